#include "io/presharded.hpp"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "common/error.hpp"
#include "common/output_file.hpp"
#include "io/safetensors_writer.hpp"

namespace ferry::io {
namespace {

constexpr const char* kFormat = "ferry-presharded";

[[noreturn]] void bad(const std::string& file, const std::string& param, const std::string& what) {
  throw Error(Stage::kIndex, file, param, "presharded manifest: " + what);
}

const nlohmann::json& field(const nlohmann::json& obj, const char* key, const std::string& where,
                            const std::string& file, const std::string& param = {}) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    bad(file, param, where + key + " is missing");
  }
  return *it;
}

std::string text(const nlohmann::json& obj, const char* key, const std::string& where,
                 const std::string& file, const std::string& param = {}) {
  const nlohmann::json& v = field(obj, key, where, file, param);
  if (!v.is_string() || v.get_ref<const std::string&>().empty()) {
    bad(file, param, where + key + " must be a non-empty string");
  }
  return v.get<std::string>();
}

std::uint64_t count(const nlohmann::json& obj, const char* key, const std::string& where,
                    const std::string& file, const std::string& param = {}) {
  const nlohmann::json& v = field(obj, key, where, file, param);
  if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<std::int64_t>() < 0)) {
    bad(file, param, where + key + " must be a non-negative integer");
  }
  return v.get<std::uint64_t>();
}

Hash128 hash(const nlohmann::json& obj, const char* key, const std::string& where,
             const std::string& file, const std::string& param = {}) {
  const std::optional<Hash128> h = Hash128::from_hex(text(obj, key, where, file, param));
  if (!h) {
    bad(file, param, where + key + " must be 32 hex digits (XXH3-128)");
  }
  return *h;
}

// A file the folder holds: one plain name, nothing that leaves the folder.
bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

nlohmann::json to_json(const PreshardedManifest& m) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const PreshardedRank& r : m.ranks) {
    nlohmann::json params = nlohmann::json::array();
    for (const PreshardedParam& p : r.params) {
      params.push_back({{"name", p.name},
                        {"tensor", p.tensor},
                        {"dtype", std::string(dtype_name(p.dtype))},
                        {"shape", p.shape},
                        {"nbytes", p.nbytes},
                        {"file", p.file},
                        {"offset", p.offset},
                        {"xxh3", p.xxh3.hex()}});
    }
    ranks.push_back(
        {{"tp_rank", static_cast<std::uint64_t>(r.tp_rank)}, {"params", std::move(params)}});
  }
  return {{"format", kFormat},
          {"version", kPreshardedVersion},
          {"signature", m.signature},
          {"pp_rank", static_cast<std::uint64_t>(m.pp_rank)},
          {"structure", m.structure.hex()},
          {"ranks", std::move(ranks)}};
}

