// ferry::Runtime: one load, in phases whose wall-clock boundaries make the report.
//
//   resolve      discovery, every header (validated), config.json
//   plan         the model's shells, every tensor routed (placed / dropped /
//                unmapped), coverage checked, reads planned as spans
//   allocate     devices made, every param allocated, page cache dropped when asked
//   stream       the actor pipeline (actors/pipeline.hpp) until every copy landed
//   postprocess  the rest of the pipeline: hooks that ran after the last copy,
//                teardown of the actors
//   verify       every param written exactly once over (byte counts)
//
// Everything a load allocates lives in a LoadedModel::State from the start. On
// failure that state is dropped after the pipeline has stopped every actor, which
// frees the device memory; on success it becomes the LoadedModel.
//
// The work is in six files around runtime/load_work.hpp (LoadWork, Runtime::Impl):
// this one (the Runtime's states, one load's thread, and the phases), allocate.cpp,
// startup.cpp (prepare/commit), update.cpp (Runtime::update), load_handle.cpp
// (LoadHandle, its CallbackThread) and loaded_model.cpp.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "actors/pipeline.hpp"
#include "actors/plan.hpp"
#include "common/format.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "ferry/metrics.hpp"
#include "gpu/backends.hpp"
#include "gpu/device.hpp"
#include "gpu/metered_device.hpp"
#include "io/discover.hpp"
#include "io/fd_limit.hpp"
#include "io/file.hpp"
#include "io/metered_reader.hpp"
#include "io/prefetch.hpp"
#include "io/safetensors.hpp"
#include "io/staging_pool.hpp"
#include "models/hooks.hpp"
#include "models/model.hpp"
#include "models/postprocess.hpp"
#include "models/quant.hpp"
#include "runtime/cache.hpp"
#include "runtime/load_work.hpp"
#include "runtime/metrics.hpp"
#include "runtime/metrics_server.hpp"
#include "runtime/plan_report.hpp"
#include "runtime/presharded.hpp"
#include "runtime/sglang_presharded.hpp"
#include "runtime/sharded_state.hpp"
#include "runtime/trace.hpp"

