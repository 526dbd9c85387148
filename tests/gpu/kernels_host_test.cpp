// The host twins of the device kernels: conversions against hand-computed bit
// patterns, against an independent nearest-value oracle, and the fill/cast loops.
#include "gpu/kernels_host.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/fp8.hpp"
#include "gpu/fill_random.hpp"
#include "testing/dtype_codec.hpp"

namespace ferry::gpu::host {
namespace {

struct Case32to16 {
  std::uint32_t in;
  std::uint16_t out;
};

TEST(KernelsHostTest, F32ToBF16KnownPatterns) {
  const Case32to16 cases[] = {
      {0x3F800000, 0x3F80},                        // 1.0
      {0xBF800000, 0xBF80},                        // -1.0
      {0x3A83126F, 0x3A83},                        // 1e-3 (low half 0x126F < 0x8000: rounds down)
      {0x00000000, 0x0000}, {0x80000000, 0x8000},  // +-0
      {0x3F808000, 0x3F80},                        // tie, lower neighbour even: down
      {0x3F818000, 0x3F82},                        // tie, lower neighbour odd: up
      {0x3F808001, 0x3F81},                        // just above a tie: up
      {0x3F807FFF, 0x3F80},                        // just below a tie: down
      {0x7F7FFFFF, 0x7F80},                        // F32 max rounds to inf
      {0x7F7F7FFF, 0x7F7F},                        // stays at BF16 max
      {0x7F800000, 0x7F80}, {0xFF800000, 0xFF80},  // +-inf
      {0x00000001, 0x0000},                        // tiny subnormal rounds to 0
      {0x00008000, 0x0000},  // tie between 0 and the smallest BF16 subnormal: even (0)
      {0x00018000, 0x0002},  // tie, odd lower neighbour: up
      {0x00010000, 0x0001},  // smallest BF16 subnormal, exact
      {0x807FFFFF, 0x8080},  // largest F32 subnormal rounds up to the smallest normal
      {0x7FC00000, 0x7FC0},  // quiet NaN
      {0x7F800001, 0x7FC0},  // signalling NaN: canonical quiet NaN
      {0xFFC00001, 0xFFC0},  // negative NaN keeps its sign
      {0x7FFFFFFF, 0x7FC0},  // a NaN that a naive rounding add would wrap
  };
  for (const auto& c : cases) {
    EXPECT_EQ(f32_to_bf16(c.in), c.out) << std::hex << c.in;
  }
}

TEST(KernelsHostTest, BF16ToF32IsExactAndCanonicalisesNaN) {
  EXPECT_EQ(bf16_to_f32(0x3F80), 0x3F800000u);
  EXPECT_EQ(bf16_to_f32(0x0001), 0x00010000u);
  EXPECT_EQ(bf16_to_f32(0x8000), 0x80000000u);
  EXPECT_EQ(bf16_to_f32(0x7F80), 0x7F800000u);
  EXPECT_EQ(bf16_to_f32(0xFF80), 0xFF800000u);
  EXPECT_EQ(bf16_to_f32(0x7FC1), 0x7FC00000u);
  EXPECT_EQ(bf16_to_f32(0x7F81), 0x7FC00000u);
  EXPECT_EQ(bf16_to_f32(0xFF81), 0xFFC00000u);
}

TEST(KernelsHostTest, F32ToF16KnownPatterns) {
  const Case32to16 cases[] = {
      {0x3F800000, 0x3C00},  // 1.0
      {0x3A83126F, 0x1419},  // 1e-3 (0x1418 + round up: remainder 0x126F > 0x1000)
      {0x477FE000, 0x7BFF},  // 65504, the largest F16
      {0x477FEFFF, 0x7BFF},  // just below the tie with 2^16
      {0x477FF000, 0x7C00},  // 65520: tie, goes to the even neighbour: inf
      {0x47C35000, 0x7C00},  // 1e5 overflows
      {0xC7C35000, 0xFC00},  // -1e5
      {0x7F800000, 0x7C00}, {0xFF800000, 0xFC00},  // +-inf
      {0x38800000, 0x0400},                        // 2^-14, the smallest normal
      {0x33800000, 0x0001},                        // 2^-24, the smallest subnormal
      {0x33000000, 0x0000},                        // 2^-25: tie between 0 and 2^-24: even (0)
      {0xB3000000, 0x8000},                        // -2^-25: -0
      {0x33000001, 0x0001},                        // just above: up
      {0x33400000, 0x0001},                        // 0.75 * 2^-24: up
      {0x33C00000, 0x0002},                        // 1.5 * 2^-24: tie, odd lower neighbour: up
      {0x34200000, 0x0002},                        // 2.5 * 2^-24: tie, even lower neighbour: down
      {0x387FE000, 0x0400},  // 1023.5 * 2^-24: tie rounds up into the normal range
      {0x387FC000, 0x03FF},  // 1023 * 2^-24, the largest subnormal
      {0x3F801000, 0x3C00},  // 1 + 2^-11: tie, even: down
      {0x3F803000, 0x3C02},  // 1 + 3 * 2^-11: tie, odd: up
      {0x3F801001, 0x3C01},  // just above a tie
      {0x3FFFF000, 0x4000},  // 2 - 2^-11: tie, rounding carries into the exponent
      {0x00000001, 0x0000},  // F32 subnormal
      {0x80000000, 0x8000}, {0x7FC00000, 0x7E00},  // NaN
      {0x7F800001, 0x7E00},                        // signalling NaN
      {0xFFC12345, 0xFE00},                        // negative NaN keeps its sign
  };
  for (const auto& c : cases) {
    EXPECT_EQ(f32_to_f16(c.in), c.out) << std::hex << c.in;
  }
}

TEST(KernelsHostTest, F16ToF32KnownPatterns) {
  EXPECT_EQ(f16_to_f32(0x3C00), 0x3F800000u);
  EXPECT_EQ(f16_to_f32(0x0001), 0x33800000u);  // 2^-24
  EXPECT_EQ(f16_to_f32(0x03FF), 0x387FC000u);  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x0400), 0x38800000u);
  EXPECT_EQ(f16_to_f32(0x7BFF), 0x477FE000u);
  EXPECT_EQ(f16_to_f32(0x8000), 0x80000000u);
  EXPECT_EQ(f16_to_f32(0x7C00), 0x7F800000u);
  EXPECT_EQ(f16_to_f32(0xFC00), 0xFF800000u);
  EXPECT_EQ(f16_to_f32(0x7E01), 0x7FC00000u);
  EXPECT_EQ(f16_to_f32(0xFD00), 0xFFC00000u);  // negative signalling NaN
}

bool f16_is_nan(std::uint16_t h) {
  return (h & 0x7FFF) > 0x7C00;
}
bool bf16_is_nan(std::uint16_t h) {
  return (h & 0x7FFF) > 0x7F80;
}

