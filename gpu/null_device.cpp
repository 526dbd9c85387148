#include "gpu/null_device.hpp"

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "gpu/device_internal.hpp"

namespace ferry::gpu {
namespace {

using detail::fail;
using detail::MemoryKind;

// The address ranges handed out: far above anything the process maps, so that a
// stray dereference faults instead of touching real memory, and drawn from one
// process-wide counter, so that no two null devices ever hand out the same range.
constexpr std::uintptr_t kFirstAddress = std::uintptr_t{0x7e00} << 32;
std::atomic<std::uintptr_t> g_next_address{kFirstAddress};

struct NullDeviceState {
  std::string name;
  detail::StatsTracker stats;
  std::atomic<std::uint64_t> bytes_written{0};
  detail::AllocationMap allocations;
  void written(std::size_t bytes) { bytes_written.fetch_add(bytes, std::memory_order_relaxed); }
};

class NullEvent final : public Event {
 public:
  explicit NullEvent(std::shared_ptr<NullDeviceState> state) : state_(std::move(state)) {
    state_->stats.event_created();
  }
  ~NullEvent() override { state_->stats.event_destroyed(); }
  NullEvent(const NullEvent&) = delete;
  NullEvent& operator=(const NullEvent&) = delete;

  bool query() override { return true; }
  void synchronize() override {}

 private:
  std::shared_ptr<NullDeviceState> state_;
};

class NullStream final : public Stream {
 public:
  explicit NullStream(std::shared_ptr<NullDeviceState> state) : state_(std::move(state)) {
    state_->stats.stream_created();
  }
  ~NullStream() override { state_->stats.stream_destroyed(); }
  NullStream(const NullStream&) = delete;
  NullStream& operator=(const NullStream&) = delete;

  void copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) override {
    state_->written(checks().copy_h2d(dst, src_host, bytes));
  }

  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    if (checks().copy_h2d_2d(dst, dst_pitch, src_host, src_pitch, width_bytes, rows) != 0) {
      state_->written(width_bytes * rows);
    }
  }

  void copy_d2h(std::byte*, const std::byte*, std::size_t bytes) override {
    if (bytes != 0) {
      fail(state_->name, "copy_d2h: a null device keeps no data, so nothing can be read back");
    }
  }

  void fill(std::byte* dst, std::size_t count, DType dtype, double) override {
    state_->written(checks().fill(dst, count, dtype));
  }

  void fill_random(std::byte* dst, std::size_t count, DType dtype, double, double,
                   std::uint64_t) override {
    state_->written(checks().fill_random(dst, count, dtype));
  }

  void zero(std::byte* dst, std::size_t bytes) override {
    state_->written(checks().zero(dst, bytes));
  }

  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    state_->written(checks().cast(dst, dst_dtype, src, src_dtype, count));
  }

  // Pitched and batched: checked and counted, by the bytes they write (the rows, not
  // the gaps between them).
  void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
               std::size_t rows) override {
    if (checks().zero_2d(dst, dst_pitch, width_bytes, rows) != 0) {
      state_->written(width_bytes * rows);
    }
  }
  void set_bytes(std::byte* dst, std::byte, std::size_t bytes) override {
    state_->written(checks().set_bytes(dst, bytes));
  }
  // Checked only: the table and the ranges hold no bytes here, so nothing is
  // compared and the flags stay as they were (a null device is never verified).
  void match_pattern(const PatternRange* ranges, std::size_t count,
                     std::uint8_t* flags) override {
    checks().match_pattern(ranges, count, flags);
  }
  void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
               std::size_t src_pitch, DType src_dtype, std::size_t width,
               std::size_t rows) override {
    if (checks().cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows) != 0) {
      state_->written(width * dtype_size(dst_dtype) * rows);
    }
  }
  void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    if (checks().copy_d2d_2d(dst, dst_pitch, src, src_pitch, width_bytes, rows) != 0) {
      state_->written(width_bytes * rows);
    }
  }
  void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                          const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                          std::size_t width, std::size_t rows) override {
    if (checks().dequantize_ggml_2d(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width,
                                    rows) != 0) {
      state_->written(width * dtype_size(dst_dtype) * rows);
    }
  }
  void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                 std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                 std::size_t cols, std::size_t batches) override {
    if (checks().transpose(dst, dst_batch_pitch, src, src_batch_pitch, element_size, rows, cols,
                           batches) != 0) {
      state_->written(rows * cols * element_size * batches);
    }
  }
  void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src, const std::byte* scale,
                      const Fp8Scales& scales, std::size_t rows, std::size_t cols,
                      std::size_t batches) override {
    state_->written(
        checks().dequantize_fp8(dst, dst_dtype, src, scale, scales, rows, cols, batches).dst);
  }
  void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                    const Fp8Scales& scales, Fp8ScaleRule, std::size_t rows, std::size_t cols,
                    std::size_t batches) override {
    const detail::Fp8Spans spans =
        checks().quantize_fp8(dst, scale, src, src_dtype, scales, rows, cols, batches);
    state_->written(spans.dst + spans.scale);
  }
  void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows, std::size_t block_rows,
                  std::size_t scale_cols, std::size_t batches) override {
    state_->written(checks().pack_ue8m0(dst, scale, rows, block_rows, scale_cols, batches).dst);
  }
  void repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t k) override {
    state_->written(checks().marlin_fp4("repack_marlin_fp4", dst, src, n, k));
  }
  void marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t groups) override {
    state_->written(checks().marlin_fp4("marlin_fp4_scales", dst, src, n, groups));
  }
  std::unique_ptr<Event> record() override { return std::make_unique<NullEvent>(state_); }
  void synchronize() override {}

 private:
  detail::TrackedStreamChecks checks() const { return {state_->name, state_->allocations}; }

  std::shared_ptr<NullDeviceState> state_;
};

