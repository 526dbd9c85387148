// Runtime::update: new weights into the storage of a loaded model
// (include/ferry/runtime.hpp).
//
//   plan       the source resolved and planned as a load of the same config would
//              be, through the update model (models/update_model.hpp): the params
//              its tensors feed, the hooks those feed, the rest unchanged by rule;
//              unknown names, shapes, dtypes and partial params refused here
//   bind       the plan's shells checked against the loaded params (name, dtype,
//              shape, strides, bytes) and pointed at their storage; load-only params
//              the update writes get storage of their own until the hooks ran
//   rollback   decided before a byte is written (update.rollback says which is
//              tried first): a re-read of the model's current source when its files'
//              stamps are unchanged, or a host snapshot of the params it writes when
//              they fit update.rollback_bytes; else none
//   stream     the ordinary pipeline into that storage; then the storage manifest
//              is checked unchanged (no address moved)
// A failure while streaming undoes what was written (snapshot or re-read) or marks
// the model invalid; the error says which.
#include <fnmatch.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/format.hpp"
#include "common/log.hpp"
#include "io/discover.hpp"
#include "io/safetensors_writer.hpp"
#include "models/update_model.hpp"
#include "runtime/load_work.hpp"

namespace ferry::runtime {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void refuse(const std::string& code, const std::string& why) {
  throw Error(Stage::kConfig, "", "", "update refused: " + code + ": " + why);
}

// In-memory tensors laid out as a checkpoint folder (model.safetensors beside the
// loaded model's config.json) in update.tensor_dir; removed with this object.
class TensorFolder {
 public:
  TensorFolder(const UpdateSource& source, const LoadedModel::State& model,
               const std::string& tensor_dir, const std::string& config_folder) {
    check(source, model);
    std::string pattern = (fs::path(tensor_dir) / "ferry-update-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw Error(
          Stage::kOutput, tensor_dir, "",
          "update.tensor_dir: cannot make a folder for the update's tensors: " + errno_text(errno));
    }
    path_ = pattern;
    for (const char* meta : {"config.json", "hf_quant_config.json"}) {
      std::error_code file_ec;
      const bool is_file = fs::is_regular_file(config_folder, file_ec);  // a dummy load's path
      if (is_file && std::string(meta) != "config.json") {
        continue;
      }
      const fs::path from = is_file ? fs::path(config_folder) : fs::path(config_folder) / meta;
      std::error_code ec;
      if (!fs::exists(from, ec)) {
        continue;
      }
      fs::copy_file(from, fs::path(path_) / meta, ec);
      if (ec) {
        throw Error(Stage::kOutput, from.string(), "",
                    "update: cannot copy beside the update's tensors: " + ec.message());
      }
    }
    write(source, model);
  }
  ~TensorFolder() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TensorFolder(const TensorFolder&) = delete;
  TensorFolder& operator=(const TensorFolder&) = delete;
  const std::string& path() const { return path_; }

 private:
  static std::uint64_t nbytes(const UpdateTensor& t) {
    std::uint64_t n = dtype_size(t.dtype);
    for (std::uint64_t d : t.shape) {
      if (d != 0 && n > UINT64_MAX / d) {
        throw Error(Stage::kConfig, "", t.name, "update: the tensor's byte size overflows");
      }
      n *= d;
    }
    return n;
  }
  static gpu::Device* device_of(const UpdateTensor& t, const LoadedModel::State& model) {
    if (t.device == "host") {
      return nullptr;
    }
    for (const auto& d : model.devices) {
      if (d->name() == t.device) {
        return d.get();
      }
    }
    throw Error(Stage::kConfig, "", t.name,
                "update: the tensor lives on '" + t.device +
                    "', which is neither host memory (\"host\") nor a device of the model");
  }
  static void check(const UpdateSource& source, const LoadedModel::State& model) {
    std::vector<std::string> names;
    for (const UpdateTensor& t : source.tensors) {
      if (t.name.empty() || t.name.find('\0') != std::string::npos) {
        throw Error(Stage::kConfig, "", t.name, "update: a tensor needs a name (without NUL)");
      }
      if (nbytes(t) != 0 && t.data == nullptr) {
        throw Error(Stage::kConfig, "", t.name, "update: the tensor has no data");
      }
      device_of(t, model);
      names.push_back(t.name);
    }
    std::sort(names.begin(), names.end());
    if (auto d = std::adjacent_find(names.begin(), names.end()); d != names.end()) {
      throw Error(Stage::kConfig, "", *d, "update: the tensor is given twice");
    }
  }
  void write(const UpdateSource& source, const LoadedModel::State& model) {
    constexpr std::uint64_t kBlock = std::uint64_t{16} << 20;
    io::SafetensorsWriter writer((fs::path(path_) / "model.safetensors").string(), Stage::kOutput,
                                 "update.tensor_dir");
    for (const UpdateTensor& t : source.tensors) {
      writer.add(t.name, t.dtype, t.shape);
    }
    writer.begin();
    std::vector<std::byte> block;
    for (const UpdateTensor& t : source.tensors) {
      const std::uint64_t n = nbytes(t);
      gpu::Device* device = device_of(t, model);
      if (device == nullptr) {
        writer.write({t.data, static_cast<std::size_t>(n)});
        continue;
      }
      // Read back through its device, a block at a time.
      auto stream = device->create_stream();
      for (std::uint64_t off = 0; off < n; off += kBlock) {
        const std::size_t len = static_cast<std::size_t>(std::min(kBlock, n - off));
        block.resize(len);
        stream->copy_d2h(block.data(), t.data + off, len);
        stream->synchronize();
        writer.write(block);
      }
    }
    writer.finish();
  }

