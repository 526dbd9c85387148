// Discovery (io::resolve_source) over folder layouts built from the input: a
// Hugging Face cache shape, root/models--org--m/snapshots/rev/ (the checkpoint
// folder) beside root/models--org--m/blobs/ and root/outside/, is made once; each
// input fills the checkpoint folder with up to 10 entries (regular files, files
// in a subfolder, directories, fifos, symbolic links to blobs, to siblings, out of
// the cache folder, absolute or dangling), an index (built from shard names with
// "..", absolute and empty components among them, or raw text) and a config.json
// (GLM-4 MoE with MTP layers, or raw text), then resolves it with random options
// and removes it. The folder lives under /dev/shm where there is one.
//
// Asserted, for every source it resolves:
//  - at least one file; names unique, relative, without ".", ".." or empty
//    components, none also skipped; each path is the folder joined with its name;
//  - each chosen file is a regular file once links are followed, and resolves
//    (realpath) inside the nearest models--* folder above the checkpoint folder:
//    no link leads a load out of the cache folder;
//  - with an index, exactly the shards its weight_map names are chosen (plus a
//    GLM-4 MoE mtp.safetensors); without one, no hidden file and no training state;
//  - order: sort_weight_files 0 gives bytewise order, every rule a permutation of it.
#include <fuzzer/FuzzedDataProvider.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "fuzz/fuzz_check.hpp"
#include "io/discover.hpp"
#include "io/safetensors.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path g_root;    // root/
fs::path g_cache;   // root/models--org--m
fs::path g_folder;  // root/models--org--m/snapshots/rev: the checkpoint folder
std::string g_cache_real;

const std::vector<std::string> kNames = {
    "model.safetensors",
    "consolidated.safetensors",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "consolidated.00.safetensors",
    "mtp.safetensors",
    "pytorch_model.bin",
    "pytorch_model-00001-of-00002.bin",
    "model.pt",
    "training_args.bin",
    "optimizer.pt",
    "scaler.pt",
    ".hidden.safetensors",
    "model.safetensors.index.json",
    "consolidated.safetensors.index.json",
    "config.json",
    "sub/x.safetensors",
    "sub",
};

const std::vector<std::string> kShardNames = {
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors",
    "consolidated.safetensors",
    "sub/x.safetensors",
    "mtp.safetensors",
    "../outside.safetensors",
    "/etc/passwd",
    "./model.safetensors",
    "sub//x.safetensors",
    "",
    "sub/../model.safetensors",
};

void write(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

// A name usable as one path component (or "sub/<component>").
std::string component(FuzzedDataProvider& in) {
  std::string s = in.ConsumeRandomLengthString(24);
  for (char& c : s) {
    if (c == '/' || c == '\0') {
      c = '_';
    }
  }
  if (s.empty() || s == "." || s == "..") {
    s = "_" + s;
  }
  return s;
}

std::string pick_name(FuzzedDataProvider& in) {
  const std::size_t i = in.ConsumeIntegralInRange<std::size_t>(0, kNames.size());
  return i < kNames.size() ? kNames[i] : component(in);
}

// `s` as the inside of a JSON string: quotes, backslashes and control bytes escaped,
// other bytes as they are.
std::string quoted(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

std::string index_text(FuzzedDataProvider& in) {
  if (in.ConsumeIntegralInRange(0, 7) == 0) {
    return in.ConsumeRandomLengthString(512);
  }
  // Written by hand: a fuzzed shard name may be invalid UTF-8, which the parser
  // must refuse and nlohmann's dump() would not write.
  std::string text = "{\"weight_map\":{";
  const int n = in.ConsumeIntegralInRange(0, 6);
  for (int i = 0; i < n; ++i) {
    const std::size_t s = in.ConsumeIntegralInRange<std::size_t>(0, kShardNames.size());
    text += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":\"" +
            quoted(s < kShardNames.size() ? kShardNames[s] : component(in)) + "\"";
  }
  text += "}";
  if (in.ConsumeBool()) {
    text += ",\"metadata\":{\"total_size\":" + std::to_string(in.ConsumeIntegral<std::uint32_t>()) +
            "}";
  }
  return text + "}";
}

std::string config_text(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      return in.ConsumeRandomLengthString(256);
    case 1:
      return json{{"architectures", {"LlamaForCausalLM"}}}.dump();
    default:
      return json{
          {"architectures", {in.ConsumeBool() ? "Glm4MoeForCausalLM" : "Glm4MoeLiteForCausalLM"}},
          {"num_nextn_predict_layers", in.ConsumeIntegralInRange(-1, 2)}}
          .dump();
  }
}

std::string link_target(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 9)) {
    case 0:
      return "../../blobs/b" + std::to_string(in.ConsumeIntegralInRange(0, 3));
    case 1:
      return (g_root / "outside" / "o.safetensors").string();
    case 2:
      return "../../../outside/o.safetensors";
    case 3:
      return "../../blobs/../../outside/o.safetensors";
    case 4:
      return "missing.safetensors";
    case 5:
      return (g_cache / "blobs" / "b1").string();
    case 6:
      return ".";
    case 7:
      return component(in);
    default:
      return pick_name(in);
  }
}

