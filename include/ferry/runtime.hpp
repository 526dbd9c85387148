// ferry's embedding API. An inference engine builds a Runtime from a Config and
// either loads in one pass (load(), or start() to watch and cancel it), or boots
// capture-safe in two steps:
//
//   prepare()  resolve, plan, allocate every parameter, fill it with the sentinel
//              (1e-3), run the post-load hooks on it and record the storage
//              manifest; start prefetching the planned files. The engine now holds
//              a complete model whose storage will not move: it may capture CUDA
//              graphs against it.
//   commit()   stop the prefetch, stream the real weights into the same storage,
//              post-process in place, and verify against the manifest.
//
// Capture safety (overlap mode): commit() may run while another thread of the
// engine captures CUDA graphs in global mode (PyTorch's default). prepare() makes
// every CUDA object the commit needs: cudaMalloc (parameters, copy scratch, the
// sentinel check's table and flags), cudaHostAlloc (staging pools, the check's
// result), cudaStreamCreateWithFlags (a stream per local rank),
// cudaEventCreateWithFlags (each device's event pool: an event for every staging
// buffer a copy worker can hold, plus its waits). commit() then calls only
// cudaMemcpyAsync / cudaMemcpy2DAsync / cudaMemsetAsync / cudaMemset2DAsync,
// ferry's kernel launches, cudaEventRecord on pooled events and cudaEventQuery /
// cudaEventSynchronize on them, all on ferry's own (never capturing) streams, plus
// cudaSetDevice / cudaGetDevice; every thread of ferry that does first switches
// itself to cudaStreamCaptureModeRelaxed (gpu::Device::bind), so a global-mode
// capture elsewhere does not refuse its queries and waits. What prepare() made
// (cudaFree, cudaFreeHost, cudaStreamDestroy) is released after commit() has
// ended, on its (relaxed) thread; the parameters stay with the model.
//
// startup.mode decides how much of the work overlaps the engine's capture
// (serial: prepare() loads fully and commit() only verifies). Every load's result
// is a LoadedModel: for each local rank, its parameters by name with device,
// pointer, dtype, shape and strides, also as ParamViews and DLPack tensors
// (ferry/dlpack.hpp). No CAF type appears here, and nothing throws across this
// boundary: results hold either the model or the error (stage, file, tensor, rule).
//
// Lifetime: the LoadedModel owns its devices' allocations and stays valid after
// the Runtime (and its actor system) is gone, until the last reference to it (a
// handle's result, a ParamView, a DLPack tensor) is released. A failed or
// cancelled load() hands nothing over and frees everything it allocated; a failed
// or cancelled commit() keeps the prepared storage until its handles and views are
// released, because captured graphs may still point at it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/config.hpp"
#include "ferry/dtype.hpp"
#include "ferry/error.hpp"
#include "ferry/export.hpp"
#include "ferry/log.hpp"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace ferry::runtime {

struct LoadedParam {
  std::string name;  // SGLang's parameter name
  DType dtype = DType::kBF16;
  std::vector<std::uint64_t> shape;    // logical shape
  std::vector<std::uint64_t> strides;  // in elements (may be non-contiguous, e.g. MLA w_kc)
  std::byte* data = nullptr;           // device pointer (host backend: host memory)
  std::size_t nbytes = 0;              // bytes of storage
};

struct FERRY_API LoadedRank {
  int tp_rank = 0;
  int pp_rank = 0;
  std::string device;               // "host:0", "cuda:1"
  std::vector<LoadedParam> params;  // sorted by name
  const LoadedParam* find(const std::string& name) const;
};

// Why a capture-safe overlap was refused (LoadReport::startup_refusals). The codes
// are stable: "load_format" (not safetensors), "backend" (a device that keeps no
// data or cannot keep storage fixed: the null device), "io_direct" (O_DIRECT reads
// bypass the page cache, so a prefetch is meaningless), "hook_not_idempotent",
// "hook_reallocates" (models::PostLoadHook), "quantization" (quantization.online:
// the FP8 weights are written from load-only full-precision ones) and "layered"
// (load.layered allocates as the load goes).
struct StartupRefusal {
  std::string code;
  std::string message;
  bool operator==(const StartupRefusal&) const = default;
};