  std::string path_;
};

std::function<bool(const std::string&)> name_filter(const std::vector<std::string>& globs) {
  if (globs.empty()) {
    return nullptr;
  }
  for (const std::string& g : globs) {
    if (g.empty() || g.find('\0') != std::string::npos) {
      refuse("source", "a names pattern is empty or holds a NUL byte");
    }
  }
  return [globs](const std::string& name) {
    return std::any_of(globs.begin(), globs.end(), [&](const std::string& g) {
      return ::fnmatch(g.c_str(), name.c_str(), 0) == 0;
    });
  };
}

// The written params' bytes copied to host memory, and back. One anonymous mapping
// holds them all, its pages populated in one call (MADV_POPULATE_WRITE): faulting
// gigabytes in page by page as the copies touch them costs seconds.
class Snapshot {
 public:
  Snapshot() = default;
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;
  ~Snapshot() {
    if (base_ != nullptr) {
      ::munmap(base_, mapped_);
    }
  }

  void take(const LoadWork& u, const models::UpdateSelection& sel) {
    const auto& shells = u.model->shells();
    for (std::size_t r = 0; r < shells.size(); ++r) {
      for (std::size_t p = 0; p < shells[r].params.size(); ++p) {
        const models::ParamSpec& spec = shells[r].params[p];
        if (sel.written[r][p] && !spec.transient && spec.nbytes != 0) {
          entries_.push_back({r, u.state->ranks[r].params[p].data, bytes_, spec.nbytes});
          bytes_ += spec.nbytes;
        }
      }
    }
    if (bytes_ == 0) {
      return;
    }
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    mapped_ = (bytes_ + page - 1) / page * page;
    void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(Stage::kConfig, "", "",
                  "update: no host memory for a snapshot of " + std::to_string(bytes_) +
                      " bytes (" + errno_text(errno) + "); lower update.rollback_bytes");
    }
    base_ = static_cast<std::byte*>(p);
#ifdef MADV_POPULATE_WRITE
    if (::madvise(base_, mapped_, MADV_POPULATE_WRITE) != 0 && errno == ENOMEM) {
      throw Error(Stage::kConfig, "", "",
                  "update: no host memory for a snapshot of " + std::to_string(bytes_) +
                      " bytes; lower update.rollback_bytes");
    }
#endif
    for (std::size_t r = 0; r < shells.size(); ++r) {
      gpu::Device& device = *u.state->devices[r];
      device.bind();
      auto stream = device.create_stream();
      for (const Entry& e : entries_) {
        if (e.rank == r) {
          stream->copy_d2h(base_ + e.offset, e.data, e.size);
        }
      }
      stream->synchronize();
    }
  }
  void restore(const LoadedModel::State& model) const {
    for (std::size_t r = 0; r < model.devices.size(); ++r) {
      gpu::Device& device = *model.devices[r];
      device.bind();
      auto stream = device.create_stream();
      for (const Entry& e : entries_) {
        if (e.rank == r) {
          stream->copy_h2d(e.data, base_ + e.offset, e.size);
        }
      }
      stream->synchronize();
    }
  }
  std::uint64_t bytes() const { return bytes_; }

 private:
  struct Entry {
    std::size_t rank = 0;
    std::byte* data = nullptr;  // the param's storage
    std::uint64_t offset = 0;   // in the mapping
    std::uint64_t size = 0;
  };
  std::vector<Entry> entries_;
  std::uint64_t bytes_ = 0;
  std::byte* base_ = nullptr;
  std::size_t mapped_ = 0;
};

