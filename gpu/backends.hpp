// Which device backends this build of ferry carries, what the CUDA runtime sees at
// run time, and the factory that turns a device spec ("host:4", "cuda:0,2") into
// devices.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/device.hpp"
#include "gpu/host_device.hpp"

namespace ferry::gpu {

// True when ferry was built with the CUDA backend (FERRY_CUDA on and a toolkit found).
bool cuda_compiled();

// Number of CUDA devices usable now; 0 without the backend, a driver or a GPU.
// `why` (optional) receives the reason when the answer is 0.
int cuda_device_count(std::string* why = nullptr);

// CUDA device `index`'s compute capability as major * 10 + minor (90 for an H100 or
// H200), or -1 when it cannot be asked (no backend, no driver, no such device).
int cuda_compute_capability(int index);

// CUDA device `index`, named "cuda:<index>". Throws ferry::Error (Stage::kConfig)
// when the backend is not compiled in, no GPU is usable (with the runtime's reason)
// or the index is out of range.
std::shared_ptr<Device> make_cuda_device(int index);

// Parses a device spec and makes the devices it names, in order:
//   host:N        N emulated host devices host:0 .. host:N-1 (N >= 1), with `host_options`
//   host          the same as host:1
//   null:N        N null devices null:0 .. null:N-1 (gpu/null_device.hpp): checked,
//                 counted, nothing kept
//   null          the same as null:1
//   cuda:I,J,...  those CUDA devices (distinct indices)
//   cuda          every CUDA device the runtime sees
// A bad spec throws ferry::Error (Stage::kConfig) quoting the spec; a cuda spec on a
// build without the backend names the build option; one with no usable GPU gives
// the runtime's reason.
std::vector<std::shared_ptr<Device>> make_devices(std::string_view spec,
                                                  const HostDeviceOptions& host_options = {});

}  // namespace ferry::gpu
