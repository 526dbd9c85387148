// The host backend: allocation tracking and capacity, bounds checks, copies (1-D
// and pitched 2-D), fill/zero/cast, events, and the bandwidth cap.
#include "gpu/host_device.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "gpu/kernels_host.hpp"
#include "gpu/link_throttle.hpp"

namespace ferry::gpu {
namespace {

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 8)) & 0xFF);
  }
  return v;
}

// Reads a whole allocation back through the stream.
std::vector<std::byte> read_back(Stream& s, const DeviceAllocation& a) {
  std::vector<std::byte> out(a.size());
  s.copy_d2h(out.data(), a.data(), a.size());
  s.synchronize();
  return out;
}

// Asserts that `f` throws ferry::Error naming `device`, with `words` in its rule.
template <class F>
void expect_error(F&& f, const std::string& device, const std::string& words,
                  Stage stage = Stage::kCopy) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << words << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), stage) << e.what();
    EXPECT_EQ(e.file(), device) << e.what();
    EXPECT_NE(e.rule().find(words), std::string::npos) << e.what();
  }
}

TEST(HostDeviceTest, NameCarriesTheIndex) {
  EXPECT_EQ(make_host_device(3)->name(), "host:3");
  expect_error([] { make_host_device(-1); }, "host:-1", "negative", Stage::kConfig);
  expect_error([] { make_host_device(0, {.bandwidth_gbps = -1}); }, "host:0", "bandwidth_gbps",
               Stage::kConfig);
  expect_error([] { make_host_device(0, {.bandwidth_gbps = std::nan("")}); }, "host:0",
               "bandwidth_gbps", Stage::kConfig);
}

TEST(HostDeviceTest, AllocationsAreAlignedAndTracked) {
  auto device = make_host_device(0);
  EXPECT_TRUE(device->stats().all_released());
  {
    DeviceAllocation a = device->allocate(1000);
    DeviceAllocation b = device->allocate(3000);
    ASSERT_NE(a.data(), nullptr);
    EXPECT_EQ(a.size(), 1000u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % kDeviceAlignment, 0u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % kDeviceAlignment, 0u);
    AllocationStats s = device->stats();
    EXPECT_EQ(s.device.live_bytes, 4000u);
    EXPECT_EQ(s.device.live_count, 2u);
    EXPECT_FALSE(s.all_released());
    a.reset();
    EXPECT_TRUE(a.empty());
    DeviceAllocation c = device->allocate(500);
    s = device->stats();
    EXPECT_EQ(s.device.live_bytes, 3500u);
    EXPECT_EQ(s.device.peak_bytes, 4000u);
    EXPECT_EQ(s.device.total_bytes, 4500u);
    EXPECT_EQ(s.device.total_count, 3u);
    DeviceAllocation moved = std::move(b);  // moving does not release
    EXPECT_EQ(device->stats().device.live_count, 2u);
    EXPECT_EQ(moved.size(), 3000u);
  }
  AllocationStats s = device->stats();
  EXPECT_EQ(s.device.live_bytes, 0u);
  EXPECT_EQ(s.device.live_count, 0u);
  EXPECT_EQ(s.device.peak_bytes, 4000u);
  EXPECT_TRUE(s.all_released());
}

// Blocks from 4 MiB up are mapped (huge-page aligned, committed at once) rather
// than taken from the heap: the same contract, checked across that threshold,
// with copies of every kind landing where they should and poison where none did.
TEST(HostDeviceTest, LargeAllocationsKeepTheContract) {
  for (bool poison : {false, true}) {
    auto device = make_host_device(0, {.poison_allocations = poison});
    std::unique_ptr<Stream> stream = device->create_stream();
    for (std::size_t bytes :
         {(std::size_t{4} << 20) - 1, std::size_t{4} << 20, (std::size_t{9} << 20) + 4097}) {
      SCOPED_TRACE("bytes " + std::to_string(bytes) + (poison ? " poisoned" : ""));
      DeviceAllocation a = device->allocate(bytes);
      ASSERT_NE(a.data(), nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % kDeviceAlignment, 0u);
      EXPECT_EQ(device->stats().device.live_bytes, bytes);
      std::vector<std::byte> src = pattern(bytes / 2, 3);
      stream->copy_h2d(a.data() + 5, src.data(), src.size());
      stream->copy_h2d_2d(a.data() + bytes - 3 * 4096, 4096, src.data(), 1000, 1000, 3);
      std::vector<std::byte> got = read_back(*stream, a);
      ASSERT_EQ(got.size(), bytes);
      EXPECT_EQ(std::memcmp(got.data() + 5, src.data(), src.size()), 0);
      for (std::size_t r = 0; r < 3; ++r) {
        EXPECT_EQ(
            std::memcmp(got.data() + bytes - 3 * 4096 + r * 4096, src.data() + r * 1000, 1000), 0);
      }
      if (poison) {
        EXPECT_EQ(got[0], kPoisonByte);
        EXPECT_EQ(got[bytes - 1], kPoisonByte);
      }
      EXPECT_THROW(stream->copy_h2d(a.data() + bytes - 10, src.data(), 11), Error);
    }
    stream.reset();
    EXPECT_TRUE(device->stats().all_released());
  }
}

