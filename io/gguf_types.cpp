// ggml's type table, the reference dequantizers and the Q8_0 quantizer. Each
// decoder follows ggml's block struct (ggml-common.h) and computes what gguf-py's
// quants.py computes, in the same order of float operations.
#include "io/gguf_types.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "common/error.hpp"
#include "common/float_bits.hpp"
#include "common/ggml_blocks.hpp"

namespace ferry::io {
namespace {

constexpr std::uint32_t kQK = 256;  // elements of a K-quant super-block (QK_K)

// gguf-py's GGML_QUANT_SIZES, in number order.
constexpr std::array<GgmlTypeTraits, 34> kTypes = {{
    {GgmlType::kF32, "F32", 1, 4},
    {GgmlType::kF16, "F16", 1, 2},
    {GgmlType::kQ4_0, "Q4_0", 32, 2 + 16},
    {GgmlType::kQ4_1, "Q4_1", 32, 2 + 2 + 16},
    {GgmlType::kQ5_0, "Q5_0", 32, 2 + 4 + 16},
    {GgmlType::kQ5_1, "Q5_1", 32, 2 + 2 + 4 + 16},
    {GgmlType::kQ8_0, "Q8_0", 32, 2 + 32},
    {GgmlType::kQ8_1, "Q8_1", 32, 4 + 4 + 32},
    {GgmlType::kQ2_K, "Q2_K", kQK, 2 + 2 + kQK / 16 + kQK / 4},
    {GgmlType::kQ3_K, "Q3_K", kQK, 2 + kQK / 4 + kQK / 8 + 12},
    {GgmlType::kQ4_K, "Q4_K", kQK, 2 + 2 + kQK / 2 + 12},
    {GgmlType::kQ5_K, "Q5_K", kQK, 2 + 2 + kQK / 2 + kQK / 8 + 12},
    {GgmlType::kQ6_K, "Q6_K", kQK, 2 + kQK / 2 + kQK / 4 + kQK / 16},
    {GgmlType::kQ8_K, "Q8_K", kQK, 4 + kQK + kQK / 8},
    {GgmlType::kIQ2_XXS, "IQ2_XXS", kQK, 2 + kQK / 4},
    {GgmlType::kIQ2_XS, "IQ2_XS", kQK, 2 + kQK / 4 + kQK / 32},
    {GgmlType::kIQ3_XXS, "IQ3_XXS", kQK, 2 + kQK / 4 + kQK / 8},
    {GgmlType::kIQ1_S, "IQ1_S", kQK, 2 + kQK / 8 + kQK / 16},
    {GgmlType::kIQ4_NL, "IQ4_NL", 32, 2 + 16},
    {GgmlType::kIQ3_S, "IQ3_S", kQK, 2 + kQK / 4 + kQK / 8 + kQK / 32 + 4},
    {GgmlType::kIQ2_S, "IQ2_S", kQK, 2 + kQK / 4 + kQK / 16},
    {GgmlType::kIQ4_XS, "IQ4_XS", kQK, 2 + 2 + kQK / 2 + kQK / 64},
    {GgmlType::kI8, "I8", 1, 1},
    {GgmlType::kI16, "I16", 1, 2},
    {GgmlType::kI32, "I32", 1, 4},
    {GgmlType::kI64, "I64", 1, 8},
    {GgmlType::kF64, "F64", 1, 8},
    {GgmlType::kIQ1_M, "IQ1_M", kQK, kQK / 8 + kQK / 16 + kQK / 32},
    {GgmlType::kBF16, "BF16", 1, 2},
    {GgmlType::kTQ1_0, "TQ1_0", kQK, 2 + 4 * 13},
    {GgmlType::kTQ2_0, "TQ2_0", kQK, 2 + 64},
    {GgmlType::kMXFP4, "MXFP4", 32, 1 + 16},
    {GgmlType::kNVFP4, "NVFP4", 64, 4 + 32},
    {GgmlType::kQ1_0, "Q1_0", 128, 2 + 16},
}};

std::uint8_t u8(const std::byte* p, std::size_t i) {
  return std::to_integer<std::uint8_t>(p[i]);
}

std::uint16_t le16(const std::byte* p) {
  return static_cast<std::uint16_t>(u8(p, 0) | (u8(p, 1) << 8));
}

[[noreturn]] void fail(Stage stage, std::string_view tensor, const std::string& rule) {
  throw Error(stage, "", std::string(tensor), rule);
}

}  // namespace

std::span<const GgmlTypeTraits> ggml_types() {
  return kTypes;
}

const GgmlTypeTraits* find_ggml_type(std::uint32_t number) {
  for (const GgmlTypeTraits& t : kTypes) {
    if (static_cast<std::uint32_t>(t.type) == number) {
      return &t;
    }
  }
  return nullptr;
}

const GgmlTypeTraits& ggml_traits(GgmlType type) {
  const GgmlTypeTraits* t = find_ggml_type(static_cast<std::uint32_t>(type));
  if (t == nullptr) {
    throw Error(Stage::kHeader, "", "",
                "ggml type number " + std::to_string(static_cast<std::uint32_t>(type)) +
                    " is not a known type");
  }
  return *t;
}

std::string_view ggml_type_name(GgmlType type) {
  return ggml_traits(type).name;
}

std::optional<GgmlType> parse_ggml_type(std::string_view name) {
  for (const GgmlTypeTraits& t : kTypes) {
    if (t.name == name) {
      return t.type;
    }
  }
  return std::nullopt;
}

std::optional<DType> ggml_dtype(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
      return DType::kF32;
    case GgmlType::kF16:
      return DType::kF16;
    case GgmlType::kBF16:
      return DType::kBF16;
    case GgmlType::kF64:
      return DType::kF64;
    case GgmlType::kI8:
      return DType::kI8;
    case GgmlType::kI16:
      return DType::kI16;
    case GgmlType::kI32:
      return DType::kI32;
    case GgmlType::kI64:
      return DType::kI64;
    default:
      return std::nullopt;
  }
}

