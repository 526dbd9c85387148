#include "common/fp8.hpp"

#include <array>
#include <bit>
#include <cmath>

namespace ferry {
namespace {

float decode(std::uint8_t bits) {
  const bool negative = (bits & 0x80u) != 0;
  const unsigned exp = (bits >> 3) & 0xFu;
  const unsigned man = bits & 0x7u;
  if (exp == 0xF && man == 0x7) {
    return std::nanf("");
  }
  const float mag =
      exp == 0 ? std::ldexp(static_cast<float>(man), -9)
               : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, static_cast<int>(exp) - 7);
  return negative ? -mag : mag;
}

}  // namespace

float e4m3_to_float(std::uint8_t bits) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (unsigned code = 0; code < 256; ++code) {
      t[code] = decode(static_cast<std::uint8_t>(code));
    }
    return t;
  }();
  return table[bits];
}

std::uint8_t float_to_e4m3(float value) {
  return e4m3_from_f32_bits(std::bit_cast<std::uint32_t>(value));
}

void scale_to_e4m3(const float* x, std::uint64_t count, float mul, std::uint8_t* q) {
  constexpr std::uint32_t kMagicBits = 141u << 23;  // 2^14: its ulp is 2^-9
  const float magic = std::bit_cast<float>(kMagicBits);
  for (std::uint64_t i = 0; i < count; ++i) {
    const float v = x[i] * mul;
    const float clamped = v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v);  // NaN stays
    const std::uint32_t bits = std::bit_cast<std::uint32_t>(clamped);
    const std::uint32_t mag = bits & 0x7FFFFFFFu;
    // At least 2^-6 (normal): round the mantissa to 3 bits, ties to even (a carry
    // moves into the exponent), then rebias 127 -> 7.
    const std::uint32_t normal = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
    // Below (subnormal, multiples of 2^-9): the FPU rounds |v| + 2^14 to its ulp.
    const std::uint32_t sub =
        std::bit_cast<std::uint32_t>(std::bit_cast<float>(mag) + magic) - kMagicBits;
    const std::uint32_t code = ((bits >> 24) & 0x80u) | (mag < (121u << 23) ? sub : normal);
    q[i] = static_cast<std::uint8_t>(mag > 0x7F800000u ? 0x7Fu : code);  // NaN
  }
}

}  // namespace ferry