// The VmFlags of the mapping that holds `p` (/proc/self/smaps), "" when not found.
std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    std::uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= addr && addr < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST(HostDeviceTest, LargeAllocationsAskForHugePagesUnlessTurnedOff) {
  for (bool huge : {true, false}) {
    SCOPED_TRACE(huge);
    HostDeviceOptions o;
    o.huge_pages = huge;
    auto dev = make_host_device(0, o);
    DeviceAllocation a = dev->allocate(std::size_t{16} << 20);
    const std::string flags = vm_flags_of(a.data());
    ASSERT_FALSE(flags.empty());
    // "hg": the mapping was given MADV_HUGEPAGE.
    EXPECT_EQ(flags.find(" hg") != std::string::npos, huge) << flags;
    std::memset(a.data(), 1, a.size());  // committed and writable either way
  }
}

TEST(HostDeviceTest, ZeroBytesGiveEmptyHandlesThatCountNothing) {
  auto device = make_host_device(0);
  DeviceAllocation a = device->allocate(0);
  PinnedAllocation p = device->allocate_pinned(0);
  HostRegistration r = device->register_host(nullptr, 0);
  EXPECT_TRUE(a.empty());
  EXPECT_TRUE(p.empty());
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(device->stats().device.total_count, 0u);
  EXPECT_EQ(device->stats().pinned.total_count, 0u);
}

TEST(HostDeviceTest, CapacityIsEnforcedLikeOutOfMemory) {
  auto device = make_host_device(2, {.capacity_bytes = 1000});
  DeviceAllocation a = device->allocate(600);
  expect_error([&] { device->allocate(401); }, "host:2", "out of memory");
  expect_error([&] { device->allocate(std::numeric_limits<std::size_t>::max()); }, "host:2",
               "capacity of 1000");
  DeviceAllocation b = device->allocate(400);  // exactly full
  EXPECT_EQ(device->stats().device.live_bytes, 1000u);
  a.reset();
  DeviceAllocation c = device->allocate(600);  // freed memory is reusable
  EXPECT_EQ(device->stats().device.live_count, 2u);
  EXPECT_EQ(device->stats().device.total_count, 3u);  // failed attempts count nothing
}

TEST(HostDeviceTest, PinnedMemoryIsPageAlignedWritableAndTracked) {
  auto device = make_host_device(0);
  PinnedAllocation p = device->allocate_pinned(10000);
  ASSERT_NE(p.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.data()) % kPinnedAlignment, 0u);
  std::memset(p.data(), 0x5A, p.size());
  EXPECT_EQ(device->stats().pinned.live_bytes, 10000u);
  EXPECT_FALSE(device->stats().all_released());
  p.reset();
  EXPECT_EQ(device->stats().pinned.live_bytes, 0u);
  EXPECT_TRUE(device->stats().all_released());
}

TEST(HostDeviceTest, RegisteringRefusesOverlapsAndIsTracked) {
  auto device = make_host_device(0);
  std::vector<std::byte> buffer(8192);
  {
    HostRegistration r = device->register_host(buffer.data() + 100, 1000);
    EXPECT_EQ(r.data(), buffer.data() + 100);
    EXPECT_EQ(device->stats().registered.live_bytes, 1000u);
    expect_error([&] { device->register_host(buffer.data() + 1099, 10); }, "host:0", "overlaps");
    expect_error([&] { device->register_host(buffer.data(), 101); }, "host:0", "overlaps");
    HostRegistration next = device->register_host(buffer.data() + 1100, 10);  // adjacent: fine
    HostRegistration before = device->register_host(buffer.data(), 100);
    EXPECT_EQ(device->stats().registered.live_count, 3u);
  }
  EXPECT_TRUE(device->stats().all_released());
  HostRegistration again = device->register_host(buffer.data() + 100, 1000);
  EXPECT_EQ(device->stats().registered.live_count, 1u);
  expect_error([&] { device->register_host(nullptr, 10); }, "host:0", "null");
}

TEST(HostDeviceTest, StreamsAndEventsAreTrackedAndEventsCompleteAtOnce) {
  auto device = make_host_device(0);
  auto stream = device->create_stream();
  auto event = stream->record();
  EXPECT_EQ(device->stats().live_streams, 1u);
  EXPECT_EQ(device->stats().live_events, 1u);
  EXPECT_TRUE(event->query());
  event->synchronize();
  event.reset();
  stream.reset();
  EXPECT_TRUE(device->stats().all_released());
}