// What happened during a load (`--report FILE` writes json()).
struct FERRY_API LoadReport {
  // "checkpoint", "ipc_cache" (views of a `ferry serve` daemon's parameters: nothing
  // read, nothing copied), "presharded" (a presharded folder, read as stored), "sharded_state"
  // (SGLang's per-rank state dict files, read as stored), or "dummy"
  // (model.load_format dummy: every parameter filled with deterministic random values
  // on its device, nothing read; bytes_copied counts the bytes filled).
  std::string load_format = "checkpoint";
  // postprocess.target as resolved: "loader", "sm90" or "sm100" (the layout the
  // parameters were left in; auto is resolved from the device).
  std::string postprocess_target = "loader";
  // model.load_format presharded: the part folder read (runtime/presharded.hpp), and
  // whether load.verify_checksums checked every param against its manifest. "" /
  // false otherwise.
  std::string presharded_read;
  bool checksums_verified = false;
  // load.save_presharded: the part folder this load saved, "" when none was written
  // (not asked, read from one, or the same part was there already); a save that
  // failed leaves the load as it was and says why in `warnings`.
  std::string presharded_saved;
  // model.load_format sharded_state: the folder read; load.save_sharded_state: the
  // folder this load saved its ranks' files in ("" when not asked; a save that failed
  // leaves the load as it was and says why in `warnings`).
  std::string sharded_state_read;
  std::string sharded_state_saved;
  std::uint64_t bytes_read = 0;     // every byte requested from weight files: headers,
                                    // tensor data, O_DIRECT alignment
  std::uint64_t bytes_skipped = 0;  // tensor bytes never read
  // bytes_skipped by why, as `ferry plan` names it: a dropped or unmapped tensor's
  // route reason ("remote_expert", "pp_stage", "unknown_name", ...), or
  // "remote_slices" (the parts of placed tensors no local rank keeps); they add up
  // to bytes_skipped.
  std::map<std::string, std::uint64_t> bytes_skipped_by_reason;
  std::uint64_t bytes_copied = 0;      // bytes written to devices
  std::uint64_t bytes_prefetched = 0;  // page-cache prefetch reads (not in bytes_read)
  double seconds = 0;
  struct Phases {
    double resolve = 0, plan = 0, allocate = 0, stream = 0, postprocess = 0, verify = 0;
  } phases;  // add up to `seconds`; an update's allocate: binding to the storage, the snapshot
  double gbps = 0;                   // bytes_read / stream seconds / 1e9
  std::uint64_t peak_rss_bytes = 0;  // the whole process's (the engine's too)
  // Each device's allocation high water during the load (its allocation tracker's
  // peak: parameters, load-only full-precision weights, copy scratch), by device name.
  std::map<std::string, std::uint64_t> peak_device_bytes;
  // Host memory ferry itself holds for the load, as it counts it (so it means the
  // same inside an engine of any size): staging allocated, the checkpoint index
  // and the plan (from their containers), the prefetch threads' block buffers and
  // the io_uring O_DIRECT bounce buffers (at most, when enabled). The parts are in
  // host_bytes_owned_by; they add up to host_bytes_owned.
  std::uint64_t host_bytes_owned = 0;
  std::map<std::string, std::uint64_t> host_bytes_owned_by;
  std::uint64_t staging_high_water_bytes = 0;  // summed over the read lanes
  std::uint64_t staging_bytes = 0;             // staging allocated (io.staging_bytes)
  unsigned read_lanes = 0;                     // reader threads that ran (io.read_lanes)
  // Tensor bytes by the path they took from the file: read straight into params
  // (io.direct_to_device) or into staging and copied; they add up to the windows read.
  struct ReadPaths {
    std::uint64_t direct_to_device = 0, staged = 0;
  } read_paths;
  std::size_t files = 0;
  struct Tensors {
    std::size_t placed = 0, dropped = 0, unmapped = 0;
  } tensors;
  std::vector<std::string> warnings;
  // Post-load hooks not run because their device keeps no data (null devices):
  // "<hook name> on <device>", after their params were checked.
  std::vector<std::string> hooks_skipped;
  // Which path ran: "load" (start()/load()), "serial" or "overlap" (prepare() and
  // commit(), after admission); the refusals that made auto run serially.
  // "update" for an update's report (Runtime::update).
  std::string startup_mode = "load";
  std::vector<StartupRefusal> startup_refusals;
  // Runtime::update only (`ran` false otherwise): what it wrote and how it could have
  // been undone.
  struct Update {
    bool ran = false;
    std::string source;              // the folder read, or "tensors" (in memory)
    std::size_t params_written = 0;  // over the local ranks, hook outputs included
    std::size_t params_unchanged = 0;
    std::uint64_t bytes_written = 0;  // the written params' bytes
    std::vector<std::string> hooks_rerun;
    // How a failure would have been undone: "snapshot" (the written params copied to
    // host memory first, within update.rollback_bytes), "reread" (the old source
    // read again: its files' stamps were unchanged) or "none" (neither: a failure
    // marks the model invalid).
    std::string rollback = "none";
    std::uint64_t snapshot_bytes = 0;
  } update;
  // The weight cache (cache.mode, model.load_format ipc_cache; `ferry serve`).
  struct Cache {
    // "off"; "daemon" or "client" for a load that asked for a daemon; "serve" for a
    // daemon's own load.
    std::string mode = "off";
    bool attached = false;     // the params are views of a daemon's memory
    std::string socket;        // the daemon's (attached, or serving)
    std::string fingerprint;   // SHA-256 of what decides the bytes
    int daemon_pid = 0;        // attached: the daemon's process
    std::string fallback;      // client mode, no daemon: why it read from disk ("" else)
    std::size_t storages = 0;  // attached: shared blocks mapped
    std::uint64_t bytes_mapped = 0;
  } cache;
  struct Remote {             // model.load_format remote_instance only
    std::string seed;         // HOST:PORT of the seed asked
    bool pulled = false;      // the params came from the seed
    std::string fingerprint;  // the layout's (SHA-256)
    std::string transports;   // remote.transports ("auto": UCX's choice)
    std::uint64_t bytes = 0;  // pulled
    std::size_t params = 0;   // pulled (empty ones aside)
    double seconds = 0;       // the pull itself
    double gbps = 0;          // bytes / seconds / 1e9
    bool staged = false;      // through host memory (devices UCX cannot register)
    std::string fallback;     // the seed could not be reached: why the files were read
  } remote;
  struct Startup {                       // prepare()/commit() only
    double prepare = 0;                  // prepare() called .. prepared
    double sentinel = 0;                 // of it: sentinel fill, hooks on it, manifest
    double capture = 0;                  // prepared .. commit() called (the engine's capture)
    double commit = 0;                   // commit() called .. ready
    double time_to_ready = 0;            // prepare() called .. ready
    std::uint64_t bytes_prefetched = 0;  // by the prefetch that ran during the capture
  } startup;

