#include "runtime/plan_report.hpp"

#include <algorithm>
#include <filesystem>
#include <utility>

#include "actors/plan.hpp"
#include "common/error.hpp"
#include "common/format.hpp"
#include "common/json_depth.hpp"
#include "common/small_file.hpp"
#include "gpu/backends.hpp"
#include "models/experts.hpp"
#include "models/postprocess.hpp"
#include "models/presharded_model.hpp"
#include "models/quant.hpp"
#include "runtime/presharded.hpp"
#include "runtime/sharded_state.hpp"

namespace ferry::runtime {

nlohmann::json read_json_file(const std::filesystem::path& path, const char* what,
                              std::uint64_t max_bytes, Stage stage) {
  const std::string text = read_small_file(path.string(), stage, max_bytes, what);
  if (json_depth(text) > kMaxJsonDepth) {
    throw Error(stage, path.string(), "", json_too_deep_rule());
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(stage, path.string(), "", std::string("does not parse: ") + e.what());
  }
}

namespace {

// The compute capability (major * 10 + minor) of the config's first CUDA device;
// nullopt for host and null devices.
std::optional<int> first_cuda_capability(const LoadConfig& c) {
  if (c.devices.kind != DeviceSpec::Kind::kCuda) {
    return std::nullopt;
  }
  return gpu::cuda_compute_capability(c.devices.ids.empty() ? 0 : c.devices.ids.front());
}

// quantization.online, auto decided as SGLang does (cutlass_fp8_supported: per channel
// from compute capability 8.9 up, else per tensor; host and null devices stand for
// such a GPU).
}  // namespace

models::QuantScheme::Online resolve_online(const LoadConfig& c) {
  using Online = models::QuantScheme::Online;
  switch (c.quantization.online) {
    case QuantizationConfig::Online::kNone:
      return Online::kNone;
    case QuantizationConfig::Online::kChannel:
      return Online::kChannel;
    case QuantizationConfig::Online::kTensor:
      return Online::kTensor;
    case QuantizationConfig::Online::kAuto:
      break;
  }
  const std::optional<int> cc = first_cuda_capability(c);
  return !cc || *cc >= 89 ? Online::kChannel : Online::kTensor;
}

models::QuantScheme::Target resolve_target(const LoadConfig& c, std::string* warning) {
  using Target = models::QuantScheme::Target;
  if (c.postprocess.target) {
    return *c.postprocess.target;
  }
  const std::optional<int> cc = first_cuda_capability(c);
  if (!cc) {
    return Target::kLoader;
  }
  if (*cc / 10 == 9) {
    return Target::kSm90;
  }
  if (*cc / 10 == 10) {
    return Target::kSm100;
  }
  if (warning != nullptr) {
    *warning = "postprocess.target=auto: compute capability " + std::to_string(*cc / 10) + "." +
               std::to_string(*cc % 10) +
               " is neither sm90 nor sm100; the parameters stay in the loader's layout";
  }
  return Target::kLoader;
}

nlohmann::json read_hf_config(const std::string& folder, std::uint64_t max_bytes) {
  const std::filesystem::path dir(folder);
  nlohmann::json config =
      read_json_file(dir / "config.json",
                     "the model's config.json (every checkpoint folder needs one)", max_bytes);
  const std::filesystem::path quant = dir / "hf_quant_config.json";
  std::error_code ec;
  // exists() follows links: a FIFO or a device there is read_small_file's to refuse.
  if (std::filesystem::exists(quant, ec)) {
    config = models::with_hf_quant_config(std::move(config),
                                          read_json_file(quant, "hf_quant_config.json", max_bytes));
  }
  return config;
}

namespace {

std::string pad(std::string s, std::size_t width) {
  if (s.size() < width) {
    s.append(width - s.size(), ' ');
  }
  return s;
}

// "model.layers.0.self_attn.qkv_proj.weight @ tp 0,1": each param once, with the
// ranks that receive it.
std::string describe_targets(const std::vector<PlanTarget>& targets) {
  std::vector<std::pair<std::string, std::vector<std::string>>> by_param;
  for (const PlanTarget& t : targets) {
    auto it = std::find_if(by_param.begin(), by_param.end(),
                           [&](const auto& e) { return e.first == t.param; });
    if (it == by_param.end()) {
      by_param.push_back({t.param, {}});
      it = by_param.end() - 1;
    }
    it->second.push_back(std::to_string(t.rank));
  }
  std::vector<std::string> parts;
  parts.reserve(by_param.size());
  for (const auto& [param, ranks] : by_param) {
    parts.push_back(param + " @ tp " + join_list(ranks, ","));
  }
  return join_list(parts, "; ");
}

}  // namespace

// ---- shared with Runtime::load --------------------------------------------------

ResolvedCheckpoint resolve_checkpoint(const LoadConfig& c) {
  if (c.model.path.empty()) {
    throw Error(Stage::kConfig, "", "", "model.path is not set (ferry load --model DIR)");
  }
  if (c.model.load_format == io::LoadFormat::kDummy) {
    // No weight files: config.json alone (model.path names its folder or the file).
    ResolvedCheckpoint out;
    const std::filesystem::path path(c.model.path);
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec)) {
      out.source.folder = path.parent_path().string();
      out.hf_config = read_json_file(path, "the model's config.json", c.io.max_metadata_bytes);
    } else {
      out.source.folder = c.model.path;
      out.hf_config = read_hf_config(c.model.path, c.io.max_metadata_bytes);
    }
    out.source.load_format = io::LoadFormat::kDummy;
    return out;
  }
  if (c.model.load_format == io::LoadFormat::kShardedState) {
    return resolve_sharded_state(c);
  }
  if (c.model.load_format == io::LoadFormat::kPresharded) {
    if (std::optional<ResolvedCheckpoint> found = resolve_presharded(c)) {
      return std::move(*found);
    }
    // No folder for the layout, and load.save_presharded asks for one: the raw
    // checkpoint at model.path is loaded (and then saved).
  }
  io::DiscoveryOptions discovery;
  discovery.format = c.model.load_format == io::LoadFormat::kPresharded ? io::LoadFormat::kAuto
                                                                        : c.model.load_format;
  discovery.sort_weight_files = c.load.sort_weight_files;
  discovery.tp_size = c.parallel.tp;
  discovery.tp_rank = c.parallel.ranks.empty() ? 0 : c.parallel.ranks.front();
  discovery.max_metadata_bytes = c.io.max_metadata_bytes;
  ResolvedCheckpoint out;
  out.source = io::resolve_source(c.model.path, discovery);
  out.index = io::build_checkpoint_index(out.source, index_options(c));
  std::error_code ec;
  if (out.index.embedded_config &&
      !std::filesystem::exists(std::filesystem::path(out.source.folder) / "config.json", ec)) {
    // A GGUF file carries its config; a config.json beside it wins, as it does in
    // SGLang when one is given.
    out.hf_config = *out.index.embedded_config;
    out.source.decisions.push_back("config: from the GGUF metadata (no config.json in " +
                                   out.source.folder + ")");
  } else {
    out.hf_config = read_hf_config(out.source.folder, c.io.max_metadata_bytes);
  }
  out.warnings = out.source.warnings;
  out.warnings.insert(out.warnings.end(), out.index.warnings.begin(), out.index.warnings.end());
  return out;
}

