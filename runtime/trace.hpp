// A Chrome trace-event JSON of one load (trace.path), for Perfetto or
// chrome://tracing: complete events ("ph": "X") on one lane per device (copies,
// casts, fills and zero fills), on read lanes (each read from submit to
// completion; reads in flight together take parallel lanes "read #2", ...), on hook
// lanes (each post-load hook's run, per local rank), on prefetch lanes (each block
// the page-cache prefetch read) and on the runtime lane (the
// phases: resolve, plan, allocate, sentinel, capture, prefetch, stream, verify).
// The events come from the same decorators as the metrics (io::MeteredReader,
// gpu::metered_device) and from a Model wrapper that times hooks. Internal to
// runtime/.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpu/metered_device.hpp"
#include "io/metered_reader.hpp"
#include "io/prefetch.hpp"
#include "models/hooks.hpp"
#include "models/model.hpp"

namespace ferry::runtime {

class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;
  // At most this many events are kept; the rest are counted (metadata
  // "ferry_dropped_events") so a huge load's trace stays bounded.
  static constexpr std::size_t kMaxEvents = std::size_t{1} << 20;

  TraceRecorder();

  // An event on lane group `group`; one that overlaps the group's earlier events
  // goes on the group's first lane that is free at `begin` (or a new one).
  void complete(const std::string& group, std::string name, Clock::time_point begin,
                Clock::time_point end, nlohmann::json args = nlohmann::json::object());

  io::ReadObserver read_observer();
  // For io::PrefetchOptions::on_block_read: lanes "prefetch", "prefetch #2", ...
  decltype(io::PrefetchOptions::on_block_read) prefetch_observer();
  gpu::CopyObserver copy_observer();
  // Records each hook's run on lane "hooks rank <local rank>".
  models::HookObserver hook_observer();

  // The trace as Chrome trace-event JSON (events sorted by start).
  nlohmann::json to_json() const;
  // Writes to_json() to `path` through a temporary file renamed into place. Throws
  // ferry::Error(Stage::kConfig) naming the file.
  void write(const std::string& path) const;

 private:
  struct Event {
    std::string name;
    int lane = 0;
    double ts_us = 0, dur_us = 0;
    nlohmann::json args;
  };
  struct Lane {
    std::string name;
    Clock::time_point end;
  };

  Clock::time_point t0_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
  std::vector<Lane> lanes_;  // index = tid - 1
  std::size_t dropped_ = 0;
};

}  // namespace ferry::runtime
