#include "gpu/host_device.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "common/error.hpp"
#include "gpu/device_internal.hpp"
#include "gpu/kernels_host.hpp"
#include "gpu/link_throttle.hpp"

namespace ferry::gpu {
namespace {

using detail::fail;
using detail::hex;
using detail::MemoryKind;

// Shared by the device, its streams, events and allocations, so that any of them
// may outlive the Device object.
struct HostDeviceState {
  std::string name;
  HostDeviceOptions options;
  std::optional<LinkThrottle> throttle;
  detail::StatsTracker stats;

  std::mutex mu;
  std::size_t live_device_bytes = 0;                    // guarded by mu
  std::map<std::uintptr_t, std::size_t> allocations;    // begin -> size; guarded by mu
  std::map<std::uintptr_t, std::size_t> registrations;  // begin -> size; guarded by mu

  // Fails unless [p, p + bytes) lies inside one live allocation of this device.
  void check_device_range(std::string_view op, std::string_view which, const std::byte* p,
                          std::size_t bytes) {
    auto begin = reinterpret_cast<std::uintptr_t>(p);
    {
      std::lock_guard lock(mu);
      auto it = allocations.upper_bound(begin);
      if (it != allocations.begin()) {
        --it;
        std::uintptr_t offset = begin - it->first;
        if (offset <= it->second && bytes <= it->second - offset) {
          return;
        }
      }
    }
    fail(name, std::string(op) + ": " + std::string(which) + " [" + hex(p) + ", +" +
                   std::to_string(bytes) + ") is not inside a live allocation of this device");
  }

  void check_host_pointer(std::string_view op, std::string_view which, const std::byte* p,
                          std::size_t bytes) const {
    if (p == nullptr && bytes != 0) {
      fail(name, std::string(op) + ": " + std::string(which) + " is null");
    }
  }

  // Holds the caller until a transfer of `bytes` requested at `start` would have
  // crossed the emulated link.
  void pace(std::size_t bytes, LinkThrottle::Clock::time_point start) {
    if (throttle) {
      std::this_thread::sleep_until(throttle->reserve(bytes, start));
    }
  }
};

class HostEvent final : public Event {
 public:
  explicit HostEvent(std::shared_ptr<HostDeviceState> state) : state_(std::move(state)) {
    state_->stats.event_created();
  }
  ~HostEvent() override { state_->stats.event_destroyed(); }
  HostEvent(const HostEvent&) = delete;
  HostEvent& operator=(const HostEvent&) = delete;

  bool query() override { return true; }
  void synchronize() override {}

 private:
  std::shared_ptr<HostDeviceState> state_;
};

class HostStream final : public Stream {
 public:
  explicit HostStream(std::shared_ptr<HostDeviceState> state) : state_(std::move(state)) {
    state_->stats.stream_created();
  }
  ~HostStream() override { state_->stats.stream_destroyed(); }
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  void copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) override {
    if (bytes == 0) {
      return;
    }
    auto start = LinkThrottle::Clock::now();
    state_->check_device_range("copy_h2d", "destination", dst, bytes);
    state_->check_host_pointer("copy_h2d", "source", src_host, bytes);
    std::memcpy(dst, src_host, bytes);
    state_->pace(bytes, start);
  }

  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    const std::string& name = state_->name;
    std::size_t dst_span =
        detail::pitched_span(name, "copy_h2d_2d", "destination", dst_pitch, width_bytes, rows);
    detail::pitched_span(name, "copy_h2d_2d", "source", src_pitch, width_bytes, rows);
    if (dst_span == 0) {
      return;
    }
    auto start = LinkThrottle::Clock::now();
    state_->check_device_range("copy_h2d_2d", "destination", dst, dst_span);
    state_->check_host_pointer("copy_h2d_2d", "source", src_host, width_bytes);
    for (std::size_t r = 0; r < rows; ++r) {
      std::memcpy(dst + r * dst_pitch, src_host + r * src_pitch, width_bytes);
    }
    state_->pace(width_bytes * rows, start);
  }

  void copy_d2h(std::byte* dst_host, const std::byte* src, std::size_t bytes) override {
    if (bytes == 0) {
      return;
    }
    state_->check_device_range("copy_d2h", "source", src, bytes);
    state_->check_host_pointer("copy_d2h", "destination", dst_host, bytes);
    std::memcpy(dst_host, src, bytes);
  }

  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override {
    std::size_t bytes = detail::check_fill(state_->name, dtype, count);
    if (bytes == 0) {
      return;
    }
    state_->check_device_range("fill", "destination", dst, bytes);
    host::fill(dst, count, dtype, value);
  }

