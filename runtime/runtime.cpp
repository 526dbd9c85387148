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
#include "runtime/runtime.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "actors/pipeline.hpp"
#include "actors/plan.hpp"
#include "common/log.hpp"
#include "gpu/backends.hpp"
#include "gpu/device.hpp"
#include "io/discover.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_writer.hpp"
#include "io/staging_pool.hpp"
#include "models/model.hpp"
#include "runtime/plan_report.hpp"
#include "runtime/runtime_internal.hpp"

namespace ferry::runtime {

struct LoadedModel::State {
  std::vector<std::shared_ptr<gpu::Device>> devices;        // per local rank
  std::vector<std::vector<gpu::DeviceAllocation>> storage;  // [rank][param]; freed first
  std::vector<LoadedRank> ranks;
  LoadReport report;
};

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::uint64_t peak_rss_bytes() {
  struct rusage usage {};
  if (getrusage(RUSAGE_SELF, &usage) != 0) {
    return 0;
  }
  return static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

ErrorInfo to_info(const Error& e) {
  return ErrorInfo{e.stage(), e.file(), e.tensor(), e.rule(), e.what()};
}

// Staging memory that CUDA copies read without staging it again: pinned host
// memory of a CUDA device (portable, so every device's copies may use it).
class PinnedStagingAllocator final : public io::BufferAllocator {
 public:
  explicit PinnedStagingAllocator(std::shared_ptr<gpu::Device> device)
      : device_(std::move(device)) {}

  void* allocate(std::size_t bytes, std::size_t alignment) override {
    if (alignment > gpu::kPinnedAlignment) {
      return nullptr;
    }
    gpu::PinnedAllocation a = device_->allocate_pinned(bytes);
    void* p = a.data();
    std::lock_guard lock(mu_);
    live_.emplace(p, std::move(a));
    return p;
  }
  void deallocate(void* p, std::size_t /*bytes*/) noexcept override {
    std::lock_guard lock(mu_);
    live_.erase(p);
  }
  std::string name() const override { return "pinned memory of " + device_->name(); }

 private:
  std::shared_ptr<gpu::Device> device_;
  std::mutex mu_;
  std::map<void*, gpu::PinnedAllocation> live_;
};

bool contiguous(const LoadedParam& p) {
  std::uint64_t expect = 1;
  for (std::size_t i = p.shape.size(); i-- > 0;) {
    if (p.shape[i] != 1 && p.strides[i] != expect) {
      return false;
    }
    expect *= p.shape[i];
  }
  return true;
}

std::string join_names(const std::vector<std::string>& names, std::size_t limit) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < limit; ++i) {
    out += (i ? ", " : "") + names[i];
  }
  if (names.size() > limit) {
    out += " and " + std::to_string(names.size() - limit) + " more";
  }
  return out;
}

}  // namespace

// ---- LoadedRank / LoadedModel ----------------------------------------------------

const LoadedParam* LoadedRank::find(const std::string& name) const {
  auto it = std::lower_bound(params.begin(), params.end(), name,
                             [](const LoadedParam& p, const std::string& n) { return p.name < n; });
  return it != params.end() && it->name == name ? &*it : nullptr;
}

LoadedModel::LoadedModel(std::shared_ptr<State> state) : state_(std::move(state)) {}

const std::vector<LoadedRank>& LoadedModel::ranks() const {
  return state_->ranks;
}

const LoadReport& LoadedModel::report() const {
  return state_->report;
}

namespace {

// read_param and dump need parameter bytes, which a null device does not keep.
void require_data(const gpu::Device& device, const std::string& what) {
  if (!device.holds_data()) {
    throw Error(Stage::kConfig, device.name(), "",
                what + ": this device keeps no parameter data (a null device)");
  }
}

}  // namespace

