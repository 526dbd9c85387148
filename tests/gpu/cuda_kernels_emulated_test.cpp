// The CUDA kernels' element code, compiled for the host and run on the CPU,
// against the host twins. Runs without a GPU wherever the CUDA backend is built;
// what it cannot check (the GPU's own conversion instructions) the self-test on a
// GPU does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/kernels_host.hpp"
#if FERRY_HAVE_CUDA
#include "gpu/cuda/kernels_emulated.hpp"
#endif

namespace ferry::gpu {
namespace {

#if FERRY_HAVE_CUDA

std::vector<std::byte> sources(DType dtype, std::size_t count) {
  std::vector<std::byte> out(count * dtype_size(dtype) + 1);
  std::mt19937 rng(7);
  for (std::size_t i = 0; i < count; ++i) {
    if (dtype == DType::kF32) {
      std::uint32_t bits = rng();
      if (i % 2 == 1) {
        bits = (bits & 0x807FFFFFu) | ((96u + bits % 52u) << 23);
      }
      if (i % 3 == 0) {
        bits = (bits & 0xFFFFE000u) | (i % 6 == 0 ? 0x1000u : 0u);
      }
      std::memcpy(out.data() + 4 * i, &bits, 4);
    } else {
      auto v = static_cast<std::uint16_t>(i);
      std::memcpy(out.data() + 2 * i, &v, 2);
    }
  }
  return out;
}

TEST(CudaKernelEmulationTest, CastMatchesTheHostTwinForEveryPairAndAlignment) {
  const DType types[] = {DType::kBF16, DType::kF16, DType::kF32};
  const std::size_t count = 65536;
  for (DType from : types) {
    std::vector<std::byte> aligned_src = sources(from, count);
    for (DType to : types) {
      if (from == to) {
        continue;  // never launched: the device copies instead
      }
      for (std::size_t shift : {0, 1}) {
        std::vector<std::byte> src(aligned_src.size() + 1);
        std::memcpy(src.data() + shift, aligned_src.data(), aligned_src.size());
        std::vector<std::byte> want(count * dtype_size(to) + 1, std::byte{0xCD});
        std::vector<std::byte> got = want;
        host::cast(want.data() + shift, to, src.data() + shift, from, count);
        cuda::cast_emulated(got.data() + shift, to, src.data() + shift, from, count);
        ASSERT_EQ(got, want) << dtype_name(from) << " -> " << dtype_name(to) << " shift " << shift;
      }
    }
  }
}

TEST(CudaKernelEmulationTest, CastInPlace) {
  std::vector<std::byte> want = sources(DType::kF16, 65536);
  std::vector<std::byte> got = want;
  host::cast(want.data(), DType::kBF16, want.data(), DType::kF16, 65536);
  cuda::cast_emulated(got.data(), DType::kBF16, got.data(), DType::kF16, 65536);
  EXPECT_EQ(got, want);
}

TEST(CudaKernelEmulationTest, FillReplicatesTheHostPattern) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32, DType::kF64}) {
    for (std::size_t shift : {0, 1, 3}) {
      std::vector<std::byte> want(8 * 33 + 4, std::byte{0x11});
      std::vector<std::byte> got = want;
      host::fill(want.data() + shift, 33, dtype, 1e-3);
      cuda::fill_emulated(got.data() + shift, 33, dtype_size(dtype),
                          host::fill_pattern(dtype, 1e-3));
      EXPECT_EQ(got, want) << dtype_name(dtype) << " shift " << shift;
    }
  }
}

TEST(CudaKernelEmulationTest, FillRandomMatchesTheHostTwin) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kU8}) {
    for (std::size_t shift : {0, 1, 3}) {
      std::vector<std::byte> want(4 * 4099 + 4, std::byte{0x11});
      std::vector<std::byte> got = want;
      host::fill_random(want.data() + shift, 4099, dtype, -1e-3, 2e-3, 99);
      const host::RandomRange r = host::random_range(-1e-3, 2e-3);
      cuda::fill_random_emulated(got.data() + shift, 4099, dtype, r.low, r.span, 99);
      EXPECT_EQ(got, want) << dtype_name(dtype) << " shift " << shift;
    }
  }
}