  void zero(std::byte* dst, std::size_t bytes) override {
    if (bytes == 0) {
      return;
    }
    state_->check_device_range("zero", "destination", dst, bytes);
    std::memset(dst, 0, bytes);
  }

  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    detail::CastBytes bytes =
        detail::check_cast(state_->name, dst, dst_dtype, src, src_dtype, count);
    if (count == 0) {
      return;
    }
    state_->check_device_range("cast", "destination", dst, bytes.dst);
    state_->check_device_range("cast", "source", src, bytes.src);
    host::cast(dst, dst_dtype, src, src_dtype, count);
  }

  std::unique_ptr<Event> record() override { return std::make_unique<HostEvent>(state_); }

  void synchronize() override {}

 private:
  std::shared_ptr<HostDeviceState> state_;
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(std::shared_ptr<HostDeviceState> state) : state_(std::move(state)) {}

  std::string name() const override { return state_->name; }

  void bind() override {}

  DeviceAllocation allocate(std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    {
      std::lock_guard lock(state_->mu);
      std::size_t capacity = state_->options.capacity_bytes;
      if (capacity != 0 && (bytes > capacity || state_->live_device_bytes > capacity - bytes)) {
        fail(state_->name, "out of memory: allocating " + std::to_string(bytes) +
                               " bytes would exceed the capacity of " + std::to_string(capacity) +
                               " bytes (" + std::to_string(state_->live_device_bytes) +
                               " bytes live)");
      }
      state_->live_device_bytes += bytes;  // reserved now so concurrent callers see it
    }
    std::byte* p = nullptr;
    try {
      p = static_cast<std::byte*>(::operator new (bytes, std::align_val_t{kDeviceAlignment}));
    } catch (const std::bad_alloc&) {
      std::lock_guard lock(state_->mu);
      state_->live_device_bytes -= bytes;
      fail(state_->name, "out of memory: host RAM refused " + std::to_string(bytes) + " bytes");
    }
    if (state_->options.poison_allocations) {
      std::memset(p, static_cast<int>(kPoisonByte), bytes);
    } else {
      // Commit the memory now, as cudaMalloc does: touching one byte per page makes
      // the kernel fault in (and clear) every page here, at allocation, instead of
      // during the first copies, where it would be charged to the stream.
      for (std::size_t off = 0; off < bytes; off += 4096) {
        static_cast<volatile std::byte*>(p)[off] = std::byte{0};
      }
    }
    {
      std::lock_guard lock(state_->mu);
      state_->allocations.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
    }
    state_->stats.add(MemoryKind::kDevice, bytes);
    return DeviceAllocation(p, bytes, [state = state_](std::byte* data, std::size_t size) {
      {
        std::lock_guard lock(state->mu);
        state->allocations.erase(reinterpret_cast<std::uintptr_t>(data));
        state->live_device_bytes -= size;
      }
      state->stats.remove(MemoryKind::kDevice, size);
      ::operator delete (data, std::align_val_t{kDeviceAlignment});
    });
  }

  PinnedAllocation allocate_pinned(std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    std::byte* p = nullptr;
    try {
      p = static_cast<std::byte*>(::operator new (bytes, std::align_val_t{kPinnedAlignment}));
    } catch (const std::bad_alloc&) {
      fail(state_->name, "allocate_pinned: host RAM refused " + std::to_string(bytes) + " bytes");
    }
    state_->stats.add(MemoryKind::kPinned, bytes);
    return PinnedAllocation(p, bytes, [state = state_](std::byte* data, std::size_t size) {
      state->stats.remove(MemoryKind::kPinned, size);
      ::operator delete (data, std::align_val_t{kPinnedAlignment});
    });
  }

  HostRegistration register_host(void* host, std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    auto* p = static_cast<std::byte*>(host);
    if (p == nullptr) {
      fail(state_->name, "register_host: the buffer is null");
    }
    auto begin = reinterpret_cast<std::uintptr_t>(p);
    {
      // Like cudaHostRegister, refuse a range that overlaps one pinned already.
      std::lock_guard lock(state_->mu);
      auto it = state_->registrations.lower_bound(begin);
      bool overlaps_next = it != state_->registrations.end() && it->first - begin < bytes;
      bool overlaps_prev = false;
      if (it != state_->registrations.begin()) {
        auto prev = std::prev(it);
        overlaps_prev = begin - prev->first < prev->second;
      }
      if (overlaps_next || overlaps_prev) {
        fail(state_->name, "register_host: [" + hex(p) + ", +" + std::to_string(bytes) +
                               ") overlaps a range that is registered already");
      }
      state_->registrations.emplace(begin, bytes);
    }
    state_->stats.add(MemoryKind::kRegistered, bytes);
    return HostRegistration(p, bytes, [state = state_](std::byte* data, std::size_t size) {
      {
        std::lock_guard lock(state->mu);
        state->registrations.erase(reinterpret_cast<std::uintptr_t>(data));
      }
      state->stats.remove(MemoryKind::kRegistered, size);
    });
  }

  std::unique_ptr<Stream> create_stream() override { return std::make_unique<HostStream>(state_); }

  AllocationStats stats() const override { return state_->stats.snapshot(); }

 private:
  std::shared_ptr<HostDeviceState> state_;
};

}  // namespace

std::shared_ptr<Device> make_host_device(int index, const HostDeviceOptions& options) {
  std::string name = "host:" + std::to_string(index);
  if (index < 0) {
    throw Error(Stage::kConfig, name, "", "the device index must not be negative");
  }
  if (!std::isfinite(options.bandwidth_gbps) || options.bandwidth_gbps < 0) {
    throw Error(Stage::kConfig, name, "",
                "bandwidth_gbps must be 0 (no cap) or a positive number of GB/s (got " +
                    std::to_string(options.bandwidth_gbps) + ")");
  }
  auto state = std::make_shared<HostDeviceState>();
  state->name = std::move(name);
  state->options = options;
  if (options.bandwidth_gbps > 0) {
    state->throttle.emplace(options.bandwidth_gbps);
  }
  return std::make_shared<HostDevice>(std::move(state));
}

}  // namespace ferry::gpu
