// Stream::dequantize_ggml_2d on the host, null and (with a GPU) CUDA backends, and the
// CUDA kernel's element code emulated on the CPU: every GGML block format into BF16,
// F16 and F32 through pitched rows, element for element against ggml_block_element
// rounded as cast() rounds F32; and the calls every backend refuses.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/ggml_blocks.hpp"
#include "gpu/backends.hpp"
#include "gpu/host_device.hpp"
#include "gpu/kernels_host.hpp"
#include "gpu/metered_device.hpp"
#include "gpu/null_device.hpp"
#if FERRY_HAVE_CUDA
#include "gpu/cuda/kernels_emulated.hpp"
#endif

namespace ferry::gpu {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

constexpr GgmlBlocks kFormats[] = {
    GgmlBlocks::kQ4_0, GgmlBlocks::kQ4_1, GgmlBlocks::kQ5_0, GgmlBlocks::kQ5_1, GgmlBlocks::kQ8_0,
    GgmlBlocks::kQ2_K, GgmlBlocks::kQ3_K, GgmlBlocks::kQ4_K, GgmlBlocks::kQ5_K, GgmlBlocks::kQ6_K};
constexpr DType kTargets[] = {DType::kF32, DType::kBF16, DType::kF16};

// Where a block keeps its F16 scales (d, and m / dmin where it has one), from ggml's
// block layouts.
std::vector<std::size_t> scale_offsets(GgmlBlocks b) {
  switch (b) {
    case GgmlBlocks::kQ4_0:
    case GgmlBlocks::kQ5_0:
    case GgmlBlocks::kQ8_0:
      return {0};
    case GgmlBlocks::kQ4_1:
    case GgmlBlocks::kQ5_1:
    case GgmlBlocks::kQ4_K:
    case GgmlBlocks::kQ5_K:
      return {0, 2};
    case GgmlBlocks::kQ2_K:
      return {80, 82};
    case GgmlBlocks::kQ3_K:
      return {108};
    case GgmlBlocks::kQ6_K:
      return {208};
    case GgmlBlocks::kNone:
      break;
  }
  return {};
}

enum class Scales { kFinite, kAny };

// `rows` rows of `width` elements of `b`, row r at r * pitch: random bytes (the gaps
// between rows too). kFinite keeps every F16 scale finite (its exponent below 31)
// and small enough that products stay in F16's range now and then, not always.
std::vector<unsigned char> random_rows(GgmlBlocks b, std::size_t width, std::size_t rows,
                                       std::size_t pitch, Scales scales, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> out(rows * pitch);
  for (unsigned char& c : out) {
    c = static_cast<unsigned char>(rng());
  }
  if (scales == Scales::kAny) {
    return out;
  }
  const GgmlBlockShape shape = ggml_block_shape(b);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t k = 0; k < width / shape.elems; ++k) {
      unsigned char* block = out.data() + r * pitch + k * shape.bytes;
      for (std::size_t at : scale_offsets(b)) {
        // Exponent 0..29 (subnormals included), random sign and mantissa.
        const auto exponent = static_cast<unsigned>(rng() % 30);
        const std::uint16_t bits = static_cast<std::uint16_t>((rng() & 0x83FFu) | (exponent << 10));
        block[at] = static_cast<unsigned char>(bits & 0xFF);
        block[at + 1] = static_cast<unsigned char>(bits >> 8);
      }
    }
  }
  return out;
}

// Element i of a row stored as `dtype`: ggml_block_element's F32, a NaN made the
// positive canonical NaN, then rounded by the host twins' F32 conversions.
std::vector<unsigned char> expected_element(GgmlBlocks b, const unsigned char* row, std::size_t i,
                                            DType dtype) {
  const GgmlBlockShape shape = ggml_block_shape(b);
  const float v = ggml_block_element(b, row + i / shape.elems * shape.bytes,
                                     static_cast<unsigned>(i % shape.elems));
  std::uint32_t f32 = std::bit_cast<std::uint32_t>(v);
  if ((f32 & 0x7FFFFFFFu) > 0x7F800000u) {
    f32 = host::kF32CanonicalNaN;
  }
  std::vector<unsigned char> out(dtype_size(dtype));
  if (dtype == DType::kF32) {
    std::memcpy(out.data(), &f32, 4);
  } else {
    const std::uint16_t h = dtype == DType::kBF16 ? host::f32_to_bf16(f32) : host::f32_to_f16(f32);
    std::memcpy(out.data(), &h, 2);
  }
  return out;
}