std::optional<std::uint64_t> ggml_row_bytes(GgmlType type, std::uint64_t elements) {
  const GgmlTypeTraits& t = ggml_traits(type);
  if (elements % t.block_size != 0) {
    return std::nullopt;
  }
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(elements / t.block_size, std::uint64_t{t.type_size}, &bytes)) {
    return std::nullopt;
  }
  return bytes;
}

std::optional<GgmlBlocks> ggml_blocks(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
      return GgmlBlocks::kQ4_0;
    case GgmlType::kQ4_1:
      return GgmlBlocks::kQ4_1;
    case GgmlType::kQ5_0:
      return GgmlBlocks::kQ5_0;
    case GgmlType::kQ5_1:
      return GgmlBlocks::kQ5_1;
    case GgmlType::kQ8_0:
      return GgmlBlocks::kQ8_0;
    case GgmlType::kQ2_K:
      return GgmlBlocks::kQ2_K;
    case GgmlType::kQ3_K:
      return GgmlBlocks::kQ3_K;
    case GgmlType::kQ4_K:
      return GgmlBlocks::kQ4_K;
    case GgmlType::kQ5_K:
      return GgmlBlocks::kQ5_K;
    case GgmlType::kQ6_K:
      return GgmlBlocks::kQ6_K;
    default:
      return std::nullopt;
  }
}

bool can_dequantize(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return true;
    default:
      return false;
  }
}

void dequantize(GgmlType type, std::span<const std::byte> src, std::span<float> out,
                std::string_view tensor) {
  const GgmlTypeTraits& t = ggml_traits(type);
  if (!can_dequantize(type)) {
    fail(Stage::kPostProcess, tensor,
         "dequantizing " + std::string(t.name) +
             " is not supported (ferry reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
             "Q2_K, Q3_K, Q4_K, Q5_K and Q6_K)");
  }
  const std::size_t blocks = src.size() / t.type_size;
  if (src.size() % t.type_size != 0 || out.size() / t.block_size != blocks ||
      out.size() % t.block_size != 0) {
    fail(Stage::kPostProcess, tensor,
         std::string(t.name) + ": " + std::to_string(src.size()) + " bytes and " +
             std::to_string(out.size()) + " floats are not the same whole number of blocks (" +
             std::to_string(t.type_size) + " bytes, " + std::to_string(t.block_size) +
             " elements each)");
  }
  const std::byte* b = src.data();
  float* y = out.data();
  const std::optional<GgmlBlocks> kind = ggml_blocks(type);
  for (std::size_t i = 0; i < blocks; ++i, b += t.type_size, y += t.block_size) {
    switch (type) {
      case GgmlType::kF32:
        std::memcpy(y, b, 4);
        break;
      case GgmlType::kF16:
        *y = f16_to_float(le16(b));
        break;
      case GgmlType::kBF16:
        *y = bf16_to_float(le16(b));
        break;
      default: {  // a quantized type: can_dequantize said it has a block format
        const auto* block = reinterpret_cast<const unsigned char*>(b);
        for (std::uint32_t e = 0; e < t.block_size; ++e) {
          y[e] = ggml_block_element(*kind, block, e);
        }
        break;
      }
    }
  }
}

void quantize_q8_0(std::span<const float> in, std::span<std::byte> out, std::string_view tensor) {
  constexpr std::size_t kBlock = 32, kBytes = 34;
  const std::size_t blocks = in.size() / kBlock;
  if (in.size() % kBlock != 0 || out.size() != blocks * kBytes) {
    fail(Stage::kSynth, tensor,
         "Q8_0: " + std::to_string(in.size()) + " floats and " + std::to_string(out.size()) +
             " bytes are not the same whole number of blocks (32 floats, 34 bytes each)");
  }
  for (std::size_t i = 0; i < blocks; ++i) {
    const float* x = in.data() + i * kBlock;
    std::byte* b = out.data() + i * kBytes;
    float amax = 0;
    for (std::size_t j = 0; j < kBlock; ++j) {
      if (!std::isfinite(x[j])) {
        fail(Stage::kSynth, tensor,
             "Q8_0: value " + std::to_string(i * kBlock + j) +
                 " is not finite (Q8_0 has no encoding for NaN or infinity)");
      }
      amax = std::max(amax, std::fabs(x[j]));
    }
    const float d = amax / 127.0f;
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    const std::uint16_t dbits = float_to_f16_bits(d);  // round to nearest even, as numpy
    b[0] = static_cast<std::byte>(dbits & 0xff);
    b[1] = static_cast<std::byte>(dbits >> 8);
    for (std::size_t j = 0; j < kBlock; ++j) {
      const float v = x[j] * id;
      // 1/d overflows for a block whose largest value is below about 3.7e-37: the
      // products are then infinite or NaN, which numpy casts to 0 on x86-64.
      std::int32_t q = 0;
      if (std::isfinite(v)) {
        q = static_cast<std::int32_t>(std::round(v));  // half away from zero
        q = std::clamp(q, -128, 127);
      }
      b[2 + j] = static_cast<std::byte>(static_cast<std::uint8_t>(static_cast<std::int8_t>(q)));
    }
  }
}

float f16_to_float(std::uint16_t bits) {
  const unsigned char le[2] = {static_cast<unsigned char>(bits & 0xffu),
                               static_cast<unsigned char>(bits >> 8)};
  return ggml_detail::half_at(le);
}

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

}  // namespace ferry::io
