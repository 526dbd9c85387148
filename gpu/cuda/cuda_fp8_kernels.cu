// The CUDA kernels behind Stream::dequantize_fp8, quantize_fp8 and pack_ue8m0, and
// their host-run emulation (the element primitives: cuda_elements.cuh). Host twins:
// gpu/kernels_host.cpp; the bytes must match them exactly.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "gpu/cuda/cuda_elements.cuh"
#include "gpu/cuda/cuda_kernels.hpp"
#include "gpu/cuda/kernels_emulated.hpp"
#include "gpu/fp8.hpp"

namespace ferry::gpu::cuda {

// The element arithmetic is gpu/fp8.hpp's, shared with the host twins. The
// reductions (a group's amax) fold with fp8::amax_fold, which is a maximum over
// the non-NaN |x|: the order threads combine in does not change the result.
namespace {

template <Kind S, bool kAligned>
__host__ __device__ inline float load_value(const unsigned char* src, std::size_t i) {
  return fp8::from_bits(widen<S>(load<typename Storage<S>::Type, kAligned>(src, i)));
}

// Element (b, r, c) of a dequantization.
template <Kind D, bool kAligned>
__host__ __device__ inline void dequantize_elem(unsigned char* dst, const unsigned char* src,
                                                const unsigned char* scale, const Fp8Scales& l,
                                                std::size_t per_matrix, std::size_t rows,
                                                std::size_t cols, std::size_t row,
                                                std::size_t c) {
  const std::size_t b = row / rows;
  const std::size_t r = row % rows;
  const float sc = fp8::load_f32(scale, b * per_matrix + fp8::scale_index(l, r, c, cols));
  const std::size_t i = row * cols + c;
  using Out = typename Storage<D>::Type;
  store<Out, kAligned>(dst, i, narrow<D>(fp8::dequantize_one(src[i], sc)));
}

// Rows of all matrices in y (b * rows + r), columns in x.
template <Kind D, bool kAligned>
__global__ void dequantize_kernel(unsigned char* dst, const unsigned char* src,
                                  const unsigned char* scale, Fp8Scales l, std::size_t per_matrix,
                                  std::size_t rows, std::size_t cols, std::size_t all_rows) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t row = blockIdx.y; row < all_rows; row += gridDim.y) {
    for (std::size_t c = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
         c += stride) {
      dequantize_elem<D, kAligned>(dst, src, scale, l, per_matrix, rows, cols, row, c);
    }
  }
}

// Where a quantization's groups are: tiles of tile_rows x tile_cols (a row, a
// block, or a whole matrix), `tiles` a matrix; group g of matrix b writes its scale
// to slots (b * tiles + g) * repeat .. + repeat - 1.
struct TileGeometry {
  std::size_t rows, cols, tile_rows, tile_cols, tiles_c, tiles, batches, repeat;
  __host__ __device__ std::size_t tile_r0(std::size_t g) const { return (g / tiles_c) * tile_rows; }
  __host__ __device__ std::size_t tile_c0(std::size_t g) const { return (g % tiles_c) * tile_cols; }
  __host__ __device__ std::size_t height(std::size_t g) const {
    const std::size_t r0 = tile_r0(g);
    return rows - r0 < tile_rows ? rows - r0 : tile_rows;
  }
  __host__ __device__ std::size_t width(std::size_t g) const {
    const std::size_t c0 = tile_c0(g);
    return cols - c0 < tile_cols ? cols - c0 : tile_cols;
  }
  // Element k (row-major inside the tile) of group g of matrix b.
  __host__ __device__ std::size_t element(std::size_t b, std::size_t g, std::size_t k) const {
    const std::size_t w = width(g);
    return (b * rows + tile_r0(g) + k / w) * cols + tile_c0(g) + k % w;
  }
};

