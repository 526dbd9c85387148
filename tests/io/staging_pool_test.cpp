// Tests for the staging-buffer pool: leases, blocking, close, alignment, allocators.
#include "io/staging_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "testing/error_of.hpp"

namespace ferry::io {
namespace {

using namespace std::chrono_literals;
using ferry::testing::error_of;

// Counts what it hands out; can be told to fail the n-th allocation (1-based), by
// returning nullptr, throwing, or returning misaligned memory.
class CountingAllocator final : public BufferAllocator {
 public:
  enum class Failure { kNone, kNull, kThrow, kMisaligned };

  explicit CountingAllocator(Failure failure = Failure::kNone, int fail_at = 0)
      : failure_(failure), fail_at_(fail_at) {}

  // Every pool in these tests uses the default alignment; delete must match it.
  static constexpr std::align_val_t kAlign{4096};

  void* allocate(std::size_t bytes, std::size_t alignment) override {
    std::lock_guard lock(mu_);
    EXPECT_EQ(alignment, 4096u);
    ++calls_;
    if (failure_ != Failure::kNone && calls_ == fail_at_) {
      if (failure_ == Failure::kNull) {
        return nullptr;
      }
      if (failure_ == Failure::kThrow) {
        throw std::bad_alloc();
      }
      // Misaligned: a real allocation, offset by one byte.
      auto* p = static_cast<std::byte*>(::operator new(bytes + alignment, kAlign));
      misaligned_.insert(p + 1);
      ++live_;
      return p + 1;
    }
    void* p = ::operator new(bytes, kAlign);
    ++live_;
    ++allocated_;
    return p;
  }
  void deallocate(void* p, std::size_t /*bytes*/) noexcept override {
    std::lock_guard lock(mu_);
    --live_;
    ++deallocated_;
    auto it = misaligned_.find(static_cast<std::byte*>(p));
    if (it != misaligned_.end()) {
      misaligned_.erase(it);
      ::operator delete(static_cast<std::byte*>(p) - 1, kAlign);
      return;
    }
    ::operator delete(p, kAlign);
  }
  std::string name() const override { return "counting"; }

  int live() const {
    std::lock_guard lock(mu_);
    return live_;
  }
  int allocated() const {
    std::lock_guard lock(mu_);
    return allocated_;
  }
  int deallocated() const {
    std::lock_guard lock(mu_);
    return deallocated_;
  }

 private:
  mutable std::mutex mu_;
  Failure failure_;
  int fail_at_;
  int calls_ = 0;
  int live_ = 0;
  int allocated_ = 0;
  int deallocated_ = 0;
  std::set<std::byte*> misaligned_;
};

TEST(StagingPoolTest, AcquireReleaseCycles) {
  StagingPool pool(3, 4096);
  EXPECT_EQ(pool.count(), 3u);
  EXPECT_EQ(pool.buffer_bytes(), 4096u);
  EXPECT_EQ(pool.total_bytes(), 3u * 4096u);
  EXPECT_EQ(pool.available(), 3u);
  EXPECT_EQ(pool.in_use(), 0u);
  for (int cycle = 0; cycle < 50; ++cycle) {
    std::vector<StagingBuffer> leases;
    for (int i = 0; i < 3; ++i) {
      leases.push_back(pool.acquire());
      EXPECT_TRUE(leases.back().valid());
      EXPECT_EQ(leases.back().size(), 4096u);
    }
    EXPECT_EQ(pool.available(), 0u);
    EXPECT_EQ(pool.in_use(), 3u);
    std::set<std::size_t> indices;
    for (const StagingBuffer& b : leases) {
      indices.insert(b.index());
    }
    EXPECT_EQ(indices, (std::set<std::size_t>{0, 1, 2}));
    leases[1].release();
    EXPECT_FALSE(leases[1].valid());
    EXPECT_EQ(leases[1].data(), nullptr);
    EXPECT_EQ(leases[1].size(), 0u);
    EXPECT_EQ(pool.available(), 1u);
    leases[1].release();  // releasing an empty lease is a no-op
    EXPECT_EQ(pool.available(), 1u);
  }
  EXPECT_EQ(pool.available(), 3u);
  EXPECT_EQ(pool.high_water(), 3u);
}

TEST(StagingPoolTest, TryAcquireOnEmptyPoolReturnsNothing) {
  StagingPool pool(1, 4096);
  std::optional<StagingBuffer> first = pool.try_acquire();
  ASSERT_TRUE(first.has_value());
  EXPECT_FALSE(pool.try_acquire().has_value());
  first.reset();
  EXPECT_TRUE(pool.try_acquire().has_value());
}

TEST(StagingPoolTest, BlockingAcquireIsWokenByReleaseFromAnotherThread) {
  StagingPool pool(1, 4096);
  StagingBuffer held = pool.acquire();
  const std::byte* held_data = held.data();
  std::atomic<bool> got{false};
  const std::byte* got_data = nullptr;
  std::thread waiter([&] {
    StagingBuffer b = pool.acquire();
    got_data = b.data();
    got = true;
  });
  // Give the waiter time to block; the assertion holds however long it took.
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(got.load());
  held.release();
  waiter.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(got_data, held_data);
  EXPECT_EQ(pool.available(), 1u);
}

TEST(StagingPoolTest, AcquireForGivesUpWhenNoneIsReleased) {
  StagingPool pool(1, 4096);
  std::optional<StagingBuffer> held = pool.acquire_for(1000ms);
  ASSERT_TRUE(held.has_value());
  EXPECT_FALSE(pool.acquire_for(10ms).has_value());
  EXPECT_FALSE(pool.acquire_for(0ms).has_value());
  held.reset();
  EXPECT_TRUE(pool.acquire_for(0ms).has_value());
}

TEST(StagingPoolTest, CloseWakesBlockedAcquirersWithCancelledError) {
  StagingPool pool(1, 4096);
  StagingBuffer held = pool.acquire();
  std::atomic<int> cancelled{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&, i] {
      try {
        if (i == 0) {
          pool.acquire();
        } else {
          pool.acquire_for(std::chrono::hours(1));
        }
      } catch (const Error& e) {
        if (e.stage() == Stage::kCancelled &&
            std::string(e.what()).find("staging pool closed") != std::string::npos) {
          ++cancelled;
        }
      }
    });
  }
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(pool.closed());
  pool.close();
  for (std::thread& t : waiters) {
    t.join();
  }
  EXPECT_EQ(cancelled.load(), 3);
  EXPECT_TRUE(pool.closed());