io::IndexOptions index_options(const LoadConfig& c, bool names_per_file) {
  io::IndexOptions options;
  options.strict = c.load.strict;
  options.max_metadata_bytes = c.io.max_metadata_bytes;
  options.names_per_file = names_per_file;
  options.gguf_dequantize = c.gguf.dequantize;
  return options;
}

std::shared_ptr<const models::Model> make_configured_model(const LoadConfig& c,
                                                           const nlohmann::json& hf_config) {
  models::ParallelLayout layout;
  layout.tp = c.parallel.tp;
  layout.ep = c.parallel.ep;
  layout.pp = c.parallel.pp;
  layout.pp_rank = c.parallel.pp_rank;
  layout.local_ranks = c.parallel.ranks;
  layout.pp_partition = c.parallel.pp_partition;
  layout.attn_dp = c.parallel.attn_dp;
  layout.dp_lm_head = c.parallel.dp_lm_head;
  layout.moe_dense_tp = c.parallel.moe_dense_tp;
  layout.moe_a2a = c.parallel.moe_a2a_deepep ? models::ParallelLayout::MoeA2a::kDeepep
                                             : models::ParallelLayout::MoeA2a::kNone;
  models::ModelOptions model_options;
  model_options.dtype = c.model.dtype;
  model_options.strict = c.load.strict;
  model_options.draft = c.model.draft;
  model_options.switch_w13 = c.model.switch_w13;
  model_options.fuse_shared_experts = c.model.fuse_shared_experts;
  model_options.unaligned_tp = c.model.unaligned_tp;
  model_options.requant = c.quantization.requant;
  model_options.online = resolve_online(c);
  model_options.target = resolve_target(c);
  model_options.pad_moe_intermediate_to =
      static_cast<std::uint64_t>(c.model.pad_moe_intermediate_to);
  if (!c.model.eplb_map.empty()) {
    model_options.eplb = models::load_eplb_map(c.model.eplb_map, c.io.max_metadata_bytes);
  }
  return models::make_model(hf_config, layout, model_options);
}