PreshardedManifest parse_presharded_manifest(const nlohmann::json& j, const std::string& file) {
  if (!j.is_object()) {
    bad(file, "", "expected a JSON object");
  }
  if (j.value("format", nlohmann::json()) != kFormat) {
    bad(file, "", "format must be \"" + std::string(kFormat) + "\"");
  }
  const nlohmann::json& version = field(j, "version", "", file);
  if (!version.is_number_integer() || version.get<std::int64_t>() != kPreshardedVersion) {
    bad(file, "",
        "version " + version.dump() + " is not the one this ferry reads (" +
            std::to_string(kPreshardedVersion) + ")");
  }
  PreshardedManifest m;
  const nlohmann::json& signature = field(j, "signature", "", file);
  if (!signature.is_object()) {
    bad(file, "", "signature must be an object of strings");
  }
  for (const auto& [key, value] : signature.items()) {
    if (!value.is_string()) {
      bad(file, "", "signature." + key + " must be a string");
    }
    m.signature[key] = value.get<std::string>();
  }
  m.structure = hash(j, "structure", "", file);
  const std::uint64_t pp_rank = count(j, "pp_rank", "", file);
  if (pp_rank > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
    bad(file, "", "pp_rank " + std::to_string(pp_rank) + " is out of range");
  }
  m.pp_rank = static_cast<int>(pp_rank);
  const nlohmann::json& ranks = field(j, "ranks", "", file);
  if (!ranks.is_array() || ranks.empty()) {
    bad(file, "", "ranks must be a non-empty array");
  }
  std::set<int> tp_ranks;
  // Every stored tensor has one file and byte range, whichever ranks list it.
  std::map<std::string, std::tuple<std::string, std::uint64_t, std::uint64_t>> ranges;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const std::string at = "ranks[" + std::to_string(i) + "].";
    const nlohmann::json& r = ranks[i];
    if (!r.is_object()) {
      bad(file, "", at.substr(0, at.size() - 1) + " must be an object");
    }
    PreshardedRank rank;
    const std::uint64_t tp = count(r, "tp_rank", at, file);
    if (tp > static_cast<std::uint64_t>(std::numeric_limits<int>::max()) ||
        !tp_ranks.insert(static_cast<int>(tp)).second) {
      bad(file, "", at + "tp_rank " + std::to_string(tp) + " is listed twice or out of range");
    }
    rank.tp_rank = static_cast<int>(tp);
    const nlohmann::json& params = field(r, "params", at, file);
    if (!params.is_array()) {
      bad(file, "", at + "params must be an array");
    }
    std::set<std::string> names;
    for (std::size_t k = 0; k < params.size(); ++k) {
      const std::string pat = at + "params[" + std::to_string(k) + "].";
      const nlohmann::json& e = params[k];
      if (!e.is_object()) {
        bad(file, "", pat.substr(0, pat.size() - 1) + " must be an object");
      }
      PreshardedParam p;
      p.name = text(e, "name", pat, file);
      if (!names.insert(p.name).second) {
        bad(file, p.name, pat + "name is listed twice for tp rank " + std::to_string(tp));
      }
      p.tensor = text(e, "tensor", pat, file, p.name);
      const std::optional<DType> dtype = parse_dtype(text(e, "dtype", pat, file, p.name));
      if (!dtype) {
        bad(file, p.name, pat + "dtype " + e["dtype"].dump() + " is not a safetensors dtype");
      }
      p.dtype = *dtype;
      const nlohmann::json& shape = field(e, "shape", pat, file, p.name);
      if (!shape.is_array()) {
        bad(file, p.name, pat + "shape must be an array of non-negative integers");
      }
      std::uint64_t elements = 1;
      for (const nlohmann::json& d : shape) {
        if (!d.is_number_integer() || (!d.is_number_unsigned() && d.get<std::int64_t>() < 0)) {
          bad(file, p.name, pat + "shape must be an array of non-negative integers");
        }
        const std::uint64_t v = d.get<std::uint64_t>();
        if (v != 0 && elements > std::numeric_limits<std::uint64_t>::max() / v) {
          bad(file, p.name, pat + "shape's element count overflows 64 bits");
        }
        elements *= v;
        p.shape.push_back(v);
      }
      p.nbytes = count(e, "nbytes", pat, file, p.name);
      const std::uint64_t es = dtype_size(p.dtype);
      if (elements > std::numeric_limits<std::uint64_t>::max() / es || p.nbytes != elements * es) {
        bad(file, p.name,
            pat + "nbytes " + std::to_string(p.nbytes) + " is not " +
                std::string(dtype_name(p.dtype)) + " x the shape's elements");
      }
      p.file = text(e, "file", pat, file, p.name);
      if (!plain_file_name(p.file)) {
        bad(file, p.name, pat + "file \"" + p.file + "\" is not a file name inside the folder");
      }
      p.offset = count(e, "offset", pat, file, p.name);
      if (p.nbytes != 0 && p.offset % kPreshardedAlignment != 0) {
        bad(file, p.name,
            pat + "offset " + std::to_string(p.offset) + " is not a multiple of " +
                std::to_string(kPreshardedAlignment));
      }
      if (p.offset > std::numeric_limits<std::uint64_t>::max() - p.nbytes) {
        bad(file, p.name, pat + "offset + nbytes overflows 64 bits");
      }
      p.xxh3 = hash(e, "xxh3", pat, file, p.name);
      const auto range = std::make_tuple(p.file, p.offset, p.nbytes);
      if (auto [it, fresh] = ranges.emplace(p.tensor, range); !fresh && it->second != range) {
        bad(file, p.name,
            pat + "tensor \"" + p.tensor + "\" is given two different files or byte ranges");
      }
      rank.params.push_back(std::move(p));
    }
    m.ranks.push_back(std::move(rank));
  }
  return m;
}