// Bytes 0..n-1 of a fixed pseudo-random sequence.
std::vector<std::byte> noise(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  std::mt19937 rng(seed);
  for (std::byte& b : out) {
    b = static_cast<std::byte>(rng());
  }
  return out;
}

TEST(CudaKernelEmulationTest, PitchedCastMatchesTheHostTwinRowByRow) {
  const DType types[] = {DType::kBF16, DType::kF16, DType::kF32};
  const std::size_t width = 301;
  const std::size_t rows = 17;
  for (DType from : types) {
    for (DType to : types) {
      if (from == to) {
        continue;
      }
      // Aligned pitches, then a pitch that breaks the element alignment of row 1.
      for (std::size_t extra : {0, 8, 1}) {
        const std::size_t src_pitch = width * dtype_size(from) + extra;
        const std::size_t dst_pitch = width * dtype_size(to) + 2 * extra + 4;
        std::vector<std::byte> src = sources(from, (src_pitch * rows) / dtype_size(from) + 1);
        std::vector<std::byte> want(dst_pitch * rows + 3, std::byte{0xCD});
        std::vector<std::byte> got = want;
        host::cast_2d(want.data(), dst_pitch, to, src.data(), src_pitch, from, width, rows);
        cuda::cast_2d_emulated(got.data(), dst_pitch, to, src.data(), src_pitch, from, width, rows);
        ASSERT_EQ(got, want) << dtype_name(from) << " -> " << dtype_name(to) << " extra " << extra;
      }
    }
  }
}

TEST(CudaKernelEmulationTest, GatherPicksTheWidestWordAndMatchesTheHostTwin) {
  struct Case {
    std::size_t dst_shift, src_shift, dst_pitch, src_pitch, width, rows, word;
  };
  // Row-parallel slices (rank 1 of tp 2 of a 7168-wide BF16 row), odd widths,
  // odd offsets: the word each thread moves falls from 16 bytes to 1.
  const Case cases[] = {{0, 7168, 7168, 14336, 7168, 9, 16},
                        {0, 8, 24, 40, 24, 5, 8},
                        {0, 4, 12, 20, 12, 5, 4},
                        {2, 6, 14, 18, 10, 4, 2},
                        {1, 0, 7, 9, 7, 11, 1},
                        {0, 0, 4096, 4096, 100, 3, 4}};
  for (const Case& c : cases) {
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{0});
    ASSERT_EQ(cuda::copy_2d_word_size(base + c.dst_shift, c.dst_pitch, base + c.src_shift,
                                      c.src_pitch, c.width),
              c.word)
        << c.width;
    std::vector<std::byte> src = noise(c.src_shift + c.src_pitch * c.rows, 3);
    // 16-aligned buffers, so that the shifts alone decide the pointers' alignment.
    std::vector<std::uint64_t> want_mem((c.dst_shift + c.dst_pitch * c.rows) / 8 + 3, 0x5A5A);
    std::vector<std::uint64_t> got_mem = want_mem;
    std::vector<std::uint64_t> src_mem(src.size() / 8 + 3);
    std::memcpy(src_mem.data(), src.data(), src.size());
    auto* want = reinterpret_cast<std::byte*>(want_mem.data());
    auto* got = reinterpret_cast<std::byte*>(got_mem.data());
    const auto* in = reinterpret_cast<const std::byte*>(src_mem.data());
    host::copy_2d(want + c.dst_shift, c.dst_pitch, in + c.src_shift, c.src_pitch, c.width, c.rows);
    cuda::copy_2d_emulated(got + c.dst_shift, c.dst_pitch, in + c.src_shift, c.src_pitch, c.width,
                           c.rows);
    EXPECT_EQ(got_mem, want_mem) << "width " << c.width;
  }
}

