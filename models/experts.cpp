#include "models/experts.hpp"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/error.hpp"
#include "common/json_depth.hpp"
#include "common/small_file.hpp"
#include "models/family.hpp"
#include "models/hf_config.hpp"
#include "models/layers.hpp"
#include "models/placement.hpp"

namespace ferry::models {
namespace {

using Blocks = std::vector<Block>;

// Everything the block rules of one MoE layer need, shared by all its targets (the
// logical -> physical table is E lists, so each rule holds a pointer, not a copy).
struct Geometry {
  int moe_tp = 1;
  std::uint64_t inter = 0;     // I, unsplit
  std::uint64_t i_local = 0;   // one moe-tp rank's share of I (of the padded I when uneven)
  std::uint64_t i_pad = 0;     // i_local rounded up to pad_moe_intermediate_to
  std::uint64_t per_rank = 0;  // physical slots of one ep rank
  std::uint64_t slots = 0;     // local slots: per_rank, plus one for a fused shared expert
  bool switch_w13 = false;
  std::vector<std::vector<std::uint64_t>> physical;  // logical expert -> physical slots
};

enum class Proj { kGate, kUp, kDown };

// Real rows of the moe-tp rank of `rank` in its share: i_local, except under uneven
// tensor parallelism, where the shares past I hold fewer (or none) and the rest of
// the share is zero padding.
std::uint64_t real_rows(const Geometry& g, int rank) {
  const std::uint64_t begin = static_cast<std::uint64_t>(rank % g.moe_tp) * g.i_local;
  return g.inter > begin ? std::min(g.inter - begin, g.i_local) : 0;
}

// The local slots of tp rank `rank` that hold logical expert `expert`: its physical
// replicas inside the rank's ep range [ep_rank * per_rank, +per_rank).
std::vector<std::uint64_t> local_slots(const Geometry& g, std::uint64_t expert, int rank) {
  const auto ep_rank = static_cast<std::uint64_t>(rank / g.moe_tp);
  std::vector<std::uint64_t> out;
  for (std::uint64_t p : g.physical[expert]) {
    if (p / g.per_rank == ep_rank) {
      out.push_back(p % g.per_rank);
    }
  }
  return out;
}

// What one projection of one expert contributes to `slot` on tp rank `rank`: the
// moe-tp rank's rows of gate or up into their half of w13 (axis 0 after the slot
// index), or its columns of down into w2 (axis 1). `fused` is the expert's index in
// a fused 3-D tensor (src_index), whose gate_up rows hold up after the I gate rows.
Block expert_block(const Geometry& g, Proj proj, std::optional<std::uint64_t> fused,
                   std::uint64_t slot, int rank) {
  const auto moe_rank = static_cast<std::uint64_t>(rank % g.moe_tp);
  Block b;
  b.kind = Block::Kind::kCopy;
  b.axis = proj == Proj::kDown ? 1 : 0;
  if (fused) {
    b.src_index = {*fused};
  }
  b.dst_index = {slot};
  b.src_start = moe_rank * g.i_local;
  if (fused && proj == Proj::kUp) {
    b.src_start += g.inter;
  }
  // w13 is [gate | up] unless switch_w13 puts up first.
  const bool second_half = proj == Proj::kUp ? !g.switch_w13 : g.switch_w13;
  b.dst_start = proj != Proj::kDown && second_half ? g.i_pad : 0;
  b.length = real_rows(g, rank);
  return b;
}

std::string proj_tensor(const MoeLayerSpec& spec, std::uint64_t expert, Proj proj) {
  const std::string& name = proj == Proj::kGate ? spec.gate_name
                            : proj == Proj::kUp ? spec.up_name
                                                : spec.down_name;
  return spec.checkpoint_prefix + std::to_string(expert) + "." + name + ".weight";
}

[[noreturn]] void eplb_error(const std::string& file, const std::string& what) {
  throw Error(Stage::kConfig, file, "", "model.eplb_map: " + what);
}

std::uint64_t parse_layer_key(const std::string& key, const std::string& file) {
  if (key.empty() || key.size() > 9 || key.find_first_not_of("0123456789") != std::string::npos) {
    eplb_error(file, "layer key \"" + key + "\" is not a layer index");
  }
  return std::stoull(key);
}

}  // namespace

ModelOptions::Eplb parse_eplb_map(const nlohmann::json& j, const std::string& file) {
  if (!j.is_object()) {
    eplb_error(file, "expected a JSON object with num_physical_experts and layers");
  }
  for (const auto& [key, value] : j.items()) {
    if (key != "num_physical_experts" && key != "layers") {
      eplb_error(file, "unknown field \"" + key + "\"");
    }
  }
  auto p = j.find("num_physical_experts");
  const std::optional<std::uint64_t> physical = p == j.end() ? std::nullopt : json_non_negative(*p);
  if (!physical || *physical == 0) {
    eplb_error(file, "num_physical_experts must be a positive integer" +
                         (p == j.end() ? std::string(" (missing)") : " (got " + p->dump() + ")"));
  }
  ModelOptions::Eplb out;
  out.num_physical_experts = *physical;
  auto layers = j.find("layers");
  if (layers == j.end() || !layers->is_object() || layers->empty()) {
    eplb_error(file, "layers must be a non-empty object of \"<layer>\": [[physical ids], ...]");
  }
  for (const auto& [key, experts] : layers->items()) {
    const std::uint64_t layer = parse_layer_key(key, file);
    const std::string where = "layers[\"" + key + "\"]";
    if (!experts.is_array() || experts.empty()) {
      eplb_error(file, where +
                           " must be a non-empty list with one list of physical ids per "
                           "logical expert");
    }
    std::vector<int> seen(out.num_physical_experts, -1);
    std::vector<std::vector<std::uint64_t>> slots;
    for (std::size_t e = 0; e < experts.size(); ++e) {
      const nlohmann::json& ids = experts[e];
      const std::string at = where + "[" + std::to_string(e) + "]";
      if (!ids.is_array() || ids.empty()) {
        eplb_error(file, at + " must list at least one physical id of logical expert " +
                             std::to_string(e));
      }
      std::vector<std::uint64_t>& mine = slots.emplace_back();
      for (const nlohmann::json& id : ids) {
        const std::optional<std::uint64_t> value = json_non_negative(id);
        if (!value || *value >= out.num_physical_experts) {
          eplb_error(file, at + " holds " + id.dump() + ", not a physical id below " +
                               "num_physical_experts " + std::to_string(out.num_physical_experts));
        }
        const std::uint64_t pid = *value;
        if (seen[pid] >= 0) {
          eplb_error(file, where + ": physical id " + std::to_string(pid) +
                               " is given to logical experts " + std::to_string(seen[pid]) +
                               " and " + std::to_string(e));
        }
        seen[pid] = static_cast<int>(e);
        mine.push_back(pid);
      }
    }
    for (std::size_t pid = 0; pid < seen.size(); ++pid) {
      if (seen[pid] < 0) {
        eplb_error(file, where + ": physical id " + std::to_string(pid) +
                             " holds no logical expert (every slot in [0, num_physical_experts) "
                             "must be used once)");
      }
    }
    out.layers.emplace(layer, std::move(slots));
  }
  return out;
}

ModelOptions::Eplb load_eplb_map(const std::string& path, std::uint64_t max_bytes) {
  std::string text;
  try {
    text = read_small_file(path, Stage::kConfig, max_bytes, "the file");
  } catch (const Error& e) {
    eplb_error(path, e.rule());
  }
  if (json_depth(text) > kMaxJsonDepth) {
    eplb_error(path, json_too_deep_rule());
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    eplb_error(path, "not valid JSON");
  }
  return parse_eplb_map(j, path);
}

void check_expert_parallel(const ParallelLayout& layout, std::uint64_t num_experts,
                           const ModelOptions& options, const std::string& architecture,
                           const std::string& experts_field,
                           const std::vector<std::uint64_t>& moe_layers) {
  if (layout.ep < 1 || layout.tp < 1 || layout.tp % layout.ep != 0) {
    throw Error(Stage::kConfig, "", "",
                "parallel.ep (" + std::to_string(layout.ep) + ") must divide parallel.tp (" +
                    std::to_string(layout.tp) +
                    "): each expert-parallel group holds tp / ep tensor-parallel shards of "
                    "its experts");
  }
  const auto ep = static_cast<std::uint64_t>(layout.ep);
  if (!options.eplb) {
    if (num_experts == 0 || num_experts % ep != 0) {
      throw Error(Stage::kPlacement, kConfigFile, "",
                  architecture + ": " + experts_field + " (" + std::to_string(num_experts) +
                      ") is not divisible by the expert-parallel size ep " +
                      std::to_string(layout.ep) + " (tp " + std::to_string(layout.tp) + ")");
    }
    return;
  }
  const ModelOptions::Eplb& eplb = *options.eplb;
  const std::uint64_t physical = eplb.num_physical_experts;
  if (physical == 0 || physical % ep != 0) {
    throw Error(Stage::kPlacement, "", "",
                "model.eplb_map: num_physical_experts (" + std::to_string(physical) +
                    ") is not divisible by the expert-parallel size ep " +
                    std::to_string(layout.ep) + " (tp " + std::to_string(layout.tp) + ")");
  }
  for (const auto& [layer, logical] : eplb.layers) {
    if (logical.size() != num_experts) {
      throw Error(Stage::kConfig, "", "",
                  "model.eplb_map: layers[\"" + std::to_string(layer) + "\"] lists " +
                      std::to_string(logical.size()) + " logical experts but " + architecture +
                      " has " + experts_field + " " + std::to_string(num_experts));
    }
  }
  for (std::uint64_t layer : moe_layers) {
    if (!eplb.layers.contains(layer)) {
      throw Error(Stage::kConfig, "", "",
                  "model.eplb_map: no entry for MoE layer " + std::to_string(layer) +
                      " (the map must place the experts of every MoE layer of " + architecture +
                      ")");
    }
  }
}

void add_moe_experts(TableModel& m, const MoeLayerSpec& spec, const ParallelLayout& layout,
                     const ModelOptions& options) {
  // Families check with their own names first; this keeps the divisions below safe
  // for any caller.
  check_expert_parallel(layout, spec.num_experts, options, "the model");
  const int tp = layout.tp;
  auto g = std::make_shared<Geometry>();
  g->moe_tp = tp / layout.ep;
  g->inter = spec.intermediate;
  g->switch_w13 = options.switch_w13;
  const auto moe_tp = static_cast<std::uint64_t>(g->moe_tp);
  if (spec.intermediate == 0) {
    throw Error(Stage::kPlacement, kConfigFile, "", spec.intermediate_field + " is 0");
  }
  // FusedMoE asserts that moe-tp divides I; under model.unaligned_tp=pad, SGLang's
  // CPU rule pads I to a multiple of tp * 32 (which moe-tp then divides), and
  // real_rows says how much of each share is real.
  const std::uint64_t i_padded =
      options.unaligned_tp == Unaligned::kPad
          ? padded_intermediate(spec.intermediate, tp, Unaligned::kPad, spec.intermediate_field)
          : padded_intermediate(spec.intermediate, g->moe_tp, Unaligned::kRefuse,
                                spec.intermediate_field);
  g->i_local = i_padded / moe_tp;
  if (i_padded != spec.intermediate) {
    m.add_note(uneven_note(
        "the experts' " + spec.intermediate_field + " " + std::to_string(spec.intermediate), "rows",
        i_padded, spec.intermediate, g->moe_tp, std::to_string(i_padded),
        "moe-tp ranks (tp rank % (tp / ep))"));
  }
  // flashinfer_trtllm (QuantScheme::trtllm_experts, the methods it serves): SGLang
  // 0.5.23 pads a rank's share of I to 64 (NVFP4: ModelOptNvFp4FusedMoEMethod.
  // create_weights) or 128 (FusedMoE) and shards the padded size
  // (narrow_padded_param_and_loaded_weight): moe-tp rank r holds rows [r * share,
  // +share) of I, the rest zero, as under uneven moe-tp.
  const QuantScheme& q = options.quant;
  if (q.trtllm_experts &&
      (q.method == QuantScheme::Method::kNvfp4 || q.method == QuantScheme::Method::kFp8Block ||
       q.method == QuantScheme::Method::kFp8Tensor || !q.quantized())) {
    const std::uint64_t share =
        round_up(g->i_local, q.method == QuantScheme::Method::kNvfp4 ? 64 : 128);
    if (share != g->i_local) {
      m.add_note("flashinfer_trtllm: each moe-tp rank's share of the experts' " +
                 spec.intermediate_field + " " + std::to_string(spec.intermediate) +
                 " is padded from " + std::to_string(g->i_local) + " to " + std::to_string(share) +
                 " rows and shards the padded size, as SGLang does");
      g->i_local = share;
    }
  }
  g->i_pad = round_up(g->i_local, options.pad_moe_intermediate_to);

  // Logical -> physical: the identity without EPLB, else this layer's map.
  std::uint64_t physical = spec.num_experts;
  if (options.eplb) {
    auto it = options.eplb->layers.find(spec.layer);
    if (it == options.eplb->layers.end()) {  // (its size was checked above)
      throw Error(Stage::kConfig, "", "",
                  "model.eplb_map: no entry for MoE layer " + std::to_string(spec.layer));
    }
    physical = options.eplb->num_physical_experts;
    g->physical = it->second;
  } else {
    for (std::uint64_t e = 0; e < spec.num_experts; ++e) {
      g->physical.push_back({e});
    }
  }
  g->per_rank = physical / static_cast<std::uint64_t>(layout.ep);
  const bool shared =
      options.fuse_shared_experts.value_or(false) && !spec.shared_checkpoint_prefix.empty();
  g->slots = g->per_rank + (shared ? 1 : 0);

  const std::string w13 = spec.param_prefix + "w13_weight";
  const std::string w2 = spec.param_prefix + "w2_weight";
  const std::uint64_t H = spec.hidden;
  const std::uint64_t I = spec.intermediate;
  const std::uint64_t E = spec.num_experts;
  m.add_param(w13, Shape{g->slots, 2 * g->i_pad, H});
  m.add_param(w2, Shape{g->slots, H, g->i_pad});
  // The global rows of a scale every rank holds for all experts: FusedMoE.
  // weight_loader (SGLang 0.5.23) on a `_sglang_require_global_experts` param writes
  // logical expert e's scalar to the physical rows e, e + E, e + 2E, ... below P
  // (ExpertLocationMetadata.logical_to_all_physical: a stride, whatever the EPLB map
  // says; without a map, row e), the fused shared expert's to row P.
  auto rows_of = [prefix = spec.checkpoint_prefix,
                  shared_prefix = shared ? spec.shared_checkpoint_prefix : std::string(),
                  E = spec.num_experts, physical](const std::string& tensor) {
    std::vector<std::uint64_t> out;
    if (!shared_prefix.empty() && tensor.starts_with(shared_prefix)) {
      out.push_back(physical);
    } else if (tensor.starts_with(prefix)) {
      const std::size_t dot = tensor.find('.', prefix.size());
      const std::string id =
          dot == std::string::npos ? "" : tensor.substr(prefix.size(), dot - prefix.size());
      if (!id.empty() && id.size() <= 9 &&
          id.find_first_not_of("0123456789") == std::string::npos) {
        const std::uint64_t e = std::stoull(id);
        for (std::uint64_t p = e; e < E && p < physical; p += E) {
          out.push_back(p);
        }
      }
    }
    return out;
  };
  m.set_global_experts(w13, physical + (shared ? 1 : 0), rows_of);
  m.set_global_experts(w2, physical + (shared ? 1 : 0), rows_of);
  if (q.trtllm_experts && !q.quantized()) {
    // flashinfer_trtllm's BF16 experts (UnquantizedFusedMoEMethod.
    // _apply_trtllm_bf16_block_layout): each expert's [N, K] rows permuted, then cut
    // into blocks of 128 bytes (64 elements) of K, the block index outermost
    // (convert_to_block_layout): served [E, K / 64, N, 64], re-laid out in place by
    // postprocess.target's hook (models/postprocess.cpp).
    for (const auto& [name, n, k] :
         {std::tuple{w13, 2 * g->i_pad, H}, std::tuple{w2, H, g->i_pad}}) {
      if (k % 64 != 0 || n % 32 != 0) {
        throw Error(Stage::kPlacement, kConfigFile, name,
                    "postprocess.target=sm100: flashinfer_trtllm's BF16 experts are " +
                        format_shape(Shape{g->slots, n, k}) +
                        ", and SGLang 0.5.23 lays them out in blocks of 64 columns of 32-row "
                        "tiles (convert_to_block_layout, get_shuffle_matrix_a_row_indices): "
                        "the hidden size must be a multiple of 64");
      }
      const Shape served{g->slots, k / 64, n, 64};
      m.serve_as(name, [served](int) { return served; });
    }
  }
  if (q.trtllm_experts && q.method == QuantScheme::Method::kFp8Tensor && H % 32 != 0) {
    // align_fp8_moe_weights_for_flashinfer_trtllm shuffles each expert's rows in
    // blocks of 32 (shuffle_matrix_a): w2's rows are the hidden size.
    throw Error(Stage::kPlacement, kConfigFile, w2,
                "postprocess.target=sm100: flashinfer_trtllm's per-tensor FP8 experts are " +
                    format_shape(Shape{g->slots, H, g->i_pad}) +
                    ", and SGLang 0.5.23 shuffles their rows in blocks of 32 "
                    "(shuffle_matrix_a, get_shuffle_matrix_a_row_indices): the hidden size "
                    "must be a multiple of 32");
  }
  if (g->i_pad > g->i_local || g->i_local * moe_tp != I) {
    // The padded tail of both w13 halves and of w2's columns, in every slot at once
    // (no leading index: the slot axis becomes the rows of one pitched block): the
    // pad_moe_intermediate_to tail, and under uneven moe-tp the padded part of the
    // rank's share before it.
    m.add_fill(w13, [g](int rank) {
      const std::uint64_t real = real_rows(*g, rank);
      Blocks out(2);
      for (std::size_t half = 0; half < 2; ++half) {
        out[half].kind = Block::Kind::kZero;
        out[half].axis = 1;
        out[half].dst_start = half * g->i_pad + real;
        out[half].length = g->i_pad - real;
      }
      return out;
    });
    m.add_fill(w2, [g](int rank) {
      const std::uint64_t real = real_rows(*g, rank);
      Block b;
      b.kind = Block::Kind::kZero;
      b.axis = 2;
      b.dst_start = real;
      b.length = g->i_pad - real;
      return Blocks{b};
    });
  }

  // Per-expert tensors: each feeds every local replica of its expert, or nothing
  // ("remote_expert": never read).
  constexpr Proj kProjs[] = {Proj::kGate, Proj::kUp, Proj::kDown};
  for (std::uint64_t e = 0; e < E; ++e) {
    for (Proj proj : kProjs) {
      const bool down = proj == Proj::kDown;
      m.add_target(
          proj_tensor(spec, e, proj), down ? w2 : w13, down ? Shape{H, I} : Shape{I, H},
          [g, e, proj](int rank) {
            Blocks out;
            for (std::uint64_t slot : local_slots(*g, e, rank)) {
              out.push_back(expert_block(*g, proj, std::nullopt, slot, rank));
            }
            return out;
          },
          "remote_expert");
    }
  }

  // Fused 3-D tensors: each local replica takes its expert's part (src_index), so a
  // rank reads only the byte range of its own experts.
  m.add_target(
      spec.checkpoint_prefix + "gate_up_proj", w13, Shape{E, 2 * I, H},
      [g](int rank) {
        Blocks out;
        for (std::uint64_t e = 0; e < g->physical.size(); ++e) {
          for (std::uint64_t slot : local_slots(*g, e, rank)) {
            out.push_back(expert_block(*g, Proj::kGate, e, slot, rank));
            out.push_back(expert_block(*g, Proj::kUp, e, slot, rank));
          }
        }
        return out;
      },
      "remote_expert");
  m.add_target(
      spec.checkpoint_prefix + "down_proj", w2, Shape{E, H, I},
      [g](int rank) {
        Blocks out;
        for (std::uint64_t e = 0; e < g->physical.size(); ++e) {
          for (std::uint64_t slot : local_slots(*g, e, rank)) {
            out.push_back(expert_block(*g, Proj::kDown, e, slot, rank));
          }
        }
        return out;
      },
      "remote_expert");

  // The fused shared expert: the slot after the routed ones, on every rank.
  if (shared) {
    for (Proj proj : kProjs) {
      const bool down = proj == Proj::kDown;
      // Shared experts are plain MLPs: always gate_proj / up_proj / down_proj.
      const char* name = proj == Proj::kGate ? "gate_proj"
                         : proj == Proj::kUp ? "up_proj"
                                             : "down_proj";
      m.add_target(spec.shared_checkpoint_prefix + name + ".weight", down ? w2 : w13,
                   down ? Shape{H, I} : Shape{I, H}, [g, proj](int rank) {
                     return Blocks{expert_block(*g, proj, std::nullopt, g->per_rank, rank)};
                   });
    }
  }
}

MoeLayerSpec routed_experts(const FamilyDescriptor& descriptor, std::uint64_t layer,
                            std::uint64_t experts, std::uint64_t hidden, std::uint64_t intermediate,
                            std::string param_prefix, std::string checkpoint_prefix) {
  MoeLayerSpec spec;
  spec.layer = layer;
  spec.num_experts = experts;
  spec.hidden = hidden;
  spec.intermediate = intermediate;
  spec.param_prefix = std::move(param_prefix);
  spec.checkpoint_prefix = std::move(checkpoint_prefix);
  const std::vector<std::string>& gate_up = descriptor.sources("experts.w13_weight");
  spec.gate_name = gate_up.at(0);
  spec.up_name = gate_up.at(1);
  spec.down_name = descriptor.sources("experts.w2_weight").at(0);
  return spec;
}

}  // namespace ferry::models
