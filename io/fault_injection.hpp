// Seeded fault injection for byte readers (tests and failure drills).
//
// Readers consult an injector once per system-level read (pread call or io_uring
// completion) and apply its verdict to the real result: a short result makes the
// reader resubmit the remainder, EAGAIN/EINTR make it retry, an I/O error fails the
// op. So a test drives the readers' own recovery code, not a copy of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <random>

namespace ferry::io {

struct FaultPlan {
  std::uint64_t seed = 1;
  double short_read_probability = 0.0;  // result cut to a random shorter length (>= 1 byte)
  double eagain_probability = 0.0;      // result replaced by -EAGAIN
  double eintr_probability = 0.0;       // result replaced by -EINTR
  std::uint64_t fail_read_number = 0;   // the n-th system read (1-based) fails with -EIO; 0 = never
};

class FaultInjector {
 public:
  explicit FaultInjector(FaultPlan plan) : plan_(plan), rng_(plan.seed) {}

  // Given what the kernel returned for a read of `requested` bytes, returns what the
  // reader should see instead. `result` < 0 is -errno. Thread-safe.
  long long apply(long long result, std::size_t requested);
  // Replaces the plan from the next read on (the read count and the random stream
  // go on), e.g. FaultPlan{} to stop injecting so the same reader setup runs clean.
  // Thread-safe.
  void set_plan(FaultPlan plan);

  std::uint64_t reads_seen() const;
  std::uint64_t faults_injected() const;

 private:
  FaultPlan plan_;
  mutable std::mutex mu_;
  std::mt19937_64 rng_;
  std::uint64_t reads_ = 0;
  std::uint64_t faults_ = 0;
};

}  // namespace ferry::io