TileGeometry tile_geometry(const Fp8Scales& l, std::size_t rows, std::size_t cols,
                           std::size_t batches) {
  TileGeometry t{rows, cols, rows, cols, 1, 1, batches, 1};
  if (l.granularity == Fp8Granularity::kRow) {
    t.tile_rows = 1;
  } else if (l.granularity == Fp8Granularity::kBlock) {
    t.tile_rows = l.block_rows;
    t.tile_cols = l.block_cols;
  } else {
    t.repeat = l.tensor_repeat;
  }
  t.tiles_c = (cols + t.tile_cols - 1) / t.tile_cols;
  t.tiles = ((rows + t.tile_rows - 1) / t.tile_rows) * t.tiles_c;
  return t;
}

__host__ __device__ inline void store_scale(unsigned char* scale, std::size_t slot, float v) {
  memcpy(scale + slot * sizeof(float), &v, sizeof v);
}

// kStatic: the largest of a group's `repeat` scale slots from `first` on.
__host__ __device__ inline float static_scale(const unsigned char* scale, std::size_t first,
                                              std::size_t repeat) {
  float s = fp8::load_f32(scale, first);
  for (std::size_t k = 1; k < repeat; ++k) {
    const float v = fp8::load_f32(scale, first + k);
    s = v > s ? v : s;
  }
  return s;
}

// Folds every thread's `amax` into partial[0], a tree over the block's threads;
// every thread of the block calls it, and all may read partial[0] after it.
__device__ inline void block_amax(float* partial, float amax) {
  partial[threadIdx.x] = amax;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      partial[threadIdx.x] = fp8::amax_fold(partial[threadIdx.x], partial[threadIdx.x + half]);
    }
    __syncthreads();
  }
}

// One block a group: its amax folded through shared memory, then its elements
// encoded and its scale written. Loop bounds depend on block indices only, so
// every thread reaches each barrier.
template <Kind S, bool kAligned>
__global__ void quantize_tiles_kernel(unsigned char* dst, unsigned char* scale,
                                      const unsigned char* src, TileGeometry t,
                                      Fp8ScaleRule rule) {
  __shared__ float partial[kThreads];
  const std::size_t groups = t.tiles * t.batches;
  for (std::size_t id = blockIdx.x; id < groups; id += gridDim.x) {
    const std::size_t b = id / t.tiles;
    const std::size_t g = id % t.tiles;
    const std::size_t n = t.height(g) * t.width(g);
    float amax = 0.0f;
    if (rule != Fp8ScaleRule::kStatic) {
      for (std::size_t k = threadIdx.x; k < n; k += blockDim.x) {
        amax = fp8::amax_fold(amax, load_value<S, kAligned>(src, t.element(b, g, k)));
      }
    }
    block_amax(partial, amax);
    const float group = rule == Fp8ScaleRule::kStatic ? static_scale(scale, id * t.repeat, t.repeat)
                                                      : partial[0];
    const fp8::ScaleMul sm = fp8::scale_for(group, rule);
    __syncthreads();  // every thread has read the static scale before any writes it
    for (std::size_t k = threadIdx.x; k < n; k += blockDim.x) {
      const std::size_t i = t.element(b, g, k);
      dst[i] = fp8::quantize_one(load_value<S, kAligned>(src, i), sm.mul);
    }
    for (std::size_t k = threadIdx.x; k < t.repeat; k += blockDim.x) {
      store_scale(scale, id * t.repeat + k, sm.scale);
    }
    __syncthreads();  // before `partial` is reused
  }
}

// Per tensor with 4-byte aligned scales: many blocks a matrix, each folding its
// part and merging it into the matrix's first scale slot with atomicMax on the F32
// bits (non-negative floats order as their bits), zeroed before.
template <Kind S, bool kAligned>
__global__ void tensor_amax_kernel(unsigned int* acc, std::size_t repeat, const unsigned char* src,
                                   std::size_t count, std::size_t batches) {
  __shared__ float partial[kThreads];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t b = blockIdx.y; b < batches; b += gridDim.y) {
    float amax = 0.0f;
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < count; i += stride) {
      amax = fp8::amax_fold(amax, load_value<S, kAligned>(src, b * count + i));
    }
    block_amax(partial, amax);
    if (threadIdx.x == 0 && partial[0] > 0.0f) {
      atomicMax(acc + b * repeat, fp8::to_bits(partial[0]));
    }
    __syncthreads();
  }
}

