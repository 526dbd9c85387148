#include "gpu/host_device.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "common/error.hpp"
#include "common/thread_start.hpp"
#include "gpu/device_internal.hpp"
#include "gpu/kernels_host.hpp"
#include "gpu/link_throttle.hpp"

namespace ferry::gpu {
namespace {

using detail::fail;
using detail::hex;
using detail::MemoryKind;

// Emulated device memory. Large blocks are committed at allocation, as cudaMalloc
// commits device memory, so that no page fault is charged to the copies later:
// they are mapped on a 2 MiB boundary, marked for transparent huge pages when
// HostDeviceOptions::huge_pages asks, and populated by the kernel in one call
// (MADV_POPULATE_WRITE), which is several times cheaper than faulting 4 KiB pages
// in one by one (the load benchmark's plan phase was mostly page faults). Where the
// kernel lacks it, every page is touched.
// Small blocks come from the heap, touched likewise.
constexpr std::size_t kMapFrom = std::size_t{4} << 20;
constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kPage = 4096;

void touch_pages(std::byte* p, std::size_t bytes) {
  for (std::size_t off = 0; off < bytes; off += kPage) {
    static_cast<volatile std::byte*>(p)[off] = std::byte{0};
  }
}

std::size_t mapped_length(std::size_t bytes) {
  return (bytes + kPage - 1) / kPage * kPage;
}

// Returns null when the memory is not there (the caller reports out of memory).
std::byte* allocate_device_memory(std::size_t bytes, bool huge_pages) {
  if (bytes < kMapFrom) {
    auto* p = static_cast<std::byte*>(
        ::operator new (bytes, std::align_val_t{kDeviceAlignment}, std::nothrow));
    if (p != nullptr) {
      touch_pages(p, bytes);
    }
    return p;
  }
  const std::size_t length = mapped_length(bytes);
  void* raw = ::mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    return nullptr;
  }
  // Keep [aligned, aligned + length) and give back the rest of the mapping.
  const auto begin = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (begin + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > begin) {
    ::munmap(raw, aligned - begin);
  }
  const std::uintptr_t end = begin + length + kHugePage;
  if (end > aligned + length) {
    ::munmap(reinterpret_cast<void*>(aligned + length), end - (aligned + length));
  }
  auto* p = reinterpret_cast<std::byte*>(aligned);
  if (huge_pages) {
    ::madvise(p, length, MADV_HUGEPAGE);  // advice only: without THP, 4 KiB pages
  }
#ifdef MADV_POPULATE_WRITE
  if (::madvise(p, length, MADV_POPULATE_WRITE) == 0) {
    return p;
  }
  if (errno == ENOMEM || errno == EFAULT) {
    ::munmap(p, length);
    return nullptr;
  }
#endif
  touch_pages(p, bytes);  // older kernels (EINVAL): fault every page in here
  return p;
}

void free_device_memory(std::byte* p, std::size_t bytes) {
  if (bytes < kMapFrom) {
    ::operator delete (p, std::align_val_t{kDeviceAlignment});
  } else {
    ::munmap(p, mapped_length(bytes));
  }
}

// HostDeviceOptions::shared_memory: a memfd of the allocation's (page-rounded)
// size, mapped shared and committed like the private mappings above. Returns the
// mapping and the descriptor, or (null, -1) when the memory is not there.
std::pair<std::byte*, int> allocate_shared_memory(const std::string& device, std::size_t bytes) {
  const std::size_t length = mapped_length(bytes);
  const int fd = ::memfd_create(("ferry " + device).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return {nullptr, -1};
  }
  if (::ftruncate(fd, static_cast<off_t>(length)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    ::close(fd);
    return {nullptr, -1};
  }
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    ::close(fd);
    return {nullptr, -1};
  }
#ifdef MADV_POPULATE_WRITE
  if (::madvise(p, length, MADV_POPULATE_WRITE) != 0 && (errno == ENOMEM || errno == EFAULT)) {
    ::munmap(p, length);
    ::close(fd);
    return {nullptr, -1};
  }
#endif
  return {static_cast<std::byte*>(p), fd};
}

std::atomic<int> g_capturing{0};  // HostCaptureGuard's count
thread_local bool t_bound = false;  // this thread called bind() on a host device

// Events each new stream adds to its device's pool, as on CUDA.
constexpr std::size_t kEventsPerStream = 16;

// Refuses `op` during an emulated capture.
void refuse_during_capture(const std::string& device, const std::string& op) {
  if (g_capturing.load() != 0) {
    fail(device, op + " while a CUDA graph capture is in progress (emulated: "
                      "gpu::HostCaptureGuard): a capture-safe load makes it in prepare()");
  }
}

// Refuses an event query or wait from a thread that did not bind() a device
// during an emulated capture (CUDA: not in relaxed capture mode).
void refuse_unbound_wait(const std::string& device, const char* op) {
  if (g_capturing.load() != 0 && !t_bound) {
    fail(device, std::string(op) +
                     " on a thread that did not bind() the device, while a CUDA graph capture "
                     "is in progress (emulated: gpu::HostCaptureGuard)");
  }
}

// Shared by the device, its streams, events and allocations, so that any of them
// may outlive the Device object.
struct HostDeviceState {
  std::string name;
  HostDeviceOptions options;
  std::optional<LinkThrottle> throttle;
  detail::StatsTracker stats;

