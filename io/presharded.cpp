#include "io/presharded.hpp"

#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "common/error.hpp"

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

}  // namespace ferry::io
