// A Device decorator that tells an observer (runtime metrics) about every
// host-to-device copy its streams make: bytes and the time the call took. On the
// host backend the call is the copy; on CUDA it is the enqueue (and, for pageable
// memory, the staging the driver does before returning). Everything else forwards
// to the inner device unchanged.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "gpu/device.hpp"

namespace ferry::gpu {

struct CopyObserver {
  // Per copy_h2d / copy_h2d_2d call: the device's name, bytes written, seconds.
  std::function<void(const std::string& device, std::size_t bytes, double seconds)> on_copy;
};

// `inner` must not be null.
std::shared_ptr<Device> metered_device(std::shared_ptr<Device> inner, CopyObserver observer);

}  // namespace ferry::gpu
