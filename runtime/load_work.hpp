// Inside the Runtime (internal to runtime/): the state a LoadedModel and a
// LoadHandle hide, the CallbackThread, one load's working state (LoadWork) and
// Runtime::Impl, shared by the files that do the work: runtime.cpp (the Runtime's
// states, one load's thread, the phases), allocate.cpp, startup.cpp (prepare and
// commit), update.cpp (Runtime::update), load_handle.cpp and loaded_model.cpp.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "actors/pipeline.hpp"
#include "actors/plan.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "gpu/device.hpp"
#include "io/prefetch.hpp"
#include "io/staging_pool.hpp"
#include "models/model.hpp"
#include "models/update_model.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/metrics.hpp"
#include "runtime/metrics_server.hpp"
#include "runtime/plan_report.hpp"
#include "runtime/test_seams.hpp"
#include "runtime/trace.hpp"

namespace ferry::runtime {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline ErrorInfo to_info(const Error& e) {
  return ErrorInfo{e.stage(), e.file(), e.tensor(), e.rule(), e.what()};
}

// The whole process's peak resident set (runtime.cpp).
std::uint64_t peak_rss_bytes();

struct FERRY_HIDDEN LoadedModel::State {
  std::vector<std::shared_ptr<gpu::Device>> devices;        // per local rank
  std::vector<std::vector<gpu::DeviceAllocation>> storage;  // [rank][param]; freed first
  // Storage that hooks declaring `reallocates` replaced: freed with the model, as
  // a captured graph may still point at it.
  std::vector<gpu::DeviceAllocation> retired;
  std::vector<LoadedRank> ranks;
  std::vector<ManifestEntry> manifest;  // recorded by prepare()
  LoadReport report;

  // What Runtime::update (runtime/update.cpp) needs of the load that made the model.
  struct Origin {
    std::shared_ptr<const models::Model> model;  // the shells and hooks it was loaded with
    std::string config_folder;                   // holds config.json (for in-memory updates)
    // The one folder every param's bytes now come from, with the stamps of the files
    // read: what a rollback re-reads. "" when none (dummy values, in-memory tensors,
    // a partial update from another folder).
    std::string folder;
    io::LoadFormat format = io::LoadFormat::kAuto;                // how `folder` was read
    std::vector<std::pair<std::string, io::FileIdentity>> files;  // path, identity
  } origin;
  // Set once a failed update could not restore the old weights (LoadedModel::valid).
  mutable std::mutex validity_mu;
  std::string invalid_reason;  // "" while valid
  // A model attached to a weight-cache daemon (runtime/cache_client.cpp): its
  // watchdog, stopped before the mappings go. Null for every other model.
  std::shared_ptr<void> cache;
};

class CallbackThread;

// One load: its cancel flag, where it is, and (once it ends) its result.
struct FERRY_HIDDEN LoadHandle::State {
  CallbackThread* callbacks = nullptr;  // set while the load runs, when it has any
  std::atomic<bool> cancel{false};
  std::atomic<LoadPhase> phase{LoadPhase::kStarting};
  bool is_update = false;  // Runtime::update's (its metrics are its own)
  std::function<void(const std::string&)> on_cache_lost;  // LoadCallbacks'
  std::atomic<std::uint64_t> bytes_planned{0};
  std::atomic<std::size_t> tensors_placed{0};
  actors::PipelineProgress pipeline;

  mutable std::mutex mu;
  mutable std::condition_variable cv;
  std::optional<LoadResult> result;  // set once, under mu
  // A failed or cancelled commit's storage: kept while a handle lives, because
  // graphs captured against the prepared model may still point at it.
  std::shared_ptr<const void> keep_alive;

  void finish(LoadResult r) {
    phase.store(r ? LoadPhase::kDone : LoadPhase::kFailed);
    {
      std::lock_guard lock(mu);
      result = std::move(r);
    }
    cv.notify_all();
  }
  void check_cancel() const {
    if (cancel.load()) {
      throw Error(Stage::kCancelled, "", "", "the load was cancelled");
    }
  }
  bool ended() const {  // the result is set
    std::lock_guard lock(mu);
    return result.has_value();
  }
};

// A snapshot of the handle's load (load_handle.cpp).
LoadProgress snapshot(const LoadHandle::State& s);
// A failure that is not a ferry::Error, labelled by the phase the load had
// reached (load_handle.cpp).
Error unexpected_error(LoadPhase phase, const std::string& what);

// Runs one load's LoadCallbacks on a thread of its own. The pipeline only posts to
// it (param_complete takes a short lock and returns); progress is sampled, so
// updates coalesce; the first callback that throws cancels the load and silences
// the rest.
class CallbackThread {
 public:
  CallbackThread(LoadCallbacks callbacks, LoadHandle::State& state);
  CallbackThread(const CallbackThread&) = delete;
  CallbackThread& operator=(const CallbackThread&) = delete;
  ~CallbackThread() { stop(); }