namespace ferry::runtime {

std::uint64_t peak_rss_bytes() {
  struct rusage usage {};
  if (getrusage(RUSAGE_SELF, &usage) != 0) {
    return 0;
  }
  return static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

namespace {

// Lets go of the descriptors kept since resolve for the files the plan reads
// nothing of (another pipeline rank's layers, unmapped or dropped tensors): a
// checkpoint of thousands of shards must not hold them all for the whole load.
void close_unread_files(const actors::Plan& plan, io::CheckpointIndex& index) {
  std::vector<bool> read(index.files.size(), false);
  for (const actors::Span& s : plan.spans) {
    read[s.file] = true;
  }
  std::size_t closed = 0;
  for (std::size_t i = 0; i < index.files.size(); ++i) {
    if (!read[i] && index.files[i].file) {
      index.files[i].file.reset();
      ++closed;
    }
  }
  if (closed > 0) {
    log::debug("plan: closed " + std::to_string(closed) + " of " +
               std::to_string(index.files.size()) + " weight files it reads nothing of");
  }
}

bool running(RuntimeState s) {
  return s == RuntimeState::kLoading || s == RuntimeState::kPreparing ||
         s == RuntimeState::kCommitting || s == RuntimeState::kUpdating;
}

// The state of a handle whose load failed before it started (a call in the wrong
// state).
std::shared_ptr<LoadHandle::State> refused(const std::string& why) {
  auto state = std::make_shared<LoadHandle::State>();
  LoadResult r;
  r.error = to_info(Error(Stage::kConfig, "", "", why));
  state->finish(std::move(r));
  return state;
}
}  // namespace

// Makes a Runtime with test seams (make_runtime); a friend of Runtime.
struct RuntimeFactory {
  static std::unique_ptr<Runtime::Impl> impl(const Config& config, RuntimeTestSeams seams,
                                             std::shared_ptr<Allocator> allocator) {
    auto impl = std::make_unique<Runtime::Impl>();
    impl->config = config.load_config();
    // A cached load reads from disk, when it does, with cache.fallback_format.
    impl->cache = cache_mode(impl->config);
    const io::LoadFormat asked = impl->config.model.load_format;
    if (impl->cache != CacheConfig::Mode::kOff &&
        (asked == io::LoadFormat::kAuto || asked == io::LoadFormat::kIpcCache)) {
      impl->config = disk_config(impl->config);
    }
    if (asked == io::LoadFormat::kRemoteInstance) {
      impl->remote = true;
      impl->config.model.load_format =
          impl->config.remote.fallback_format.value_or(io::LoadFormat::kAuto);
    }
    impl->seams = std::move(seams);
    impl->allocator = std::move(allocator);
    impl->start_metrics();
    return impl;
  }
  static Runtime make(const Config& config, RuntimeTestSeams seams,
                      std::shared_ptr<Allocator> allocator) {
    return Runtime(impl(config, std::move(seams), std::move(allocator)));
  }
  static std::unique_ptr<Runtime> make_sharing(const Config& config, RuntimeTestSeams seams) {
    std::unique_ptr<Runtime::Impl> i = impl(config, std::move(seams), nullptr);
    i->share_devices = true;
    return std::unique_ptr<Runtime>(new Runtime(std::move(i)));
  }
  static std::shared_ptr<LoadedModel::State> last_state(Runtime& rt) {
    std::lock_guard lock(rt.impl_->mu);
    return rt.impl_->last_state.lock();
  }
  static std::shared_ptr<LoadMetrics> metrics(Runtime& rt) { return rt.impl_->current_metrics(); }
};

std::unique_ptr<Runtime> make_sharing_runtime(Config config, RuntimeTestSeams seams) {
  return RuntimeFactory::make_sharing(config, std::move(seams));
}
std::shared_ptr<LoadedModel::State> loaded_state(Runtime& runtime) {
  return RuntimeFactory::last_state(runtime);
}
std::shared_ptr<LoadMetrics> runtime_metrics(Runtime& runtime) {
  return RuntimeFactory::metrics(runtime);
}

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Runtime::Runtime(Config config, std::shared_ptr<Allocator> allocator)
    : Runtime(RuntimeFactory::impl(config, {}, std::move(allocator))) {}

Runtime make_runtime(Config config, RuntimeTestSeams seams, std::shared_ptr<Allocator> allocator) {
  return RuntimeFactory::make(config, std::move(seams), std::move(allocator));
}

void Runtime::Impl::start_metrics() {
  const MetricsConfig& m = config.metrics;
  if (m.listen.empty() && m.textfile.empty()) {
    return;
  }
  metrics = std::make_shared<LoadMetrics>(std::make_shared<prometheus::Registry>());
  if (m.listen.empty()) {
    return;
  }
  try {
    server = std::make_unique<MetricsServer>(m.listen);
    server->add(metrics->registry());
  } catch (const Error& e) {
    metrics_error = e;  // its thread refused: resources
  } catch (const std::exception& e) {
    // Every load then fails with this (a constructor that never throws).
    metrics_error = Error(Stage::kConfig, "", "",
                          "metrics.listen: cannot serve metrics on " + m.listen + ": " + e.what());
  }
}

void use_registry(Runtime& runtime, std::shared_ptr<prometheus::Registry> registry) {
  if (!registry) {
    return;
  }
  Runtime::Impl& impl = *runtime.impl_;
  auto metrics = std::make_shared<LoadMetrics>(std::move(registry));
  std::lock_guard lock(impl.mu);
  if (impl.server) {
    impl.server->add(metrics->registry());
  }
  impl.metrics = std::move(metrics);
}

std::vector<int> metrics_ports(const Runtime& runtime) {
  std::lock_guard lock(runtime.impl_->mu);
  return runtime.impl_->server ? runtime.impl_->server->ports() : std::vector<int>{};
}

Runtime::~Runtime() {
  std::thread worker;
  std::shared_ptr<LoadWork> prepared;
  {
    std::lock_guard lock(impl_->mu);
    if (auto running = impl_->current.lock()) {
      running->cancel.store(true);
    }
    worker = std::move(impl_->worker);
    prepared = std::move(impl_->prepared);
  }
  // Joined without the lock: a callback of the ending load may call cancel().
  if (worker.joinable()) {
    worker.join();
  }
  prepared.reset();  // stops its prefetch
}

RuntimeState Runtime::state() const {
  std::lock_guard lock(impl_->mu);
  return impl_->status;
}

void Runtime::cancel() {
  std::shared_ptr<LoadWork> prepared;  // dropped (its prefetch stopped) after the lock
  std::lock_guard lock(impl_->mu);
  if (running(impl_->status)) {
    if (auto current = impl_->current.lock()) {
      current->cancel.store(true);
    }
  } else if (impl_->status == RuntimeState::kPrepared) {
    log::warn(
        "startup cancelled while prepared: the prefetch stops; the prepared model stays "
        "valid until it is released");
    prepared = std::move(impl_->prepared);
    impl_->status = RuntimeState::kFailed;
  }
}

LoadHandle Runtime::Impl::launch(RuntimeState running_state, RuntimeState success,
                                 LoadCallbacks callbacks, Body body, std::shared_ptr<LoadWork> keep,
                                 bool is_update) {
  if (running(status)) {
    return LoadHandle(refused(
        "a load is already running on this Runtime; wait for it (or cancel it) before "
        "starting another"));
  }
  auto handle = std::make_shared<LoadHandle::State>();
  handle->is_update = is_update;
  handle->on_cache_lost = callbacks.on_cache_lost;
  if (worker.joinable()) {
    worker.join();  // the previous load has ended (it set the state): its thread is ending
  }
  try {
    worker = start_thread("load", [this, handle, cb = std::move(callbacks), body = std::move(body),
                                   success, keep = std::move(keep), sink = log_sink]() mutable {
      // Every thread of the load inherits it: the pipeline's, the prefetcher's, the
      // per-rank allocations', the layer notifier's.
      const log::ScopedSink scope(std::move(sink));
      run(*handle, cb, body, success, keep);
      body = nullptr;  // the work it holds goes before the thread ends
      keep.reset();
    });
  } catch (const Error& e) {
    // The load never ran; what it would have used (a commit's prepared model) went
    // with the thread's function.
    status = RuntimeState::kFailed;
    LoadResult r;
    r.error = to_info(e);
    handle->finish(std::move(r));
    if (std::shared_ptr<LoadMetrics> m = metrics) {
      m->record_error(e.stage());
    }
    return LoadHandle(handle);
  }
  status = running_state;
  current = handle;
  return LoadHandle(handle);
}

void Runtime::set_log_sink(log::Sink sink) {
  std::lock_guard lock(impl_->mu);
  impl_->log_sink = sink ? std::make_shared<const log::Sink>(std::move(sink)) : nullptr;
}

LoadHandle Runtime::start(LoadCallbacks callbacks) {
  std::lock_guard lock(impl_->mu);
  if (impl_->status == RuntimeState::kPrepared) {
    return LoadHandle(
        refused("a prepared model waits for commit() (or cancel()); start() refused"));
  }
  return impl_->launch(
      RuntimeState::kLoading, RuntimeState::kReady, std::move(callbacks),
      [impl = impl_.get()](LoadHandle::State& h) { return impl->load(h); }, nullptr);
}

LoadHandle Runtime::prepare(LoadCallbacks callbacks) {
  std::lock_guard lock(impl_->mu);
  if (impl_->status == RuntimeState::kPrepared) {
    return LoadHandle(
        refused("a prepared model waits for commit() (or cancel()); prepare() refused"));
  }
  auto work = std::make_shared<LoadWork>();
  return impl_->launch(
      RuntimeState::kPreparing, RuntimeState::kPrepared, std::move(callbacks),
      [impl = impl_.get(), w = work.get()](LoadHandle::State& h) { return impl->prepare(*w, h); },
      work);
}

LoadHandle Runtime::commit(LoadCallbacks callbacks) {
  std::lock_guard lock(impl_->mu);
  if (impl_->status != RuntimeState::kPrepared && !running(impl_->status)) {
    return LoadHandle(
        refused("commit() needs a prepared model (call prepare() first); the runtime is " +
                std::string(to_string(impl_->status))));
  }
  std::shared_ptr<LoadWork> work = running(impl_->status) ? nullptr : std::move(impl_->prepared);
  return impl_->launch(
      RuntimeState::kCommitting, RuntimeState::kReady, std::move(callbacks),
      [impl = impl_.get(), work](LoadHandle::State& h) {
        try {
          return impl->commit(*work, h);
        } catch (...) {
          h.keep_alive = work->loaded;  // graphs may point at it
          throw;
        }
      },
      nullptr);
}

LoadHandle Runtime::start_update(UpdateSource source, LoadCallbacks callbacks) {
  std::lock_guard lock(impl_->mu);
  if (running(impl_->status)) {
    return LoadHandle(refused(
        "update refused: running: a load or update is running on this Runtime; wait for it"));
  }
  if (impl_->status == RuntimeState::kPrepared) {
    return LoadHandle(refused(
        "update refused: prepared: a prepared model waits for commit() (or cancel()); an update "
        "writes a committed model"));
  }
  std::shared_ptr<LoadedModel> model = impl_->last_model.lock();
  std::shared_ptr<LoadedModel::State> state = impl_->last_state.lock();
  if (!model || !state) {
    return LoadHandle(
        refused("update refused: no_model: this Runtime holds no loaded model to update (load() or "
                "commit() first, and keep its result)"));
  }
  if (state->cache) {
    return LoadHandle(refused(
        "update refused: ipc_cache: the model's parameters are a weight-cache daemon's shared "
        "memory, which no client may write; update the checkpoint and restart `ferry serve`"));
  }
  return impl_->launch(
      RuntimeState::kUpdating, RuntimeState::kReady, std::move(callbacks),
      [impl = impl_.get(), source = std::move(source), model, state](LoadHandle::State& h) {
        return impl->update(source, model, state, h);
      },
      nullptr, /*is_update=*/true);
}

LoadResult Runtime::update(UpdateSource source) {
  return start_update(std::move(source)).wait();
}

LoadResult Runtime::load() {
  LoadHandle handle = start();
  LoadResult r = handle.wait();
  // Join this load's thread, so that once the caller drops the result nothing of the
  // load is left (the thread's reference to the state goes with it). Joined without
  // the lock, which a callback of the ending load may want for cancel().
  std::thread worker;
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->current.lock() == handle.state_ && !running(impl_->status)) {
      worker = std::move(impl_->worker);
    }
  }
  if (worker.joinable()) {
    worker.join();
  }
  return r;
}

