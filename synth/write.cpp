// Writing a synthetic checkpoint: the shard plan, the shards (safetensors or PyTorch
// .bin files written, or sparse safetensors files whose data is a hole), the index and
// configs, or one GGUF file (synth/gguf.hpp), into a temporary sibling folder that is
// then renamed into place.
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <utility>

#include "common/error.hpp"
#include "common/log.hpp"
#include "io/safetensors_writer.hpp"
#include "io/torch_writer.hpp"
#include "synth/family.hpp"
#include "synth/gguf.hpp"
#include "synth/synth.hpp"

namespace ferry::synth {

namespace fs = std::filesystem;

namespace {

// Writes all of `text` to `fd`, closing it on failure.
void write_all(int fd, const std::string& path, std::string_view text) {
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      ::close(fd);
      throw_errno(Stage::kSynth, path, "write failed", err);
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// Optionally fsyncs, then closes `fd`.
void sync_and_close(int fd, const std::string& path, bool sync) {
  if (sync && ::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    throw_errno(Stage::kSynth, path, "fsync failed", err);
  }
  if (::close(fd) != 0) {
    throw_errno(Stage::kSynth, path, "close failed", errno);
  }
}

void write_text_file(const std::string& path, const std::string& text, bool sync) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw_errno(Stage::kSynth, path, "cannot create the file", errno);
  }
  write_all(fd, path, text);
  sync_and_close(fd, path, sync);
}

// A safetensors file whose data region is a hole: the 8-byte length and the header
// exactly as io::SafetensorsWriter lays them out, then ftruncate to the full size,
// so the data reads as zeros and takes no disk.
void write_sparse_safetensors(const std::string& path,
                              const std::vector<io::SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata,
                              std::uint64_t data_bytes, bool sync) {
  std::string header = io::safetensors_header_text(entries, metadata, path);
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) {
    bytes[static_cast<std::size_t>(i)] =
        static_cast<char>((static_cast<std::uint64_t>(header.size()) >> (8 * i)) & 0xff);
  }
  bytes += header;
  std::uint64_t size = bytes.size() + data_bytes;
  if (size > static_cast<std::uint64_t>(std::numeric_limits<off_t>::max())) {
    fail(path, "a file of " + std::to_string(size) + " bytes is too large for this system");
  }
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw_errno(Stage::kSynth, path, "cannot create the file", errno);
  }
  write_all(fd, path, bytes);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    ::close(fd);
    throw_errno(Stage::kSynth, path, "cannot extend the file to " + std::to_string(size) + " bytes",
                err);
  }
  sync_and_close(fd, path, sync);
}

// Makes renames inside `dir` durable. Best effort: some file systems refuse
// fsync on a directory, which is no reason to fail a synth.
void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    if (::fsync(fd) != 0) {
      log::debug("synth: fsync of folder " + dir.string() + " failed: " + errno_text(errno));
    }
    ::close(fd);
  }
}

bool is_checkpoint_file_name(const std::string& name) {
  auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends_with(".safetensors") || ends_with(".bin") || ends_with(".gguf") || ends_with(".json");
}

enum class Target { kAbsent, kEmpty, kReplace };

// What is at `out` now, and whether this synth may take its place.
Target inspect_target(const fs::path& out, bool force) {
  std::error_code ec;
  fs::file_status st = fs::symlink_status(out, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    fail(out.string(), "cannot inspect the output folder: " + ec.message());
  }
  if (!fs::exists(st)) {
    return Target::kAbsent;
  }
  if (fs::is_symlink(st)) {
    fail(out.string(), "the output is a symbolic link; give the folder it points to");
  }
  if (!fs::is_directory(st)) {
    fail(out.string(), "the output exists and is not a folder");
  }
  fs::directory_iterator it(out, ec);
  if (ec) {
    fail(out.string(), "cannot list the output folder: " + ec.message());
  }
  bool empty = true;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) {
      fail(out.string(), "cannot list the output folder: " + ec.message());
    }
    empty = false;
    if (!force) {
      break;
    }
    std::string name = it->path().filename().string();
    if (!it->is_regular_file(ec) || it->is_symlink(ec) || !is_checkpoint_file_name(name)) {
      fail(out.string(),
           "refusing to replace the folder: it holds '" + name +
               "', which is not a checkpoint file (*.safetensors, *.bin, *.gguf, *.json)");
    }
  }
  if (ec) {
    fail(out.string(), "cannot list the output folder: " + ec.message());
  }
  if (empty) {
    return Target::kEmpty;
  }
  if (!force) {
    fail(out.string(), "the output folder exists and is not empty (pass --force to replace it)");
  }
  return Target::kReplace;
}