  std::mutex mu;
  std::size_t live_device_bytes = 0;                    // guarded by mu
  std::map<std::uintptr_t, std::size_t> registrations;  // begin -> size; guarded by mu
  detail::AllocationMap allocations;                    // device memory handed out
  // HostDeviceOptions::shared_memory: each allocation's memfd, by its first byte
  // (begin -> (size, fd)); guarded by mu.
  std::map<std::uintptr_t, std::pair<std::size_t, int>> shared;
  std::size_t free_events = 0;  // the emulated event pool (HostCaptureGuard); guarded by mu

  void reserve_events(std::size_t count) {
    std::lock_guard lock(mu);
    free_events = std::max(free_events, count);
  }
  // An event from the pool, or a new one (refused during an emulated capture).
  void take_event(const char* op) {
    std::lock_guard lock(mu);
    if (free_events == 0) {
      refuse_during_capture(name, std::string(op) + " creating an event (the pool is empty)");
      return;
    }
    --free_events;
  }
  void give_event() {
    std::lock_guard lock(mu);
    ++free_events;
  }
};

// When the emulated link has finished a stream's work: copies land in memory at
// once, but with a bandwidth cap a transfer only counts as done, for events and
// synchronize(), when it would have crossed the link. The caller is not held, as
// a CUDA stream does not hold the host: a copy worker queues the next chunk while
// the link is busy and returns a staging buffer when its event fires. (Sleeping
// in every copy instead lost the timer's slack on each one, about 50 us.)
using TimePoint = LinkThrottle::Clock::time_point;

// A stream's waits for its emulated link, shared with the events it records. The
// bytes have landed already when a wait begins (copies run on the calling thread),
// so Stream::abandon_emulated_waits may end every such wait at once, for good: a
// stopped load then gets past a link slow enough to take minutes (hardening round
// two, item 12: at 1e-5 GB/s a cancel waited for every copy booked on the link).
class LinkWaits {
 public:
  // Sleeps until `t` or until abandon(), whichever comes first.
  void until(TimePoint t) {
    std::unique_lock lock(mu_);
    cv_.wait_until(lock, t, [this] { return abandoned_.load(); });
  }
  // Whether `t` has passed, or the waits were abandoned.
  bool passed(TimePoint t) const { return abandoned_.load() || LinkThrottle::Clock::now() >= t; }
  void abandon() {
    {
      std::lock_guard lock(mu_);
      abandoned_.store(true);
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> abandoned_{false};  // written under mu_, read without it by passed()
};

class HostEvent final : public Event {
 public:
  HostEvent(std::shared_ptr<HostDeviceState> state, std::shared_ptr<LinkWaits> waits,
            TimePoint done_at)
      : state_(std::move(state)), waits_(std::move(waits)), done_at_(done_at) {
    state_->take_event("record");
    state_->stats.event_created();
  }
  ~HostEvent() override {
    state_->give_event();
    state_->stats.event_destroyed();
  }
  HostEvent(const HostEvent&) = delete;
  HostEvent& operator=(const HostEvent&) = delete;

  bool query() override {
    refuse_unbound_wait(state_->name, "Event::query");
    return waits_->passed(done_at_);
  }
  void synchronize() override {
    refuse_unbound_wait(state_->name, "Event::synchronize");
    if (!waits_->passed(done_at_)) {
      waits_->until(done_at_);
    }
  }

 private:
  std::shared_ptr<HostDeviceState> state_;
  std::shared_ptr<LinkWaits> waits_;
  TimePoint done_at_;
};

// host.deferred_copies: a stream's operations, run in order on a thread of their
// own some time after they were queued.
class DeferredQueue {
 public:
  DeferredQueue() : thread_(start_thread("host device queue", [this] { run(); })) {}
  ~DeferredQueue() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  DeferredQueue(const DeferredQueue&) = delete;
  DeferredQueue& operator=(const DeferredQueue&) = delete;

  // Queues `op`; returns its sequence number.
  std::uint64_t push(std::function<void()> op) {
    std::lock_guard lock(mu_);
    ops_.push_back(std::move(op));
    cv_.notify_all();
    return ++queued_;
  }
  std::uint64_t queued() const {
    std::lock_guard lock(mu_);
    return queued_;
  }
  bool done(std::uint64_t seq) const {
    std::lock_guard lock(mu_);
    return done_ >= seq;
  }
  void wait(std::uint64_t seq) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_ >= seq; });
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !ops_.empty(); });
      if (ops_.empty()) {
        return;  // stopping, and everything queued has run
      }
      std::function<void()> op = std::move(ops_.front());
      ops_.pop_front();
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(100));  // the DMA's latency
      op();
      lock.lock();
      ++done_;
      cv_.notify_all();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> ops_;
  std::uint64_t queued_ = 0;
  std::uint64_t done_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest exists
};

