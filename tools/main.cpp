// ferry: the command line. Dispatches to a verb; nothing throws past here.
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>

#include "tools/commands.hpp"

namespace {

constexpr const char kUsage[] =
    "usage: ferry <command> [options]\n"
    "\n"
    "commands:\n"
    "  demo      synthesize the embedded default checkpoint (once) and inspect it\n"
    "  synth     write a synthetic checkpoint (ferry synth --help)\n"
    "  inspect   list and validate a checkpoint's weight files and tensors\n"
    "  load      load a checkpoint onto devices and report (ferry load --help)\n"
    "  plan      show where every tensor would go, reading no tensor data (ferry plan --help)\n"
    "  selftest  compare every device operation with the host backend, byte for byte\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  std::string_view verb = argv[1];
  ferry::tools::Args args(argv + 2, argv + argc);
  try {
    if (verb == "demo") return ferry::tools::cmd_demo(args);
    if (verb == "synth") return ferry::tools::cmd_synth(args);
    if (verb == "inspect") return ferry::tools::cmd_inspect(args);
    if (verb == "load") return ferry::tools::cmd_load(args);
    if (verb == "plan") return ferry::tools::cmd_plan(args);
    if (verb == "selftest") return ferry::tools::cmd_selftest(args);
    if (verb == "-h" || verb == "--help" || verb == "help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry %s: error: %s\n", argv[1], e.what());
    return 1;
  }
  std::fprintf(stderr, "ferry: unknown command '%s'\n\n%s", argv[1], kUsage);
  return 2;
}
