// A Device decorator that tells an observer (runtime metrics and trace) about every
// stream operation that writes device memory: host-to-device copies, casts (GGML
// dequantization among them), fills and zero fills, with bytes and when the call
// began and returned. On the host backend the call is the work; on CUDA it is the
// enqueue (and, for pageable memory, the staging the driver does before returning).
// Everything else forwards to the inner device unchanged.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "gpu/device.hpp"

namespace ferry::gpu {

struct DeviceOp {
  const std::string* device = nullptr;  // the device's name
  // "copy" (copy_h2d, copy_h2d_2d), "cast" (cast, cast_2d, dequantize_ggml_2d), "fill"
  // (fill, fill_random), "zero" (zero, zero_2d), "gather" (copy_d2d_2d); transposes and
  // reads back are not reported.
  std::string_view op;
  std::size_t bytes = 0;  // bytes written to the device
  std::chrono::steady_clock::time_point begin, end;
  double seconds() const { return std::chrono::duration<double>(end - begin).count(); }
};

struct CopyObserver {
  std::function<void(const DeviceOp& op)> on_op;  // after each call returned
};

// `inner` must not be null.
std::shared_ptr<Device> metered_device(std::shared_ptr<Device> inner, CopyObserver observer);

}  // namespace ferry::gpu
