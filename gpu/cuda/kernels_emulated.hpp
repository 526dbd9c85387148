// The CUDA kernels' per-element code (gpu/cuda/*_kernels.cu), compiled for the
// host and run in a plain loop. Only built with the CUDA backend. Tests compare it
// with the host twins (gpu/kernels_host.hpp) on machines without a GPU; this checks
// the kernels' own logic (NaN handling, alignment paths, dispatch) and the host
// fallbacks of cuda_fp16.h / cuda_bf16.h, but not the GPU's conversion
// instructions: the self-test on a real device does that.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.hpp"
#include "common/ggml_blocks.hpp"
#include "gpu/device.hpp"
#include "gpu/fp8.hpp"

namespace ferry::gpu::cuda {

void fill_emulated(std::byte* dst, std::size_t count, std::size_t element_size,
                   std::uint64_t pattern);

void fill_random_emulated(std::byte* dst, std::size_t count, DType dtype, float low, float span,
                          std::uint64_t seed);

void cast_emulated(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                   std::size_t count);

void cast_2d_emulated(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
                      std::size_t src_pitch, DType src_dtype, std::size_t width, std::size_t rows);

void dequantize_ggml_2d_emulated(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                                 const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                                 std::size_t width, std::size_t rows);

void copy_2d_emulated(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                      std::size_t src_pitch, std::size_t width_bytes, std::size_t rows);

// The word size launch_copy_2d and copy_2d_emulated pick for these arguments.
std::size_t copy_2d_word_size(const std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                              std::size_t src_pitch, std::size_t width_bytes);

void transpose_emulated(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                        std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                        std::size_t cols, std::size_t batches);

// launch_match_pattern's per-byte rule, run over a host-resident table.
void match_pattern_emulated(const PatternRange* ranges, std::size_t count, std::uint8_t* flags);
// The FP8 kernels' steps run in order on the CPU (the tensor path's accumulator,
// merge and final scales included), over the very element functions.
void dequantize_fp8_emulated(std::byte* dst, DType dst_dtype, const std::byte* src,
                             const std::byte* scale, const Fp8Scales& scales, std::size_t rows,
                             std::size_t cols, std::size_t batches);
void quantize_fp8_emulated(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                           const Fp8Scales& scales, Fp8ScaleRule rule, std::size_t rows,
                           std::size_t cols, std::size_t batches);
void pack_ue8m0_emulated(std::byte* dst, const std::byte* scale, std::size_t rows,
                         std::size_t block_rows, std::size_t scale_cols, std::size_t batches);

void repack_marlin_fp4_emulated(std::byte* dst, const std::byte* src, std::size_t n,
                                std::size_t k);
void marlin_fp4_scales_emulated(std::byte* dst, const std::byte* src, std::size_t n,
                                std::size_t groups);

}  // namespace ferry::gpu::cuda