class DeferredEvent final : public Event {
 public:
  DeferredEvent(std::shared_ptr<HostDeviceState> state, std::shared_ptr<DeferredQueue> queue,
                std::uint64_t seq)
      : state_(std::move(state)), queue_(std::move(queue)), seq_(seq) {
    state_->take_event("record");
  }
  ~DeferredEvent() override { state_->give_event(); }
  DeferredEvent(const DeferredEvent&) = delete;
  DeferredEvent& operator=(const DeferredEvent&) = delete;
  bool query() override {
    refuse_unbound_wait(state_->name, "Event::query");
    return queue_->done(seq_);
  }
  void synchronize() override {
    refuse_unbound_wait(state_->name, "Event::synchronize");
    queue_->wait(seq_);
  }

 private:
  std::shared_ptr<HostDeviceState> state_;
  std::shared_ptr<DeferredQueue> queue_;
  std::uint64_t seq_;
};

// What on_changed_source compares: every byte of a small source, else 4096 samples
// of 8 bytes spread over it (a poisoned or refilled staging buffer changes them all).
std::uint64_t fingerprint(const std::byte* p, std::size_t bytes) {
  constexpr std::size_t kWhole = std::size_t{64} << 10;
  constexpr std::size_t kSamples = 4096;
  std::uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&h](const std::byte* q, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      h = (h ^ static_cast<std::uint64_t>(q[i])) * 0x100000001b3ULL;
    }
  };
  if (bytes <= kWhole) {
    mix(p, bytes);
    return h;
  }
  const std::size_t step = (bytes - 8) / (kSamples - 1);
  for (std::size_t i = 0; i < kSamples; ++i) {
    mix(p + i * step, 8);
  }
  return h;
}