// kStatic per tensor: each matrix's largest slot into its first (the accumulator).
__global__ void tensor_static_kernel(unsigned int* acc, std::size_t repeat, std::size_t batches) {
  for (std::size_t b = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       b < batches; b += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    acc[b * repeat] = fp8::to_bits(
        static_scale(reinterpret_cast<const unsigned char*>(acc), b * repeat, repeat));
  }
}

// Element i of matrix b, per tensor: the multiplier from the finished amax.
template <Kind S, bool kAligned>
__host__ __device__ inline void tensor_quantize_elem(unsigned char* dst, const unsigned int* acc,
                                                     std::size_t repeat, const unsigned char* src,
                                                     std::size_t count, std::size_t b,
                                                     std::size_t i, Fp8ScaleRule rule) {
  const float mul = fp8::scale_for(fp8::from_bits(acc[b * repeat]), rule).mul;
  const std::size_t at = b * count + i;
  dst[at] = fp8::quantize_one(load_value<S, kAligned>(src, at), mul);
}

template <Kind S, bool kAligned>
__global__ void tensor_quantize_kernel(unsigned char* dst, const unsigned int* acc,
                                       std::size_t repeat, const unsigned char* src,
                                       std::size_t count, std::size_t batches, Fp8ScaleRule rule) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t b = blockIdx.y; b < batches; b += gridDim.y) {
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < count; i += stride) {
      tensor_quantize_elem<S, kAligned>(dst, acc, repeat, src, count, b, i, rule);
    }
  }
}

// The amax in each matrix's first slot becomes its scale, in all `repeat` slots.
__global__ void tensor_scale_kernel(unsigned int* acc, std::size_t repeat, std::size_t batches,
                                    Fp8ScaleRule rule) {
  __shared__ unsigned int bits;
  for (std::size_t b = blockIdx.x; b < batches; b += gridDim.x) {
    if (threadIdx.x == 0) {
      bits = fp8::to_bits(fp8::scale_for(fp8::from_bits(acc[b * repeat]), rule).scale);
    }
    __syncthreads();
    for (std::size_t k = threadIdx.x; k < repeat; k += blockDim.x) {
      acc[b * repeat + k] = bits;
    }
    __syncthreads();
  }
}

// Word (w, r) of matrix b of a packed UE8M0 copy; `row` is b * words + w.
template <bool kAligned>
__host__ __device__ inline void pack_elem(unsigned char* dst, const unsigned char* scale,
                                          std::size_t rows, std::size_t block_rows,
                                          std::size_t scale_cols, std::size_t words,
                                          std::size_t per_matrix, std::size_t row, std::size_t r) {
  const std::size_t b = row / words;
  const std::size_t w = row % words;
  store<std::uint32_t, kAligned>(
      dst, row * rows + r,
      fp8::ue8m0_word(scale + b * per_matrix * sizeof(float), r, w, block_rows, scale_cols));
}

template <bool kAligned>
__global__ void pack_ue8m0_kernel(unsigned char* dst, const unsigned char* scale, std::size_t rows,
                                  std::size_t block_rows, std::size_t scale_cols,
                                  std::size_t words, std::size_t per_matrix,
                                  std::size_t all_rows) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t row = blockIdx.y; row < all_rows; row += gridDim.y) {
    for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
         r += stride) {
      pack_elem<kAligned>(dst, scale, rows, block_rows, scale_cols, words, per_matrix, row, r);
    }
  }
}

bool aligned_to(std::size_t unit, const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % unit == 0;
}