// A sibling folder made by mkdtemp, removed at scope exit unless released.
class TempFolder {
 public:
  TempFolder(const fs::path& out, std::string_view tag) {
    std::string tmpl = out.string() + std::string(tag) + "XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      throw_errno(Stage::kSynth, tmpl, "cannot create a temporary folder", errno);
    }
    path_ = tmpl;
    // mkdtemp makes it 0700; the checkpoint folder should read like one mkdir made.
    ::chmod(tmpl.c_str(), 0755);
  }
  ~TempFolder() {
    if (!path_.empty()) {
      std::error_code ec;
      fs::remove_all(path_, ec);
      if (ec) {
        log::write_built(
            log::Level::kWarn,
            [&] { return "synth: cannot remove " + path_.string() + ": " + ec.message(); },
            "synth: cannot remove its temporary folder");
      }
    }
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;

  const fs::path& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  fs::path path_;
};

// Puts the finished temporary folder at `out`. rename(2) replaces an empty folder
// atomically; a non-empty one is swapped with RENAME_EXCHANGE so `out` is never
// missing, and the old contents (now in the temporary folder) are removed.
void install(TempFolder& tmp, const fs::path& out, Target target) {
  if (target != Target::kReplace) {
    if (::rename(tmp.path().c_str(), out.c_str()) != 0) {
      int err = errno;
      if (err == ENOTEMPTY || err == EEXIST) {
        fail(out.string(), "the output folder was filled by someone else while synth ran");
      }
      throw_errno(Stage::kSynth, out.string(), "cannot rename the finished checkpoint into place",
                  err);
    }
    tmp.release();
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.path().c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) == 0) {
    return;  // `tmp` now holds the old checkpoint; its destructor removes it
  }
  if (errno != EINVAL && errno != ENOSYS) {
    throw_errno(Stage::kSynth, out.string(), "cannot swap the finished checkpoint into place",
                errno);
  }
  // No RENAME_EXCHANGE on this file system: move the old folder aside first.
  TempFolder old(out, ".old-");
  if (::rename(out.c_str(), old.path().c_str()) != 0) {
    throw_errno(Stage::kSynth, out.string(), "cannot move the old checkpoint aside", errno);
  }
  if (::rename(tmp.path().c_str(), out.c_str()) != 0) {
    int err = errno;
    ::rename(old.path().c_str(), out.c_str());
    throw_errno(Stage::kSynth, out.string(), "cannot rename the finished checkpoint into place",
                err);
  }
  tmp.release();
}

// Absolute, without a trailing separator, so the sibling temporary folder is
// really a sibling.
fs::path normalize_out(const std::string& out) {
  if (out.empty()) {
    fail("", "no output folder given (--out DIR)");
  }
  fs::path p = fs::absolute(fs::path(out)).lexically_normal();
  if (!p.has_filename() && p.has_relative_path()) {
    p = p.parent_path();
  }
  std::string name = p.filename().string();
  if (name.empty() || name == "." || name == "..") {
    fail(out, "the output must name a folder (not '/', '.' or '..')");
  }
  return p;
}

}  // namespace

std::optional<SynthFormat> parse_synth_format(std::string_view text) {
  if (text == "safetensors") {
    return SynthFormat::kSafetensors;
  }
  if (text == "bin") {
    return SynthFormat::kTorchBin;
  }
  if (text == "gguf") {
    return SynthFormat::kGguf;
  }
  return std::nullopt;
}

