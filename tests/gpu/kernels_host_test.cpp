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
