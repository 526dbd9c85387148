// ggml's types (io/gguf_types.hpp): the table against gguf-py's GGML_QUANT_SIZES,
// dequantization of hand-made blocks whose values are worked out here from ggml's
// block layouts, and the Q8_0 quantizer's rounding. tests/interop/gguf_interop_test.py
// compares the same code with gguf-py itself on random blocks.
#include "io/gguf_types.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/error.hpp"
#include "testing/error_of.hpp"

namespace ferry::io {
namespace {

using ferry::testing::error_of;

// A block of `n` zero bytes with little-endian fp16 `bits` written at `at`.
struct Block {
  std::vector<std::byte> b;
  explicit Block(std::size_t n) : b(n) {}
  Block& f16(std::size_t at, std::uint16_t bits) {
    b[at] = static_cast<std::byte>(bits & 0xff);
    b[at + 1] = static_cast<std::byte>(bits >> 8);
    return *this;
  }
  Block& set(std::size_t at, std::uint8_t v) {
    b[at] = static_cast<std::byte>(v);
    return *this;
  }
  std::vector<float> decode(GgmlType type) const {
    std::vector<float> out(ggml_traits(type).block_size);
    dequantize(type, b, out);
    return out;
  }
};

constexpr std::uint16_t kOne = 0x3c00, kHalf = 0x3800, kTwo = 0x4000, kQuarter = 0x3400;
constexpr std::uint16_t kMinusOne = 0xbc00;

TEST(GgmlTypes, TheTableIsGgufPys) {
  EXPECT_EQ(ggml_types().size(), 34u);
  const auto sizes = [](GgmlType t) {
    return std::pair{ggml_traits(t).block_size, ggml_traits(t).type_size};
  };
  EXPECT_EQ(sizes(GgmlType::kF32), (std::pair{1u, 4u}));
  EXPECT_EQ(sizes(GgmlType::kBF16), (std::pair{1u, 2u}));
  EXPECT_EQ(sizes(GgmlType::kQ8_0), (std::pair{32u, 34u}));
  EXPECT_EQ(sizes(GgmlType::kQ8_1), (std::pair{32u, 40u}));
  EXPECT_EQ(sizes(GgmlType::kQ2_K), (std::pair{256u, 84u}));
  EXPECT_EQ(sizes(GgmlType::kQ3_K), (std::pair{256u, 110u}));
  EXPECT_EQ(sizes(GgmlType::kQ4_K), (std::pair{256u, 144u}));
  EXPECT_EQ(sizes(GgmlType::kQ5_K), (std::pair{256u, 176u}));
  EXPECT_EQ(sizes(GgmlType::kQ6_K), (std::pair{256u, 210u}));
  EXPECT_EQ(sizes(GgmlType::kQ8_K), (std::pair{256u, 292u}));
  EXPECT_EQ(sizes(GgmlType::kIQ1_M), (std::pair{256u, 56u}));
  EXPECT_EQ(sizes(GgmlType::kTQ1_0), (std::pair{256u, 54u}));
  EXPECT_EQ(sizes(GgmlType::kMXFP4), (std::pair{32u, 17u}));
  EXPECT_EQ(sizes(GgmlType::kNVFP4), (std::pair{64u, 36u}));
  EXPECT_EQ(sizes(GgmlType::kQ1_0), (std::pair{128u, 18u}));
  for (std::uint32_t removed : {4u, 5u, 31u, 32u, 33u, 36u, 37u, 38u, 42u}) {
    EXPECT_EQ(find_ggml_type(removed), nullptr) << removed;
  }
  EXPECT_EQ(find_ggml_type(30)->name, "BF16");
  EXPECT_EQ(parse_ggml_type("IQ4_XS"), GgmlType::kIQ4_XS);
  EXPECT_EQ(parse_ggml_type("q4_k"), std::nullopt);
  EXPECT_EQ(ggml_type_name(GgmlType::kTQ2_0), "TQ2_0");
  EXPECT_EQ(ggml_dtype(GgmlType::kBF16), DType::kBF16);
  EXPECT_EQ(ggml_dtype(GgmlType::kI32), DType::kI32);
  EXPECT_EQ(ggml_dtype(GgmlType::kQ8_0), std::nullopt);
  EXPECT_EQ(ggml_row_bytes(GgmlType::kQ4_K, 4096), 2304u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::kQ4_K, 4097), std::nullopt);
  EXPECT_EQ(ggml_row_bytes(GgmlType::kF32, std::uint64_t{1} << 62), std::nullopt);
}

TEST(GgmlTypes, HalvesAndBfloatsDecodeExactly) {
  EXPECT_EQ(f16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_float(0xc000), -2.0f);
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));  // the smallest subnormal
  EXPECT_EQ(f16_to_float(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_float(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f16_to_float(0x7e00)));
  EXPECT_TRUE(std::signbit(f16_to_float(0x8000)));
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xc0a0), -5.0f);
  EXPECT_EQ(Block(2).f16(0, 0x3555).decode(GgmlType::kF16)[0], f16_to_float(0x3555));
  EXPECT_EQ(Block(2).set(0, 0xa0).set(1, 0xc0).decode(GgmlType::kBF16)[0], -5.0f);
}