TEST(KernelsHostTest, Every16BitValueRoundTripsThroughF32) {
  for (std::uint32_t i = 0; i < 65536; ++i) {
    auto h = static_cast<std::uint16_t>(i);
    if (!f16_is_nan(h)) {
      ASSERT_EQ(f32_to_f16(f16_to_f32(h)), h) << std::hex << i;
      // The widened value is exactly the F16 value.
      double want = std::ldexp(((h >> 10) & 0x1F) == 0 ? (h & 0x3FF) : ((h & 0x3FF) | 0x400),
                               std::max(1, (h >> 10) & 0x1F) - 25);
      if (((h >> 10) & 0x1F) == 0x1F) {
        want = std::numeric_limits<double>::infinity();
      }
      if (h & 0x8000) {
        want = -want;
      }
      ASSERT_EQ(static_cast<double>(std::bit_cast<float>(f16_to_f32(h))), want) << std::hex << i;
    }
    if (!bf16_is_nan(h)) {
      ASSERT_EQ(f32_to_bf16(bf16_to_f32(h)), h) << std::hex << i;
    }
  }
}

// Nearest-value oracle that knows nothing about bit tricks: `table` holds the
// positive finite values of a format by code, followed by the "overflow" value
// 2^(emax+1) standing for infinity (IEEE rounds to infinity exactly when the
// unbounded-exponent result would reach it).
std::uint16_t oracle(const std::vector<double>& table, float x) {
  double a = std::fabs(static_cast<double>(x));
  std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  auto hi = std::upper_bound(table.begin(), table.end(), a);
  if (hi == table.end()) {
    return static_cast<std::uint16_t>(sign | (table.size() - 1));  // at or past the overflow value
  }
  auto lo = std::prev(hi);
  double below = a - *lo;
  double above = *hi - a;
  auto lo_code = static_cast<std::uint16_t>(lo - table.begin());
  std::uint16_t code = lo_code;
  if (above < below || (above == below && (lo_code & 1) != 0)) {
    code = static_cast<std::uint16_t>(lo_code + 1);
  }
  return sign | code;
}

std::vector<double> format_table(int mantissa_bits, int exponent_bits) {
  int bias = (1 << (exponent_bits - 1)) - 1;
  std::uint32_t inf_code = static_cast<std::uint32_t>((1 << exponent_bits) - 1) << mantissa_bits;
  std::vector<double> table;
  for (std::uint32_t code = 0; code < inf_code; ++code) {
    std::uint32_t e = code >> mantissa_bits;
    std::uint32_t m = code & ((1u << mantissa_bits) - 1);
    double mant = e == 0 ? m : (m | (1u << mantissa_bits));
    table.push_back(std::ldexp(mant, static_cast<int>(std::max(e, 1u)) - bias - mantissa_bits));
  }
  table.push_back(std::ldexp(1.0, bias + 1));  // code inf_code: infinity
  return table;
}

TEST(KernelsHostTest, NarrowingMatchesANearestValueOracle) {
  const std::vector<double> f16 = format_table(10, 5);
  const std::vector<double> bf16 = format_table(7, 8);
  ASSERT_EQ(f16.size(), 0x7C01u);
  ASSERT_EQ(bf16.size(), 0x7F81u);
  std::mt19937 rng(42);
  for (int i = 0; i < 300000; ++i) {
    std::uint32_t bits = rng();
    if (i % 2 == 1) {  // most random patterns are far outside F16's range
      bits = (bits & 0x807FFFFFu) | ((96u + bits % 52u) << 23);
    }
    if (i % 5 == 0) {  // force exact ties of either format
      bits = (i % 10 == 0) ? ((bits & 0xFFFF0000u) | 0x8000u) : ((bits & 0xFFFFE000u) | 0x1000u);
    }
    float x = std::bit_cast<float>(bits);
    if (std::isnan(x)) {
      continue;
    }
    ASSERT_EQ(f32_to_f16(bits), oracle(f16, x)) << std::hex << bits;
    ASSERT_EQ(f32_to_bf16(bits), oracle(bf16, x)) << std::hex << bits;
  }
}

TEST(KernelsHostTest, FillPatternRoundsThroughF32) {
  EXPECT_EQ(fill_pattern(DType::kBF16, 1e-3), 0x3A83u);
  EXPECT_EQ(fill_pattern(DType::kF16, 1e-3), 0x1419u);
  EXPECT_EQ(fill_pattern(DType::kF32, 1e-3), 0x3A83126Fu);
  EXPECT_EQ(fill_pattern(DType::kF64, 1e-3), 0x3F50624DD2F1A9FCull);
  EXPECT_EQ(fill_pattern(DType::kF32, -0.0), 0x80000000u);
  EXPECT_EQ(fill_pattern(DType::kF16, 65520.0), 0x7C00u);
  EXPECT_EQ(fill_pattern(DType::kF32, 1e40), 0x7F800000u);  // past float's range: inf
  EXPECT_EQ(fill_pattern(DType::kF32, -1e300), 0xFF800000u);
  EXPECT_EQ(fill_pattern(DType::kBF16, 1e40), 0x7F80u);
  EXPECT_EQ(fill_pattern(DType::kF32, std::numeric_limits<double>::quiet_NaN()), 0x7FC00000u);
  EXPECT_EQ(fill_pattern(DType::kF16, -std::numeric_limits<double>::quiet_NaN()), 0xFE00u);
  // Just above FLT_MAX but below the rounding midpoint: stays FLT_MAX.
  EXPECT_EQ(fill_pattern(DType::kF32, 0x1.fffffe8p+127), 0x7F7FFFFFu);
  EXPECT_EQ(fill_pattern(DType::kF32, 0x1.ffffffp+127), 0x7F800000u);
  EXPECT_THROW(fill_pattern(DType::kI32, 1.0), Error);
  EXPECT_THROW(fill_pattern(DType::kF8E4M3, 1.0), Error);
}

TEST(KernelsHostTest, FillWritesEveryElementAtAnyAlignment) {
  std::vector<std::byte> buf(2 + 5 * 2 + 2, std::byte{0xEE});
  fill(buf.data() + 1, 5, DType::kF16, 1e-3);  // odd address
  EXPECT_EQ(buf[0], std::byte{0xEE});
  for (int i = 0; i < 5; ++i) {
    std::uint16_t v;
    std::memcpy(&v, buf.data() + 1 + 2 * i, 2);
    EXPECT_EQ(v, 0x1419);
  }
  EXPECT_EQ(buf[11], std::byte{0xEE});
  fill(buf.data(), 0, DType::kF64, 1.0);  // nothing
  EXPECT_EQ(buf[0], std::byte{0xEE});
}

TEST(KernelsHostTest, LargeFillsWriteEveryElementAndNothingAround) {
  // Past the element-by-element head, fills copy their own prefix in blocks: check
  // every element of counts around the block edges, at an odd address.
  for (DType dtype : {DType::kBF16, DType::kF32, DType::kF64}) {
    const std::size_t es = dtype_size(dtype);
    const std::uint64_t pattern = fill_pattern(dtype, 1e-3);
    for (std::size_t count : {std::size_t{4096} / es - 1, std::size_t{4096} / es + 1,
                              (std::size_t{3} << 20) / es + 7}) {
      std::vector<std::byte> buf(count * es + 2, std::byte{0xEE});
      fill(buf.data() + 1, count, dtype, 1e-3);
      ASSERT_EQ(buf.front(), std::byte{0xEE});
      ASSERT_EQ(buf.back(), std::byte{0xEE});
      for (std::size_t i = 0; i < count; ++i) {
        std::uint64_t v = 0;
        std::memcpy(&v, buf.data() + 1 + i * es, es);
        ASSERT_EQ(v, pattern) << dtype_name(dtype) << " count " << count << " element " << i;
      }
    }
  }
}

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  std::vector<std::byte> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