class NullDevice final : public Device {
 public:
  explicit NullDevice(std::shared_ptr<NullDeviceState> state) : state_(std::move(state)) {}

  std::string name() const override { return state_->name; }
  void bind() override {}
  bool holds_data() const override { return false; }

  DeviceAllocation allocate(std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    const std::uintptr_t rounded =
        (bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment;
    if (rounded < bytes || rounded > (std::uintptr_t{1} << 56)) {
      fail(state_->name, "out of address space: allocating " + std::to_string(bytes) + " bytes");
    }
    // A gap of one alignment unit keeps neighbours apart, so a range that runs past
    // its allocation never lands inside the next one.
    const std::uintptr_t begin = g_next_address.fetch_add(rounded + kDeviceAlignment);
    auto* p = reinterpret_cast<std::byte*>(begin);
    state_->allocations.add(p, bytes);
    state_->stats.add(MemoryKind::kDevice, bytes);
    return DeviceAllocation(p, bytes, [state = state_](std::byte* data, std::size_t size) {
      state->allocations.remove(data);
      state->stats.remove(MemoryKind::kDevice, size);
    });
  }

  DeviceAllocation adopt(std::byte*, std::size_t, DeviceAllocation::Release) override {
    fail(state_->name, "adopt: a null device keeps no data, so it takes no engine memory");
  }

  PinnedAllocation allocate_pinned(std::size_t bytes) override {
    return detail::allocate_host_pinned(state_, bytes);
  }

  HostRegistration register_host(void* host, std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    detail::check_host_pointer(state_->name, "register_host", "buffer", host, bytes);
    state_->stats.add(MemoryKind::kRegistered, bytes);
    return HostRegistration(static_cast<std::byte*>(host), bytes,
                            [state = state_](std::byte*, std::size_t size) {
                              state->stats.remove(MemoryKind::kRegistered, size);
                            });
  }

  std::unique_ptr<Stream> create_stream() override { return std::make_unique<NullStream>(state_); }

  AllocationStats stats() const override { return state_->stats.snapshot(); }

  std::uint64_t bytes_written() const { return state_->bytes_written.load(); }

 private:
  std::shared_ptr<NullDeviceState> state_;
};

}  // namespace

std::shared_ptr<Device> make_null_device(int index) {
  auto state = std::make_shared<NullDeviceState>();
  state->name = "null:" + std::to_string(index);
  return std::make_shared<NullDevice>(std::move(state));
}

std::uint64_t null_device_bytes_written(const Device& device) {
  const auto* null = dynamic_cast<const NullDevice*>(&device);
  if (null == nullptr) {
    throw Error(Stage::kConfig, device.name(), "", "not a null device");
  }
  return null->bytes_written();
}

}  // namespace ferry::gpu
