// What every actor of one load shares: the immutable input (plan, model, params),
// the staging pool, the first error, the abort flag and the counters that end up in
// the load report. Plain C++ (no CAF), internal to actors/.
//
// The first error wins: an actor that fails records its error here and stops; the
// coordinator sees the actor go down (or notices on its tick), finds the error and
// aborts everything else. `aborted` tells the other actors to stop doing work at
// once (drop chunks, issue no reads), before the exit messages reach them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "actors/pipeline.hpp"
#include "common/error.hpp"
#include "io/staging_pool.hpp"

namespace ferry::actors {

using Clock = std::chrono::steady_clock;

// Turns whatever was thrown into a ferry::Error: a ferry::Error as is, anything
// else as `fallback` with the given file and tensor and the exception's text.
inline Error to_error(std::exception_ptr ep, Stage fallback, const std::string& file,
                      const std::string& tensor, const std::string& context) {
  try {
    std::rethrow_exception(ep);
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    return Error(fallback, file, tensor, context + e.what());
  } catch (...) {
    return Error(fallback, file, tensor, context + "unknown exception");
  }
}

class Shared {
 public:
  explicit Shared(const PipelineInput& input)
      : input_(input),
        progress_(input.progress ? input.progress : &own_progress_),
        start_(Clock::now()) {}

  const PipelineInput& input() const { return input_; }
  const Plan& plan() const { return *input_.plan; }
  const io::CheckpointIndex& index() const { return *input_.index; }
  const models::Model& model() const { return *input_.model; }

  // Records `error` when it is the first; always sets aborted(). Never throws (it
  // runs in CAF's exception handlers and on failure paths).
  void fail(const Error& error) noexcept { record(&error); }
  // fail(to_error(...)), where building the error may itself run out of memory.
  void fail(std::exception_ptr ep, Stage fallback, const std::string& file,
            const std::string& tensor, const std::string& context) noexcept {
    try {
      fail(to_error(std::move(ep), fallback, file, tensor, context));
    } catch (...) {
      record(nullptr);
    }
  }
  std::optional<Error> error() const {
    std::lock_guard lock(mu_);
    return error_;
  }
  bool failed() const {
    std::lock_guard lock(mu_);
    return error_.has_value();
  }

  // Stop working: an error happened somewhere or the load is being torn down.
  bool aborted() const { return aborted_.load(); }
  void abort() { aborted_.store(true); }

  // The embedder asked to cancel.
  bool cancel_requested() const { return input_.cancel != nullptr && input_.cancel->load(); }
  // Throws Error(Stage::kCancelled) when the embedder asked to cancel.
  void check_cancel() const {
    if (cancel_requested()) {
      throw Error(Stage::kCancelled, "", "", "the load was cancelled");
    }
  }

  // The lanes, their staging pools and each rank's stream and scratch
  // (PipelineInput::prepared, or made by run_pipeline), set before any actor
  // starts; they outlive the actors.
  std::shared_ptr<PreparedResources> resources;
  std::vector<PreparedResources::Lane> lanes;
  // Whether readers may read straight into params (io.direct_to_device resolved
  // against the lanes that run; see run_pipeline).
  bool single_copy = false;
  // Ends every rank stream's emulated waits (gpu::Stream::abandon_emulated_waits), so
  // that a copy worker sleeping on the host backend's capped link wakes (an abort:
  // a cancel must not wait for a slow link to carry what was booked on it).
  void abandon_emulated_waits() {
    if (resources) {
      for (PreparedResources::Rank& rank : resources->ranks) {
        if (rank.stream) {
          rank.stream->abandon_emulated_waits();
        }
      }
    }
  }
  // Closes every lane's pool, so a reader blocked on one wakes (an abort).
  void close_pools() {
    for (PreparedResources::Lane& lane : lanes) {
      if (lane.pool) {
        lane.pool->close();
      }
    }
  }

  std::atomic<std::uint64_t> bytes_read{0};  // requested by the reader (O_DIRECT widening)
  // Staging buffers a reader lane left, on purpose, to reads still in flight after
  // io.cancel_timeout_ms (freeing them under the kernel would be worse).
  std::atomic<std::uint64_t> staging_leaked{0};
  // Windows read and param bytes copied so far: the caller's counters when it
  // watches them (PipelineInput::progress), else the pipeline's own.
  PipelineProgress& progress() { return *progress_; }
  std::atomic<std::uint64_t> bytes_prefetched{0};
  std::atomic<std::uint64_t> reads{0};
  std::atomic<std::uint64_t> bytes_direct{0};  // read straight into params
  std::atomic<std::uint64_t> bytes_staged{0};  // read into staging

  double seconds_since_start() const {
    return std::chrono::duration<double>(Clock::now() - start_).count();
  }
  // When every copy and fill had landed (set once by the post-processor).
  std::atomic<double> stream_done_seconds{-1.0};

  // The post-processor's byte counts, published when it stops.
  void publish_landed(std::vector<std::vector<std::uint64_t>> landed) {
    std::lock_guard lock(mu_);
    landed_ = std::move(landed);
  }
  std::vector<std::vector<std::uint64_t>> landed() const {
    std::lock_guard lock(mu_);
    return landed_;
  }

 private:
  // Records `*error` when it is the first; the spare when there is no error to
  // record (null) or copying it runs out of memory (an Error moves without
  // allocating). Sets aborted().
  void record(const Error* error) noexcept {
    {
      std::lock_guard lock(mu_);
      if (!error_ && error != nullptr) {
        try {
          error_ = *error;
        } catch (...) {
        }
      }
      if (!error_) {
        error_ = std::move(spare_);
      }
    }
    aborted_.store(true);
  }

  const PipelineInput& input_;
  PipelineProgress own_progress_;
  PipelineProgress* progress_;
  Clock::time_point start_;
  mutable std::mutex mu_;
  std::optional<Error> error_;
  // Recorded when the first error cannot be, for want of memory (an Error moves
  // without allocating).
  std::optional<Error> spare_{
      Error(Stage::kResources, "", "", "out of memory while recording the load's error")};
  std::atomic<bool> aborted_{false};
  std::vector<std::vector<std::uint64_t>> landed_;
};

}  // namespace ferry::actors