void build_entry(FuzzedDataProvider& in) {
  const int kind = in.ConsumeIntegralInRange(0, 9);
  const std::string name = pick_name(in);
  const fs::path path = g_folder / name;
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  // Never write through what an earlier entry made: opening a fifo to write blocks,
  // and a link would lead the write out of the folder.
  if (fs::is_symlink(path.parent_path(), ec) || !fs::is_directory(path.parent_path(), ec)) {
    return;
  }
  fs::remove_all(path, ec);
  switch (kind) {
    case 0:
    case 1:
    case 2:
    case 3: {
      std::string bytes;
      if (name.ends_with(".index.json")) {
        bytes = index_text(in);
      } else if (name == "config.json") {
        bytes = config_text(in);
      } else {
        bytes.assign(in.ConsumeIntegralInRange(0, 16), 'x');
      }
      write(path, bytes);
      break;
    }
    case 4:
    case 5:
    case 6:
      fs::create_symlink(link_target(in), path, ec);
      break;
    case 7:
      fs::create_directories(path, ec);
      break;
    case 8:
      ::mkfifo(path.c_str(), 0600);
      break;
    default: {
      const fs::path sub = g_folder / "sub";
      fs::create_directories(sub, ec);
      if (!fs::is_symlink(sub, ec) && fs::is_directory(sub, ec)) {
        const fs::path file = sub / component(in);
        fs::remove_all(file, ec);
        write(file, "y");
      }
      break;
    }
  }
}

std::string real(const fs::path& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) != nullptr ? std::string(buf) : std::string();
}

bool is_hidden(const std::string& name) {
  return fs::path(name).filename().string().starts_with(".");
}

void check(const ferry::io::ResolvedSource& src, const ferry::io::DiscoveryOptions& options) {
  FUZZ_CHECK(!src.files.empty(), "resolved with no weight file");
  std::set<std::string> names;
  for (const auto& f : src.files) {
    FUZZ_CHECK(names.insert(f.name).second, "chosen twice: " + f.name);
    FUZZ_CHECK(!f.name.empty() && f.name.front() != '/', "not relative: " + f.name);
    for (const auto& part : fs::path(f.name)) {
      FUZZ_CHECK(part != "." && part != ".." && !part.empty(), "bad component in " + f.name);
    }
    FUZZ_CHECK(f.path == (g_folder / f.name).string(), f.path);
    struct stat st {};
    FUZZ_CHECK(::stat(f.path.c_str(), &st) == 0 && S_ISREG(st.st_mode),
               "chosen but not a regular file: " + f.name);
    const std::string target = real(f.path);
    FUZZ_CHECK(target.rfind(g_cache_real + "/", 0) == 0,
               "chosen file " + f.name + " resolves outside the cache folder: " + target);
  }
  for (const auto& s : src.skipped) {
    FUZZ_CHECK(names.count(s.name) == 0, "both chosen and skipped: " + s.name);
  }
  if (src.index_file) {
    FUZZ_CHECK(src.weight_index != nullptr);
    std::set<std::string> shards;
    for (const auto& [tensor, shard] : src.weight_index->weight_map) {
      shards.insert(shard);
    }
    for (const std::string& n : names) {
      FUZZ_CHECK(shards.count(n) == 1 || n == "mtp.safetensors", "chosen, not indexed: " + n);
    }
    for (const std::string& s : shards) {
      FUZZ_CHECK(names.count(s) == 1, "indexed, not chosen: " + s);
    }
  } else {
    for (const std::string& n : names) {
      FUZZ_CHECK(!is_hidden(n), "a hidden file chosen: " + n);
      for (const char* t :
           {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}) {
        FUZZ_CHECK(n != t, "training state chosen: " + n);
      }
    }
  }
  std::vector<std::string> order;
  for (const auto& f : src.files) {
    order.push_back(f.name);
  }
  std::vector<std::string> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  if (options.sort_weight_files == 0) {
    FUZZ_CHECK(order == sorted, "sort_weight_files 0 but not in bytewise order");
  }
}

void remove_root() {
  std::error_code ec;
  fs::remove_all(g_root, ec);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ferry::log::set_level(ferry::log::Level::kError);
  std::error_code ec;
  const fs::path base = fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0
                            ? fs::path("/dev/shm")
                            : fs::temp_directory_path();
  // The pid in the name lets scripts/fuzz.sh remove what a crashed run left.
  std::string tmpl =
      (base / ("ferry-fuzz-discover-" + std::to_string(::getpid()) + "-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) {
    std::perror("mkdtemp");
    std::abort();
  }
  g_root = tmpl;
  g_cache = g_root / "models--org--m";
  g_folder = g_cache / "snapshots" / "rev";
  fs::create_directories(g_cache / "blobs");
  fs::create_directories(g_root / "outside");
  for (int i = 0; i < 4; ++i) {
    write(g_cache / "blobs" / ("b" + std::to_string(i)), "blob");
  }
  write(g_root / "outside" / "o.safetensors", "outside");
  write(g_root / "models--org--m" / "snapshots" / "outside.safetensors", "outside the snapshot");
  g_cache_real = real(g_cache);
  std::atexit(remove_root);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  ferry::io::DiscoveryOptions options;
  options.format = static_cast<ferry::io::LoadFormat>(in.ConsumeIntegralInRange(0, 3));
  options.sort_weight_files = in.ConsumeIntegralInRange(-2, 3);
  options.tp_size = in.ConsumeIntegralInRange(0, 4);
  options.tp_rank = in.ConsumeIntegralInRange(-1, 4);

  std::error_code ec;
  fs::remove_all(g_folder, ec);
  fs::create_directories(g_folder, ec);
  const int entries = in.ConsumeIntegralInRange(1, 10);
  for (int i = 0; i < entries; ++i) {
    build_entry(in);
  }
  try {
    const ferry::io::ResolvedSource src = ferry::io::resolve_source(g_folder.string(), options);
    check(src, options);
  } catch (const ferry::Error&) {
  }
  fs::remove_all(g_folder, ec);
  return 0;
}