// The destination as the operation must leave it: `background` with row r's
// elements written at shift + r * dst_pitch.
std::vector<unsigned char> expected_rows(GgmlBlocks b, const std::vector<unsigned char>& src,
                                         std::size_t src_pitch, DType dtype, std::size_t width,
                                         std::size_t rows, std::vector<unsigned char> background,
                                         std::size_t shift, std::size_t dst_pitch) {
  const std::size_t es = dtype_size(dtype);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t i = 0; i < width; ++i) {
      const std::vector<unsigned char> e =
          expected_element(b, src.data() + r * src_pitch, i, dtype);
      std::memcpy(background.data() + shift + r * dst_pitch + i * es, e.data(), es);
    }
  }
  return background;
}

std::string label(GgmlBlocks b, DType dtype) {
  return std::string(ggml_blocks_name(b)) + " -> " + std::string(dtype_name(dtype));
}

// One pitched call on `device`'s stream (source and destination in one allocation,
// a background of 0xA5 around the rows); returns the destination region read back.
struct Shape {
  std::size_t width, rows, src_pitch, dst_pitch, dst_shift;
};
std::vector<unsigned char> run_on(Device& device, GgmlBlocks b, DType dtype,
                                  const std::vector<unsigned char>& src, const Shape& s) {
  const std::size_t dst_bytes = s.dst_shift + s.rows * s.dst_pitch;
  DeviceAllocation a = device.allocate(src.size() + 64 + dst_bytes);
  std::unique_ptr<Stream> stream = device.create_stream();
  std::byte* src_at = a.data();
  std::byte* dst_at = a.data() + src.size() + 64;
  const std::vector<std::byte> fill(dst_bytes, std::byte{0xA5});
  stream->copy_h2d(src_at, reinterpret_cast<const std::byte*>(src.data()), src.size());
  stream->copy_h2d(dst_at, fill.data(), fill.size());
  stream->dequantize_ggml_2d(dst_at + s.dst_shift, s.dst_pitch, dtype, src_at, s.src_pitch, b,
                             s.width, s.rows);
  std::vector<unsigned char> out(dst_bytes);
  stream->copy_d2h(reinterpret_cast<std::byte*>(out.data()), dst_at, dst_bytes);
  stream->synchronize();
  return out;
}

// Three blocks a row, 5 rows, both pitches wider than their rows and odd, the
// destination at an odd address for the unaligned pass.
Shape shape_for(GgmlBlocks b, DType dtype, std::size_t misalign) {
  const std::size_t width = 3 * ggml_block_shape(b).elems;
  return {width, 5, ggml_row_bytes(b, width) + 13, width * dtype_size(dtype) + 6 + misalign,
          misalign};
}

TEST(GgmlDequantizeTest, HostDeviceMatchesTheBlockElementsForEveryFormatAndTarget) {
  for (bool deferred : {false, true}) {
    auto device = make_host_device(0, {.deferred_copies = deferred});
    std::uint32_t seed = 1;
    for (GgmlBlocks b : kFormats) {
      for (DType dtype : kTargets) {
        for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
          const Shape s = shape_for(b, dtype, misalign);
          const std::vector<unsigned char> src =
              random_rows(b, s.width, s.rows, s.src_pitch, Scales::kFinite, seed++);
          const std::vector<unsigned char> got = run_on(*device, b, dtype, src, s);
          const std::vector<unsigned char> want =
              expected_rows(b, src, s.src_pitch, dtype, s.width, s.rows,
                            std::vector<unsigned char>(got.size(), 0xA5), s.dst_shift, s.dst_pitch);
          ASSERT_EQ(got, want) << label(b, dtype) << (misalign ? " unaligned" : "")
                               << (deferred ? " deferred" : "");
        }
      }
    }
  }
}

