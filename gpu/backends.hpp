// Which device backends this build of ferry carries, and what the CUDA runtime
// sees at run time. The Device interface itself arrives with the load pipeline.
#pragma once

#include <string>

namespace ferry::gpu {

// True when ferry was built with the CUDA backend (FERRY_CUDA on and a toolkit found).
bool cuda_compiled();

// Number of CUDA devices usable now; 0 without the backend, a driver or a GPU.
// `why` (optional) receives the reason when the answer is 0.
int cuda_device_count(std::string* why = nullptr);

}  // namespace ferry::gpu
