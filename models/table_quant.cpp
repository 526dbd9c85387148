// TableModel's quantization (table_model.hpp): apply_quant and apply_online, run by
// finish(). Each quantized weight param gets its scale params, in the forms its
// method and postprocess.target give them, and the targets that load them.
#include <algorithm>
#include <set>
#include <utility>

#include "common/error.hpp"
#include "models/hf_config.hpp"
#include "models/postprocess.hpp"
#include "models/quant_traits.hpp"
#include "models/table_model.hpp"

namespace ferry::models {
namespace {

// The checkpoint modules a fused param is made of, for modules_to_not_convert.
std::vector<std::string> fused_shards(const std::string& module) {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kFused{
      {"qkv_proj", {"q_proj", "k_proj", "v_proj"}},
      {"gate_up_proj", {"gate_proj", "up_proj"}},
      {"fused_qkv_a_proj_with_mqa", {"q_a_proj", "kv_a_proj_with_mqa"}},
  };
  const std::size_t dot = module.rfind('.');
  const std::string parent = dot == std::string::npos ? "" : module.substr(0, dot + 1);
  const std::string leaf = dot == std::string::npos ? module : module.substr(dot + 1);
  for (const auto& [fused, parts] : kFused) {
    if (leaf == fused) {
      std::vector<std::string> out;
      for (const std::string& part : parts) {
        out.push_back(parent + part);
      }
      return out;
    }
  }
  return {};
}

// A param's module: "x.qkv_proj.weight" -> "x.qkv_proj", "x.experts.w13_weight" ->
// "x.experts".
std::string param_module(const std::string& param) {
  const std::size_t dot = param.rfind('.');
  return dot == std::string::npos ? param : param.substr(0, dot);
}

// The dims after `fixed` leading indices.
Shape inner_dims(const Shape& shape, std::size_t fixed) {
  return fixed >= shape.size() ? Shape{} : Shape(shape.begin() + long(fixed), shape.end());
}

}  // namespace

namespace {

bool ends_with(const std::string& text, std::string_view suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Blocks without repeats (a scale element several weight blocks share is written once).
void add_unique(std::vector<Block>& blocks, const Block& b) {
  if (std::find(blocks.begin(), blocks.end(), b) == blocks.end()) {
    blocks.push_back(b);
  }
}

// The element of a per-shard scale a weight block's scalar goes to: its shard's
// position among the param's shard starts (the rows where the fused shards begin).
// A column split (a row-parallel param) is one shard.
Block shard_scale_block(const Block& b, const std::vector<std::uint64_t>& starts) {
  Block out;
  out.axis = 0;
  out.dst_index = b.dst_index;
  out.length = 1;
  if (b.axis == 0) {
    out.dst_start = static_cast<std::uint64_t>(
        std::lower_bound(starts.begin(), starts.end(), b.dst_start) - starts.begin());
  }
  return out;
}

// The F32 [.., N, 1] channel scale's block of a weight block: the same rows, or
// every row of the source for a column split.
Block channel_scale_block(const Block& b, const Shape& src_inner) {
  Block out = b;
  out.axis = 0;
  if (b.axis != 0) {
    out.src_start = 0;
    out.dst_start = 0;
    out.length = src_inner.at(0);
  }
  return out;
}

// Shape rules of a quantized weight's companions.
TableModel::ShapeRule replace_last_dim(TableModel::ShapeRule rule, std::uint64_t divisor,
                                       std::optional<std::uint64_t> value = {}) {
  return [rule = std::move(rule), divisor, value](int rank) {
    Shape s = rule(rank);
    s.back() = value ? *value : s.back() / divisor;
    return s;
  };
}

}  // namespace

// What apply_quant adds: the scale params and the targets feeding them.
struct TableModel::QuantWork {
  const QuantScheme& q;
  const QuantTraits& traits;
  std::uint64_t bn = 0;  // a scale block's rows and columns (ScaleGrain::kBlock)
  std::uint64_t bk = 0;
  std::vector<ParamDecl> companions;
  std::vector<std::pair<std::string, Target>> added;
};

// One quantized weight param: the checkpoint tensors feeding it, where its fused
// shards start, and its scale params' names and forms.
struct TableModel::WeightScales {
  ParamDecl* decl = nullptr;
  ShapeRule weight;  // the logical (unpacked) shape
  std::vector<std::pair<std::string, Target*>> feeds;
  std::vector<std::uint64_t> starts;  // rows where the fused shards begin
  std::uint64_t shards = 1;
  bool stacked = false;    // fused experts: leading expert dims
  bool ue8m0 = false;      // quantization.requant=ue8m0 converts it
  bool nvfp4 = false;      // postprocess.target=sm100's dense NVFP4 path (nvfp4_served)
  bool nvfp4_pad = false;  // ... whose weight pad_nvfp4_weight pads (nvfp4_pads)
  bool marlin = false;     // postprocess.target=sm90's dense NVFP4 path (nvfp4_marlin)
  ScaleForm form = ScaleForm::kAsLoaded;
  bool input_max = false;
  std::string scale;        // the weight scale's param
  std::string scale2;       // NVFP4's second scale's param (a twin for Marlin's experts)
  std::string input_param;  // the input scale's param
  // The experts' w13_input_scale: one element an expert (merged_input), or each
  // element of the expert's row holding the scalar loaded last (row_input).
  bool merged_input = false;
  bool row_input = false;
  // ModelOpt NVFP4's experts: the input scales hold every global expert on each rank
  // (set_global_experts): their rows, and the rows each checkpoint tensor writes.
  std::uint64_t global_rows = 0;
  RowsRule rows_of;