// Values worked out by hand: the operation reads block k of row r where it should,
// and the element functions give ggml's numbers.
TEST(GgmlDequantizeTest, HostDeviceGivesHandWorkedValues) {
  auto device = make_host_device(0);
  // Q8_0, two rows of one block, 40 bytes apart: d = 0.5 (0x3800) in the first, -2
  // (0xC000) in the second; q[j] = j - 16.
  std::vector<unsigned char> q8(2 * 40, 0);
  for (std::size_t r = 0; r < 2; ++r) {
    unsigned char* block = q8.data() + r * 40;
    block[0] = 0x00;
    block[1] = r == 0 ? 0x38 : 0xC0;
    for (int j = 0; j < 32; ++j) {
      block[2 + j] = static_cast<unsigned char>(static_cast<signed char>(j - 16));
    }
  }
  const std::vector<unsigned char> got =
      run_on(*device, GgmlBlocks::kQ8_0, DType::kF32, q8, {32, 2, 40, 32 * 4 + 4, 0});
  for (std::size_t r = 0; r < 2; ++r) {
    for (int j = 0; j < 32; ++j) {
      float v;
      std::memcpy(&v, got.data() + r * 132 + 4 * j, 4);
      EXPECT_EQ(v, static_cast<float>(j - 16) * (r == 0 ? 0.5f : -2.0f)) << r << " " << j;
    }
  }
  // Q4_0, one block: d = 2 (0x4000); byte j holds element j (low nibble, j) and
  // element j + 16 (high nibble, 15 - j); values (nibble - 8) * 2.
  std::vector<unsigned char> q4(18);
  q4[0] = 0x00;
  q4[1] = 0x40;
  for (unsigned j = 0; j < 16; ++j) {
    q4[2 + j] = static_cast<unsigned char>(j | ((15 - j) << 4));
  }
  const std::vector<unsigned char> got4 =
      run_on(*device, GgmlBlocks::kQ4_0, DType::kBF16, q4, {32, 1, 18, 64, 0});
  for (unsigned e = 0; e < 32; ++e) {
    const int nibble = e < 16 ? static_cast<int>(e) : static_cast<int>(15 - (e - 16));
    std::uint16_t h;
    std::memcpy(&h, got4.data() + 2 * e, 2);
    EXPECT_EQ(h, host::f32_to_bf16(std::bit_cast<std::uint32_t>(2.0f * (nibble - 8)))) << e;
  }
}

// NaN and infinite scales: a NaN element is the target's positive canonical NaN,
// whatever sign the CPU gave it; infinities keep theirs.
TEST(GgmlDequantizeTest, NaNElementsBecomeThePositiveCanonicalNaN) {
  auto device = make_host_device(0);
  for (GgmlBlocks b : kFormats) {
    for (DType dtype : kTargets) {
      const Shape s = shape_for(b, dtype, 0);
      std::vector<unsigned char> src =
          random_rows(b, s.width, s.rows, s.src_pitch, Scales::kAny, 99);
      // Block 0 of each row: a negative NaN scale; block 1: -infinity (times a zero
      // quant it is a NaN on the CPU with the sign bit set).
      for (std::size_t r = 0; r < s.rows; ++r) {
        for (std::size_t at : scale_offsets(b)) {
          unsigned char* row = src.data() + r * s.src_pitch;
          row[at] = 0x01;
          row[at + 1] = 0xFE;
          row[ggml_block_shape(b).bytes + at] = 0x00;
          row[ggml_block_shape(b).bytes + at + 1] = 0xFC;
        }
      }
      const std::vector<unsigned char> got = run_on(*device, b, dtype, src, s);
      const std::vector<unsigned char> want =
          expected_rows(b, src, s.src_pitch, dtype, s.width, s.rows,
                        std::vector<unsigned char>(got.size(), 0xA5), 0, s.dst_pitch);
      ASSERT_EQ(got, want) << label(b, dtype);
      const std::uint32_t nan_bits = dtype == DType::kF32    ? host::kF32CanonicalNaN
                                     : dtype == DType::kBF16 ? host::kBF16CanonicalNaN
                                                             : host::kF16CanonicalNaN;
      std::uint32_t first = 0;
      std::memcpy(&first, got.data(), dtype_size(dtype));
      EXPECT_EQ(first, nan_bits) << label(b, dtype);
    }
  }
}