TEST(HostDeviceTest, HandlesMayOutliveTheDevice) {
  auto device = make_host_device(0);
  DeviceAllocation a = device->allocate(64);
  auto stream = device->create_stream();
  device.reset();
  std::vector<std::byte> src = pattern(64, 1);
  stream->copy_h2d(a.data(), src.data(), 64);
  EXPECT_EQ(read_back(*stream, a), src);
}

TEST(HostDeviceTest, PoisonMarksBytesNothingWrote) {
  auto device = make_host_device(0, {.poison_allocations = true});
  DeviceAllocation a = device->allocate(333);
  auto stream = device->create_stream();
  EXPECT_EQ(read_back(*stream, a), std::vector<std::byte>(333, kPoisonByte));
}

TEST(HostDeviceTest, CopyH2DWritesExactlyTheRange) {
  auto device = make_host_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(1000);
  std::vector<std::byte> background = pattern(1000, 1);
  stream->copy_h2d(a.data(), background.data(), 1000);
  std::vector<std::byte> src = pattern(333, 2);
  stream->copy_h2d(a.data() + 17, src.data(), src.size());
  stream->copy_h2d(a.data() + 999, src.data(), 0);  // nothing
  std::vector<std::byte> want = background;
  std::memcpy(want.data() + 17, src.data(), src.size());
  EXPECT_EQ(read_back(*stream, a), want);
}

TEST(HostDeviceTest, DevicePointersMustLieInALiveAllocation) {
  auto device = make_host_device(1);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(100);
  std::vector<std::byte> host(200);
  expect_error([&] { stream->copy_h2d(a.data() + 1, host.data(), 100); }, "host:1",
               "not inside a live allocation");
  expect_error([&] { stream->copy_h2d(host.data(), host.data() + 100, 10); }, "host:1",
               "copy_h2d: destination");
  expect_error([&] { stream->copy_d2h(host.data(), a.data() + 50, 51); }, "host:1",
               "copy_d2h: source");
  expect_error([&] { stream->zero(a.data() - 1, 2); }, "host:1", "zero: destination");
  expect_error([&] { stream->fill(a.data(), 26, DType::kF32, 1.0); }, "host:1", "fill");
  expect_error([&] { stream->cast(host.data(), DType::kF32, a.data(), DType::kF16, 4); }, "host:1",
               "cast: destination");
  expect_error([&] { stream->copy_h2d(a.data(), nullptr, 4); }, "host:1", "source is null");
  // Another device's memory is not this device's.
  auto other = make_host_device(2);
  DeviceAllocation b = other->allocate(100);
  expect_error([&] { stream->copy_h2d(b.data(), host.data(), 10); }, "host:1",
               "not inside a live allocation");
  // Nor is memory that was freed.
  std::byte* stale = a.data();
  a.reset();
  expect_error([&] { stream->copy_h2d(stale, host.data(), 10); }, "host:1",
               "not inside a live allocation");
}

TEST(HostDeviceTest, Copy2DTouchesOnlyTheRegion) {
  auto device = make_host_device(0);
  auto stream = device->create_stream();
  const std::size_t dst_pitch = 37, src_pitch = 29, width = 23, rows = 11;
  const std::size_t offset = 3;
  DeviceAllocation a = device->allocate(offset + rows * dst_pitch + 5);
  std::vector<std::byte> background = pattern(a.size(), 3);
  stream->copy_h2d(a.data(), background.data(), a.size());
  std::vector<std::byte> src = pattern((rows - 1) * src_pitch + width, 4);
  stream->copy_h2d_2d(a.data() + offset, dst_pitch, src.data(), src_pitch, width, rows);
  std::vector<std::byte> got = read_back(*stream, a);
  for (std::size_t i = 0; i < a.size(); ++i) {
    std::byte want = background[i];
    if (i >= offset) {
      std::size_t row = (i - offset) / dst_pitch;
      std::size_t col = (i - offset) % dst_pitch;
      if (row < rows && col < width) {
        want = src[row * src_pitch + col];
      }
    }
    ASSERT_EQ(got[i], want) << "byte " << i;
  }
}