TEST(KernelsHostTest, CastConvertsElementwise) {
  std::vector<std::byte> src =
      bytes_of(std::vector<std::uint32_t>{0x3F800000, 0x3A83126F, 0x7F800001});
  std::vector<std::byte> dst(3 * 2 + 1);
  cast(dst.data() + 1, DType::kF16, src.data(), DType::kF32, 3);  // unaligned destination
  std::uint16_t out[3];
  std::memcpy(out, dst.data() + 1, 6);
  EXPECT_EQ(out[0], 0x3C00);
  EXPECT_EQ(out[1], 0x1419);
  EXPECT_EQ(out[2], 0x7E00);

  std::vector<std::byte> back(12);
  cast(back.data(), DType::kF32, dst.data() + 1, DType::kF16, 3);
  std::uint32_t wide[3];
  std::memcpy(wide, back.data(), 12);
  EXPECT_EQ(wide[0], 0x3F800000u);
  EXPECT_EQ(wide[1], f16_to_f32(0x1419));
  EXPECT_EQ(wide[2], 0x7FC00000u);
}

TEST(KernelsHostTest, CastSameDtypeIsAPlainCopyKeepingNaNPayloads) {
  std::vector<std::byte> src = bytes_of(std::vector<std::uint32_t>{0x7F800001, 0xFFC12345});
  std::vector<std::byte> dst(8);
  cast(dst.data(), DType::kF32, src.data(), DType::kF32, 2);
  EXPECT_EQ(dst, src);
}

TEST(KernelsHostTest, CastInPlaceBetweenEqualSizes) {
  std::vector<std::uint16_t> values(65536);
  for (std::size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<std::uint16_t>(i);
  }
  std::vector<std::byte> in_place = bytes_of(values);
  std::vector<std::byte> separate(in_place.size());
  cast(separate.data(), DType::kBF16, in_place.data(), DType::kF16, values.size());
  cast(in_place.data(), DType::kBF16, in_place.data(), DType::kF16, values.size());
  EXPECT_EQ(in_place, separate);
  // Spot-check: F16 1.0 is BF16 1.0; F16 65504 rounds to BF16 65536 (0x4780).
  std::uint16_t v;
  std::memcpy(&v, separate.data() + 2 * 0x3C00, 2);
  EXPECT_EQ(v, 0x3F80);
  std::memcpy(&v, separate.data() + 2 * 0x7BFF, 2);
  EXPECT_EQ(v, 0x4780);
}

TEST(KernelsHostTest, CastRejectsOtherDtypes) {
  std::vector<std::byte> a(16), b(16);
  EXPECT_THROW(cast(a.data(), DType::kF32, b.data(), DType::kI32, 2), Error);
  EXPECT_THROW(cast(a.data(), DType::kF64, b.data(), DType::kF32, 2), Error);
  try {
    cast(a.data(), DType::kF8E4M3, b.data(), DType::kBF16, 2);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(e.rule().find("BF16 -> F8_E4M3"), std::string::npos) << e.rule();
  }
}

// The E4M3 encoder (common/fp8.hpp: bit arithmetic, shared with the CUDA kernel)
// against an independent oracle, a search of the 254 finite codes for the nearest
// (ties to the even code): every BF16-exact value, and random F32 values of every
// magnitude.
TEST(KernelsHostTest, E4m3EncoderMatchesTheNearestCodeSearch) {
  auto check = [](std::uint32_t f) {
    const float v = std::bit_cast<float>(f);
    const std::uint8_t got = e4m3_from_f32_bits(f);
    if (std::isnan(v)) {
      ASSERT_EQ(got, 0x7F) << std::hex << f;
      return;
    }
    // Saturated beyond the largest finite value; the search's own float arithmetic
    // cannot tell 384 from 448 for huge inputs.
    const float want =
        std::fabs(v) >= 448.0f ? std::copysign(448.0f, v) : testing::round_to_e4m3(v);
    ASSERT_EQ(testing::e4m3_value(got), want) << std::hex << f << " " << v;
    ASSERT_EQ((got & 0x80) != 0, std::signbit(v)) << std::hex << f;
  };
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    check(b << 16);
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    check(static_cast<std::uint32_t>(rng()));
  }
}

// The span encoder (branch-free, for online quantization) agrees with the bit
// encoder on every scaled value: all F32 patterns up to and past 448 whose low 12
// bits are one of the rounding cases (exact, just above, half, just past half,
// all ones), either sign, NaN, and the multiplier's effect.
TEST(KernelsHostTest, SpanE4m3EncoderMatchesTheBitEncoder) {
  std::vector<float> x;
  for (std::uint32_t top = 0; top <= (0x44000000u >> 12); ++top) {
    for (std::uint32_t low : {0x0u, 0x1u, 0x7FFu, 0x800u, 0x801u, 0xFFFu}) {
      for (std::uint32_t sign : {0x0u, 0x80000000u}) {
        x.push_back(std::bit_cast<float>(sign | (top << 12) | low));
      }
    }
  }
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  x.push_back(-std::numeric_limits<float>::quiet_NaN());
  x.push_back(std::numeric_limits<float>::infinity());
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(1e30f);
  for (const float mul : {1.0f, 3.0f, 0.25f}) {
    std::vector<std::uint8_t> q(x.size());
    scale_to_e4m3(x.data(), x.size(), mul, q.data());
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(q[i], e4m3_from_f32_bits(std::bit_cast<std::uint32_t>(x[i] * mul)))
          << std::hex << std::bit_cast<std::uint32_t>(x[i]) << " * " << mul;
    }
  }
}

// `value` rounded to `dtype` and back.
float rounded(DType dtype, double value) {
  const float f = static_cast<float>(value);
  std::byte narrow[4]{};
  std::byte wide[4]{};
  cast(narrow, dtype, reinterpret_cast<const std::byte*>(&f), DType::kF32, 1);
  cast(wide, DType::kF32, narrow, dtype, 1);
  float out = 0;
  std::memcpy(&out, wide, 4);
  return out;
}

