// The weight cache's fingerprint (runtime/cache.hpp): computed the same way by the
// daemon for its load and by a client for the load it asks for.
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "common/error.hpp"
#include "common/sha256.hpp"
#include "gpu/device.hpp"
#include "io/discover.hpp"
#include "io/file.hpp"
#include "models/postprocess.hpp"
#include "runtime/cache.hpp"
#include "runtime/config_keys.hpp"
#include "runtime/plan_report.hpp"

namespace ferry::runtime {

namespace {

nlohmann::json file_entry(const std::string& name, const io::FileIdentity& id) {
  return nlohmann::json::array({name, id.device, id.inode, id.size, id.mtime_ns});
}

io::FileIdentity stat_identity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw Error(Stage::kCache, path, "", "cannot stat a weight file for the fingerprint");
  }
  return io::identity_of(&st);
}

bool fingerprinted(std::string_view key) {
  for (const char* excluded : kFingerprintExcluded) {
    if (key == excluded) {
      return false;
    }
  }
  for (const char* section : kFingerprintSections) {
    const std::string_view s(section);
    if (key.size() > s.size() && key.substr(0, s.size()) == s && key[s.size()] == '.') {
      return true;
    }
  }
  return false;
}

// `path` is a .gguf file, or `dir` holds one.
bool has_gguf(const std::filesystem::path& dir, const std::string& path) {
  if (path.ends_with(".gguf")) {
    return true;
  }
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".gguf") {
      return true;
    }
  }
  return false;
}

}  // namespace

std::string release() {
  return FERRY_RELEASE;
}

CacheConfig::Mode cache_mode(const LoadConfig& c) {
  if (c.cache.mode == CacheConfig::Mode::kOff && c.model.load_format == io::LoadFormat::kIpcCache) {
    return CacheConfig::Mode::kDaemon;
  }
  return c.cache.mode;
}

LoadConfig disk_config(const LoadConfig& c) {
  LoadConfig out = c;
  if (cache_mode(c) != CacheConfig::Mode::kOff) {
    out.model.load_format = c.cache.fallback_format;
  }
  return out;
}

CacheIdentity cache_identity(const LoadConfig& c) {
  CacheIdentity out;
  nlohmann::json files = nlohmann::json::array();
  std::string folder;
  nlohmann::json hf_config;
  const io::LoadFormat format = c.model.load_format;
  std::string pattern;
  std::error_code ec;
  const bool file_path = std::filesystem::is_regular_file(c.model.path, ec);
  const std::filesystem::path dir = file_path ? std::filesystem::path(c.model.path).parent_path()
                                              : std::filesystem::path(c.model.path);
  // A GGUF's config is its metadata, read through its header (a metadata read): the
  // gguf format, or auto on a .gguf with no config.json beside it. Any other folder
  // without config.json takes the quick path, whose read_hf_config says so before
  // any weight file is opened.
  const bool embedded_config =
      format == io::LoadFormat::kGguf ||
      (format == io::LoadFormat::kAuto && !std::filesystem::exists(dir / "config.json", ec) &&
       has_gguf(dir, c.model.path));
  if (format == io::LoadFormat::kDummy || format == io::LoadFormat::kPresharded ||
      format == io::LoadFormat::kShardedState || embedded_config) {
    ResolvedCheckpoint resolved = resolve_checkpoint(c);
    folder = resolved.source.folder;
    hf_config = std::move(resolved.hf_config);
    for (const io::CheckpointFile& f : resolved.index.files) {
      files.push_back(file_entry(f.name, f.identity.known() ? f.identity : stat_identity(f.path)));
    }
  } else {
    // Every weight file and index of the folder, by name, without parsing an index
    // (a client attaches in the time this takes): a superset of what discovery
    // picks, so a change to any of them is a mismatch.
    folder = dir.string();
    if (!std::filesystem::is_directory(folder, ec)) {
      throw Error(Stage::kDiscovery, folder, "", "no such folder");
    }
    pattern = "*.safetensors *.bin *.pt *.gguf *.index.json";
    hf_config = read_hf_config(folder, c.io.max_metadata_bytes);
    for (const auto& e : std::filesystem::directory_iterator(folder, ec)) {
      const std::string name = e.path().filename().string();
      if ((name.ends_with(".safetensors") || name.ends_with(".bin") || name.ends_with(".pt") ||
           name.ends_with(".gguf") || name.ends_with(".index.json")) &&
          e.is_regular_file(ec)) {
        files.push_back(file_entry(name, stat_identity(e.path().string())));
      }
    }
    if (ec) {
      throw Error(Stage::kDiscovery, folder, "", "cannot list the folder: " + ec.message());
    }
  }
  std::sort(files.begin(), files.end());
  ec.clear();
  const std::filesystem::path real = std::filesystem::canonical(folder, ec);
  out.model = ec ? folder : real.string();

  nlohmann::json keys = nlohmann::json::object();
  for (const ConfigKey& key : config_keys()) {
    if (fingerprinted(key.name)) {
      keys[std::string(key.name)] = key.write(c);
    }
  }
  nlohmann::json& id = out.identity;
  id["layout_version"] = kCacheLayoutVersion;
  id["model"] = out.model;
  id["format"] = std::string(io::to_string(format)) + (pattern.empty() ? "" : " " + pattern);
  id["files"] = std::move(files);
  id["config_sha256"] = sha256_hex(hf_config.dump());
  out.hf_config = hf_config;
  id["keys"] = std::move(keys);
  id["postprocess_target"] = std::string(models::to_string(resolve_target(c)));
  if (!c.model.eplb_map.empty()) {
    id["eplb_map_sha256"] = sha256_hex(
        read_json_file(c.model.eplb_map, "the EPLB map", c.io.max_metadata_bytes).dump());
  }
  out.fingerprint = sha256_hex(id.dump());
  out.compat = {{"ferry", release()}, {"protocol", cache::kProtocolVersion}};
  return out;
}

