// The null backend: address ranges no memory backs, every stream operation checked
// against the live allocations with the host backend's words, bytes counted and
// discarded, nothing readable back; `null:N` specs.
#include "gpu/null_device.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/error.hpp"
#include "gpu/backends.hpp"
#include "gpu/host_device.hpp"

namespace ferry::gpu {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

auto fails_with(const std::string& device, const std::string& words) {
  return ThrowsMessage<Error>(AllOf(HasSubstr(device), HasSubstr(words)));
}

TEST(NullDeviceTest, AllocationsAreDistinctAlignedAndUnbacked) {
  auto device = make_null_device(3);
  EXPECT_EQ(device->name(), "null:3");
  EXPECT_FALSE(device->holds_data());
  EXPECT_TRUE(make_host_device(0)->holds_data());
  // A terabyte costs nothing: no memory is behind it.
  DeviceAllocation big = device->allocate(std::size_t{1} << 40);
  DeviceAllocation a = device->allocate(100);
  DeviceAllocation b = device->allocate(1);
  EXPECT_TRUE(device->allocate(0).empty());
  for (const DeviceAllocation* x : {&big, &a, &b}) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(x->data()) % kDeviceAlignment, 0u);
  }
  EXPECT_GE(a.data(), big.data() + big.size() + 1);
  EXPECT_GE(b.data(), a.data() + a.size() + 1);
  AllocationStats s = device->stats();
  EXPECT_EQ(s.device.live_count, 3u);
  EXPECT_EQ(s.device.live_bytes, (std::size_t{1} << 40) + 101);
  big.reset();
  a.reset();
  b.reset();
  EXPECT_TRUE(device->stats().all_released());
}

TEST(NullDeviceTest, CopiesAreCheckedCountedAndDiscarded) {
  auto device = make_null_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(1000);
  std::vector<std::byte> host(1000);
  stream->copy_h2d(a.data(), host.data(), 1000);
  stream->copy_h2d(a.data() + 10, host.data(), 0);                 // nothing
  stream->copy_h2d_2d(a.data() + 1, 100, host.data(), 10, 10, 5);  // 50 bytes
  stream->fill(a.data(), 10, DType::kBF16, 1.0);                   // 20 bytes
  stream->zero(a.data() + 500, 500);
  stream->cast(a.data(), DType::kF32, a.data() + 800, DType::kBF16, 100);  // 400 written
  stream->fill_random(a.data() + 3, 30, DType::kF8E4M3, -1, 1, 5);         // 30 bytes
  std::unique_ptr<Event> e = stream->record();
  EXPECT_TRUE(e->query());
  e->synchronize();
  stream->synchronize();
  EXPECT_EQ(null_device_bytes_written(*device), 1000u + 50 + 20 + 500 + 400 + 30);
  EXPECT_THAT([&] { null_device_bytes_written(*make_host_device(0)); },
              ThrowsMessage<Error>(HasSubstr("not a null device")));
}

TEST(NullDeviceTest, PitchedAndBatchedOperationsCountTheirRowsAndCheckRanges) {
  auto device = make_null_device(2);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(1000);
  stream->zero_2d(a.data(), 100, 10, 5);                                                // 50
  stream->copy_d2d_2d(a.data() + 500, 20, a.data(), 30, 20, 4);                         // 80
  stream->cast_2d(a.data(), 40, DType::kF32, a.data() + 600, 20, DType::kBF16, 10, 3);  // 120
  stream->transpose(a.data() + 800, 24, a.data(), 24, 2, 3, 4, 2);                      // 48
  EXPECT_EQ(null_device_bytes_written(*device), 50u + 80 + 120 + 48);
  EXPECT_THAT([&] { stream->copy_d2d_2d(a.data() + 990, 20, a.data(), 30, 20, 4); },
              fails_with("null:2", "copy_d2d_2d: destination"));
  EXPECT_THAT([&] { stream->transpose(a.data(), 8, a.data() + 990, 8, 4, 1, 2, 2); },
              fails_with("null:2", "transpose: source"));
  EXPECT_EQ(null_device_bytes_written(*device), 50u + 80 + 120 + 48);  // failures count nothing
}