  // Future acquirers fail too, even with a buffer free; releases still work.
  held.release();
  EXPECT_EQ(pool.available(), 1u);
  error_of(Stage::kCancelled, [&] { pool.acquire(); });
  error_of(Stage::kCancelled, [&] { (void)pool.try_acquire(); });
  error_of(Stage::kCancelled, [&] { (void)pool.acquire_for(0ms); });
  pool.close();  // idempotent
}

TEST(StagingPoolTest, EveryBufferIsAlignedDistinctAndWritable) {
  StagingPool pool(8, 5000);  // rounded up to 8192
  EXPECT_EQ(pool.buffer_bytes(), 8192u);
  EXPECT_EQ(pool.alignment(), 4096u);
  std::vector<StagingBuffer> leases;
  for (int i = 0; i < 8; ++i) {
    leases.push_back(pool.acquire());
  }
  std::set<std::uintptr_t> starts;
  for (StagingBuffer& b : leases) {
    auto start = reinterpret_cast<std::uintptr_t>(b.data());
    EXPECT_EQ(start % 4096, 0u) << "buffer " << b.index();
    EXPECT_EQ(b.span().size(), 8192u);
    starts.insert(start);
    std::memset(b.data(), static_cast<int>(b.index() + 1), b.size());
  }
  ASSERT_EQ(starts.size(), 8u);
  // Sorted starts: consecutive buffers do not overlap.
  for (auto it = starts.begin(); std::next(it) != starts.end(); ++it) {
    EXPECT_GE(*std::next(it) - *it, 8192u);
  }
  for (StagingBuffer& b : leases) {
    for (std::size_t i = 0; i < b.size(); i += 997) {
      ASSERT_EQ(static_cast<int>(b.data()[i]), static_cast<int>(b.index() + 1));
    }
  }
}

TEST(StagingPoolTest, OtherAlignmentsAreHonoured) {
  StagingPool pool(2, 100, aligned_host_allocator(), 512);
  EXPECT_EQ(pool.buffer_bytes(), 512u);
  StagingBuffer a = pool.acquire();
  StagingBuffer b = pool.acquire();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 512, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % 512, 0u);
}

