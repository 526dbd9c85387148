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
#include "runtime/api_internal.hpp"

#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include "actors/pipeline.hpp"
#include "actors/plan.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "ferry/metrics.hpp"
#include "gpu/backends.hpp"
#include "gpu/device.hpp"
#include "gpu/kernels_host.hpp"
#include "gpu/metered_device.hpp"
#include "io/discover.hpp"
#include "io/fd_limit.hpp"
#include "io/file.hpp"
#include "io/metered_reader.hpp"
#include "io/numa.hpp"
#include "io/prefetch.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_writer.hpp"
#include "io/staging_pool.hpp"
#include "models/hooks.hpp"
#include "models/model.hpp"
#include "models/postprocess.hpp"
#include "models/quant.hpp"
#include "runtime/metrics.hpp"
#include "runtime/metrics_server.hpp"
#include "runtime/plan_report.hpp"
#include "runtime/test_seams.hpp"
#include "runtime/trace.hpp"

namespace ferry::runtime {

struct FERRY_HIDDEN LoadedModel::State {
  std::vector<std::shared_ptr<gpu::Device>> devices;        // per local rank
  std::vector<std::vector<gpu::DeviceAllocation>> storage;  // [rank][param]; freed first
  // Storage that hooks declaring `reallocates` replaced: freed with the model, as
  // a captured graph may still point at it.
  std::vector<gpu::DeviceAllocation> retired;
  std::vector<LoadedRank> ranks;
  std::vector<ManifestEntry> manifest;  // recorded by prepare()
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
  // node >= 0: the pages are placed on that NUMA node (bound, then touched) before
  // they are pinned, since pinned pages cannot move; else allocate_pinned.
  explicit PinnedStagingAllocator(std::shared_ptr<gpu::Device> device, int node = -1)
      : device_(std::move(device)),
        node_(node),
        host_(node >= 0 ? io::numa_allocator(io::aligned_host_allocator(), node) : nullptr) {}

  void* allocate(std::size_t bytes, std::size_t alignment) override {
    if (alignment > gpu::kPinnedAlignment) {
      return nullptr;
    }
    if (host_) {
      void* p = host_->allocate(bytes, alignment);
      if (p == nullptr) {
        return nullptr;
      }
      std::memset(p, 0, bytes);  // first touch: the pages land on the node
      gpu::HostRegistration pinned;
      try {
        pinned = device_->register_host(p, bytes);
      } catch (...) {
        host_->deallocate(p, bytes);
        throw;
      }
      std::lock_guard lock(mu_);
      placed_.emplace(p, std::move(pinned));
      return p;
    }
    gpu::PinnedAllocation a = device_->allocate_pinned(bytes);
    void* p = a.data();
    std::lock_guard lock(mu_);
    live_.emplace(p, std::move(a));
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    std::lock_guard lock(mu_);
    live_.erase(p);
    if (auto it = placed_.find(p); it != placed_.end()) {
      placed_.erase(it);  // unpins before the memory goes
      host_->deallocate(p, bytes);
    }
  }
  std::string name() const override {
    return "pinned memory of " + device_->name() +
           (node_ >= 0 ? " on NUMA node " + std::to_string(node_) : "");
  }