TEST(HostDeviceTest, Copy2DChecksPitchesAndBounds) {
  auto device = make_host_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(100);
  std::vector<std::byte> src(1000);
  expect_error([&] { stream->copy_h2d_2d(a.data(), 8, src.data(), 16, 9, 2); }, "host:0",
               "destination pitch 8 is smaller than the row width 9");
  expect_error([&] { stream->copy_h2d_2d(a.data(), 16, src.data(), 8, 9, 2); }, "host:0",
               "source pitch 8");
  // 6 rows of pitch 20 end at 5 * 20 + 1 = 101 > 100.
  expect_error([&] { stream->copy_h2d_2d(a.data(), 20, src.data(), 20, 1, 6); }, "host:0",
               "not inside a live allocation");
  expect_error(
      [&] {
        stream->copy_h2d_2d(a.data(), std::size_t{1} << 40, src.data(), 1, 1, std::size_t{1} << 30);
      },
      "host:0", "overflows");
  stream->copy_h2d_2d(a.data(), 20, src.data(), 20, 1, 5);    // exactly fits
  stream->copy_h2d_2d(a.data(), 20, src.data(), 20, 0, 500);  // empty: nothing, no checks
  stream->copy_h2d_2d(a.data(), 20, src.data(), 20, 7, 0);
}

TEST(HostDeviceTest, FillZeroAndCastMatchTheHostTwins) {
  auto device = make_host_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(4096);
  std::vector<std::byte> want = pattern(4096, 5);
  stream->copy_h2d(a.data(), want.data(), want.size());

  stream->fill(a.data() + 1, 100, DType::kBF16, 1e-3);
  host::fill(want.data() + 1, 100, DType::kBF16, 1e-3);
  stream->zero(a.data() + 300, 77);
  std::memset(want.data() + 300, 0, 77);
  stream->fill(a.data() + 400, 10, DType::kF64, -2.5);
  host::fill(want.data() + 400, 10, DType::kF64, -2.5);
  stream->cast(a.data() + 1000, DType::kF32, a.data() + 1, DType::kBF16, 100);
  host::cast(want.data() + 1000, DType::kF32, want.data() + 1, DType::kBF16, 100);
  stream->cast(a.data() + 2000, DType::kF16, a.data() + 1000, DType::kF32, 100);
  host::cast(want.data() + 2000, DType::kF16, want.data() + 1000, DType::kF32, 100);
  stream->cast(a.data() + 2000, DType::kBF16, a.data() + 2000, DType::kF16, 100);  // in place
  host::cast(want.data() + 2000, DType::kBF16, want.data() + 2000, DType::kF16, 100);
  stream->fill_random(a.data() + 3001, 333, DType::kBF16, -1e-3, 1e-3, 7);
  host::fill_random(want.data() + 3001, 333, DType::kBF16, -1e-3, 1e-3, 7);
  EXPECT_EQ(read_back(*stream, a), want);

  // The F32 written above is exactly BF16 1e-3 widened.
  std::uint32_t f32;
  std::memcpy(&f32, want.data() + 1000, 4);
  EXPECT_EQ(f32, 0x3A830000u);
}

TEST(HostDeviceTest, FillAndCastRejectBadArguments) {
  auto device = make_host_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(1024);
  expect_error([&] { stream->fill(a.data(), 4, DType::kI32, 1.0); }, "host:0",
               "dtype I32 is not supported");
  expect_error([&] { stream->fill_random(a.data(), 4, DType::kI32, 0, 1, 1); }, "host:0",
               "fill_random: dtype I32 is not supported");
  expect_error([&] { stream->fill_random(a.data() + 1000, 30, DType::kU8, 0, 1, 1); }, "host:0",
               "fill_random: destination");
  expect_error([&] { stream->cast(a.data(), DType::kU8, a.data() + 512, DType::kF32, 4); },
               "host:0", "only BF16, F16 and F32");
  // Overlapping ranges, other than exactly in place with equal sizes.
  expect_error([&] { stream->cast(a.data(), DType::kF32, a.data(), DType::kBF16, 4); }, "host:0",
               "overlap");
  expect_error([&] { stream->cast(a.data() + 2, DType::kF16, a.data(), DType::kBF16, 4); },
               "host:0", "overlap");
  expect_error(
      [&] {
        stream->cast(a.data(), DType::kF32, a.data() + 512, DType::kF16,
                     std::numeric_limits<std::size_t>::max() / 2);
      },
      "host:0", "overflows");
  stream->cast(a.data(), DType::kF32, a.data() + 512, DType::kF16, 0);  // nothing
}