std::shared_ptr<const models::Model> make_configured_model(const LoadConfig& c,
                                                           const ResolvedCheckpoint& ck) {
  std::shared_ptr<const models::Model> model = make_configured_model(c, ck.hf_config);
  if (ck.presharded) {
    model = models::make_presharded_model(std::move(model), *ck.presharded,
                                          ck.presharded_manifest_file);
  }
  if (ck.stored_state) {
    model = models::make_state_dict_model(std::move(model), ck.index, *ck.stored_state,
                                          sharded_state_naming(c, ck.hf_config), ck.source.folder,
                                          ck.stored_format);
  }
  return model;
}

// ---- the plan report ------------------------------------------------------------

PlanReport make_plan_report(const LoadConfig& config) {
  ResolvedCheckpoint ck = resolve_checkpoint(config);
  std::shared_ptr<const models::Model> model = make_configured_model(config, ck);

  PlanReport report;
  report.family = model->family();
  report.layout = model->layout();
  report.files = ck.index.files.size();
  report.warnings = ck.warnings;
  report.checkpoint_bytes = ck.index.total_bytes;

  const std::vector<models::RankShell>& shells = model->shells();
  for (const io::TensorInfo& t : ck.index.tensors) {
    models::Route route = model->route(t);
    PlannedTensor p;
    p.name = t.name;
    p.route = route.kind;
    p.reason = route.reason;
    p.nbytes = t.nbytes;
    switch (route.kind) {
      case models::RouteKind::kPlaced:
        ++report.placed;
        for (const models::Piece& piece : route.pieces) {
          const models::RankShell& shell = shells[piece.local_rank];
          PlanTarget target{shell.tp_rank, shell.params[piece.param].name};
          if (std::find(p.targets.begin(), p.targets.end(), target) == p.targets.end()) {
            p.targets.push_back(std::move(target));
          }
        }
        break;
      case models::RouteKind::kDropped:
        ++report.dropped;
        break;
      case models::RouteKind::kUnmapped:
        ++report.unmapped;
        break;
    }
    report.tensors.push_back(std::move(p));
  }

  for (const models::RankShell& shell : shells) {
    PlannedRank& r = report.rank_params.emplace_back();
    r.rank = shell.tp_rank;
    r.params = shell.params.size();
    for (const models::ParamSpec& p : shell.params) {
      r.param_bytes += p.nbytes;
    }
  }
  report.dummy = config.model.load_format == io::LoadFormat::kDummy;
  std::string target_warning;
  report.postprocess_target =
      std::string(models::to_string(resolve_target(config, &target_warning)));
  if (!target_warning.empty()) {
    report.warnings.push_back(target_warning);
  }
  if (report.dummy) {
    return report;  // nothing is read: every param is filled with dummy values
  }
  // The reader's view: the same routes cut into windows, with the coverage check a
  // load makes before reading (a param nothing fills fails here too).
  actors::PlanOptions plan_options;
  plan_options.chunk_bytes = config.io.chunk_bytes;
  plan_options.direct = config.io.direct;
  actors::Plan plan = actors::make_plan(ck.index, *model, plan_options, ck.source.folder);
  report.read_bytes = plan.bytes_planned;
  report.skipped_bytes = plan.bytes_skipped_by_reason;
  if (report.unmapped > 0) {
    report.warnings.push_back(std::to_string(report.unmapped) +
                              " checkpoint tensor(s) map to no parameter of " + report.family +
                              " and would not be read (load.strict makes this an error)");
  }
  for (const std::string& note : model->notes()) {
    report.warnings.push_back(note);
  }
  return report;
}