  // The report as a JSON object's text (`indent` < 0: one line), the form of
  // `ferry load --report FILE`.
  std::string json(int indent = 2) const;
  std::string summary() const;  // a few human lines for the CLI
};

// One entry of the storage manifest prepare() records: where a parameter (or a
// post-load hook's derived buffer, e.g. MLA w_kc) lives. commit() fails when any
// field of any entry changed.
struct ManifestEntry {
  std::size_t local_rank = 0;  // index into LoadedModel::ranks()
  std::string name;
  std::string device;
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;       // bytes of storage
  std::uint64_t byte_offset = 0;  // from the start of the allocation that holds it
  DType dtype = DType::kBF16;
  std::vector<std::uint64_t> shape;
  std::vector<std::uint64_t> strides;  // in elements
  bool operator==(const ManifestEntry&) const = default;
};

class LoadedModel;

// A parameter or derived buffer as an engine binds it. Holding a view keeps the
// whole loaded model (every allocation) alive.
struct ParamView {
  std::string name;
  std::string device;  // "host:0", "cuda:1"
  int tp_rank = 0;
  std::byte* data = nullptr;
  DType dtype = DType::kBF16;  // the real dtype (DLPack shows FP8 as uint8)
  std::vector<std::uint64_t> shape;
  std::vector<std::uint64_t> strides;  // in elements
  std::uint64_t byte_offset = 0;       // from the start of its allocation
  std::shared_ptr<const LoadedModel> model;
};