TEST(StagingPoolTest, HighWaterIsTheMostLeasedAtOnce) {
  StagingPool pool(4, 4096);
  EXPECT_EQ(pool.high_water(), 0u);
  {
    StagingBuffer a = pool.acquire();
    StagingBuffer b = pool.acquire();
    StagingBuffer c = pool.acquire();
    EXPECT_EQ(pool.high_water(), 3u);
    b.release();
    c.release();
    StagingBuffer d = pool.acquire();
    EXPECT_EQ(pool.in_use(), 2u);
    EXPECT_EQ(pool.high_water(), 3u);
  }
  EXPECT_EQ(pool.in_use(), 0u);
  EXPECT_EQ(pool.high_water(), 3u);
}

TEST(StagingPoolTest, LeasesMoveAndMoveAssignmentReleasesTheOldOne) {
  StagingPool pool(2, 4096);
  StagingBuffer a = pool.acquire();
  const std::byte* data = a.data();
  const std::size_t index = a.index();
  StagingBuffer b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.index(), index);
  EXPECT_EQ(pool.in_use(), 1u);

  StagingBuffer c = pool.acquire();
  EXPECT_EQ(pool.in_use(), 2u);
  c = std::move(b);  // c's old buffer goes back
  EXPECT_EQ(pool.in_use(), 1u);
  EXPECT_EQ(c.data(), data);
  StagingBuffer empty;
  EXPECT_FALSE(static_cast<bool>(empty));
  c = std::move(empty);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(StagingPoolTest, SharedPtrWrappedLeaseReturnsOnLastReference) {
  StagingPool pool(2, 4096);
  auto shared = std::make_shared<StagingBuffer>(pool.acquire());
  std::shared_ptr<StagingBuffer> copy = shared;  // as a copied CAF message would
  EXPECT_EQ(pool.in_use(), 1u);
  shared.reset();
  EXPECT_EQ(pool.in_use(), 1u);
  EXPECT_TRUE(copy->valid());
  // The last reference may drop on another thread (a copy worker).
  std::thread other([c = std::move(copy)]() mutable { c.reset(); });
  other.join();
  EXPECT_EQ(pool.in_use(), 0u);
  EXPECT_EQ(pool.available(), 2u);
}

TEST(StagingPoolTest, CustomAllocatorGetsEverythingBackWhenThePoolGoes) {
  auto alloc = std::make_shared<CountingAllocator>();
  {
    StagingPool pool(5, 10000, alloc);
    EXPECT_EQ(alloc->allocated(), 5);
    EXPECT_EQ(alloc->live(), 5);
    EXPECT_EQ(pool.allocator().name(), "counting");
    EXPECT_EQ(pool.buffer_bytes(), 12288u);
    for (int i = 0; i < 20; ++i) {
      StagingBuffer a = pool.acquire();
      StagingBuffer b = pool.acquire();
    }
    EXPECT_EQ(alloc->allocated(), 5);  // all up front, none per lease
  }
  EXPECT_EQ(alloc->live(), 0);
  EXPECT_EQ(alloc->deallocated(), 5);
}

TEST(StagingPoolTest, LeaseOutlivingThePoolStaysValidAndHoldsOnlyItsOwnBuffer) {
  auto alloc = std::make_shared<CountingAllocator>();
  std::optional<StagingBuffer> lease;
  {
    StagingPool pool(3, 4096, alloc);
    lease = pool.acquire();
  }
  ASSERT_TRUE(lease->valid());
  std::memset(lease->data(), 0x5a, lease->size());  // still our memory
  EXPECT_EQ(alloc->live(), 1) << "the two idle buffers went back when the pool closed";
  lease->release();
  EXPECT_EQ(alloc->live(), 0);
}

// What a read that never completes leaves: its lease, kept for good, holds one
// buffer; every other buffer goes back to the allocator once the pool is closed,
// whether it was idle then or given back later.
TEST(StagingPoolTest, AClosedPoolGivesEachBufferBackAsSoonAsItIsIdle) {
  auto alloc = std::make_shared<CountingAllocator>();
  StagingPool pool(4, 4096, alloc);
  StagingBuffer kept = pool.acquire();
  std::optional<StagingBuffer> later = pool.acquire();
  EXPECT_EQ(alloc->live(), 4);
  pool.close();
  EXPECT_EQ(alloc->live(), 2);
  EXPECT_EQ(pool.in_use(), 2u);
  later.reset();
  EXPECT_EQ(alloc->live(), 1);
  EXPECT_EQ(pool.in_use(), 1u);
  EXPECT_THROW(pool.acquire(), Error);
  std::memset(kept.data(), 0x5a, kept.size());  // still valid
}

