// The one check every CUDA runtime call goes through: a failure becomes a
// ferry::Error (Stage::kCopy) that names the device, the failing call and the
// runtime's own words, e.g.
//   "copy: cuda:0: cudaMemcpyAsync: invalid argument (cudaErrorInvalidValue, code 1)".
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

namespace ferry::gpu::cuda {

// "<call>: <cudaGetErrorString> (<cudaGetErrorName>, code N)[: <context>]".
// `call` may be a whole expression; only the function name before '(' is kept.
std::string describe(cudaError_t err, std::string_view call, std::string_view context = {});

// Throws ferry::Error(Stage::kCopy, device, "", describe(...)) unless err is
// cudaSuccess. Clears the runtime's last-error slot first so that a later
// cudaGetLastError() does not report this failure a second time.
void check(cudaError_t err, std::string_view call, const std::string& device,
           std::string_view context = {});

}  // namespace ferry::gpu::cuda

// FERRY_CUDA_CHECK(device_name, cudaMalloc(&p, n)): the call's text names it.
#define FERRY_CUDA_CHECK(device, call) ::ferry::gpu::cuda::check((call), #call, (device))
