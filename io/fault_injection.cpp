// FaultInjector: seeded perturbation of system read results.
#include "io/fault_injection.hpp"

#include <cerrno>

namespace ferry::io {

long long FaultInjector::apply(long long result, std::size_t requested) {
  std::lock_guard<std::mutex> lock(mu_);
  ++reads_;
  if (plan_.fail_read_number != 0 && reads_ == plan_.fail_read_number) {
    ++faults_;
    return -EIO;
  }
  // One draw per read whatever the outcome, so the verdict for the n-th read
  // depends only on the seed and n, not on earlier results.
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  double draw = unit(rng_);
  const std::uint64_t cut_seed = rng_();
  if (result < 0 || result > static_cast<long long>(requested)) {
    return result;  // real errors (and impossible results) pass through untouched
  }
  if (draw < plan_.eagain_probability) {
    ++faults_;
    return -EAGAIN;
  }
  draw -= plan_.eagain_probability;
  if (draw < plan_.eintr_probability) {
    ++faults_;
    return -EINTR;
  }
  draw -= plan_.eintr_probability;
  if (draw < plan_.short_read_probability && result > 1) {
    ++faults_;
    // A length in [1, result - 1]: at least one byte, so the reader always progresses.
    return 1 + static_cast<long long>(cut_seed % static_cast<std::uint64_t>(result - 1));
  }
  return result;
}

void FaultInjector::set_plan(FaultPlan plan) {
  std::lock_guard<std::mutex> lock(mu_);
  plan_ = plan;
}

std::uint64_t FaultInjector::reads_seen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reads_;
}

std::uint64_t FaultInjector::faults_injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return faults_;
}

}  // namespace ferry::io
