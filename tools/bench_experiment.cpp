#include "tools/bench_experiment.hpp"

#include <algorithm>
#include <set>

#include "common/error.hpp"
#include "common/json_depth.hpp"
#include "common/small_file.hpp"

namespace ferry::tools {
namespace {

[[noreturn]] void bad(const std::string& file, const std::string& rule) {
  throw Error(Stage::kConfig, file, "", "experiment: " + rule);
}

// A value as a `--set` right-hand side (strings bare, everything else as JSON).
std::string set_text(const nlohmann::json& v) {
  return v.is_string() ? v.get<std::string>() : v.dump();
}

}  // namespace

const std::vector<std::string>& known_peers() {
  static const std::vector<std::string> peers = {"cat", "pread", "sglang", "load_file"};
  return peers;
}

Experiment parse_experiment(const nlohmann::ordered_json& j, const std::string& file) {
  if (!j.is_object()) {
    bad(file, "expected a JSON object");
  }
  static const std::set<std::string> fields = {"checkpoint", "base",    "matrix",
                                               "cold",       "overlap", "peers"};
  for (const auto& [key, unused] : j.items()) {
    if (!fields.count(key)) {
      bad(file,
          "unknown field '" + key + "' (fields: checkpoint, base, matrix, cold, overlap, peers)");
    }
  }
  Experiment e;
  e.file = file;
  const nlohmann::ordered_json ck = j.value("checkpoint", nlohmann::ordered_json::object());
  if (!ck.is_object()) {
    bad(file, "checkpoint: expected {\"family\": F, \"preset\": P} or {\"path\": DIR}");
  }
  if (ck.contains("path")) {
    if (!ck["path"].is_string() || ck.size() != 1) {
      bad(file, "checkpoint: {\"path\": DIR} takes one string");
    }
    e.path = ck["path"].get<std::string>();
  } else if (ck.contains("family") && ck.contains("preset") && ck.size() == 2 &&
             ck["family"].is_string() && ck["preset"].is_string()) {
    e.family = ck["family"].get<std::string>();
    e.preset = ck["preset"].get<std::string>();
  } else if (!ck.empty()) {
    bad(file, "checkpoint: expected {\"family\": F, \"preset\": P} or {\"path\": DIR}");
  }
  if (j.contains("base")) {
    if (!j["base"].is_object()) {
      bad(file, "base: expected an object of configuration keys");
    }
    e.base = nlohmann::json::parse(j["base"].dump());
  }
  if (j.contains("matrix")) {
    if (!j["matrix"].is_object()) {
      bad(file, "matrix: expected {\"key\": [values], ...}");
    }
    for (const auto& [key, values] : j["matrix"].items()) {
      if (!values.is_array() || values.empty()) {
        bad(file, "matrix." + key + ": expected a non-empty array of values");
      }
      std::vector<nlohmann::json> list;
      for (const auto& v : values) {
        list.push_back(nlohmann::json::parse(v.dump()));
      }
      e.matrix.emplace_back(key, std::move(list));
    }
  }
  for (const char* flag : {"cold", "overlap"}) {
    if (j.contains(flag)) {
      if (!j[flag].is_boolean()) {
        bad(file, std::string(flag) + ": expected true or false");
      }
      (std::string(flag) == "cold" ? e.cold : e.overlap) = j[flag].get<bool>();
    }
  }
  if (j.contains("peers")) {
    if (!j["peers"].is_array()) {
      bad(file, "peers: expected an array of names");
    }
    for (const auto& p : j["peers"]) {
      const auto& known = known_peers();
      if (!p.is_string() ||
          std::find(known.begin(), known.end(), p.get<std::string>()) == known.end()) {
        bad(file, "peers: unknown peer " + p.dump() + " (known: cat, pread, sglang, load_file)");
      }
      e.peers.push_back(p.get<std::string>());
    }
  }
  return e;
}

Experiment read_experiment(const std::string& file) {
  const std::string text =
      read_small_file(file, Stage::kConfig, kDefaultMaxMetadataBytes, "the experiment file");
  if (json_depth(text) > kMaxJsonDepth) {
    bad(file, json_too_deep_rule());
  }
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::ordered_json::exception& ex) {
    bad(file, std::string("not JSON: ") + ex.what());
  }
  return parse_experiment(j, file);
}

std::vector<Combination> expand(const Experiment& e, const std::string& model_dir) {
  std::size_t count = 1;
  for (const auto& [key, values] : e.matrix) {
    count *= values.size();
  }
  std::vector<Combination> out;
  for (std::size_t n = 0; n < count; ++n) {
    Combination c;
    std::size_t rest = n;
    for (std::size_t k = e.matrix.size(); k-- > 0;) {  // the last key varies fastest
      const auto& [key, values] = e.matrix[k];
      c.values.emplace(c.values.begin(), key, values[rest % values.size()]);
      rest /= values.size();
    }
    for (const auto& [key, value] : c.values) {
      c.label += (c.label.empty() ? "" : " ") + key + "=" + set_text(value);
    }
    if (c.label.empty()) {
      c.label = "base";
    }
    try {
      runtime::ConfigBuilder b;
      b.apply_json(e.base, e.file + " (base)");
      b.apply_set("model.path=" + model_dir);
      for (const auto& [key, value] : c.values) {
        b.apply_set(key + "=" + set_text(value));
      }
      // The configuration refuses what cannot run (prefetch with io.direct, ep not
      // dividing tp), naming why.
      c.config = b.build();
    } catch (const Error& err) {
      c.skipped = err.what();
    }
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace ferry::tools
