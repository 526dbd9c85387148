// LoadHandle (one load: wait, cancel, progress) and the CallbackThread that runs
// its LoadCallbacks, the phase and state names, and how a failure that is not a
// ferry::Error is labelled.
#include <algorithm>
#include <array>
#include <chrono>
#include <exception>
#include <string>
#include <utility>

#include "common/enum_name.hpp"
#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "runtime/load_work.hpp"

namespace ferry::runtime {

namespace {

// "model.layers.<i>." -> i; nothing for other names.
std::optional<std::uint64_t> layer_of(const std::string& name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (name.rfind(kPrefix, 0) != 0) {
    return std::nullopt;
  }
  std::uint64_t layer = 0;
  std::size_t i = kPrefix.size();
  if (i >= name.size() || name[i] < '0' || name[i] > '9') {
    return std::nullopt;
  }
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) {
    layer = layer * 10 + static_cast<std::uint64_t>(name[i] - '0');
  }
  return i < name.size() && name[i] == '.' ? std::optional(layer) : std::nullopt;
}

}  // namespace

LoadProgress snapshot(const LoadHandle::State& s) {
  LoadProgress p;
  p.phase = s.phase.load();
  p.bytes_planned = s.bytes_planned.load();
  p.bytes_read = s.pipeline.bytes_read.load();
  p.bytes_copied = s.pipeline.bytes_copied.load();
  p.tensors_placed = s.tensors_placed.load();
  return p;
}

CallbackThread::CallbackThread(LoadCallbacks callbacks, LoadHandle::State& state)
    : callbacks_(std::move(callbacks)),
      state_(state),
      thread_(start_thread("callbacks", [this, sink = log::thread_sink()] {
        const log::ScopedSink scope(sink);
        loop();
      })) {}

void CallbackThread::set_layers(const std::vector<models::RankShell>& shells) {
  std::lock_guard lock(mu_);
  for (const models::RankShell& shell : shells) {
    auto& of = param_layer_.emplace_back();
    auto& left = remaining_.emplace_back();
    tp_ranks_.push_back(shell.tp_rank);
    for (const models::ParamSpec& p : shell.params) {
      std::optional<std::uint64_t> layer = p.nbytes == 0 ? std::nullopt : layer_of(p.name);
      of.push_back(layer);
      if (layer) {
        ++left[*layer];
      }
    }
  }
}

void CallbackThread::param_complete(std::size_t rank, std::size_t param) {
  std::lock_guard lock(mu_);
  if (rank >= param_layer_.size() || param >= param_layer_[rank].size()) {
    return;
  }
  if (const std::optional<std::uint64_t> layer = param_layer_[rank][param]) {
    if (--remaining_[rank][*layer] == 0) {
      ready_.emplace_back(*layer, tp_ranks_[rank]);
      cv_.notify_one();
    }
  }
}

std::optional<std::string> CallbackThread::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) {
    thread_.join();
  }
  return error_;
}

template <class F>
void CallbackThread::call(const char* which, F&& f) {
  if (error_) {
    return;  // the load is failing already: no more callbacks
  }
  try {
    f();
  } catch (const std::exception& e) {
    error_ = std::string(which) + " threw: " + e.what();
  } catch (...) {
    error_ = std::string(which) + " threw a non-standard exception";
  }
  if (error_) {
    state_.cancel.store(true);
  }
}

void CallbackThread::loop() {
  std::optional<LoadProgress> last;
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait_for(lock, std::chrono::milliseconds(5),
                 [this] { return stopping_ || !ready_.empty(); });
    std::vector<std::pair<std::uint64_t, int>> ready;
    ready.swap(ready_);
    const bool stopping = stopping_;
    lock.unlock();
    for (const auto& [layer, tp_rank] : ready) {
      call("on_layer_ready", [&] {
        if (callbacks_.on_layer_ready) {
          callbacks_.on_layer_ready(layer, tp_rank);
        }
      });
    }
    const LoadProgress now = snapshot(state_);
    if (callbacks_.on_progress && (!last || now != *last)) {
      last = now;
      call("on_progress", [&] {
        if (!callbacks_.on_progress(now)) {
          state_.cancel.store(true);  // the engine asked to stop
        }
      });
    }
    lock.lock();
    if (stopping && ready_.empty()) {
      return;
    }
  }
}
// A failure that is not a ferry::Error (std::bad_alloc, a std::system_error, an
// engine's exception) is labelled by the phase the load had reached: it used to be
// "config", which sent an operator to the settings for a failure of the stream.
Error unexpected_error(LoadPhase phase, const std::string& what) {
  Stage stage = Stage::kConfig;  // kStarting: before the checkpoint was touched
  switch (phase) {
    case LoadPhase::kResolve: stage = Stage::kDiscovery; break;
    case LoadPhase::kPlan: stage = Stage::kPlacement; break;
    // Allocation and the sentinel fill are device work, labelled as the fault
    // matrix labels a device's failures there; the stream's catch-all is "copy" too.
    case LoadPhase::kAllocate:
    case LoadPhase::kSentinel:
    case LoadPhase::kStream: stage = Stage::kCopy; break;
    case LoadPhase::kVerify: stage = Stage::kVerify; break;
    case LoadPhase::kStarting:
    case LoadPhase::kDone:
    case LoadPhase::kFailed: break;
  }
  return Error(stage, "", "",
               "unexpected during " + std::string(to_string(phase)) + ": " + what);
}

std::string_view to_string(LoadPhase phase) {
  static constexpr std::array<std::string_view, 9> kNames{
      "starting", "resolve", "plan", "allocate", "sentinel", "stream", "verify", "done", "failed"};
  static_assert(kNames.size() == static_cast<std::size_t>(LoadPhase::kFailed) + 1);
  return enum_name(phase, kNames);
}

LoadResult LoadHandle::wait() const {
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [this] { return state_->result.has_value(); });
  return *state_->result;
}

std::optional<LoadResult> LoadHandle::wait_for(std::chrono::milliseconds timeout) const {
  const Clock::time_point now = Clock::now();
  // now() + timeout past what the clock holds (milliseconds::max(), centuries) would
  // wrap into the past and return at once: such a timeout is no deadline. A negative
  // one is a deadline already passed (and milliseconds::min() must not overflow either).
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  std::unique_lock lock(state_->mu);
  auto ended = [this] { return state_->result.has_value(); };
  if (timeout >= room) {
    state_->cv.wait(lock, ended);
  } else if (!state_->cv.wait_until(
                 lock, now + std::max(timeout, std::chrono::milliseconds::zero()), ended)) {
    return std::nullopt;
  }
  return *state_->result;
}

void LoadHandle::cancel() const {
  state_->cancel.store(true);
}

bool LoadHandle::done() const {
  return state_->ended();
}

LoadProgress LoadHandle::progress() const {
  return snapshot(*state_);
}

std::string_view to_string(RuntimeState state) {
  static constexpr std::array<std::string_view, 8> kNames{
      "created", "loading", "preparing", "prepared", "committing", "ready", "failed", "updating"};
  static_assert(kNames.size() == static_cast<std::size_t>(RuntimeState::kUpdating) + 1);
  return enum_name(state, kNames);
}

}  // namespace ferry::runtime
