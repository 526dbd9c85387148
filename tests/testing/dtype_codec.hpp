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
#include "tools/synth.hpp"

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

inline void encode_one(float v, DType dtype, std::byte* out) {
  if (dtype == DType::kF32) {
    std::memcpy(out, &v, 4);
  } else if (dtype == DType::kBF16 || dtype == DType::kF16) {
    std::uint16_t bits =
        dtype == DType::kBF16 ? tools::float_to_bf16_bits(v) : tools::float_to_f16_bits(v);
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
