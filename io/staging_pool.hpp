// The staging-buffer pool: a fixed number of fixed-size, aligned host buffers that
// the load pipeline reads weight bytes into before they are copied to a device.
//
// The pool is the bound on host memory a load uses (count × buffer_bytes): every
// buffer is allocated up front and readers must lease one before they can read.
// Buffers are aligned (kDirectAlignment by default) so that O_DIRECT reads land in them in place.
//
// The memory comes from a pluggable BufferAllocator. io/ provides aligned host
// memory; pinned (page-locked) memory from a device backend is plugged in by a layer
// that knows both io/ and gpu/ (actors/ or runtime/), since those two do not know
// each other.
//
// Lifetime: the pool's state is shared with its leases, so a lease that outlives
// the StagingPool object (for instance a shared_ptr<StagingBuffer> still sitting in
// an actor's mailbox when a cancelled load tears down) stays valid. Once the pool
// is closed, each buffer goes back to the allocator as soon as it is idle: those
// idle at close() at once, the others when their lease is released. So a lease
// kept for good (a read that never completed) keeps its own buffer only.
// Destroying the pool closes it: blocked acquirers in other threads wake with an
// error. (Destroying it while another thread is still *inside* a pool method is a
// use-after-free like for any object: close() first and let those threads leave.)
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "io/file.hpp"

namespace ferry::io {

// Where staging memory comes from. Implementations must be thread-safe (a pool
// allocates from its constructor and deallocates from whichever thread drops the
// last reference).
class BufferAllocator {
 public:
  virtual ~BufferAllocator();
  // Returns `bytes` bytes aligned to `alignment` (a power of two), or throws /
  // returns nullptr on failure; the pool turns either into ferry::Error.
  virtual void* allocate(std::size_t bytes, std::size_t alignment) = 0;
  // Frees memory from allocate() with the same `bytes`.
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  // For messages and logs ("aligned host", "cuda pinned", ...).
  virtual std::string name() const = 0;
};

// Plain host memory from posix_memalign (pageable; fine for O_DIRECT).
std::shared_ptr<BufferAllocator> aligned_host_allocator();

namespace detail {
struct StagingPoolState;
}  // namespace detail

// A lease on one staging buffer: move-only, returns the buffer to its pool when
// destroyed or on release(). A default-constructed or released lease is empty
// (data() == nullptr, size() == 0). To pass a lease in a copyable message, wrap it:
// std::make_shared<StagingBuffer>(std::move(lease)); the buffer returns when the last
// shared_ptr goes. Not thread-safe itself (one owner at a time), but leases of the
// same pool may be released concurrently from any threads.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  StagingBuffer(StagingBuffer&& other) noexcept;
  StagingBuffer& operator=(StagingBuffer&& other) noexcept;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  ~StagingBuffer();

  // Start of the buffer, aligned to the pool's alignment; buffer_bytes() long.
  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<std::byte> span() const { return {data_, size_}; }
  // Which of the pool's buffers this is, in [0, count()); stable for the pool's life.
  std::size_t index() const { return index_; }
  bool valid() const { return data_ != nullptr; }
  explicit operator bool() const { return valid(); }

  // Returns the buffer to the pool now; the lease becomes empty. No-op when empty.
  void release() noexcept;

 private:
  friend struct detail::StagingPoolState;
  StagingBuffer(std::shared_ptr<detail::StagingPoolState> state, std::size_t index, std::byte* data,
                std::size_t size)
      : state_(std::move(state)), index_(index), data_(data), size_(size) {}

  std::shared_ptr<detail::StagingPoolState> state_;
  std::size_t index_ = 0;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

class StagingPool {
 public:
  // Allocates `count` buffers of `buffer_bytes` rounded up to `alignment` (a power
  // of two). Throws ferry::Error(Stage::kStaging) naming count and size when count or
  // size is 0, the alignment is not a power of two, the total overflows, or the
  // allocator throws, returns nullptr or returns misaligned memory (what was already
  // allocated is given back).
  StagingPool(std::size_t count, std::size_t buffer_bytes,
              std::shared_ptr<BufferAllocator> allocator = aligned_host_allocator(),
              std::size_t alignment = kDirectAlignment);
  // Closes the pool (see close()). Outstanding leases stay valid (see file comment).
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Waits until a buffer is free. Throws ferry::Error(Stage::kCancelled) "staging
  // pool closed" when the pool is or becomes closed while waiting.
  StagingBuffer acquire();
  // A free buffer, or nullopt when none is free right now. Throws like acquire()
  // when closed, so a polling loop cannot spin forever on a cancelled load.
  std::optional<StagingBuffer> try_acquire();
  // Like acquire() but gives up after `timeout` (nullopt). Throws when closed.
  std::optional<StagingBuffer> acquire_for(std::chrono::milliseconds timeout);

  // Makes every current and future acquire throw ferry::Error(Stage::kCancelled), so
  // a cancelled load never hangs on a buffer. Releasing leases still works (the
  // buffer then goes back to the allocator, as idle ones do here). Idempotent;
  // cannot be undone.
  void close();
  bool closed() const;

  std::size_t count() const;
  std::size_t buffer_bytes() const;  // after rounding up to the alignment
  std::size_t alignment() const;
  std::size_t total_bytes() const;  // count() × buffer_bytes(): the host memory bound
  std::size_t available() const;    // buffers free now
  std::size_t in_use() const;       // buffers leased now
  std::size_t high_water() const;   // most buffers leased at the same time so far
  const BufferAllocator& allocator() const;
  // Called with the number of buffers leased after every lease and return, under
  // the pool's lock (it must be quick and must not touch the pool), e.g. to keep a
  // gauge current. Replaces any earlier observer.
  void observe(std::function<void(std::size_t in_use)> observer);
  // Overwrite every buffer with kPoisonPattern as it comes back, so that a copy
  // still reading it afterwards (a buffer released before its copy completed)
  // lands the pattern instead of checkpoint bytes: host.deferred_copies' check.
  void poison_on_return(bool on);
  static constexpr std::byte kPoisonPattern{0x5A};

 private:
  std::shared_ptr<detail::StagingPoolState> state_;
};

}  // namespace ferry::io
