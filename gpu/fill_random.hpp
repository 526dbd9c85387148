// The element function of Stream::fill_random, shared by the host twin
// (gpu/kernels_host.cpp) and the CUDA kernel (gpu/cuda/cuda_kernels.cu), so that both
// backends compute the same F32 value for every element from nothing but (seed,
// index): a counter-based generator, no state between elements or launches.
//
//   bits  = splitmix64(seed + i)
//   u     = (bits >> 40) * 2^-24                 exact, in [0, 1)
//   value = low + (high - low) * u               two F32 operations, each rounded
//                                                 to nearest (never fused)
//
// The value is then stored in the element's dtype by the backend's own F32
// conversion (round to nearest even; FP8 E4M3 saturating at +-448, e4m3_from_f32
// below); a U8 element is the top byte of `bits`.
#pragma once

#include <cstdint>

#include "common/hash.hpp"

namespace ferry::gpu::random_fill {

using ferry::splitmix64;

// Element i's F32 value; `span` is high - low, computed once in F32 by the caller.
FERRY_HOST_DEVICE inline float value(std::uint64_t bits, float low, float span) {
  const float u = static_cast<float>(bits >> 40) * 5.9604644775390625e-8f;  // 2^-24
#ifdef __CUDA_ARCH__
  return __fadd_rn(low, __fmul_rn(span, u));
#else
  const float scaled = span * u;  // a statement of its own: never contracted into an FMA
  return low + scaled;
#endif
}

// F32 bits -> F8_E4M3 (E4M3FN: bias 7, no infinities, 0x7F/0xFF NaN): round to
// nearest, ties to even; magnitudes of 448 and above (and infinities) saturate to
// +-448 (0x7E), NaN is 0x7F. The same encoding as ferry::float_to_e4m3.
FERRY_HOST_DEVICE inline std::uint8_t e4m3_from_f32(std::uint32_t f) {
  const std::uint32_t sign = (f >> 24) & 0x80u;
  const std::uint32_t exp_bits = (f >> 23) & 0xFFu;
  const std::uint32_t man = f & 0x7FFFFFu;
  if (exp_bits == 0xFF && man != 0) {
    return 0x7F;
  }
  if (exp_bits == 0) {
    return static_cast<std::uint8_t>(sign);  // F32 subnormals are far below 2^-10
  }
  const std::uint32_t mag = f & 0x7FFFFFFFu;
  if (mag >= 0x43E00000u) {  // 448.0f
    return static_cast<std::uint8_t>(sign | 0x7Eu);
  }
  const int e = static_cast<int>(exp_bits) - 127;
  const std::uint32_t m = man | 0x800000u;  // 24 bits, the leading 1 at bit 23
  // Normal results keep 3 mantissa bits (q holds 1.mmm, 4 bits); subnormal ones are
  // multiples of 2^-9: q = round(value * 2^9).
  const int shift = e >= -6 ? 20 : 14 - e;
  if (shift >= 32) {
    return static_cast<std::uint8_t>(sign);
  }
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u) != 0)) {
    ++q;
  }
  if (e < -6) {
    return static_cast<std::uint8_t>(sign | q);  // q <= 8: 8 is the smallest normal's code
  }
  std::uint32_t biased = static_cast<std::uint32_t>(e + 7);
  if (q == 16) {  // rounding carried into the next binade
    q = 8;
    ++biased;
  }
  const std::uint32_t code = (biased << 3) | (q & 7u);
  return static_cast<std::uint8_t>(sign | (code > 0x7Eu ? 0x7Eu : code));
}

}  // namespace ferry::gpu::random_fill
