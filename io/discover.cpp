// Weight-file discovery: lists the top level of a checkpoint folder, picks the files
// of the requested load format, filters them with the index when there is one, applies
// the few packaging rules SGLang knows about, orders them for the tensor-parallel rank,
// and records a reason for every choice so that `ferry inspect` can show it.
#include "io/discover.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <utility>

#include "common/enum_name.hpp"
#include "common/error.hpp"
#include "common/format.hpp"
#include "common/json_depth.hpp"
#include "common/log.hpp"
#include "common/small_file.hpp"
#include "io/safetensors.hpp"

namespace ferry::io {
namespace {

namespace fs = std::filesystem;

constexpr const char* kModelIndex = "model.safetensors.index.json";
constexpr const char* kMistralIndex = "consolidated.safetensors.index.json";
// transformers' save_pretrained(safe_serialization=False) names its index so.
constexpr const char* kBinIndex = "pytorch_model.bin.index.json";
constexpr const char* kMtpFile = "mtp.safetensors";
constexpr const char* kConfigFile = "config.json";

// Written by trainers next to the weights; never weights themselves.
constexpr std::array<std::string_view, 5> kTrainingState = {
    "training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"};

// Architectures whose checkpoints ship an mtp.safetensors the index forgets.
constexpr std::array<std::string_view, 2> kGlmMoeArchitectures = {"Glm4MoeForCausalLM",
                                                                  "Glm4MoeLiteForCausalLM"};

// What a path is once symbolic links are followed.
enum class Kind {
  kFile,      // a regular file, or a link to one
  kMissing,   // nothing there
  kDangling,  // a symbolic link whose target cannot be reached
  kOther,     // a directory, fifo, socket, device, or a link to one of those
};

struct Probe {
  Kind kind = Kind::kMissing;
  std::string detail;  // why it is not a file, e.g. "dangling symbolic link to ../blobs/ab"
};

std::string describe_type(const fs::file_status& status) {
  switch (status.type()) {
    case fs::file_type::directory:
      return "a directory";
    case fs::file_type::fifo:
      return "a fifo";
    case fs::file_type::socket:
      return "a socket";
    case fs::file_type::block:
      return "a block device";
    case fs::file_type::character:
      return "a character device";
    default:
      return "not a regular file";
  }
}

Probe probe(const fs::path& path) {
  std::error_code ec;
  const fs::file_status target = fs::status(path, ec);
  if (!ec && fs::is_regular_file(target)) {
    return {Kind::kFile, ""};
  }
  std::error_code link_ec;
  const fs::file_status link = fs::symlink_status(path, link_ec);
  if (!link_ec && fs::is_symlink(link)) {
    if (ec || !fs::exists(target)) {
      std::error_code read_ec;
      const fs::path to = fs::read_symlink(path, read_ec);
      std::string detail = "dangling symbolic link";
      if (!read_ec) {
        detail += " to " + to.string();
      }
      return {Kind::kDangling, detail};
    }
    return {Kind::kOther, "symbolic link to " + describe_type(target)};
  }
  if (!ec && !fs::exists(target)) {
    return {Kind::kMissing, ""};
  }
  if (ec) {
    // ENOENT / ENOTDIR mean "not there"; anything else (EACCES, ...) is worth showing.
    if (ec == std::errc::no_such_file_or_directory || ec == std::errc::not_a_directory) {
      return {Kind::kMissing, ""};
    }
    return {Kind::kOther, ec.message()};
  }
  return {Kind::kOther, describe_type(target)};
}

struct Entry {
  std::string name;
  Probe probe;
};

// Top-level entries in the order the directory returns them.
std::vector<Entry> list_folder(const std::string& folder) {
  std::error_code ec;
  fs::directory_iterator it(folder, ec);
  if (ec) {
    throw Error(Stage::kDiscovery, folder, "", "cannot list the folder: " + ec.message());
  }
  std::vector<Entry> out;
  const fs::directory_iterator end;
  while (it != end) {
    out.push_back({it->path().filename().string(), probe(it->path())});
    it.increment(ec);
    if (ec) {
      throw Error(Stage::kDiscovery, folder, "", "cannot list the folder: " + ec.message());
    }
  }
  return out;
}

std::vector<const char*> patterns_for(LoadFormat format) {
  switch (format) {
    case LoadFormat::kAuto:
      return {"*.safetensors", "*.bin", "*.gguf"};
    case LoadFormat::kSafetensors:
      return {"*.safetensors"};
    case LoadFormat::kMistral:
      return {"consolidated*.safetensors"};
    case LoadFormat::kPt:
      return {"*.pt"};
    case LoadFormat::kGguf:
      return {"*.gguf"};
    case LoadFormat::kDummy:
    case LoadFormat::kPresharded:
    case LoadFormat::kShardedState:
    case LoadFormat::kIpcCache:
    case LoadFormat::kRemoteInstance:
      break;
  }
  return {};
}

// Shell-style match as Python's glob does it: a leading dot must be matched literally,
// so hidden files are never weights.
bool matches(const char* pattern, const std::string& name) {
  return fnmatch(pattern, name.c_str(), FNM_PERIOD) == 0;
}

bool is_training_state(const std::string& name) {
  return std::find(kTrainingState.begin(), kTrainingState.end(), name) != kTrainingState.end();
}

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

std::string count_files(std::size_t n) {
  return std::to_string(n) + (n == 1 ? " file" : " files");
}

// Why a shard name from an index may not be used, or empty when it may. Names are
// paths relative to the folder; "." and empty components are refused too, so one file
// cannot be named twice under two spellings.
std::string bad_shard_name(const std::string& name) {
  if (name.empty()) {
    return "is empty";
  }
  if (name.find('\0') != std::string::npos) {
    return "contains a NUL character";
  }
  if (name.front() == '/') {
    return "is an absolute path";
  }
  std::size_t start = 0;
  while (start <= name.size()) {
    std::size_t slash = name.find('/', start);
    if (slash == std::string::npos) {
      slash = name.size();
    }
    const std::string_view part(name.data() + start, slash - start);
    if (part == "..") {
      return "has a '..' component";
    }
    if (part == "." || part.empty()) {
      return "has an empty or '.' component";
    }
    start = slash + 1;
  }
  return "";
}

void check_order_options(int sort_weight_files, int tp_size, int tp_rank) {
  if (sort_weight_files < -1) {
    throw Error(Stage::kConfig, "", "",
                "load.sort_weight_files must be -1 (directory order), 0 (sorted) or a positive "
                "group factor (got " +
                    std::to_string(sort_weight_files) + ")");
  }
  if (tp_size < 1) {
    throw Error(Stage::kConfig, "", "",
                "tp_size must be at least 1 (got " + std::to_string(tp_size) + ")");
  }
  if (tp_rank < 0 || tp_rank >= tp_size) {
    throw Error(Stage::kConfig, "", "",
                "tp_rank must be in [0, tp_size) (got tp_rank " + std::to_string(tp_rank) +
                    " with tp_size " + std::to_string(tp_size) + ")");
  }
}

std::string order_decision(int sort_weight_files, int tp_size, int tp_rank) {
  const std::string setting = "load.sort_weight_files=" + std::to_string(sort_weight_files);
  if (sort_weight_files == -1) {
    return "order: directory order (" + setting + ")";
  }
  if (sort_weight_files == 0) {
    return "order: sorted bytewise (" + setting + ")";
  }
  if (tp_size == 1) {
    return "order: sorted bytewise, no staggering with tp_size=1 (" + setting + ")";
  }
  const auto group = static_cast<std::int64_t>(tp_size) * sort_weight_files;
  const auto shift = static_cast<std::int64_t>(tp_rank) * sort_weight_files;
  return "order: staggered in groups of " + std::to_string(group) + ", rank " +
         std::to_string(tp_rank) + " rotated by " + std::to_string(shift) + " (sorted first; " +
         setting + ", tp_size=" + std::to_string(tp_size) + ")";
}

// Reads the generic fields of config.json the GLM-4 MoE rule needs. Returns the
// architecture that triggers the rule and num_nextn_predict_layers, or nullopt with a
// line in `decisions` saying why the rule does not apply.
struct GlmMtp {
  std::string architecture;
  std::int64_t nextn_layers = 0;
};

std::optional<GlmMtp> glm_mtp_rule(const std::string& folder, const std::string& index_name,
                                   std::uint64_t max_config_bytes,
                                   std::vector<std::string>& decisions) {
  const std::string prefix = std::string(kMtpFile) + " is not in " + index_name + "; ";
  const fs::path path = fs::path(folder) / kConfigFile;
  const Probe config = probe(path);
  if (config.kind != Kind::kFile) {
    decisions.push_back(prefix + "config.json " +
                        (config.kind == Kind::kMissing ? "is absent" : config.detail) +
                        ", so the GLM-4 MoE rule does not apply: not added");
    return std::nullopt;
  }
  nlohmann::json json;
  std::string unreadable;
  try {
    const std::string text =
        read_small_file(path.string(), Stage::kDiscovery, max_config_bytes, "config.json");
    if (json_depth(text) <= kMaxJsonDepth) {  // deeper: left null, not an object
      json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    }
  } catch (const Error& e) {
    unreadable = " (" + e.rule() + ")";
  }
  if (!unreadable.empty() || json.is_discarded() || !json.is_object()) {
    decisions.push_back(prefix + "config.json cannot be read as a JSON object" + unreadable +
                        ", so the GLM-4 MoE rule does not apply: not added");
    return std::nullopt;
  }
  std::string architecture;
  const auto archs = json.find("architectures");
  if (archs != json.end() && archs->is_array()) {
    for (const auto& arch : *archs) {
      if (arch.is_string() && std::find(kGlmMoeArchitectures.begin(), kGlmMoeArchitectures.end(),
                                        arch.get<std::string>()) != kGlmMoeArchitectures.end()) {
        architecture = arch.get<std::string>();
        break;
      }
    }
  }
  if (architecture.empty()) {
    decisions.push_back(prefix + "config.json architectures name no GLM-4 MoE model: not added");
    return std::nullopt;
  }
  std::int64_t nextn = 0;
  const auto layers = json.find("num_nextn_predict_layers");
  if (layers != json.end() && layers->is_number_integer()) {
    nextn = layers->get<std::int64_t>();
  }
  if (nextn <= 0) {
    decisions.push_back(prefix + architecture +
                        " without num_nextn_predict_layers > 0 has no MTP layers: not added");
    return std::nullopt;
  }
  return GlmMtp{architecture, nextn};
}

}  // namespace

std::string_view to_string(LoadFormat format) {
  static constexpr std::array<std::string_view, 10> kNames{
      "auto",  "safetensors", "mistral",       "pt",        "gguf",
      "dummy", "presharded",  "sharded_state", "ipc_cache", "remote_instance"};
  static_assert(kNames.size() == static_cast<std::size_t>(LoadFormat::kRemoteInstance) + 1);
  return enum_name(format, kNames, "unknown");
}

std::optional<LoadFormat> parse_load_format(std::string_view text) {
  for (LoadFormat format :
       {LoadFormat::kAuto, LoadFormat::kSafetensors, LoadFormat::kMistral, LoadFormat::kPt,
        LoadFormat::kGguf, LoadFormat::kDummy, LoadFormat::kPresharded, LoadFormat::kShardedState,
        LoadFormat::kIpcCache, LoadFormat::kRemoteInstance}) {
    if (text == to_string(format)) {
      return format;
    }
  }
  return std::nullopt;
}

std::vector<std::string> order_weight_files(std::vector<std::string> names, int sort_weight_files,
                                            int tp_size, int tp_rank) {
  check_order_options(sort_weight_files, tp_size, tp_rank);
  if (sort_weight_files == -1) {
    return names;
  }
  std::sort(names.begin(), names.end());
  if (sort_weight_files == 0 || tp_size == 1) {
    return names;
  }
  // Ranks reading a shared file system start on different files of each group.
  const std::size_t group = static_cast<std::size_t>(tp_size) * sort_weight_files;
  const std::size_t shift = static_cast<std::size_t>(tp_rank) * sort_weight_files;
  std::vector<std::string> out;
  out.reserve(names.size());
  for (std::size_t start = 0; start < names.size(); start += group) {
    const std::size_t n = std::min(group, names.size() - start);
    for (std::size_t j = 0; j < n; ++j) {
      out.push_back(std::move(names[start + (j + shift) % n]));
    }
  }
  return out;
}

namespace {

// Whether `path` is `root` or lies below it (both canonical).
bool inside(const fs::path& path, const fs::path& root) {
  auto [r, p] = std::mismatch(root.begin(), root.end(), path.begin(), path.end());
  return r == root.end();
}

// Refuses a weight file that resolves (through symbolic links) outside the
// checkpoint folder: a planted link must not make the loader read any file the
// process can. The one exception is a Hugging Face cache, whose snapshot files are
// links into ../../blobs/: links that stay inside the same `models--*` folder are
// allowed.
void check_files_stay_inside(const std::string& folder, const std::vector<std::string>& names) {
  std::error_code ec;
  const fs::path root = fs::canonical(folder, ec);
  if (ec) {
    return;  // the folder itself was probed above; nothing to compare against
  }
  fs::path allowed = root;
  for (fs::path p = root; !p.empty() && p != p.root_path(); p = p.parent_path()) {
    if (p.filename().string().rfind("models--", 0) == 0) {
      allowed = p;
      break;
    }
  }
  for (const std::string& name : names) {
    const fs::path target = fs::canonical(fs::path(folder) / name, ec);
    if (!ec && !inside(target, allowed)) {
      throw Error(Stage::kDiscovery, (fs::path(folder) / name).string(), "",
                  "resolves to " + target.string() + ", outside " +
                      (allowed == root ? "the checkpoint folder " + root.string()
                                       : "its Hugging Face cache folder " + allowed.string()) +
                      " (a weight file may link only within it)");
    }
  }
}

// What discovery has decided so far: the result being built, and the files chosen
// (in list order, the order -1 keeps) with their reasons.
struct Discovery {
  const std::string& folder;
  const DiscoveryOptions& options;
  ResolvedSource out;
  std::set<std::string> skipped_names;
  std::vector<std::string> chosen;
  std::map<std::string, std::string> reasons;