// Points the update's shells at the loaded model's storage, after checking that
// they are the loaded params; load-only params the update writes get storage.
void bind(LoadWork& u, const LoadedModel::State& model, const models::UpdateSelection& sel) {
  const auto& shells = u.model->shells();
  LoadedModel::State& state = *u.state;
  if (shells.size() != model.ranks.size()) {
    refuse("model", "the source makes " + std::to_string(shells.size()) +
                        " local rank(s), the loaded model has " +
                        std::to_string(model.ranks.size()));
  }
  state.devices = model.devices;
  state.storage.resize(shells.size());
  for (std::size_t r = 0; r < shells.size(); ++r) {
    const LoadedRank& loaded = model.ranks[r];
    LoadedRank rank;
    rank.tp_rank = loaded.tp_rank;
    rank.pp_rank = loaded.pp_rank;
    rank.device = loaded.device;
    std::size_t kept = 0;
    for (std::size_t p = 0; p < shells[r].params.size(); ++p) {
      const models::ParamSpec& spec = shells[r].params[p];
      LoadedParam param;
      param.name = spec.name;
      param.dtype = spec.dtype;
      param.shape = spec.shape;
      param.strides = spec.strides;
      param.nbytes = spec.nbytes;
      state.storage[r].emplace_back();
      if (spec.transient) {
        if (sel.written[r][p]) {
          state.storage[r][p] = allocate_param(nullptr, *state.devices[r], spec);
          param.data = state.storage[r][p].data();
        }
        rank.params.push_back(std::move(param));
        continue;
      }
      ++kept;
      const LoadedParam* have = loaded.find(spec.name);
      const std::string where = " (tp rank " + std::to_string(loaded.tp_rank) + ")";
      if (have == nullptr) {
        throw Error(Stage::kMapping, u.resolved.source.folder, spec.name,
                    "update refused: model: the source's model has this param" + where +
                        " and the loaded model does not");
      }
      if (have->dtype != spec.dtype || have->shape != spec.shape || have->strides != spec.strides ||
          have->nbytes != spec.nbytes) {
        throw Error(Stage::kMapping, u.resolved.source.folder, spec.name,
                    "update refused: model: the source makes this param" + where + " " +
                        std::string(dtype_name(spec.dtype)) + models::format_shape(spec.shape) +
                        ", the loaded model holds " + std::string(dtype_name(have->dtype)) +
                        models::format_shape(have->shape) + " (strides and bytes must agree too)");
      }
      param.data = have->data;
      rank.params.push_back(std::move(param));
    }
    if (kept != loaded.params.size()) {
      refuse("model", "the loaded model holds " + std::to_string(loaded.params.size()) +
                          " params on tp rank " + std::to_string(loaded.tp_rank) +
                          ", the source's model " + std::to_string(kept));
    }
    state.ranks.push_back(std::move(rank));
  }
}

// Whether the old source's files are as they were when it was read: a re-read then
// gives the old weights back.
std::optional<std::string> origin_changed(const LoadedModel::State::Origin& origin) {
  for (const auto& [path, identity] : origin.files) {
    io::CheckpointFile f;
    f.path = path;
    f.name = path;
    try {
      const io::FileIdentity now = identity_now(f);
      if (identity.known() && now != identity) {
        return path + " changed (" + io::describe_change(identity, now) + ")";
      }
    } catch (const Error& e) {
      return std::string(e.what());
    }
  }
  return std::nullopt;
}

}  // namespace

void Runtime::Impl::record_origin(LoadWork& w, const std::shared_ptr<LoadedModel>& model) {
  LoadedModel::State::Origin& o = w.state->origin;
  o.model = w.model;
  o.config_folder = w.resolved.source.folder.empty() ? config.model.path : w.resolved.source.folder;
  o.format = config.model.load_format;
  o.files.clear();
  o.folder.clear();
  if (config.model.load_format != io::LoadFormat::kDummy) {
    o.folder = config.model.path;
    for (const io::CheckpointFile& f : w.resolved.index.files) {
      o.files.emplace_back(f.path, f.identity);
    }
  }
  std::lock_guard lock(mu);
  last_model = model;
  last_state = w.state;
}