struct DequantizeArgs {
  unsigned char* dst;
  const unsigned char* src;
  const unsigned char* scale;
  Fp8Scales l;
  std::size_t per_matrix, rows, cols, all_rows;
};

DequantizeArgs dequantize_args(std::byte* dst, const std::byte* src, const std::byte* scale,
                               const Fp8Scales& l, std::size_t rows, std::size_t cols,
                               std::size_t batches) {
  return {reinterpret_cast<unsigned char*>(dst),
          reinterpret_cast<const unsigned char*>(src),
          reinterpret_cast<const unsigned char*>(scale),
          l,
          fp8::scale_count(l, rows, cols),
          rows,
          cols,
          rows * batches};
}

struct LaunchDequantize {
  DequantizeArgs a;
  cudaStream_t stream;
  template <Kind D, bool kAligned>
  cudaError_t run() {
    dequantize_kernel<D, kAligned><<<grid_2d(a.cols, a.all_rows), kThreads, 0, stream>>>(
        a.dst, a.src, a.scale, a.l, a.per_matrix, a.rows, a.cols, a.all_rows);
    return cudaGetLastError();
  }
};

struct EmulateDequantize {
  DequantizeArgs a;
  template <Kind D, bool kAligned>
  cudaError_t run() {
    for (std::size_t row = 0; row < a.all_rows; ++row) {
      for (std::size_t c = 0; c < a.cols; ++c) {
        dequantize_elem<D, kAligned>(a.dst, a.src, a.scale, a.l, a.per_matrix, a.rows, a.cols, row,
                                     c);
      }
    }
    return cudaSuccess;
  }
};

struct QuantizeArgs {
  unsigned char* dst;
  unsigned char* scale;
  const unsigned char* src;
  TileGeometry t;
  Fp8ScaleRule rule;
  // Per tensor with aligned scales: the multi-block path with atomics.
  bool atomic_tensor;
};

QuantizeArgs quantize_args(std::byte* dst, std::byte* scale, const std::byte* src,
                           const Fp8Scales& l, Fp8ScaleRule rule, std::size_t rows,
                           std::size_t cols, std::size_t batches) {
  return {reinterpret_cast<unsigned char*>(dst), reinterpret_cast<unsigned char*>(scale),
          reinterpret_cast<const unsigned char*>(src), tile_geometry(l, rows, cols, batches), rule,
          l.granularity == Fp8Granularity::kTensor && aligned_to(sizeof(float), scale)};
}

struct LaunchQuantize {
  QuantizeArgs a;
  cudaStream_t stream;
  template <Kind S, bool kAligned>
  cudaError_t run() {
    const TileGeometry& t = a.t;
    if (!a.atomic_tensor) {
      quantize_tiles_kernel<S, kAligned>
          <<<capped(t.tiles * t.batches, kMaxBlocks), kThreads, 0, stream>>>(a.dst, a.scale, a.src,
                                                                             t, a.rule);
      return cudaGetLastError();
    }
    auto* acc = reinterpret_cast<unsigned int*>(a.scale);
    const std::size_t count = t.rows * t.cols;
    const dim3 grid = grid_2d(count, t.batches);
    if (a.rule == Fp8ScaleRule::kStatic) {
      tensor_static_kernel<<<capped(t.batches, kMaxBlocks), kThreads, 0, stream>>>(acc, t.repeat,
                                                                                  t.batches);
    } else {
      cudaError_t err = cudaMemsetAsync(a.scale, 0, t.batches * t.repeat * sizeof(float), stream);
      if (err != cudaSuccess) {
        return err;
      }
      tensor_amax_kernel<S, kAligned><<<grid, kThreads, 0, stream>>>(acc, t.repeat, a.src, count,
                                                                     t.batches);
    }
    tensor_quantize_kernel<S, kAligned>
        <<<grid, kThreads, 0, stream>>>(a.dst, acc, t.repeat, a.src, count, t.batches, a.rule);
    tensor_scale_kernel<<<capped(t.batches, kMaxBlocks), kThreads, 0, stream>>>(acc, t.repeat,
                                                                                t.batches, a.rule);
    return cudaGetLastError();
  }
};