std::string_view to_string(SynthFormat format) {
  switch (format) {
    case SynthFormat::kTorchBin:
      return "bin";
    case SynthFormat::kGguf:
      return "gguf";
    case SynthFormat::kSafetensors:
      break;
  }
  return "safetensors";
}

std::string_view synth_index_file(SynthFormat format) {
  switch (format) {
    case SynthFormat::kTorchBin:
      return "pytorch_model.bin.index.json";
    case SynthFormat::kGguf:
      return "";
    case SynthFormat::kSafetensors:
      break;
  }
  return "model.safetensors.index.json";
}

std::vector<SynthShard> synth_shard_plan(const std::vector<SynthTensor>& tensors,
                                         std::uint64_t shard_bytes, SynthFormat format) {
  if (shard_bytes == 0) {
    fail("", "the shard size must be at least 1 byte");
  }
  std::vector<SynthShard> shards;
  std::vector<std::string> extra_files;  // unindexed files, in order of first use
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].file.empty()) {
      if (std::find(extra_files.begin(), extra_files.end(), tensors[i].file) == extra_files.end()) {
        extra_files.push_back(tensors[i].file);
      }
      continue;
    }
    std::uint64_t n = tensors[i].nbytes();
    if (shards.empty() || (!shards.back().tensors.empty() &&
                           n > shard_bytes - std::min(shard_bytes, shards.back().data_bytes))) {
      shards.emplace_back();
    }
    shards.back().tensors.push_back(i);
    shards.back().data_bytes += n;
  }
  if (shards.size() > 99999) {
    fail("", "the shard size gives " + std::to_string(shards.size()) +
                 " shards; file names have room for 99999");
  }
  char name[64];
  for (std::size_t s = 0; s < shards.size(); ++s) {
    std::snprintf(name, sizeof name,
                  format == SynthFormat::kTorchBin ? "pytorch_model-%05zu-of-%05zu.bin"
                                                   : "model-%05zu-of-%05zu.safetensors",
                  s + 1, shards.size());
    shards[s].file = name;
  }
  for (const std::string& file : extra_files) {
    SynthShard& shard = shards.emplace_back();
    shard.file = file;
    shard.indexed = false;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].file == file) {
        shard.tensors.push_back(i);
        shard.data_bytes += tensors[i].nbytes();
      }
    }
  }
  return shards;
}