std::vector<std::byte> LoadedModel::read_param(std::size_t rank_index,
                                               const std::string& name) const {
  if (rank_index >= state_->ranks.size()) {
    throw Error(Stage::kConfig, "", name,
                "read_param: local rank " + std::to_string(rank_index) + " does not exist (" +
                    std::to_string(state_->ranks.size()) + " local ranks)");
  }
  const LoadedRank& rank = state_->ranks[rank_index];
  const LoadedParam* p = rank.find(name);
  if (p == nullptr) {
    throw Error(Stage::kConfig, rank.device, name, "read_param: no such parameter");
  }
  require_data(*state_->devices[rank_index], "read_param");
  std::vector<std::byte> out(p->nbytes);
  auto stream = state_->devices[rank_index]->create_stream();
  stream->copy_d2h(out.data(), p->data, p->nbytes);
  stream->synchronize();
  return out;
}

void LoadedModel::dump(const std::string& dir) const {
  namespace fs = std::filesystem;
  for (const auto& device : state_->devices) {
    require_data(*device, "dump");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw Error(Stage::kConfig, dir, "", "cannot create the dump folder: " + ec.message());
  }
  constexpr std::size_t kBlock = std::size_t{16} << 20;  // bounded host memory per copy
  for (std::size_t r = 0; r < state_->ranks.size(); ++r) {
    const LoadedRank& rank = state_->ranks[r];
    io::SafetensorsWriter writer(
        (fs::path(dir) / ("rank-" + std::to_string(rank.tp_rank) + ".safetensors")).string());
    writer.set_metadata({{"format", "pt"},
                         {"ferry.tp_rank", std::to_string(rank.tp_rank)},
                         {"ferry.device", rank.device}});
    for (const LoadedParam& p : rank.params) {
      writer.add(p.name, p.dtype, p.shape);
    }
    writer.begin();
    auto stream = state_->devices[r]->create_stream();
    std::vector<std::byte> buf;
    for (const LoadedParam& p : rank.params) {
      const std::size_t es = dtype_size(p.dtype);
      if (contiguous(p)) {
        std::uint64_t logical = es;
        for (std::uint64_t d : p.shape) {
          logical *= d;
        }
        for (std::uint64_t off = 0; off < logical; off += kBlock) {
          std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kBlock, logical - off));
          buf.resize(n);
          stream->copy_d2h(buf.data(), p.data + off, n);
          stream->synchronize();
          writer.write(buf);
        }
        continue;
      }
      // Strided storage (e.g. a transposed view): gather the logical order.
      std::vector<std::byte> all = read_param(r, p.name);
      std::vector<std::uint64_t> index(p.shape.size(), 0);
      std::uint64_t count = 1;
      for (std::uint64_t d : p.shape) {
        count *= d;
      }
      buf.clear();
      for (std::uint64_t i = 0; i < count; ++i) {
        std::uint64_t off = 0;
        for (std::size_t d = 0; d < index.size(); ++d) {
          off += index[d] * p.strides[d];
        }
        buf.insert(buf.end(), all.begin() + static_cast<std::ptrdiff_t>(off * es),
                   all.begin() + static_cast<std::ptrdiff_t>((off + 1) * es));
        for (std::size_t d = index.size(); d-- > 0;) {
          if (++index[d] < p.shape[d]) {
            break;
          }
          index[d] = 0;
        }
      }
      writer.write(buf);
    }
    writer.finish();
  }
}

// ---- Runtime ------------------------------------------------------------------------

namespace {

// `bytes` bytes of the engine's memory for `device`, tracked by the device and given
// back to the engine when the handle dies.
gpu::DeviceAllocation engine_allocation(const std::shared_ptr<Allocator>& allocator,
                                        gpu::Device& device, std::size_t bytes) {
  const std::string name = device.name();
  void* p = nullptr;
  try {
    p = allocator->allocate(name, bytes, gpu::kDeviceAlignment);
  } catch (const std::exception& e) {
    throw Error(Stage::kCopy, name, "", std::string("the engine's Allocator refused: ") + e.what());
  }
  if (p == nullptr) {
    throw Error(Stage::kCopy, name, "", "the engine's Allocator returned null");
  }
  auto give_back = [allocator, name](std::byte* data, std::size_t size) {
    allocator->release(name, data, size);
  };
  if (reinterpret_cast<std::uintptr_t>(p) % gpu::kDeviceAlignment != 0) {
    give_back(static_cast<std::byte*>(p), bytes);
    throw Error(Stage::kCopy, name, "",
                "the engine's Allocator returned memory not aligned to " +
                    std::to_string(gpu::kDeviceAlignment) + " bytes");
  }
  try {
    return device.adopt(static_cast<std::byte*>(p), bytes, give_back);
  } catch (...) {
    give_back(static_cast<std::byte*>(p), bytes);
    throw;
  }
}

}  // namespace