class FERRY_API LoadedModel : public std::enable_shared_from_this<LoadedModel> {
 public:
  struct State;  // devices, allocations, params (runtime/load_work.hpp)
  explicit LoadedModel(std::shared_ptr<State> state);

  const std::vector<LoadedRank>& ranks() const;
  // Complete once the load (or commit) has ended; prepare() gives the part so far.
  const LoadReport& report() const;
  // The storage manifest recorded by prepare() (empty for start()/load()).
  const std::vector<ManifestEntry>& manifest() const;
  // Every parameter and derived buffer of every local rank, by rank then name. The
  // model must be owned by a shared_ptr (it always is when ferry hands it over).
  std::vector<ParamView> views() const;
  // Copies one parameter back to host memory in its storage layout (nbytes bytes).
  // Both this and dump() fail on devices that keep no data (null devices).
  std::vector<std::byte> read_param(std::size_t rank_index, const std::string& name) const;
  // Writes DIR/rank-<tp rank>.safetensors per local rank: every parameter in its
  // logical shape, contiguous, names as keys. Creates DIR when missing. Refused for
  // an invalid model.
  void dump(const std::string& dir) const;
  // False once an update failed and the old weights could not be restored: the
  // parameters then hold a mix of old and new bytes, and invalid_reason() says what
  // happened. An update that writes every parameter makes the model valid again.
  bool valid() const;
  std::string invalid_reason() const;

 private:
  std::shared_ptr<State> state_;
};

struct ErrorInfo {
  Stage stage = Stage::kConfig;
  std::string file;
  std::string tensor;
  std::string rule;
  std::string message;  // what() of the error: "stage: file: tensor 'x': rule"
};

struct LoadResult {
  std::shared_ptr<LoadedModel> model;  // null on failure
  std::optional<ErrorInfo> error;      // set on failure
  explicit operator bool() const { return model != nullptr; }
};

// Where a load is, for an engine that watches it.
// kSentinel: prepare() in overlap mode fills the shells with the sentinel, runs the
// hooks on them and records the manifest.
enum class LoadPhase {
  kStarting,
  kResolve,
  kPlan,
  kAllocate,
  kSentinel,
  kStream,
  kVerify,
  kDone,
  kFailed
};
FERRY_API std::string_view to_string(LoadPhase phase);

// A snapshot of a running (or finished) load.
struct LoadProgress {
  LoadPhase phase = LoadPhase::kStarting;
  std::uint64_t bytes_planned = 0;  // tensor bytes the plan reads (0 until planned)
  std::uint64_t bytes_read = 0;     // of them, read so far (the planned windows: no headers,
                                    // no O_DIRECT widening)
  std::uint64_t bytes_copied = 0;   // param bytes written from checkpoint data so far
  std::size_t tensors_placed = 0;   // checkpoint tensors the plan places (0 until planned)
  bool operator==(const LoadProgress&) const = default;
};

// What an engine is told while a load runs. Both run on one ferry thread per load,
// never on a reader or copy worker: a slow callback delays only the callbacks.
// Progress updates coalesce (a callback sees the latest snapshot, not every
// step). A callback that throws fails the load (Stage::kCancelled, its message
// naming the callback and what it threw).
struct LoadCallbacks {
  // Called when the progress has changed, at most every few milliseconds, and
  // once at the end; returning false cancels the load.
  std::function<bool(const LoadProgress&)> on_progress;
  // Called once per decoder layer and tp rank when every parameter of that layer on
  // that rank has landed on the device (post-load hook outputs included), so that
  // an engine can start on early layers. Layer indices are the checkpoint's
  // (model.layers.<i>.); the draft model's layer, which has none, is not reported.
  std::function<void(std::uint64_t layer, int tp_rank)> on_layer_ready;
  // A model attached to a weight-cache daemon (cache.mode): called once, from the
  // model's watchdog thread, when the daemon is no longer the process it attached
  // to (checked every cache.watch_ms), with a message saying what was seen. Unset:
  // ferry logs the message and aborts the process, as SGLang does, because graphs
  // captured against the daemon's memory would read freed memory (CUDA). Host
  // devices' memfd mappings stay valid after the daemon's death: an engine on them
  // may choose to go on. Must not throw; the watchdog stops after calling it.
  std::function<void(const std::string& why)> on_cache_lost;
};