  // Before the stream: the decoder layer of each param of each local rank.
  void set_layers(const std::vector<models::RankShell>& shells);
  // From the post-processor: every byte of (rank, param) has landed.
  void param_complete(std::size_t rank, std::size_t param);
  // Delivers what is pending and a last progress, then stops. Returns what the
  // first callback that threw said, if one did.
  std::optional<std::string> stop();

 private:
  void loop();
  template <class F>
  void call(const char* which, F&& f);

  LoadCallbacks callbacks_;
  LoadHandle::State& state_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<std::vector<std::optional<std::uint64_t>>> param_layer_;  // [rank][param]
  std::vector<std::map<std::uint64_t, std::size_t>> remaining_;         // [rank][layer]
  std::vector<int> tp_ranks_;
  std::vector<std::pair<std::uint64_t, int>> ready_;  // (layer, tp rank) to deliver
  std::optional<std::string> error_;                  // written by the thread only
  std::thread thread_;  // last: it starts once everything above exists
};

// `bytes` bytes of memory for `spec` on `device`: from the engine's Allocator when
// there is one, else from the device (allocate.cpp).
gpu::DeviceAllocation allocate_param(const std::shared_ptr<Allocator>& allocator,
                                     gpu::Device& device, const models::ParamSpec& spec);
// `spec`'s bytes at the start of a block of its own whose size is a multiple of
// `granule` (a sharing runtime's hook outputs: see allocate_rank) (allocate.cpp).
gpu::DeviceAllocation allocate_shareable(gpu::Device& device, const models::ParamSpec& spec,
                                         std::size_t granule);
// Pinned staging memory of a CUDA device, placed on NUMA node `node` when >= 0
// (allocate.cpp).
std::shared_ptr<io::BufferAllocator> pinned_staging_allocator(std::shared_ptr<gpu::Device> device,
                                                              int node = -1);

// The check commit() runs for one local rank: which floating-point params still
// hold only the sentinel, read where the manifest says ferry put them (never
// through a pointer that moved since). prepare() builds it, because the manifest
// is known then and every allocation belongs there (capture safety): the table of
// ranges, uploaded once, the flags on the device and their pinned copy. commit()
// then launches one match_pattern over the table and reads the flags back with one
// copy: no readback, and no synchronize, per parameter.
struct SentinelCheck {
  std::vector<std::string> names;  // per range, as the error names them
  gpu::DeviceAllocation table;     // names.size() PatternRange entries
  gpu::DeviceAllocation flags;     // names.size() bytes
  gpu::PinnedAllocation result;    // the flags, read back
};

// Everything one load builds, step by step. A prepared startup keeps it between
// prepare() and commit().
struct LoadWork {
  ResolvedCheckpoint resolved;
  std::shared_ptr<const models::Model> model;
  actors::Plan plan;
  std::shared_ptr<LoadedModel::State> state = std::make_shared<LoadedModel::State>();
  std::mutex state_mu;  // ranks and storage, for hooks that reallocate while copies run
  LoadReport report;
  Clock::time_point begin = Clock::now();
  Clock::time_point resolved_at, planned_at, allocated_at;

  std::shared_ptr<LoadMetrics> metrics;  // null: none
  std::shared_ptr<TraceRecorder> trace;  // trace.path; null: none
  // Phases for the trace's runtime lane: (name, begin, end).
  std::vector<std::tuple<std::string, Clock::time_point, Clock::time_point>> spans;