TEST(HostDeviceTest, PitchedAndBatchedOperationsWriteOnlyTheirRows) {
  auto device = make_host_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(8192);
  std::vector<std::byte> want = pattern(a.size(), 9);
  stream->copy_h2d(a.data(), want.data(), want.size());

  // zero_2d: 5 rows of 7 bytes, 13 apart.
  stream->zero_2d(a.data() + 3, 13, 7, 5);
  for (std::size_t r = 0; r < 5; ++r) {
    std::memset(want.data() + 3 + r * 13, 0, 7);
  }
  // copy_d2d_2d: 6 rows of 10 bytes from pitch 24 to pitch 11 (a gather).
  stream->copy_d2d_2d(a.data() + 200, 11, a.data() + 1000, 24, 10, 6);
  for (std::size_t r = 0; r < 6; ++r) {
    std::memcpy(want.data() + 200 + r * 11, want.data() + 1000 + r * 24, 10);
  }
  // cast_2d: 4 rows of 9 BF16 elements (pitch 20) into F32 rows of pitch 40.
  stream->cast_2d(a.data() + 2000, 40, DType::kF32, a.data() + 1500, 20, DType::kBF16, 9, 4);
  for (std::size_t r = 0; r < 4; ++r) {
    host::cast(want.data() + 2000 + r * 40, DType::kF32, want.data() + 1500 + r * 20, DType::kBF16,
               9);
  }
  // transpose: 3 batches of 2 x 5 F16 matrices (source batches 24 bytes apart).
  stream->transpose(a.data() + 3000, 20, a.data() + 2600, 24, 2, 2, 5, 3);
  for (std::size_t b = 0; b < 3; ++b) {
    for (std::size_t i = 0; i < 2; ++i) {
      for (std::size_t j = 0; j < 5; ++j) {
        std::memcpy(want.data() + 3000 + b * 20 + (j * 2 + i) * 2,
                    want.data() + 2600 + b * 24 + (i * 5 + j) * 2, 2);
      }
    }
  }
  EXPECT_EQ(read_back(*stream, a), want);
}

TEST(HostDeviceTest, PitchedAndBatchedOperationsRejectBadArguments) {
  auto device = make_host_device(0);
  auto stream = device->create_stream();
  DeviceAllocation a = device->allocate(1024);
  expect_error([&] { stream->zero_2d(a.data(), 8, 9, 2); }, "host:0",
               "zero_2d: destination pitch 8 is smaller than the row width 9");
  expect_error([&] { stream->zero_2d(a.data(), 100, 10, 12); }, "host:0",
               "not inside a live allocation");
  expect_error([&] { stream->copy_d2d_2d(a.data(), 16, a.data() + 8, 16, 8, 4); }, "host:0",
               "copy_d2d_2d: source");
  expect_error([&] { stream->copy_d2d_2d(a.data(), 16, a.data() + 512, 8, 9, 2); }, "host:0",
               "source pitch 8");
  expect_error([&] { stream->copy_d2d_2d(a.data(), 16, a.data() + 1000, 16, 16, 2); }, "host:0",
               "not inside a live allocation");
  expect_error(
      [&] { stream->cast_2d(a.data(), 8, DType::kI8, a.data() + 512, 8, DType::kF32, 2, 2); },
      "host:0", "only BF16, F16 and F32");
  expect_error(
      [&] { stream->cast_2d(a.data(), 8, DType::kF32, a.data() + 512, 8, DType::kF32, 4, 2); },
      "host:0", "destination pitch 8 is smaller than the row width 16");
  expect_error(
      [&] { stream->cast_2d(a.data(), 16, DType::kF32, a.data() + 8, 16, DType::kBF16, 2, 4); },
      "host:0", "overlap");
  expect_error([&] { stream->transpose(a.data(), 64, a.data() + 512, 64, 3, 2, 2, 2); }, "host:0",
               "element size 3 is not supported");
  expect_error([&] { stream->transpose(a.data(), 8, a.data() + 512, 16, 4, 2, 2, 2); }, "host:0",
               "destination pitch 8 is smaller than the row width 16");
  expect_error([&] { stream->transpose(a.data(), 16, a.data() + 8, 16, 4, 2, 2, 2); }, "host:0",
               "overlap");
  expect_error(
      [&] {
        stream->transpose(a.data(), 16, a.data() + 512, 16, 8, std::size_t{1} << 32,
                          std::size_t{1} << 32, 1);
      },
      "host:0", "overflows");
  // In place with equal pitches and element sizes is a cast's one allowed overlap.
  stream->cast_2d(a.data(), 16, DType::kF16, a.data(), 16, DType::kBF16, 4, 3);
  // Empty: nothing, and nothing checked beyond the pitches.
  stream->zero_2d(a.data(), 8, 0, 1000);
  stream->copy_d2d_2d(a.data(), 8, a.data(), 8, 8, 0);
  stream->transpose(a.data(), 0, a.data(), 0, 4, 0, 5, 3);
  stream->synchronize();
}