// One load started by Runtime::start(). Copyable; every copy is the same load.
// The load runs on a thread of the Runtime whether or not a handle is kept.
class FERRY_API LoadHandle {
 public:
  // Blocks until the load ends; returns its result (the same on every call).
  LoadResult wait() const;
  // The result when the load ends within `timeout`, else nullopt. A timeout too
  // large for the clock (milliseconds::max()) waits without a deadline; a negative
  // one is a deadline already passed.
  std::optional<LoadResult> wait_for(std::chrono::milliseconds timeout) const;
  // Asks this load to stop; it ends with Stage::kCancelled unless it already ended.
  // Thread-safe, never blocks.
  void cancel() const;
  LoadProgress progress() const;
  bool done() const;

  struct State;  // internal (runtime/load_work.hpp)

 private:
  friend class Runtime;
  explicit LoadHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// Memory an embedding engine manages, for parameters: with one, every parameter
// (one call each) comes from it instead of the device backend. Called from the
// loading thread; release may be called from any thread.
class FERRY_API Allocator {
 public:
  virtual ~Allocator() = default;
  // `bytes` (> 0) bytes for `device` ("host:0", "cuda:1"), aligned to `alignment`:
  // device memory the backend can copy into (host memory for host devices). Throw
  // (or return null) to refuse; the load then fails naming the parameter.
  virtual void* allocate(const std::string& device, std::size_t bytes, std::size_t alignment) = 0;
  // Gives back what allocate returned, once, when nothing of the load uses it any
  // more (the loaded model, its views and DLPack tensors are gone, or the load failed).
  virtual void release(const std::string& device, void* data, std::size_t bytes) noexcept = 0;
};

// Where a Runtime is. start(): created -> loading -> ready. prepare()/commit():
// created -> preparing -> prepared -> committing -> ready. update(): ready (or
// failed, with a model) -> updating -> ready. Anything can end in failed; start() or
// prepare() leaves ready or failed for a new load.
enum class RuntimeState {
  kCreated,
  kLoading,
  kPreparing,
  kPrepared,
  kCommitting,
  kReady,
  kFailed,
  kUpdating
};
FERRY_API std::string_view to_string(RuntimeState state);

// One tensor of an in-memory update: a checkpoint's name (the whole tensor, as the
// checkpoint stores it; ferry shards it by its rules) and its bytes, contiguous and
// row-major, borrowed for the call. ferry/dlpack.hpp makes one from a DLPack tensor.
struct UpdateTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<std::uint64_t> shape;
  const std::byte* data = nullptr;
  // Where `data` lives: "host" (host memory), or the name of one of the model's
  // devices ("cuda:1"), read back through it.
  std::string device = "host";
};

// What Runtime::update writes into the loaded model: a checkpoint folder (SGLang's
// update_weights_from_disk), or named tensors in memory (update_weights_from_tensor),
// exactly one of the two; `names`, when not empty, keeps only the source's tensors
// whose name matches one of these shell globs (fnmatch: `*`, `?`, `[...]`).
// `load_format` reads the folder as model.load_format would ("safetensors",
// "presharded", "sharded_state", ...); "" = the Runtime's own (its dummy: auto).
// In-memory tensors are always a checkpoint's.
struct UpdateSource {
  std::string folder;
  std::vector<UpdateTensor> tensors;
  std::vector<std::string> names;
  std::string load_format;