TEST(CudaKernelEmulationTest, TransposeMatchesTheHostTwin) {
  // DeepSeek-V3's w_kc per head (dn 128 x kv_lora_rank 512) and ragged shapes,
  // for every element size, aligned and not.
  struct Case {
    std::size_t rows, cols, batches;
  };
  for (const Case& c : {Case{128, 512, 2}, Case{33, 65, 3}, Case{1, 7, 4}, Case{31, 1, 1}}) {
    for (std::size_t es : {1, 2, 4, 8}) {
      for (std::size_t shift : {0, 1}) {
        const std::size_t matrix = c.rows * c.cols * es;
        const std::size_t src_pitch = matrix + 3 * es;  // batches apart, with a gap
        std::vector<std::byte> src = noise(shift + src_pitch * c.batches, 11);
        std::vector<std::byte> want(shift + matrix * c.batches + 5, std::byte{0x77});
        std::vector<std::byte> got = want;
        host::transpose(want.data() + shift, matrix, src.data() + shift, src_pitch, es, c.rows,
                        c.cols, c.batches);
        cuda::transpose_emulated(got.data() + shift, matrix, src.data() + shift, src_pitch, es,
                                 c.rows, c.cols, c.batches);
        ASSERT_EQ(got, want) << c.rows << "x" << c.cols << " es " << es << " shift " << shift;
      }
    }
  }
}

// The FP8 kernels' steps (the tile kernel's groups, the tensor path's accumulator,
// merge and final scales, the pack's words), aligned and not, against the twins.
TEST(CudaKernelEmulationTest, Fp8KernelsMatchTheHostTwins) {
  struct Case {
    std::size_t rows, cols, batches;
    Fp8Scales scales;
  };
  const Case cases[] = {
      {130, 260, 2, {Fp8Granularity::kBlock, 128, 128, 1}},
      {5, 7, 3, {Fp8Granularity::kBlock, 2, 3, 1}},
      {6, 33, 2, {Fp8Granularity::kRow, 0, 0, 1}},
      {7, 9, 3, {Fp8Granularity::kTensor, 0, 0, 1}},
      {3, 5, 2, {Fp8Granularity::kTensor, 0, 0, 4}},
  };
  const Fp8ScaleRule rules[] = {Fp8ScaleRule::kAmax, Fp8ScaleRule::kAmaxOrOne,
                                Fp8ScaleRule::kInputToFloat8, Fp8ScaleRule::kUe8m0,
                                Fp8ScaleRule::kStatic};
  for (const Case& c : cases) {
    const std::size_t n = c.rows * c.cols * c.batches;
    const std::size_t per = c.scales.granularity == Fp8Granularity::kTensor
                                ? c.scales.tensor_repeat
                                : fp8::scale_count(c.scales, c.rows, c.cols);
    for (std::size_t shift : {0, 1}) {
      for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
        // Random bit patterns: NaN, infinities and zeros among them.
        const std::vector<std::byte> src = noise(shift + n * dtype_size(dtype), 21);
        for (Fp8ScaleRule rule : rules) {
          std::vector<std::byte> q_want(n + shift, std::byte{0x11});
          std::vector<std::byte> q_got = q_want;
          std::vector<std::byte> s_want(per * c.batches * 4 + shift, std::byte{0x22});
          std::vector<std::byte> s_got = s_want;
          host::quantize_fp8(q_want.data() + shift, s_want.data() + shift, src.data() + shift,
                             dtype, c.scales, rule, c.rows, c.cols, c.batches);
          cuda::quantize_fp8_emulated(q_got.data() + shift, s_got.data() + shift,
                                      src.data() + shift, dtype, c.scales, rule, c.rows, c.cols,
                                      c.batches);
          ASSERT_EQ(q_got, q_want) << c.rows << "x" << c.cols << " " << dtype_name(dtype);
          ASSERT_EQ(s_got, s_want) << c.rows << "x" << c.cols << " " << dtype_name(dtype);
        }
        // Dequantize with the scales just made (finite) and with random ones.
        std::vector<std::byte> scales(per * c.batches * 4 + shift);
        const std::vector<std::byte> raw = noise(scales.size(), 5);
        std::memcpy(scales.data(), raw.data(), raw.size());
        std::vector<std::byte> want(n * dtype_size(dtype) + shift, std::byte{0x33});
        std::vector<std::byte> got = want;
        const Fp8Scales read{c.scales.granularity, c.scales.block_rows, c.scales.block_cols, 1};
        host::dequantize_fp8(want.data() + shift, dtype, src.data() + shift, scales.data() + shift,
                             read, c.rows, c.cols, c.batches);
        cuda::dequantize_fp8_emulated(got.data() + shift, dtype, src.data() + shift,
                                      scales.data() + shift, read, c.rows, c.cols, c.batches);
        ASSERT_EQ(got, want) << "dequantize " << c.rows << "x" << c.cols << " "
                             << dtype_name(dtype);
      }
    }
  }
  for (std::size_t shift : {0, 1}) {
    const std::vector<std::byte> scales = noise(2 * 3 * 5 * 4 + shift, 9);
    std::vector<std::byte> want(2 * 2 * 9 * 4 + shift, std::byte{0x44});
    std::vector<std::byte> got = want;
    host::pack_ue8m0(want.data() + shift, scales.data() + shift, 9, 4, 5, 2);
    cuda::pack_ue8m0_emulated(got.data() + shift, scales.data() + shift, 9, 4, 5, 2);
    ASSERT_EQ(got, want) << "pack_ue8m0 shift " << shift;
  }
  for (std::size_t shift : {0, 1}) {
    const std::vector<std::byte> src = noise(192 * 64 + shift, 10);
    std::vector<std::byte> want(192 * 64 + shift, std::byte{0x55});
    std::vector<std::byte> got = want;
    host::repack_marlin_fp4(want.data() + shift, src.data() + shift, 192, 128);
    cuda::repack_marlin_fp4_emulated(got.data() + shift, src.data() + shift, 192, 128);
    ASSERT_EQ(got, want) << "repack_marlin_fp4 shift " << shift;
    host::marlin_fp4_scales(want.data() + shift, src.data() + shift, 192, 8);
    cuda::marlin_fp4_scales_emulated(got.data() + shift, src.data() + shift, 192, 8);
    ASSERT_EQ(got, want) << "marlin_fp4_scales shift " << shift;
  }
}