namespace {

// What synthesize() writes, settled before any byte is.
struct Checkpoint {
  std::vector<SynthTensor> tensors;
  nlohmann::json config;
  std::uint64_t shard_bytes = 0;
  std::string family;
  std::string what;  // the "ferry_synth" metadata: how the checkpoint was made
  SynthQuant quant = SynthQuant::kNone;
  std::uint64_t quant_block = 0;
};

// With quant_from_config: the config's own FP8 block layout, if it has one (fp8 with
// weight_block_size [b, b]), else none.
void quant_from_source(const SynthSource& source, Checkpoint& c) {
  c.quant = SynthQuant::kNone;
  if (auto q = source.config.find("quantization_config"); q != source.config.end()) {
    const nlohmann::json block =
        q->is_object() ? q->value("weight_block_size", nlohmann::json()) : nlohmann::json();
    if (q->value("quant_method", std::string()) == "fp8" && block.is_array() && block.size() == 2 &&
        block[0].is_number_integer() && block[0].get<std::int64_t>() > 0 && block[0] == block[1]) {
      c.quant = SynthQuant::kFp8Block;
      c.quant_block = c.quant_block != 0 ? c.quant_block : block[0].get<std::uint64_t>();
    }
  }
  if (c.quant == SynthQuant::kFp8Block) {
    c.config["quantization_config"] = source.config.at("quantization_config");
  }
}

void from_source(const SynthOptions& options, Checkpoint& c) {
  if (!options.family.empty() || !options.preset.empty()) {
    fail(options.from_config,
         "a model config replaces the family and preset; give one or the other");
  }
  if (options.tie_embeddings) {
    fail(options.from_config, "with a model config, its tie_word_embeddings decides the lm_head");
  }
  SynthSource source = read_synth_source(options.from_config);
  c.tensors = synth_tensor_list(source, options.dtype, options.scale_hidden, options.fused_experts);
  c.config = synth_config(source, options.dtype, options.scale_hidden);
  if (options.quant_from_config) {
    quant_from_source(source, c);
  }
  c.shard_bytes = c.shard_bytes != 0 ? c.shard_bytes : kSynthSourceShardBytes;
  c.family = source.family;
  c.what = c.family + " from " + fs::path(options.from_config).filename().string();
  if (options.scale_hidden != 0) {
    c.what += " scaled to hidden " + std::to_string(options.scale_hidden);
  }
}

void from_preset(const SynthOptions& options, Checkpoint& c) {
  if (options.scale_hidden != 0) {
    fail("", "scaling the dimensions (--scale-dims) needs a model config (--from-config)");
  }
  c.tensors = synth_tensor_list(options.family, options.preset, options.dtype,
                                options.tie_embeddings, options.fused_experts);
  c.config = synth_config(options.family, options.preset, options.dtype, options.tie_embeddings);
  c.shard_bytes = c.shard_bytes != 0 ? c.shard_bytes : synth_default_shard_bytes(options.preset);
  c.what = options.family + "/" + options.preset;
}

// The quantized layout of the tensors, and config.json's quantization_config.
void quantize(const SynthOptions& options, Checkpoint& c) {
  c.quant_block = c.quant_block != 0 ? c.quant_block : 128;
  if (options.fused_experts) {
    fail(options.out, "quantized weights are not written for fused 3-D experts");
  }
  synth_quantize(c.tensors, c.quant, c.quant_block);
  if (c.quant == SynthQuant::kFp8Block) {
    if (!options.quant_from_config || !c.config.contains("quantization_config")) {
      c.config["quantization_config"] = synth_quant_config(c.quant, c.quant_block);
    }
    c.config["quantization_config"]["weight_block_size"] = {c.quant_block, c.quant_block};
    c.what += " fp8-block " + std::to_string(c.quant_block);
  } else {
    if (nlohmann::json q = synth_quant_config(c.quant, c.quant_block); !q.is_null()) {
      c.config["quantization_config"] = q;
    }
    c.what += " " + std::string(to_string(c.quant));
  }
}

// What a .bin checkpoint cannot hold.
void refuse_for_bin(const SynthOptions& options, const Checkpoint& c) {
  if (options.sparse) {
    fail(options.out,
         "--sparse cannot write .bin shards (--format bin): a ZIP member carries the "
         "CRC-32 of its bytes, so every byte must be written");
  }
  for (const SynthTensor& t : c.tensors) {
    if (!t.file.empty()) {
      fail(options.out, c.family + " writes '" + t.name + "' to the unindexed " + t.file +
                            ", which a .bin checkpoint (--format bin) has no place for");
    }
  }
}

// What a GGUF (as the converter writes it) cannot be made of; the rest is refused
// while planning (plan_synth_gguf: families, config values).
void refuse_for_gguf(const SynthOptions& options, const Checkpoint& c) {
  const std::string why =
      "--format gguf writes what llama.cpp's convert_hf_to_gguf.py makes "
      "of a plain checkpoint: ";
  if (options.sparse) {
    fail(options.out, why +
                          "--sparse cannot write it (its tensors are converted, permuted and "
                          "stacked from the values, which a hole does not have)");
  }
  if (c.quant != SynthQuant::kNone) {
    fail(options.out, why + "quantized inputs (--quant " + std::string(to_string(c.quant)) +
                          ") are refused; --gguf-type q8_0 quantizes as the converter does");
  }
  if (options.fused_experts) {
    fail(options.out, why +
                          "fused 3-D experts (--fused-experts) are refused; the GGUF stacks "
                          "the per-expert weights itself (ffn_*_exps)");
  }
  if (!synth_gguf_arch(c.family)) {
    fail(options.out, why + "family '" + c.family +
                          "' has no llama.cpp architecture ferry maps (llama, mistral, mixtral, "
                          "qwen2, qwen3, qwen3_moe, deepseek_v2, deepseek_v3)");
  }
}

Checkpoint settle(const SynthOptions& options) {
  Checkpoint c;
  c.shard_bytes = options.shard_bytes;
  c.family = options.family;
  c.quant = options.quant;
  c.quant_block = options.quant_block;
  if (!options.from_config.empty()) {
    from_source(options, c);
  } else {
    from_preset(options, c);
  }
  if (c.quant != SynthQuant::kNone) {
    quantize(options, c);
  }
  if (options.format == SynthFormat::kTorchBin) {
    refuse_for_bin(options, c);
  }
  if (options.format == SynthFormat::kGguf) {
    refuse_for_gguf(options, c);
    c.what += " gguf " + std::string(io::ggml_type_name(options.gguf_type));
  }
  c.what += " seed " + std::to_string(options.seed);
  c.what += options.fused_experts ? " fused-experts" : "";
  c.what += options.sparse ? " sparse (all zeros)" : "";
  return c;
}

// Streams the synth values of `shard`'s tensors into `writer` (begun).
template <typename Writer>
void write_values(Writer& writer, const std::vector<SynthTensor>& tensors, const SynthShard& shard,
                  const SynthOptions& options, std::vector<std::byte>& block) {
  for (std::size_t i : shard.tensors) {
    const SynthTensor& t = tensors[i];
    std::uint64_t esize = dtype_size(t.dtype);
    std::uint64_t per_block = block.size() / esize;
    std::uint64_t n = t.elements();
    for (std::uint64_t first = 0; first < n; first += per_block) {
      std::size_t count = static_cast<std::size_t>(std::min(per_block, n - first));
      std::span<std::byte> bytes(block.data(), count * esize);
      synth_encode(t.dtype, options.seed, t.value_name.empty() ? t.name : t.value_name, first,
                   bytes);
      writer.write(bytes);
    }
  }
}

// One shard with its synth values, written through io::SafetensorsWriter or, for
// kTorchBin, io::TorchWriter (which has no place for `metadata`).
void write_shard(const std::string& path, const std::vector<SynthTensor>& tensors,
                 const SynthShard& shard, const std::map<std::string, std::string>& metadata,
                 const SynthOptions& options, std::vector<std::byte>& block) {
  if (options.format == SynthFormat::kTorchBin) {
    io::TorchWriter writer(path);
    for (std::size_t i : shard.tensors) {
      writer.add(tensors[i].name, tensors[i].dtype, tensors[i].shape);
    }
    writer.begin();
    write_values(writer, tensors, shard, options, block);
    writer.finish(options.fsync ? io::TorchWriter::Sync::kFsync : io::TorchWriter::Sync::kNone);
    return;
  }
  io::SafetensorsWriter writer(path);
  for (std::size_t i : shard.tensors) {
    writer.add(tensors[i].name, tensors[i].dtype, tensors[i].shape);
  }
  writer.set_metadata(metadata);
  writer.begin();
  write_values(writer, tensors, shard, options, block);
  writer.finish(options.fsync ? io::SafetensorsWriter::Sync::kFsync
                              : io::SafetensorsWriter::Sync::kNone);
}

// Every shard of `plan` into `dir`; returns the index's weight_map.
nlohmann::json write_shards(const fs::path& dir, const Checkpoint& c,
                            const std::vector<SynthShard>& plan, const SynthOptions& options,
                            std::uint64_t total) {
  constexpr std::size_t kBlockBytes = std::size_t{4} << 20;
  std::vector<std::byte> block(options.sparse ? 0 : kBlockBytes);
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"ferry_synth", c.what}};
  nlohmann::json weight_map = nlohmann::json::object();
  std::uint64_t done = 0;
  for (const auto& shard : plan) {
    for (std::size_t i : shard.tensors) {
      if (shard.indexed) {
        weight_map[c.tensors[i].name] = shard.file;
      }
    }
    const std::string path = (dir / shard.file).string();
    if (options.sparse) {
      std::vector<io::SafetensorsEntry> entries;
      entries.reserve(shard.tensors.size());
      for (std::size_t i : shard.tensors) {
        entries.push_back({c.tensors[i].name, c.tensors[i].dtype, c.tensors[i].shape});
      }
      write_sparse_safetensors(path, entries, metadata, shard.data_bytes, options.fsync);
    } else {
      write_shard(path, c.tensors, shard, metadata, options, block);
    }
    done += shard.data_bytes;
    if (options.progress) {
      options.progress(done, total);
    }
  }
  return weight_map;
}

