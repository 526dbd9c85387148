// FP8 E4M3 ("float8_e4m3fn", safetensors F8_E4M3) elements on the host: 1 sign, 4
// exponent (bias 7) and 3 mantissa bits, no infinities, 0x7F / 0xFF NaN, largest
// finite 448. Used where the host must read or write FP8 weights (the synthetic
// checkpoints, the MLA split's dequantization on the host).
#pragma once

#include <cstdint>

#include "common/host_device_macro.hpp"

namespace ferry {

// Exact value of an E4M3 byte (NaN for 0x7F / 0xFF): a table lookup.
float e4m3_to_float(std::uint8_t bits);
// Nearest E4M3 value, ties to the even code; beyond +-448 saturates to +-448 (as
// SGLang's quantizers clamp before they cast); NaN becomes 0x7F.
std::uint8_t float_to_e4m3(float value);

// q[i] = float_to_e4m3(x[i] * mul) for a span, branch-free so that the loop
// vectorizes (online quantization encodes whole weights on the host).
void scale_to_e4m3(const float* x, std::uint64_t count, float mul, std::uint8_t* q);

// float_to_e4m3 on the value's F32 bits, by bit arithmetic alone, so that CUDA
// kernels share it (the random fill's FP8 elements).
FERRY_HOST_DEVICE constexpr std::uint8_t e4m3_from_f32_bits(std::uint32_t f) {
  const std::uint32_t sign = (f >> 24) & 0x80u;
  const std::uint32_t exp_bits = (f >> 23) & 0xFFu;
  const std::uint32_t man = f & 0x7FFFFFu;
  if (exp_bits == 0xFF && man != 0) {
    return 0x7F;
  }
  if (exp_bits == 0) {
    return static_cast<std::uint8_t>(sign);  // F32 subnormals are far below 2^-10
  }
  if ((f & 0x7FFFFFFFu) >= 0x43E00000u) {  // 448.0f and up, infinity included
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

}  // namespace ferry