void Runtime::Impl::run(LoadHandle::State& handle, const LoadCallbacks& callbacks, const Body& body,
                        RuntimeState success, const std::shared_ptr<LoadWork>& keep) {
  std::unique_ptr<CallbackThread> notifier;
  LoadResult r;
  try {
    if (callbacks.on_progress || callbacks.on_layer_ready) {
      notifier = std::make_unique<CallbackThread>(callbacks, handle);  // may fail: kResources
      handle.callbacks = notifier.get();
    }
    r = body(handle);
  } catch (const Error& e) {
    r.error = to_info(e);
  } catch (const std::exception& e) {
    r.error = to_info(unexpected_error(handle.phase.load(), e.what()));
  } catch (...) {
    // Last resort: something (an engine's Allocator, a hook) threw what is not a
    // std::exception. Escaping this thread would std::terminate the engine.
    r = LoadResult{};
    r.error = to_info(
        unexpected_error(handle.phase.load(), "an exception that is not a std::exception"));
  }
  if (notifier) {
    // The callbacks see the end (a last progress in its final phase) before wait().
    handle.phase.store(r ? LoadPhase::kDone : LoadPhase::kFailed);
    if (std::optional<std::string> threw = notifier->stop()) {
      r = LoadResult{};
      r.error =
          to_info(Error(Stage::kCancelled, "", "", "a LoadCallbacks callback failed: " + *threw));
    }
    handle.callbacks = nullptr;
  }
  {
    // Under the lock that Runtime::cancel() takes: a cancel that came while the load
    // was running is never lost, even one that came after its last check.
    std::lock_guard lock(mu);
    // An update's bytes are all written by now: a cancel this late leaves it applied.
    if (r && handle.cancel.load() && !handle.is_update) {
      if (status == RuntimeState::kCommitting) {
        handle.keep_alive = r.model;  // a commit's storage outlives its cancel
      }
      r = LoadResult{};
      r.error = to_info(Error(Stage::kCancelled, "", "", "the load was cancelled"));
    }
    status = r ? success : RuntimeState::kFailed;
    if (r && keep) {
      prepared = keep;
    }
  }
  if (std::shared_ptr<LoadMetrics> m = current_metrics()) {
    // A load or a commit that ended well is recorded; a prepared startup is not yet.
    if (r && success == RuntimeState::kReady && !handle.is_update) {
      m->record_load(r.model->report(), std::filesystem::path(config.model.path).filename());
    } else if (!r) {
      m->record_error(r.error->stage);
    }
    if (!config.metrics.textfile.empty() && success != RuntimeState::kPrepared) {
      try {
        m->write_textfile(config.metrics.textfile);
      } catch (const Error& e) {
        log::warn(e.what());
      }
    }
  }
  handle.finish(std::move(r));
}

