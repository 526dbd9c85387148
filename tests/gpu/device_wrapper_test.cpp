// gpu::DeviceWrapper and StreamWrapper forward every call, arguments and results
// unchanged, to the device and stream they wrap: a Device or Stream method added
// without a forwarder either fails to compile (pure) or fails here (a virtual with
// a default, which the wrapper would otherwise answer itself).
#include "gpu/device_wrapper.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "gpu/fp8.hpp"

namespace ferry::gpu {
namespace {

using ::testing::ElementsAre;

// Writes down each call with the first pointer argument it was given.
struct Log {
  std::vector<std::string> calls;
  std::vector<const void*> firsts;
  void add(const char* name, const void* first = nullptr) {
    calls.emplace_back(name);
    firsts.push_back(first);
  }
};

class LoggingEvent final : public Event {
 public:
  bool query() override { return true; }
  void synchronize() override {}
};

class LoggingStream final : public Stream {
 public:
  explicit LoggingStream(std::shared_ptr<Log> log) : log_(std::move(log)) {}
  void copy_h2d(std::byte* d, const std::byte*, std::size_t) override { log_->add("copy_h2d", d); }
  void copy_h2d_2d(std::byte* d, std::size_t, const std::byte*, std::size_t, std::size_t,
                   std::size_t) override {
    log_->add("copy_h2d_2d", d);
  }
  void copy_d2h(std::byte* d, const std::byte*, std::size_t) override { log_->add("copy_d2h", d); }
  void fill(std::byte* d, std::size_t, DType, double) override { log_->add("fill", d); }
  void fill_random(std::byte* d, std::size_t, DType, double, double, std::uint64_t) override {
    log_->add("fill_random", d);
  }
  void zero(std::byte* d, std::size_t) override { log_->add("zero", d); }
  void cast(std::byte* d, DType, const std::byte*, DType, std::size_t) override {
    log_->add("cast", d);
  }
  void zero_2d(std::byte* d, std::size_t, std::size_t, std::size_t) override {
    log_->add("zero_2d", d);
  }
  void set_bytes(std::byte* d, std::byte, std::size_t) override { log_->add("set_bytes", d); }
  void match_pattern(const PatternRange* r, std::size_t, std::uint8_t*) override {
    log_->add("match_pattern", r);
  }
  void cast_2d(std::byte* d, std::size_t, DType, const std::byte*, std::size_t, DType, std::size_t,
               std::size_t) override {
    log_->add("cast_2d", d);
  }
  void dequantize_ggml_2d(std::byte* d, std::size_t, DType, const std::byte*, std::size_t,
                          GgmlBlocks, std::size_t, std::size_t) override {
    log_->add("dequantize_ggml_2d", d);
  }
  void copy_d2d_2d(std::byte* d, std::size_t, const std::byte*, std::size_t, std::size_t,
                   std::size_t) override {
    log_->add("copy_d2d_2d", d);
  }
  void transpose(std::byte* d, std::size_t, const std::byte*, std::size_t, std::size_t, std::size_t,
                 std::size_t, std::size_t) override {
    log_->add("transpose", d);
  }
  void dequantize_fp8(std::byte* d, DType, const std::byte*, const std::byte*, const Fp8Scales&,
                      std::size_t, std::size_t, std::size_t) override {
    log_->add("dequantize_fp8", d);
  }
  void quantize_fp8(std::byte* d, std::byte*, const std::byte*, DType, const Fp8Scales&,
                    Fp8ScaleRule, std::size_t, std::size_t, std::size_t) override {
    log_->add("quantize_fp8", d);
  }
  void pack_ue8m0(std::byte* d, const std::byte*, std::size_t, std::size_t, std::size_t,
                  std::size_t) override {
    log_->add("pack_ue8m0", d);
  }
  void repack_marlin_fp4(std::byte* d, const std::byte*, std::size_t, std::size_t) override {
    log_->add("repack_marlin_fp4", d);
  }
  void marlin_fp4_scales(std::byte* d, const std::byte*, std::size_t, std::size_t) override {
    log_->add("marlin_fp4_scales", d);
  }
  std::unique_ptr<Event> record() override {
    log_->add("record");
    return std::make_unique<LoggingEvent>();
  }
  void synchronize() override { log_->add("synchronize"); }
  void abandon_emulated_waits() override { log_->add("abandon_emulated_waits"); }