// The kernels' steps in order, one "thread" at a time: the tile kernel's fold,
// encode and scale writes, or the tensor path's zeroed accumulator, atomic-max
// merge, encode and final scales.
struct EmulateQuantize {
  QuantizeArgs a;
  template <Kind S, bool kAligned>
  cudaError_t run() {
    const TileGeometry& t = a.t;
    if (!a.atomic_tensor) {
      for (std::size_t id = 0; id < t.tiles * t.batches; ++id) {
        const std::size_t b = id / t.tiles;
        const std::size_t g = id % t.tiles;
        const std::size_t n = t.height(g) * t.width(g);
        float amax = 0.0f;
        if (a.rule == Fp8ScaleRule::kStatic) {
          amax = static_scale(a.scale, id * t.repeat, t.repeat);
        } else {
          for (std::size_t k = 0; k < n; ++k) {
            amax = fp8::amax_fold(amax, load_value<S, kAligned>(a.src, t.element(b, g, k)));
          }
        }
        const fp8::ScaleMul sm = fp8::scale_for(amax, a.rule);
        for (std::size_t k = 0; k < n; ++k) {
          const std::size_t i = t.element(b, g, k);
          a.dst[i] = fp8::quantize_one(load_value<S, kAligned>(a.src, i), sm.mul);
        }
        for (std::size_t k = 0; k < t.repeat; ++k) {
          store_scale(a.scale, id * t.repeat + k, sm.scale);
        }
      }
      return cudaSuccess;
    }
    auto* acc = reinterpret_cast<unsigned int*>(a.scale);
    const std::size_t count = t.rows * t.cols;
    if (a.rule == Fp8ScaleRule::kStatic) {
      for (std::size_t b = 0; b < t.batches; ++b) {
        acc[b * t.repeat] = fp8::to_bits(static_scale(a.scale, b * t.repeat, t.repeat));
      }
    } else {
      memset(a.scale, 0, t.batches * t.repeat * sizeof(float));
      for (std::size_t b = 0; b < t.batches; ++b) {
        for (std::size_t i = 0; i < count; ++i) {
          const float v = fp8::amax_fold(0.0f, load_value<S, kAligned>(a.src, b * count + i));
          if (v > 0.0f && fp8::to_bits(v) > acc[b * t.repeat]) {
            acc[b * t.repeat] = fp8::to_bits(v);
          }
        }
      }
    }
    for (std::size_t b = 0; b < t.batches; ++b) {
      for (std::size_t i = 0; i < count; ++i) {
        tensor_quantize_elem<S, kAligned>(a.dst, acc, t.repeat, a.src, count, b, i, a.rule);
      }
    }
    for (std::size_t b = 0; b < t.batches; ++b) {
      const unsigned int bits =
          fp8::to_bits(fp8::scale_for(fp8::from_bits(acc[b * t.repeat]), a.rule).scale);
      for (std::size_t k = 0; k < t.repeat; ++k) {
        acc[b * t.repeat + k] = bits;
      }
    }
    return cudaSuccess;
  }
};

struct PackArgs {
  unsigned char* dst;
  const unsigned char* scale;
  std::size_t rows, block_rows, scale_cols, words, per_matrix, all_rows;
  bool aligned;
};

PackArgs pack_args(std::byte* dst, const std::byte* scale, std::size_t rows,
                   std::size_t block_rows, std::size_t scale_cols, std::size_t batches) {
  const std::size_t words = (scale_cols + 3) / 4;
  return {reinterpret_cast<unsigned char*>(dst),
          reinterpret_cast<const unsigned char*>(scale),
          rows,
          block_rows,
          scale_cols,
          words,
          ((rows + block_rows - 1) / block_rows) * scale_cols,
          words * batches,
          aligned_to(sizeof(std::uint32_t), dst)};
}

}  // namespace