void Runtime::Impl::resolve_and_plan(LoadWork& w, LoadHandle::State& handle, const LoadConfig& c,
                                     const ModelAdapter& adapt) {
  LoadReport& report = w.report;
  if (metrics_error) {
    throw *metrics_error;
  }
  // A Config set call by call leaves these to the load (ConfigBuilder::Rules).
  if (std::optional<BrokenRule> broken = broken_load_rule(c)) {
    throw Error(Stage::kConfig, "", "", broken->rule);
  }
  if (!c.trace.path.empty() && !w.trace) {
    w.trace = std::make_shared<TraceRecorder>();
  }

  // ---- resolve
  handle.phase.store(LoadPhase::kResolve);
  if (seams.in_resolve) {
    seams.in_resolve();
  }
  // Once per process: a checkpoint of thousands of shards keeps a descriptor per
  // shard (build_checkpoint_index still checks that its files fit).
  io::raise_open_file_limit();
  // Shared with `ferry plan` (runtime/plan_report.hpp).
  w.resolved = resolve_checkpoint(c);
  report.files = w.resolved.index.files.size();
  // After what came before the resolve (a weight cache's fallback says why it read).
  report.warnings.insert(report.warnings.end(), w.resolved.warnings.begin(),
                         w.resolved.warnings.end());
  if (w.resolved.presharded || w.resolved.stored_format == kSglangPresharded) {
    report.load_format = "presharded";
    report.presharded_read = w.resolved.source.folder;
  }
  if (w.resolved.stored_format == kShardedState) {
    report.load_format = "sharded_state";
    report.sharded_state_read = w.resolved.source.folder;
  }
  handle.check_cancel();
  w.resolved_at = Clock::now();
  w.span("resolve", w.begin, w.resolved_at);

  // ---- plan
  handle.phase.store(LoadPhase::kPlan);
  // The layout and model options from the config (shared with `ferry plan`).
  w.model = make_configured_model(c, w.resolved);
  if (seams.wrap_model) {
    w.model = seams.wrap_model(w.model);
    if (!w.model) {
      throw Error(Stage::kConfig, "", "", "RuntimeTestSeams::wrap_model returned no model");
    }
  }
  if (adapt) {
    w.model = adapt(std::move(w.model), w.resolved);
  }
  for (const std::string& note : w.model->notes()) {
    log::warn(note);
    report.warnings.push_back(note);
  }
  {
    std::string warning;
    report.postprocess_target = std::string(models::to_string(resolve_target(c, &warning)));
    if (!warning.empty()) {
      log::warn(warning);
      report.warnings.push_back(warning);
    }
  }
  actors::PlanOptions plan_options;
  plan_options.chunk_bytes = c.io.chunk_bytes;
  plan_options.direct = c.io.direct;
  if (c.model.load_format != io::LoadFormat::kDummy) {
    w.plan = actors::make_plan(w.resolved.index, *w.model, plan_options, w.resolved.source.folder);
    close_unread_files(w.plan, w.resolved.index);
  }
  report.tensors.placed = w.plan.placed;
  report.tensors.dropped = w.plan.dropped;
  report.tensors.unmapped = w.plan.unmapped;
  report.bytes_skipped = w.plan.bytes_skipped;
  report.bytes_skipped_by_reason = w.plan.bytes_skipped_by_reason;
  if (w.plan.unmapped > 0) {
    std::string warning = std::to_string(w.plan.unmapped) +
                          " checkpoint tensor(s) map to no parameter of " + w.model->family() +
                          " and were not read (load.strict makes this an error): " +
                          join_first(w.plan.unmapped_names, 20);
    log::warn(warning);
    report.warnings.push_back(warning);
  }
  handle.check_cancel();
  w.planned_at = Clock::now();
  w.span("plan", w.resolved_at, w.planned_at);
}
actors::PipelineInput Runtime::Impl::pipeline_input(LoadWork& w) const {
  const LoadConfig& c = config;
  const auto& shells = w.model->shells();
  actors::PipelineInput input;
  input.index = &w.resolved.index;
  input.model = w.model.get();
  input.plan = &w.plan;
  for (std::size_t r = 0; r < shells.size(); ++r) {
    actors::RankTarget& target = input.ranks.emplace_back();
    target.device = w.state->devices[r];
    for (const LoadedParam& p : w.state->ranks[r].params) {
      target.params.push_back(p.data);
    }
  }
  input.options.io = c.io;
  input.options.prefetch = c.prefetch;
  // Auto staging and lanes follow the devices' link (io_auto).
  const IoAuto io = io_auto(c.devices.kind, shells.size());
  if (c.io.staging_bytes == 0) {
    input.options.io.staging_bytes = io.staging_bytes;
  }
  input.options.max_auto_lanes = io.max_lanes;
  // A presharded folder is a few large files by design (one a rank, up to
  // save.max_file_bytes): lanes share a file there (docs/PERFORMANCE.md, presharded:
  // one lane reads a 2.2 GB part at 0.73 of `cat`, two at 0.96).
  input.options.lanes_follow_files = io.lanes_follow_files && !w.resolved.presharded;
  input.options.poison_staging = c.host.deferred_copies;
  input.release_staging_early = seams.release_staging_early;
  input.staging_allocator = seams.staging_allocator;
  if (!input.staging_allocator) {
    for (const auto& d : w.state->devices) {
      if (d->name().rfind("cuda", 0) == 0) {
        input.staging_allocator = pinned_staging_allocator(d);
        input.staging_allocator_on_node = [d](int node) {
          return pinned_staging_allocator(d, node);
        };
        break;
      }
    }
  }
  return input;
}

