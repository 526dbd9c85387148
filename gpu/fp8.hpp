// FP8 E4M3 work after loading, on the device (gpu::Stream::dequantize_fp8,
// quantize_fp8, pack_ue8m0): how scales map onto elements, how a group's amax
// becomes its scale, and the per-element arithmetic. The element functions are
// shared by the host twins (gpu/kernels_host.cpp) and the CUDA kernels
// (gpu/cuda/cuda_kernels.cu), so that both compute the same bits: F32 products and
// quotients rounded once (never fused), E4M3 encoded by common/fp8.hpp's
// e4m3_from_f32_bits (nearest even, saturating at +-448, NaN -> 0x7F).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/fp8.hpp"
#include "common/host_device_macro.hpp"

namespace ferry::gpu {

// Which elements of a rows x cols matrix share one F32 scale.
enum class Fp8Granularity {
  kTensor,  // one scale a matrix
  kRow,     // one a row (per output channel): [rows] a matrix
  kBlock,   // one a block_rows x block_cols tile: [ceil(rows / br), ceil(cols / bc)],
            // row-major; the last tiles of a row or column may be partial
};

// The F32 scales of a batch of matrices: per matrix fp8_scale_count() of them,
// matrix after matrix (dense).
struct Fp8Scales {
  Fp8Granularity granularity = Fp8Granularity::kTensor;
  std::size_t block_rows = 0;  // kBlock: rows of a tile (> 0)
  std::size_t block_cols = 0;  // kBlock: columns of a tile (> 0)
  // kTensor only, quantize_fp8 only: each matrix's scale is written this many times
  // in a row (>= 1), so that a block-scale param can hold it in every block (SGLang's
  // block_quant_to_tensor_quant). dequantize_fp8 reads one scale a matrix.
  std::size_t tensor_repeat = 1;
};

// How quantize_fp8 turns a group's amax (the largest |x| of its elements,
// infinities included, NaN skipped; 0 for a group of zeros and NaNs) into the
// scale s it stores and the multiplier m it quantizes with: q = e4m3(x * m).
enum class Fp8ScaleRule {
  kAmax,           // s = amax / 448, m = s > 0 ? 1 / s : 0 (SGLang's per-token quant and
                   //   scaled_fp8_quant: a zero group gets s = 0 and zeros)
  kAmaxOrOne,      // s = amax > 0 ? amax / 448 : 1, m = 1 / s (block_quant_to_tensor_quant)
  kInputToFloat8,  // m = 448 / max(amax, 1e-12), s = 1 / m (input_to_float8)
  kUe8m0,          // s = ceil_to_ue8m0(max(amax, 1e-4) / 448), m = 1 / s (exact: a power of
                   //   two), as requant_weight_ue8m0 does for DeepGEMM
  kStatic,         // no amax: s = the largest of the group's scale slots as they are before
                   //   the call (kTensor: its tensor_repeat slots), m = 1 / s, and every
                   //   slot of the group then holds s: SGLang's scaled_fp8_quant with a
                   //   static scale (its kernel multiplies by the F32 reciprocal), given
                   //   the max of several shards' scales (requantize_with_max_scale)
};

namespace fp8 {

inline constexpr float kE4M3Max = 448.0f;

// Scales a matrix has (kBlock needs block sizes > 0; the caller checks).
FERRY_HOST_DEVICE inline std::size_t scale_count(const Fp8Scales& s, std::size_t rows,
                                                 std::size_t cols) {
  switch (s.granularity) {
    case Fp8Granularity::kRow:
      return rows;
    case Fp8Granularity::kBlock:
      return ((rows + s.block_rows - 1) / s.block_rows) *
             ((cols + s.block_cols - 1) / s.block_cols);
    case Fp8Granularity::kTensor:
      break;
  }
  return 1;
}

// Index of element (r, c)'s scale within its matrix's scales.
FERRY_HOST_DEVICE inline std::size_t scale_index(const Fp8Scales& s, std::size_t r, std::size_t c,
                                                 std::size_t cols) {
  switch (s.granularity) {
    case Fp8Granularity::kRow:
      return r;
    case Fp8Granularity::kBlock:
      return (r / s.block_rows) * ((cols + s.block_cols - 1) / s.block_cols) + c / s.block_cols;
    case Fp8Granularity::kTensor:
      break;
  }
  return 0;
}

FERRY_HOST_DEVICE inline std::uint32_t to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  std::uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FERRY_HOST_DEVICE inline float from_bits(std::uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

FERRY_HOST_DEVICE inline bool is_nan_bits(std::uint32_t f) {
  return (f & 0x7FFFFFFFu) > 0x7F800000u;
}

// a * b and a / b in F32, rounded once to nearest even on both sides.
FERRY_HOST_DEVICE inline float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FERRY_HOST_DEVICE inline float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The exact F32 bits of an E4M3 byte (0x7F / 0xFF: quiet NaN with the byte's sign).
FERRY_HOST_DEVICE constexpr std::uint32_t e4m3_to_f32_bits(std::uint8_t b) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t exp = (b >> 3) & 0xFu;
  const std::uint32_t man = b & 0x7u;
  if (exp == 0xF && man == 0x7) {
    return sign | 0x7FC00000u;
  }
  if (exp != 0) {
    return sign | ((exp + 120u) << 23) | (man << 20);  // rebias 7 -> 127
  }
  if (man == 0) {
    return sign;
  }
  // Subnormal: man * 2^-9, man in 1..7; its leading bit p gives 2^(p - 9).
  const std::uint32_t p = man >= 4 ? 2u : (man >= 2 ? 1u : 0u);
  return sign | ((p + 118u) << 23) | ((man - (1u << p)) << (23u - p));
}

// One dequantized element, F32 bits: e4m3(q) * scale, rounded once. A NaN result
// is the canonical quiet NaN (0x7FC00000) with the sign of the NaN operand, the
// weight's first, then the scale's; 0 * inf is -NaN (the product's sign on x86,
// where the host code this replaced ran).
FERRY_HOST_DEVICE inline std::uint32_t dequantize_one(std::uint8_t q, float scale) {
  const std::uint32_t w = e4m3_to_f32_bits(q);
  const std::uint32_t s = to_bits(scale);
  const std::uint32_t p = to_bits(mul(from_bits(w), scale));
  if (!is_nan_bits(p)) {
    return p;
  }
  if (is_nan_bits(w)) {
    return (w & 0x80000000u) | 0x7FC00000u;
  }
  if (is_nan_bits(s)) {
    return (s & 0x80000000u) | 0x7FC00000u;
  }
  return 0xFFC00000u;
}

// |x| folded into a running amax; NaN is skipped (std::max(amax, |x|) on the host
// and fmaxf on the device agree on it).
FERRY_HOST_DEVICE inline float amax_fold(float amax, float x) {
  const float a = from_bits(to_bits(x) & 0x7FFFFFFFu);
  return is_nan_bits(to_bits(a)) || !(a > amax) ? amax : a;
}

// ceil_to_ue8m0 of SGLang's fp8_utils: the smallest power of two >= |x| (the
// exponent rounded up when the mantissa is nonzero), exponent clamped to [1, 254].
FERRY_HOST_DEVICE inline float ceil_to_ue8m0(float x) {
  const std::uint32_t b = to_bits(x) & 0x7FFFFFFFu;
  std::uint32_t e = (b >> 23) & 0xFFu;
  if ((b & 0x7FFFFFu) != 0) {
    ++e;
  }
  e = e < 1u ? 1u : (e > 254u ? 254u : e);
  return from_bits(e << 23);
}

struct ScaleMul {
  float scale = 0;  // what the scales array holds
  float mul = 0;    // what the elements are multiplied by before encoding
};

// The rule's (s, m) for a group's amax (see Fp8ScaleRule); kStatic takes the group's
// static scale in place of the amax.
FERRY_HOST_DEVICE inline ScaleMul scale_for(float amax, Fp8ScaleRule rule) {
  switch (rule) {
    case Fp8ScaleRule::kAmax: {
      const float s = div(amax, kE4M3Max);
      return {s, s > 0.0f ? div(1.0f, s) : 0.0f};
    }
    case Fp8ScaleRule::kAmaxOrOne: {
      const float s = amax > 0.0f ? div(amax, kE4M3Max) : 1.0f;
      return {s, div(1.0f, s)};
    }
    case Fp8ScaleRule::kInputToFloat8: {
      const float m = div(kE4M3Max, amax > 1e-12f ? amax : 1e-12f);
      return {div(1.0f, m), m};
    }
    case Fp8ScaleRule::kStatic:
      return {amax, div(1.0f, amax)};  // `amax` is the group's static scale
    case Fp8ScaleRule::kUe8m0:
      break;
  }
  const float s = ceil_to_ue8m0(div(amax > 1e-4f ? amax : 1e-4f, kE4M3Max));
  return {s, div(1.0f, s)};
}

// One quantized element: e4m3(x * m).
FERRY_HOST_DEVICE inline std::uint8_t quantize_one(float x, float m) {
  return e4m3_from_f32_bits(to_bits(mul(x, m)));
}

// The exponent byte DeepGEMM's packed UE8M0 scales hold for an F32 scale.
FERRY_HOST_DEVICE inline std::uint32_t ue8m0_byte(float scale) {
  return (to_bits(scale) >> 23) & 0xFFu;
}

// F32 element i at `base`, any alignment.
FERRY_HOST_DEVICE inline float load_f32(const unsigned char* base, std::size_t i) {
  float f;
  memcpy(&f, base + i * sizeof f, sizeof f);
  return f;
}

// Word w of row r of a packed UE8M0 copy: the exponent bytes of the scales of
// column blocks 4w .. 4w + 3 of row r's block row, little-endian, zero past
// scale_cols. `scales` is one matrix's F32 [ceil(rows / block_rows), scale_cols].
FERRY_HOST_DEVICE inline std::uint32_t ue8m0_word(const unsigned char* scales, std::size_t r,
                                                  std::size_t w, std::size_t block_rows,
                                                  std::size_t scale_cols) {
  std::uint32_t word = 0;
  for (std::size_t k = 0; k < 4; ++k) {
    const std::size_t col = w * 4 + k;
    if (col < scale_cols) {
      word |= ue8m0_byte(load_f32(scales, (r / block_rows) * scale_cols + col)) << (8 * k);
    }
  }
  return word;
}

}  // namespace fp8
}  // namespace ferry::gpu