class HostStream final : public Stream {
 public:
  explicit HostStream(std::shared_ptr<HostDeviceState> state) : state_(std::move(state)) {
    refuse_during_capture(state_->name, "create_stream");
    // First: a copy thread the system refuses leaves nothing counted.
    if (state_->options.deferred_copies) {
      deferred_ = std::make_shared<DeferredQueue>();
    }
    state_->reserve_events(kEventsPerStream);
    state_->stats.stream_created();
  }
  ~HostStream() override {
    if (deferred_) {
      deferred_->wait(deferred_->queued());
    }
    state_->stats.stream_destroyed();
  }
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  void copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) override {
    if (checks().copy_h2d(dst, src_host, bytes) == 0) {
      return;
    }
    const std::uint64_t before = source_fingerprint(src_host, bytes);
    run([=, this] {
      check_source("copy_h2d", before, src_host, bytes);
      host::copy_around_caches(dst, src_host, bytes);
    });
    book(bytes);
  }

  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    if (checks().copy_h2d_2d(dst, dst_pitch, src_host, src_pitch, width_bytes, rows) == 0) {
      return;
    }
    const std::size_t span = (rows - 1) * src_pitch + width_bytes;
    const std::uint64_t before = source_fingerprint(src_host, span);
    run([=, this] {
      check_source("copy_h2d_2d", before, src_host, span);
      for (std::size_t r = 0; r < rows; ++r) {
        host::copy_around_caches(dst + r * dst_pitch, src_host + r * src_pitch, width_bytes);
      }
    });
    book(width_bytes * rows);
  }

  void copy_d2h(std::byte* dst_host, const std::byte* src, std::size_t bytes) override {
    if (bytes == 0) {
      return;
    }
    state_->allocations.check(state_->name, "copy_d2h", "source", src, bytes);
    detail::check_host_pointer(state_->name, "copy_d2h", "destination", dst_host, bytes);
    run([=] { std::memcpy(dst_host, src, bytes); });
  }

  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override {
    if (checks().fill(dst, count, dtype) != 0) {
      run([=] { host::fill(dst, count, dtype, value); });
    }
  }

  void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                   std::uint64_t seed) override {
    if (checks().fill_random(dst, count, dtype) != 0) {
      run([=] { host::fill_random(dst, count, dtype, low, high, seed); });
    }
  }

  void zero(std::byte* dst, std::size_t bytes) override {
    if (checks().zero(dst, bytes) != 0) {
      run([=] { std::memset(dst, 0, bytes); });
    }
  }

  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    if (checks().cast(dst, dst_dtype, src, src_dtype, count) != 0) {
      run([=] { host::cast(dst, dst_dtype, src, src_dtype, count); });
    }
  }

  void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
               std::size_t rows) override {
    if (checks().zero_2d(dst, dst_pitch, width_bytes, rows) != 0) {
      run([=] { host::zero_2d(dst, dst_pitch, width_bytes, rows); });
    }
  }

  void set_bytes(std::byte* dst, std::byte value, std::size_t bytes) override {
    if (checks().set_bytes(dst, bytes) != 0) {
      run([=] { std::memset(dst, static_cast<int>(value), bytes); });
    }
  }

  // The table lies in device memory, which here is host memory: its entries are
  // checked at the call, after whatever this stream queued before (the upload of
  // the table, on a deferred stream) has run.
  void match_pattern(const PatternRange* ranges, std::size_t count,
                     std::uint8_t* flags) override {
    if (checks().match_pattern(ranges, count, flags) == 0) {
      return;
    }
    if (deferred_) {
      deferred_->wait(deferred_->queued());
    }
    for (std::size_t i = 0; i < count; ++i) {
      checks().check_pattern_range(ranges[i], i);
    }
    run([=] {
      for (std::size_t i = 0; i < count; ++i) {
        const PatternRange& r = ranges[i];
        flags[i] = host::matches_pattern(r.data, r.bytes, r.pattern, r.element_size) ? 1 : 0;
      }
    });
  }

  void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
               std::size_t src_pitch, DType src_dtype, std::size_t width,
               std::size_t rows) override {
    if (checks().cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows) != 0) {
      run([=] {
        host::cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows);
      });
    }
  }

  void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    if (checks().copy_d2d_2d(dst, dst_pitch, src, src_pitch, width_bytes, rows) != 0) {
      run([=] { host::copy_2d(dst, dst_pitch, src, src_pitch, width_bytes, rows); });
    }
  }

  void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                          const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                          std::size_t width, std::size_t rows) override {
    if (checks().dequantize_ggml_2d(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width,
                                    rows) != 0) {
      run([=] {
        host::dequantize_ggml_2d(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width, rows);
      });
    }
  }

  void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                 std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                 std::size_t cols, std::size_t batches) override {
    if (checks().transpose(dst, dst_batch_pitch, src, src_batch_pitch, element_size, rows, cols,
                           batches) != 0) {
      run([=] {
        host::transpose(dst, dst_batch_pitch, src, src_batch_pitch, element_size, rows, cols,
                        batches);
      });
    }
  }

  void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src, const std::byte* scale,
                      const Fp8Scales& scales, std::size_t rows, std::size_t cols,
                      std::size_t batches) override {
    if (checks().dequantize_fp8(dst, dst_dtype, src, scale, scales, rows, cols, batches).dst != 0) {
      run([=] { host::dequantize_fp8(dst, dst_dtype, src, scale, scales, rows, cols, batches); });
    }
  }

  void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                    const Fp8Scales& scales, Fp8ScaleRule rule, std::size_t rows, std::size_t cols,
                    std::size_t batches) override {
    if (checks().quantize_fp8(dst, scale, src, src_dtype, scales, rows, cols, batches).dst != 0) {
      run([=] {
        host::quantize_fp8(dst, scale, src, src_dtype, scales, rule, rows, cols, batches);
      });
    }
  }

  void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows, std::size_t block_rows,
                  std::size_t scale_cols, std::size_t batches) override {
    if (checks().pack_ue8m0(dst, scale, rows, block_rows, scale_cols, batches).dst != 0) {
      run([=] { host::pack_ue8m0(dst, scale, rows, block_rows, scale_cols, batches); });
    }
  }

  void repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t k) override {
    if (checks().marlin_fp4("repack_marlin_fp4", dst, src, n, k) != 0) {
      run([=] { host::repack_marlin_fp4(dst, src, n, k); });
    }
  }

  void marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t groups) override {
    if (checks().marlin_fp4("marlin_fp4_scales", dst, src, n, groups) != 0) {
      run([=] { host::marlin_fp4_scales(dst, src, n, groups); });
    }
  }

  std::unique_ptr<Event> record() override {
    if (deferred_) {
      return std::make_unique<DeferredEvent>(state_, deferred_, deferred_->queued());
    }
    return std::make_unique<HostEvent>(state_, waits_, done_at_);
  }

  // As on CUDA, through a pooled event (taken and given back).
  void synchronize() override {
    refuse_unbound_wait(state_->name, "Stream::synchronize");
    state_->take_event("synchronize");
    state_->give_event();
    if (deferred_) {
      deferred_->wait(deferred_->queued());
    }
    if (!waits_->passed(done_at_)) {
      waits_->until(done_at_);
    }
  }

  // The bytes have landed; only the link's time is left to wait, and no longer is.
  void abandon_emulated_waits() override { waits_->abandon(); }

 private:
  // Runs `op` now, or queues it on the deferred queue (host.deferred_copies).
  template <class F>
  void run(F&& op) {
    if (deferred_) {
      deferred_->push(std::forward<F>(op));
    } else {
      op();
    }
  }

  detail::TrackedStreamChecks checks() const { return {state_->name, state_->allocations}; }

  // HostDeviceOptions::on_changed_source: only deferred copies can see a change.
  bool checks_sources() const {
    return deferred_ != nullptr && static_cast<bool>(state_->options.on_changed_source);
  }
  std::uint64_t source_fingerprint(const std::byte* src, std::size_t bytes) const {
    return checks_sources() ? fingerprint(src, bytes) : 0;
  }
  // Runs on the deferred queue's thread, just before the copy.
  void check_source(const char* op, std::uint64_t before, const std::byte* src,
                    std::size_t bytes) const {
    if (checks_sources() && fingerprint(src, bytes) != before) {
      state_->options.on_changed_source(state_->name + ": " + op + " of " +
                                        std::to_string(bytes) + " bytes from " + hex(src) +
                                        ": the source changed before the copy ran");
    }
  }

  // Books a host-to-device transfer on the device's link, in stream order: it
  // starts when queued, after the stream's previous transfer, once the link is free.
  void book(std::size_t bytes) {
    if (state_->throttle) {
      done_at_ = state_->throttle->reserve(bytes, std::max(LinkThrottle::Clock::now(), done_at_));
    }
  }

  std::shared_ptr<HostDeviceState> state_;
  std::shared_ptr<LinkWaits> waits_ = std::make_shared<LinkWaits>();
  TimePoint done_at_{};                      // when the link has carried everything queued so far
  std::shared_ptr<DeferredQueue> deferred_;  // host.deferred_copies; null otherwise
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(std::shared_ptr<HostDeviceState> state) : state_(std::move(state)) {}

  std::string name() const override { return state_->name; }

  // A capped link has bytes to emulate on the way, so reads go through staging then.
  bool host_addressable() const override { return !state_->throttle; }
  std::size_t narrow_row_bytes() const override { return state_->options.narrow_row_bytes; }

  // With a bandwidth cap, the calling thread (the copy worker's) sleeps until the
  // emulated link is through; Linux lets such sleeps overrun by the thread's timer
  // slack, 50 us by default, which per 1 MiB chunk is a quarter of its time on a
  // 5 GB/s link. Binding asks for 1 us instead.
  void bind() override {
    t_bound = true;
    if (state_->throttle) {
      ::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    }
  }

  DeviceAllocation allocate(std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    refuse_during_capture(state_->name, "allocate");
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
    if (state_->options.shared_memory) {
      return allocate_shared(bytes);
    }
    std::byte* p = allocate_device_memory(bytes, state_->options.huge_pages);
    if (p == nullptr) {
      std::lock_guard lock(state_->mu);
      state_->live_device_bytes -= bytes;
      fail(state_->name, "out of memory: host RAM refused " + std::to_string(bytes) + " bytes");
    }
    if (state_->options.poison_allocations) {
      std::memset(p, static_cast<int>(kPoisonByte), bytes);
    }
    state_->allocations.add(p, bytes);
    state_->stats.add(MemoryKind::kDevice, bytes);
    return DeviceAllocation(p, bytes, [state = state_](std::byte* data, std::size_t size) {
      state->allocations.remove(data);
      {
        std::lock_guard lock(state->mu);
        state->live_device_bytes -= size;
      }
      state->stats.remove(MemoryKind::kDevice, size);
      free_device_memory(data, size);
    });
  }

  std::optional<SharedBlock> shared_block(const std::byte* p) const override {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(state_->mu);
    auto it = state_->shared.upper_bound(at);
    if (it == state_->shared.begin()) {
      return std::nullopt;
    }
    --it;
    if (at >= it->first + it->second.first) {
      return std::nullopt;
    }
    SharedBlock b;
    b.kind = "memfd";
    b.base = reinterpret_cast<const std::byte*>(it->first);
    b.bytes = it->second.first;
    b.fd = it->second.second;
    return b;
  }

  void seal_shared() override {
    std::lock_guard lock(state_->mu);
    for (const auto& [begin, block] : state_->shared) {
      if (::fcntl(block.second, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0 &&
          errno != EPERM) {  // EPERM: sealed already
        fail(state_->name,
             std::string("sealing a shared block (F_SEAL_FUTURE_WRITE): ") + std::strerror(errno));
      }
    }
  }

  DeviceAllocation map_shared(const SharedBlock& block, int fd) override {
    if (block.kind != "memfd") {
      fail(state_->name, "a host device maps memfd blocks only, not " + block.kind);
    }
    if (block.bytes == 0) {
      return {};
    }
    struct stat st {};
    if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      fail(state_->name, "the shared block's descriptor is not a memory file");
    }
    if (static_cast<std::uint64_t>(st.st_size) < block.bytes) {
      fail(state_->name, "the shared block's memory file has " + std::to_string(st.st_size) +
                             " bytes, " + std::to_string(block.bytes) + " announced");
    }
    const std::size_t length = mapped_length(block.bytes);
    void* p = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      fail(state_->name, std::string("mapping a shared block: ") + std::strerror(errno));
    }
    return adopt(static_cast<std::byte*>(p), block.bytes,
                 [length](std::byte* data, std::size_t) { ::munmap(data, length); });
  }

  DeviceAllocation adopt(std::byte* data, std::size_t bytes,
                         DeviceAllocation::Release release) override {
    if (bytes == 0) {
      return {};
    }
    if (data == nullptr) {
      fail(state_->name, "adopt: the engine's memory is null");
    }
    state_->allocations.add(data, bytes);
    state_->stats.add(MemoryKind::kDevice, bytes);
    return DeviceAllocation(
        data, bytes,
        [state = state_, release = std::move(release)](std::byte* p, std::size_t size) {
          state->allocations.remove(p);
          state->stats.remove(MemoryKind::kDevice, size);
          release(p, size);
        });
  }

  PinnedAllocation allocate_pinned(std::size_t bytes) override {
    if (bytes != 0) {
      refuse_during_capture(state_->name, "allocate_pinned");
    }
    return detail::allocate_host_pinned(state_, bytes);
  }

  HostRegistration register_host(void* host, std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    refuse_during_capture(state_->name, "register_host");
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

  void reserve_events(std::size_t count) override {
    refuse_during_capture(state_->name, "reserve_events");
    state_->reserve_events(count);
  }

  AllocationStats stats() const override { return state_->stats.snapshot(); }

  // HostDeviceOptions::shared_memory's allocate(): `bytes` were reserved already.
  DeviceAllocation allocate_shared(std::size_t bytes) {
    auto [p, fd] = allocate_shared_memory(state_->name, bytes);
    if (p == nullptr) {
      std::lock_guard lock(state_->mu);
      state_->live_device_bytes -= bytes;
      fail(state_->name, "out of memory: a shared memory file of " + std::to_string(bytes) +
                             " bytes was refused (" + std::strerror(errno) + ")");
    }
    if (state_->options.poison_allocations) {
      std::memset(p, static_cast<int>(kPoisonByte), bytes);
    }
    {
      std::lock_guard lock(state_->mu);
      state_->shared[reinterpret_cast<std::uintptr_t>(p)] = {bytes, fd};
    }
    state_->allocations.add(p, bytes);
    state_->stats.add(MemoryKind::kDevice, bytes);
    return DeviceAllocation(p, bytes, [state = state_](std::byte* data, std::size_t size) {
      state->allocations.remove(data);
      int block_fd = -1;
      {
        std::lock_guard lock(state->mu);
        state->live_device_bytes -= size;
        auto it = state->shared.find(reinterpret_cast<std::uintptr_t>(data));
        if (it != state->shared.end()) {
          block_fd = it->second.second;
          state->shared.erase(it);
        }
      }
      state->stats.remove(MemoryKind::kDevice, size);
      ::munmap(data, mapped_length(size));
      if (block_fd >= 0) {
        ::close(block_fd);
      }
    });
  }

 private:
  std::shared_ptr<HostDeviceState> state_;
};

}  // namespace

HostCaptureGuard::HostCaptureGuard() {
  g_capturing.fetch_add(1);
}
HostCaptureGuard::~HostCaptureGuard() {
  g_capturing.fetch_sub(1);
}
bool HostCaptureGuard::active() {
  return g_capturing.load() != 0;
}

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