actors::PipelineInput Runtime::Impl::stream_input(LoadWork& w, LoadHandle::State& handle) {
  const LoadConfig& c = config;
  actors::PipelineInput input = pipeline_input(w);
  input.prepared = w.resources;  // prepare()'s, in overlap mode
  input.faults = seams.faults;
  input.before_copy = seams.before_copy;
  input.fault_point = seams.fault_point;
  input.cancel = &handle.cancel;
  input.progress = &handle.pipeline;
  if (CallbackThread* cb = handle.callbacks) {
    cb->set_layers(w.model->shells());
    input.on_param_complete = [cb](std::size_t rank, std::size_t param) {
      cb->param_complete(rank, param);
    };
  }
  input.reallocate = [this, &w](std::size_t rank, std::size_t param) {
    return reallocate(w, rank, param);
  };
  if (c.load.layered) {
    // Load-only params: allocated on their first write and freed after their last
    // hook, by their rank's copy worker.
    input.options.io.direct_to_device = io::DirectToDevice::kOff;
    input.allocate_transient = [this, &w](std::size_t rank, std::size_t param) {
      const models::ParamSpec& spec = w.model->shells().at(rank).params.at(param);
      std::lock_guard lock(w.state_mu);
      LoadedModel::State& state = *w.state;
      state.storage.at(rank).at(param) = allocate_param(nullptr, *state.devices.at(rank), spec);
      std::byte* data = state.storage[rank][param].data();
      state.ranks.at(rank).params.at(param).data = data;
      return data;
    };
    input.release_transient = [&w](std::size_t rank, std::size_t param) {
      std::lock_guard lock(w.state_mu);
      w.state->storage.at(rank).at(param).reset();
      w.state->ranks.at(rank).params.at(param).data = nullptr;
    };
  }
  std::vector<io::ReadObserver> readers;
  if (w.metrics) {
    readers.push_back(w.metrics->read_observer());
    input.on_staging = w.metrics->staging_observer();
  }
  if (w.trace) {
    readers.push_back(w.trace->read_observer());
    input.on_prefetch_block = w.trace->prefetch_observer();
    input.on_hook = w.trace->hook_observer();
  }
  if (!readers.empty() || seams.wrap_reader) {
    input.wrap_reader = [readers, wrap = seams.wrap_reader](std::unique_ptr<io::Reader> reader) {
      for (const io::ReadObserver& o : readers) {
        reader = std::make_unique<io::MeteredReader>(std::move(reader), o);
      }
      return wrap ? wrap(std::move(reader)) : std::move(reader);
    };
  }
  return input;
}

