#include "gpu/link_throttle.hpp"

#include <algorithm>
#include <cmath>

namespace ferry::gpu {

LinkThrottle::LinkThrottle(double gbps) : gbps_(gbps) {}

LinkThrottle::Clock::duration LinkThrottle::transfer_time(std::size_t bytes, double gbps) {
  // 1 GB/s moves one byte per nanosecond. Capped at about a century so that the
  // conversion to an integer tick count cannot overflow.
  double nanos = std::ceil(static_cast<double>(bytes) / gbps);
  nanos = std::min(nanos, 3e18);
  return std::chrono::ceil<Clock::duration>(
      std::chrono::nanoseconds(static_cast<std::chrono::nanoseconds::rep>(nanos)));
}

LinkThrottle::Clock::time_point LinkThrottle::reserve(std::size_t bytes, Clock::time_point now) {
  Clock::duration busy = transfer_time(bytes, gbps_);
  std::lock_guard lock(mu_);
  Clock::time_point start = std::max(now, busy_until_);
  busy_until_ = start + busy;
  return busy_until_;
}

}  // namespace ferry::gpu