  void skip(const std::string& name, std::string reason) {
    if (skipped_names.insert(name).second) {
      out.skipped.push_back({name, std::move(reason)});
    }
  }
  void choose(const std::string& name, std::string reason) {
    chosen.push_back(name);
    reasons[name] = std::move(reason);
  }
};

// The folder's entries, once it is known to be a folder at all.
std::vector<Entry> open_model_folder(const std::string& folder, LoadFormat format) {
  if (folder.empty()) {
    throw Error(Stage::kDiscovery, "", "", "no model folder given");
  }
  if (format == LoadFormat::kDummy) {
    throw Error(Stage::kDiscovery, folder, "",
                "load format dummy reads no weight files (the runtime fills the parameters "
                "from config.json alone); there is nothing to discover");
  }
  if (format == LoadFormat::kPresharded) {
    throw Error(Stage::kDiscovery, folder, "",
                "load format presharded reads the folder's manifest, not discovered files "
                "(the runtime finds the folder)");
  }
  if (format == LoadFormat::kShardedState) {
    throw Error(Stage::kDiscovery, folder, "",
                "load format sharded_state reads each local tp rank's own files, not "
                "discovered ones (the runtime picks them)");
  }
  if (format == LoadFormat::kIpcCache) {
    throw Error(Stage::kDiscovery, folder, "",
                "load format ipc_cache maps a `ferry serve` daemon's parameters; the daemon "
                "read the files (cache.fallback_format says how to read them without one)");
  }
  if (format == LoadFormat::kRemoteInstance) {
    throw Error(Stage::kDiscovery, folder, "",
                "load format remote_instance pulls a seed's parameters over the network; "
                "nothing is read here (remote.fallback_format says how to read the files when "
                "the seed cannot be reached)");
  }
  const Probe where = probe(folder);
  if (where.kind == Kind::kMissing) {
    throw Error(Stage::kDiscovery, folder, "", "no such folder");
  }
  if (where.kind == Kind::kDangling) {
    throw Error(Stage::kDiscovery, folder, "", "not a folder: " + where.detail);
  }
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) {
    throw Error(Stage::kDiscovery, folder, "",
                "not a folder (" +
                    (where.kind == Kind::kFile ? std::string("a regular file") : where.detail) +
                    ")");
  }
  return list_folder(folder);
}

// The weight candidates (files and dangling links, in directory order) of the first
// pattern that matches one; sets the result's pattern and file format.
std::vector<const Entry*> find_candidates(Discovery& d, const std::vector<Entry>& entries) {
  const std::string format_name(to_string(d.options.format));
  std::vector<std::string> tried;
  std::vector<const Entry*> candidates;
  for (const char* p : patterns_for(d.options.format)) {
    tried.emplace_back(p);
    for (const Entry& entry : entries) {
      if (!matches(p, entry.name)) {
        continue;
      }
      if (is_training_state(entry.name)) {
        d.skip(entry.name, "training state, not weights");
      } else if (entry.probe.kind == Kind::kOther) {
        d.skip(entry.name, "not a regular file (" + entry.probe.detail + ")");
      } else {
        candidates.push_back(&entry);
      }
    }
    if (!candidates.empty()) {
      d.out.pattern = p;
      break;
    }
    d.out.decisions.push_back("load format " + format_name + ": " + p + " matched no weight file");
  }
  if (candidates.empty()) {
    std::string rule = "no weight files found (tried " + join_list(tried, ", ") + ")";
    if (!d.out.skipped.empty()) {
      std::vector<std::string> parts;
      for (const SkippedFile& s : d.out.skipped) {
        parts.push_back(s.name + " (" + s.reason + ")");
      }
      rule += "; skipped " + join_list(parts, ", ");
    }
    throw Error(Stage::kDiscovery, d.folder, "", rule);
  }
  d.out.format = ends_with(d.out.pattern, ".safetensors") ? FileFormat::kSafetensors
                 : ends_with(d.out.pattern, ".gguf")      ? FileFormat::kGguf
                                                          : FileFormat::kPickle;
  d.out.decisions.push_back("load format " + format_name + ": " + d.out.pattern + " matched " +
                            count_files(candidates.size()));
  return candidates;
}

// Whether the index decides the shard list: for safetensors and *.bin files (not
// *.pt, which has none), and an index that is there but unreadable is an error
// rather than a guess.
bool index_decides(Discovery& d, const fs::path& index_path, const std::string& index_name) {
  if (d.out.format == FileFormat::kSafetensors || d.out.pattern == "*.bin") {
    const Probe index = probe(index_path);
    if (index.kind == Kind::kDangling || index.kind == Kind::kOther) {
      // Guessing without it could load duplicate or stale files; say so instead.
      throw Error(
          Stage::kDiscovery, index_path.string(), "",
          "the index is not a readable file (" + index.detail + "), so the shard list is unknown");
    }
    return index.kind == Kind::kFile;
  }
  if (probe(index_path).kind != Kind::kMissing) {
    d.out.decisions.push_back(index_name + " is present but " + d.out.pattern +
                              " matched, so it is not used");
  }
  return false;
}

// The shard files the index names, each checked to be a relative path inside the
// folder and present; the parsed index is kept for the checkpoint index.
std::set<std::string> read_index_shards(Discovery& d, const fs::path& index_path,
                                        const std::string& index_name) {
  auto parsed = std::make_shared<const WeightIndex>(
      read_weight_index(index_path.string(), index_path.string(), d.options.max_metadata_bytes));
  const WeightIndex& index = *parsed;
  d.out.weight_index = parsed;
  if (index.weight_map.empty()) {
    throw Error(Stage::kDiscovery, index_path.string(), "",
                "the index names no shard files (weight_map is empty)");
  }
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : index.weight_map) {
    const std::string why = bad_shard_name(shard);
    if (!why.empty()) {
      throw Error(Stage::kDiscovery, index_path.string(), tensor,
                  "shard name '" + shard + "' " + why +
                      "; shard names must be relative paths inside the folder");
    }
    shards.insert(shard);
  }
  d.out.index_file = index_name;
  d.out.decisions.push_back("index " + index_name + ": " + std::to_string(index.weight_map.size()) +
                            " tensors in " + std::to_string(shards.size()) + " shard " +
                            (shards.size() == 1 ? "file" : "files"));
  std::vector<std::string> missing;
  for (const std::string& shard : shards) {
    const Probe p = probe(fs::path(d.folder) / shard);
    if (p.kind != Kind::kFile) {
      missing.push_back(p.detail.empty() ? shard : shard + " (" + p.detail + ")");
    }
  }
  if (!missing.empty()) {
    throw Error(Stage::kDiscovery, index_path.string(), "",
                std::to_string(missing.size()) + " of " + std::to_string(shards.size()) +
                    " shard files named by the index are missing: " + join_list(missing, ", "));
  }
  return shards;
}