namespace {

// The verify phase: every param written exactly once over (the bytes the pipeline
// landed in each, against its size).
void verify_landed(const LoadWork& w, const actors::PipelineResult& streamed) {
  const auto& shells = w.model->shells();
  std::vector<std::string> short_params;
  for (std::size_t r = 0; r < shells.size(); ++r) {
    for (std::size_t p = 0; p < shells[r].params.size(); ++p) {
      std::uint64_t landed =
          r < streamed.landed.size() && p < streamed.landed[r].size() ? streamed.landed[r][p] : 0;
      if (landed != shells[r].params[p].nbytes) {
        short_params.push_back(shells[r].params[p].name + " (tp rank " +
                               std::to_string(shells[r].tp_rank) + ": " + std::to_string(landed) +
                               " of " + std::to_string(shells[r].params[p].nbytes) + " bytes)");
      }
    }
  }
  if (!short_params.empty()) {
    throw Error(Stage::kVerify, w.resolved.source.folder, "",
                std::to_string(short_params.size()) +
                    " parameter(s) not completely written: " + join_first(short_params, 20));
  }
}

}  // namespace

void Runtime::Impl::stream(LoadWork& w, LoadHandle::State& handle) {
  LoadReport& report = w.report;
  handle.bytes_planned.store(w.plan.bytes_planned);
  handle.tensors_placed.store(w.plan.placed);
  const Clock::time_point t_begin = Clock::now();

  // ---- stream (+ postprocess)
  handle.phase.store(LoadPhase::kStream);
  actors::PipelineInput input = stream_input(w, handle);
  actors::PipelineResult streamed = actors::run_pipeline(input);
  report.bytes_read = w.resolved.index.header_bytes_read + streamed.bytes_read;
  report.bytes_copied = streamed.bytes_copied;
  report.bytes_prefetched += streamed.bytes_prefetched;
  report.staging_high_water_bytes = streamed.staging_high_water_bytes;
  report.staging_bytes = streamed.staging_bytes;
  report.read_lanes = streamed.read_lanes;
  report.read_paths.direct_to_device += streamed.bytes_direct;
  report.read_paths.staged += streamed.bytes_staged;
  if (streamed.error && streamed.staging_buffers_leaked != 0) {
    // Said in the error, so the caller knows how much host memory stays behind.
    const Error& e = *streamed.error;
    throw Error(e.stage(), e.file(), e.tensor(),
                e.rule() + "; " + std::to_string(streamed.staging_buffers_leaked) +
                    " staging buffer(s) left to reads still in flight after "
                    "io.cancel_timeout_ms (leaked on purpose, never freed under the kernel)");
  }
  if (streamed.error) {
    throw *streamed.error;  // the caller drops the work (and every allocation)
  }
  if (streamed.staging_buffers_leased_at_end != 0) {
    throw Error(Stage::kStaging, "", "",
                "internal: " + std::to_string(streamed.staging_buffers_leased_at_end) +
                    " staging buffer(s) still leased after the pipeline stopped");
  }
  const Clock::time_point t_streamed = Clock::now();

  // ---- verify: every param written exactly once over
  handle.phase.store(LoadPhase::kVerify);
  verify_landed(w, streamed);
  const Clock::time_point t_verified = Clock::now();
  w.span("stream", t_begin, t_streamed);
  w.span("verify", t_streamed, t_verified);

  report_stream(w, streamed.stream_seconds, t_begin, t_streamed, t_verified);
}

