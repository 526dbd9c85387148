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

std::uint32_t le32(const std::byte* p) {
  return static_cast<std::uint32_t>(u8(p, 0)) | (static_cast<std::uint32_t>(u8(p, 1)) << 8) |
         (static_cast<std::uint32_t>(u8(p, 2)) << 16) |
         (static_cast<std::uint32_t>(u8(p, 3)) << 24);
}

float half(const std::byte* p) {
  return f16_to_float(le16(p));
}

// Each decoder writes one block: `b` points at type_size bytes, `y` at block_size floats.

void block_q4_0(const std::byte* b, float* y) {  // d, qs[16]
  const float d = half(b);
  for (int j = 0; j < 16; ++j) {
    const std::uint8_t q = u8(b, 2 + j);
    y[j] = d * static_cast<float>((q & 0x0f) - 8);
    y[j + 16] = d * static_cast<float>((q >> 4) - 8);
  }
}

void block_q4_1(const std::byte* b, float* y) {  // d, m, qs[16]
  const float d = half(b);
  const float m = half(b + 2);
  for (int j = 0; j < 16; ++j) {
    const std::uint8_t q = u8(b, 4 + j);
    y[j] = d * static_cast<float>(q & 0x0f) + m;
    y[j + 16] = d * static_cast<float>(q >> 4) + m;
  }
}

void block_q5_0(const std::byte* b, float* y) {  // d, qh[4], qs[16]
  const float d = half(b);
  const std::uint32_t qh = le32(b + 2);
  for (int j = 0; j < 16; ++j) {
    const std::uint8_t q = u8(b, 6 + j);
    const int lo = (q & 0x0f) | static_cast<int>(((qh >> j) & 1u) << 4);
    const int hi = (q >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
    y[j] = d * static_cast<float>(lo - 16);
    y[j + 16] = d * static_cast<float>(hi - 16);
  }
}

void block_q5_1(const std::byte* b, float* y) {  // d, m, qh[4], qs[16]
  const float d = half(b);
  const float m = half(b + 2);
  const std::uint32_t qh = le32(b + 4);
  for (int j = 0; j < 16; ++j) {
    const std::uint8_t q = u8(b, 8 + j);
    const int lo = (q & 0x0f) | static_cast<int>(((qh >> j) & 1u) << 4);
    const int hi = (q >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
    y[j] = d * static_cast<float>(lo) + m;
    y[j + 16] = d * static_cast<float>(hi) + m;
  }
}

void block_q8_0(const std::byte* b, float* y) {  // d, qs[32] (int8)
  const float d = half(b);
  for (int j = 0; j < 32; ++j) {
    y[j] = static_cast<float>(static_cast<std::int8_t>(u8(b, 2 + j))) * d;
  }
}

// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64] (2 bits), d, dmin.
// Element e = 128 g + 32 s + l takes bits 2s of qs[32 g + l]; its sub-block is e / 16.
void block_q2_k(const std::byte* b, float* y) {
  const std::byte* scales = b;
  const std::byte* qs = b + 16;
  const float d = half(b + 80);
  const float dmin = half(b + 82);
  for (std::uint32_t e = 0; e < kQK; ++e) {
    const std::uint32_t g = e / 128, s = (e / 32) % 4, l = e % 32;
    const std::uint8_t sc = u8(scales, e / 16);
    const float dl = d * static_cast<float>(sc & 0x0f);
    const float ml = dmin * static_cast<float>(sc >> 4);
    const int q = (u8(qs, 32 * g + l) >> (2 * s)) & 3;
    y[e] = dl * static_cast<float>(q) - ml;
  }
}

// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales, offset 32), d. The high bit
// of element e = 128 g + 32 s + l is bit (4 g + s) of hmask[l]; set means no -4.
void block_q3_k(const std::byte* b, float* y) {
  const std::byte* hmask = b;
  const std::byte* qs = b + 32;
  const std::byte* sc = b + 96;
  const float d = half(b + 108);
  int scale[16];
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? (u8(sc, i) & 0x0f) : (u8(sc, i - 8) >> 4);
    const int hi = (u8(sc, 8 + i % 4) >> (2 * (i / 4))) & 3;
    scale[i] = (lo | (hi << 4)) - 32;
  }
  for (std::uint32_t e = 0; e < kQK; ++e) {
    const std::uint32_t g = e / 128, s = (e / 32) % 4, l = e % 32;
    const int low = (u8(qs, 32 * g + l) >> (2 * s)) & 3;
    const int high = (u8(hmask, l) >> (4 * g + s)) & 1;
    const float dl = d * static_cast<float>(scale[e / 16]);
    y[e] = dl * static_cast<float>(low - (high != 0 ? 0 : 4));
  }
}

// The eight 6-bit scales and mins of Q4_K and Q5_K, packed in 12 bytes (ggml's
// get_scale_min_k4).
void scale_min_k4(const std::byte* s, int sc[8], int mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = u8(s, j) & 63;
    mn[j] = u8(s, j + 4) & 63;
    sc[j + 4] = (u8(s, j + 8) & 0x0f) | ((u8(s, j) >> 6) << 4);
    mn[j + 4] = (u8(s, j + 8) >> 4) | ((u8(s, j + 4) >> 6) << 4);
  }
}

