// What a load would do, without doing it: the checkpoint resolved as Runtime
// resolves it, the model made for the configured layout, every tensor routed and
// the reads planned — but no tensor data read and no device touched. `ferry plan`
// prints it; tests call make_plan_report directly. The JSON form is a stable
// interface documented in docs/plan-json.md.
//
// The first two functions are the resolve and model steps of Runtime::load
// (runtime/runtime.cpp calls them too), so a plan and a load can never disagree on
// which files, which tensors or which params there are.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/discover.hpp"
#include "io/presharded.hpp"
#include "io/safetensors.hpp"
#include "models/model.hpp"
#include "models/sharded_state_model.hpp"
#include "runtime/load_config.hpp"

namespace ferry::runtime {

// ---- shared with Runtime::load --------------------------------------------------

struct ResolvedCheckpoint {
  io::ResolvedSource source;
  io::CheckpointIndex index;          // every header read and validated
  nlohmann::json hf_config;           // the folder's config.json, a hf_quant_config.json merged in
  std::vector<std::string> warnings;  // discovery's, then the index's
  // model.load_format presharded, a folder found (runtime/presharded.hpp): its
  // manifest, checked against the layout; null otherwise (a raw checkpoint).
  std::shared_ptr<const io::PreshardedManifest> presharded;
  std::string presharded_manifest_file;
  // A folder of SGLang's state dicts (sharded_state, runtime/sharded_state.hpp, or
  // SGLang's presharded layout, runtime/sglang_presharded.hpp): what each tp rank's
  // files hold, read by models::make_state_dict_model; `stored_format` names which
  // ("sharded_state", "SGLang presharded"), in the report and in errors. Null
  // otherwise.
  std::shared_ptr<const models::StoredState> stored_state;
  std::string stored_format;
};

// A JSON file through read_small_file (a regular file of at most `max_bytes`,
// io.max_metadata_bytes) and the depth check, parsed. Throws Error(stage) naming the
// file: `what` when it cannot be read, "does not parse" when nlohmann refuses it.
nlohmann::json read_json_file(const std::filesystem::path& path, const char* what,
                              std::uint64_t max_bytes, Stage stage = Stage::kConfig);

// config.json in `folder`, with a ModelOpt hf_quant_config.json beside it merged in
// (models::with_hf_quant_config). Throws Error(Stage::kConfig).
nlohmann::json read_hf_config(const std::string& folder, std::uint64_t max_bytes);

// The index's options as the configuration sets them (load.strict,
// io.max_metadata_bytes); `names_per_file` for folders whose files are each one
// rank's state (sharded_state, SGLang's presharded).
io::IndexOptions index_options(const LoadConfig& config, bool names_per_file = false);

// quantization.online resolved: auto is channel on a device of compute capability
// 8.9 or more, or with no CUDA device; tensor below.
models::QuantScheme::Online resolve_online(const LoadConfig& config);

// Discovery (model.load_format, load.sort_weight_files, the tp rank of the first
// local rank for per-rank checkpoints), every header (load.strict), config.json.
// Throws ferry::Error: Stage::kConfig for an empty model.path or an unreadable
// config.json, and whatever discovery and the header checks throw.
ResolvedCheckpoint resolve_checkpoint(const LoadConfig& config);

// postprocess.target resolved: auto is the first CUDA device's compute capability
// (9.x sm90, 10.x sm100, else loader, with a line in `warning` when given), loader
// on host and null devices.
models::QuantScheme::Target resolve_target(const LoadConfig& config,
                                           std::string* warning = nullptr);

// The model of config.json for the config's parallel layout and model options.
// Throws what models::make_model throws.
std::shared_ptr<const models::Model> make_configured_model(const LoadConfig& config,
                                                           const nlohmann::json& hf_config);
// The model a load of `checkpoint` uses: the configured one, or for a presharded
// folder that model's presharded reader (models/presharded_model.hpp).
std::shared_ptr<const models::Model> make_configured_model(const LoadConfig& config,
                                                           const ResolvedCheckpoint& checkpoint);

// ---- the plan report ------------------------------------------------------------

struct PlanTarget {
  int rank = 0;       // tp rank
  std::string param;  // the param the tensor writes on that rank
  bool operator==(const PlanTarget&) const = default;
};

struct PlannedTensor {
  std::string name;
  models::RouteKind route = models::RouteKind::kPlaced;
  std::string reason;               // "" when placed; the drop reason; "unknown_name" when unmapped
  std::vector<PlanTarget> targets;  // placed only: by local rank, then first piece order
  std::uint64_t nbytes = 0;         // tensor data bytes
};

// What one local rank allocates.
struct PlannedRank {
  int rank = 0;  // tp rank
  std::size_t params = 0;
  std::uint64_t param_bytes = 0;
};

struct PlanReport {
  std::string family;
  models::ParallelLayout layout;  // local_ranks filled in
  std::size_t files = 0;
  std::vector<PlannedTensor> tensors;  // checkpoint order (files in load order, offsets)
  std::size_t placed = 0;
  std::size_t dropped = 0;
  std::size_t unmapped = 0;
  std::uint64_t checkpoint_bytes = 0;  // sum of tensor data bytes
  std::uint64_t read_bytes = 0;        // tensor data the reader will request (no headers,
                                       // no alignment padding)
  // Tensor bytes never read, by reason (actors::Plan::bytes_skipped_by_reason: the
  // reason of each dropped or unmapped tensor, and actors::kRemoteSlicesReason).
  // checkpoint_bytes == read_bytes + the sum of these.
  std::map<std::string, std::uint64_t> skipped_bytes;
  std::vector<std::string> warnings;
  std::vector<PlannedRank> rank_params;  // by local rank
  bool dummy = false;                    // model.load_format dummy: no tensors, nothing read
  std::string postprocess_target = "loader";  // postprocess.target as resolved

  // {"load_format": "checkpoint" | "dummy", "postprocess_target": "loader" | "sm90" | "sm100",
  //  "tensors": [{"name", "route", "reason", "targets": [{"rank", "param"}]}],
  //  "ranks": [{"rank", "params", "param_bytes"}],
  //  "totals": {"checkpoint_bytes", "read_bytes", "skipped_bytes": {reason: n}}}
  nlohmann::json to_json() const;
  // A table of the tensors and a few lines of totals, for the CLI.
  std::string summary() const;
};

// Resolves, makes the model, routes every tensor and plans the reads (io.chunk_bytes,
// io.direct as a load would). Reads headers and config.json only. Throws
// ferry::Error as Runtime::load would fail before streaming (a shape that does not
// fit, an unknown name with load.strict, a param nothing fills).
PlanReport make_plan_report(const LoadConfig& config);

}  // namespace ferry::runtime