// The sentinel check's per-byte rule against the host twin: every element size,
// odd alignments and lengths, a change at the first or last element, empty ranges,
// an element size the kernel refuses (0).
TEST(CudaKernelEmulationTest, MatchPatternMatchesTheHostTwin) {
  std::mt19937 rng(11);
  std::vector<std::byte> buf(1 << 16);
  std::vector<PatternRange> table;
  std::vector<std::uint8_t> want;
  const std::uint64_t pattern = 0xF0E0D0C0B0A09080ull;
  std::size_t at = 0;
  for (std::uint32_t es : {1u, 2u, 4u, 8u}) {
    for (std::size_t bytes : {std::size_t{0}, std::size_t{es - 1}, std::size_t{3 * es + 1},
                              std::size_t{4000}}) {
      for (int change : {-1, 0, 1}) {  // none, the first byte, the last whole element's byte
        at += 3;                        // odd alignments
        for (std::size_t j = 0; j < bytes; ++j) {
          buf.at(at + j) = static_cast<std::byte>((pattern >> (8 * (j % es))) & 0xFF);
        }
        const std::size_t whole = bytes / es * es;
        if (change == 0 && whole != 0) {
          buf[at] ^= std::byte{1};
        } else if (change == 1 && whole != 0) {
          buf[at + whole - 1] ^= std::byte{1};
        }
        table.push_back({buf.data() + at, bytes, pattern, es, 0});
        want.push_back(host::matches_pattern(buf.data() + at, bytes, pattern, es) ? 1 : 0);
        at += bytes;
      }
    }
  }
  table.push_back({buf.data() + at, 64, rng(), 1, 0});  // random bytes: (almost surely) not
  want.push_back(host::matches_pattern(buf.data() + at, 64, table.back().pattern, 1) ? 1 : 0);
  table.push_back({buf.data(), 16, pattern, 0, 0});  // refused element size
  want.push_back(0);
  std::vector<std::uint8_t> got(table.size(), 0xFF);
  cuda::match_pattern_emulated(table.data(), table.size(), got.data());
  EXPECT_EQ(got, want);
  EXPECT_NE(std::count(want.begin(), want.end(), 1), 0);
  EXPECT_NE(std::count(want.begin(), want.end(), 0), 0);
}

#else

TEST(CudaKernelEmulationTest, NeedsTheCudaBackend) {
  GTEST_SKIP() << "ferry was built without the CUDA backend";
}

#endif

}  // namespace
}  // namespace ferry::gpu