// With an index: its shards, in listing order, then those in subfolders; a candidate
// it does not name is skipped, but for GLM's mtp.safetensors (glm_mtp_rule).
void choose_from_index(Discovery& d, const std::vector<Entry>& entries,
                       const std::vector<const Entry*>& candidates,
                       const std::set<std::string>& matched, const fs::path& index_path,
                       const std::string& index_name) {
  const std::set<std::string> shards = read_index_shards(d, index_path, index_name);
  const std::string named = "named by " + index_name;
  for (const Entry& entry : entries) {
    if (shards.count(entry.name) != 0) {
      d.choose(entry.name, matched.count(entry.name) != 0
                               ? named
                               : named + " (does not match " + d.out.pattern + ")");
    }
  }
  // A subfolder shard is not seen by the top-level listing; the index vouches for it.
  for (const std::string& shard : shards) {
    if (shard.find('/') != std::string::npos) {
      d.choose(shard, named + " (in a subfolder)");
    }
  }
  for (const Entry* entry : candidates) {
    if (shards.count(entry->name) != 0) {
      continue;
    }
    if (entry->name == kMtpFile && entry->probe.kind == Kind::kFile) {
      if (const auto glm =
              glm_mtp_rule(d.folder, index_name, d.options.max_metadata_bytes, d.out.decisions)) {
        const std::string nextn = "num_nextn_predict_layers=" + std::to_string(glm->nextn_layers);
        d.choose(entry->name,
                 std::string(kMtpFile) + " added for " + glm->architecture + " (" + nextn + ")");
        const std::string warning = std::string(kMtpFile) + " is not in " + index_name +
                                    " (a packaging bug of " + glm->architecture +
                                    " checkpoints); added it because config.json has " + nextn;
        d.out.warnings.push_back(warning);
        log::warn("discovery: " + d.folder + ": " + warning);
        continue;
      }
    }
    d.skip(entry->name, entry->probe.kind == Kind::kFile
                            ? "not in " + index_name
                            : "not in " + index_name + " (" + entry->probe.detail + ")");
  }
}

