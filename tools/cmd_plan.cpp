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
#include "tools/cli.hpp"
#include "tools/commands.hpp"

namespace ferry::tools {
namespace {

constexpr const char kDescription[] =
    "Routes every tensor of the checkpoint in DIR as `ferry load` with the same flags would,\n"
    "without reading tensor data or touching a device, and prints each tensor's route\n"
    "(placed / dropped / unmapped), its reason and targets, and the bytes a load would read\n"
    "and skip.";

}  // namespace

int cmd_plan(const Args& args) {
  CLI::App app(kDescription, "ferry plan");
  ConfigArgs config_args;
  add_config_options(app, config_args, {});
  bool json = false;
  add_switch(app, "--json", json,
             "print exactly one JSON document (docs/plan-json.md); warnings go to stderr");
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  std::optional<runtime::LoadConfig> config = config_from_args(config_args, "plan");
  if (!config) {
    return 2;
  }
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
