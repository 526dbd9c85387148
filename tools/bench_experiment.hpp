// `ferry bench` experiments: a JSON file that names a checkpoint, a base
// configuration, a matrix of configuration values to sweep, whether runs are
// cold, and the peers to run beside ferry (docs/OPERATING.md, "Experiments").
//
//   {"checkpoint": {"family": F, "preset": P} | {"path": DIR},
//    "base": {config keys, nested by section or dotted},
//    "matrix": {"key": [values], ...},
//    "cold": true | false,
//    "overlap": true | false,
//    "peers": ["cat", "pread", "sglang", "load_file"]}
//
// Every combination of the matrix (in file order, the last key varying fastest) is
// built into a LoadConfig exactly as `ferry load --config` would; a combination
// that the configuration refuses, or that makes no sense to measure (prefetch with
// io.direct), is skipped with its reason instead of failing the experiment.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/load_config.hpp"

namespace ferry::tools {

struct Experiment {
  std::string file;                 // for messages
  std::optional<std::string> path;  // checkpoint folder, or
  std::string family, preset;       // a synthesized checkpoint
  nlohmann::json base = nlohmann::json::object();
  std::vector<std::pair<std::string, std::vector<nlohmann::json>>> matrix;
  bool cold = false;
  // Also run each combination on null devices (the read stage alone) and report
  // overlap efficiency where host.bandwidth_gbps caps the copies.
  bool overlap = false;
  std::vector<std::string> peers;
};

// The peers `ferry bench` knows.
const std::vector<std::string>& known_peers();

// Parses and checks an experiment. Throws ferry::Error(Stage::kConfig, file, "",
// rule) naming the field: unknown fields, a checkpoint that is neither form, an
// empty or non-array matrix entry, an unknown peer.
// (ordered_json keeps the matrix in file order.)
Experiment parse_experiment(const nlohmann::ordered_json& j, const std::string& file);
Experiment read_experiment(const std::string& file);

struct Combination {
  std::string label;  // "io.queue_depth=4 io.chunk_bytes=1MiB", or "base"
  std::vector<std::pair<std::string, nlohmann::json>> values;
  std::optional<runtime::LoadConfig> config;  // set unless skipped
  std::string skipped;                        // why it is not run
};

// Every combination for the checkpoint in `model_dir`, built and checked.
std::vector<Combination> expand(const Experiment& e, const std::string& model_dir);

}  // namespace ferry::tools