TEST(GgmlDequantizeTest, NullDeviceChecksAndCountsTheRowsItWrites) {
  auto device = make_null_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(4096);
  // 3 rows of 256 Q4_K elements (144 bytes, pitch 150) into F16 rows of pitch 600.
  stream->dequantize_ggml_2d(a.data() + 2000, 600, DType::kF16, a.data(), 150, GgmlBlocks::kQ4_K,
                             256, 3);
  stream->dequantize_ggml_2d(a.data() + 2000, 600, DType::kF16, a.data(), 150, GgmlBlocks::kQ4_K, 0,
                             3);  // nothing
  EXPECT_EQ(null_device_bytes_written(*device), 3u * 256 * 2);
  EXPECT_THAT(
      [&] {
        stream->dequantize_ggml_2d(a.data() + 2000, 600, DType::kF16, a.data(), 150,
                                   GgmlBlocks::kQ4_K, 256, 4);
      },
      ThrowsMessage<Error>(AllOf(HasSubstr("null:0"), HasSubstr("dequantize_ggml_2d"),
                                 HasSubstr("not inside a live allocation"))));
}

TEST(GgmlDequantizeTest, MeteredDeviceReportsACastOfTheBytesWritten) {
  std::vector<std::pair<std::string, std::size_t>> ops;
  auto device =
      metered_device(make_host_device(0),
                     {[&](const DeviceOp& op) { ops.emplace_back(std::string(op.op), op.bytes); }});
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(4096);
  stream->dequantize_ggml_2d(a.data() + 1024, 200, DType::kBF16, a.data(), 80, GgmlBlocks::kQ8_0,
                             64, 4);
  stream->synchronize();
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].first, "cast");
  EXPECT_EQ(ops[0].second, 64u * 4 * 2);
}

// Every refusal names the operation and the device, on both tracking backends.
TEST(GgmlDequantizeTest, BadCallsAreRefusedOnHostAndNullDevices) {
  for (auto device : {make_host_device(0), make_null_device(0)}) {
    SCOPED_TRACE(device->name());
    auto stream = device->create_stream();
    DeviceAllocation a = device->allocate(8192);
    std::byte* p = a.data();
    auto fails_with = [&](const std::string& words) {
      return ThrowsMessage<Error>(
          AllOf(HasSubstr(device->name()), HasSubstr("dequantize_ggml_2d"), HasSubstr(words)));
    };
    // A row that is not a whole number of blocks.
    EXPECT_THAT(
        [&] {
          stream->dequantize_ggml_2d(p + 4096, 512, DType::kF16, p, 200, GgmlBlocks::kQ4_K, 128, 2);
        },
        fails_with("Q4_K -> F16: a row of 128 elements is not a whole number of blocks (256"));
    EXPECT_THAT(
        [&] {
          stream->dequantize_ggml_2d(p + 4096, 512, DType::kF32, p, 40, GgmlBlocks::kQ8_0, 33, 1);
        },
        fails_with("a row of 33 elements"));
    // No block format.
    EXPECT_THAT(
        [&] {
          stream->dequantize_ggml_2d(p + 4096, 512, DType::kF32, p, 40, GgmlBlocks::kNone, 32, 1);
        },
        fails_with("no block format"));
    // Destinations that are not BF16, F16 or F32.
    for (DType bad : {DType::kI32, DType::kU8, DType::kF64, DType::kF8E4M3}) {
      EXPECT_THAT(
          [&] { stream->dequantize_ggml_2d(p + 4096, 512, bad, p, 40, GgmlBlocks::kQ8_0, 32, 1); },
          fails_with("only BF16, F16 and F32"))
          << dtype_name(bad);
    }
    // Pitches narrower than the rows: 32 F32 elements are 128 bytes, a Q8_0 block 34.
    EXPECT_THAT(
        [&] {
          stream->dequantize_ggml_2d(p + 4096, 100, DType::kF32, p, 40, GgmlBlocks::kQ8_0, 32, 2);
        },
        fails_with("destination pitch 100 is smaller than the row width 128"));
    EXPECT_THAT(
        [&] {
          stream->dequantize_ggml_2d(p + 4096, 128, DType::kF32, p, 33, GgmlBlocks::kQ8_0, 32, 2);
        },
        fails_with("source pitch 33 is smaller than the row width 34"));
    // Overlapping source and destination, in place included.
    EXPECT_THAT(
        [&] {
          stream->dequantize_ggml_2d(p + 64, 128, DType::kF32, p, 34, GgmlBlocks::kQ8_0, 32, 4);
        },
        fails_with("overlap"));
    EXPECT_THAT(
        [&] { stream->dequantize_ggml_2d(p, 128, DType::kF32, p, 128, GgmlBlocks::kQ8_0, 32, 2); },
        fails_with("overlap"));
    // Ranges past the allocation.
    EXPECT_THAT(
        [&] {
          stream->dequantize_ggml_2d(p + 8000, 512, DType::kF32, p, 40, GgmlBlocks::kQ8_0, 32, 2);
        },
        fails_with("not inside a live allocation"));
    EXPECT_THAT(
        [&] {
          stream->dequantize_ggml_2d(p + 4096, 512, DType::kF32, p + 8150, 40, GgmlBlocks::kQ8_0,
                                     32, 2);
        },
        fails_with("source"));
    // Empty calls do nothing, checking the arguments that make them empty only.
    stream->dequantize_ggml_2d(nullptr, 0, DType::kF32, nullptr, 0, GgmlBlocks::kQ8_0, 0, 5);
    stream->dequantize_ggml_2d(nullptr, 128, DType::kF32, nullptr, 34, GgmlBlocks::kQ8_0, 32, 0);
    stream->synchronize();
  }
}

