// The embedding API is the public header include/ferry/runtime.hpp; ferry's own
// code includes it by this name, with what the library adds inside: the internal
// configuration (LoadConfig, ConfigBuilder) and the report's JSON object.
#pragma once

#include <nlohmann/json.hpp>

#include "ferry/runtime.hpp"
#include "runtime/load_config.hpp"

namespace ferry::runtime {

// The load report as JSON (LoadReport::json() is its text).
nlohmann::json to_json(const LoadReport& report);

}  // namespace ferry::runtime