TEST(NullDeviceTest, RangesOutsideAllocationsFailAsOnTheHostBackend) {
  auto device = make_null_device(1);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(100);
  std::vector<std::byte> host(200);
  EXPECT_THAT([&] { stream->copy_h2d(a.data() + 1, host.data(), 100); },
              fails_with("null:1", "copy_h2d: destination"));
  EXPECT_THAT([&] { stream->copy_h2d(a.data() + 1, host.data(), 100); },
              fails_with("null:1", "not inside a live allocation of this device"));
  EXPECT_THAT([&] { stream->copy_h2d(host.data(), host.data(), 10); },
              fails_with("null:1", "not inside a live allocation"));
  EXPECT_THAT([&] { stream->copy_h2d(a.data(), nullptr, 4); },
              fails_with("null:1", "source is null"));
  EXPECT_THAT([&] { stream->zero(a.data() - 1, 2); }, fails_with("null:1", "zero: destination"));
  EXPECT_THAT([&] { stream->fill(a.data(), 26, DType::kF32, 1.0); },
              fails_with("null:1", "fill: destination"));
  EXPECT_THAT([&] { stream->fill(a.data(), 2, DType::kI8, 1.0); }, fails_with("null:1", "fill"));
  EXPECT_THAT([&] { stream->fill_random(a.data(), 26, DType::kF32, 0, 1, 1); },
              fails_with("null:1", "fill_random: destination"));
  EXPECT_THAT([&] { stream->fill_random(a.data(), 2, DType::kF64, 0, 1, 1); },
              fails_with("null:1", "fill_random: dtype F64 is not supported"));
  EXPECT_THAT([&] { stream->cast(a.data(), DType::kF32, a.data() + 90, DType::kBF16, 10); },
              fails_with("null:1", "cast: source"));
  // 6 rows of pitch 20 end at 5 * 20 + 1 = 101 > 100.
  EXPECT_THAT([&] { stream->copy_h2d_2d(a.data(), 20, host.data(), 20, 1, 6); },
              fails_with("null:1", "not inside a live allocation"));
  EXPECT_THAT([&] { stream->copy_h2d_2d(a.data(), 8, host.data(), 16, 9, 2); },
              fails_with("null:1", "destination pitch 8 is smaller than the row width 9"));
  // Another null device's ranges, and freed ones, are not this device's.
  auto other = make_null_device(2);
  DeviceAllocation b = other->allocate(100);
  EXPECT_THAT([&] { stream->copy_h2d(b.data(), host.data(), 10); },
              fails_with("null:1", "not inside a live allocation"));
  std::byte* stale = a.data();
  a.reset();
  EXPECT_THAT([&] { stream->copy_h2d(stale, host.data(), 10); },
              fails_with("null:1", "not inside a live allocation"));
  EXPECT_EQ(null_device_bytes_written(*device), 0u);  // nothing that failed was counted
}

TEST(NullDeviceTest, NothingCanBeReadBack) {
  auto device = make_null_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(16);
  std::vector<std::byte> host(16);
  EXPECT_THAT([&] { stream->copy_d2h(host.data(), a.data(), 16); },
              fails_with("null:0", "keeps no data"));
  stream->copy_d2h(host.data(), a.data(), 0);  // nothing asked, nothing refused
}

TEST(NullDeviceTest, PinnedMemoryIsRealAndRegistrationsPinNothing) {
  auto device = make_null_device(0);
  PinnedAllocation p = device->allocate_pinned(8192);
  ASSERT_FALSE(p.empty());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.data()) % kPinnedAlignment, 0u);
  p.data()[8191] = std::byte{7};  // writable host memory
  std::vector<std::byte> buffer(64);
  HostRegistration r = device->register_host(buffer.data(), buffer.size());
  EXPECT_EQ(r.data(), buffer.data());
  EXPECT_EQ(device->stats().registered.live_bytes, 64u);
  p.reset();
  r.reset();
  EXPECT_TRUE(device->stats().all_released());
}

TEST(NullDeviceTest, SpecsMakeNullDevices) {
  auto devices = make_devices("null:3");
  ASSERT_EQ(devices.size(), 3u);
  EXPECT_EQ(devices[2]->name(), "null:2");
  EXPECT_EQ(make_devices("null").size(), 1u);
  EXPECT_THAT([] { make_devices("null:0"); }, ThrowsMessage<Error>(HasSubstr("null:N makes")));
  EXPECT_THAT([] { make_devices("null:x"); }, ThrowsMessage<Error>(HasSubstr("'x'")));
  EXPECT_THAT([] { make_devices("null:"); }, ThrowsMessage<Error>(HasSubstr("nothing after ':'")));
}

}  // namespace
}  // namespace ferry::gpu