// Without an index: every candidate, but for Mistral's duplicate pair; a candidate
// that cannot be opened is an error (nothing says whether it held weights).
void choose_without_index(Discovery& d, const std::vector<const Entry*>& candidates,
                          const std::set<std::string>& matched, const std::string& index_name) {
  if (d.out.format == FileFormat::kSafetensors || d.out.pattern == "*.bin") {
    d.out.decisions.push_back("no index (" + index_name + " is absent): every file matching " +
                              d.out.pattern + " is a weight file");
  }
  // Some Mistral repositories ship the same weights twice under these two names.
  const bool duplicate_pair = candidates.size() == 2 && matched.count("model.safetensors") != 0 &&
                              matched.count("consolidated.safetensors") != 0;
  std::vector<std::string> dangling;
  for (const Entry* entry : candidates) {
    if (duplicate_pair && entry->name == "consolidated.safetensors") {
      d.skip(entry->name,
             "duplicates model.safetensors (both present, no index): kept model.safetensors");
      continue;
    }
    if (entry->probe.kind != Kind::kFile) {
      dangling.push_back(entry->name + " (" + entry->probe.detail + ")");
      continue;
    }
    d.choose(entry->name, "matches " + d.out.pattern + " (no index)");
  }
  if (!dangling.empty()) {
    // Without an index nothing says whether these were weights; loading the rest would
    // silently drop tensors.
    throw Error(Stage::kDiscovery, d.folder, "",
                std::to_string(dangling.size()) + " files matching " + d.out.pattern +
                    " cannot be opened: " + join_list(dangling, ", "));
  }
}

}  // namespace

