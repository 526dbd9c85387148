// The CUDA backend on a real GPU, compared byte for byte with the host backend.
// Every test here needs a GPU and skips with the runtime's reason without one; all
// are named CudaDevice* so that CTest can label them `gpu`.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <iostream>
#include <vector>

#include "common/error.hpp"
#include "gpu/backends.hpp"
#include "gpu/selftest.hpp"

namespace ferry::gpu {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (cuda_device_count(&why) == 0) {
      GTEST_SKIP() << "no CUDA device: " << why;
    }
  }
};

TEST_F(CudaDeviceTest, SelftestMatchesTheHostBackendOnEveryGpu) {
  auto reference = make_host_device(0);
  for (auto& device : make_devices("cuda")) {
    SelftestResult r = run_selftest(*device, *reference);
    EXPECT_TRUE(r.passed()) << r.report();
    std::cout << r.report();
  }
}

TEST_F(CudaDeviceTest, AllocationsStreamsAndEventsAreTrackedAndReleased) {
  auto device = make_cuda_device(0);
  device->bind();
  {
    DeviceAllocation a = device->allocate(1 << 20);
    ASSERT_NE(a.data(), nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % kDeviceAlignment, 0u);
    PinnedAllocation p = device->allocate_pinned(3 << 20);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.data()) % kPinnedAlignment, 0u);
    std::vector<std::byte> host(1 << 20, std::byte{7});
    HostRegistration r = device->register_host(host.data(), host.size());
    auto stream = device->create_stream();
    std::memset(p.data(), 0x3C, 1 << 20);
    stream->copy_h2d(a.data(), p.data(), 1 << 20);
    auto event = stream->record();
    event->synchronize();
    EXPECT_TRUE(event->query());
    std::vector<std::byte> back(1 << 20);
    stream->copy_d2h(back.data(), a.data(), back.size());
    stream->synchronize();
    EXPECT_EQ(back, std::vector<std::byte>(1 << 20, std::byte{0x3C}));
    AllocationStats s = device->stats();
    EXPECT_EQ(s.device.live_bytes, std::size_t{1} << 20);
    EXPECT_EQ(s.pinned.live_bytes, std::size_t{3} << 20);
    EXPECT_EQ(s.registered.live_bytes, std::size_t{1} << 20);
    EXPECT_EQ(s.live_streams, 1u);
    EXPECT_EQ(s.live_events, 1u);
  }
  EXPECT_TRUE(device->stats().all_released());
}

TEST_F(CudaDeviceTest, ErrorsNameTheFailingCall) {
  auto device = make_cuda_device(0);
  try {
    device->allocate(std::size_t{1} << 60);  // fails at once and leaves the context usable
    FAIL() << "allocated 2^60 bytes";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kCopy);
    EXPECT_EQ(e.file(), "cuda:0");
    EXPECT_EQ(e.rule().rfind("cudaMalloc: ", 0), 0u) << e.rule();
    EXPECT_NE(e.rule().find("(cudaErrorMemoryAllocation, code 2)"), std::string::npos) << e.rule();
  }
  EXPECT_TRUE(device->stats().all_released());
  // The device still works after the failure (the error was not sticky).
  DeviceAllocation a = device->allocate(64);
  auto stream = device->create_stream();
  stream->fill(a.data(), 16, DType::kF32, 1.0);
  std::vector<std::byte> back(64);
  stream->copy_d2h(back.data(), a.data(), 64);
  stream->synchronize();
  std::uint32_t first;
  std::memcpy(&first, back.data(), 4);
  EXPECT_EQ(first, 0x3F800000u);
}

TEST_F(CudaDeviceTest, ArgumentChecksMatchTheHostBackend) {
  auto device = make_cuda_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(1024);
  EXPECT_THROW(stream->fill(a.data(), 4, DType::kI32, 1.0), Error);
  EXPECT_THROW(stream->cast(a.data(), DType::kF32, a.data(), DType::kBF16, 4), Error);
  EXPECT_THROW(stream->copy_h2d_2d(a.data(), 8, a.data(), 16, 9, 2), Error);
}

}  // namespace
}  // namespace ferry::gpu