  static UpdateSource from_folder(std::string folder, std::vector<std::string> names = {},
                                  std::string load_format = {}) {
    UpdateSource s;
    s.folder = std::move(folder);
    s.names = std::move(names);
    s.load_format = std::move(load_format);
    return s;
  }
  static UpdateSource from_tensors(std::vector<UpdateTensor> tensors,
                                   std::vector<std::string> names = {}) {
    UpdateSource s;
    s.tensors = std::move(tensors);
    s.names = std::move(names);
    return s;
  }
};

class FERRY_API Runtime {
 public:
  // `allocator`: parameters come from the engine's memory (null: from the devices).
  // The null device keeps no data and refuses one.
  explicit Runtime(Config config, std::shared_ptr<Allocator> allocator = nullptr);
  // Cancels a load still running and waits for it to stop.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Starts one load on a ferry thread and returns at once. One load at a time: a
  // start() while the previous load runs returns a handle whose result is an error
  // (Stage::kConfig, "a load is already running"); so does one while a prepared
  // model waits for commit(). One serial pass whatever startup.mode says. Never
  // throws.
  LoadHandle start(LoadCallbacks callbacks = {});
  // start().wait(). Never throws.
  LoadResult load();
  // Writes new weights into the storage of the model this Runtime loaded last (by
  // load()/start() or commit(); it must still be held): every address stays as it
  // was, so CUDA graphs captured against it stay valid. The source is read, placed,
  // sharded and post-processed as the load was, into the parameters its tensors
  // feed (and the hooks those feed); every other parameter keeps its bytes.
  // Before a byte is written, the source's names, shapes, dtypes, the coverage of
  // every parameter it touches and its files' stamps are checked; a source that
  // does not fit is refused naming the tensor. A failure while writing restores the
  // old weights (LoadReport::Update::rollback says how) or, when that is not
  // possible, marks the model invalid (LoadedModel::valid()); the error says which
  // happened. The result's model is the same model, whose report() is now the
  // update's. Refused (Stage::kConfig, "update refused: <code>: ...") while a load
  // runs ("running"), while a prepare() waits for commit() ("prepared"), with no
  // model held ("no_model"), a source that names no folder or tensors, or both
  // ("source"), and devices that keep no data ("backend"). Never throws.
  LoadHandle start_update(UpdateSource source, LoadCallbacks callbacks = {});
  LoadResult update(UpdateSource source);
  // Capture-safe startup, step 1 (see the top of this file): returns at once; the
  // handle's result is the prepared model, whose storage then stays where it is.
  // Same rules as start() for a load already running; also refused while a
  // prepared model waits for commit().
  LoadHandle prepare(LoadCallbacks callbacks = {});
  // Step 2, only in the prepared state: the handle's result is the same model, now
  // holding the real weights, or the error (the manifest check lists the entries
  // that moved and the parameters still holding only the sentinel).
  LoadHandle commit(LoadCallbacks callbacks = {});
  // Asks the load that is running, or starting (start(), prepare() or commit()), to
  // stop; it ends with Stage::kCancelled. A cancel after the call returned is never
  // lost. In the prepared state it stops the prefetch and fails the startup (the
  // prepared model stays valid for whoever holds it). With no load in progress it
  // does nothing (the next load is not affected). Thread-safe.
  void cancel();
  // Where this Runtime's messages go: everything its loads log (on every thread
  // they use) reaches `sink` instead of the process-wide sink (log::set_sink) or
  // standard error; other runtimes and the rest of the process are not affected.
  // For loads started after the call; nullptr restores the process-wide sink. The
  // sink is called from any of the load's threads, outside ferry's locks, and must
  // not call back into this Runtime. Thread-safe.
  void set_log_sink(log::Sink sink);
  RuntimeState state() const;

 private:
  friend FERRY_API void use_registry(Runtime& runtime,
                                     std::shared_ptr<prometheus::Registry> registry);
  friend FERRY_API std::vector<int> metrics_ports(const Runtime& runtime);
  struct Impl;
  // ferry's tests make one with test seams (make_runtime, internal); not exported.
  friend struct RuntimeFactory;
  explicit FERRY_HIDDEN Runtime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::runtime