std::string presharded_mismatch(const std::map<std::string, std::string>& folder,
                                const std::map<std::string, std::string>& asked) {
  std::set<std::string> keys;
  for (const auto& [k, v] : folder) {
    keys.insert(k);
  }
  for (const auto& [k, v] : asked) {
    keys.insert(k);
  }
  for (const std::string& k : keys) {
    auto f = folder.find(k);
    auto a = asked.find(k);
    const std::string fv = f == folder.end() ? "(none)" : f->second;
    const std::string av = a == asked.end() ? "(none)" : a->second;
    if (fv != av) {
      return k + ": the folder has " + fv + ", the load asks " + av;
    }
  }
  return {};
}

// ---- writing ------------------------------------------------------------------

namespace {

[[noreturn]] void out_error(const std::string& file, const std::string& tensor,
                            const std::string& what) {
  throw Error(Stage::kOutput, file, tensor, "presharded: " + what);
}

void write_text(const std::string& path, const std::string& text) {
  OutputFile f(path, Stage::kOutput, "presharded");
  f.write(text);
  f.sync();
  f.commit();
}

// One stored tensor: a param's bytes, the same on every rank in `ranks`.
struct Stored {
  std::string tensor;
  std::size_t spec_rank = 0;  // where its bytes are read (the first of `ranks`)
  std::size_t spec_param = 0;
  std::vector<std::size_t> ranks;
  Hash128 hash;
  std::string file;
  std::uint64_t offset = 0;
};

template <typename HashOf>
PreshardedManifest write_files(
    const std::string& dir, const std::map<std::string, std::string>& signature,
    const Hash128& structure, int pp_rank, const std::vector<PreshardedRankSpec>& ranks,
    std::vector<Stored>& stored, const std::vector<std::vector<std::size_t>>& where,
    const std::map<std::string, std::vector<std::size_t>>& files, HashOf& hash_of) {
  namespace fs = std::filesystem;
  for (const auto& [name, members] : files) {
    const std::string path = (fs::path(dir) / name).string();
    SafetensorsWriter w(path, Stage::kOutput, "presharded");
    // "__pad__.<file>.<n>": the index refuses one name in two files.
    w.set_data_alignment(kPreshardedAlignment, name.substr(0, name.find('.')) + ".");
    w.set_metadata({{"format", "pt"}, {"ferry.presharded", std::to_string(kPreshardedVersion)}});
    for (std::size_t i : members) {
      const PreshardedParamSpec& spec = ranks[stored[i].spec_rank].params[stored[i].spec_param];
      // Stored in storage order as a flat tensor of the dtype: the manifest keeps the shape.
      const std::uint64_t es = dtype_size(spec.dtype);
      w.add(stored[i].tensor, spec.nbytes % es == 0 ? spec.dtype : DType::kU8,
            {spec.nbytes % es == 0 ? spec.nbytes / es : spec.nbytes});
    }
    w.begin();
    for (std::size_t i : members) {
      Stored& s = stored[i];
      const Hash128 again =
          hash_of(s.spec_rank, s.spec_param, [&w](std::span<const std::byte> b) { w.write(b); });
      if (again != s.hash) {
        out_error(path, ranks[s.spec_rank].params[s.spec_param].name,
                  "the param's bytes changed while it was written (tp rank " +
                      std::to_string(ranks[s.spec_rank].tp_rank) + ")");
      }
    }
    w.finish(SafetensorsWriter::Sync::kFsync);
    for (std::size_t k = 0, e = 0; k < w.entries().size(); ++k) {
      if (!w.is_padding(k)) {
        stored[members[e++]].offset = w.header_bytes() + w.data_begin(k);
      }
    }
  }

  PreshardedManifest m;
  m.signature = signature;
  m.structure = structure;
  m.pp_rank = pp_rank;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    PreshardedRank& out = m.ranks.emplace_back();
    out.tp_rank = ranks[r].tp_rank;
    for (std::size_t p = 0; p < ranks[r].params.size(); ++p) {
      const PreshardedParamSpec& spec = ranks[r].params[p];
      const Stored& s = stored[where[r][p]];
      out.params.push_back(
          {spec.name, s.tensor, spec.dtype, spec.shape, spec.nbytes, s.file, s.offset, s.hash});
    }
  }
  write_text((fs::path(dir) / kPreshardedManifest).string(), to_json(m).dump(1) + "\n");
  sync_folder(dir, Stage::kOutput, "presharded");
  write_text(
      (fs::path(dir) / kPreshardedReady).string(),
      nlohmann::json{{"format", kFormat}, {"version", kPreshardedVersion}, {"files", files.size()}}
              .dump() +
          "\n");
  sync_folder(dir, Stage::kOutput, "presharded");
  return m;
}

}  // namespace