// Element i depends on (seed, i) only: any sub-range filled with seed + k is the
// whole fill's tail; floats lie in [low, high] after rounding, roughly uniformly;
// another seed gives other bytes.
TEST(KernelsHostTest, FillRandomIsCounterBasedInRangeAndUniform) {
  constexpr std::size_t kCount = 100000;
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kU8}) {
    const std::size_t es = dtype_size(dtype);
    const double low = dtype == DType::kF8E4M3 ? -448.0 : -1e-3;
    const double high = -low;
    std::vector<std::byte> whole(kCount * es + 1);
    fill_random(whole.data(), kCount, dtype, low, high, 1234);
    std::vector<std::byte> tail((kCount - 777) * es + 1);
    fill_random(tail.data() + 1, kCount - 777, dtype, low, high, 1234 + 777);  // misaligned
    ASSERT_EQ(0, std::memcmp(tail.data() + 1, whole.data() + 777 * es, (kCount - 777) * es))
        << dtype_name(dtype);
    std::vector<std::byte> other(kCount * es + 1);
    fill_random(other.data(), kCount, dtype, low, high, 1235);
    EXPECT_NE(0, std::memcmp(other.data(), whole.data(), kCount * es)) << dtype_name(dtype);
    // Ten bins over [low, high] (U8: over 0..255): each holds about a tenth.
    std::vector<std::size_t> bins(10, 0);
    for (std::size_t i = 0; i < kCount; ++i) {
      double v = 0;
      const std::byte* p = whole.data() + i * es;
      if (dtype == DType::kU8) {
        v = static_cast<double>(static_cast<std::uint8_t>(*p)) / 256.0;
      } else {
        float f = 0;
        if (dtype == DType::kF8E4M3) {
          f = e4m3_to_float(static_cast<std::uint8_t>(*p));
        } else {
          std::byte widened[4]{};
          cast(widened, DType::kF32, p, dtype, 1);
          std::memcpy(&f, widened, 4);
        }
        // The bounds as the dtype rounds them (1e-3 is 0.0010004 in F16).
        const float bound = dtype == DType::kF8E4M3 ? 448.0f : rounded(dtype, high);
        ASSERT_GE(f, -bound) << dtype_name(dtype) << " element " << i;
        ASSERT_LE(f, bound) << dtype_name(dtype) << " element " << i;
        v = (f - low) / (high - low);
      }
      ++bins[std::min<std::size_t>(9, static_cast<std::size_t>(v * 10))];
    }
    for (std::size_t b = 0; b < bins.size(); ++b) {
      // E4M3 is denser near 0, so its bins are only checked for being used.
      if (dtype == DType::kF8E4M3) {
        EXPECT_GT(bins[b], kCount / 40) << "bin " << b;
      } else {
        EXPECT_NEAR(static_cast<double>(bins[b]), kCount / 10.0, kCount / 100.0)
            << dtype_name(dtype) << " bin " << b;
      }
    }
  }
  std::byte one[8];
  EXPECT_THROW(fill_random(one, 1, DType::kF64, 0, 1, 1), Error);
  EXPECT_THROW(fill_random(one, 1, DType::kI32, 0, 1, 1), Error);
}

// matches_pattern against a naive reference written element by element with the
// pattern's bytes spelled out (little-endian), over every element size, at odd
// alignments and lengths, with one element changed at the first and last place.
bool naive_matches(const std::vector<std::byte>& buf, std::size_t at, std::size_t bytes,
                   std::uint64_t pattern, std::uint32_t es) {
  for (std::size_t e = 0; (e + 1) * es <= bytes; ++e) {
    for (std::uint32_t k = 0; k < es; ++k) {
      if (buf[at + e * es + k] != static_cast<std::byte>((pattern >> (8 * k)) & 0xFF)) {
        return false;
      }
    }
  }
  return true;
}

TEST(KernelsHostTest, MatchesPatternAgreesWithANaiveReference) {
  const std::uint64_t pattern = 0x0807060504030201ull;
  for (std::uint32_t es : {1u, 2u, 4u, 8u}) {
    for (std::size_t shift : {0u, 1u, 3u}) {
      for (std::size_t bytes : {std::size_t{0}, std::size_t{es - 1}, std::size_t{es},
                                std::size_t{es * 5 + 1}, std::size_t{8191}, std::size_t{8192}}) {
        std::vector<std::byte> buf(shift + bytes + 8, std::byte{0xEE});
        for (std::size_t j = 0; j < bytes; ++j) {
          buf[shift + j] = static_cast<std::byte>((pattern >> (8 * (j % es))) & 0xFF);
        }
        SCOPED_TRACE("es " + std::to_string(es) + " shift " + std::to_string(shift) + " bytes " +
                     std::to_string(bytes));
        EXPECT_TRUE(matches_pattern(buf.data() + shift, bytes, pattern, es));
        EXPECT_TRUE(naive_matches(buf, shift, bytes, pattern, es));
        const std::size_t whole = bytes / es * es;
        if (whole == 0) {
          continue;  // no whole element: vacuously the pattern, whatever follows
        }
        for (std::size_t at : {std::size_t{0}, whole - 1}) {  // first, last byte compared
          std::vector<std::byte> bad = buf;
          bad[shift + at] ^= std::byte{0x40};
          EXPECT_FALSE(matches_pattern(bad.data() + shift, bytes, pattern, es)) << at;
          EXPECT_FALSE(naive_matches(bad, shift, bytes, pattern, es)) << at;
        }
        if (whole < bytes) {  // the tail after the last whole element is not read
          std::vector<std::byte> tail = buf;
          tail[shift + whole] ^= std::byte{0x40};
          EXPECT_TRUE(matches_pattern(tail.data() + shift, bytes, pattern, es));
        }
      }
    }
  }
}

// ---- FP8 twins (dequantize_fp8, quantize_fp8, pack_ue8m0) against naive
// references written from the formulas (gpu/fp8.hpp), with the test's own E4M3
// decoding and nearest-code search (testing/dtype_codec.hpp) ----------------------

struct Fp8Case {
  std::size_t rows, cols, batches;
  Fp8Scales scales;
};

// Shapes that are not multiples of their blocks, single rows and columns, batches.
std::vector<Fp8Case> fp8_cases() {
  const Fp8Scales tensor{Fp8Granularity::kTensor, 0, 0, 1};
  const Fp8Scales row{Fp8Granularity::kRow, 0, 0, 1};
  return {
      {5, 7, 1, {Fp8Granularity::kBlock, 2, 3, 1}},
      {130, 260, 2, {Fp8Granularity::kBlock, 128, 128, 1}},
      {9, 4, 3, {Fp8Granularity::kBlock, 4, 8, 1}},  // one column block, wider than the matrix
      {1, 1, 1, {Fp8Granularity::kBlock, 1, 1, 1}},
      {6, 33, 2, row},
      {1, 100, 1, row},
      {7, 9, 3, tensor},
      {64, 64, 1, tensor},
      {3, 5, 2, Fp8Scales{Fp8Granularity::kTensor, 0, 0, 4}},  // repeated tensor scale
  };
}

// Scale index of (r, c), written out per granularity.
std::size_t naive_scale_index(const Fp8Scales& l, std::size_t r, std::size_t c, std::size_t cols) {
  if (l.granularity == Fp8Granularity::kRow) {
    return r;
  }
  if (l.granularity == Fp8Granularity::kTensor) {
    return 0;
  }
  const std::size_t per_row = (cols + l.block_cols - 1) / l.block_cols;
  return (r / l.block_rows) * per_row + c / l.block_cols;
}

std::size_t naive_scale_count(const Fp8Scales& l, std::size_t rows, std::size_t cols) {
  if (l.granularity == Fp8Granularity::kRow) {
    return rows;
  }
  if (l.granularity == Fp8Granularity::kTensor) {
    return 1;
  }
  return ((rows + l.block_rows - 1) / l.block_rows) * ((cols + l.block_cols - 1) / l.block_cols);
}

// Every E4M3 code, in a shuffled order, with the NaN codes among them.
std::vector<std::uint8_t> fp8_codes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = static_cast<std::uint8_t>(i < 256 ? i : rng());
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