// The FP8 operations' arguments are checked like the others': dtypes, block sizes,
// a zero tensor_repeat, overlaps, ranges outside live allocations, on the stream
// that queues them (also a deferred one); empty calls do nothing.
TEST(HostDeviceTest, Fp8OperationsCheckTheirArguments) {
  for (bool deferred : {false, true}) {
    HostDeviceOptions options;
    options.deferred_copies = deferred;
    auto dev = make_host_device(0, options);
    DeviceAllocation a = dev->allocate(1024);
    auto stream = dev->create_stream();
    const Fp8Scales row{Fp8Granularity::kRow, 0, 0, 1};
    const Fp8Scales zero_block{Fp8Granularity::kBlock, 0, 4, 1};
    const Fp8Scales no_copies{Fp8Granularity::kTensor, 0, 0, 0};
    std::byte* p = a.data();
    expect_error([&] { stream->dequantize_fp8(p, DType::kF8E4M3, p + 512, p + 900, row, 2, 4, 1); },
                 "host:0", "dequantize_fp8: F8_E4M3 -> F8_E4M3 is not supported");
    expect_error(
        [&] {
          stream->quantize_fp8(p, p + 900, p + 512, DType::kI8, row, Fp8ScaleRule::kAmax, 2, 4, 1);
        },
        "host:0", "quantize_fp8: I8 -> F8_E4M3 is not supported");
    expect_error(
        [&] { stream->dequantize_fp8(p, DType::kBF16, p + 512, p + 900, zero_block, 2, 4, 1); },
        "host:0", "block of at least 1 x 1");
    expect_error(
        [&] {
          stream->quantize_fp8(p, p + 900, p + 512, DType::kF32, no_copies, Fp8ScaleRule::kAmax, 2,
                               4, 1);
        },
        "host:0", "tensor_repeat is 0");
    // 2 x 4 F32 source (32 bytes) overlapping the FP8 destination.
    expect_error(
        [&] {
          stream->quantize_fp8(p, p + 900, p + 4, DType::kF32, row, Fp8ScaleRule::kAmax, 2, 4, 1);
        },
        "host:0", "overlap");
    expect_error(
        [&] {
          stream->quantize_fp8(p, p + 516, p + 512, DType::kF32, row, Fp8ScaleRule::kAmax, 2, 4, 1);
        },
        "host:0", "overlap");
    expect_error([&] { stream->dequantize_fp8(p, DType::kF32, p + 512, p + 16, row, 2, 4, 1); },
                 "host:0", "overlap");
    expect_error([&] { stream->dequantize_fp8(p, DType::kF32, p + 512, p + 1020, row, 2, 4, 1); },
                 "host:0", "dequantize_fp8: scales");
    expect_error([&] { stream->pack_ue8m0(p + 1000, p, 8, 4, 5, 1); }, "host:0",
                 "pack_ue8m0: destination");
    expect_error([&] { stream->pack_ue8m0(p, p + 512, 8, 0, 5, 1); }, "host:0",
                 "block_rows must be at least 1");
    expect_error([&] { stream->pack_ue8m0(p, p + 8, 8, 4, 5, 1); }, "host:0", "overlap");
    expect_error([&] { stream->repack_marlin_fp4(p, p + 512, 32, 16); }, "host:0",
                 "repack_marlin_fp4: n 32, k 16: Marlin's tiles need n % 64 == 0 and k % 16 == 0");
    expect_error([&] { stream->repack_marlin_fp4(p, p + 512, 64, 8); }, "host:0",
                 "k % 16 == 0");
    expect_error([&] { stream->repack_marlin_fp4(p, p + 256, 64, 16); }, "host:0", "overlap");
    expect_error([&] { stream->marlin_fp4_scales(p, p + 512, 96, 1); }, "host:0",
                 "marlin_fp4_scales: n 96, groups 1");
    expect_error([&] { stream->marlin_fp4_scales(p + 1000, p, 64, 1); }, "host:0",
                 "marlin_fp4_scales: destination");
    // Empty: nothing to do, nothing checked beyond the layout.
    stream->dequantize_fp8(nullptr, DType::kBF16, nullptr, nullptr, row, 0, 4, 1);
    stream->quantize_fp8(nullptr, nullptr, nullptr, DType::kBF16, row, Fp8ScaleRule::kAmax, 3, 0,
                         1);
    stream->pack_ue8m0(nullptr, nullptr, 0, 4, 5, 1);
    // A valid call on the deferred queue lands after synchronize().
    const float x[2] = {448.0f, -1.0f};
    stream->copy_h2d(p + 512, reinterpret_cast<const std::byte*>(x), sizeof x);
    stream->quantize_fp8(p, p + 600, p + 512, DType::kF32, Fp8Scales{}, Fp8ScaleRule::kAmax, 1, 2,
                         1);
    std::uint8_t q[2];
    float s = 0;
    stream->copy_d2h(reinterpret_cast<std::byte*>(q), p, 2);
    stream->copy_d2h(reinterpret_cast<std::byte*>(&s), p + 600, 4);
    stream->synchronize();
    EXPECT_EQ(q[0], 0x7E);
    EXPECT_EQ(q[1], 0xB8);
    EXPECT_EQ(s, 1.0f);
  }
}

