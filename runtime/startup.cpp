// The capture-safe startup (include/ferry/runtime.hpp): prepare() admits overlap or
// runs serially, fills the shells with the sentinel, runs the hooks on it, records
// the storage manifest and starts the prefetch; commit() streams the real weights
// into the same storage and verifies it against the manifest.
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "common/format.hpp"
#include "common/log.hpp"
#include "gpu/kernels_host.hpp"
#include "io/prefetch.hpp"
#include "runtime/load_work.hpp"

namespace ferry::runtime {

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

std::string rank_name(const LoadedModel::State& state, std::size_t local_rank,
                      const std::string& param) {
  return param + " (tp rank " + std::to_string(state.ranks.at(local_rank).tp_rank) + ")";
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
    resources.ranks.at(r).stream->copy_h2d(c.table.data(),
                                           reinterpret_cast<const std::byte*>(tables[r].data()),
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
    stream.match_pattern(reinterpret_cast<const gpu::PatternRange*>(c.table.data()), c.names.size(),
                         flags);
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

void check_unchanged(const io::CheckpointFile& f, const std::string& when,
                     const std::string& then) {
  const io::FileIdentity now = identity_now(f);
  if (f.identity.known() && now != f.identity) {
    throw Error(
        Stage::kRead, f.name, "",
        "the file changed " + when + " (" + io::describe_change(f.identity, now) + "): " + then);
  }
}

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

std::vector<StartupRefusal> Runtime::Impl::overlap_refusals(const LoadWork& w) const {
  std::vector<StartupRefusal> out;
  if (config.model.load_format == io::LoadFormat::kDummy) {
    out.push_back({"load_format",
                   "the dummy format reads nothing to overlap with a capture: prepare() fills "
                   "the parameters in full"});
  }
  // Every file format ferry reads (safetensors, torch.save archives) gives each
  // tensor's place before any data is read, so none is refused here.
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
                       join_first(not_idempotent, 8)});
  }
  if (!reallocating.empty()) {
    out.push_back({"hook_reallocates",
                   "post-load hook(s) that replace their outputs' storage, which captured graphs "
                   "would lose: " +
                       join_first(reallocating, 8)});
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

LoadResult Runtime::Impl::prepare(LoadWork& w, LoadHandle::State& handle) {
  TraceOnExit trace{*this, w};
  const bool cached = cache != CacheConfig::Mode::kOff && attach_cache(w, handle);
  if (cached || (remote && pull_remote(w, handle))) {
    // A daemon's parameters are complete and stay where they are, and a seed's were
    // pulled complete: commit() verifies.
    w.mode = StartupMode::kSerial;
    w.report.startup_mode = "serial";
    w.report.startup_refusals.push_back(
        cached ? StartupRefusal{"ipc_cache",
                                "the parameters are views of a weight-cache daemon's memory: "
                                "complete already, nothing to stream"}
               : StartupRefusal{"remote_instance",
                                "the parameters were pulled complete from a seed in "
                                "prepare(): nothing to stream"});
    w.state->manifest = record_manifest(*w.state);
    w.prepared_at = Clock::now();
    w.report.startup.prepare = seconds_between(w.begin, w.prepared_at);
    w.state->report = w.report;
    w.loaded = std::make_shared<LoadedModel>(w.state);
    trace.armed = false;
    LoadResult result;
    result.model = w.loaded;
    return result;
  }
  resolve_and_plan(w, handle, config);
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
               " storage manifest entr(ies) changed since prepare(): " + join_first(moved, 8);
  }
  if (!sentinel.empty()) {
    message += std::string(message.empty() ? "" : "; ") + std::to_string(sentinel.size()) +
               " floating-point parameter(s) still hold only the sentinel (nothing wrote them): " +
               join_first(sentinel, 8);
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
      check_unchanged(w.resolved.index.files[i], "between prepare() and commit()", "prepare again");
    }
    handle.check_cancel();
    stream(w, handle);
  }
  handle.phase.store(LoadPhase::kVerify);
  handle.check_cancel();
  verify_startup(w);
  finish_restart_layouts(w, handle);
  const Clock::time_point t_ready = Clock::now();
  report.startup.commit = seconds_between(t_commit, t_ready);
  report.startup.time_to_ready = seconds_between(w.begin, t_ready);
  w.state->report = report;
  LoadResult result;
  result.model = w.loaded;
  record_origin(w, result.model);
  return result;
}

}  // namespace ferry::runtime