// The BF16 / F16 value nearest `v` (ties to the even code), by binary search over
// the codes of one sign ordered by magnitude, values compared in double; past the
// largest finite value, rounding to infinity as IEEE does (at and beyond half an
// ulp above it).
float nearest_16(float v, DType dtype) {
  auto value = [dtype](std::uint32_t code) {
    return dtype == DType::kBF16
               ? static_cast<double>(std::bit_cast<float>(code << 16))
               : static_cast<double>(testing::half_to_float(static_cast<std::uint16_t>(code)));
  };
  const std::uint32_t inf_code = dtype == DType::kBF16 ? 0x7F80u : 0x7C00u;
  const double a = std::fabs(static_cast<double>(v));
  std::uint32_t lo = 0;
  std::uint32_t hi = inf_code;  // value(lo) <= a < value(hi) while searching
  if (a >= value(inf_code)) {
    lo = inf_code;
  } else {
    while (hi - lo > 1) {
      const std::uint32_t mid = (lo + hi) / 2;
      (value(mid) <= a ? lo : hi) = mid;
    }
    const double below = a - value(lo);
    const double above = hi == inf_code
                             ? value(hi - 1) + (value(hi - 1) - value(hi - 2)) - a  // next ulp
                             : value(hi) - a;
    if (above < below || (above == below && lo % 2 == 1)) {
      lo = hi;
    }
  }
  const double mag = value(lo);
  return static_cast<float>(std::signbit(v) ? -mag : mag);
}

float bits_float(std::uint32_t bits) {
  return std::bit_cast<float>(bits);
}

TEST(KernelsHostTest, DequantizeFp8MatchesTheNaiveReference) {
  for (const Fp8Case& c : fp8_cases()) {
    const std::size_t n = c.rows * c.cols * c.batches;
    const std::size_t per = naive_scale_count(c.scales, c.rows, c.cols);
    const std::vector<std::uint8_t> q = fp8_codes(n, 3);
    std::vector<float> scales(per * c.batches);
    std::mt19937 rng(5);
    for (std::size_t i = 0; i < scales.size(); ++i) {
      scales[i] = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f,
                             static_cast<int>(rng() % 40) - 30);
    }
    // Edge scales: zero, infinity (0 * inf is NaN), NaN, a huge one (overflow to inf).
    scales[0] = scales.size() > 1 ? 1e38f : scales[0];
    if (scales.size() > 3) {
      scales[1] = 0.0f;
      scales[2] = std::numeric_limits<float>::infinity();
      scales[3] = -std::numeric_limits<float>::quiet_NaN();
    }
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      const std::size_t es = dtype_size(dtype);
      std::vector<std::byte> out(n * es + 8, std::byte{0x5A});
      dequantize_fp8(out.data(), dtype, reinterpret_cast<const std::byte*>(q.data()),
                     reinterpret_cast<const std::byte*>(scales.data()), c.scales, c.rows, c.cols,
                     c.batches);
      for (std::size_t k = n * es; k < out.size(); ++k) {
        ASSERT_EQ(out[k], std::byte{0x5A}) << "wrote past the end";
      }
      for (std::size_t b = 0; b < c.batches; ++b) {
        for (std::size_t r = 0; r < c.rows; ++r) {
          for (std::size_t col = 0; col < c.cols; ++col) {
            const std::size_t i = (b * c.rows + r) * c.cols + col;
            const float s = scales[b * per + naive_scale_index(c.scales, r, col, c.cols)];
            const float want32 = testing::e4m3_value(q[i]) * s;
            const float got = testing::decode_one(out.data() + i * es, dtype);
            if (std::isnan(want32)) {
              ASSERT_TRUE(std::isnan(got)) << i;
              continue;
            }
            const float want = dtype == DType::kF32 ? want32 : nearest_16(want32, dtype);
            ASSERT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(want))
                << dtype_name(dtype) << " element " << i << " code " << int(q[i]) << " scale " << s;
          }
        }
      }
    }
  }
}

// A NaN result is the target's canonical NaN, with the NaN operand's sign.
TEST(KernelsHostTest, DequantizeFp8NaNIsCanonical) {
  const std::uint8_t q[4] = {0x7F, 0xFF, 0x38, 0x00};  // NaN, -NaN, 1, 0
  const float nan_scale = bits_float(0xFFC01234u);     // a negative NaN with a payload
  const float scales[4] = {1.0f, 1.0f, nan_scale, std::numeric_limits<float>::infinity()};
  std::uint32_t out[4];
  dequantize_fp8(reinterpret_cast<std::byte*>(out), DType::kF32,
                 reinterpret_cast<const std::byte*>(q), reinterpret_cast<const std::byte*>(scales),
                 Fp8Scales{Fp8Granularity::kRow, 0, 0, 1}, 4, 1, 1);
  EXPECT_EQ(out[0], 0x7FC00000u);
  EXPECT_EQ(out[1], 0xFFC00000u);
  EXPECT_EQ(out[2], 0xFFC00000u);  // the scale's sign, no payload
  EXPECT_EQ(out[3], 0xFFC00000u);  // 0 * inf
  std::uint16_t bf16[4];
  dequantize_fp8(reinterpret_cast<std::byte*>(bf16), DType::kBF16,
                 reinterpret_cast<const std::byte*>(q), reinterpret_cast<const std::byte*>(scales),
                 Fp8Scales{Fp8Granularity::kRow, 0, 0, 1}, 4, 1, 1);
  EXPECT_EQ(bf16[0], 0x7FC0u);
  EXPECT_EQ(bf16[1], 0xFFC0u);
}

// The scale rules from their SGLang definitions, written independently.
struct NaiveScale {
  float scale;
  float mul;
};
NaiveScale naive_scale(float amax, Fp8ScaleRule rule) {
  switch (rule) {
    case Fp8ScaleRule::kAmax: {
      const float s = amax / 448.0f;
      return {s, s == 0.0f ? 0.0f : 1.0f / s};
    }
    case Fp8ScaleRule::kAmaxOrOne: {
      const float s = amax == 0.0f ? 1.0f : amax / 448.0f;
      return {s, 1.0f / s};
    }
    case Fp8ScaleRule::kInputToFloat8: {
      const float m = 448.0f / std::max(amax, 1e-12f);
      return {1.0f / m, m};
    }
    case Fp8ScaleRule::kStatic:
      return {amax, 1.0f / amax};  // no amax: the static scale (its own test)
    case Fp8ScaleRule::kUe8m0:
      break;
  }
  const float x = std::max(amax, 1e-4f) / 448.0f;
  int e = 0;
  const float frac = std::frexp(x, &e);  // x = frac * 2^e, frac in [0.5, 1)
  int exponent = frac == 0.5f ? e - 1 : e;
  if (std::isinf(x)) {
    exponent = 127;
  }
  exponent = std::clamp(exponent, -126, 127);
  const float s = std::ldexp(1.0f, exponent);
  return {s, 1.0f / s};
}

// The E4M3 code of `v` from the nearest-value search: +-448 beyond the range, 0x7F
// for NaN; compared by value (so +0 and -0 are one).
float naive_e4m3(float v) {
  if (std::isnan(v)) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (std::fabs(v) >= 448.0f) {
    return std::copysign(448.0f, v);
  }
  return testing::round_to_e4m3(v);
}