namespace {

// model.path naming one GGUF file (SGLang's `--model-path x.gguf`): that file, in its
// folder. Nothing else of the folder is a weight file.
std::optional<ResolvedSource> gguf_file(const std::string& path, const DiscoveryOptions& options) {
  if (options.format != LoadFormat::kAuto && options.format != LoadFormat::kGguf) {
    return std::nullopt;
  }
  if (probe(path).kind != Kind::kFile ||
      (options.format == LoadFormat::kAuto && !ends_with(path, ".gguf"))) {
    return std::nullopt;
  }
  const fs::path p(path);
  ResolvedSource out;
  out.folder = p.has_parent_path() ? p.parent_path().string() : ".";
  out.load_format = options.format;
  out.format = FileFormat::kGguf;
  out.pattern = "*.gguf";
  const std::string name = p.filename().string();
  out.files.push_back({path, name, "model.path names this GGUF file"});
  out.decisions.push_back("load format " + std::string(to_string(options.format)) +
                          ": model.path is the GGUF file " + name);
  return out;
}

}  // namespace

ResolvedSource resolve_source(const std::string& folder, const DiscoveryOptions& options) {
  check_order_options(options.sort_weight_files, options.tp_size, options.tp_rank);
  if (std::optional<ResolvedSource> one = gguf_file(folder, options)) {
    return std::move(*one);
  }
  Discovery d{folder, options, {}, {}, {}, {}};
  d.out.folder = folder;
  d.out.load_format = options.format;
  const std::vector<Entry> entries = open_model_folder(folder, options.format);

  // The first pattern that matches a weight candidate wins.
  const std::vector<const Entry*> candidates = find_candidates(d, entries);
  std::set<std::string> matched;
  for (const Entry* entry : candidates) {
    matched.insert(entry->name);
  }
  const std::string index_name = options.format == LoadFormat::kMistral ? kMistralIndex
                                 : d.out.pattern == "*.bin"             ? kBinIndex
                                                                        : kModelIndex;
  const fs::path index_path = fs::path(folder) / index_name;
  if (index_decides(d, index_path, index_name)) {
    choose_from_index(d, entries, candidates, matched, index_path, index_name);
  } else {
    choose_without_index(d, candidates, matched, index_name);
  }

  ResolvedSource& out = d.out;
  if (out.format == FileFormat::kGguf && d.chosen.size() > 1) {
    // Several quantizations of one model often sit side by side; split files
    // (*-00001-of-00003.gguf) are one model in parts, which ferry does not join.
    std::vector<std::string> names = d.chosen;
    std::sort(names.begin(), names.end());
    throw Error(Stage::kDiscovery, folder, "",
                std::to_string(names.size()) + " GGUF files (" + join_list(names, ", ") +
                    "): a GGUF checkpoint is one file; name it as model.path (split GGUF "
                    "files are not joined)");
  }
  std::sort(out.skipped.begin(), out.skipped.end(),
            [](const SkippedFile& a, const SkippedFile& b) { return a.name < b.name; });
  check_files_stay_inside(folder, d.chosen);
  const std::vector<std::string> chosen = order_weight_files(
      std::move(d.chosen), options.sort_weight_files, options.tp_size, options.tp_rank);
  out.decisions.push_back(
      order_decision(options.sort_weight_files, options.tp_size, options.tp_rank));
  for (const std::string& name : chosen) {
    out.files.push_back({(fs::path(folder) / name).string(), name, d.reasons[name]});
  }
  return std::move(out);
}

}  // namespace ferry::io
