// Everything of ferry's embedding API but ferry/metrics.hpp (which needs
// prometheus-cpp): include this, link ferry::ferry (CMake) or `pkg-config ferry`.
#pragma once

#include "ferry/cache.hpp"
#include "ferry/config.hpp"
#include "ferry/dlpack.hpp"
#include "ferry/dtype.hpp"
#include "ferry/error.hpp"
#include "ferry/log.hpp"
#include "ferry/runtime.hpp"
#include "ferry/version.hpp"
