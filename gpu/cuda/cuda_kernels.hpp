// Launchers for the CUDA kernels (gpu/cuda/cuda_kernels.cu). Each returns the
// launch's cudaError_t; the caller checks it with FERRY_CUDA_CHECK. Their host twins
// are in gpu/kernels_host.hpp; gpu/cuda/kernels_emulated.hpp runs the very same
// element code on the CPU so that it can be tested on machines without a GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.hpp"
#include "common/ggml_blocks.hpp"
#include "gpu/device.hpp"
#include "gpu/fp8.hpp"

namespace ferry::gpu::cuda {

// Writes `count` elements of `element_size` bytes (2, 4 or 8) holding the low bytes
// of `pattern` (computed on the host by host::fill_pattern, so both backends convert
// the fill value with the same code). Any alignment.
cudaError_t launch_fill(std::byte* dst, std::size_t count, std::size_t element_size,
                        std::uint64_t pattern, cudaStream_t stream);

// Stream::fill_random: element i from gpu/fill_random.hpp, stored as `dtype` (BF16,
// F16, F32, F8_E4M3, U8; checked by the caller) with this file's conversions.
// `low` / `span` are host::random_range's. Any alignment.
cudaError_t launch_fill_random(std::byte* dst, std::size_t count, DType dtype, float low,
                               float span, std::uint64_t seed, cudaStream_t stream);

// Elementwise cast among BF16/F16/F32 with the rules of Stream::cast. The dtypes
// must differ and be castable (checked by the caller). Any alignment; dst == src
// works for equal element sizes.
cudaError_t launch_cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                        std::size_t count, cudaStream_t stream);

// The pitched form of launch_cast: one launch for `rows` rows of `width` elements.
cudaError_t launch_cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                           const std::byte* src, std::size_t src_pitch, DType src_dtype,
                           std::size_t width, std::size_t rows, cudaStream_t stream);

// Stream::dequantize_ggml_2d (gpu/cuda/cuda_ggml_kernels.cu), its arguments checked
// by the caller: a thread an output element, ggml_block_element's float32 narrowed
// as the cast kernel narrows F32 (a NaN the positive canonical NaN). kNone gives
// cudaErrorInvalidValue. Any alignment.
cudaError_t launch_dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                                      const std::byte* src, std::size_t src_pitch,
                                      GgmlBlocks blocks, std::size_t width, std::size_t rows,
                                      cudaStream_t stream);

// Device-to-device pitched copy (the gather of narrow rows): each thread moves the
// widest word (up to 16 bytes) that divides both pointers, pitches and the width.
cudaError_t launch_copy_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                           std::size_t src_pitch, std::size_t width_bytes, std::size_t rows,
                           cudaStream_t stream);

// Batched transpose of rows x cols matrices of 1-, 2-, 4- or 8-byte elements (see
// Stream::transpose), tiled through shared memory.
cudaError_t launch_transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                             std::size_t src_batch_pitch, std::size_t element_size,
                             std::size_t rows, std::size_t cols, std::size_t batches,
                             cudaStream_t stream);

// Stream::match_pattern: flags[i] = 1 when every whole element of range i of the
// device-resident table equals its pattern (host::matches_pattern's rule), else 0;
// an element size other than 1, 2, 4 or 8 gives 0. One launch for all ranges: a
// block a range (grid-stride over the ranges), its threads over the range's bytes,
// stopping at the first pass that finds a difference.
cudaError_t launch_match_pattern(const PatternRange* ranges, std::size_t count,
                                 std::uint8_t* flags, cudaStream_t stream);
// Stream::dequantize_fp8 (dst_dtype BF16, F16 or F32), quantize_fp8 (src_dtype
// likewise) and pack_ue8m0, their arguments checked by the caller. quantize_fp8 per
// row or block: a block of threads a group; per tensor with 4-byte aligned scales:
// a zeroed accumulator in each matrix's first scale slot (cudaMemsetAsync), an
// atomic-max reduction kernel, an encoding kernel and a kernel writing the final
// scales (unaligned scales: a block a matrix). No scratch, no host round trip.
cudaError_t launch_dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src,
                                  const std::byte* scale, const Fp8Scales& scales, std::size_t rows,
                                  std::size_t cols, std::size_t batches, cudaStream_t stream);
cudaError_t launch_quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src,
                                DType src_dtype, const Fp8Scales& scales, Fp8ScaleRule rule,
                                std::size_t rows, std::size_t cols, std::size_t batches,
                                cudaStream_t stream);
cudaError_t launch_pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows,
                              std::size_t block_rows, std::size_t scale_cols, std::size_t batches,
                              cudaStream_t stream);

// Stream::repack_marlin_fp4 and marlin_fp4_scales (gpu/marlin.hpp), their arguments
// checked by the caller: a thread an output word or byte, grid-stride.
cudaError_t launch_repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                                     std::size_t k, cudaStream_t stream);
cudaError_t launch_marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                                     std::size_t groups, cudaStream_t stream);

}  // namespace ferry::gpu::cuda