// Q4_K: d, dmin, scales[12], qs[128]. Sub-block t (32 elements) of 8 takes nibble
// t % 2 of qs[32 (t / 2) + l].
void block_q4_k(const std::byte* b, float* y) {
  const float d = half(b);
  const float dmin = half(b + 2);
  int sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const std::byte* qs = b + 16;
  for (std::uint32_t e = 0; e < kQK; ++e) {
    const std::uint32_t t = e / 32, l = e % 32;
    const int q = (u8(qs, 32 * (t / 2) + l) >> (4 * (t % 2))) & 0x0f;
    const float d1 = d * static_cast<float>(sc[t]);
    const float m1 = dmin * static_cast<float>(mn[t]);
    y[e] = d1 * static_cast<float>(q) - m1;
  }
}

// Q5_K: d, dmin, scales[12], qh[32], qs[128]; the fifth bit of sub-block t is bit t
// of qh[l].
void block_q5_k(const std::byte* b, float* y) {
  const float d = half(b);
  const float dmin = half(b + 2);
  int sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const std::byte* qh = b + 16;
  const std::byte* qs = b + 48;
  for (std::uint32_t e = 0; e < kQK; ++e) {
    const std::uint32_t t = e / 32, l = e % 32;
    const int lo = (u8(qs, 32 * (t / 2) + l) >> (4 * (t % 2))) & 0x0f;
    const int hi = (u8(qh, l) >> t) & 1;
    const float d1 = d * static_cast<float>(sc[t]);
    const float m1 = dmin * static_cast<float>(mn[t]);
    y[e] = d1 * static_cast<float>(lo | (hi << 4)) - m1;
  }
}

// Q6_K: ql[128], qh[64], scales[16] (int8), d. Element e = 128 g + 64 h + k has its
// low nibble in nibble h of ql[64 g + k] and its two high bits at bits 2 s of
// qh[32 g + l] where e = 128 g + 32 s + l.
void block_q6_k(const std::byte* b, float* y) {
  const std::byte* ql = b;
  const std::byte* qh = b + 128;
  const std::byte* scales = b + 192;
  const float d = half(b + 208);
  for (std::uint32_t e = 0; e < kQK; ++e) {
    const std::uint32_t g = e / 128, h = (e / 64) % 2, k = e % 64;
    const std::uint32_t s = (e / 32) % 4, l = e % 32;
    const int lo = (u8(ql, 64 * g + k) >> (4 * h)) & 0x0f;
    const int hi = (u8(qh, 32 * g + l) >> (2 * s)) & 3;
    const float ds = d * static_cast<float>(static_cast<std::int8_t>(u8(scales, e / 16)));
    y[e] = ds * static_cast<float>((lo | (hi << 4)) - 32);
  }
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
  for (std::size_t i = 0; i < blocks; ++i, b += t.type_size, y += t.block_size) {
    switch (type) {
      case GgmlType::kF32:
        std::memcpy(y, b, 4);
        break;
      case GgmlType::kF16:
        *y = half(b);
        break;
      case GgmlType::kBF16:
        *y = bf16_to_float(le16(b));
        break;
      case GgmlType::kQ4_0:
        block_q4_0(b, y);
        break;
      case GgmlType::kQ4_1:
        block_q4_1(b, y);
        break;
      case GgmlType::kQ5_0:
        block_q5_0(b, y);
        break;
      case GgmlType::kQ5_1:
        block_q5_1(b, y);
        break;
      case GgmlType::kQ8_0:
        block_q8_0(b, y);
        break;
      case GgmlType::kQ2_K:
        block_q2_k(b, y);
        break;
      case GgmlType::kQ3_K:
        block_q3_k(b, y);
        break;
      case GgmlType::kQ4_K:
        block_q4_k(b, y);
        break;
      case GgmlType::kQ5_K:
        block_q5_k(b, y);
        break;
      case GgmlType::kQ6_K:
        block_q6_k(b, y);
        break;
      default:
        break;  // refused above
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
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exp = (bits >> 10) & 0x1fu;
  std::uint32_t mant = bits & 0x3ffu;
  std::uint32_t out = 0;
  if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);  // infinity or NaN, payload kept
  } else if (exp != 0) {
    out = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    out = sign;
  } else {
    // Subnormal half: normalize into a float's exponent range.
    std::uint32_t e = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    out = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(out);
}

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

}  // namespace ferry::io
