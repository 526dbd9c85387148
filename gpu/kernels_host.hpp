// Host twins of the device kernels: scalar conversions between F32, F16 and BF16,
// and the fill and cast loops built on them. These define what every backend must
// produce bit for bit (the host backend runs them directly; the CUDA kernels are
// compared against them by the self-test).
//
// Rules (see Stream::cast in gpu/device.hpp): round to nearest, ties to even;
// subnormals are converted exactly, never flushed; overflow goes to infinity; a NaN
// becomes the canonical quiet NaN of the target type, keeping the sign.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.hpp"
#include "common/ggml_blocks.hpp"
#include "gpu/fp8.hpp"

namespace ferry::gpu::host {

inline constexpr std::uint16_t kBF16CanonicalNaN = 0x7FC0;
inline constexpr std::uint16_t kF16CanonicalNaN = 0x7E00;
inline constexpr std::uint32_t kF32CanonicalNaN = 0x7FC00000;

// Conversions on bit patterns (the formats' own bits, no host float16 type needed).
std::uint16_t f32_to_bf16(std::uint32_t f32_bits);
std::uint32_t bf16_to_f32(std::uint16_t bf16_bits);
std::uint16_t f32_to_f16(std::uint32_t f32_bits);
std::uint32_t f16_to_f32(std::uint16_t f16_bits);

// The element pattern fill() writes for `value` (see Stream::fill): the low
// dtype_size(dtype) bytes of the result, in the machine's byte order. Throws
// ferry::Error for dtypes fill() does not support.
std::uint64_t fill_pattern(DType dtype, double value);

// Writes `count` copies of fill_pattern(dtype, value) to dst (any alignment).
void fill(std::byte* dst, std::size_t count, DType dtype, double value);

// Stream::fill_random's definition: element i from gpu/fill_random.hpp, stored by
// this file's F32 conversions (any alignment). Throws ferry::Error for other dtypes.
void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                 std::uint64_t seed);
// fill_random's F32 (low, high - low), as every backend computes them.
struct RandomRange {
  float low = 0;
  float span = 0;
};
RandomRange random_range(double low, double high);

// Converts `count` elements (any alignment); same dtype is a memmove. Throws
// ferry::Error for dtypes outside BF16/F16/F32. `dst == src` works when both
// element sizes are equal; other overlaps are the caller's business.
void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
          std::size_t count);

// The pitched and batched operations of gpu::Stream (zero_2d, cast_2d, copy_d2d_2d,
// dequantize_ggml_2d, transpose), as plain loops: what the CUDA kernels must match
// byte for byte. Arguments are the caller's to check (gpu/device_internal.hpp).
void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes, std::size_t rows);
void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
             std::size_t src_pitch, DType src_dtype, std::size_t width, std::size_t rows);
void copy_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src, std::size_t src_pitch,
             std::size_t width_bytes, std::size_t rows);
// Stream::dequantize_ggml_2d: element by element through ggml_block_element
// (common/ggml_blocks.hpp, the CUDA kernel's own element code), a NaN made the
// positive canonical NaN, then stored with this file's F32 conversions.
void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                        const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                        std::size_t width, std::size_t rows);
void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
               std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
               std::size_t cols, std::size_t batches);

// Stream::match_pattern's rule for one range: true when every whole element of
// `element_size` bytes (1, 2, 4 or 8) in [data, data + bytes) equals the low
// element_size bytes of `pattern`, in the machine's byte order. Any alignment;
// bytes after the last whole element are not read; no whole element: true.
bool matches_pattern(const std::byte* data, std::uint64_t bytes, std::uint64_t pattern,
                     std::uint32_t element_size);
// The FP8 operations of gpu::Stream (dequantize_fp8, quantize_fp8, pack_ue8m0; see
// gpu/device.hpp and gpu/fp8.hpp), as plain loops over fp8::'s element functions.
// Arguments are the caller's to check (gpu/device_internal.hpp). quantize_fp8
// encodes a run of elements with common/fp8.hpp's scale_to_e4m3 (the vectorized
// loop quantization.online ran on the host before), which gives the same bytes as
// fp8::quantize_one element by element.
void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src, const std::byte* scale,
                    const Fp8Scales& scales, std::size_t rows, std::size_t cols,
                    std::size_t batches);
void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                  const Fp8Scales& scales, Fp8ScaleRule rule, std::size_t rows, std::size_t cols,
                  std::size_t batches);
void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows, std::size_t block_rows,
                std::size_t scale_cols, std::size_t batches);

// Marlin's NVFP4 layouts (gpu/marlin.hpp), word by word and byte by byte.
void repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n, std::size_t k);
void marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n, std::size_t groups);

// A host-to-"device" copy written the way a DMA engine writes device memory:
// around the CPU caches. From 64 KiB up it uses non-temporal stores, so the
// destination (gigabytes, not read again during a load) costs no read-for-ownership
// per line and does not evict the staging buffers the reader is about to refill
// (measured here: 19 GB/s against memcpy's 8 GB/s from a cache-resident source).
// Smaller copies, and builds without SSE2, use memcpy. No overlap allowed.
void copy_around_caches(std::byte* dst, const std::byte* src, std::size_t bytes);

}  // namespace ferry::gpu::host
