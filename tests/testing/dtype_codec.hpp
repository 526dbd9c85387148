// Little-endian encoding of floats as BF16, F16 or F32 and back, for tests that
// compare loaded bytes with reference values (values must be exact in the target
// type; synth values are). Header-only, so every test executable can use it.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common/dtype.hpp"
#include "synth/synth.hpp"

namespace ferry::testing {

// IEEE half to float, exactly (subnormals, infinities and NaN included).
inline float half_to_float(std::uint16_t h) {
  std::uint32_t sign = (h >> 15) & 1u;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  float mag = 0;
  if (exp == 0) {
    mag = static_cast<float>(man) / 1024.0f / 16384.0f;  // subnormal: man * 2^-24
  } else if (exp == 31) {
    mag = man == 0 ? INFINITY : NAN;
  } else {
    mag = (1.0f + static_cast<float>(man) / 1024.0f);
    int e = static_cast<int>(exp) - 15;
    for (; e > 0; --e) {
      mag *= 2.0f;
    }
    for (; e < 0; ++e) {
      mag /= 2.0f;
    }
  }
  return sign != 0 ? -mag : mag;
}

// FP8 E4M3 (float8_e4m3fn) by its definition: 1 sign, 4 exponent bits (bias 7), 3
// mantissa bits, subnormals at exponent 0, 0x7F / 0xFF NaN, no infinities.
inline float e4m3_value(std::uint8_t b) {
  const int e = (b >> 3) & 0xF;
  const int m = b & 0x7;
  if (e == 0xF && m == 0x7) {
    return NAN;
  }
  const float mag = e == 0 ? static_cast<float>(m) / 8.0f / 64.0f  // m/8 * 2^-6
                           : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
  return (b & 0x80) != 0 ? -mag : mag;
}

// The E4M3 value nearest `v` (on a tie, the one with an even code, i.e. an even
// mantissa: round half to even), by trying every code.
inline float round_to_e4m3(float v) {
  float best = 0;
  float best_err = INFINITY;
  int best_code = 0;
  for (int code = 0; code < 256; ++code) {
    const float x = e4m3_value(static_cast<std::uint8_t>(code));
    if (std::isnan(x)) {
      continue;
    }
    const float err = std::fabs(x - v);
    if (err < best_err || (err == best_err && code % 2 == 0 && best_code % 2 != 0)) {
      best = x;
      best_err = err;
      best_code = code;
    }
  }
  return best;
}

inline void encode_one(float v, DType dtype, std::byte* out) {
  if (dtype == DType::kU8) {  // a byte's value (NVFP4's packed pairs)
    if (v < 0 || v > 255 || v != static_cast<float>(static_cast<int>(v))) {
      throw std::runtime_error("encode: value is not a byte");
    }
    *out = static_cast<std::byte>(static_cast<int>(v));
    return;
  }
  if (dtype == DType::kF8E4M3) {
    for (int code = 0; code < 256; ++code) {
      if (e4m3_value(static_cast<std::uint8_t>(code)) == v &&
          (v != 0 || !std::signbit(v) == (code < 128))) {
        *out = static_cast<std::byte>(code);
        return;
      }
    }
    throw std::runtime_error("encode: value is not exact in F8_E4M3");
  }
  if (dtype == DType::kF32) {
    std::memcpy(out, &v, 4);
  } else if (dtype == DType::kBF16 || dtype == DType::kF16) {
    std::uint16_t bits =
        dtype == DType::kBF16 ? synth::float_to_bf16_bits(v) : synth::float_to_f16_bits(v);
    std::memcpy(out, &bits, 2);
  } else {
    throw std::runtime_error("encode: unsupported dtype");
  }
}

inline std::vector<std::byte> encode(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> out(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    encode_one(values[i], dtype, out.data() + i * dtype_size(dtype));
  }
  return out;
}

inline float decode_one(const std::byte* p, DType dtype) {
  if (dtype == DType::kU8) {
    return static_cast<float>(static_cast<std::uint8_t>(*p));
  }
  if (dtype == DType::kF8E4M3) {
    return e4m3_value(static_cast<std::uint8_t>(*p));
  }
  if (dtype == DType::kF32) {
    float v = 0;
    std::memcpy(&v, p, 4);
    return v;
  }
  std::uint16_t bits = 0;
  std::memcpy(&bits, p, 2);
  if (dtype == DType::kBF16) {
    std::uint32_t w = static_cast<std::uint32_t>(bits) << 16;
    float v = 0;
    std::memcpy(&v, &w, 4);
    return v;
  }
  if (dtype == DType::kF16) {
    return half_to_float(bits);
  }
  throw std::runtime_error("decode: unsupported dtype");
}

}  // namespace ferry::testing