  void span(std::string name, Clock::time_point b, Clock::time_point e) {
    spans.emplace_back(std::move(name), b, e);
  }
  // prepare()/commit() only.
  StartupMode mode = StartupMode::kSerial;  // after admission
  std::shared_ptr<LoadedModel> loaded;      // what prepare() handed over
  std::unique_ptr<io::Prefetcher> prefetcher;
  std::vector<std::size_t> stamped;  // planned files (index.files) commit() checks again
  Clock::time_point prepared_at;
  // Made by prepare() in overlap mode, so that commit() allocates and creates
  // nothing (include/ferry/runtime.hpp): the pipeline's lanes, staging pools, and
  // per local rank a stream (the sentinel fill, the copy worker, the sentinel
  // check) and copy scratch; the sentinel check's buffers. Released with the work,
  // after commit() ended.
  std::shared_ptr<actors::PreparedResources> resources;
  std::vector<SentinelCheck> sentinel_checks;
  gpu::Stream& rank_stream(std::size_t r) { return *resources->ranks.at(r).stream; }
};

struct FERRY_HIDDEN Runtime::Impl {
  LoadConfig config;  // a cached load's: model.load_format is cache.fallback_format
  RuntimeTestSeams seams;
  std::shared_ptr<Allocator> allocator;
  CacheConfig::Mode cache = CacheConfig::Mode::kOff;  // cache_mode() of the config given
  bool share_devices = false;  // the weight-cache daemon's: host devices on memfds
  // model.load_format remote_instance: the config's load_format is then
  // remote.fallback_format (auto when none), what a load from disk would read.
  bool remote = false;

  mutable std::mutex mu;  // guards everything below
  RuntimeState status = RuntimeState::kCreated;
  // The last load started. Weak: the Runtime never keeps a finished load's model
  // alive; its handles and its thread (until the thread ends) do.
  std::weak_ptr<LoadHandle::State> current;
  std::thread worker;                         // runs it
  std::shared_ptr<const log::Sink> log_sink;  // set_log_sink; null: the process-wide one
  std::shared_ptr<LoadWork> prepared;         // in the prepared state
  // Metrics: on the engine's registry (use_registry), or on one of ferry's own when
  // metrics.listen or metrics.textfile is set; null when neither.
  std::shared_ptr<LoadMetrics> metrics;
  std::unique_ptr<MetricsServer> server;  // metrics.listen, while the Runtime lives
  std::optional<Error> metrics_error;     // the endpoint could not be opened

  void start_metrics();
  // Adds the work's phases to its trace and writes it to trace.path (a failure
  // only warns). Never throws.
  void write_trace(LoadWork& w) noexcept;
  // Writes the trace when the scope ends, unless disarmed (a prepare() that
  // succeeded: its commit() writes the whole startup).
  struct TraceOnExit {
    Impl& impl;
    LoadWork& work;
    bool armed = true;
    ~TraceOnExit() {
      if (armed) {
        impl.write_trace(work);
      }
    }
  };
  std::shared_ptr<LoadMetrics> current_metrics() const {
    std::lock_guard lock(mu);
    return metrics;
  }

  using Body = std::function<LoadResult(LoadHandle::State&)>;
  // Under `mu`: an error handle when a load is running or `allowed` says no, else
  // starts `body` on the worker thread in state `running`; on success the runtime
  // goes to `success` (and keeps `keep` as the prepared work).
  LoadHandle launch(RuntimeState running, RuntimeState success, LoadCallbacks callbacks, Body body,
                    std::shared_ptr<LoadWork> keep, bool is_update = false);
  void run(LoadHandle::State& state, const LoadCallbacks& callbacks, const Body& body,
           RuntimeState success, const std::shared_ptr<LoadWork>& keep);

