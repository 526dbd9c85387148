#include "common/float_bits.hpp"

#include <bit>

namespace ferry {

std::uint16_t float_to_bf16_bits(float value) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  if ((x & 0x7fffffffU) > 0x7f800000U) {
    return static_cast<std::uint16_t>((x >> 16) | 0x0040U);  // quiet NaN, sign kept
  }
  std::uint32_t rounding = 0x7fffU + ((x >> 16) & 1U);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

std::uint16_t float_to_f16_bits(float value) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  std::uint32_t sign = (x >> 16) & 0x8000U;
  std::uint32_t exp = (x >> 23) & 0xffU;
  std::uint32_t mant = x & 0x7fffffU;
  if (exp == 0xff) {  // infinity or NaN (kept quiet, top payload bits kept)
    return static_cast<std::uint16_t>(sign | 0x7c00U | (mant != 0 ? 0x0200U | (mant >> 13) : 0));
  }
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) {
    return static_cast<std::uint16_t>(sign | 0x7c00U);
  }
  if (e <= 0) {
    // Half subnormal: value / 2^-24, rounded to nearest even. Below 2^-25 it is 0.
    if (e < -10) {
      return static_cast<std::uint16_t>(sign);
    }
    std::uint32_t m = mant | 0x800000U;
    int shift = 14 - e;
    std::uint32_t half = m >> shift;
    std::uint32_t rem = m & ((1U << shift) - 1U);
    std::uint32_t halfway = 1U << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1U) != 0)) {
      ++half;  // may carry into the smallest normal, which is the right answer
    }
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t half = sign | (static_cast<std::uint32_t>(e) << 10) | (mant >> 13);
  std::uint32_t rem = mant & 0x1fffU;
  if (rem > 0x1000U || (rem == 0x1000U && (half & 1U) != 0)) {
    ++half;  // a carry out of the mantissa bumps the exponent, up to infinity
  }
  return static_cast<std::uint16_t>(half);
}

}  // namespace ferry
