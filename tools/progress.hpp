// What `ferry load` shows while a load runs (unless --quiet): on a terminal, one
// line redrawn in place at most 10 times a second — phase, bytes read of the
// planned bytes, GB/s and ETA; otherwise plain lines, one when the phase changes
// and one every `interval` while it stays (logs and CI stay readable).
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include "runtime/api_internal.hpp"

namespace ferry::tools {

class ProgressPrinter {
 public:
  using Clock = std::chrono::steady_clock;
  ProgressPrinter(std::FILE* out, bool terminal,
                  std::chrono::milliseconds interval = std::chrono::seconds(2));

  // A LoadCallbacks::on_progress for this printer (always returns true).
  runtime::LoadCallbacks callbacks();
  // Prints `p` if it is due at `now` (tests pass their own clock).
  void update(const runtime::LoadProgress& p, Clock::time_point now);
  // Ends the terminal line (a newline) when one was drawn.
  void finish();

  // "stream 1.10 GiB / 2.05 GiB (54%) 5.21 GB/s ETA 0.2 s": the text of one update.
  static std::string line(const runtime::LoadProgress& p, double gbps, double eta_seconds);

 private:
  std::FILE* out_;
  bool terminal_;
  std::chrono::milliseconds interval_;
  Clock::time_point last_print_{};
  Clock::time_point stream_started_{};
  runtime::LoadPhase last_phase_ = runtime::LoadPhase::kStarting;
  bool printed_ = false;
  bool line_open_ = false;
};

}  // namespace ferry::tools
