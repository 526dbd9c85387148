// `ferry plan`: where every checkpoint tensor would go under a parallel layout —
// placed (on which tp ranks, into which params), dropped (why) or unmapped — and
// how many tensor bytes a load would read and skip, from the headers and
// config.json alone: no tensor data is read and no device is made. The JSON form
// (--json) is documented in docs/plan-json.md.
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "common/log.hpp"
#include "runtime/load_config.hpp"
#include "runtime/plan_report.hpp"
#include "tools/commands.hpp"

namespace ferry::tools {
namespace {

constexpr const char kUsage[] =
    "usage: ferry plan --model DIR [--config FILE] [--set key=value]... [--tp N] [--ep N]\n"
    "                  [--pp N] [--pp-rank R] [--ranks LIST] [--draft] [--json]\n"
    "  Routes every tensor of the checkpoint in DIR as `ferry load` with the same flags\n"
    "  would, without reading tensor data or touching a device, and prints each tensor's\n"
    "  route (placed / dropped / unmapped), its reason and targets, and the bytes a load\n"
    "  would read and skip.\n"
    "  --json    print exactly one JSON document (docs/plan-json.md); warnings go to stderr\n";

constexpr const char* kSwitches[] = {"--json"};

}  // namespace

int cmd_plan(const Args& args) {
  std::optional<ParsedArgs> parsed = parse_config_args(args, "plan", {}, kSwitches, kUsage);
  if (!parsed) {
    return 2;
  }
  if (parsed->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::optional<runtime::LoadConfig> config = config_from_args(*parsed, "plan", kUsage);
  if (!config) {
    return 2;
  }
  const bool json = !parsed->switches.empty();
  runtime::PlanReport report;
  try {
    report = runtime::make_plan_report(*config);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry plan: %s: error: %s\n", config->model.path.c_str(), e.what());
    return 1;
  }
  if (json) {
    for (const std::string& w : report.warnings) {
      log::warn(w);
    }
    std::fputs((report.to_json().dump(2) + "\n").c_str(), stdout);
  } else {
    std::fputs(report.summary().c_str(), stdout);
  }
  return 0;
}

}  // namespace ferry::tools
