#include "gpu/backends.hpp"

namespace ferry::gpu {

#if FERRY_HAVE_CUDA
namespace cuda {
int device_count(std::string* why);  // gpu/cuda/cuda_probe.cu
}
bool cuda_compiled() { return true; }
int cuda_device_count(std::string* why) { return cuda::device_count(why); }
#else
bool cuda_compiled() { return false; }
int cuda_device_count(std::string* why) {
  if (why != nullptr) {
    *why = "ferry was built without the CUDA backend (FERRY_CUDA=OFF or no toolkit)";
  }
  return 0;
}
#endif

}  // namespace ferry::gpu