// Inputs with zero rows and blocks, NaN, infinities, values past the E4M3 range
// after scaling, and tiny ones.
std::vector<float> quantize_inputs(const Fp8Case& c, std::uint32_t seed) {
  const std::size_t n = c.rows * c.cols * c.batches;
  std::mt19937 rng(seed);
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float mag =
        std::ldexp(static_cast<float>(rng() % 4096) / 4096.0f, static_cast<int>(rng() % 24) - 12);
    x[i] = rng() % 2 == 0 ? mag : -mag;
  }
  if (c.rows > 1) {  // row 1 of matrix 0 all zero: a zero group for kRow
    for (std::size_t col = 0; col < c.cols; ++col) {
      x[c.cols + col] = col % 2 == 0 ? 0.0f : -0.0f;
    }
  }
  if (n > 20) {
    x[3] = std::numeric_limits<float>::quiet_NaN();
    x[n - 2] = -std::numeric_limits<float>::infinity();
    x[n / 2] = 1e30f;
  }
  return x;
}

// kStatic: no amax; each group's scale is the largest of its slots as they were,
// every slot of the group then holds it, and the elements are x * (1 / s) encoded
// (SGLang's scaled_fp8_quant with a static scale, given the max of shard scales).
TEST(KernelsHostTest, QuantizeFp8StaticUsesTheLargestSlotOfEachGroup) {
  for (const Fp8Case& c : fp8_cases()) {
    const std::vector<float> x = quantize_inputs(c, 17);
    const std::size_t n = x.size();
    const bool tensor = c.scales.granularity == Fp8Granularity::kTensor;
    const std::size_t per =
        tensor ? c.scales.tensor_repeat : naive_scale_count(c.scales, c.rows, c.cols);
    std::vector<float> s(per * c.batches + 1, -7.0f);
    for (std::size_t i = 0; i < per * c.batches; ++i) {
      s[i] = std::ldexp(1.0f + static_cast<float>(i % 5) / 8.0f, static_cast<int>(i % 3) - 8);
    }
    const std::vector<float> before = s;
    std::vector<std::uint8_t> q(n + 4, 0xA5);
    quantize_fp8(reinterpret_cast<std::byte*>(q.data()), reinterpret_cast<std::byte*>(s.data()),
                 reinterpret_cast<const std::byte*>(x.data()), DType::kF32, c.scales,
                 Fp8ScaleRule::kStatic, c.rows, c.cols, c.batches);
    ASSERT_EQ(q[n], 0xA5) << "wrote past the weight";
    ASSERT_EQ(s[per * c.batches], -7.0f) << "wrote past the scales";
    for (std::size_t b = 0; b < c.batches; ++b) {
      for (std::size_t r = 0; r < c.rows; ++r) {
        for (std::size_t col = 0; col < c.cols; ++col) {
          // The group's slots: all `per` of the matrix (kTensor), else its one.
          const std::size_t first =
              b * per + (tensor ? 0 : naive_scale_index(c.scales, r, col, c.cols));
          const std::size_t count = tensor ? per : 1;
          const float want_s = *std::max_element(before.begin() + first,
                                                 before.begin() + first + count);
          for (std::size_t k = 0; k < count; ++k) {
            ASSERT_EQ(s[first + k], want_s);
          }
          const std::size_t i = (b * c.rows + r) * c.cols + col;
          const float got = testing::decode_one(reinterpret_cast<const std::byte*>(&q[i]),
                                                DType::kF8E4M3);
          const float want = naive_e4m3(x[i] * (1.0f / want_s));
          if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(got)) << i;
          } else {
            ASSERT_EQ(got, want) << c.rows << "x" << c.cols << " element " << i;
          }
        }
      }
    }
  }
}

TEST(KernelsHostTest, QuantizeFp8MatchesTheNaiveReference) {
  for (const Fp8Case& c : fp8_cases()) {
    const std::vector<float> x32 = quantize_inputs(c, 9);
    const std::size_t n = x32.size();
    const bool tensor = c.scales.granularity == Fp8Granularity::kTensor;
    const std::size_t per =
        tensor ? c.scales.tensor_repeat : naive_scale_count(c.scales, c.rows, c.cols);
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      // The source in `dtype`, and the values it holds.
      std::vector<std::byte> src(n * dtype_size(dtype));
      std::vector<float> x(n);
      cast(src.data(), dtype, reinterpret_cast<const std::byte*>(x32.data()), DType::kF32, n);
      for (std::size_t i = 0; i < n; ++i) {
        x[i] = testing::decode_one(src.data() + i * dtype_size(dtype), dtype);
      }
      for (Fp8ScaleRule rule : {Fp8ScaleRule::kAmax, Fp8ScaleRule::kAmaxOrOne,
                                Fp8ScaleRule::kInputToFloat8, Fp8ScaleRule::kUe8m0}) {
        std::vector<std::uint8_t> q(n + 4, 0xA5);
        std::vector<float> s(per * c.batches + 1, -7.0f);
        quantize_fp8(reinterpret_cast<std::byte*>(q.data()), reinterpret_cast<std::byte*>(s.data()),
                     src.data(), dtype, c.scales, rule, c.rows, c.cols, c.batches);
        ASSERT_EQ(q[n], 0xA5) << "wrote past the weight";
        ASSERT_EQ(s[per * c.batches], -7.0f) << "wrote past the scales";
        // Each group's amax, by brute force over its elements.
        for (std::size_t b = 0; b < c.batches; ++b) {
          std::vector<float> amax(naive_scale_count(c.scales, c.rows, c.cols), 0.0f);
          for (std::size_t r = 0; r < c.rows; ++r) {
            for (std::size_t col = 0; col < c.cols; ++col) {
              const float v = std::fabs(x[(b * c.rows + r) * c.cols + col]);
              float& a = amax[naive_scale_index(c.scales, r, col, c.cols)];
              if (!std::isnan(v) && v > a) {
                a = v;
              }
            }
          }
          for (std::size_t g = 0; g < per; ++g) {
            const float want = naive_scale(amax[tensor ? 0 : g], rule).scale;
            ASSERT_EQ(s[b * per + g], want) << "scale " << g << " of matrix " << b;
          }
          for (std::size_t r = 0; r < c.rows; ++r) {
            for (std::size_t col = 0; col < c.cols; ++col) {
              const std::size_t i = (b * c.rows + r) * c.cols + col;
              const float m =
                  naive_scale(amax[naive_scale_index(c.scales, r, col, c.cols)], rule).mul;
              const float want = naive_e4m3(x[i] * m);
              const float got = testing::e4m3_value(q[i]);
              if (std::isnan(want)) {
                ASSERT_EQ(q[i], 0x7F) << i;
              } else {
                ASSERT_EQ(got, want) << dtype_name(dtype) << " rule " << static_cast<int>(rule)
                                     << " element " << i << " x " << x[i] << " m " << m;
              }
            }
          }
        }
      }
    }
  }
}

