#include "common/fp8.hpp"

#include <array>
#include <cmath>

namespace ferry {
namespace {

// The 127 finite non-negative values, by code 0x00..0x7E (increasing).
const std::array<float, 127>& positive_values() {
  static const std::array<float, 127> table = [] {
    std::array<float, 127> t{};
    for (unsigned code = 0; code < 127; ++code) {
      t[code] = e4m3_to_float(static_cast<std::uint8_t>(code));
    }
    return t;
  }();
  return table;
}

}  // namespace

float e4m3_to_float(std::uint8_t bits) {
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

std::uint8_t float_to_e4m3(float value) {
  if (std::isnan(value)) {
    return 0x7F;
  }
  const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float mag = std::fabs(value);
  const std::array<float, 127>& t = positive_values();
  if (mag >= t[126]) {
    return static_cast<std::uint8_t>(sign | 126u);
  }
  // First code whose value is >= mag; then the nearer of it and the one below.
  unsigned lo = 0;
  unsigned hi = 126;
  while (lo < hi) {
    const unsigned mid = (lo + hi) / 2;
    if (t[mid] < mag) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  unsigned code = lo;
  if (code > 0) {
    const float up = t[code] - mag;
    const float down = mag - t[code - 1];
    if (down < up || (down == up && (code - 1) % 2 == 0)) {
      code -= 1;
    }
  }
  return static_cast<std::uint8_t>(sign | code);
}

}  // namespace ferry