 private:
  std::shared_ptr<Log> log_;
};

// Every answer differs from Device's defaults, so a default cannot pass for a
// forwarded call.
class LoggingDevice final : public Device {
 public:
  explicit LoggingDevice(std::shared_ptr<Log> log) : log_(std::move(log)) {}
  std::string name() const override { return "logging:7"; }
  void bind() override { log_->add("bind"); }
  DeviceAllocation allocate(std::size_t bytes) override {
    log_->add("allocate");
    return DeviceAllocation(&byte_, bytes, [](std::byte*, std::size_t) {});
  }
  DeviceAllocation adopt(std::byte* data, std::size_t bytes,
                         DeviceAllocation::Release release) override {
    log_->add("adopt", data);
    return DeviceAllocation(data, bytes, std::move(release));
  }
  PinnedAllocation allocate_pinned(std::size_t bytes) override {
    log_->add("allocate_pinned");
    return PinnedAllocation(&byte_, bytes, [](std::byte*, std::size_t) {});
  }
  HostRegistration register_host(void* host, std::size_t bytes) override {
    log_->add("register_host", host);
    return HostRegistration(static_cast<std::byte*>(host), bytes, [](std::byte*, std::size_t) {});
  }
  std::unique_ptr<Stream> create_stream() override {
    log_->add("create_stream");
    return std::make_unique<LoggingStream>(log_);
  }
  void reserve_events(std::size_t) override { log_->add("reserve_events"); }
  AllocationStats stats() const override {
    AllocationStats s;
    s.live_streams = 3;
    return s;
  }
  bool holds_data() const override { return false; }
  bool host_addressable() const override { return true; }
  int numa_node() const override { return 5; }
  std::size_t narrow_row_bytes() const override { return 12345; }

 private:
  std::shared_ptr<Log> log_;
  std::byte byte_{};
};

TEST(DeviceWrapper, ForwardsEveryDeviceCallAndAnswer) {
  auto log = std::make_shared<Log>();
  DeviceWrapper w(std::make_shared<LoggingDevice>(log));
  std::byte b[4];
  EXPECT_EQ(w.name(), "logging:7");
  w.bind();
  EXPECT_EQ(w.allocate(4).size(), 4u);
  EXPECT_EQ(w.adopt(b, 4, [](std::byte*, std::size_t) {}).data(), b);
  EXPECT_EQ(w.allocate_pinned(8).size(), 8u);
  EXPECT_EQ(w.register_host(b, 4).data(), b);
  EXPECT_NE(w.create_stream(), nullptr);
  w.reserve_events(9);
  EXPECT_EQ(w.stats().live_streams, 3u);
  EXPECT_FALSE(w.holds_data());
  EXPECT_TRUE(w.host_addressable());
  EXPECT_EQ(w.numa_node(), 5);
  EXPECT_EQ(w.narrow_row_bytes(), 12345u);
  EXPECT_THAT(log->calls, ElementsAre("bind", "allocate", "adopt", "allocate_pinned",
                                      "register_host", "create_stream", "reserve_events"));
  EXPECT_EQ(log->firsts[2], b);
  EXPECT_EQ(log->firsts[4], b);
  EXPECT_EQ(w.inner()->name(), "logging:7");
}

TEST(DeviceWrapper, ForwardsEveryStreamCall) {
  auto log = std::make_shared<Log>();
  StreamWrapper s(std::make_unique<LoggingStream>(log));
  std::byte d[8];
  const std::byte src[8]{};
  const PatternRange* table = reinterpret_cast<const PatternRange*>(d);
  std::uint8_t flags[1];
  Fp8Scales scales;
  s.copy_h2d(d, src, 1);
  s.copy_h2d_2d(d, 1, src, 1, 1, 1);
  s.copy_d2h(d, src, 1);
  s.fill(d, 1, DType::kF32, 1.0);
  s.fill_random(d, 1, DType::kF32, 0, 1, 2);
  s.zero(d, 1);
  s.cast(d, DType::kF32, src, DType::kBF16, 1);
  s.zero_2d(d, 1, 1, 1);
  s.set_bytes(d, std::byte{1}, 1);
  s.match_pattern(table, 1, flags);
  s.cast_2d(d, 1, DType::kF32, src, 1, DType::kBF16, 1, 1);
  s.dequantize_ggml_2d(d, 1, DType::kF32, src, 1, GgmlBlocks::kQ8_0, 32, 1);
  s.copy_d2d_2d(d, 1, src, 1, 1, 1);
  s.transpose(d, 1, src, 1, 1, 1, 1, 1);
  s.dequantize_fp8(d, DType::kBF16, src, src, scales, 1, 1, 1);
  s.quantize_fp8(d, d, src, DType::kBF16, scales, Fp8ScaleRule::kAmax, 1, 1, 1);
  s.pack_ue8m0(d, src, 1, 1, 1, 1);
  s.repack_marlin_fp4(d, src, 64, 16);
  s.marlin_fp4_scales(d, src, 64, 1);
  EXPECT_NE(s.record(), nullptr);
  s.synchronize();
  s.abandon_emulated_waits();
  EXPECT_THAT(log->calls,
              ElementsAre("copy_h2d", "copy_h2d_2d", "copy_d2h", "fill", "fill_random", "zero",
                          "cast", "zero_2d", "set_bytes", "match_pattern", "cast_2d",
                          "dequantize_ggml_2d", "copy_d2d_2d", "transpose", "dequantize_fp8",
                          "quantize_fp8", "pack_ue8m0", "repack_marlin_fp4", "marlin_fp4_scales",
                          "record", "synchronize", "abandon_emulated_waits"));
  for (std::size_t i = 0; i < 19; ++i) {
    EXPECT_EQ(log->firsts[i], static_cast<const void*>(d)) << log->calls[i];
  }
}

TEST(DeviceWrapper, RefusesANullInner) {
  EXPECT_THROW(DeviceWrapper(nullptr), std::invalid_argument);
  EXPECT_THROW(StreamWrapper(nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace ferry::gpu