// A large weight's groups are quantized on several threads (from 1 Mi elements):
// the same bytes and scales as quantizing it band by band, each band small enough
// for one thread, for row and block groups, with a ragged last band.
TEST(KernelsHostTest, QuantizeFp8OnManyThreadsEqualsBandByBand) {
  const std::size_t rows = 1100;
  const std::size_t cols = 2100;  // 2.3 Mi elements: several threads where cores allow
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> x(rows * cols);
  for (float& v : x) {
    v = u(rng);
  }
  std::vector<std::byte> src(x.size() * 2);
  cast(src.data(), DType::kBF16, reinterpret_cast<const std::byte*>(x.data()), DType::kF32,
       x.size());
  for (const Fp8Scales& scales : {Fp8Scales{Fp8Granularity::kRow, 0, 0, 1},
                                  Fp8Scales{Fp8Granularity::kBlock, 128, 128, 1}}) {
    const std::size_t band = scales.granularity == Fp8Granularity::kRow ? 1 : 128;
    const std::size_t per_band = scales.granularity == Fp8Granularity::kRow ? 1 : (cols + 127) / 128;
    const std::size_t groups = (rows + band - 1) / band * per_band;
    std::vector<std::byte> q(x.size()), q_bands(x.size());
    std::vector<float> s(groups), s_bands(groups);
    quantize_fp8(q.data(), reinterpret_cast<std::byte*>(s.data()), src.data(), DType::kBF16,
                 scales, Fp8ScaleRule::kAmax, rows, cols, 1);
    for (std::size_t r0 = 0; r0 < rows; r0 += band) {
      const std::size_t n = std::min(band, rows - r0);
      quantize_fp8(q_bands.data() + r0 * cols,
                   reinterpret_cast<std::byte*>(s_bands.data() + r0 / band * per_band),
                   src.data() + r0 * cols * 2, DType::kBF16, scales, Fp8ScaleRule::kAmax, n, cols,
                   1);
    }
    EXPECT_EQ(q, q_bands) << "granularity " << static_cast<int>(scales.granularity);
    EXPECT_EQ(s, s_bands) << "granularity " << static_cast<int>(scales.granularity);
  }
}

// The zero-group rules: kAmax stores 0 and zeros, kAmaxOrOne stores 1, and
// kInputToFloat8 / kUe8m0 floor the amax (1e-12, 1e-4).
TEST(KernelsHostTest, QuantizeFp8ZeroGroups) {
  const float zeros[4] = {0.0f, -0.0f, 0.0f, 0.0f};
  auto run = [&](Fp8ScaleRule rule) {
    std::uint8_t q[4];
    float s = -1;
    quantize_fp8(reinterpret_cast<std::byte*>(q), reinterpret_cast<std::byte*>(&s),
                 reinterpret_cast<const std::byte*>(zeros), DType::kF32, Fp8Scales{}, rule, 2, 2,
                 1);
    EXPECT_EQ(q[0], 0);
    EXPECT_EQ(q[1] & 0x7F, 0);
    return s;
  };
  EXPECT_EQ(run(Fp8ScaleRule::kAmax), 0.0f);
  EXPECT_EQ(run(Fp8ScaleRule::kAmaxOrOne), 1.0f);
  EXPECT_EQ(run(Fp8ScaleRule::kInputToFloat8), 1.0f / (448.0f / 1e-12f));
  EXPECT_EQ(run(Fp8ScaleRule::kUe8m0), std::ldexp(1.0f, -22));  // 1e-4 / 448 ~ 2.2e-7 <= 2^-22
}

// Saturation: with a fixed tensor scale, values beyond the group's amax cannot
// occur, but infinities can: they saturate to +-448 while the scale follows them.
TEST(KernelsHostTest, QuantizeFp8SaturatesAndSkipsNaN) {
  const float x[4] = {std::numeric_limits<float>::infinity(), 1.0f,
                      std::numeric_limits<float>::quiet_NaN(), -1.0f};
  std::uint8_t q[4];
  float s = 0;
  quantize_fp8(reinterpret_cast<std::byte*>(q), reinterpret_cast<std::byte*>(&s),
               reinterpret_cast<const std::byte*>(x), DType::kF32, Fp8Scales{},
               Fp8ScaleRule::kAmaxOrOne, 1, 4, 1);
  EXPECT_TRUE(std::isinf(s));  // amax = inf: the NaN was skipped
  EXPECT_EQ(q[2], 0x7F);       // NaN stays NaN
  EXPECT_EQ(q[1], 0x00);       // 1 / inf = 0
  const float big[2] = {1000.0f, -900.0f};
  quantize_fp8(reinterpret_cast<std::byte*>(q), reinterpret_cast<std::byte*>(&s),
               reinterpret_cast<const std::byte*>(big), DType::kF32, Fp8Scales{},
               Fp8ScaleRule::kUe8m0, 1, 2, 1);
  EXPECT_EQ(s, 4.0f);     // 1000 / 448 = 2.23 -> 4
  EXPECT_EQ(q[0], 0x78);  // 250 -> 256 (0x78: exponent 15, mantissa 0)
}

TEST(KernelsHostTest, PackUe8m0MatchesTheNaiveReference) {
  struct Case {
    std::size_t rows, block_rows, scale_cols, batches;
  };
  for (const Case& c :
       {Case{8, 4, 5, 2}, Case{256, 128, 56, 1}, Case{3, 1, 4, 1}, Case{12, 128, 1, 3}}) {
    const std::size_t block_row_count = (c.rows + c.block_rows - 1) / c.block_rows;
    const std::size_t per = block_row_count * c.scale_cols;
    std::vector<float> scales(per * c.batches);
    std::mt19937 rng(13);
    for (float& v : scales) {
      v = std::ldexp(rng() % 3 == 0 ? 1.5f : 1.0f, static_cast<int>(rng() % 60) - 40);
    }
    const std::size_t words = (c.scale_cols + 3) / 4;
    std::vector<std::uint32_t> out(words * c.rows * c.batches + 1, 0xDEADBEEFu);
    pack_ue8m0(reinterpret_cast<std::byte*>(out.data()),
               reinterpret_cast<const std::byte*>(scales.data()), c.rows, c.block_rows,
               c.scale_cols, c.batches);
    ASSERT_EQ(out.back(), 0xDEADBEEFu);
    for (std::size_t b = 0; b < c.batches; ++b) {
      for (std::size_t r = 0; r < c.rows; ++r) {
        for (std::size_t k = 0; k < words * 4; ++k) {
          const std::uint32_t word = out[(b * words + k / 4) * c.rows + r];
          const unsigned byte = (word >> (8 * (k % 4))) & 0xFFu;
          unsigned want = 0;
          if (k < c.scale_cols) {
            want = static_cast<unsigned>(
                std::ilogb(scales[b * per + (r / c.block_rows) * c.scale_cols + k]) + 127);
          }
          ASSERT_EQ(byte, want) << "matrix " << b << " row " << r << " column block " << k;
        }
      }
    }
  }
}

// ---- Marlin's NVFP4 layouts against SGLang 0.5.23's own code, transcribed ----