class CallbackThread;

// One load: its cancel flag, where it is, and (once it ends) its result.
struct LoadHandle::State {
  CallbackThread* callbacks = nullptr;  // set while the load runs, when it has any
  std::atomic<bool> cancel{false};
  std::atomic<LoadPhase> phase{LoadPhase::kStarting};
  std::atomic<std::uint64_t> bytes_planned{0};
  std::atomic<std::size_t> tensors_placed{0};
  actors::PipelineProgress pipeline;

  mutable std::mutex mu;
  mutable std::condition_variable cv;
  std::optional<LoadResult> result;  // set once, under mu

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

namespace {

LoadProgress snapshot(const LoadHandle::State& s) {
  LoadProgress p;
  p.phase = s.phase.load();
  p.bytes_planned = s.bytes_planned.load();
  p.bytes_read = s.pipeline.bytes_read.load();
  p.bytes_copied = s.pipeline.bytes_copied.load();
  p.tensors_placed = s.tensors_placed.load();
  return p;
}

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

// Runs one load's LoadCallbacks on a thread of its own. The pipeline only posts to
// it (param_complete takes a short lock and returns); progress is sampled, so
// updates coalesce; the first callback that throws cancels the load and silences
// the rest.
class CallbackThread {
 public:
  CallbackThread(LoadCallbacks callbacks, LoadHandle::State& state)
      : callbacks_(std::move(callbacks)), state_(state), thread_([this] { loop(); }) {}
  CallbackThread(const CallbackThread&) = delete;
  CallbackThread& operator=(const CallbackThread&) = delete;
  ~CallbackThread() { stop(); }