TEST(StagingPoolTest, DestroyingThePoolWakesBlockedAcquirers) {
  auto pool = std::make_unique<StagingPool>(1, 4096);
  StagingBuffer held = pool->acquire();
  // A waiter that entered acquire() before destruction: close() first (the pool
  // contract), then destroy while the lease is still out.
  std::atomic<bool> cancelled{false};
  std::thread waiter([&] {
    try {
      pool->acquire();
    } catch (const Error& e) {
      cancelled = e.stage() == Stage::kCancelled;
    }
  });
  std::this_thread::sleep_for(10ms);
  pool->close();
  waiter.join();
  pool.reset();
  EXPECT_TRUE(cancelled.load());
  held.release();
}

TEST(StagingPoolTest, ZeroCountOrSizeIsRejected) {
  std::string m = error_of(Stage::kStaging, [] { StagingPool pool(0, 4096); });
  EXPECT_NE(m.find("0 x 4096 bytes"), std::string::npos) << m;
  m = error_of(Stage::kStaging, [] { StagingPool pool(4, 0); });
  EXPECT_NE(m.find("4 x 0 bytes"), std::string::npos) << m;
}

TEST(StagingPoolTest, BadAlignmentOverflowAndNullAllocatorAreRejected) {
  std::string m =
      error_of(Stage::kStaging, [] { StagingPool pool(2, 4096, aligned_host_allocator(), 3000); });
  EXPECT_NE(m.find("power of two"), std::string::npos) << m;
  error_of(Stage::kStaging, [] { StagingPool pool(2, 4096, aligned_host_allocator(), 0); });
  auto alloc = std::make_shared<CountingAllocator>();
  m = error_of(Stage::kStaging,
               [&] { StagingPool pool(std::numeric_limits<std::size_t>::max() / 2, 8192, alloc); });
  EXPECT_NE(m.find("overflows"), std::string::npos) << m;
  error_of(Stage::kStaging,
           [&] { StagingPool pool(1, std::numeric_limits<std::size_t>::max() - 5, alloc); });
  EXPECT_EQ(alloc->allocated(), 0);  // rejected before allocating anything
  error_of(Stage::kStaging, [] { StagingPool pool(1, 4096, nullptr); });
}

TEST(StagingPoolTest, AllocatorReturningNullFailsAndGivesBackTheRest) {
  auto alloc = std::make_shared<CountingAllocator>(CountingAllocator::Failure::kNull, 3);
  std::string m = error_of(Stage::kStaging, [&] { StagingPool pool(4, 4096, alloc); });
  EXPECT_NE(m.find("staging buffer 2 of 4 x 4096 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("counting allocator"), std::string::npos) << m;
  EXPECT_EQ(alloc->allocated(), 2);
  EXPECT_EQ(alloc->live(), 0);
}

TEST(StagingPoolTest, AllocatorThrowingFailsAndGivesBackTheRest) {
  auto alloc = std::make_shared<CountingAllocator>(CountingAllocator::Failure::kThrow, 2);
  std::string m = error_of(Stage::kStaging, [&] { StagingPool pool(4, 4096, alloc); });
  EXPECT_NE(m.find("bad_alloc"), std::string::npos) << m;
  EXPECT_EQ(alloc->allocated(), 1);
  EXPECT_EQ(alloc->live(), 0);
}

TEST(StagingPoolTest, AllocatorReturningMisalignedMemoryIsRejected) {
  auto alloc = std::make_shared<CountingAllocator>(CountingAllocator::Failure::kMisaligned, 2);
  std::string m = error_of(Stage::kStaging, [&] { StagingPool pool(3, 4096, alloc); });
  EXPECT_NE(m.find("not aligned to 4096"), std::string::npos) << m;
  EXPECT_EQ(alloc->live(), 0);
}

TEST(StagingPoolTest, ConcurrentLeasesNeverShareABuffer) {
  StagingPool pool(2, 4096);
  std::atomic<int> owners[2] = {0, 0};
  std::atomic<int> clashes{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 300; ++i) {
        StagingBuffer b = pool.acquire();
        if (owners[b.index()].fetch_add(1) != 0) {
          ++clashes;
        }
        b.data()[0] = std::byte{1};
        owners[b.index()].fetch_sub(1);
      }
    });
  }
  for (std::thread& t : threads) {
    t.join();
  }
  EXPECT_EQ(clashes.load(), 0);
  EXPECT_EQ(pool.available(), 2u);
  EXPECT_LE(pool.high_water(), 2u);
  EXPECT_GE(pool.high_water(), 1u);
}

}  // namespace
}  // namespace ferry::io