cudaError_t launch_dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src,
                                  const std::byte* scale, const Fp8Scales& scales,
                                  std::size_t rows, std::size_t cols, std::size_t batches,
                                  cudaStream_t stream) {
  if (rows == 0 || cols == 0 || batches == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  LaunchDequantize op{dequantize_args(dst, src, scale, scales, rows, cols, batches), stream};
  const Kind d = kind_of(dst_dtype);
  return with_kind(d, aligned_to(kind_size(d), dst), op);
}

cudaError_t launch_quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src,
                                DType src_dtype, const Fp8Scales& scales, Fp8ScaleRule rule,
                                std::size_t rows, std::size_t cols, std::size_t batches,
                                cudaStream_t stream) {
  if (rows == 0 || cols == 0 || batches == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  LaunchQuantize op{quantize_args(dst, scale, src, scales, rule, rows, cols, batches), stream};
  const Kind s = kind_of(src_dtype);
  return with_kind(s, aligned_to(kind_size(s), src), op);
}

cudaError_t launch_pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows,
                              std::size_t block_rows, std::size_t scale_cols, std::size_t batches,
                              cudaStream_t stream) {
  if (rows == 0 || scale_cols == 0 || batches == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  const PackArgs a = pack_args(dst, scale, rows, block_rows, scale_cols, batches);
  if (a.aligned) {
    pack_ue8m0_kernel<true><<<grid_2d(rows, a.all_rows), kThreads, 0, stream>>>(
        a.dst, a.scale, rows, block_rows, scale_cols, a.words, a.per_matrix, a.all_rows);
  } else {
    pack_ue8m0_kernel<false><<<grid_2d(rows, a.all_rows), kThreads, 0, stream>>>(
        a.dst, a.scale, rows, block_rows, scale_cols, a.words, a.per_matrix, a.all_rows);
  }
  return cudaGetLastError();
}

void dequantize_fp8_emulated(std::byte* dst, DType dst_dtype, const std::byte* src,
                             const std::byte* scale, const Fp8Scales& scales, std::size_t rows,
                             std::size_t cols, std::size_t batches) {
  EmulateDequantize op{dequantize_args(dst, src, scale, scales, rows, cols, batches)};
  const Kind d = kind_of(dst_dtype);
  with_kind(d, aligned_to(kind_size(d), dst), op);
}

void quantize_fp8_emulated(std::byte* dst, std::byte* scale, const std::byte* src,
                           DType src_dtype, const Fp8Scales& scales, Fp8ScaleRule rule,
                           std::size_t rows, std::size_t cols, std::size_t batches) {
  if (rows == 0 || cols == 0 || batches == 0) {
    return;
  }
  EmulateQuantize op{quantize_args(dst, scale, src, scales, rule, rows, cols, batches)};
  const Kind s = kind_of(src_dtype);
  with_kind(s, aligned_to(kind_size(s), src), op);
}

void pack_ue8m0_emulated(std::byte* dst, const std::byte* scale, std::size_t rows,
                         std::size_t block_rows, std::size_t scale_cols, std::size_t batches) {
  const PackArgs a = pack_args(dst, scale, rows, block_rows, scale_cols, batches);
  for (std::size_t row = 0; row < a.all_rows; ++row) {
    for (std::size_t r = 0; r < rows; ++r) {
      if (a.aligned) {
        pack_elem<true>(a.dst, a.scale, rows, block_rows, scale_cols, a.words, a.per_matrix, row,
                        r);
      } else {
        pack_elem<false>(a.dst, a.scale, rows, block_rows, scale_cols, a.words, a.per_matrix, row,
                         r);
      }
    }
  }
}

}  // namespace ferry::gpu::cuda