  // Before the stream: the decoder layer of each param of each local rank.
  void set_layers(const std::vector<models::RankShell>& shells) {
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
  // From the post-processor: every byte of (rank, param) has landed.
  void param_complete(std::size_t rank, std::size_t param) {
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
  // Delivers what is pending and a last progress, then stops. Returns what the
  // first callback that threw said, if one did.
  std::optional<std::string> stop() {
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

 private:
  void loop() {
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
  template <class F>
  void call(const char* which, F&& f) {
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

std::string_view to_string(LoadPhase phase) {
  switch (phase) {
    case LoadPhase::kStarting:
      return "starting";
    case LoadPhase::kResolve:
      return "resolve";
    case LoadPhase::kPlan:
      return "plan";
    case LoadPhase::kAllocate:
      return "allocate";
    case LoadPhase::kStream:
      return "stream";
    case LoadPhase::kVerify:
      return "verify";
    case LoadPhase::kDone:
      return "done";
    case LoadPhase::kFailed:
      return "failed";
  }
  return "?";
}

LoadResult LoadHandle::wait() const {
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [this] { return state_->result.has_value(); });
  return *state_->result;
}

std::optional<LoadResult> LoadHandle::wait_for(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout, [this] { return state_->result.has_value(); })) {
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

// ---- Runtime ------------------------------------------------------------------------

struct Runtime::Impl {
  LoadConfig config;
  RuntimeHooks hooks;
  std::shared_ptr<Allocator> allocator;
  std::mutex mu;  // guards current and worker
  // The last load started. Weak: the Runtime never keeps a finished load's model
  // alive; its handles and its thread (until the thread ends) do.
  std::weak_ptr<LoadHandle::State> current;
  std::thread worker;  // runs it

  // One load with `state`: never throws, always finishes the state.
  void run(LoadHandle::State& state, const LoadCallbacks& callbacks);
  LoadResult load(LoadReport& report, LoadHandle::State& handle);
};

Runtime::Runtime(LoadConfig config, std::shared_ptr<Allocator> allocator)
    : Runtime(std::move(config), RuntimeHooks{}, std::move(allocator)) {}

Runtime::Runtime(LoadConfig config, RuntimeHooks hooks, std::shared_ptr<Allocator> allocator)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = std::move(config);
  impl_->hooks = std::move(hooks);
  impl_->allocator = std::move(allocator);
}

Runtime::~Runtime() {
  std::thread worker;
  {
    std::lock_guard lock(impl_->mu);
    if (auto running = impl_->current.lock()) {
      running->cancel.store(true);
    }
    worker = std::move(impl_->worker);
  }
  // Joined without the lock: a callback of the ending load may call cancel().
  if (worker.joinable()) {
    worker.join();
  }
}

void Runtime::cancel() {
  std::lock_guard lock(impl_->mu);
  if (auto running = impl_->current.lock(); running && !running->ended()) {
    running->cancel.store(true);
  }
}

LoadHandle Runtime::start(LoadCallbacks callbacks) {
  std::lock_guard lock(impl_->mu);
  auto state = std::make_shared<LoadHandle::State>();
  if (auto running = impl_->current.lock(); running && !running->ended()) {
    LoadResult r;
    r.error = to_info(Error(Stage::kConfig, "", "",
                            "a load is already running on this Runtime; wait for it (or "
                            "cancel it) before starting another"));
    state->finish(std::move(r));
    return LoadHandle(state);
  }
  if (impl_->worker.joinable()) {
    impl_->worker.join();  // the previous load has finished: its thread is ending
  }
  impl_->current = state;
  impl_->worker = std::thread(
      [impl = impl_.get(), state, cb = std::move(callbacks)] { impl->run(*state, cb); });
  return LoadHandle(state);
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
    if (impl_->current.lock() == handle.state_) {
      worker = std::move(impl_->worker);
    }
  }
  if (worker.joinable()) {
    worker.join();
  }
  return r;
}

void Runtime::Impl::run(LoadHandle::State& state, const LoadCallbacks& callbacks) {
  std::unique_ptr<CallbackThread> notifier;
  if (callbacks.on_progress || callbacks.on_layer_ready) {
    notifier = std::make_unique<CallbackThread>(callbacks, state);
    state.callbacks = notifier.get();
  }
  LoadReport report;
  LoadResult r;
  try {
    r = load(report, state);
  } catch (const Error& e) {
    r.error = to_info(e);
  } catch (const std::exception& e) {
    r.error = to_info(Error(Stage::kConfig, "", "", std::string("unexpected: ") + e.what()));
  }
  if (notifier) {
    // The callbacks see the end (a last progress in its final phase) before wait().
    state.phase.store(r ? LoadPhase::kDone : LoadPhase::kFailed);
    if (std::optional<std::string> threw = notifier->stop()) {
      r = LoadResult{};
      r.error =
          to_info(Error(Stage::kCancelled, "", "", "a LoadCallbacks callback failed: " + *threw));
    }
    state.callbacks = nullptr;
  }
  state.finish(std::move(r));
}

LoadResult Runtime::Impl::load(LoadReport& report, LoadHandle::State& handle) {
  const LoadConfig& c = config;
  const Clock::time_point t0 = Clock::now();

  // ---- resolve
  handle.phase.store(LoadPhase::kResolve);
  // Shared with `ferry plan` (runtime/plan_report.hpp).
  ResolvedCheckpoint resolved = resolve_checkpoint(c);
  const io::ResolvedSource& source = resolved.source;
  const io::CheckpointIndex& index = resolved.index;
  report.files = index.files.size();
  report.warnings = resolved.warnings;
  handle.check_cancel();
  const Clock::time_point t1 = Clock::now();

  // ---- plan
  handle.phase.store(LoadPhase::kPlan);
  // The layout and model options from the config (shared with `ferry plan`).
  std::shared_ptr<const models::Model> model = make_configured_model(c, resolved.hf_config);
  if (hooks.wrap_model) {
    model = hooks.wrap_model(model);
    if (!model) {
      throw Error(Stage::kConfig, "", "", "RuntimeHooks::wrap_model returned no model");
    }
  }
  for (const std::string& note : model->notes()) {
    log::warn(note);
    report.warnings.push_back(note);
  }
  actors::PlanOptions plan_options;
  plan_options.chunk_bytes = c.io.chunk_bytes;
  plan_options.direct = c.io.direct;
  actors::Plan plan = actors::make_plan(index, *model, plan_options, source.folder);
  report.tensors.placed = plan.placed;
  report.tensors.dropped = plan.dropped;
  report.tensors.unmapped = plan.unmapped;
  report.bytes_skipped = plan.bytes_skipped;
  if (plan.unmapped > 0) {
    std::string w = std::to_string(plan.unmapped) +
                    " checkpoint tensor(s) map to no parameter of " + model->family() +
                    " and were not read (load.strict makes this an error): " +
                    join_names(plan.unmapped_names, 20);
    log::warn(w);
    report.warnings.push_back(w);
  }

  handle.check_cancel();
  const Clock::time_point t_plan = Clock::now();

  // ---- allocate
  handle.phase.store(LoadPhase::kAllocate);
  handle.bytes_planned.store(plan.bytes_planned);
  handle.tensors_placed.store(plan.placed);
  const auto& shells = model->shells();
  auto state = std::make_shared<LoadedModel::State>();
  if (!hooks.devices.empty()) {
    state->devices = hooks.devices;
  } else {
    gpu::HostDeviceOptions host;
    host.bandwidth_gbps = c.host.bandwidth_gbps;
    state->devices = gpu::make_devices(to_string(c.devices), host);
  }
  if (state->devices.size() != shells.size()) {
    throw Error(Stage::kConfig, "", "",
                std::to_string(state->devices.size()) + " device(s) for " +
                    std::to_string(shells.size()) +
                    " local rank(s): each local rank needs exactly one device");
  }
  for (std::size_t r = 0; r < shells.size(); ++r) {
    if (!state->devices[r]) {
      throw Error(Stage::kConfig, "", "", "device of local rank " + std::to_string(r) + " is null");
    }
  }
  std::vector<actors::RankTarget> targets(shells.size());
  state->storage.resize(shells.size());
  for (std::size_t r = 0; r < shells.size(); ++r) {
    gpu::Device& device = *state->devices[r];
    LoadedRank rank;
    rank.tp_rank = shells[r].tp_rank;
    rank.pp_rank = c.parallel.pp_rank;
    rank.device = device.name();
    targets[r].device = state->devices[r];
    for (const models::ParamSpec& spec : shells[r].params) {
      gpu::DeviceAllocation a;
      try {
        a = allocator && spec.nbytes != 0 ? engine_allocation(allocator, device, spec.nbytes)
                                          : device.allocate(spec.nbytes);
      } catch (const Error& e) {
        throw Error(Stage::kCopy, device.name(), spec.name,
                    "allocating " + std::to_string(spec.nbytes) + " bytes: " + e.rule());
      }
      LoadedParam p;
      p.name = spec.name;
      p.dtype = spec.dtype;
      p.shape = spec.shape;
      p.strides = spec.strides;
      p.data = a.data();
      p.nbytes = spec.nbytes;
      targets[r].params.push_back(a.data());
      rank.params.push_back(std::move(p));
      state->storage[r].push_back(std::move(a));
    }
    state->ranks.push_back(std::move(rank));
  }
  if (c.io.drop_cache) {
    for (const io::CheckpointFile& f : index.files) {
      io::drop_page_cache(io::File::open(f.path, false, f.name));
    }
  }
  handle.check_cancel();
  const Clock::time_point t2 = Clock::now();

  // ---- stream (+ postprocess)
  handle.phase.store(LoadPhase::kStream);
  actors::PipelineInput input;
  input.index = &index;
  input.model = model.get();
  input.plan = &plan;
  input.ranks = std::move(targets);
  input.options.engine = c.io.engine;
  input.options.queue_depth = c.io.queue_depth;
  input.options.chunk_bytes = c.io.chunk_bytes;
  input.options.staging_buffers = c.io.staging_buffers;
  input.options.direct = c.io.direct;
  input.options.prefetch = c.prefetch.enabled;
  input.options.prefetch_threads = c.prefetch.threads;
  input.options.prefetch_block_bytes = c.prefetch.block_bytes;
  input.options.prefetch_ahead_bytes = c.prefetch.ahead_bytes;
  input.staging_allocator = hooks.staging_allocator;
  if (!input.staging_allocator) {
    for (const auto& d : state->devices) {
      if (d->name().rfind("cuda", 0) == 0) {
        input.staging_allocator = std::make_shared<PinnedStagingAllocator>(d);
        break;
      }
    }
  }
  input.faults = hooks.faults;
  input.before_copy = hooks.before_copy;
  input.cancel = &handle.cancel;
  input.progress = &handle.pipeline;
  if (CallbackThread* cb = handle.callbacks) {
    cb->set_layers(shells);
    input.on_param_complete = [cb](std::size_t rank, std::size_t param) {
      cb->param_complete(rank, param);
    };
  }
  actors::PipelineResult streamed = actors::run_pipeline(input);
  report.bytes_read = index.header_bytes_read + streamed.bytes_read;
  report.bytes_copied = streamed.bytes_copied;
  report.bytes_prefetched = streamed.bytes_prefetched;
  report.staging_high_water_bytes = streamed.staging_high_water_bytes;
  if (streamed.error) {
    throw *streamed.error;  // `state` (and with it every allocation) goes with the stack
  }
  if (streamed.staging_buffers_leased_at_end != 0) {
    throw Error(Stage::kStaging, "", "",
                "internal: " + std::to_string(streamed.staging_buffers_leased_at_end) +
                    " staging buffer(s) still leased after the pipeline stopped");
  }
  const Clock::time_point t3 = Clock::now();

  // ---- verify: every param written exactly once over
  handle.phase.store(LoadPhase::kVerify);
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
    throw Error(Stage::kVerify, source.folder, "",
                std::to_string(short_params.size()) +
                    " parameter(s) not completely written: " + join_names(short_params, 20));
  }
  const Clock::time_point t4 = Clock::now();

  report.phases.resolve = seconds_between(t0, t1);
  report.phases.plan = seconds_between(t1, t_plan);
  report.phases.allocate = seconds_between(t_plan, t2);
  const double pipeline = seconds_between(t2, t3);
  report.phases.stream = std::min(streamed.stream_seconds, pipeline);
  report.phases.postprocess = pipeline - report.phases.stream;
  report.phases.verify = seconds_between(t3, t4);
  report.seconds = report.phases.resolve + report.phases.plan + report.phases.allocate +
                   report.phases.stream + report.phases.postprocess + report.phases.verify;
  report.gbps = report.phases.stream > 0
                    ? static_cast<double>(report.bytes_read) / report.phases.stream / 1e9
                    : 0;
  for (const models::PostLoadHook& hook : model->hooks()) {
    const gpu::Device& device = *state->devices.at(hook.local_rank);
    if (!device.holds_data()) {  // the copy workers checked its params and skipped it
      report.hooks_skipped.push_back(hook.name + " on " + device.name());
    }
  }
  report.peak_rss_bytes = peak_rss_bytes();
  state->report = report;

  LoadResult result;
  result.model = std::make_shared<LoadedModel>(std::move(state));
  return result;
}

}  // namespace ferry::runtime