PreshardedManifest write_presharded(const std::string& dir,
                                    const std::map<std::string, std::string>& signature,
                                    const Hash128& structure, int pp_rank,
                                    const std::vector<PreshardedRankSpec>& ranks,
                                    const PreshardedRead& read,
                                    const PreshardedWriteOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    out_error(dir, "", "cannot create the folder: " + ec.message());
  }
  if (!fs::is_empty(dir, ec) || ec) {
    out_error(
        dir, "",
        ec ? "cannot list the folder: " + ec.message()
           : std::string("the folder is not empty (a presharded checkpoint is written into an "
                         "empty one, so that nothing stale mixes in)"));
  }
  const std::uint64_t block = std::max<std::uint64_t>(options.block_bytes, 4096);
  std::vector<std::byte> buf;
  auto hash_of = [&](std::size_t r, std::size_t p,
                     const std::function<void(std::span<const std::byte>)>& sink) {
    Xxh3Hasher h;
    const std::uint64_t n = ranks[r].params[p].nbytes;
    for (std::uint64_t off = 0; off < n; off += block) {
      buf.resize(static_cast<std::size_t>(std::min(block, n - off)));
      read(r, p, off, buf);
      h.update(buf);
      if (sink) {
        sink(buf);
      }
    }
    return h.digest();
  };

  // Pass 1: every param's hash; identical ones across ranks are stored once.
  using Key = std::tuple<std::string, DType, std::vector<std::uint64_t>, std::uint64_t,
                         std::uint64_t, std::uint64_t>;
  std::map<Key, std::size_t> stored_of;
  std::vector<Stored> stored;
  std::vector<std::vector<std::size_t>> where(ranks.size());  // [rank][param] -> stored
  std::map<std::string, std::size_t> groups_of_name;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    for (std::size_t p = 0; p < ranks[r].params.size(); ++p) {
      const PreshardedParamSpec& s = ranks[r].params[p];
      const Hash128 h = hash_of(r, p, {});
      const Key key{s.name, s.dtype, s.shape, s.nbytes, h.high, h.low};
      auto [it, fresh] = stored_of.emplace(key, stored.size());
      if (fresh) {
        stored.push_back({s.name, r, p, {}, h, {}, 0});
        ++groups_of_name[s.name];
      }
      stored[it->second].ranks.push_back(r);
      where[r].push_back(it->second);
    }
  }
  for (Stored& s : stored) {
    if (groups_of_name[s.tensor] > 1) {  // the ranks disagree: name the rank set
      std::string set;
      for (std::size_t r : s.ranks) {
        set += (set.empty() ? "" : ",") + std::to_string(ranks[r].tp_rank);
      }
      s.tensor += "@" + set;
    }
  }

  // Files: shared tensors in common-*, each rank's own in rank-<r>-*, split at
  // max_file_bytes (counting the alignment's padding).
  std::map<std::string, std::vector<std::size_t>> files;                // name -> stored, in order
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> fill;  // prefix -> (index, bytes)
  for (std::size_t i = 0; i < stored.size(); ++i) {
    Stored& s = stored[i];
    const std::string prefix =
        s.ranks.size() > 1 ? "common" : "rank-" + std::to_string(ranks[s.ranks[0]].tp_rank);
    const std::uint64_t bytes =
        (ranks[s.spec_rank].params[s.spec_param].nbytes + kPreshardedAlignment - 1) /
        kPreshardedAlignment * kPreshardedAlignment;
    auto& [index, used] = fill[prefix];
    if (used != 0 && used + bytes > options.max_file_bytes) {
      ++index;
      used = 0;
    }
    used += bytes;
    char name[64];
    std::snprintf(name, sizeof name, "-%05llu.safetensors", static_cast<unsigned long long>(index));
    s.file = prefix + name;
    files[s.file].push_back(i);
  }

  // Pass 2: the files, each tensor hashed again as it is written. The folder was
  // empty: on any failure what this call wrote is removed again.
  try {
    return write_files(dir, signature, structure, pp_rank, ranks, stored, where, files, hash_of);
  } catch (...) {
    std::vector<fs::path> written;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      written.push_back(entry.path());
    }
    for (const fs::path& path : written) {
      fs::remove_all(path, ec);
    }
    throw;
  }
}

}  // namespace ferry::io