#if FERRY_HAVE_CUDA

// The CUDA kernel's element code run on the CPU against the host twin: every format,
// every target, aligned and not, scales of any bits (NaN and infinities among them).
TEST(CudaKernelEmulationTest, DequantizeGgmlMatchesTheHostTwin) {
  std::uint32_t seed = 500;
  for (GgmlBlocks b : kFormats) {
    for (DType dtype : kTargets) {
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        for (Scales scales : {Scales::kFinite, Scales::kAny}) {
          const Shape s = shape_for(b, dtype, misalign);
          const std::vector<unsigned char> src =
              random_rows(b, s.width, s.rows, s.src_pitch, scales, seed++);
          const std::size_t bytes = s.dst_shift + s.rows * s.dst_pitch;
          std::vector<std::byte> want(bytes, std::byte{0xA5});
          std::vector<std::byte> got = want;
          const auto* in = reinterpret_cast<const std::byte*>(src.data());
          host::dequantize_ggml_2d(want.data() + s.dst_shift, s.dst_pitch, dtype, in, s.src_pitch,
                                   b, s.width, s.rows);
          cuda::dequantize_ggml_2d_emulated(got.data() + s.dst_shift, s.dst_pitch, dtype, in,
                                            s.src_pitch, b, s.width, s.rows);
          ASSERT_EQ(got, want) << label(b, dtype) << (misalign ? " unaligned" : "");
        }
      }
    }
  }
}

#endif

// On a GPU: the CUDA backend gives the host backend's bytes (the self-test covers
// the same with the random background; this one with valid scales and in
// isolation, so a failure names its format).
TEST(CudaDeviceGgmlTest, DequantizeMatchesTheHostBackend) {
  std::string why;
  if (cuda_device_count(&why) == 0) {
    GTEST_SKIP() << "no CUDA device: " << why;
  }
  auto cuda = make_cuda_device(0);
  cuda->bind();
  auto host = make_host_device(0);
  std::uint32_t seed = 900;
  for (GgmlBlocks b : kFormats) {
    for (DType dtype : kTargets) {
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        const Shape s = shape_for(b, dtype, misalign);
        const std::vector<unsigned char> src =
            random_rows(b, s.width, s.rows, s.src_pitch, Scales::kFinite, seed++);
        EXPECT_EQ(run_on(*cuda, b, dtype, src, s), run_on(*host, b, dtype, src, s))
            << label(b, dtype) << (misalign ? " unaligned" : "");
      }
    }
  }
  auto stream = cuda->create_stream();
  DeviceAllocation a = cuda->allocate(4096);
  EXPECT_THAT(
      [&] {
        stream->dequantize_ggml_2d(a.data() + 2048, 512, DType::kF16, a.data(), 200,
                                   GgmlBlocks::kQ4_K, 128, 2);
      },
      ThrowsMessage<Error>(AllOf(HasSubstr("cuda:0"), HasSubstr("dequantize_ggml_2d"))));
}

}  // namespace
}  // namespace ferry::gpu
