// The null backend: devices that keep no bytes, for planning and reading a model of
// any size on any machine (`--devices null:N`). An allocation hands out an address
// range that no memory backs and that nothing may dereference; every stream
// operation checks its device ranges against the live allocations, as the host
// backend does (so an out-of-bounds piece fails loudly), counts the bytes it was
// given and discards them. Reading back (copy_d2h) is an error: there is nothing to
// read. Pinned host memory is real (staging buffers live in it); registrations
// are accepted and pin nothing. holds_data() is false, which tells the runtime to
// skip post-load hooks (after checking their params) and to refuse dumps.
#pragma once

#include <cstdint>
#include <memory>

#include "gpu/device.hpp"

namespace ferry::gpu {

// Device "null:<index>".
std::shared_ptr<Device> make_null_device(int index);

// Bytes the null device `device` was given by host-to-device copies, fills, zeros
// and casts since it was made (what a real device would have written). Throws
// ferry::Error(Stage::kConfig) when `device` is not a null device.
std::uint64_t null_device_bytes_written(const Device& device);

}  // namespace ferry::gpu
