// The embedding API (include/ferry/runtime.hpp, ferry/config.hpp) as ferry's own
// code sees it, with what the library adds inside: the internal configuration
// (LoadConfig, ConfigBuilder), the public Config made from it, and the report's
// JSON object. The Runtime's test seams are in runtime/test_seams.hpp.
#pragma once

#include <nlohmann/json.hpp>

#include "ferry/runtime.hpp"
#include "runtime/load_config.hpp"

namespace ferry::runtime {

// The public Config holding exactly `config` (later layers apply over it): how
// ferry's own code (the CLI, the tests) makes a Runtime from its internal form.
Config to_config(const LoadConfig& config);

// The load report as JSON (LoadReport::json() is its text).
nlohmann::json to_json(const LoadReport& report);

}  // namespace ferry::runtime