void Runtime::Impl::plan_update(LoadWork& u, const std::string& folder, io::LoadFormat format,
                                const models::UpdateFilter& filter, models::UpdateSelection& sel,
                                const LoadedModel::State& model, LoadHandle::State& handle) {
  LoadConfig c = config;
  c.model.path = folder;
  c.model.load_format = format;
  c.load.save_presharded.clear();
  c.load.save_sharded_state.clear();
  c.load.report.clear();
  c.load.dump_dir.clear();
  c.trace.path.clear();
  resolve_and_plan(u, handle, c,
                   [&](std::shared_ptr<const models::Model> base, const ResolvedCheckpoint& r) {
                     auto m = models::make_update_model(std::move(base), r.index, filter, sel);
                     models::check_update_coverage(*m, r.index, r.source.folder);
                     return m;
                   });
  if (u.plan.unmapped > 0) {
    throw Error(Stage::kMapping, u.resolved.source.folder, u.plan.unmapped_names.front(),
                "update refused: " + std::to_string(u.plan.unmapped) +
                    " tensor(s) of the source map to no parameter of the loaded model: " +
                    join_first(u.plan.unmapped_names, 8));
  }
  if (sel.params_written == 0) {
    refuse("source", "the source's tensors (" + std::to_string(u.resolved.index.tensors.size()) +
                         " in " + folder + ") write no parameter of the loaded model" +
                         (filter.keep_tensor ? " that the names filter keeps" : ""));
  }
  bind(u, model, sel);
}

