// The value function and its encoders: element i of tensor T is a pure function of
// (seed, T, i), encoded through tables of the 255 values it takes.
#include <array>
#include <bit>
#include <cstring>

#include "common/error.hpp"
#include "common/fp8.hpp"
#include "common/hash.hpp"
#include "synth/family.hpp"
#include "synth/synth.hpp"

namespace ferry::synth {

static_assert(std::endian::native == std::endian::little,
              "safetensors is little-endian; the encoders store host order");

namespace {

float value_of(std::uint64_t k) {
  return (static_cast<float>(k) - 127.0f) / 128.0f;
}

std::uint32_t float_to_f32_bits(float value) {
  return std::bit_cast<std::uint32_t>(value);
}

// Encoded forms of the 255 possible values, so the hot loop is a hash and a load.
template <typename T, T (*encode)(float)>
const std::array<T, 255>& value_table() {
  static const std::array<T, 255> table = [] {
    std::array<T, 255> t{};
    for (std::uint64_t k = 0; k < 255; ++k) {
      t[k] = encode(value_of(k));
    }
    return t;
  }();
  return table;
}

template <typename T>
void encode_with(const std::array<T, 255>& table, std::uint64_t base, std::span<std::byte> out) {
  std::byte* p = out.data();
  std::size_t n = out.size() / sizeof(T);
  for (std::size_t i = 0; i < n; ++i) {
    T bits = table[splitmix64(base + i) % 255];
    std::memcpy(p + i * sizeof(T), &bits, sizeof(T));
  }
}

}  // namespace

float synth_value(std::uint64_t seed, std::string_view tensor_name, std::uint64_t index) {
  return value_of(splitmix64((seed ^ fnv1a64(tensor_name)) + index) % 255);
}

void synth_encode(DType dtype, std::uint64_t seed, std::string_view name, std::uint64_t first_index,
                  std::span<std::byte> out) {
  if (dtype == DType::kF8E4M3) {
    encode_with(value_table<std::uint8_t, float_to_e4m3>(), (seed ^ fnv1a64(name)) + first_index,
                out);
    return;
  }
  if (dtype == DType::kU8) {  // packed NVFP4 weights: any byte
    const std::uint64_t base = (seed ^ fnv1a64(name)) + first_index;
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = static_cast<std::byte>(splitmix64(base + i) & 0xFF);
    }
    return;
  }
  check_dtype(dtype);
  if (out.size() % dtype_size(dtype) != 0) {
    throw Error(Stage::kSynth, "", std::string(name),
                "encode buffer of " + std::to_string(out.size()) +
                    " bytes is not a whole number of " + std::string(dtype_name(dtype)) +
                    " elements");
  }
  std::uint64_t base = (seed ^ fnv1a64(name)) + first_index;
  switch (dtype) {
    case DType::kBF16:
      encode_with(value_table<std::uint16_t, float_to_bf16_bits>(), base, out);
      break;
    case DType::kF16:
      encode_with(value_table<std::uint16_t, float_to_f16_bits>(), base, out);
      break;
    default:
      encode_with(value_table<std::uint32_t, float_to_f32_bits>(), base, out);
      break;
  }
}

}  // namespace ferry::synth
