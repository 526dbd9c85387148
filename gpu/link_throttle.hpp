// A model of a host-to-device link of fixed speed, used by the host backend's
// bandwidth cap so that overlap experiments on a machine without a GPU see
// PCIe-like copy times.
//
// The link carries one transfer at a time: a transfer of n bytes that is requested
// at `now` starts when the link is free (never before `now`) and occupies it for
// n / rate. Every stream of a device shares the device's link, so concurrent copies
// queue behind each other, as on a real bus. An idle link saves no credit.
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>

namespace ferry::gpu {

class LinkThrottle {
 public:
  using Clock = std::chrono::steady_clock;

  // `gbps` in GB/s (1e9 bytes per second); must be > 0 and finite.
  explicit LinkThrottle(double gbps);

  // Books the link for `bytes` bytes requested at `now` and returns when that
  // transfer ends on the emulated link; the caller sleeps until then. Thread-safe.
  Clock::time_point reserve(std::size_t bytes, Clock::time_point now);

  // How long `bytes` bytes take at `gbps` (rounded up to the clock's tick).
  static Clock::duration transfer_time(std::size_t bytes, double gbps);

  double gbps() const { return gbps_; }

 private:
  const double gbps_;
  std::mutex mu_;
  Clock::time_point busy_until_{};
};

}  // namespace ferry::gpu