  // The steps. resolve_and_plan reads `c` (the Runtime's config, or an update's);
  // `adapt` replaces the model made from it (an update's model, runtime/update.cpp).
  using ModelAdapter = std::function<std::shared_ptr<const models::Model>(
      std::shared_ptr<const models::Model>, const ResolvedCheckpoint&)>;
  void resolve_and_plan(LoadWork& w, LoadHandle::State& handle, const LoadConfig& c,
                        const ModelAdapter& adapt = {});
  void make_devices(LoadWork& w);
  void allocate(LoadWork& w, LoadHandle::State& handle);
  void stream(LoadWork& w, LoadHandle::State& handle);  // + verify the bytes landed
  // The pipeline's whole input for stream(): pipeline_input() with the handle, the
  // test seams, the callbacks, load.layered's allocation and the observers.
  actors::PipelineInput stream_input(LoadWork& w, LoadHandle::State& handle);
  // The report's phases, throughput and host memory once the stream has verified.
  void report_stream(LoadWork& w, double stream_seconds, Clock::time_point t_begin,
                     Clock::time_point t_streamed, Clock::time_point t_verified) const;
  // The pipeline's input as far as it is fixed before streaming: plan, model,
  // targets, options, staging (what actors::prepare_resources reads).
  actors::PipelineInput pipeline_input(LoadWork& w) const;
  std::byte* reallocate(LoadWork& w, std::size_t rank, std::size_t param);
  std::vector<StartupRefusal> overlap_refusals(const LoadWork& w) const;
  void fill_sentinel(LoadWork& w, LoadHandle::State& handle);
  // Runs every post-load hook once, in the model's order, on its rank's device
  // (`what` names the weights in errors); hooks of devices that keep no data are
  // skipped and listed in the report.
  void run_hooks_once(LoadWork& w, LoadHandle::State& handle, const std::string& what);
  // model.load_format dummy: every param that no hook fills gets dummy values on its
  // device (models::dummy_range), then the hooks run.
  void fill_dummy(LoadWork& w, LoadHandle::State& handle);
  // The whole load into allocated storage: the pipeline, or the dummy fill; then each
  // device's allocation high water, and the load-only params freed and dropped.
  void load_all(LoadWork& w, LoadHandle::State& handle) {
    if (config.model.load_format == io::LoadFormat::kDummy) {
      fill_dummy(w, handle);
    } else {
      stream(w, handle);
    }
    drop_transients(w);
  }
  void drop_transients(LoadWork& w);
  // After the load's bytes are in and verified: load.verify_checksums on a presharded
  // read (throws Error(Stage::kVerify)), then load.save_presharded and
  // load.save_sharded_state (a failed save only warns: the load itself succeeded).
  void finish_restart_layouts(LoadWork& w, LoadHandle::State& handle);
  void verify_startup(LoadWork& w);

  LoadResult load(LoadHandle::State& handle);
  // The weight cache's client (runtime/cache_client.cpp): fills `w` with views of a
  // daemon's parameters and returns true, or returns false for a fallback to disk
  // (client mode, no daemon registered); throws for every other failure.
  bool attach_cache(LoadWork& w, LoadHandle::State& handle);
  // remote_instance's target (runtime/remote_target.cpp): fills `w` with the params
  // pulled from the seed and returns true, or returns false for a fallback to disk
  // (the seed unreachable, remote.fallback_format set); throws for everything else.
  bool pull_remote(LoadWork& w, LoadHandle::State& handle);
  // The result of an attached (or pulled) load (its model recorded as the one update() refuses).
  LoadResult attached(LoadWork& w);
  LoadResult prepare(LoadWork& w, LoadHandle::State& handle);
  LoadResult commit(LoadWork& w, LoadHandle::State& handle);

  // Runtime::update (runtime/update.cpp). The model the last load or commit handed
  // over, for update(): weak, as `current`.
  std::weak_ptr<LoadedModel> last_model;
  std::weak_ptr<LoadedModel::State> last_state;
  // After a load or commit that succeeded: the model's Origin, and the model as the
  // one update() writes.
  void record_origin(LoadWork& w, const std::shared_ptr<LoadedModel>& model);
  LoadResult update(const UpdateSource& source, const std::shared_ptr<LoadedModel>& model,
                    const std::shared_ptr<LoadedModel::State>& state, LoadHandle::State& handle);
  // Resolves and plans `folder` as an update of `model` through the update model
  // (models/update_model.hpp), and binds the work to the model's storage.
  void plan_update(LoadWork& u, const std::string& folder, io::LoadFormat format,
                   const models::UpdateFilter& filter, models::UpdateSelection& sel,
                   const LoadedModel::State& model, LoadHandle::State& handle);
};

// A weight file's identity as of now: that of the descriptor kept since its header
// was read, else (an index made without descriptors) of its path (startup.cpp).
io::FileIdentity identity_now(const io::CheckpointFile& f);
// Throws Error(Stage::kRead) naming `f` when its identity now differs from the one
// its header was read with: "the file changed <when> (what changed): <then>".
void check_unchanged(const io::CheckpointFile& f, const std::string& when, const std::string& then);
// The manifest of `state` as it is now, and the entries that differ from `before`,
// each with what changed (startup.cpp).
std::vector<ManifestEntry> record_manifest(const LoadedModel::State& state);
std::vector<std::string> manifest_changes(const std::vector<ManifestEntry>& before,
                                          const LoadedModel::State& state);

}  // namespace ferry::runtime
