// The staging-buffer pool: aligned host allocator, shared pool state and leases.
#include "io/staging_pool.hpp"

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "common/error.hpp"

namespace ferry::io {

BufferAllocator::~BufferAllocator() = default;

namespace {

class AlignedHostAllocator final : public BufferAllocator {
 public:
  void* allocate(std::size_t bytes, std::size_t alignment) override {
    // posix_memalign wants a power of two that is a multiple of sizeof(void*).
    std::size_t a = alignment < sizeof(void*) ? sizeof(void*) : alignment;
    void* p = nullptr;
    if (posix_memalign(&p, a, bytes) != 0) {
      return nullptr;
    }
    return p;
  }
  void deallocate(void* p, std::size_t /*bytes*/) noexcept override { std::free(p); }
  std::string name() const override { return "aligned host"; }
};

std::string shape(std::size_t count, std::size_t bytes) {
  return std::to_string(count) + " x " + std::to_string(bytes) + " bytes";
}

[[noreturn]] void throw_closed() {
  throw Error(Stage::kCancelled, "", "", "staging pool closed");
}

}  // namespace

std::shared_ptr<BufferAllocator> aligned_host_allocator() {
  // Stateless, so one shared instance serves every pool.
  static const std::shared_ptr<BufferAllocator> instance = std::make_shared<AlignedHostAllocator>();
  return instance;
}

namespace detail {

// Everything a lease needs, shared between the pool and its leases so that a lease
// outliving the StagingPool object stays valid (see the header).
struct StagingPoolState {
  std::shared_ptr<BufferAllocator> allocator;
  std::size_t count = 0;
  std::size_t buffer_bytes = 0;
  std::size_t alignment = 0;
  std::vector<std::byte*> buffers;  // by index; fixed after construction

  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::size_t> free;  // free indices, used as a stack: reuse the warmest buffer
  std::size_t high_water = 0;
  bool closed = false;
  std::function<void(std::size_t in_use)> observer;  // set before use; called under mu
  bool poison = false;                               // set before use

  StagingPoolState() = default;
  StagingPoolState(const StagingPoolState&) = delete;
  StagingPoolState& operator=(const StagingPoolState&) = delete;
  ~StagingPoolState() {
    for (std::byte* p : buffers) {
      if (p != nullptr) {
        allocator->deallocate(p, buffer_bytes);
      }
    }
  }

  // Once closed, no buffer is leased again: those idle now (close()) and those
  // given back later go back to the allocator at once, so a lease kept for good (a
  // read that never completed) holds its own buffer only, not the pool's. Requires
  // `mu` held; returns what to deallocate after unlocking.
  std::vector<std::byte*> take_idle() {
    std::vector<std::byte*> out;
    for (std::size_t i : free) {
      if (buffers[i] != nullptr) {
        out.push_back(std::exchange(buffers[i], nullptr));
      }
    }
    return out;
  }
  void deallocate(const std::vector<std::byte*>& idle) noexcept {
    for (std::byte* p : idle) {
      allocator->deallocate(p, buffer_bytes);
    }
  }

  // Takes a free buffer; requires `mu` held and `free` non-empty.
  StagingBuffer take(std::shared_ptr<StagingPoolState> self);