LoadResult Runtime::Impl::update(const UpdateSource& source,
                                 const std::shared_ptr<LoadedModel>& model,
                                 const std::shared_ptr<LoadedModel::State>& ms,
                                 LoadHandle::State& handle) {
  if (source.folder.empty() == source.tensors.empty()) {
    refuse("source", "name a checkpoint folder or give tensors, exactly one of the two");
  }
  std::optional<io::LoadFormat> asked;
  if (!source.load_format.empty()) {
    asked = io::parse_load_format(source.load_format);
    if (!asked || *asked == io::LoadFormat::kDummy) {
      refuse("source", "load_format '" + source.load_format +
                           "' is not a format an update reads (auto, safetensors, mistral, pt, "
                           "presharded, sharded_state)");
    }
    if (!source.tensors.empty()) {
      refuse("source", "load_format is for a folder; in-memory tensors are a checkpoint's");
    }
  }
  for (const auto& d : ms->devices) {
    if (!d->holds_data()) {
      refuse("backend",
             "device " + d->name() + " keeps no data (a null device): nothing to update");
    }
  }
  const LoadedModel::State::Origin origin = ms->origin;
  std::optional<TensorFolder> staged;
  std::string folder = source.folder;
  io::LoadFormat format = asked ? *asked
                          : config.model.load_format == io::LoadFormat::kDummy
                              ? io::LoadFormat::kAuto
                              : config.model.load_format;
  LoadWork u;
  u.metrics = current_metrics();
  models::UpdateSelection sel;
  try {
    if (!source.tensors.empty()) {
      staged.emplace(source, *ms, config.update.tensor_dir, origin.config_folder);
      folder = staged->path();
      format = io::LoadFormat::kSafetensors;
    }
    models::UpdateFilter filter;
    filter.keep_tensor = name_filter(source.names);
    plan_update(u, folder, format, filter, sel, *ms, handle);
  } catch (...) {
    if (u.metrics) {
      u.metrics->record_update("refused");
    }
    throw;
  }

  // ---- rollback, decided before a byte is written
  LoadReport::Update& up = u.report.update;
  up.ran = true;
  up.source = staged ? "tensors" : source.folder;
  up.params_written = sel.params_written;
  up.params_unchanged = sel.params_unchanged;
  up.bytes_written = sel.bytes_written;
  up.hooks_rerun = sel.hooks_rerun;
  std::uint64_t kept_bytes = 0;  // the written params the model keeps
  const auto& shells = u.model->shells();
  for (std::size_t r = 0; r < shells.size(); ++r) {
    for (std::size_t p = 0; p < shells[r].params.size(); ++p) {
      if (sel.written[r][p] && !shells[r].params[p].transient) {
        kept_bytes += shells[r].params[p].nbytes;
      }
    }
  }
  Snapshot snapshot;
  std::string no_rollback;
  std::string no_reread;
  if (origin.folder.empty()) {
    no_reread =
        "there is no old source to read again (dummy values, in-memory tensors or a "
        "partial update from another folder)";
  } else if (std::optional<std::string> changed = origin_changed(origin)) {
    no_reread = "the old source changed: " + *changed;
  }
  const bool fits = kept_bytes <= config.update.rollback_bytes;
  const bool prefer_snapshot = config.update.rollback == UpdateConfig::Rollback::kSnapshot;
  if (fits && (prefer_snapshot || !no_reread.empty())) {
    up.rollback = "snapshot";
    snapshot.take(u, sel);
    up.snapshot_bytes = snapshot.bytes();
  } else if (no_reread.empty()) {
    up.rollback = "reread";
  } else {
    no_rollback = "the written params, " + std::to_string(kept_bytes) +
                  " bytes, exceed update.rollback_bytes, and " + no_reread;
  }
  if (!no_rollback.empty()) {
    const std::string warning =
        "update: no rollback (" + no_rollback + "): a failure leaves the model invalid";
    log::warn(warning);
    u.report.warnings.push_back(warning);
  }
  handle.check_cancel();
  for (const io::CheckpointFile& f : u.resolved.index.files) {
    check_unchanged(f, "after the update read its header", "nothing was written");
  }
  // The report's allocate phase of an update: binding to the storage and the snapshot.
  u.allocated_at = Clock::now();
  u.span("bind and snapshot", u.planned_at, u.allocated_at);

  // ---- stream
  const std::vector<ManifestEntry> before = record_manifest(*ms);
  try {
    stream(u, handle);
    drop_transients(u);
    if (std::vector<std::string> moved = manifest_changes(before, *ms); !moved.empty()) {
      throw Error(Stage::kVerify, folder, "",
                  "internal: the update moved storage: " + join_first(moved, 8));
    }
  } catch (const std::exception& failure) {
    const auto* ferry_error = dynamic_cast<const Error*>(&failure);
    const Error e = ferry_error != nullptr ? *ferry_error
                                           : unexpected_error(handle.phase.load(), failure.what());
    std::string how;
    std::string outcome = "rolled_back";
    try {
      if (up.rollback == "snapshot") {
        snapshot.restore(*ms);
        how = "the old weights were restored from a snapshot of " +
              std::to_string(snapshot.bytes()) + " bytes";
      } else if (up.rollback == "reread") {
        LoadHandle::State quiet;  // not cancellable, no callbacks
        LoadWork r;
        models::UpdateSelection again;
        plan_update(r, origin.folder, origin.format, {nullptr, &sel.written}, again, *ms, quiet);
        if (again.written != sel.written) {
          throw Error(Stage::kMapping, origin.folder, "",
                      "the old source does not write the params the update wrote");
        }
        if (std::optional<std::string> changed = origin_changed(origin)) {
          throw Error(Stage::kRead, origin.folder, "", "the old source changed: " + *changed);
        }
        stream(r, quiet);
        drop_transients(r);
        how = "the old weights were read again from " + origin.folder;
      } else {
        throw Error(e.stage(), folder, "", no_rollback);
      }
    } catch (const std::exception& undo) {
      outcome = "invalid";
      how = "the old weights could not be restored (" + std::string(undo.what()) +
            "): the model is invalid, its parameters a mix of old and new bytes";
      std::lock_guard lock(ms->validity_mu);
      ms->invalid_reason = "an update from " + up.source + " failed (" + e.rule() + ") and " +
                           "could not be undone (" + undo.what() + ")";
    }
    if (u.metrics) {
      u.metrics->record_update(outcome);
    }
    throw Error(e.stage(), e.file(), e.tensor(), e.rule() + "; " + how);
  }

  // ---- the model now comes from the update's source
  const bool whole = sel.params_unchanged == 0;
  {
    LoadedModel::State::Origin& o = ms->origin;
    o.files.clear();
    o.folder.clear();
    if (!staged && whole) {
      o.folder = source.folder;
      o.format = format;
      for (const io::CheckpointFile& f : u.resolved.index.files) {
        o.files.emplace_back(f.path, f.identity);
      }
    }
    std::lock_guard lock(ms->validity_mu);
    if (whole) {
      ms->invalid_reason.clear();
    }
  }
  u.report.startup_mode = "update";
  u.report.peak_rss_bytes = peak_rss_bytes();
  ms->report = u.report;
  if (u.metrics) {
    u.metrics->record_update("applied", &u.report);
  }
  LoadResult result;
  result.model = model;
  return result;
}

}  // namespace ferry::runtime