void Runtime::Impl::report_stream(LoadWork& w, double stream_seconds, Clock::time_point t_begin,
                                  Clock::time_point t_streamed,
                                  Clock::time_point t_verified) const {
  LoadReport& report = w.report;
  report.phases.resolve = seconds_between(w.begin, w.resolved_at);
  report.phases.plan = seconds_between(w.resolved_at, w.planned_at);
  report.phases.allocate = seconds_between(w.planned_at, w.allocated_at);
  const double pipeline = seconds_between(t_begin, t_streamed);
  report.phases.stream = std::min(stream_seconds, pipeline);
  report.phases.postprocess = pipeline - report.phases.stream;
  report.phases.verify = seconds_between(t_streamed, t_verified);
  report.seconds = report.phases.resolve + report.phases.plan + report.phases.allocate +
                   report.phases.stream + report.phases.postprocess + report.phases.verify;
  report.gbps = report.phases.stream > 0
                    ? static_cast<double>(report.bytes_read) / report.phases.stream / 1e9
                    : 0;
  report.hooks_skipped.clear();
  for (const models::PostLoadHook& hook : w.model->hooks()) {
    const gpu::Device& device = *w.state->devices.at(hook.local_rank);
    if (!device.holds_data()) {  // the copy workers checked its params and skipped it
      report.hooks_skipped.push_back(hook.name + " on " + device.name());
    }
  }
  report.peak_rss_bytes = peak_rss_bytes();
  std::map<std::string, std::uint64_t>& owned = report.host_bytes_owned_by;
  owned.clear();
  owned["staging"] = report.staging_bytes;
  owned["index"] = w.resolved.index.bytes_owned();
  owned["plan"] = w.plan.bytes_owned();
  owned["prefetch"] = config.prefetch.enabled
                          ? std::uint64_t{config.prefetch.threads} * config.prefetch.block_bytes
                          : 0;
  // One chunk (plus an alignment block) per read in flight, per lane, O_DIRECT only.
  owned["bounce"] = config.io.direct ? std::uint64_t{report.read_lanes} * config.io.queue_depth *
                                           (config.io.chunk_bytes + io::kDirectAlignment)
                                     : 0;
  report.host_bytes_owned = 0;
  for (const auto& [part, bytes] : owned) {
    report.host_bytes_owned += bytes;
  }
}

void Runtime::Impl::write_trace(LoadWork& w) noexcept {
  if (!w.trace) {
    return;
  }
  try {
    for (auto& [name, begin, end] : w.spans) {
      w.trace->complete("runtime", name, begin, end);
    }
    w.spans.clear();
    w.trace->write(config.trace.path);
  } catch (const std::exception& e) {
    log::write_built(
        log::Level::kWarn, [&] { return std::string("trace: ") + e.what(); },
        "trace: could not be written");
  }
}

LoadResult Runtime::Impl::load(LoadHandle::State& handle) {
  LoadWork w;
  TraceOnExit trace{*this, w};
  if (cache != CacheConfig::Mode::kOff && attach_cache(w, handle)) {
    return attached(w);
  }
  if (remote && pull_remote(w, handle)) {
    return attached(w);
  }
  resolve_and_plan(w, handle, config);
  make_devices(w);
  allocate(w, handle);
  load_all(w, handle);
  finish_restart_layouts(w, handle);
  w.state->report = w.report;
  LoadResult result;
  result.model = std::make_shared<LoadedModel>(w.state);
  record_origin(w, result.model);
  return result;
}
void Runtime::Impl::run_hooks_once(LoadWork& w, LoadHandle::State& handle,
                                   const std::string& what) {
  LoadedModel::State& state = *w.state;
  w.report.hooks_skipped.clear();
  const models::HookObserver observer = w.trace ? w.trace->hook_observer() : models::HookObserver{};
  const std::vector<models::PostLoadHook> model_hooks = w.model->hooks();
  // Each rank's hook scratch (the largest any of its hooks declares), made before
  // the first hook runs, as the copy workers make theirs.
  std::vector<gpu::DeviceAllocation> scratch(state.devices.size());
  {
    std::vector<std::size_t> need(state.devices.size(), 0);
    for (const models::PostLoadHook& hook : model_hooks) {
      need.at(hook.local_rank) = std::max(need.at(hook.local_rank), hook.scratch_bytes);
    }
    for (std::size_t r = 0; r < need.size(); ++r) {
      if (need[r] != 0 && state.devices[r]->holds_data()) {
        scratch[r] = state.devices[r]->allocate(need[r]);
      }
    }
  }
  for (const models::PostLoadHook& hook : model_hooks) {
    handle.check_cancel();
    gpu::Device& device = *state.devices.at(hook.local_rank);
    if (!device.holds_data()) {
      w.report.hooks_skipped.push_back(hook.name + " on " + device.name());
      continue;
    }
    auto stream = device.create_stream();
    std::vector<std::byte*> params;
    for (const LoadedParam& p : state.ranks.at(hook.local_rank).params) {
      params.push_back(p.data);
    }
    models::ParamsHookContext context(
        hook, params, *stream, device.name(),
        [this, &w, r = hook.local_rank](std::size_t param) { return reallocate(w, r, param); },
        {scratch[hook.local_rank].data(), scratch[hook.local_rank].size()});
    try {
      models::run_hook(hook, context, observer);
      stream->synchronize();
    } catch (const std::exception& e) {
      throw Error(Stage::kPostProcess, device.name(), "",
                  "post-load hook '" + hook.name + "' failed on " + what + ": " + e.what());
    }
  }
}

