// The CUDA kernels' element code, compiled for the host and run on the CPU,
// against the host twins. Runs without a GPU wherever the CUDA backend is built;
// what it cannot check (the GPU's own conversion instructions) the self-test on a
// GPU does.
#include <gtest/gtest.h>

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

#else

TEST(CudaKernelEmulationTest, NeedsTheCudaBackend) {
  GTEST_SKIP() << "ferry was built without the CUDA backend";
}

#endif

}  // namespace
}  // namespace ferry::gpu