TEST(GgmlTypes, DequantizesQ8_0AndTheLegacyQuants) {
  // Q8_0: d, then 32 int8.
  const auto q8 = Block(34).f16(0, kHalf).set(2, 1).set(3, 0xfe).set(4, 127).set(5, 0x80).decode(
      GgmlType::kQ8_0);
  EXPECT_EQ(q8[0], 0.5f);
  EXPECT_EQ(q8[1], -1.0f);
  EXPECT_EQ(q8[2], 63.5f);
  EXPECT_EQ(q8[3], -64.0f);
  EXPECT_EQ(q8[31], 0.0f);

  // Q4_0: d, 16 bytes; element j is the low nibble of byte j, j + 16 the high one,
  // each minus 8.
  const auto q40 = Block(18).f16(0, kTwo).set(2, 0x9f).set(3, 0x08).decode(GgmlType::kQ4_0);
  EXPECT_EQ(q40[0], 14.0f);    // (15 - 8) * 2
  EXPECT_EQ(q40[16], 2.0f);    // (9 - 8) * 2
  EXPECT_EQ(q40[1], 0.0f);     // (8 - 8) * 2
  EXPECT_EQ(q40[17], -16.0f);  // (0 - 8) * 2

  // Q4_1: d, m, 16 bytes: d * q + m.
  const auto q41 = Block(20).f16(0, kHalf).f16(2, kMinusOne).set(4, 0x3a).decode(GgmlType::kQ4_1);
  EXPECT_EQ(q41[0], 4.0f);   // 10 * 0.5 - 1
  EXPECT_EQ(q41[16], 0.5f);  // 3 * 0.5 - 1
  EXPECT_EQ(q41[1], -1.0f);

  // Q5_0: d, qh (32 fifth bits, little-endian), 16 bytes: (q | h << 4) - 16.
  const auto q50 =
      Block(22).f16(0, kOne).set(2, 0x01).set(4, 0x01).set(6, 0x21).decode(GgmlType::kQ5_0);
  EXPECT_EQ(q50[0], 1.0f);   // 1 | 16, minus 16
  EXPECT_EQ(q50[16], 2.0f);  // 2 | 16 (bit 16 of qh), minus 16
  EXPECT_EQ(q50[1], -16.0f);
  EXPECT_EQ(q50[17], -16.0f);

  // Q5_1: d, m, qh, 16 bytes: d * (q | h << 4) + m.
  const auto q51 = Block(24)
                       .f16(0, kQuarter)
                       .f16(2, kOne)
                       .set(7, 0x80)
                       .set(8 + 15, 0xf0)
                       .decode(GgmlType::kQ5_1);
  EXPECT_EQ(q51[15], 1.0f);   // 0 * 0.25 + 1
  EXPECT_EQ(q51[31], 8.75f);  // (15 | 16) * 0.25 + 1: bit 31 of qh
  EXPECT_EQ(q51[30], 1.0f);   // byte 14 is 0
}

