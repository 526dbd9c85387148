// Asks the CUDA runtime how many devices it sees. With no driver (as on the build
// machines) every runtime call fails with cudaErrorInsufficientDriver; any error
// means "no usable GPU" and the reason is reported.
#include <cuda_runtime_api.h>

#include <string>

namespace ferry::gpu::cuda {

int device_count(std::string* why) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) {
      *why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + " (" +
             cudaGetErrorString(err) + ")";
    }
    return 0;
  }
  if (count == 0 && why != nullptr) {
    *why = "the CUDA runtime reports no devices";
  }
  return count;
}

int compute_capability(int index) {
  int major = 0;
  int minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index) != cudaSuccess) {
    return -1;
  }
  return major * 10 + minor;
}

}  // namespace ferry::gpu::cuda
