// The CUDA kernel behind Stream::dequantize_ggml_2d, and its host-run emulation.
// Host twin: host::dequantize_ggml_2d (gpu/kernels_host.cpp); the bytes must match.
//
// Each element is common/ggml_blocks.hpp's ggml_block_element, the very function the
// host twin and io::dequantize call. Its multiplies and adds are separate roundings
// on the host, so this file is compiled with --fmad=false (gpu/CMakeLists.txt): nvcc
// would otherwise contract d * q + m into one fused multiply-add and round once,
// which differs in the last bit. A NaN element is made the positive canonical NaN
// before narrowing, as on the host: the GPU's NaNs from arithmetic carry no sign
// the CPU's would.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/ggml_blocks.hpp"
#include "gpu/cuda/cuda_elements.cuh"
#include "gpu/cuda/cuda_kernels.hpp"
#include "gpu/cuda/kernels_emulated.hpp"

namespace ferry::gpu::cuda {
namespace {

// Where a row's blocks are: every GGML block holds a power of two of elements (32
// or 256), so an element's block and place in it are a shift and a mask.
struct BlockGeometry {
  GgmlBlocks blocks;
  unsigned bytes;       // bytes a block
  unsigned elems_log2;  // log2(elements a block)
};

// Element i of a row: what every thread of dequantize_ggml_kernel does, and what
// the emulation loops over.
template <Kind D, bool kAligned>
__host__ __device__ inline void dequantize_ggml_one(unsigned char* dst_row,
                                                    const unsigned char* src_row,
                                                    const BlockGeometry& g, std::size_t i) {
  const unsigned char* block = src_row + (i >> g.elems_log2) * g.bytes;
  const auto e = static_cast<unsigned>(i & ((std::size_t{1} << g.elems_log2) - 1));
  std::uint32_t f = float_bits(ggml_block_element(g.blocks, block, e));
  if (f32_is_nan(f)) {
    f = kF32CanonicalNaN;
  }
  store<typename Storage<D>::Type, kAligned>(dst_row, i, narrow<D>(f));
}

// A thread an output element: blocks stride over rows in y and over a row's
// elements in x, as the cast kernel does. The threads of a warp read the same
// block's scales (one transaction) and neighbouring quant bytes.
template <Kind D, bool kAligned>
__global__ void dequantize_ggml_kernel(unsigned char* dst, std::size_t dst_pitch,
                                       const unsigned char* src, std::size_t src_pitch,
                                       BlockGeometry g, std::size_t width, std::size_t rows) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < width;
         i += stride) {
      dequantize_ggml_one<D, kAligned>(dst + r * dst_pitch, src + r * src_pitch, g, i);
    }
  }
}

struct DequantizeGgmlArgs {
  unsigned char* dst;
  std::size_t dst_pitch;
  const unsigned char* src;
  std::size_t src_pitch;
  BlockGeometry g;
  std::size_t width;
  std::size_t rows;
  Kind dst_kind;
  bool aligned;  // the destination and its pitch are multiples of the element size
};

// false for kNone (or a block of elements not a power of two: none in GGML).
bool dequantize_ggml_args(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                          const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                          std::size_t width, std::size_t rows, DequantizeGgmlArgs& a) {
  const GgmlBlockShape shape = ggml_block_shape(blocks);
  unsigned log2 = 0;
  while ((1u << log2) < shape.elems) {
    ++log2;
  }
  if (shape.bytes == 0 || (1u << log2) != shape.elems) {
    return false;
  }
  a = {reinterpret_cast<unsigned char*>(dst),
       dst_pitch,
       reinterpret_cast<const unsigned char*>(src),
       src_pitch,
       {blocks, shape.bytes, log2},
       width,
       rows,
       kind_of(dst_dtype),
       false};
  const std::size_t es = kind_size(a.dst_kind);
  a.aligned = divides(es, reinterpret_cast<std::uintptr_t>(dst)) && divides(es, dst_pitch);
  return true;
}

struct LaunchDequantizeGgml {
  DequantizeGgmlArgs a;
  cudaStream_t stream;
  template <Kind D, bool kAligned>
  cudaError_t run() {
    dequantize_ggml_kernel<D, kAligned><<<grid_2d(a.width, a.rows), kThreads, 0, stream>>>(
        a.dst, a.dst_pitch, a.src, a.src_pitch, a.g, a.width, a.rows);
    return cudaGetLastError();
  }
};

struct EmulateDequantizeGgml {
  DequantizeGgmlArgs a;
  template <Kind D, bool kAligned>
  cudaError_t run() {
    for (std::size_t r = 0; r < a.rows; ++r) {
      for (std::size_t i = 0; i < a.width; ++i) {
        dequantize_ggml_one<D, kAligned>(a.dst + r * a.dst_pitch, a.src + r * a.src_pitch, a.g, i);
      }
    }
    return cudaSuccess;
  }
};

}  // namespace

cudaError_t launch_dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                                      const std::byte* src, std::size_t src_pitch,
                                      GgmlBlocks blocks, std::size_t width, std::size_t rows,
                                      cudaStream_t stream) {
  DequantizeGgmlArgs a{};
  if (!dequantize_ggml_args(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width, rows, a)) {
    return cudaErrorInvalidValue;
  }
  if (width == 0 || rows == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  LaunchDequantizeGgml op{a, stream};
  return with_kind(a.dst_kind, a.aligned, op);
}

void dequantize_ggml_2d_emulated(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                                 const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                                 std::size_t width, std::size_t rows) {
  DequantizeGgmlArgs a{};
  if (dequantize_ggml_args(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width, rows, a)) {
    EmulateDequantizeGgml op{a};
    with_kind(a.dst_kind, a.aligned, op);
  }
}

}  // namespace ferry::gpu::cuda