TEST(LinkThrottleTest, TransfersQueueOnTheLinkAtItsSpeed) {
  using namespace std::chrono;
  LinkThrottle link(2.0);  // 2 bytes per nanosecond
  EXPECT_EQ(LinkThrottle::transfer_time(4096, 2.0), nanoseconds(2048));
  EXPECT_EQ(LinkThrottle::transfer_time(3, 2.0), nanoseconds(2));  // rounded up
  auto t0 = LinkThrottle::Clock::time_point(seconds(1000));
  EXPECT_EQ(link.reserve(2'000'000'000, t0), t0 + seconds(1));
  // A second transfer requested at the same time waits for the first.
  EXPECT_EQ(link.reserve(1'000'000'000, t0), t0 + milliseconds(1500));
  // An idle link earns no credit: a later request starts when it is made.
  EXPECT_EQ(link.reserve(2'000, t0 + seconds(10)), t0 + seconds(10) + microseconds(1));
  EXPECT_EQ(link.reserve(0, t0 + seconds(20)), t0 + seconds(20));
}

TEST(HostDeviceTest, CappedCopiesAreNeverFasterThanTheLink) {
  // Lower bounds only: a throttled copy can be slow on a busy machine, never fast.
  auto device = make_host_device(0, {.bandwidth_gbps = 1.0});
  DeviceAllocation a = device->allocate(2 << 20);
  std::vector<std::byte> src(1 << 20, std::byte{1});
  auto stream = device->create_stream();
  auto start = std::chrono::steady_clock::now();
  stream->copy_h2d(a.data(), src.data(), src.size());
  stream->copy_h2d_2d(a.data(), 1024, src.data(), 1024, 1024, 1024);
  std::unique_ptr<Event> done = stream->record();
  done->synchronize();
  EXPECT_TRUE(done->query());
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, std::chrono::nanoseconds(2 << 20));  // 2 MiB at 1 byte/ns

  // The caller is not held: 64 MiB queued at 1 GB/s take 67 ms on the link, and
  // an event recorded behind them is not complete until the link is through.
  DeviceAllocation big = device->allocate(64 << 20);
  std::vector<std::byte> big_src(64 << 20, std::byte{2});
  start = std::chrono::steady_clock::now();
  stream->copy_h2d(big.data(), big_src.data(), big_src.size());
  std::unique_ptr<Event> big_done = stream->record();
  if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(60)) {
    EXPECT_FALSE(big_done->query());
  }
  stream->synchronize();
  EXPECT_TRUE(big_done->query());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::nanoseconds(64 << 20));

  // Two streams on two threads share the device's link.
  auto second = device->create_stream();
  start = std::chrono::steady_clock::now();
  std::thread other([&] {
    second->copy_h2d(a.data() + (1 << 20), src.data(), src.size());
    second->synchronize();
  });
  stream->copy_h2d(a.data(), src.data(), src.size());
  stream->synchronize();
  other.join();
  elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, std::chrono::nanoseconds(2 << 20));
  // Device-to-host copies are not capped (no assertion on time: only that they work).
  std::vector<std::byte> back(16);
  stream->copy_d2h(back.data(), a.data(), 16);
  EXPECT_EQ(back[0], std::byte{1});
}

// A stopped load must not wait for the emulated link (hardening round two, item 12):
// abandon_emulated_waits() wakes a thread sleeping on an event or on synchronize()
// at once, and from then on neither waits for the link. The bytes landed already.
TEST(HostDeviceTest, AbandonedLinkWaitsEndAtOnceWithTheBytesLanded) {
  using namespace std::chrono;
  // 1 MiB at 1e-5 GB/s: 105 s on the emulated link.
  auto device = make_host_device(0, {.bandwidth_gbps = 1e-5});
  DeviceAllocation a = device->allocate(1 << 20);
  std::vector<std::byte> src(1 << 20, std::byte{7});
  auto stream = device->create_stream();
  stream->copy_h2d(a.data(), src.data(), src.size());
  std::unique_ptr<Event> done = stream->record();
  EXPECT_FALSE(done->query());
  const auto start = steady_clock::now();
  std::thread event_waiter([&] { done->synchronize(); });
  std::thread stream_waiter([&] { stream->synchronize(); });
  std::this_thread::sleep_for(milliseconds(100));  // both asleep on the link by now, or soon
  stream->abandon_emulated_waits();
  event_waiter.join();
  stream_waiter.join();
  EXPECT_LT(steady_clock::now() - start, seconds(30));  // not the link's 105 s
  EXPECT_TRUE(done->query());
  EXPECT_EQ(a.data()[0], std::byte{7});
  EXPECT_EQ(a.data()[(1 << 20) - 1], std::byte{7});
  // Later copies on the abandoned stream do not wait either; a second call is harmless.
  stream->copy_h2d(a.data(), src.data(), src.size());
  std::unique_ptr<Event> later = stream->record();
  EXPECT_TRUE(later->query());
  stream->abandon_emulated_waits();
  stream->synchronize();
  EXPECT_LT(steady_clock::now() - start, seconds(30));
  // Another stream of the device still waits for its link.
  auto other = device->create_stream();
  other->copy_h2d(a.data(), src.data(), 4096);
  EXPECT_FALSE(other->record()->query());
  other->abandon_emulated_waits();
}

// set_bytes writes its byte and nothing else; match_pattern reads its table from
// device memory (here after the queued upload on a deferred stream too), writes a
// flag a range, and refuses a table, flags or a range outside the device's memory
// and an element size it does not know.
TEST(HostDeviceTest, SetBytesAndMatchPattern) {
  for (bool deferred : {false, true}) {
    SCOPED_TRACE(deferred ? "deferred" : "immediate");
    auto device = make_host_device(0, {.deferred_copies = deferred});
    auto stream = device->create_stream();
    DeviceAllocation a = device->allocate(8192);
    const std::vector<std::byte> source = pattern(a.size(), 5);  // unchanged while queued
    stream->copy_h2d(a.data(), source.data(), source.size());
    stream->set_bytes(a.data() + 3, std::byte{0x01}, 1001);
    std::vector<std::byte> want = source;
    std::fill(want.begin() + 3, want.begin() + 1004, std::byte{0x01});
    stream->set_bytes(a.data(), std::byte{0x02}, 0);  // nothing
    std::vector<PatternRange> table = {
        {a.data() + 3, 1001, 0x01, 1, 0},    // all 0x01
        {a.data() + 3, 1002, 0x01, 1, 0},    // one byte past it
        {a.data() + 4, 1000, 0x0101, 2, 0},  // 500 elements of 0x0101
        {a.data() + 3, 0, 0x55, 8, 0},       // empty
    };
    const std::size_t table_bytes = table.size() * sizeof(PatternRange);
    std::byte* t = a.data() + 4096;
    auto* flags = reinterpret_cast<std::uint8_t*>(a.data() + 6000);
    stream->copy_h2d(t, reinterpret_cast<const std::byte*>(table.data()), table_bytes);
    stream->match_pattern(reinterpret_cast<const PatternRange*>(t), table.size(), flags);
    std::vector<std::byte> got(a.size());
    stream->copy_d2h(got.data(), a.data(), got.size());
    stream->synchronize();
    EXPECT_TRUE(std::equal(got.begin(), got.begin() + 4096, want.begin()));
    EXPECT_EQ(std::to_integer<int>(got[6000]), 1);
    EXPECT_EQ(std::to_integer<int>(got[6001]), 0);
    EXPECT_EQ(std::to_integer<int>(got[6002]), 1);
    EXPECT_EQ(std::to_integer<int>(got[6003]), 1);

    expect_error([&] { stream->set_bytes(a.data() + 8000, std::byte{1}, 193); }, "host:0",
                 "set_bytes: destination");
    std::vector<std::byte> host_table(table_bytes);
    expect_error(
        [&] {
          stream->match_pattern(reinterpret_cast<const PatternRange*>(host_table.data()), 1, flags);
        },
        "host:0", "match_pattern: table");
    expect_error(
        [&] {
          stream->match_pattern(reinterpret_cast<const PatternRange*>(t), 1,
                                reinterpret_cast<std::uint8_t*>(host_table.data()));
        },
        "host:0", "match_pattern: flags");
    // A table a GPU kernel could not read in place (its fields are 8 bytes).
    expect_error(
        [&] { stream->match_pattern(reinterpret_cast<const PatternRange*>(t + 4), 1, flags); },
        "host:0", "is not 8-byte aligned");
    PatternRange bad[2] = {{a.data(), 16, 0, 3, 0}, {want.data(), 16, 0, 1, 0}};
    stream->copy_h2d(t, reinterpret_cast<const std::byte*>(bad), sizeof bad);
    expect_error([&] { stream->match_pattern(reinterpret_cast<const PatternRange*>(t), 1, flags); },
                 "host:0", "range 0 has element size 3");
    expect_error(
        [&] { stream->match_pattern(reinterpret_cast<const PatternRange*>(t) + 1, 1, flags); },
        "host:0", "match_pattern: range 0");
    stream->synchronize();
  }
}

}  // namespace
}  // namespace ferry::gpu