void Runtime::Impl::finish_restart_layouts(LoadWork& w, LoadHandle::State& handle) {
  const LoadConfig& c = config;
  if (w.resolved.presharded && c.load.verify_checksums) {
    handle.check_cancel();
    const Clock::time_point t = Clock::now();
    verify_presharded(*w.state, *w.resolved.presharded, w.resolved.presharded_manifest_file);
    w.report.checksums_verified = true;
    w.span("verify_checksums", t, Clock::now());
  } else if (w.resolved.stored_format == kSglangPresharded && c.load.verify_checksums) {
    handle.check_cancel();
    const Clock::time_point t = Clock::now();
    verify_sglang_presharded(*w.state, w.resolved, c);
    w.report.checksums_verified = true;
    w.span("verify_checksums", t, Clock::now());
  }
  if (wants_presharded_save(c, w.resolved)) {
    handle.check_cancel();
    const Clock::time_point t = Clock::now();
    try {
      w.report.presharded_saved =
          save_presharded(*w.state, c, w.resolved.hf_config, c.load.save_presharded);
    } catch (const Error& e) {
      const std::string warning =
          std::string("load.save_presharded: the load succeeded, the save failed: ") + e.what();
      log::warn(warning);
      w.report.warnings.push_back(warning);
    }
    w.span("save_presharded", t, Clock::now());
  }
  if (!c.load.save_sharded_state.empty()) {
    handle.check_cancel();
    const Clock::time_point t = Clock::now();
    try {
      w.report.sharded_state_saved = save_sharded_state(
          *w.state, c, w.resolved.hf_config, w.resolved.source.folder, c.load.save_sharded_state);
    } catch (const Error& e) {
      const std::string warning =
          std::string("load.save_sharded_state: the load succeeded, the save failed: ") + e.what();
      log::warn(warning);
      w.report.warnings.push_back(warning);
    }
    w.span("save_sharded_state", t, Clock::now());
  }
}

void Runtime::Impl::fill_dummy(LoadWork& w, LoadHandle::State& handle) {
  LoadReport& report = w.report;
  LoadedModel::State& state = *w.state;
  const auto& shells = w.model->shells();
  report.load_format = "dummy";
  handle.phase.store(LoadPhase::kStream);
  const Clock::time_point t_begin = Clock::now();
  std::vector<std::vector<bool>> hook_output(shells.size());
  for (std::size_t r = 0; r < shells.size(); ++r) {
    hook_output[r].assign(shells[r].params.size(), false);
  }
  for (const models::PostLoadHook& h : w.model->hooks()) {
    for (std::size_t out : h.outputs) {
      hook_output.at(h.local_rank).at(out) = true;
    }
  }
  // A rank a thread, as the allocation: each fill is one kernel on its device.
  std::vector<std::uint64_t> filled(shells.size(), 0);
  run_each("dummy fill rank", shells.size(), [&](std::size_t r) {
    gpu::Device& device = *state.devices[r];
    device.bind();
    auto stream = device.create_stream();
    for (std::size_t i = 0; i < shells[r].params.size(); ++i) {
      const models::ParamSpec& spec = shells[r].params[i];
      const LoadedParam& p = state.ranks[r].params[i];
      if (hook_output[r][i] || spec.nbytes == 0 || handle.cancel.load()) {
        continue;
      }
      const models::DummyRange range = models::dummy_range(spec);
      if (range.random) {
        // Each param's own seed (the config's and its name): replicated params agree
        // across ranks, and the values do not depend on the order params are filled.
        const std::uint64_t seed = splitmix64(config.model.dummy_seed ^ fnv1a64(spec.name));
        stream->fill_random(p.data, spec.nbytes / dtype_size(spec.dtype), spec.dtype, range.low,
                            range.high, seed);
      } else {
        stream->zero(p.data, spec.nbytes);
      }
      filled[r] += spec.nbytes;
    }
    stream->synchronize();
  });
  handle.check_cancel();
  const Clock::time_point t_filled = Clock::now();
  run_hooks_once(w, handle, "the dummy weights");
  const Clock::time_point t_hooks = Clock::now();
  w.span("dummy fill", t_begin, t_filled);
  w.span("postprocess", t_filled, t_hooks);
  report.bytes_copied = 0;
  for (std::uint64_t b : filled) {
    report.bytes_copied += b;
  }
  report.phases.resolve = seconds_between(w.begin, w.resolved_at);
  report.phases.plan = seconds_between(w.resolved_at, w.planned_at);
  report.phases.allocate = seconds_between(w.planned_at, w.allocated_at);
  report.phases.stream = seconds_between(t_begin, t_filled);
  report.phases.postprocess = seconds_between(t_filled, t_hooks);
  report.seconds = report.phases.resolve + report.phases.plan + report.phases.allocate +
                   report.phases.stream + report.phases.postprocess;
  report.peak_rss_bytes = peak_rss_bytes();
}

}  // namespace ferry::runtime
