#include "gpu/cuda/cuda_check.hpp"

#include "common/error.hpp"

namespace ferry::gpu::cuda {

std::string describe(cudaError_t err, std::string_view call, std::string_view context) {
  std::string_view name = call.substr(0, call.find('('));
  while (!name.empty() && name.back() == ' ') {
    name.remove_suffix(1);
  }
  std::string out(name);
  out += ": ";
  out += cudaGetErrorString(err);
  out += " (";
  out += cudaGetErrorName(err);
  out += ", code " + std::to_string(static_cast<int>(err)) + ")";
  if (!context.empty()) {
    out += ": ";
    out += context;
  }
  return out;
}

void check(cudaError_t err, std::string_view call, const std::string& device,
           std::string_view context) {
  if (err == cudaSuccess) {
    return;
  }
  (void)cudaGetLastError();
  throw Error(Stage::kCopy, device, "", describe(err, call, context));
}

}  // namespace ferry::gpu::cuda
