// GGML's quantized blocks as the copy path reads them: which block formats a GGUF
// tensor can keep on its way to the device, each block's size, and the value of one
// element of a block in float32. One definition serves the host reference
// (io::dequantize), the host and null devices and the CUDA kernel (FERRY_HOST_DEVICE),
// so the device's dequantization is the reference's, operation for operation.
//
// The block layouts are ggml's (ggml-common.h: block_q4_0 ... block_q6_K). Each
// element is computed with the same float operations, in the same order, as gguf-py's
// quants.py dequantizes it, so results agree with gguf-py exactly where multiply-adds
// are not fused (ferry's host code; the CUDA kernel is built with --fmad=false).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

#include "common/host_device_macro.hpp"

namespace ferry {

// The quantized formats ferry dequantizes: kNone is a plain element type.
enum class GgmlBlocks : std::uint8_t {
  kNone = 0,
  kQ4_0,
  kQ4_1,
  kQ5_0,
  kQ5_1,
  kQ8_0,
  kQ2_K,
  kQ3_K,
  kQ4_K,
  kQ5_K,
  kQ6_K,
};

struct GgmlBlockShape {
  std::uint32_t elems = 1;  // elements a block
  std::uint32_t bytes = 0;  // bytes a block
};

// The shape of a block of `b`; {1, 0} for kNone.
FERRY_HOST_DEVICE constexpr GgmlBlockShape ggml_block_shape(GgmlBlocks b) {
  switch (b) {
    case GgmlBlocks::kQ4_0:
      return {32, 18};
    case GgmlBlocks::kQ4_1:
      return {32, 20};
    case GgmlBlocks::kQ5_0:
      return {32, 22};
    case GgmlBlocks::kQ5_1:
      return {32, 24};
    case GgmlBlocks::kQ8_0:
      return {32, 34};
    case GgmlBlocks::kQ2_K:
      return {256, 84};
    case GgmlBlocks::kQ3_K:
      return {256, 110};
    case GgmlBlocks::kQ4_K:
      return {256, 144};
    case GgmlBlocks::kQ5_K:
      return {256, 176};
    case GgmlBlocks::kQ6_K:
      return {256, 210};
    case GgmlBlocks::kNone:
      break;
  }
  return {1, 0};
}

// "Q4_K", as llama.cpp spells it; "none" for kNone.
std::string_view ggml_blocks_name(GgmlBlocks b);

// Bytes of a row of `width` elements of `b` (width a multiple of its block elements).
FERRY_HOST_DEVICE constexpr std::uint64_t ggml_row_bytes(GgmlBlocks b, std::uint64_t width) {
  const GgmlBlockShape s = ggml_block_shape(b);
  return width / s.elems * s.bytes;
}

namespace ggml_detail {

FERRY_HOST_DEVICE inline unsigned u8(const unsigned char* p, unsigned i) {
  return p[i];
}

FERRY_HOST_DEVICE inline float f32_from_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// IEEE binary16 bits to float, exactly (subnormals, infinities, NaN payloads).
FERRY_HOST_DEVICE inline float half_at(const unsigned char* p) {
  const std::uint32_t bits = u8(p, 0) | (u8(p, 1) << 8);
  const std::uint32_t sign = (bits & 0x8000u) << 16;
  const std::uint32_t exp = (bits >> 10) & 0x1fu;
  std::uint32_t mant = bits & 0x3ffu;
  if (exp == 0x1f) {
    return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  }
  if (exp != 0) {
    return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
  }
  if (mant == 0) {
    return f32_from_bits(sign);
  }
  std::uint32_t e = 113;  // normalise the subnormal: value = mant * 2^-24
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return f32_from_bits(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

FERRY_HOST_DEVICE inline std::uint32_t le32_at(const unsigned char* p) {
  return u8(p, 0) | (u8(p, 1) << 8) | (u8(p, 2) << 16) | (u8(p, 3) << 24);
}

// The 6-bit scale (which 0) or min (which 1) of sub-block t of a Q4_K / Q5_K block,
// from its 12 packed bytes (ggml's get_scale_min_k4).
FERRY_HOST_DEVICE inline int scale_min_k4(const unsigned char* s, unsigned t, unsigned which) {
  if (t < 4) {
    return static_cast<int>(u8(s, t + 4 * which) & 63u);
  }
  const unsigned j = t - 4;
  const unsigned low = which == 0 ? (u8(s, j + 8) & 0x0fu) : (u8(s, j + 8) >> 4);
  return static_cast<int>(low | ((u8(s, j + 4 * which) >> 6) << 4));
}

}  // namespace ggml_detail

// Element `e` (< its block elements) of the block of `b` at `block`, in float32.
// kNone gives 0.
FERRY_HOST_DEVICE inline float ggml_block_element(GgmlBlocks b, const unsigned char* block,
                                                  unsigned e) {
  using ggml_detail::half_at;
  using ggml_detail::le32_at;
  using ggml_detail::scale_min_k4;
  using ggml_detail::u8;
  switch (b) {
    case GgmlBlocks::kQ4_0: {  // d, qs[16]: element j in the low nibble, j + 16 the high
      const float d = half_at(block);
      const unsigned q = u8(block, 2 + e % 16);
      const int v = static_cast<int>(e < 16 ? (q & 0x0fu) : (q >> 4)) - 8;
      return d * static_cast<float>(v);
    }
    case GgmlBlocks::kQ4_1: {  // d, m, qs[16]
      const float d = half_at(block);
      const float m = half_at(block + 2);
      const unsigned q = u8(block, 4 + e % 16);
      return d * static_cast<float>(e < 16 ? (q & 0x0fu) : (q >> 4)) + m;
    }
    case GgmlBlocks::kQ5_0: {  // d, qh[4], qs[16]: the fifth bit of element e is bit e
      const float d = half_at(block);
      const std::uint32_t qh = le32_at(block + 2);
      const unsigned q = u8(block, 6 + e % 16);
      const unsigned v = (e < 16 ? (q & 0x0fu) : (q >> 4)) | (((qh >> e) & 1u) << 4);
      return d * static_cast<float>(static_cast<int>(v) - 16);
    }
    case GgmlBlocks::kQ5_1: {  // d, m, qh[4], qs[16]
      const float d = half_at(block);
      const float m = half_at(block + 2);
      const std::uint32_t qh = le32_at(block + 4);
      const unsigned q = u8(block, 8 + e % 16);
      const unsigned v = (e < 16 ? (q & 0x0fu) : (q >> 4)) | (((qh >> e) & 1u) << 4);
      return d * static_cast<float>(v) + m;
    }
    case GgmlBlocks::kQ8_0: {  // d, qs[32] (int8)
      const float d = half_at(block);
      return static_cast<float>(static_cast<signed char>(u8(block, 2 + e))) * d;
    }
    case GgmlBlocks::kQ2_K: {
      // scales[16] (low nibble scale, high nibble min), qs[64] (2 bits), d, dmin.
      // Element e = 128 g + 32 s + l takes bits 2s of qs[32 g + l]; its sub-block is e / 16.
      const unsigned g = e / 128, s = (e / 32) % 4, l = e % 32;
      const float d = half_at(block + 80);
      const float dmin = half_at(block + 82);
      const unsigned sc = u8(block, e / 16);
      const float dl = d * static_cast<float>(sc & 0x0fu);
      const float ml = dmin * static_cast<float>(sc >> 4);
      const unsigned q = (u8(block + 16, 32 * g + l) >> (2 * s)) & 3u;
      return dl * static_cast<float>(q) - ml;
    }
    case GgmlBlocks::kQ3_K: {
      // hmask[32], qs[64], scales[12] (16 six-bit scales, offset 32), d. The high bit
      // of element e = 128 g + 32 s + l is bit (4 g + s) of hmask[l]; set means no -4.
      const unsigned g = e / 128, s = (e / 32) % 4, l = e % 32;
      const unsigned char* sc = block + 96;
      const unsigned i = e / 16;
      const unsigned lo = i < 8 ? (u8(sc, i) & 0x0fu) : (u8(sc, i - 8) >> 4);
      const unsigned hi = (u8(sc, 8 + i % 4) >> (2 * (i / 4))) & 3u;
      const int scale = static_cast<int>(lo | (hi << 4)) - 32;
      const float d = half_at(block + 108);
      const int low = static_cast<int>((u8(block + 32, 32 * g + l) >> (2 * s)) & 3u);
      const unsigned high = (u8(block, l) >> (4 * g + s)) & 1u;
      const float dl = d * static_cast<float>(scale);
      return dl * static_cast<float>(low - (high != 0 ? 0 : 4));
    }
    case GgmlBlocks::kQ4_K: {
      // d, dmin, scales[12], qs[128]. Sub-block t (32 elements) of 8 takes nibble
      // t % 2 of qs[32 (t / 2) + l].
      const unsigned t = e / 32, l = e % 32;
      const float d = half_at(block);
      const float dmin = half_at(block + 2);
      const int q = static_cast<int>((u8(block + 16, 32 * (t / 2) + l) >> (4 * (t % 2))) & 0x0fu);
      const float d1 = d * static_cast<float>(scale_min_k4(block + 4, t, 0));
      const float m1 = dmin * static_cast<float>(scale_min_k4(block + 4, t, 1));
      return d1 * static_cast<float>(q) - m1;
    }
    case GgmlBlocks::kQ5_K: {
      // d, dmin, scales[12], qh[32], qs[128]; the fifth bit of sub-block t is bit t of qh[l].
      const unsigned t = e / 32, l = e % 32;
      const float d = half_at(block);
      const float dmin = half_at(block + 2);
      const unsigned lo = (u8(block + 48, 32 * (t / 2) + l) >> (4 * (t % 2))) & 0x0fu;
      const unsigned hi = (u8(block + 16, l) >> t) & 1u;
      const float d1 = d * static_cast<float>(scale_min_k4(block + 4, t, 0));
      const float m1 = dmin * static_cast<float>(scale_min_k4(block + 4, t, 1));
      return d1 * static_cast<float>(static_cast<int>(lo | (hi << 4))) - m1;
    }
    case GgmlBlocks::kQ6_K: {
      // ql[128], qh[64], scales[16] (int8), d. Element e = 128 g + 64 h + k has its low
      // nibble in nibble h of ql[64 g + k] and its two high bits at bits 2 s of
      // qh[32 g + l] where e = 128 g + 32 s + l.
      const unsigned g = e / 128, h = (e / 64) % 2, k = e % 64;
      const unsigned s = (e / 32) % 4, l = e % 32;
      const unsigned lo = (u8(block, 64 * g + k) >> (4 * h)) & 0x0fu;
      const unsigned hi = (u8(block + 128, 32 * g + l) >> (2 * s)) & 3u;
      const float d = half_at(block + 208);
      const float ds = d * static_cast<float>(static_cast<signed char>(u8(block + 192, e / 16)));
      return ds * static_cast<float>(static_cast<int>(lo | (hi << 4)) - 32);
    }
    case GgmlBlocks::kNone:
      break;
  }
  return 0.0f;
}

}  // namespace ferry