TEST(GgmlTypes, DequantizesQ2_KAndQ3_K) {
  // Q2_K: scales[16] (scale | min << 4), qs[64], d, dmin. Element 128 g + 32 s + l is
  // bits 2s of qs[32 g + l]; sub-block e / 16: d * scale * q - dmin * min.
  Block q2(84);
  q2.f16(80, kOne).f16(82, kHalf);
  q2.set(0, 0x21).set(2, 0x13).set(4, 0x05).set(6, 0xf1).set(8, 0x02);
  q2.set(16 + 0, 0xe4).set(16 + 32, 0x03);
  const auto y2 = q2.decode(GgmlType::kQ2_K);
  EXPECT_EQ(y2[0], -1.0f);   // 1 * 0 - 2 * 0.5
  EXPECT_EQ(y2[32], 2.5f);   // q 1, sub-block 2: 3 * 1 - 1 * 0.5
  EXPECT_EQ(y2[64], 10.0f);  // q 2, sub-block 4: 5 * 2 - 0
  EXPECT_EQ(y2[96], -4.5f);  // q 3, sub-block 6: 1 * 3 - 15 * 0.5
  EXPECT_EQ(y2[128], 6.0f);  // q 3 from qs[32], sub-block 8: 2 * 3
  EXPECT_EQ(y2[1], -1.0f);   // q 0, sub-block 0
  EXPECT_EQ(y2[255], 0.0f);

  // Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales, minus 32), d. A set hmask
  // bit (bit 4 g + s of hmask[l]) means no -4.
  Block q3(110);
  q3.f16(108, kOne);
  // Every scale 32 (0 after the offset): low nibbles 0, high bits 2 in bytes 8-11.
  for (std::size_t i = 96 + 8; i < 96 + 12; ++i) {
    q3.set(i, 0xaa);
  }
  q3.set(96 + 0, 0xe1);  // scale 0's low nibble 1, scale 8's low nibble 14
  q3.set(96 + 8, 0x9a);  // scale 8's high bits 1 (bits 4-5): 30, so -2; scale 0 keeps 2: 33, so 1
  q3.set(0, 0x01);       // hmask: element 0's bit set, element 128's (bit 4) clear
  q3.set(32 + 0, 0x03).set(32 + 32, 0x02);
  const auto y3 = q3.decode(GgmlType::kQ3_K);
  EXPECT_EQ(y3[0], 3.0f);    // q 3, no -4, scale 1
  EXPECT_EQ(y3[1], -4.0f);   // q 0 - 4, scale 1
  EXPECT_EQ(y3[128], 4.0f);  // q 2 - 4, scale -2
  EXPECT_EQ(y3[16], -0.0f);  // scale 0
  EXPECT_EQ(y3[255], -0.0f);
}

TEST(GgmlTypes, DequantizesQ4_KQ5_KAndQ6_K) {
  // Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, qs[128]. Sub-block t takes
  // nibble t % 2 of qs[32 (t / 2) + l]: d * scale - dmin * min.
  Block q4(144);
  q4.f16(0, kOne).f16(2, kOne);
  q4.set(4 + 0, 0x82);  // scale 0 = 2; top bits 2 are scale 4's high bits
  q4.set(4 + 4, 0x41);  // min 0 = 1; top bits 1 are min 4's high bits
  q4.set(4 + 8, 0x35);  // scale 4 = 5 | 2 << 4 = 37, min 4 = 3 | 1 << 4 = 19
  q4.set(16 + 0, 0x07).set(16 + 64, 0x0a);
  const auto y4 = q4.decode(GgmlType::kQ4_K);
  EXPECT_EQ(y4[0], 13.0f);     // 2 * 7 - 1
  EXPECT_EQ(y4[1], -1.0f);     // 2 * 0 - 1
  EXPECT_EQ(y4[128], 351.0f);  // 37 * 10 - 19
  EXPECT_EQ(y4[32], 0.0f);     // sub-block 1: scale 0, min 0

  // Q5_K: Q4_K's scales, then qh[32] (bit t of qh[l] is sub-block t's fifth bit).
  Block q5(176);
  q5.f16(0, kOne).f16(2, kOne).set(4, 0x82).set(8, 0x41).set(12, 0x35);
  q5.set(16 + 0, 0x10);  // qh[0]: sub-block 4's fifth bit for l = 0
  q5.set(48 + 0, 0x07).set(48 + 64, 0x0a);
  const auto y5 = q5.decode(GgmlType::kQ5_K);
  EXPECT_EQ(y5[0], 13.0f);
  EXPECT_EQ(y5[128], 943.0f);  // 37 * (10 | 16) - 19

  // Q6_K: ql[128], qh[64], scales[16] (int8), d. (low | high << 4) - 32.
  Block q6(210);
  q6.f16(208, kHalf);
  q6.set(192 + 0, 0xfd).set(192 + 2, 4).set(192 + 8, 2);  // scales -3, 4, 2
  q6.set(0, 0x05).set(128 + 0, 0x06);  // element 0: low 5, high 2; element 32: high 1
  q6.set(32, 0x01);                    // element 32's low nibble
  q6.set(64, 0x0f);                    // element 128's low nibble (qh[32] = 0)
  const auto y6 = q6.decode(GgmlType::kQ6_K);
  EXPECT_EQ(y6[0], -7.5f);     // 0.5 * -3 * ((5 | 32) - 32)
  EXPECT_EQ(y6[32], -30.0f);   // 0.5 * 4 * ((1 | 16) - 32)
  EXPECT_EQ(y6[128], -17.0f);  // 0.5 * 2 * (15 - 32)
  EXPECT_EQ(y6[64], -0.0f);    // scale 4 is 0
}

