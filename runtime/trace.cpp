#include "runtime/trace.hpp"

#include <algorithm>
#include <utility>

#include "common/format.hpp"
#include "models/hooks.hpp"

namespace ferry::runtime {

TraceRecorder::TraceRecorder() : t0_(Clock::now()) {}

void TraceRecorder::complete(const std::string& group, std::string name, Clock::time_point begin,
                             Clock::time_point end, nlohmann::json args) {
  std::lock_guard lock(mu_);
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  // The group's lanes are "group", "group #2", ...: the first free at `begin`.
  int lane = -1;
  int copies = 0;
  for (std::size_t i = 0; i < lanes_.size(); ++i) {
    const std::string& n = lanes_[i].name;
    if (n == group || n.rfind(group + " #", 0) == 0) {
      ++copies;
      if (lanes_[i].end <= begin) {
        lane = static_cast<int>(i);
        break;
      }
    }
  }
  if (lane < 0) {
    lanes_.push_back({copies == 0 ? group : group + " #" + std::to_string(copies + 1), end});
    lane = static_cast<int>(lanes_.size()) - 1;
  }
  lanes_[static_cast<std::size_t>(lane)].end = end;
  Event e;
  e.name = std::move(name);
  e.lane = lane;
  e.ts_us = std::chrono::duration<double, std::micro>(begin - t0_).count();
  e.dur_us = std::chrono::duration<double, std::micro>(end - begin).count();
  e.args = std::move(args);
  events_.push_back(std::move(e));
}

io::ReadObserver TraceRecorder::read_observer() {
  io::ReadObserver o;
  o.on_read = [this](const io::ReadOp& op, Clock::time_point submitted, Clock::time_point completed,
                     bool failed) {
    nlohmann::json args = {{"file", op.file != nullptr ? op.file->display() : ""},
                           {"offset", op.offset},
                           {"bytes", op.nbytes}};
    if (failed) {
      args["failed"] = true;
    }
    complete("read", "read", submitted, completed, std::move(args));
  };
  return o;
}

decltype(io::PrefetchOptions::on_block_read) TraceRecorder::prefetch_observer() {
  return [this](const io::PrefetchFile& file, std::uint64_t offset, std::uint64_t bytes,
                Clock::time_point begin, Clock::time_point end) {
    complete("prefetch", "prefetch", begin, end,
             {{"file", file.name.empty() ? file.path : file.name},
              {"offset", offset},
              {"bytes", bytes}});
  };
}

gpu::CopyObserver TraceRecorder::copy_observer() {
  gpu::CopyObserver o;
  o.on_op = [this](const gpu::DeviceOp& op) {
    complete(*op.device, std::string(op.op), op.begin, op.end, {{"bytes", op.bytes}});
  };
  return o;
}

models::HookObserver TraceRecorder::hook_observer() {
  return [this](const models::PostLoadHook& h, Clock::time_point begin, Clock::time_point end) {
    complete("hooks rank " + std::to_string(h.local_rank), h.name, begin, end);
  };
}

nlohmann::json TraceRecorder::to_json() const {
  std::lock_guard lock(mu_);
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t i = 0; i < lanes_.size(); ++i) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", i + 1},
                      {"args", {{"name", lanes_[i].name}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", i + 1},
                      {"args", {{"sort_index", i}}}});
  }
  std::vector<const Event*> sorted;
  for (const Event& e : events_) {
    sorted.push_back(&e);
  }
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const Event* a, const Event* b) { return a->ts_us < b->ts_us; });
  for (const Event* e : sorted) {
    events.push_back({{"name", e->name},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", e->lane + 1},
                      {"ts", e->ts_us},
                      {"dur", e->dur_us},
                      {"args", e->args}});
  }
  return {{"traceEvents", events},
          {"displayTimeUnit", "ms"},
          {"otherData", {{"producer", "ferry"}, {"ferry_dropped_events", dropped_}}}};
}

void TraceRecorder::write(const std::string& path) const {
  write_file_replacing(path, to_json().dump() + "\n", "trace.path");
}

}  // namespace ferry::runtime