// gptq_marlin_repack_kernel (kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh,
// num_bits 4, no perm) run thread by thread over b_q_weight = weight.view(int32).T:
// a 16 x 64 tile's two rows of words in "shared memory", each of the 4 x 32 threads
// gathering its eight nibbles and writing one word.
std::vector<std::uint32_t> sglang_marlin_repack(const std::vector<std::uint8_t>& weight,
                                                std::size_t n, std::size_t k) {
  auto b_q = [&](std::size_t kw, std::size_t col) {  // weight.view(int32).T[kw][col]
    std::uint32_t v = 0;
    std::memcpy(&v, weight.data() + col * (k / 2) + kw * 4, 4);
    return v;
  };
  const std::size_t n_tiles = n / 64;
  std::vector<std::uint32_t> out(n * k / 8);
  const int tc_offsets[4] = {0, 1, 8, 9};
  const int pack_idx[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  for (std::size_t k_tile = 0; k_tile < k / 16; ++k_tile) {
    for (std::size_t n_tile = 0; n_tile < n_tiles; ++n_tile) {
      std::uint32_t sh[2 * 64];
      for (std::size_t k_id = 0; k_id < 2; ++k_id) {
        for (std::size_t c = 0; c < 64; ++c) {
          sh[k_id * 64 + c] = b_q(k_tile * 2 + k_id, n_tile * 64 + c);
        }
      }
      for (int warp_id = 0; warp_id < 4; ++warp_id) {
        for (int th_id = 0; th_id < 32; ++th_id) {
          const int tc_col = th_id / 4;
          const int tc_row = (th_id % 4) * 2;
          const int cur_n = warp_id * 16 + tc_col;
          std::uint32_t vals[8];
          for (int i = 0; i < 4; ++i) {
            const int cur_elem = tc_row + tc_offsets[i];
            const int cur_int = cur_elem / 8;
            const int cur_pos = cur_elem % 8;
            vals[i] = (sh[cur_n + 64 * cur_int] >> (cur_pos * 4)) & 0xF;
            vals[4 + i] = (sh[cur_n + 8 + 64 * cur_int] >> (cur_pos * 4)) & 0xF;
          }
          std::uint32_t res = 0;
          for (int i = 0; i < 8; ++i) {
            res |= vals[pack_idx[i]] << (i * 4);
          }
          out[(k_tile * n_tiles + n_tile) * 128 + th_id * 4 + warp_id] = res;
        }
      }
    }
  }
  return out;
}

// marlin_permute_scales (marlin_utils.py, group 16 < k: scale_perm) after
// weight_scale.T, then nvfp4_marlin_process_scales (marlin_utils_fp4.py): to f16,
// view(-1, 4)[:, [0, 2, 1, 3]], (x * 2^7).view(int16) << 1, the odd (high) bytes.
std::vector<std::uint8_t> sglang_marlin_scales(const std::vector<std::uint8_t>& scales,
                                               std::size_t n, std::size_t groups) {
  std::vector<int> scale_perm;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      scale_perm.push_back(i + 8 * j);
    }
  }
  std::vector<std::uint8_t> t(n * groups);  // weight_scale.T
  for (std::size_t g = 0; g < groups; ++g) {
    for (std::size_t c = 0; c < n; ++c) {
      t[g * n + c] = scales[c * groups + g];
    }
  }
  std::vector<std::uint8_t> p(t.size());
  for (std::size_t i = 0; i < t.size(); ++i) {
    p[i] = t[i - i % 64 + static_cast<std::size_t>(scale_perm[i % 64])];
  }
  const std::size_t swap[4] = {0, 2, 1, 3};
  std::vector<std::uint8_t> out(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const float x = testing::e4m3_value(p[i - i % 4 + swap[i % 4]]) * 128.0f;
    const auto bits = static_cast<std::uint16_t>(synth::float_to_f16_bits(x) << 1);
    out[i] = static_cast<std::uint8_t>(bits >> 8);
  }
  return out;
}

TEST(KernelsHostTest, MarlinRepackIsSglangsKernelThreadByThread) {
  std::mt19937 rng(17);
  struct Case {
    std::size_t n, k;
  };
  for (Case c : {Case{64, 16}, Case{128, 64}, Case{192, 128}, Case{768, 256}}) {
    std::vector<std::uint8_t> weight(c.n * c.k / 2);
    for (std::uint8_t& b : weight) {
      b = static_cast<std::uint8_t>(rng());
    }
    std::vector<std::uint32_t> got(c.n * c.k / 8 + 1, 0xDEADBEEFu);
    repack_marlin_fp4(reinterpret_cast<std::byte*>(got.data()),
                      reinterpret_cast<const std::byte*>(weight.data()), c.n, c.k);
    ASSERT_EQ(got.back(), 0xDEADBEEFu);
    got.pop_back();
    EXPECT_EQ(got, sglang_marlin_repack(weight, c.n, c.k)) << c.n << " x " << c.k;
  }
}

TEST(KernelsHostTest, MarlinScalesAreSglangsPermutationAndCode) {
  // Every E4M3 code (NaN and negatives included) in every position.
  for (std::size_t groups : {1, 4, 7}) {
    const std::size_t n = 128;
    std::vector<std::uint8_t> scales(n * groups);
    for (std::size_t i = 0; i < scales.size(); ++i) {
      scales[i] = static_cast<std::uint8_t>((i * 37 + groups) % 256);
    }
    std::vector<std::uint8_t> got(scales.size() + 1, 0xAB);
    marlin_fp4_scales(reinterpret_cast<std::byte*>(got.data()),
                      reinterpret_cast<const std::byte*>(scales.data()), n, groups);
    ASSERT_EQ(got.back(), 0xAB);
    got.pop_back();
    EXPECT_EQ(got, sglang_marlin_scales(scales, n, groups)) << groups << " groups";
  }
}

}  // namespace
}  // namespace ferry::gpu::host

// The streaming copy must equal memcpy for every size (below and above the
// non-temporal threshold, with odd tails) and every misalignment of either side,
// and must not write a byte outside [dst, dst + bytes).
TEST(KernelsHostTest, CopyAroundCachesEqualsMemcpyAtAnySizeAndAlignment) {
  std::mt19937 rng(7);
  const std::size_t sizes[] = {0,
                               1,
                               15,
                               16,
                               17,
                               4095,
                               (64u << 10) - 1,
                               64u << 10,
                               (64u << 10) + 1,
                               (64u << 10) + 63,
                               (1u << 20) + 13};
  for (std::size_t bytes : sizes) {
    for (std::size_t src_shift : {0u, 1u, 8u, 15u}) {
      for (std::size_t dst_shift : {0u, 3u, 16u}) {
        std::vector<std::byte> src(bytes + 32);
        for (std::byte& b : src) {
          b = static_cast<std::byte>(rng());
        }
        std::vector<std::byte> dst(bytes + 64, std::byte{0xEE});
        ferry::gpu::host::copy_around_caches(dst.data() + 16 + dst_shift, src.data() + src_shift,
                                             bytes);
        SCOPED_TRACE("bytes " + std::to_string(bytes) + " src+" + std::to_string(src_shift) +
                     " dst+" + std::to_string(dst_shift));
        ASSERT_EQ(std::memcmp(dst.data() + 16 + dst_shift, src.data() + src_shift, bytes), 0);
        for (std::size_t i = 0; i < 16 + dst_shift; ++i) {
          ASSERT_EQ(dst[i], std::byte{0xEE}) << "wrote before dst at " << i;
        }
        for (std::size_t i = 16 + dst_shift + bytes; i < dst.size(); ++i) {
          ASSERT_EQ(dst[i], std::byte{0xEE}) << "wrote past the end at " << i;
        }
      }
    }
  }
}