TEST(GgmlTypes, DequantizeRefusesOtherTypesByNameAndWrongSizes) {
  std::vector<std::byte> src(66);
  std::vector<float> out(256);
  const std::string e =
      error_of(Stage::kPostProcess, [&] { dequantize(GgmlType::kIQ2_XXS, src, out, "w"); });
  EXPECT_NE(e.find("tensor 'w': dequantizing IQ2_XXS is not supported"), std::string::npos) << e;
  std::vector<std::byte> q8(34 * 2);
  std::vector<float> wrong(32);
  EXPECT_NE(error_of(Stage::kPostProcess, [&] { dequantize(GgmlType::kQ8_0, q8, wrong); })
                .find("68 bytes and 32 floats are not the same whole number of blocks"),
            std::string::npos);
  EXPECT_FALSE(can_dequantize(GgmlType::kIQ4_NL));
  EXPECT_TRUE(can_dequantize(GgmlType::kQ5_K));
}

TEST(GgmlTypes, QuantizesQ8_0RoundingHalfAwayFromZero) {
  // max |x| 127: d = 1 exactly, so q = round(x), halves away from zero.
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 0.49f;
  x[4] = -126.6f;
  x[5] = 1.5f;
  std::vector<std::byte> q(34);
  quantize_q8_0(x, q);
  EXPECT_EQ(std::to_integer<int>(q[0]), 0x00);  // fp16 1.0 = 0x3c00, little-endian
  EXPECT_EQ(std::to_integer<int>(q[1]), 0x3c);
  const auto qi = [&](int j) { return static_cast<std::int8_t>(std::to_integer<int>(q[2 + j])); };
  EXPECT_EQ(qi(0), 127);
  EXPECT_EQ(qi(1), 3);
  EXPECT_EQ(qi(2), -3);
  EXPECT_EQ(qi(3), 0);
  EXPECT_EQ(qi(4), -127);
  EXPECT_EQ(qi(5), 2);

  // max 16: d = 16 / 127 = 0.12598..., stored as fp16 0x3008 (0.1259765625).
  for (int j = 0; j < 32; ++j) {
    x[static_cast<std::size_t>(j)] = static_cast<float>(j - 16);
  }
  quantize_q8_0(x, q);
  EXPECT_EQ(std::to_integer<int>(q[0]) | (std::to_integer<int>(q[1]) << 8), 0x3008);
  EXPECT_EQ(qi(0), -127);
  EXPECT_EQ(qi(17), 8);   // 1 * 127 / 16 = 7.94
  EXPECT_EQ(qi(18), 16);  // 15.875
  std::vector<float> back(32);
  dequantize(GgmlType::kQ8_0, q, back);
  for (int j = 0; j < 32; ++j) {
    EXPECT_NEAR(back[static_cast<std::size_t>(j)], j - 16, 0.07) << j;
  }

  // A zero block, and one so small that 1 / d overflows: all zeros.
  for (float tiny : {0.0f, 1e-38f}) {
    std::fill(x.begin(), x.end(), tiny);
    quantize_q8_0(x, q);
    for (std::size_t i = 2; i < 34; ++i) {
      EXPECT_EQ(std::to_integer<int>(q[i]), 0) << tiny;
    }
  }
}

TEST(GgmlTypes, QuantizeRefusesNonFiniteValuesAndWrongSizes) {
  std::vector<float> x(64, 1.0f);
  x[40] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::byte> q(68);
  EXPECT_NE(error_of(Stage::kSynth, [&] { quantize_q8_0(x, q, "w"); })
                .find("tensor 'w': Q8_0: value 40 is not finite"),
            std::string::npos);
  std::vector<float> odd(33);
  std::vector<std::byte> q34(34);
  EXPECT_NE(
      error_of(Stage::kSynth, [&] { quantize_q8_0(odd, q34); }).find("33 floats and 34 bytes"),
      std::string::npos);
}

}  // namespace
}  // namespace ferry::io
