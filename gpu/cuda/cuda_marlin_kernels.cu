// The CUDA kernels behind Stream::repack_marlin_fp4 and marlin_fp4_scales, and their
// host-run emulation: a thread an output word or byte over gpu/marlin.hpp's element
// functions, which the host twins (gpu/kernels_host.cpp) loop over too.
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/cuda/cuda_elements.cuh"
#include "gpu/cuda/cuda_kernels.hpp"
#include "gpu/cuda/kernels_emulated.hpp"
#include "gpu/marlin.hpp"

namespace ferry::gpu::cuda {
namespace {

// Word w, stored a byte at a time (the destination need not be 4-byte aligned),
// little-endian as the host stores it.
__host__ __device__ inline void repack_elem(unsigned char* dst, const unsigned char* src,
                                            std::size_t n, std::size_t k, std::size_t w) {
  const std::uint32_t word = marlin::repack_word(src, n, k, w);
  for (unsigned b = 0; b < 4; ++b) {
    dst[4 * w + b] = static_cast<unsigned char>((word >> (8 * b)) & 0xFFu);
  }
}

__global__ void repack_marlin_fp4_kernel(unsigned char* dst, const unsigned char* src,
                                         std::size_t n, std::size_t k, std::size_t words) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t w = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
       w += stride) {
    repack_elem(dst, src, n, k, w);
  }
}

__global__ void marlin_fp4_scales_kernel(unsigned char* dst, const unsigned char* src,
                                         std::size_t n, std::size_t groups, std::size_t count) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t f = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; f < count;
       f += stride) {
    dst[f] = marlin::scale_byte(src, n, groups, f);
  }
}

}  // namespace

cudaError_t launch_repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                                     std::size_t k, cudaStream_t stream) {
  const std::size_t words = n * k / 8;
  if (words == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  repack_marlin_fp4_kernel<<<grid_for(words), kThreads, 0, stream>>>(
      reinterpret_cast<unsigned char*>(dst), reinterpret_cast<const unsigned char*>(src), n, k,
      words);
  return cudaGetLastError();
}

cudaError_t launch_marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                                     std::size_t groups, cudaStream_t stream) {
  const std::size_t count = n * groups;
  if (count == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  marlin_fp4_scales_kernel<<<grid_for(count), kThreads, 0, stream>>>(
      reinterpret_cast<unsigned char*>(dst), reinterpret_cast<const unsigned char*>(src), n,
      groups, count);
  return cudaGetLastError();
}

void repack_marlin_fp4_emulated(std::byte* dst, const std::byte* src, std::size_t n,
                                std::size_t k) {
  for (std::size_t w = 0; w < n * k / 8; ++w) {
    repack_elem(reinterpret_cast<unsigned char*>(dst), reinterpret_cast<const unsigned char*>(src),
                n, k, w);
  }
}

void marlin_fp4_scales_emulated(std::byte* dst, const std::byte* src, std::size_t n,
                                std::size_t groups) {
  for (std::size_t f = 0; f < n * groups; ++f) {
    dst[f] = static_cast<std::byte>(
        marlin::scale_byte(reinterpret_cast<const unsigned char*>(src), n, groups, f));
  }
}

}  // namespace ferry::gpu::cuda