// The GGUF file alone, in place of the shards, index and configs.
SynthResult synthesize_gguf(const SynthOptions& options, const Checkpoint& c, const fs::path& out) {
  const GgufPlan plan =
      plan_synth_gguf(c.tensors, c.config, c.family, c.what, options.gguf_type, options.out);
  inspect_target(out, options.force);  // refuse early, before any byte is written
  std::error_code ec;
  fs::create_directories(out.parent_path(), ec);
  if (ec) {
    fail(out.parent_path().string(), "cannot create the parent folder: " + ec.message());
  }
  TempFolder tmp(out, ".tmp-");
  const std::uint64_t bytes =
      write_synth_gguf((tmp.path() / kSynthGgufFile).string(), plan, c.tensors, options.seed,
                       options.fsync, options.progress);
  if (options.fsync) {
    fsync_dir(tmp.path());
  }
  install(tmp, out, inspect_target(out, options.force));
  if (options.fsync) {
    fsync_dir(out.parent_path());
  }
  SynthResult result;
  result.files.push_back((out / kSynthGgufFile).string());
  result.total_bytes = bytes;
  result.tensors = plan.tensors.size();
  result.shards = 1;
  result.family = c.family;
  return result;
}

}  // namespace

SynthResult synthesize(const SynthOptions& options) {
  const Checkpoint c = settle(options);
  if (options.format == SynthFormat::kGguf) {
    return synthesize_gguf(options, c, normalize_out(options.out));
  }
  std::vector<SynthShard> plan = synth_shard_plan(c.tensors, c.shard_bytes, options.format);

  fs::path out = normalize_out(options.out);
  inspect_target(out, options.force);  // refuse early, before any byte is written
  std::error_code ec;
  fs::create_directories(out.parent_path(), ec);
  if (ec) {
    fail(out.parent_path().string(), "cannot create the parent folder: " + ec.message());
  }

  std::uint64_t total = 0;
  std::uint64_t indexed_total = 0;  // metadata.total_size counts the indexed shards only
  for (const auto& shard : plan) {
    total += shard.data_bytes;
    indexed_total += shard.indexed ? shard.data_bytes : 0;
  }

  TempFolder tmp(out, ".tmp-");
  nlohmann::json weight_map = write_shards(tmp.path(), c, plan, options, total);
  nlohmann::json index = {{"metadata", {{"total_size", indexed_total}}},
                          {"weight_map", weight_map}};
  const std::string index_file(synth_index_file(options.format));
  write_text_file((tmp.path() / index_file).string(), index.dump(2) + "\n", options.fsync);
  write_text_file((tmp.path() / "config.json").string(), c.config.dump(2) + "\n", options.fsync);
  const nlohmann::json hf_quant = synth_hf_quant_config(c.quant);
  if (!hf_quant.is_null()) {
    write_text_file((tmp.path() / "hf_quant_config.json").string(), hf_quant.dump(2) + "\n",
                    options.fsync);
  }
  if (options.fsync) {
    fsync_dir(tmp.path());
  }

  // Look again: the folder may have changed while the shards were written.
  install(tmp, out, inspect_target(out, options.force));
  if (options.fsync) {
    fsync_dir(out.parent_path());
  }

  SynthResult result;
  for (const auto& shard : plan) {
    result.files.push_back((out / shard.file).string());
  }
  result.files.push_back((out / index_file).string());
  result.files.push_back((out / "config.json").string());
  if (!hf_quant.is_null()) {
    result.files.push_back((out / "hf_quant_config.json").string());
  }
  result.total_bytes = total;
  result.tensors = c.tensors.size();
  result.shards = plan.size();
  result.family = c.family;
  return result;
}

}  // namespace ferry::synth
