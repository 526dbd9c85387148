// ferry: the command line. Dispatches to a verb, which parses the rest of the words
// with CLI11 (tools/cli.hpp); `ferry --help` is generated from the same verb table.
// Nothing throws past here.
#include <malloc.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <string_view>

#include "tools/cli.hpp"
#include "tools/commands.hpp"

namespace {

struct Verb {
  const char* name;
  const char* summary;
  int (*run)(const ferry::tools::Args&);
};

constexpr Verb kVerbs[] = {
    {"demo", "synthesize the embedded default checkpoint (once) and load it",
     ferry::tools::cmd_demo},
    {"synth", "write a synthetic checkpoint", ferry::tools::cmd_synth},
    {"inspect", "list and validate a checkpoint's weight files and tensors",
     ferry::tools::cmd_inspect},
    {"load", "load a checkpoint onto devices and report", ferry::tools::cmd_load},
    {"serve", "hold a model and share it with every engine process (the weight cache)",
     ferry::tools::cmd_serve},
    {"plan", "show where every tensor would go, reading no tensor data", ferry::tools::cmd_plan},
    {"save", "load a checkpoint and save every rank's params as loaded (presharded, sharded_state)",
     ferry::tools::cmd_save},
    {"bench", "run an experiment: configurations and peers, rounds, table and chart",
     ferry::tools::cmd_bench},
    {"selftest", "compare every device operation with the host backend, byte for byte",
     ferry::tools::cmd_selftest},
    {"config", "list the configuration keys, or show the effective configuration and its sources",
     ferry::tools::cmd_config},
};

// `ferry` without a known verb: its help, or a usage error (exit 2).
int top_level(const ferry::tools::Args& args) {
  CLI::App app(
      "ferry moves a model checkpoint from disk into sharded, kernel-ready parameters.\n"
      "Every command has --help.",
      "ferry");
  app.require_subcommand(1);
  for (const Verb& verb : kVerbs) {
    app.add_subcommand(verb.name, verb.summary);
  }
  if (!args.empty() && !args[0].empty() && args[0][0] != '-') {
    std::cerr << "ferry: unknown command '" << args[0] << "'\n\n" << app.help() << std::flush;
    return 2;
  }
  std::optional<int> status = ferry::tools::parse_verb(app, args);
  return status ? *status : 2;  // a verb would have been dispatched before
}

// Under a finite address-space limit (ulimit -v, RLIMIT_AS), one malloc arena,
// unless the user chose (MALLOC_ARENA_MAX, GLIBC_TUNABLES). glibc gives threads
// arenas of their own, each reserving 64 MiB of address space at once. Under the
// limit those reservations, not ferry's thread stacks and buffers, took the last
// of it, and the small allocations glibc and CAF make where nothing can report a
// failure (a thread-local's destructor registration, a mailbox element) then
// aborted the process (docs/OPERATING.md, "Address-space limits"). With one arena
// the limit falls on ferry's own starts and allocations, which end in an error.
void one_malloc_arena_under_an_address_limit() {
  rlimit as{};
  if (::getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) {
    return;
  }
  const char* arena_max = std::getenv("MALLOC_ARENA_MAX");  // NOLINT(concurrency-mt-unsafe)
  const char* tunables = std::getenv("GLIBC_TUNABLES");     // NOLINT(concurrency-mt-unsafe)
  if (arena_max != nullptr || (tunables != nullptr && std::string_view(tunables).find(
                                                          "arena_max") != std::string_view::npos)) {
    return;
  }
  ::mallopt(M_ARENA_MAX, 1);
}

}  // namespace

int main(int argc, char** argv) {
  one_malloc_arena_under_an_address_limit();  // before any thread allocates
  ferry::tools::Args args(argv + 1, argv + argc);
  for (const Verb& verb : kVerbs) {
    if (argc >= 2 && std::string_view(argv[1]) == verb.name) {
      try {
        return verb.run(ferry::tools::Args(argv + 2, argv + argc));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ferry %s: error: %s\n", verb.name, e.what());
        return 1;
      }
    }
  }
  if (argc >= 2 && std::string_view(argv[1]) == "help") {
    args[0] = "--help";
  }
  return top_level(args);
}