 private:
  std::shared_ptr<gpu::Device> device_;
  int node_;
  std::shared_ptr<io::BufferAllocator> host_;  // node-bound host memory; null: allocate_pinned
  std::mutex mu_;
  std::map<void*, gpu::PinnedAllocation> live_;
  std::map<void*, gpu::HostRegistration> placed_;  // host_'s buffers, pinned
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

const std::vector<ManifestEntry>& LoadedModel::manifest() const {
  return state_->manifest;
}

std::vector<ParamView> LoadedModel::views() const {
  std::shared_ptr<const LoadedModel> self = shared_from_this();
  std::vector<ParamView> out;
  for (std::size_t r = 0; r < state_->ranks.size(); ++r) {
    const LoadedRank& rank = state_->ranks[r];
    for (std::size_t p = 0; p < rank.params.size(); ++p) {
      const LoadedParam& param = rank.params[p];
      const gpu::DeviceAllocation& a = state_->storage[r][p];
      ParamView v;
      v.name = param.name;
      v.device = rank.device;
      v.tp_rank = rank.tp_rank;
      v.data = param.data;
      v.dtype = param.dtype;
      v.shape = param.shape;
      v.strides = param.strides;
      v.byte_offset = a.empty() ? 0 : static_cast<std::uint64_t>(param.data - a.data());
      v.model = self;
      out.push_back(std::move(v));
    }
  }
  return out;
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
  // The folder's path reaches C calls, which would end it at a NUL (Python can pass one).
  if (dir.find('\0') != std::string::npos) {
    throw Error(Stage::kConfig, "", "", "dump: the folder's path contains a NUL byte");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw Error(Stage::kOutput, dir, "", "dump: cannot create the folder: " + ec.message());
  }
  constexpr std::size_t kBlock = std::size_t{16} << 20;  // bounded host memory per copy
  for (std::size_t r = 0; r < state_->ranks.size(); ++r) {
    const LoadedRank& rank = state_->ranks[r];
    io::SafetensorsWriter writer(
        (fs::path(dir) / ("rank-" + std::to_string(rank.tp_rank) + ".safetensors")).string(),
        Stage::kOutput, "dump");
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
  } catch (...) {
    throw Error(Stage::kCopy, name, "",
                "the engine's Allocator refused with an exception that is not a std::exception");
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
struct FERRY_HIDDEN LoadHandle::State {
  CallbackThread* callbacks = nullptr;  // set while the load runs, when it has any
  std::atomic<bool> cancel{false};
  std::atomic<LoadPhase> phase{LoadPhase::kStarting};
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
      : callbacks_(std::move(callbacks)),
        state_(state),
        thread_(start_thread("callbacks", [this, sink = log::thread_sink()] {
          const log::ScopedSink scope(sink);
          loop();
        })) {}
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

namespace {

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

}  // namespace

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
    case LoadPhase::kSentinel:
      return "sentinel";
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
  using Clock = std::chrono::steady_clock;
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
  switch (state) {
    case RuntimeState::kCreated:
      return "created";
    case RuntimeState::kLoading:
      return "loading";
    case RuntimeState::kPreparing:
      return "preparing";
    case RuntimeState::kPrepared:
      return "prepared";
    case RuntimeState::kCommitting:
      return "committing";
    case RuntimeState::kReady:
      return "ready";
    case RuntimeState::kFailed:
      return "failed";
  }
  return "?";
}

// ---- one load's work ------------------------------------------------------------

namespace {

// The value every floating-point parameter holds between prepare() and commit().
constexpr double kSentinel = 1e-3;

bool floating(DType dtype) {
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
    case DType::kF32:
    case DType::kF64:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kF8E8M0:
      return true;
    default:
      return false;
  }
}

// One element of the sentinel in `dtype`, as its bytes. FP8 has no Stream::fill:
// its encodings of the value nearest 1e-3 are written here.
std::vector<std::byte> sentinel_element(DType dtype) {
  switch (dtype) {
    case DType::kF8E4M3:
      return {std::byte{0x01}};  // 2^-9, the smallest E4M3FN subnormal (1e-3 rounds to it)
    case DType::kF8E5M2:
      return {std::byte{0x14}};  // 2^-10 (exponent 5, mantissa 0)
    case DType::kF8E8M0:
      return {std::byte{0x75}};  // 2^-10 (biased exponent 117)
    default: {
      const std::uint64_t bits = gpu::host::fill_pattern(dtype, kSentinel);
      std::vector<std::byte> out(dtype_size(dtype));
      std::memcpy(out.data(), &bits, out.size());  // the low bytes, in machine order
      return out;
    }
  }
}

// `bytes` bytes of memory for `spec` on `device`: from the engine's Allocator when
// there is one, else from the device.
gpu::DeviceAllocation allocate_param(const std::shared_ptr<Allocator>& allocator,
                                     gpu::Device& device, const models::ParamSpec& spec) {
  try {
    return allocator && spec.nbytes != 0 ? engine_allocation(allocator, device, spec.nbytes)
                                         : device.allocate(spec.nbytes);
  } catch (const Error& e) {
    throw Error(Stage::kCopy, device.name(), spec.name,
                "allocating " + std::to_string(spec.nbytes) + " bytes: " + e.rule());
  }
}

// A load-only param (ParamSpec::transient) of its own allocation, so that it can
// be freed before the others; with load.layered none yet (its first write does it).
gpu::DeviceAllocation allocate_transient(gpu::Device& device, const models::ParamSpec& spec,
                                         bool layered) {
  return layered ? gpu::DeviceAllocation{} : allocate_param(nullptr, device, spec);
}

// Every param of one local rank from one allocation of its device (an arena), each
// at a kDeviceAlignment boundary: one cudaMalloc per device instead of one per
// param. A param's handle keeps the arena alive; the arena goes with the last. An
// empty param gets an empty handle. Should the device refuse the one large block
// (a fragmented GPU), the params are allocated one by one, so that a real
// shortage fails naming the param that did not fit. Transient params are not in the
// arena (allocate_transient).
std::vector<gpu::DeviceAllocation> allocate_rank(gpu::Device& device,
                                                 const std::vector<models::ParamSpec>& params,
                                                 bool layered) {
  std::vector<std::uint64_t> offsets;
  std::uint64_t end = 0;
  for (const models::ParamSpec& spec : params) {
    const std::uint64_t at =
        (end + gpu::kDeviceAlignment - 1) / gpu::kDeviceAlignment * gpu::kDeviceAlignment;
    offsets.push_back(at);
    end = spec.transient ? at : at + spec.nbytes;
  }
  std::vector<gpu::DeviceAllocation> out;
  std::shared_ptr<gpu::DeviceAllocation> arena;
  try {
    arena = std::make_shared<gpu::DeviceAllocation>(device.allocate(end));
  } catch (const Error& e) {
    log::warn(device.name() + ": one block of " + std::to_string(end) + " bytes for " +
              std::to_string(params.size()) +
              " parameters was refused; allocating them one by one (" + e.rule() + ")");
    for (const models::ParamSpec& spec : params) {
      out.push_back(spec.transient ? allocate_transient(device, spec, layered)
                                   : allocate_param(nullptr, device, spec));
    }
    return out;
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].transient) {
      out.push_back(allocate_transient(device, params[i], layered));
    } else if (params[i].nbytes == 0) {
      out.emplace_back();
    } else {
      out.emplace_back(arena->data() + offsets[i], params[i].nbytes,
                       [arena](std::byte*, std::size_t) {});
    }
  }
  return out;
}

// Each local rank's params: from the engine's Allocator on this thread, one call a
// param (it is called from the loading thread only), or else from an arena per
// rank, the ranks set up in parallel, a thread each (a GPU's first allocation also
// creates its context, which takes a while per device). On failure everything
// allocated is given back and the first rank's error is thrown.
std::vector<std::vector<gpu::DeviceAllocation>> allocate_ranks(
    const std::shared_ptr<Allocator>& allocator,
    const std::vector<std::shared_ptr<gpu::Device>>& devices,
    const std::vector<models::RankShell>& shells, bool layered) {
  std::vector<std::vector<gpu::DeviceAllocation>> out(shells.size());
  if (allocator) {
    for (std::size_t r = 0; r < shells.size(); ++r) {
      for (const models::ParamSpec& spec : shells[r].params) {
        out[r].push_back(spec.transient ? allocate_transient(*devices[r], spec, layered)
                                        : allocate_param(allocator, *devices[r], spec));
      }
    }
    return out;
  }
  std::vector<std::exception_ptr> errors(shells.size());
  auto set_up = [&](std::size_t r) {
    try {
      devices[r]->bind();
      out[r] = allocate_rank(*devices[r], shells[r].params, layered);
    } catch (...) {
      errors[r] = std::current_exception();
    }
  };
  if (shells.size() == 1) {
    set_up(0);
  } else {
    std::vector<std::thread> threads;
    try {
      for (std::size_t r = 0; r < shells.size(); ++r) {
        threads.push_back(start_thread("allocation rank " + std::to_string(r),
                                       [&set_up, r, sink = log::thread_sink()] {
                                         const log::ScopedSink scope(sink);
                                         set_up(r);
                                       }));
      }
    } catch (...) {
      join_all(threads);  // what they allocated goes with `out`
      throw;
    }
    join_all(threads);
  }
  for (const std::exception_ptr& e : errors) {
    if (e) {
      std::rethrow_exception(e);
    }
  }
  return out;
}

// A weight file's identity as of now: that of the descriptor kept since its header
// was read, else (an index made without descriptors) of its path.
io::FileIdentity identity_now(const io::CheckpointFile& f) {
  if (f.file) {
    return f.file->current_identity();
  }
  struct stat st {};
  if (::stat(f.path.c_str(), &st) != 0) {
    throw Error(Stage::kRead, f.name, "", std::string("stat: ") + errno_text(errno));
  }
  return io::identity_of(&st);
}

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

}  // namespace

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
  LoadConfig config;
  RuntimeTestSeams seams;
  std::shared_ptr<Allocator> allocator;

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
                    std::shared_ptr<LoadWork> keep);
  void run(LoadHandle::State& state, const LoadCallbacks& callbacks, const Body& body,
           RuntimeState success, const std::shared_ptr<LoadWork>& keep);

  // The steps.
  void resolve_and_plan(LoadWork& w, LoadHandle::State& handle);
  void make_devices(LoadWork& w);
  void allocate(LoadWork& w, LoadHandle::State& handle);
  void stream(LoadWork& w, LoadHandle::State& handle);  // + verify the bytes landed
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
  void verify_startup(LoadWork& w);

  LoadResult load(LoadHandle::State& handle);
  LoadResult prepare(LoadWork& w, LoadHandle::State& handle);
  LoadResult commit(LoadWork& w, LoadHandle::State& handle);
};