nlohmann::json PlanReport::to_json() const {
  nlohmann::json tensors_json = nlohmann::json::array();
  for (const PlannedTensor& t : tensors) {
    nlohmann::json targets_json = nlohmann::json::array();
    for (const PlanTarget& target : t.targets) {
      targets_json.push_back({{"rank", target.rank}, {"param", target.param}});
    }
    tensors_json.push_back({{"name", t.name},
                            {"route", std::string(models::to_string(t.route))},
                            {"reason", t.reason},
                            {"targets", std::move(targets_json)}});
  }
  nlohmann::json skipped = nlohmann::json::object();
  for (const auto& [reason, bytes] : skipped_bytes) {
    skipped[reason] = bytes;
  }
  nlohmann::json ranks_json = nlohmann::json::array();
  for (const PlannedRank& r : rank_params) {
    ranks_json.push_back({{"rank", r.rank}, {"params", r.params}, {"param_bytes", r.param_bytes}});
  }
  return nlohmann::json{{"load_format", dummy ? "dummy" : "checkpoint"},
                        {"postprocess_target", postprocess_target},
                        {"tensors", std::move(tensors_json)},
                        {"ranks", std::move(ranks_json)},
                        {"totals",
                         {{"checkpoint_bytes", checkpoint_bytes},
                          {"read_bytes", read_bytes},
                          {"skipped_bytes", std::move(skipped)}}}};
}

std::string PlanReport::summary() const {
  std::vector<std::string> ranks;
  for (int r : layout.local_ranks) {
    ranks.push_back(std::to_string(r));
  }
  std::string s = family + ": tp " + std::to_string(layout.tp) + " (local ranks " +
                  join_list(ranks, ",") + "), ep " + std::to_string(layout.ep) + ", pp stage " +
                  std::to_string(layout.pp_rank) + " of " + std::to_string(layout.pp) + ", " +
                  std::to_string(files) + " file(s), " + std::to_string(tensors.size()) +
                  " tensor(s), postprocess.target " + postprocess_target + "\n";
  std::size_t name_width = 6;
  for (const PlannedTensor& t : tensors) {
    name_width = std::max(name_width, t.name.size());
  }
  s += pad("route", 9) + pad("reason", 18) + pad("tensor", name_width + 2) + "targets\n";
  for (const PlannedTensor& t : tensors) {
    std::string row = pad(std::string(models::to_string(t.route)), 9) + pad(t.reason, 18) +
                      pad(t.name, name_width + 2) + describe_targets(t.targets);
    row.erase(row.find_last_not_of(' ') + 1);
    s += row + "\n";
  }
  s += std::to_string(placed) + " placed, " + std::to_string(dropped) + " dropped, " +
       std::to_string(unmapped) + " unmapped\n";
  for (const PlannedRank& r : rank_params) {
    s += "tp rank " + std::to_string(r.rank) + ": " + std::to_string(r.params) + " params, " +
         human_bytes(r.param_bytes) + (dummy ? " (dummy values, nothing read)" : "") + "\n";
  }
  std::uint64_t skipped = 0;
  std::vector<std::string> by_reason;
  for (const auto& [reason, bytes] : skipped_bytes) {
    skipped += bytes;
    by_reason.push_back(reason + " " + human_bytes(bytes));
  }
  s += "checkpoint " + human_bytes(checkpoint_bytes) + ", read " + human_bytes(read_bytes) +
       ", skipped " + human_bytes(skipped);
  if (!by_reason.empty()) {
    s += " (" + join_list(by_reason, ", ") + ")";
  }
  s += "\n";
  for (const std::string& w : warnings) {
    s += "warning: " + w + "\n";
  }
  return s;
}

}  // namespace ferry::runtime