  // Fused experts keep a shard dim only where there are several shards: SGLang's
  // FusedMoE methods make w13 scales [E, 2] and w2 scales [E] (Fp8MoEMethod,
  // ModelOptFp8MoEMethod and ModelOptNvFp4FusedMoEMethod.create_weights in SGLang
  // 0.5.23); a dense param keeps [shards] ([1] for o_proj).
  ShapeRule scale_shape(std::uint64_t n) const {
    return [weight = weight, n](int rank) {
      Shape s = weight(rank);
      s.resize(s.size() - 2);  // the leading (expert) dims
      if (s.empty() || n > 1) {
        s.push_back(n);
      }
      return s;
    };
  }
  // A per-shard scalar's blocks. `merged`: every shard's scalar goes to its
  // expert's one element (the experts' w13_input_scale).
  BlockRule per_shard_rule(BlockRule logical, bool merged = false) const {
    const bool one = stacked && (shards == 1 || merged);
    // (An expert's scalars load even where the rank holds none of its rows.)
    return [logical = std::move(logical), starts = starts, one, all = stacked](int rank) {
      std::vector<Block> out;
      for (const Block& b : logical(rank)) {
        if (b.length != 0 || all) {
          Block s = shard_scale_block(b, starts);
          if (one) {
            // [E]: the expert index becomes the start of a 1-D block.
            s.dst_start = s.dst_index.back();
            s.dst_index.pop_back();
          }
          add_unique(out, s);
        }
      }
      return out;
    };
  }
};

std::map<std::string, TableModel::ShapeRule> TableModel::quantized_weights() const {
  const QuantScheme& q = quant_;
  const ExcludedModules excluded(q);
  std::map<std::string, ShapeRule> quantized;  // weight param -> its logical shape rule
  for (const ParamDecl& d : param_decls_) {
    if (!quantized_linear_param(d.name)) {
      continue;
    }
    const std::string module = param_module(d.name);
    if (!excluded.skipped(module, fused_shards(module))) {
      quantized.emplace(d.name, d.shape);
    }
  }
  for (const Fill& f : fill_decls_) {  // (flashinfer_trtllm's padded experts: apply_quant)
    if (quantized.count(f.param) != 0 && !q.trtllm_experts) {
      throw Error(Stage::kPlacement, "", f.param,
                  "zero padding (model.unaligned_tp=pad, model.pad_moe_intermediate_to) of a "
                  "quantized parameter (" +
                      describe(q) +
                      ") is not supported: the padded "
                      "share would not be whole scale blocks");
    }
  }
  if (q.format == QuantScheme::Format::kCompressedTensors &&
      q.method == QuantScheme::Method::kFp8Tensor && !q.input_scales) {
    for (const auto& [param, rule] : quantized) {
      if (ends_with(param, "experts.w13_weight")) {
        throw Error(Stage::kMapping, kConfigFile, param,
                    "For FP8 Fused MoE layers, only per-tensor and channelwise-dynamic-per-token "
                    "quantization is supported (SGLang's CompressedTensorsW8A8Fp8MoEMethod): "
                    "per-tensor weights need static per-tensor input scales");
      }
    }
  }
  return quantized;
}

TableModel::WeightScales TableModel::weight_scales(ParamDecl& d, ShapeRule weight,
                                                   const QuantWork& w) {
  const QuantScheme& q = w.q;
  if (w.traits.group_blocks) {
    for (int rank : layout_.local_ranks) {
      const std::uint64_t k = weight(rank).back();
      if (k % q.group_size != 0) {
        throw Error(Stage::kPlacement, "", d.name,
                    "Unsupported model when in features size is not multiple of " +
                        std::to_string(q.group_size) + ": " + d.name + " has " + std::to_string(k) +
                        " input features on tp rank " + std::to_string(rank) + " (" +
                        w.traits.name + " group_size " + std::to_string(q.group_size) + ")");
      }
    }
  }
  WeightScales s;
  s.decl = &d;
  s.weight = std::move(weight);
  // Every local rank's share is checked now, so that a layout SGLang refuses fails
  // when the model is made, naming the tensor; the shard starts are gathered.
  std::set<std::uint64_t> start_set;
  for (auto& [tensor, targets] : targets_) {
    for (Target& t : targets) {
      if (t.param != d.name || !ends_with(tensor, "weight")) {
        // Experts stored fused on disk (experts.gate_up_proj): no quantized layout of
        // them is known, so no scale target (a quantized one leaves the scale param
        // incomplete, a coverage error; a BF16 one is refused by dtype).
        continue;
      }
      s.feeds.emplace_back(tensor, &t);
      for (int rank : layout_.local_ranks) {
        const Shape dst = s.weight(rank);
        for (const Block& b : t.copy(rank)) {
          if (b.length == 0 && dst.size() < 3) {  // (experts: their shards' starts)
            continue;
          }
          if (b.axis == 0) {
            start_set.insert(b.dst_start);
          }
          if (w.traits.grain == ScaleGrain::kBlock) {
            check_block_aligned(b, inner_dims(t.src_shape, b.src_index.size()),
                                inner_dims(dst, b.dst_index.size()), w.bn, w.bk, tensor, t.param,
                                rank, layout_.tp);
          }
        }
      }
    }
  }
  s.starts.assign(start_set.begin(), start_set.end());
  s.shards = std::max<std::uint64_t>(1, s.starts.size());
  shard_starts_[d.name] = s.starts.empty() ? std::vector<std::uint64_t>{0} : s.starts;
  const Shape first_shape = s.weight(layout_.local_ranks.front());
  s.stacked = first_shape.size() > 2;
  // The weight's own scale param: the checkpoint's scales as loaded (a transient
  // F32 copy under quantization.requant=ue8m0, whose packed output takes the name).
  // postprocess.target (models/postprocess.hpp): a scale whose served shape differs
  // loads into a transient twin of its loaded shape, which a hook reads.
  s.ue8m0 = !d.transient && converts_ue8m0(q, first_shape);
  s.form = d.transient ? ScaleForm::kAsLoaded : scale_form(q, first_shape, s.shards);
  s.nvfp4 = !d.transient && nvfp4_served(q, first_shape);
  s.marlin = !d.transient && nvfp4_marlin(q, first_shape);
  s.scale2 = s.marlin && s.stacked ? loaded_scale_2_name(d.name)
                                   : companion_name(d.name, "weight_scale_2");
  for (int rank : layout_.local_ranks) {
    const std::string why = !s.stacked || d.transient ? ""
                            : s.marlin                ? marlin_experts_unaligned(s.weight(rank))
                                       : sm100_experts_unaligned(q, d.name, s.weight(rank));
    if (!why.empty()) {
      throw Error(Stage::kPlacement, "", d.name,
                  "postprocess.target=" + std::string(to_string(q.target)) + ": " + why +
                      " (tp rank " + std::to_string(rank) + ")");
    }
  }
  s.nvfp4_pad = s.nvfp4 && !s.stacked && nvfp4_pads(first_shape);
  for (int rank : s.nvfp4 ? layout_.local_ranks : std::vector<int>{}) {
    const Shape shape = s.weight(rank);
    if (scale_form(q, shape, s.shards) != s.form || nvfp4_pads(shape) != s.nvfp4_pad) {
      throw Error(Stage::kPlacement, "", d.name,
                  "postprocess.target=sm100: the NVFP4 weight would be padded, or its swizzled "
                  "scales replace weight_scale, on some local ranks and not on others (" +
                      format_shape(shape) + " on tp rank " + std::to_string(rank) + ")");
    }
  }
  s.input_max = !d.transient && input_scale_max(q);
  s.scale = s.form != ScaleForm::kAsLoaded ? loaded_tensor_scale_name(d.name)
                                           : loaded_scale_name(q, d.name, s.ue8m0);
  s.input_param =
      s.input_max ? loaded_input_scale_name(d.name) : companion_name(d.name, "input_scale");
  // The experts' w13_input_scale is [E] for the FP8 methods: w1's and w3's scalars
  // go to one element per expert (FusedMoE._load_single_value). NVFP4 keeps [E, 2],
  // but the same loader writes each scalar to the expert's whole row, so both
  // elements hold the one loaded last (`row_input`).
  s.merged_input = s.stacked && w.traits.merged_expert_input;
  s.row_input = s.stacked && !w.traits.merged_expert_input && s.shards > 1;
  // SGLang 0.5.23's ModelOptNvFp4FusedMoEMethod.create_weights makes w13_input_scale
  // [num_experts, 2] and w2_input_scale [num_experts], every global expert (physical
  // ones, then the fused shared one), marked `_sglang_require_global_experts`, so
  // FusedMoE.weight_loader writes each expert's scalar on every rank.
  if (q.method == QuantScheme::Method::kNvfp4 && q.input_scales && s.stacked) {
    if (auto it = global_experts_.find(d.name); it != global_experts_.end()) {
      s.global_rows = it->second.first;
      s.rows_of = it->second.second;
    }
  }
  return s;
}

// quantization.requant's outputs (models/requant.hpp): DeepGEMM's packed UE8M0
// scales, or one F32 scale a matrix. It converts what the model keeps; a transient
// is only read.
void TableModel::add_requant_outputs(const WeightScales& s, QuantWork& w) const {
  const QuantScheme& q = w.q;
  const ParamDecl& d = *s.decl;
  const ShapeRule& weight = s.weight;
  if (s.ue8m0) {
    for (int rank : layout_.local_ranks) {
      const Shape shape = weight(rank);
      if (shape[shape.size() - 2] % 4 != 0) {
        throw Error(Stage::kPlacement, "", d.name,
                    "quantization.requant=ue8m0 packs the scales of " +
                        std::to_string(shape[shape.size() - 2]) + " rows on tp rank " +
                        std::to_string(rank) +
                        "; DeepGEMM's layout needs a multiple of 4 (TMA alignment)");
      }
      if (converts_ue8m0(q, shape) != s.ue8m0) {
        throw Error(Stage::kPlacement, "", d.name,
                    "postprocess.target=sm100: the UE8M0 repack would convert this weight on "
                    "some local ranks and not on others (tp rank " +
                        std::to_string(rank) + " holds " + format_shape(shape) + ")");
      }
    }
    // DeepGEMM's MN-major layout: the rows run fastest within each packed word.
    // SGLang 0.5.23's requant_weight_ue8m0_inplace (fp8_utils.py) replaces
    // weight_scale_inv itself with it, so it takes that name.
    w.companions.push_back({weight_scale_name(q, d.name),
                            [weight, bk = w.bk](int rank) {
                              Shape shape = weight(rank);
                              shape.back() = ((shape.back() + bk - 1) / bk + 3) / 4;
                              return shape;
                            },
                            DType::kI32, false,
                            [](const Shape& shape) {
                              const std::uint64_t rows = shape[shape.size() - 2];
                              return shape.size() == 3
                                         ? std::vector<std::uint64_t>{shape[2] * rows, 1, rows}
                                         : std::vector<std::uint64_t>{1, rows};
                            }});
  } else if (q.requant == QuantScheme::Requant::kTensor && !d.transient) {
    w.companions.push_back({companion_name(d.name, "weight_scale"),
                            [weight](int rank) {
                              Shape shape = weight(rank);
                              shape.resize(shape.size() - 2);  // one a matrix: an expert each
                              return shape.empty() ? Shape{1} : shape;
                            },
                            DType::kF32});
  }
}

// The weight's scale params: its scale (as its QuantTraits grain lays it out), the
// second scale, quantization.requant's outputs and the static input scale.
void TableModel::add_weight_companions(const WeightScales& s, QuantWork& w) const {
  const QuantScheme& q = w.q;
  const ParamDecl& d = *s.decl;
  const ShapeRule& weight = s.weight;
  const ShapeRule per_shard_shape = s.scale_shape(s.shards);
  switch (w.traits.grain) {
    case ScaleGrain::kBlock: {
      ShapeRule blocks = [weight, bn = w.bn, bk = w.bk](int rank) {
        return block_scale_shape(weight(rank), bn, bk);
      };
      const bool swizzled = s.form == ScaleForm::kSwizzled;
      w.companions.push_back(
          {s.scale, blocks, w.traits.scale_dtype, s.ue8m0 || swizzled || s.marlin});
      if (swizzled) {
        w.companions.push_back({weight_scale_name(q, d.name), blocks, w.traits.scale_dtype});
      } else if (s.marlin) {
        w.companions.push_back({weight_scale_name(q, d.name),
                                [weight, group = q.group_size](int rank) {
                                  return marlin_scale_shape(weight(rank), group);
                                },
                                w.traits.scale_dtype});
      }
      break;
    }
    case ScaleGrain::kChannel:
      w.companions.push_back({s.scale, replace_last_dim(weight, 1, 1), w.traits.scale_dtype});
      break;
    case ScaleGrain::kShard:
      w.companions.push_back(
          {s.scale, per_shard_shape, w.traits.scale_dtype, s.form != ScaleForm::kAsLoaded});
      if (s.form != ScaleForm::kAsLoaded) {
        w.companions.push_back(
            {weight_scale_name(q, d.name),
             [weight, form = s.form](int rank) { return served_scale_shape(form, weight(rank)); },
             DType::kF32});
      }
      break;
    case ScaleGrain::kNone:
      break;
  }
  if (w.traits.second_scale) {
    const bool marlin_experts = s.marlin && s.stacked;
    w.companions.push_back({s.scale2, per_shard_shape, DType::kF32, marlin_experts});
    if (marlin_experts) {
      w.companions.push_back(
          {companion_name(d.name, "weight_scale_2"), s.scale_shape(1), q.params_dtype});
    }
  }
  add_requant_outputs(s, w);
  if (s.nvfp4) {
    // ModelOptFp4LinearMethod / ModelOptNvFp4FusedMoEMethod.process_weights_after_loading
    // on sm100 (models/postprocess.hpp).
    if (s.form != ScaleForm::kSwizzled && !(s.stacked && q.trtllm_experts)) {
      w.companions.push_back(
          {companion_name(d.name, s.stacked ? "blockscale_swizzled" : "weight_scale_interleaved"),
           [weight, group = q.group_size](int rank) {
             return nvfp4_swizzled_shape(weight(rank), group);
           },
           w.traits.scale_dtype});
    }
    for (const auto& out : nvfp4_expert_scalars(q, d.name, s.stacked)) {
      w.companions.push_back({out.first,
                              [weight, scalar = out.second](int rank) {
                                return scalar ? Shape{} : Shape{weight(rank)[0]};
                              },
                              DType::kF32});
    }
  }
  for (const std::string& name : trtllm_fp8_scalars(q, d.name, s.stacked)) {
    w.companions.push_back({name, [weight](int r) { return Shape{weight(r)[0]}; }, DType::kF32});
  }
  if ((s.nvfp4 || s.marlin) && !s.stacked) {
    // alpha and input_scale_inv on both targets; Marlin's global scales on sm90
    // (prepare_nvfp4_layer_for_marlin).
    std::vector<std::string> scalars = {"alpha", "input_scale_inv"};
    if (s.marlin) {
      scalars.push_back("input_global_scale");
      w.companions.push_back({companion_name(d.name, "weight_global_scale"),
                              [](int) { return Shape{1}; }, q.params_dtype});
    }
    for (const std::string& scalar : scalars) {
      w.companions.push_back(
          {companion_name(d.name, scalar), [](int) { return Shape{}; }, DType::kF32});
    }
  }
  if (q.input_scales) {
    ShapeRule input_shape = s.merged_input ? s.scale_shape(1) : per_shard_shape;
    if (s.global_rows != 0) {
      Shape global{s.global_rows};
      if (s.shards > 1) {
        global.push_back(s.shards);
      }
      input_shape = [global](int) { return global; };
    }
    w.companions.push_back({s.input_param, input_shape, DType::kF32, s.input_max});
    if (s.input_max) {
      w.companions.push_back(
          {companion_name(d.name, "input_scale"), [](int) { return Shape{}; }, DType::kF32});
    }
  }
}

// The target a weight tensor's scale tensor loads through, as the grain lays it out.
TableModel::Target TableModel::scale_target(const WeightScales& s, const Target& t,
                                            const QuantWork& w) {
  const BlockRule logical = t.copy;
  const Shape src = t.src_shape;
  Target scale{s.scale, {}, {}, t.empty_reason};
  switch (w.traits.grain) {
    case ScaleGrain::kBlock:
      scale.src_shape = block_scale_shape(src, w.bn, w.bk);
      scale.copy = [logical, bn = w.bn, bk = w.bk](int rank) {
        std::vector<Block> out;
        for (const Block& b : logical(rank)) {
          out.push_back(scale_block(b, bn, bk));
        }
        return out;
      };
      break;
    case ScaleGrain::kChannel:
      scale.src_shape = src;
      scale.src_shape.back() = 1;
      scale.copy = [logical, src](int rank) {
        std::vector<Block> out;
        for (const Block& b : logical(rank)) {
          if (b.length != 0) {
            add_unique(out, channel_scale_block(b, inner_dims(src, b.src_index.size())));
          }
        }
        return out;
      };
      break;
    case ScaleGrain::kShard:
      scale.src_shape = Shape{};
      scale.copy = s.per_shard_rule(logical);
      break;
    case ScaleGrain::kNone:
      break;
  }
  return scale;
}

// Packed weights (values_per_byte > 1, NVFP4's E2M1 pairs along K): the tensor's
// columns are bytes, so a target's column blocks are divided.
void TableModel::pack_target(const std::string& tensor, Target& t, const QuantWork& w) {
  const std::uint64_t per_byte = w.traits.values_per_byte;
  if (per_byte == 1) {
    return;
  }
  if (t.src_shape.back() % per_byte != 0) {
    throw Error(Stage::kPlacement, "", tensor,
                std::string("an ") + w.traits.name + " weight packs " +
                    (per_byte == 2 ? std::string("two") : std::to_string(per_byte)) +
                    " values a byte, but the tensor has " + std::to_string(t.src_shape.back()) +
                    " columns");
  }
  t.src_shape.back() /= per_byte;
  t.copy = [logical = t.copy, per_byte](int rank) {
    std::vector<Block> out = logical(rank);
    for (Block& b : out) {
      if (b.axis == 1) {
        b.src_start /= per_byte;
        b.dst_start /= per_byte;
        b.length /= per_byte;
      }
    }
    return out;
  };
}

// Each feed's scale targets: its weight scale, second scale and input scale.
// Returns whether w1's input scales load into a transient (compressed-tensors).
bool TableModel::add_scale_targets(const WeightScales& s, QuantWork& w) {
  const QuantScheme& q = w.q;
  const ParamDecl& d = *s.decl;
  // The experts' slots a target writes (local rank and expert index of each block):
  // the w1 and w3 tensors of one expert write the same ones.
  auto slots_of = [this, &s](const std::string& tensor, const Target& t) {
    if (s.global_rows != 0) {  // the global rows, the same on every rank
      return s.rows_of(tensor);
    }
    std::vector<std::uint64_t> key;
    for (int rank : layout_.local_ranks) {
      for (const Block& b : t.copy(rank)) {
        if (b.length != 0) {
          key.push_back(static_cast<std::uint64_t>(rank));
          key.insert(key.end(), b.dst_index.begin(), b.dst_index.end());
        }
      }
    }
    return key;
  };
  // Of the tensors writing the same experts' slots, the one SGLang loads last:
  // the checkpoint's name order (gate_proj before up_proj, w1 before w3).
  std::map<std::vector<std::uint64_t>, std::string> last_of_slots;
  if ((s.merged_input && s.shards > 1) || s.row_input) {
    for (const auto& [tensor, t] : s.feeds) {
      const std::vector<std::uint64_t> key = slots_of(tensor, *t);
      if (!key.empty()) {
        std::string& last = last_of_slots[key];
        last = std::max(last, tensor);
      }
    }
  }
  bool w1_inputs = false;
  for (const auto& [tensor, t] : s.feeds) {
    const BlockRule logical = t->copy;
    w.added.emplace_back(weight_scale_name(q, tensor), scale_target(s, *t, w));
    if (w.traits.second_scale) {
      w.added.emplace_back(companion_name(tensor, "weight_scale_2"),
                           Target{s.scale2, Shape{}, s.per_shard_rule(logical), t->empty_reason});
    }
    if (q.input_scales) {
      const std::string input = companion_name(tensor, "input_scale");
      auto last = last_of_slots.find(slots_of(tensor, *t));
      if (last != last_of_slots.end() && last->second != tensor) {
        if (q.format == QuantScheme::Format::kCompressedTensors && s.merged_input) {
          // SGLang's compressed-tensors FusedMoE refuses w1 / w3 input scales that
          // differ (FusedMoE.weight_loader): w1's load into a transient that
          // make_input_scale_checks compares with the slot (w3's).
          w.added.emplace_back(input,
                               Target{input_scale_w1_name(d.name), Shape{},
                                      s.per_shard_rule(logical, s.merged_input), t->empty_reason});
          w1_inputs = true;
        } else {
          // SGLang writes w1's, then w3's over it, so the element holds w3's; w1's
          // is not read.
          drop_names_[input] = "overwritten_scale";
        }
      } else if (s.global_rows != 0) {
        // Every rank: each of the tensor's global rows (each element of it: the
        // scalar loaded last, as below), whether or not the rank holds the expert.
        w.added.emplace_back(input, Target{s.input_param, Shape{},
                                           [rows = s.rows_of(tensor), shards = s.shards](int) {
                                             std::vector<Block> out;
                                             for (std::uint64_t row : rows) {
                                               for (std::uint64_t k = 0; k < shards; ++k) {
                                                 Block b;
                                                 b.axis = 0;
                                                 b.length = 1;
                                                 if (shards > 1) {
                                                   b.dst_index = {row};
                                                   b.dst_start = k;
                                                 } else {
                                                   b.dst_start = row;
                                                 }
                                                 out.push_back(b);
                                               }
                                             }
                                             return out;
                                           },
                                           t->empty_reason});
      } else if (s.row_input) {
        // The last loaded scalar in every shard's element of its expert's row.
        BlockRule one = s.per_shard_rule(logical);
        w.added.emplace_back(input, Target{s.input_param, Shape{},
                                           [one, shards = s.shards](int rank) {
                                             std::vector<Block> out;
                                             for (const Block& b : one(rank)) {
                                               for (std::uint64_t k = 0; k < shards; ++k) {
                                                 Block c = b;
                                                 c.dst_start = k;
                                                 add_unique(out, c);
                                               }
                                             }
                                             return out;
                                           },
                                           t->empty_reason});
      } else {
        w.added.emplace_back(
            input, Target{s.input_param, Shape{}, s.per_shard_rule(logical, s.merged_input),
                          t->empty_reason});
      }
    }
    pack_target(tensor, *t, w);
  }
  return w1_inputs;
}

// ModelOpt's FP8 KV cache: SGLang's maybe_remap_kv_scale_name gives every attention
// its F32 scalars; postprocess.target adds those no checkpoint tensor feeds.
void TableModel::add_kv_cache_scales(QuantWork& w) const {
  const QuantScheme& q = w.q;
  if (q.kv_cache_scales) {
    // SGLang's maybe_remap_kv_scale_name: self_attn.k_proj.k_scale (or
    // self_attn.k_scale) -> self_attn.attn.k_scale, likewise v; MLA's go to
    // self_attn.attn_mqa.k_scale (below).
    std::map<std::string, std::string> a_tensor_of;  // attention param -> a tensor feeding it
    for (const auto& [tensor, targets] : targets_) {
      for (const Target& t : targets) {
        if (tensor.find("self_attn.") != std::string::npos) {
          a_tensor_of.emplace(t.param, tensor);
        }
      }
    }
    for (const ParamDecl& d : param_decls_) {
      auto it = a_tensor_of.find(d.name);
      if (it == a_tensor_of.end() || (!ends_with(d.name, "self_attn.qkv_proj.weight") &&
                                      !ends_with(d.name, "self_attn.kv_b_proj.weight"))) {
        continue;
      }
      constexpr std::string_view kAttn = "self_attn.";
      const std::string pa = d.name.substr(0, d.name.find(kAttn) + kAttn.size());
      const std::string ta = it->second.substr(0, it->second.find(kAttn) + kAttn.size());
      // MLA's scales belong to its absorbed attention, attn_mqa: SGLang 0.5.23's
      // DeepSeek loader (deepseek_common/deepseek_weight_loader.py, load_weights)
      // renames k_proj.k_scale to attn_mqa.k_scale.
      const bool mla = ends_with(d.name, "self_attn.kv_b_proj.weight");
      for (const std::string s : {"k", "v"}) {
        const std::string param = pa + (mla ? "attn_mqa." : "attn.") + s + "_scale";
        w.companions.push_back({param, [](int) { return Shape{}; }, DType::kF32});
        for (const std::string& name : {ta + s + "_proj." + s + "_scale", ta + s + "_scale"}) {
          w.added.emplace_back(
              name, Target{param, Shape{}, [](int) { return std::vector<Block>{replicated(1)}; },
                           "no_local_slice"});
        }
      }
    }
  }
  // postprocess.target: every attention SGLang gives a KV-cache quant method holds
  // BaseKVCacheMethod's k_scale / v_scale (F32 []; MLA on attn_mqa and attn_mha);
  // those no checkpoint tensor feeds get 1.0 from a hook (models/postprocess.hpp).
  if (kv_scales_served(q)) {
    std::set<std::string> declared;
    for (const ParamDecl& c : w.companions) {
      declared.insert(c.name);
    }
    for (const ParamDecl& d : param_decls_) {
      const bool mla = ends_with(d.name, "self_attn.kv_b_proj.weight");
      if (!mla && !ends_with(d.name, "self_attn.qkv_proj.weight")) {
        continue;
      }
      constexpr std::string_view kAttn = "self_attn.";
      const std::string pa = d.name.substr(0, d.name.find(kAttn) + kAttn.size());
      for (const std::string& attn : mla ? std::vector<std::string>{"attn_mqa.", "attn_mha."}
                                         : std::vector<std::string>{"attn."}) {
        for (const std::string s : {"k", "v"}) {
          const std::string param = pa + attn + s + "_scale";
          if (declared.insert(param).second) {
            w.companions.push_back({param, [](int) { return Shape{}; }, DType::kF32});
          }
        }
      }
    }
  }
}

void TableModel::apply_quant() {
  const std::map<std::string, ShapeRule> quantized = quantized_weights();
  const QuantTraits& traits = quant_traits(quant_.method);
  // Block-scaled shares must be whole blocks: NVFP4's scales are [1, group] blocks.
  QuantWork w{quant_,
              traits,
              traits.group_blocks ? 1 : quant_.block_n,
              traits.group_blocks ? quant_.group_size : quant_.block_k,
              {},
              {}};
  std::map<std::string, std::string> twins;  // weight -> its loaded twin
  for (ParamDecl& d : param_decls_) {
    auto qit = quantized.find(d.name);
    if (qit == quantized.end()) {
      continue;
    }
    const std::size_t companions_before = w.companions.size();
    const WeightScales s = weight_scales(d, qit->second, w);
    add_weight_companions(s, w);
    for (std::size_t i = 0, n = fill_decls_.size(); i < n; ++i) {
      if (fill_decls_[i].param == d.name) {          // flashinfer_trtllm's padded experts
        if (w.traits.grain == ScaleGrain::kBlock) {  // (a scale a shard: loaded whole)
          fill_decls_.push_back({s.scale, scale_fill(fill_decls_[i].zero, w.bn, w.bk)});
        }
        fill_decls_[i].zero = packed_fill(fill_decls_[i].zero, w.traits.values_per_byte);
      }
    }
    if (add_scale_targets(s, w)) {
      w.companions.push_back({input_scale_w1_name(d.name), s.scale_shape(1), DType::kF32, true});
    }
    // The scales of a transient weight (read by a hook, then freed) go with it.
    if (d.transient) {
      for (std::size_t c = companions_before; c < w.companions.size(); ++c) {
        w.companions[c].transient = true;
      }
    }
    // The weight param itself: F8_E4M3, or NVFP4's packed bytes.
    d.dtype = w.traits.weight_dtype;
    if (w.traits.values_per_byte > 1) {
      d.shape = replace_last_dim(s.weight, w.traits.values_per_byte);
    }
    if (s.marlin) {
      // postprocess.target=sm90: the checkpoint's weight loads into a transient twin;
      // the param is Marlin's repack of it (models/postprocess.hpp).
      // A bias (Qwen2's qkv_proj) loads into its twin too; the param is padded to N'
      // and permuted (marlin_permute_bias).
      const std::string bias = companion_name(d.name, "bias");
      auto b = std::find_if(param_decls_.begin(), param_decls_.end(),
                            [&](const ParamDecl& p) { return p.name == bias; });
      if (b != param_decls_.end()) {
        w.companions.push_back({loaded_bias_name(d.name), b->shape, b->dtype, true});
        twins.emplace(bias, loaded_bias_name(d.name));
        b->shape = [weight = s.weight](int rank) {
          return Shape{marlin_padded_shape(weight(rank))[0]};
        };
      }
      d.dtype = DType::kI32;
    }
    if (s.marlin || s.nvfp4_pad) {  // (sm100: pad_nvfp4_weight's zero-padded weight)
      w.companions.push_back({loaded_weight_name(d.name), d.shape, w.traits.weight_dtype, true});
      twins.emplace(d.name, loaded_weight_name(d.name));
      d.shape = [weight = s.weight, marlin = s.marlin](int rank) {
        return marlin ? marlin_weight_shape(weight(rank)) : nvfp4_padded_weight(weight(rank));
      };
    }
  }
  retarget(twins);
  add_kv_cache_scales(w);
  for (ParamDecl& c : w.companions) {
    param_decls_.push_back(std::move(c));
  }
  for (auto& [tensor, target] : w.added) {
    targets_[tensor].push_back(std::move(target));
  }
}

void TableModel::apply_online() {
  // Each quantized linear param P becomes F8_E4M3 and gets its F32 weight_scale; the
  // checkpoint's pieces and fills go to a transient P_unquantized of the model dtype
  // instead, which the online quantization hook reads (models/online_quant.hpp).
  const bool channel = quant_.online == QuantScheme::Online::kChannel;
  std::map<std::string, std::string> unquantized;  // P -> its transient
  std::vector<ParamDecl> added;
  for (ParamDecl& d : param_decls_) {
    // A transient (the V3.2 indexer's fused wk) is read by its hook as loaded.
    if (!quantized_linear_param(d.name) || d.transient) {
      continue;
    }
    const std::string t = companion_name(d.name, "weight_unquantized");
    unquantized.emplace(d.name, t);
    added.push_back({t, d.shape, d.dtype, true});
    const ShapeRule weight = d.shape;
    added.push_back({companion_name(d.name, "weight_scale"),
                     [weight, channel](int rank) {
                       Shape s = weight(rank);
                       if (channel && s.size() == 2) {
                         s.back() = 1;  // one scale an output row
                         return s;
                       }
                       s.resize(s.size() - 2);  // one a matrix: a fused expert each
                       return s.empty() ? Shape{1} : s;
                     },
                     DType::kF32});
    d.dtype = DType::kF8E4M3;
  }
  for (ParamDecl& a : added) {
    param_decls_.push_back(std::move(a));
  }
  retarget(unquantized);
}

}  // namespace ferry::models