namespace {

bool running(RuntimeState s) {
  return s == RuntimeState::kLoading || s == RuntimeState::kPreparing ||
         s == RuntimeState::kCommitting;
}

// A handle whose load failed before it started (a call in the wrong state).
LoadHandle::State& refuse(LoadHandle::State& state, const std::string& why) {
  LoadResult r;
  r.error = to_info(Error(Stage::kConfig, "", "", why));
  state.finish(std::move(r));
  return state;
}

}  // namespace

// Makes a Runtime with test seams (make_runtime); a friend of Runtime.
struct RuntimeFactory {
  static std::unique_ptr<Runtime::Impl> impl(const Config& config, RuntimeTestSeams seams,
                                             std::shared_ptr<Allocator> allocator) {
    auto impl = std::make_unique<Runtime::Impl>();
    impl->config = config.load_config();
    impl->seams = std::move(seams);
    impl->allocator = std::move(allocator);
    impl->start_metrics();
    return impl;
  }
  static Runtime make(const Config& config, RuntimeTestSeams seams,
                      std::shared_ptr<Allocator> allocator) {
    return Runtime(impl(config, std::move(seams), std::move(allocator)));
  }
};

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
                                 LoadCallbacks callbacks, Body body,
                                 std::shared_ptr<LoadWork> keep) {
  auto handle = std::make_shared<LoadHandle::State>();
  if (running(status)) {
    refuse(*handle,
           "a load is already running on this Runtime; wait for it (or cancel it) before "
           "starting another");
    return LoadHandle(handle);
  }
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
    auto handle = std::make_shared<LoadHandle::State>();
    refuse(*handle, "a prepared model waits for commit() (or cancel()); start() refused");
    return LoadHandle(handle);
  }
  return impl_->launch(
      RuntimeState::kLoading, RuntimeState::kReady, std::move(callbacks),
      [impl = impl_.get()](LoadHandle::State& h) { return impl->load(h); }, nullptr);
}