  void give_back(std::size_t index) noexcept {
    std::byte* to_free = nullptr;
    {
      std::lock_guard lock(mu);
      if (closed) {
        to_free = std::exchange(buffers[index], nullptr);
      } else if (poison) {
        std::memset(buffers[index], static_cast<int>(StagingPool::kPoisonPattern), buffer_bytes);
      }
      free.push_back(index);
      if (observer) {
        observer(count - free.size());
      }
    }
    if (to_free != nullptr) {
      allocator->deallocate(to_free, buffer_bytes);
    }
    // One buffer freed, so one waiter can proceed.
    cv.notify_one();
  }
};

}  // namespace detail

// ---- StagingBuffer ------------------------------------------------------------

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : state_(std::move(other.state_)),
      index_(std::exchange(other.index_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    release();
    state_ = std::move(other.state_);
    index_ = std::exchange(other.index_, 0);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

StagingBuffer::~StagingBuffer() {
  release();
}

void StagingBuffer::release() noexcept {
  if (state_ == nullptr) {
    return;
  }
  // Keep our reference until give_back() has notified: it may be the last one.
  state_->give_back(index_);
  state_.reset();
  index_ = 0;
  data_ = nullptr;
  size_ = 0;
}

StagingBuffer detail::StagingPoolState::take(std::shared_ptr<StagingPoolState> self) {
  std::size_t index = free.back();
  free.pop_back();
  std::size_t used = count - free.size();
  if (used > high_water) {
    high_water = used;
  }
  if (observer) {
    observer(used);
  }
  std::byte* data = buffers[index];
  return StagingBuffer(std::move(self), index, data, buffer_bytes);
}

// ---- StagingPool --------------------------------------------------------------

StagingPool::StagingPool(std::size_t count, std::size_t buffer_bytes,
                         std::shared_ptr<BufferAllocator> allocator, std::size_t alignment) {
  const std::string requested = shape(count, buffer_bytes);
  if (count == 0 || buffer_bytes == 0) {
    throw Error(Stage::kStaging, "", "",
                "staging pool needs a non-zero buffer count and size (got " + requested + ")");
  }
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    throw Error(Stage::kStaging, "", "",
                "staging buffer alignment must be a power of two (got " +
                    std::to_string(alignment) + " for " + requested + ")");
  }
  if (allocator == nullptr) {
    throw Error(Stage::kStaging, "", "", "staging pool of " + requested + " has no allocator");
  }
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  if (buffer_bytes > kMax - (alignment - 1)) {
    throw Error(Stage::kStaging, "", "", "staging buffer size overflows (" + requested + ")");
  }
  std::size_t rounded = (buffer_bytes + alignment - 1) & ~(alignment - 1);
  if (rounded > kMax / count) {
    throw Error(Stage::kStaging, "", "", "staging pool size overflows (" + requested + ")");
  }

  auto state = std::make_shared<detail::StagingPoolState>();
  state->allocator = std::move(allocator);
  state->count = count;
  state->buffer_bytes = rounded;
  state->alignment = alignment;
  state->buffers.reserve(count);
  state->free.reserve(count);
  // On failure, `state` going out of scope gives back what was allocated so far.
  for (std::size_t i = 0; i < count; ++i) {
    const std::string what = "cannot allocate staging buffer " + std::to_string(i) + " of " +
                             shape(count, rounded) + " from the " + state->allocator->name() +
                             " allocator";
    void* p = nullptr;
    try {
      p = state->allocator->allocate(rounded, alignment);
    } catch (const std::exception& e) {
      throw Error(Stage::kStaging, "", "", what + ": " + e.what());
    } catch (...) {
      throw Error(Stage::kStaging, "", "", what + ": unknown exception");
    }
    if (p == nullptr) {
      throw Error(Stage::kStaging, "", "", what + ": out of memory");
    }
    auto* data = static_cast<std::byte*>(p);
    if (reinterpret_cast<std::uintptr_t>(p) % alignment != 0) {
      state->allocator->deallocate(p, rounded);
      throw Error(Stage::kStaging, "", "",
                  what + ": memory is not aligned to " + std::to_string(alignment) + " bytes");
    }
    state->buffers.push_back(data);
  }
  // Hand out index 0 first (the stack pops from the back).
  for (std::size_t i = count; i > 0; --i) {
    state->free.push_back(i - 1);
  }
  state_ = std::move(state);
}

StagingPool::~StagingPool() {
  close();
}

StagingBuffer StagingPool::acquire() {
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->closed || !state_->free.empty(); });
  if (state_->closed) {
    throw_closed();
  }
  return state_->take(state_);
}

std::optional<StagingBuffer> StagingPool::try_acquire() {
  std::lock_guard lock(state_->mu);
  if (state_->closed) {
    throw_closed();
  }
  if (state_->free.empty()) {
    return std::nullopt;
  }
  return state_->take(state_);
}

std::optional<StagingBuffer> StagingPool::acquire_for(std::chrono::milliseconds timeout) {
  std::unique_lock lock(state_->mu);
  bool ready =
      state_->cv.wait_for(lock, timeout, [&] { return state_->closed || !state_->free.empty(); });
  if (state_->closed) {
    throw_closed();
  }
  if (!ready) {
    return std::nullopt;
  }
  return state_->take(state_);
}

void StagingPool::close() {
  std::vector<std::byte*> idle;
  {
    std::lock_guard lock(state_->mu);
    state_->closed = true;
    idle = state_->take_idle();
  }
  state_->cv.notify_all();
  state_->deallocate(idle);
}

bool StagingPool::closed() const {
  std::lock_guard lock(state_->mu);
  return state_->closed;
}

std::size_t StagingPool::count() const {
  return state_->count;
}
std::size_t StagingPool::buffer_bytes() const {
  return state_->buffer_bytes;
}
std::size_t StagingPool::alignment() const {
  return state_->alignment;
}
std::size_t StagingPool::total_bytes() const {
  return state_->count * state_->buffer_bytes;
}

std::size_t StagingPool::available() const {
  std::lock_guard lock(state_->mu);
  return state_->free.size();
}

std::size_t StagingPool::in_use() const {
  std::lock_guard lock(state_->mu);
  return state_->count - state_->free.size();
}

std::size_t StagingPool::high_water() const {
  std::lock_guard lock(state_->mu);
  return state_->high_water;
}

void StagingPool::observe(std::function<void(std::size_t in_use)> observer) {
  std::lock_guard lock(state_->mu);
  state_->observer = std::move(observer);
}

void StagingPool::poison_on_return(bool on) {
  std::lock_guard lock(state_->mu);
  state_->poison = on;
}

const BufferAllocator& StagingPool::allocator() const {
  return *state_->allocator;
}

}  // namespace ferry::io