namespace {

// The keys of two JSON objects, sorted, each once.
std::set<std::string> key_union(const nlohmann::json& a, const nlohmann::json& b) {
  std::set<std::string> keys;
  for (const nlohmann::json* o : {&a, &b}) {
    for (const auto& [k, v] : o->items()) {
      keys.insert(k);
    }
  }
  return keys;
}

}  // namespace

std::vector<std::string> identity_differences(const nlohmann::json& theirs,
                                              const nlohmann::json& ours, std::size_t limit,
                                              std::string_view peer) {
  std::vector<std::string> out;
  auto add = [&](const std::string& field, const nlohmann::json& a, const nlohmann::json& b) {
    if (out.size() < limit) {
      out.push_back(field + ": " + std::string(peer) + "'s " + a.dump() + ", this load's " +
                    b.dump());
    }
  };
  if (!theirs.is_object() || !ours.is_object()) {
    add("identity", theirs, ours);
    return out;
  }
  const nlohmann::json none;
  auto at = [&](const nlohmann::json& o, const std::string& k) -> const nlohmann::json& {
    return o.contains(k) ? o[k] : none;
  };
  for (const std::string& f : key_union(theirs, ours)) {
    const nlohmann::json& a = at(theirs, f);
    const nlohmann::json& b = at(ours, f);
    if (a == b) {
      continue;
    }
    if (f == "keys" && a.is_object() && b.is_object()) {
      for (const std::string& k : key_union(a, b)) {
        if (at(a, k) != at(b, k)) {
          add(k, at(a, k), at(b, k));
        }
      }
    } else if (f == "files" && a.is_array() && b.is_array()) {
      std::size_t shown = 0;
      for (std::size_t i = 0; i < std::max(a.size(), b.size()) && shown < 3; ++i) {
        const nlohmann::json& x = i < a.size() ? a[i] : none;
        const nlohmann::json& y = i < b.size() ? b[i] : none;
        if (x != y) {
          add("files[" + std::to_string(i) + "] (name, device, inode, size, mtime)", x, y);
          ++shown;
        }
      }
    } else {
      add(f, a, b);
    }
  }
  return out;
}

std::string device_set(const std::vector<std::shared_ptr<gpu::Device>>& devices) {
  std::string out;
  for (const auto& d : devices) {
    const std::string uuid = d->uuid();
    out += (out.empty() ? "" : ",") + (uuid.empty() ? d->name() : uuid);
  }
  return out;
}

}  // namespace ferry::runtime

namespace ferry::runtime {

LayoutIdentity layout_identity(const CacheIdentity& id) {
  LayoutIdentity out;
  out.identity = id.identity;
  for (const char* machine : {"model", "files", "format"}) {
    out.identity.erase(machine);
  }
  // A path on one machine (its contents are hashed as eplb_map_sha256).
  if (out.identity.contains("keys")) {
    out.identity["keys"].erase("model.eplb_map");
  }
  out.fingerprint = sha256_hex(out.identity.dump());
  return out;
}

}  // namespace ferry::runtime