LoadHandle Runtime::prepare(LoadCallbacks callbacks) {
  std::lock_guard lock(impl_->mu);
  if (impl_->status == RuntimeState::kPrepared) {
    auto handle = std::make_shared<LoadHandle::State>();
    refuse(*handle, "a prepared model waits for commit() (or cancel()); prepare() refused");
    return LoadHandle(handle);
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
    auto handle = std::make_shared<LoadHandle::State>();
    refuse(*handle, "commit() needs a prepared model (call prepare() first); the runtime is " +
                        std::string(to_string(impl_->status)));
    return LoadHandle(handle);
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
    if (r && handle.cancel.load()) {
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
    if (r && success == RuntimeState::kReady) {
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

void Runtime::Impl::resolve_and_plan(LoadWork& w, LoadHandle::State& handle) {
  const LoadConfig& c = config;
  LoadReport& report = w.report;
  if (metrics_error) {
    throw *metrics_error;
  }
  if (c.load.layered && c.quantization.online == QuantizationConfig::Online::kNone) {
    throw Error(Stage::kConfig, "", "",
                "load.layered frees load-only parameters as soon as they are used, and only "
                "quantization.online makes any: set quantization.online, or turn layered off");
  }
  if (c.load.layered && c.model.load_format == io::LoadFormat::kDummy) {
    throw Error(Stage::kConfig, "", "",
                "load.layered with model.load_format dummy: a dummy load fills every parameter "
                "at once, there is no stream to follow layer by layer");
  }
  if (c.prefetch.enabled && c.io.direct) {
    throw Error(Stage::kConfig, "", "",
                "prefetch.enabled with io.direct: refused, because O_DIRECT reads bypass the "
                "page cache the prefetch warms (turn one of them off)");
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
  report.warnings = w.resolved.warnings;
  handle.check_cancel();
  w.resolved_at = Clock::now();
  w.span("resolve", w.begin, w.resolved_at);

  // ---- plan
  handle.phase.store(LoadPhase::kPlan);
  // The layout and model options from the config (shared with `ferry plan`).
  w.model = make_configured_model(c, w.resolved.hf_config);
  if (seams.wrap_model) {
    w.model = seams.wrap_model(w.model);
    if (!w.model) {
      throw Error(Stage::kConfig, "", "", "RuntimeTestSeams::wrap_model returned no model");
    }
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
                          join_names(w.plan.unmapped_names, 20);
    log::warn(warning);
    report.warnings.push_back(warning);
  }
  handle.check_cancel();
  w.planned_at = Clock::now();
  w.span("plan", w.resolved_at, w.planned_at);
}

void Runtime::Impl::make_devices(LoadWork& w) {
  LoadedModel::State& state = *w.state;
  const auto& shells = w.model->shells();
  if (!seams.devices.empty()) {
    state.devices = seams.devices;
  } else {
    gpu::HostDeviceOptions host;
    host.bandwidth_gbps = config.host.bandwidth_gbps;
    host.huge_pages = config.host.huge_pages;
    host.deferred_copies = config.host.deferred_copies;
    host.narrow_row_bytes = config.host.narrow_row_bytes;
    state.devices = gpu::make_devices(to_string(config.devices), host);
  }
  if (state.devices.size() != shells.size()) {
    throw Error(Stage::kConfig, "", "",
                std::to_string(state.devices.size()) + " device(s) for " +
                    std::to_string(shells.size()) +
                    " local rank(s): each local rank needs exactly one device");
  }
  for (std::size_t r = 0; r < shells.size(); ++r) {
    if (!state.devices[r]) {
      throw Error(Stage::kConfig, "", "", "device of local rank " + std::to_string(r) + " is null");
    }
  }
  w.metrics = current_metrics();
  for (auto& d : state.devices) {
    if (w.metrics) {
      d = gpu::metered_device(d, w.metrics->copy_observer());
    }
    if (w.trace) {
      d = gpu::metered_device(d, w.trace->copy_observer());
    }
  }
}

void Runtime::Impl::allocate(LoadWork& w, LoadHandle::State& handle) {
  handle.phase.store(LoadPhase::kAllocate);
  LoadedModel::State& state = *w.state;
  const auto& shells = w.model->shells();
  state.storage = allocate_ranks(allocator, state.devices, shells, config.load.layered);
  for (std::size_t r = 0; r < shells.size(); ++r) {
    gpu::Device& device = *state.devices[r];
    LoadedRank rank;
    rank.tp_rank = shells[r].tp_rank;
    rank.pp_rank = config.parallel.pp_rank;
    rank.device = device.name();
    for (std::size_t i = 0; i < shells[r].params.size(); ++i) {
      const models::ParamSpec& spec = shells[r].params[i];
      const gpu::DeviceAllocation& a = state.storage[r][i];
      LoadedParam p;
      p.name = spec.name;
      p.dtype = spec.dtype;
      p.shape = spec.shape;
      p.strides = spec.strides;
      p.data = a.data();
      p.nbytes = spec.nbytes;
      rank.params.push_back(std::move(p));
    }
    state.ranks.push_back(std::move(rank));
  }
  if (config.io.drop_cache) {
    for (const io::CheckpointFile& f : w.resolved.index.files) {
      io::drop_page_cache(io::File::open(f.path, false, f.name));
    }
  }
  handle.check_cancel();
  w.allocated_at = Clock::now();
  w.span("allocate", w.planned_at, w.allocated_at);
}

void Runtime::Impl::drop_transients(LoadWork& w) {
  std::lock_guard lock(w.state_mu);
  LoadedModel::State& state = *w.state;
  w.report.peak_device_bytes.clear();
  for (const auto& d : state.devices) {
    w.report.peak_device_bytes[d->name()] = d->stats().device.peak_bytes;
  }
  const auto& shells = w.model->shells();
  for (std::size_t r = 0; r < shells.size(); ++r) {
    const auto& params = shells[r].params;
    if (std::none_of(params.begin(), params.end(),
                     [](const models::ParamSpec& p) { return p.transient; })) {
      continue;
    }
    std::vector<LoadedParam> kept;
    std::vector<gpu::DeviceAllocation> storage;
    for (std::size_t p = 0; p < params.size(); ++p) {
      if (!params[p].transient) {
        kept.push_back(std::move(state.ranks[r].params[p]));
        storage.push_back(std::move(state.storage[r][p]));
      }
    }
    state.ranks[r].params = std::move(kept);
    state.storage[r] = std::move(storage);  // the dropped ones' handles free them here
  }
}

std::byte* Runtime::Impl::reallocate(LoadWork& w, std::size_t rank, std::size_t param) {
  const models::ParamSpec& spec = w.model->shells().at(rank).params.at(param);
  std::lock_guard lock(w.state_mu);
  LoadedModel::State& state = *w.state;
  gpu::DeviceAllocation fresh = allocate_param(allocator, *state.devices.at(rank), spec);
  std::byte* data = fresh.data();
  state.retired.push_back(std::exchange(state.storage.at(rank).at(param), std::move(fresh)));
  state.ranks.at(rank).params.at(param).data = data;
  return data;
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
  input.options.engine = c.io.engine;
  input.options.read_lanes = c.io.read_lanes;
  input.options.queue_depth = c.io.queue_depth;
  input.options.cancel_timeout = std::chrono::milliseconds(c.io.cancel_timeout_ms);
  input.options.chunk_bytes = c.io.chunk_bytes;
  // Auto staging and lanes follow the devices' link (io_auto).
  const IoAuto io = io_auto(c.devices.kind, shells.size());
  input.options.staging_bytes = c.io.staging_bytes != 0 ? c.io.staging_bytes : io.staging_bytes;
  input.options.max_auto_lanes = io.max_lanes;
  input.options.lanes_follow_files = io.lanes_follow_files;
  input.options.direct_to_device = c.io.direct_to_device;
  input.options.direct = c.io.direct;
  input.options.prefetch = c.prefetch.enabled;
  input.options.prefetch_threads = c.prefetch.threads;
  input.options.prefetch_block_bytes = c.prefetch.block_bytes;
  input.options.prefetch_ahead_bytes = c.prefetch.ahead_bytes;
  input.options.poison_staging = c.host.deferred_copies;
  input.release_staging_early = seams.release_staging_early;
  input.staging_allocator = seams.staging_allocator;
  if (!input.staging_allocator) {
    for (const auto& d : w.state->devices) {
      if (d->name().rfind("cuda", 0) == 0) {
        input.staging_allocator = std::make_shared<PinnedStagingAllocator>(d);
        input.staging_allocator_on_node = [d](int node) {
          return std::make_shared<PinnedStagingAllocator>(d, node);
        };
        break;
      }
    }
  }
  return input;
}

void Runtime::Impl::stream(LoadWork& w, LoadHandle::State& handle) {
  const LoadConfig& c = config;
  LoadReport& report = w.report;
  const auto& shells = w.model->shells();
  handle.bytes_planned.store(w.plan.bytes_planned);
  handle.tensors_placed.store(w.plan.placed);
  const Clock::time_point t_begin = Clock::now();

  // ---- stream (+ postprocess)
  handle.phase.store(LoadPhase::kStream);
  actors::PipelineInput input = pipeline_input(w);
  input.prepared = w.resources;  // prepare()'s, in overlap mode
  input.faults = seams.faults;
  input.before_copy = seams.before_copy;
  input.fault_point = seams.fault_point;
  input.cancel = &handle.cancel;
  input.progress = &handle.pipeline;
  if (CallbackThread* cb = handle.callbacks) {
    cb->set_layers(shells);
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
    if (c.io.direct_to_device == io::DirectToDevice::kOn) {
      throw Error(Stage::kConfig, "", "",
                  "io.direct_to_device=on with load.layered: a load-only param has no storage "
                  "until its copy worker's first write, so no read can land in it");
    }
    input.options.direct_to_device = io::DirectToDevice::kOff;
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
                    " parameter(s) not completely written: " + join_names(short_params, 20));
  }
  const Clock::time_point t_verified = Clock::now();
  w.span("stream", t_begin, t_streamed);
  w.span("verify", t_streamed, t_verified);

  report.phases.resolve = seconds_between(w.begin, w.resolved_at);
  report.phases.plan = seconds_between(w.resolved_at, w.planned_at);
  report.phases.allocate = seconds_between(w.planned_at, w.allocated_at);
  const double pipeline = seconds_between(t_begin, t_streamed);
  report.phases.stream = std::min(streamed.stream_seconds, pipeline);
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
                                           (config.io.chunk_bytes + 4096)
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
  resolve_and_plan(w, handle);
  make_devices(w);
  allocate(w, handle);
  load_all(w, handle);
  w.state->report = w.report;
  LoadResult result;
  result.model = std::make_shared<LoadedModel>(std::move(w.state));
  return result;
}

// ---- capture-safe startup ----------------------------------------------------------

namespace {

std::vector<ManifestEntry> record_manifest(const LoadedModel::State& state) {
  std::vector<ManifestEntry> out;
  for (std::size_t r = 0; r < state.ranks.size(); ++r) {
    const LoadedRank& rank = state.ranks[r];
    for (std::size_t p = 0; p < rank.params.size(); ++p) {
      const LoadedParam& param = rank.params[p];
      const gpu::DeviceAllocation& a = state.storage[r][p];
      ManifestEntry e;
      e.local_rank = r;
      e.name = param.name;
      e.device = rank.device;
      e.data = param.data;
      e.nbytes = param.nbytes;
      e.byte_offset = a.empty() ? 0 : static_cast<std::uint64_t>(param.data - a.data());
      e.dtype = param.dtype;
      e.shape = param.shape;
      e.strides = param.strides;
      out.push_back(std::move(e));
    }
  }
  return out;
}

std::string rank_name(const LoadedModel::State& state, std::size_t local_rank,
                      const std::string& param) {
  return param + " (tp rank " + std::to_string(state.ranks.at(local_rank).tp_rank) + ")";
}

// The manifest entries that differ from `before`, each with what changed.
std::vector<std::string> manifest_changes(const std::vector<ManifestEntry>& before,
                                          const LoadedModel::State& state) {
  const std::vector<ManifestEntry> now = record_manifest(state);
  std::vector<std::string> out;
  if (now.size() != before.size()) {
    out.push_back("the parameter list (" + std::to_string(before.size()) + " entries, now " +
                  std::to_string(now.size()) + ")");
    return out;
  }
  for (std::size_t i = 0; i < now.size(); ++i) {
    const ManifestEntry& a = before[i];
    const ManifestEntry& b = now[i];
    std::vector<std::string> what;
    if (a.name != b.name || a.local_rank != b.local_rank) {
      what.push_back("name (now " + b.name + ")");
    }
    if (a.data != b.data || a.nbytes != b.nbytes) {
      what.push_back("pointer");
    }
    if (a.byte_offset != b.byte_offset) {
      what.push_back("offset");
    }
    if (a.shape != b.shape) {
      what.push_back("shape");
    }
    if (a.strides != b.strides) {
      what.push_back("strides");
    }
    if (a.dtype != b.dtype) {
      what.push_back("dtype");
    }
    if (a.device != b.device) {
      what.push_back("device");
    }
    if (!what.empty()) {
      std::string changed;
      for (const std::string& x : what) {
        changed += (changed.empty() ? "" : ", ") + x;
      }
      out.push_back(rank_name(state, a.local_rank, a.name) + ": " + changed);
    }
  }
  return out;
}

// The sentinel as Stream::match_pattern compares it: the element's bytes as the
// low bytes of a word, in machine order.
gpu::PatternRange sentinel_range(const ManifestEntry& e) {
  const std::vector<std::byte> element = sentinel_element(e.dtype);
  gpu::PatternRange range;
  range.data = e.data;
  range.bytes = e.nbytes;
  std::memcpy(&range.pattern, element.data(), element.size());
  range.element_size = static_cast<std::uint32_t>(element.size());
  return range;
}

}  // namespace

namespace {

// Builds every rank's check on its prepared stream and waits for the uploads
// (one synchronize per device).
std::vector<SentinelCheck> prepare_sentinel_checks(
    const std::vector<ManifestEntry>& manifest, const LoadedModel::State& state,
    const actors::PreparedResources& resources) {
  std::vector<SentinelCheck> checks(state.devices.size());
  std::vector<std::vector<gpu::PatternRange>> tables(state.devices.size());
  for (const ManifestEntry& e : manifest) {
    const gpu::Device& device = *state.devices.at(e.local_rank);
    if (!floating(e.dtype) || !device.holds_data() || e.nbytes == 0) {
      continue;
    }
    tables[e.local_rank].push_back(sentinel_range(e));
    checks[e.local_rank].names.push_back(rank_name(state, e.local_rank, e.name));
  }
  for (std::size_t r = 0; r < checks.size(); ++r) {
    const std::size_t n = tables[r].size();
    if (n == 0) {
      continue;
    }
    gpu::Device& device = *state.devices[r];
    SentinelCheck& c = checks[r];
    try {
      c.table = device.allocate(n * sizeof(gpu::PatternRange));
      c.flags = device.allocate(n);
      c.result = device.allocate_pinned(n);
    } catch (const Error& e) {
      throw Error(Stage::kVerify, device.name(), "",
                  "allocating the sentinel check of " + std::to_string(n) +
                      " parameters: " + e.rule());
    }
    resources.ranks.at(r).stream->copy_h2d(c.table.data(), reinterpret_cast<const std::byte*>(tables[r].data()),
                            n * sizeof(gpu::PatternRange));
  }
  for (std::size_t r = 0; r < checks.size(); ++r) {
    if (!tables[r].empty()) {
      resources.ranks[r].stream->synchronize();  // before `tables` goes
    }
  }
  return checks;
}

// The params nothing wrote: one match_pattern and one read-back per device, then
// one synchronize per device.
std::vector<std::string> sentinel_params(std::vector<SentinelCheck>& checks,
                                         const LoadedModel::State& state,
                                         const actors::PreparedResources& resources) {
  for (std::size_t r = 0; r < checks.size(); ++r) {
    SentinelCheck& c = checks[r];
    if (c.names.empty()) {
      continue;
    }
    state.devices[r]->bind();  // this thread's calls as a copy worker's (docs/GPU.md)
    auto* flags = reinterpret_cast<std::uint8_t*>(c.flags.data());
    gpu::Stream& stream = *resources.ranks.at(r).stream;
    stream.match_pattern(reinterpret_cast<const gpu::PatternRange*>(c.table.data()),
                              c.names.size(), flags);
    stream.copy_d2h(c.result.data(), c.flags.data(), c.names.size());
  }
  std::vector<std::string> out;
  for (std::size_t r = 0; r < checks.size(); ++r) {
    const SentinelCheck& c = checks[r];
    if (c.names.empty()) {
      continue;
    }
    resources.ranks[r].stream->synchronize();
    for (std::size_t i = 0; i < c.names.size(); ++i) {
      if (c.result.data()[i] != std::byte{0}) {
        out.push_back(c.names[i]);
      }
    }
  }
  return out;
}

}  // namespace

std::vector<StartupRefusal> Runtime::Impl::overlap_refusals(const LoadWork& w) const {
  std::vector<StartupRefusal> out;
  if (config.model.load_format == io::LoadFormat::kDummy) {
    out.push_back({"load_format",
                   "the dummy format reads nothing to overlap with a capture: prepare() fills "
                   "the parameters in full"});
  } else if (w.resolved.source.format != io::FileFormat::kSafetensors) {
    out.push_back({"load_format",
                   "the checkpoint is not safetensors: only safetensors headers give every "
                   "tensor's place before the data is read"});
  }
  for (const auto& d : w.state->devices) {
    if (!d->holds_data()) {
      out.push_back({"backend", "device " + d->name() +
                                    " keeps no data (a null device): there is no storage to "
                                    "capture against"});
      break;
    }
  }
  if (config.quantization.online != QuantizationConfig::Online::kNone) {
    out.push_back({"quantization",
                   "quantization.online writes the FP8 weights from load-only full-precision "
                   "ones, which prepare() would have to hold until commit()"});
  }
  if (config.load.layered) {
    out.push_back({"layered",
                   "load.layered allocates params as the load reaches them, so there is no "
                   "storage to capture against before commit()"});
  }
  if (config.io.direct) {
    out.push_back({"io_direct",
                   "io.direct reads bypass the page cache, so a prefetch during the capture "
                   "gains nothing"});
  }
  std::vector<std::string> not_idempotent, reallocating;
  for (const models::PostLoadHook& h : w.model->hooks()) {
    if (!h.idempotent) {
      not_idempotent.push_back(h.name);
    }
    if (h.reallocates) {
      reallocating.push_back(h.name);
    }
  }
  if (!not_idempotent.empty()) {
    out.push_back({"hook_not_idempotent",
                   "post-load hook(s) that cannot run again on the real weights after the "
                   "sentinel: " +
                       join_names(not_idempotent, 8)});
  }
  if (!reallocating.empty()) {
    out.push_back({"hook_reallocates",
                   "post-load hook(s) that replace their outputs' storage, which captured graphs "
                   "would lose: " +
                       join_names(reallocating, 8)});
  }
  return out;
}

void Runtime::Impl::fill_sentinel(LoadWork& w, LoadHandle::State& handle) {
  handle.phase.store(LoadPhase::kSentinel);
  LoadedModel::State& state = *w.state;
  // Queued on every device first, waited for once per device at the end: FP8's
  // sentinel is one repeated byte (set_bytes, a memset), the others a fill kernel.
  for (std::size_t r = 0; r < state.ranks.size(); ++r) {
    handle.check_cancel();
    gpu::Stream& stream = w.rank_stream(r);
    for (const LoadedParam& p : state.ranks[r].params) {
      if (!floating(p.dtype) || p.nbytes == 0) {
        continue;
      }
      const std::size_t es = dtype_size(p.dtype);
      if (es == 1) {
        stream.set_bytes(p.data, sentinel_element(p.dtype).front(), p.nbytes);
      } else {
        stream.fill(p.data, p.nbytes / es, p.dtype, kSentinel);
      }
    }
  }
  for (std::size_t r = 0; r < state.ranks.size(); ++r) {
    w.rank_stream(r).synchronize();
  }
  // The post-load hooks run on the sentinel weights (the MLA split included), so
  // their outputs are in place and the engine captures the same buffers.
  run_hooks_once(w, handle, "the sentinel weights");
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
  std::vector<std::exception_ptr> errors(shells.size());
  auto fill_rank = [&](std::size_t r) {
    try {
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
    } catch (...) {
      errors[r] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  try {
    for (std::size_t r = 1; r < shells.size(); ++r) {
      threads.push_back(start_thread("dummy fill rank " + std::to_string(r),
                                     [&fill_rank, r, sink = log::thread_sink()] {
                                       const log::ScopedSink scope(sink);
                                       fill_rank(r);
                                     }));
    }
  } catch (...) {
    join_all(threads);
    throw;
  }
  if (!shells.empty()) {
    fill_rank(0);
  }
  join_all(threads);
  for (const std::exception_ptr& e : errors) {
    if (e) {
      std::rethrow_exception(e);
    }
  }
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

LoadResult Runtime::Impl::prepare(LoadWork& w, LoadHandle::State& handle) {
  TraceOnExit trace{*this, w};
  resolve_and_plan(w, handle);
  make_devices(w);
  LoadReport& report = w.report;
  // ---- admission: decided before anything is allocated
  w.mode = StartupMode::kSerial;
  if (config.startup.mode != StartupMode::kSerial) {
    if (!seams.skip_startup_admission) {
      report.startup_refusals = overlap_refusals(w);
    }
    if (report.startup_refusals.empty()) {
      w.mode = StartupMode::kOverlap;
    } else if (config.startup.mode == StartupMode::kOverlap) {
      std::string why;
      for (const StartupRefusal& refusal : report.startup_refusals) {
        why += (why.empty() ? "" : "; ") + refusal.code + ": " + refusal.message;
      }
      throw Error(Stage::kConfig, w.resolved.source.folder, "",
                  "startup.mode overlap refused: " + why);
    } else {
      for (const StartupRefusal& refusal : report.startup_refusals) {
        log::warn("startup.mode auto runs serially: " + refusal.code + ": " + refusal.message);
      }
    }
  }
  report.startup_mode = std::string(to_string(w.mode));
  allocate(w, handle);

  if (w.mode == StartupMode::kSerial) {
    load_all(w, handle);  // the whole load; commit() only verifies
    w.state->manifest = record_manifest(*w.state);
  } else {
    const Clock::time_point t_sentinel = Clock::now();
    w.resources = actors::prepare_resources(pipeline_input(w));
    fill_sentinel(w, handle);
    w.state->manifest = record_manifest(*w.state);
    w.sentinel_checks = prepare_sentinel_checks(w.state->manifest, *w.state, *w.resources);
    report.startup.sentinel = seconds_between(t_sentinel, Clock::now());
    w.span("sentinel", t_sentinel, Clock::now());
    // Warm the page cache while the engine captures: the planned ranges, in plan
    // order (commit() stops it). commit() checks every planned file again.
    std::vector<io::PrefetchFile> files = actors::planned_prefetch_files(w.plan, w.resolved.index);
    for (std::size_t i = 0; i < files.size(); ++i) {  // one per index file, in order
      if (!files[i].ranges->empty()) {
        w.stamped.push_back(i);
      }
    }
    io::PrefetchOptions options;
    options.threads = config.prefetch.threads;
    options.block_bytes = config.prefetch.block_bytes;
    if (w.trace) {
      options.on_block_read = w.trace->prefetch_observer();
    }
    w.prefetcher = std::make_unique<io::Prefetcher>(std::move(files), options);
  }
  w.prepared_at = Clock::now();
  report.startup.prepare = seconds_between(w.begin, w.prepared_at);
  w.state->report = report;
  w.loaded = std::make_shared<LoadedModel>(w.state);
  trace.armed = false;  // commit() writes the whole startup
  LoadResult result;
  result.model = w.loaded;
  return result;
}

void Runtime::Impl::verify_startup(LoadWork& w) {
  std::vector<std::string> moved;
  {
    std::lock_guard lock(w.state_mu);
    if (seams.before_startup_verify) {
      seams.before_startup_verify(w.state->ranks);
    }
    moved = manifest_changes(w.state->manifest, *w.state);
  }
  std::vector<std::string> sentinel;
  if (w.mode == StartupMode::kOverlap) {
    sentinel = sentinel_params(w.sentinel_checks, *w.state, *w.resources);
  }
  if (moved.empty() && sentinel.empty()) {
    return;
  }
  std::string message;
  if (!moved.empty()) {
    message += std::to_string(moved.size()) +
               " storage manifest entr(ies) changed since prepare(): " + join_names(moved, 8);
  }
  if (!sentinel.empty()) {
    message += std::string(message.empty() ? "" : "; ") + std::to_string(sentinel.size()) +
               " floating-point parameter(s) still hold only the sentinel (nothing wrote them): " +
               join_names(sentinel, 8);
  }
  throw Error(Stage::kVerify, w.resolved.source.folder, "", message);
}

LoadResult Runtime::Impl::commit(LoadWork& w, LoadHandle::State& handle) {
  TraceOnExit trace{*this, w};
  const Clock::time_point t_commit = Clock::now();
  LoadReport& report = w.report;
  report.startup.capture = seconds_between(w.prepared_at, t_commit);
  w.span("capture (engine)", w.prepared_at, t_commit);
  if (w.mode == StartupMode::kOverlap) {
    // Stop the prefetch: a bounded wait, and its failures only warn.
    constexpr std::chrono::milliseconds kPrefetchStop{2000};
    if (!w.prefetcher->stop(kPrefetchStop)) {
      log::warn("startup: the prefetch did not stop within 2 s; committing anyway");
    }
    for (const std::string& f : w.prefetcher->failed()) {
      log::warn(f);
      report.warnings.push_back(f);
    }
    report.startup.bytes_prefetched = w.prefetcher->bytes_prefetched();
    w.span("prefetch (capture)", w.prepared_at, Clock::now());
    report.bytes_prefetched = report.startup.bytes_prefetched;
    w.prefetcher.reset();
    for (std::size_t i : w.stamped) {
      const io::CheckpointFile& f = w.resolved.index.files[i];
      const io::FileIdentity now = identity_now(f);
      if (f.identity.known() && now != f.identity) {
        throw Error(Stage::kRead, f.name, "",
                    "the file changed between prepare() and commit() (" +
                        io::describe_change(f.identity, now) + "): prepare again");
      }
    }
    handle.check_cancel();
    stream(w, handle);
  }
  handle.phase.store(LoadPhase::kVerify);
  handle.check_cancel();
  verify_startup(w);
  const Clock::time_point t_ready = Clock::now();
  report.startup.commit = seconds_between(t_commit, t_ready);
  report.startup.time_to_ready = seconds_between(w.begin, t_ready);
  w.state->report = report;
  LoadResult result;
  result.model = w.loaded;
  return result;
}

}  // namespace ferry::runtime
