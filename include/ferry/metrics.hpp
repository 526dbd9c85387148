// Engine-owned Prometheus metrics: hand ferry the engine's own registry, and
// ferry's families (every one prefixed `ferry_`, docs/OPERATING.md lists them)
// are added to it beside the engine's. A separate header so that
// ferry/runtime.hpp needs no prometheus-cpp. The one public header that includes a
// third-party library's (prometheus-cpp's core); CMake's ferry::metrics target
// links it.
#pragma once

#include <prometheus/registry.h>

#include <memory>
#include <vector>

#include "ferry/export.hpp"
#include "ferry/runtime.hpp"

namespace ferry::runtime {

// From now on `runtime` records its metrics into `registry` (instead of a registry
// of its own, which it makes only when metrics.listen or metrics.textfile is set).
// With metrics.listen set, the endpoint serves `registry` too. Call it before a
// load starts; a null registry is ignored. Thread-safe.
FERRY_API void use_registry(Runtime& runtime, std::shared_ptr<prometheus::Registry> registry);

// The ports the metrics.listen endpoint serves on (port 0 in the config picks a
// free one); empty when it is off or could not be opened.
FERRY_API std::vector<int> metrics_ports(const Runtime& runtime);

}  // namespace ferry::runtime
