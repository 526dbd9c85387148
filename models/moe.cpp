#include "models/moe.hpp"

#include <array>
#include <set>
#include <utility>

#include "common/error.hpp"
#include "models/experts.hpp"
#include "models/hf_config.hpp"
#include "models/layers.hpp"
#include "models/placement.hpp"
#include "models/stages.hpp"
#include "models/table_model.hpp"

namespace ferry::models {
namespace {

using Blocks = std::vector<Block>;

constexpr const char* kMixtral = "MixtralForCausalLM";
constexpr const char* kQwen3Moe = "Qwen3MoeForCausalLM";
constexpr const char* kQwen2Moe = "Qwen2MoeForCausalLM";

[[noreturn]] void config_error(const std::string& rule) {
  throw Error(Stage::kConfig, kConfigFile, "", rule);
}

std::string layer_prefix(std::uint64_t layer) {
  return "model.layers." + std::to_string(layer) + ".";
}

// Hugging Face's Qwen-MoE rule: layer l is sparse unless it is in mlp_only_layers
// or (l + 1) is not a multiple of decoder_sparse_step.
std::vector<bool> qwen_sparse_layers(const nlohmann::json& config, std::uint64_t layers) {
  const std::uint64_t step = config_optional_positive(config, "decoder_sparse_step").value_or(1);
  std::set<std::uint64_t> dense;
  auto it = config.find("mlp_only_layers");
  if (it != config.end() && !it->is_null()) {
    if (!it->is_array()) {
      config_error("field 'mlp_only_layers' must be a list of layer indices (got " + it->dump() +
                   ")");
    }
    for (const nlohmann::json& v : *it) {
      if (!v.is_number_integer() || v.get<std::int64_t>() < 0) {
        config_error("field 'mlp_only_layers' holds " + v.dump() + ", not a layer index");
      }
      dense.insert(v.get<std::uint64_t>());
    }
  }
  std::vector<bool> out(layers);
  for (std::uint64_t l = 0; l < layers; ++l) {
    out[l] = !dense.contains(l) && (l + 1) % step == 0;
  }
  return out;
}

class Builder {
 public:
  Builder(TableModel& m, const MoeConfig& c, const ParallelLayout& layout,
          const ModelOptions& options)
      : m_(m), c_(c), layout_(layout), options_(options), tp_(layout.tp) {}

  void layer(std::uint64_t layer) {
    const std::string p = layer_prefix(layer);
    attention(p);
    for (const char* norm : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
      replicated_param(p + norm, c_.hidden);
    }
    if (!c_.sparse[layer]) {
      dense_mlp(p + "mlp.", c_.dense_intermediate, "intermediate_size");
      return;
    }
    const std::string moe = p + (c_.family == "mixtral" ? "block_sparse_moe." : "mlp.");
    // The router is a ReplicatedLinear: every rank holds all of it.
    const std::string gate = moe + "gate.weight";
    m_.add_param(gate, Shape{c_.experts, c_.hidden});
    m_.add_target(gate, gate, Shape{c_.experts, c_.hidden},
                  [e = c_.experts](int) { return Blocks{replicated(e)}; });

    MoeLayerSpec spec;
    spec.layer = layer;
    spec.num_experts = c_.experts;
    spec.hidden = c_.hidden;
    spec.intermediate = c_.moe_intermediate;
    spec.param_prefix = moe + "experts.";
    spec.checkpoint_prefix = moe + "experts.";
    if (c_.family == "mixtral") {
      spec.gate_name = "w1";
      spec.up_name = "w3";
      spec.down_name = "w2";
    }
    spec.intermediate_field = c_.moe_intermediate_field;
    add_moe_experts(m_, spec, layout_, options_);

    if (c_.shared_intermediate > 0) {
      // Qwen2-MoE's shared expert is never fused (SGLang's Qwen2MoeSparseMoeBlock
      // builds it as its own tensor-parallel MLP, gated by shared_expert_gate).
      dense_mlp(moe + "shared_expert.", c_.shared_intermediate, "shared_expert_intermediate_size");
      // The shared expert's sigmoid gate: a [1, H] ReplicatedLinear.
      const std::string sg = moe + "shared_expert_gate.weight";
      m_.add_param(sg, Shape{1, c_.hidden});
      m_.add_target(sg, sg, Shape{1, c_.hidden}, [](int) { return Blocks{replicated(1)}; });
    }
  }

 private:
  void replicated_param(const std::string& name, std::uint64_t size) {
    add_replicated(m_, name, name, Shape{size});
  }

  // q, k and v fused into qkv_proj (slots q, k, v), o_proj row-parallel; Qwen3's
  // per-head q/k RMSNorm weights are replicated.
  void attention(const std::string& p) {
    add_gqa_attention(m_, p + "self_attn.", p + "self_attn.",
                      gqa_attention(c_, c_.qkv_bias, c_.o_bias, options_.unaligned_tp), tp_);
    if (c_.qk_norm) {
      replicated_param(p + "self_attn.q_norm.weight", c_.head_dim);
      replicated_param(p + "self_attn.k_norm.weight", c_.head_dim);
    }
  }

  // A tensor-parallel gated MLP under `p` (dense layers, Qwen2-MoE's shared expert).
  void dense_mlp(const std::string& p, std::uint64_t inter, const char* what) {
    add_gated_mlp(m_, p, p, c_.hidden, inter, tp_, options_.unaligned_tp, what);
  }

  TableModel& m_;
  const MoeConfig& c_;
  const ParallelLayout& layout_;
  const ModelOptions& options_;
  int tp_;
};

// Every split the layout needs, checked before any param is declared so the error
// names the config field rather than a tensor.
void check_splits(const MoeConfig& c, const ParallelLayout& layout, const ModelOptions& options) {
  const int tp = layout.tp;
  padded_qkv(QkvShape{c.heads, c.kv_heads, c.head_dim}, tp, options.unaligned_tp);
  even_shard(padded_vocab(c.vocab), 0, tp, "padded vocab_size");
  std::vector<std::uint64_t> moe_layers;
  for (std::uint64_t l = 0; l < c.layers; ++l) {
    if (c.sparse[l]) {
      moe_layers.push_back(l);
    }
  }
  check_expert_parallel(layout, c.experts, options, c.architecture, c.experts_field, moe_layers);
  if (c.shared_intermediate > 0) {
    padded_intermediate(c.shared_intermediate, tp, options.unaligned_tp,
                        "shared_expert_intermediate_size");
  }
  if (moe_layers.size() < c.layers) {
    padded_intermediate(c.dense_intermediate, tp, options.unaligned_tp, "intermediate_size");
  }
  // SGLang fuses shared experts only for DeepSeek-V3/R1-shaped models and GLM-4 MoE
  // (determine_num_fused_shared_experts): asking for it here is refused.
  if (options.fuse_shared_experts.value_or(false)) {
    throw Error(Stage::kConfig, kConfigFile, "",
                "model.fuse_shared_experts=true: " + c.architecture +
                    (c.shared_intermediate > 0
                         ? " keeps its shared expert as a separate, gated MLP; SGLang never "
                           "fuses it into the routed experts"
                         : " has no shared experts"));
  }
}

}  // namespace

MoeConfig parse_moe_config(const nlohmann::json& hf_config, const std::string& architecture) {
  MoeConfig c;
  c.architecture = architecture;
  if (architecture == kMixtral) {
    c.family = "mixtral";
  } else if (architecture == kQwen3Moe) {
    c.family = "qwen3_moe";
  } else if (architecture == kQwen2Moe) {
    c.family = "qwen2_moe";
  } else {
    throw Error(Stage::kMapping, kConfigFile, "",
                "internal: " + architecture + " is not a Mixtral / Qwen-MoE architecture");
  }
  static_cast<GqaDecoderDims&>(c) = config_gqa_decoder_dims(hf_config);

  if (c.family == "mixtral") {
    // Every Mixtral layer is sparse; an expert's width is intermediate_size.
    c.experts_field = "num_local_experts";
    c.moe_intermediate_field = "intermediate_size";
    c.experts = config_positive(hf_config, "num_local_experts");
    c.moe_intermediate = config_positive(hf_config, "intermediate_size");
    c.sparse.assign(c.layers, true);
    return c;
  }
  c.experts_field = "num_experts";
  c.moe_intermediate_field = "moe_intermediate_size";
  c.experts = config_positive(hf_config, "num_experts");
  c.moe_intermediate = config_positive(hf_config, "moe_intermediate_size");
  c.sparse = qwen_sparse_layers(hf_config, c.layers);
  for (bool sparse : c.sparse) {
    if (!sparse) {
      c.dense_intermediate = config_positive(hf_config, "intermediate_size");
      break;
    }
  }
  if (c.family == "qwen3_moe") {
    c.qk_norm = true;
    // Qwen3MoeAttention's attention_bias covers qkv_proj and o_proj.
    c.qkv_bias = config_bool(hf_config, "attention_bias", false);
    c.o_bias = c.qkv_bias;
  } else {
    c.qkv_bias = true;  // Qwen2MoeAttention: q/k/v biases, none on o_proj
    c.shared_intermediate = config_count(hf_config, "shared_expert_intermediate_size", 0);
  }
  return c;
}

std::unique_ptr<Model> make_moe_model(const MoeConfig& c, const ParallelLayout& layout, DType dtype,
                                      const ModelOptions& options) {
  if (options.draft) {
    throw Error(Stage::kConfig, kConfigFile, "",
                "model.draft: " + c.architecture +
                    " has no MTP (NextN) layers, so there is no draft model to load");
  }
  if (c.sparse.size() != c.layers) {
    throw Error(Stage::kConfig, kConfigFile, "",
                "internal: the sparse-layer list has " + std::to_string(c.sparse.size()) +
                    " entries for num_hidden_layers " + std::to_string(c.layers));
  }
  check_splits(c, layout, options);
  const Range stage = pp_layers(c.layers, layout.pp, layout.pp_rank, layout.pp_partition);

  auto m = std::make_unique<TableModel>(c.family, c.architecture, layout, dtype, options.strict);
  m->set_quantization(options.quant);
  Builder b(*m, c, layout, options);
  for (std::uint64_t layer = stage.begin; layer < stage.end(); ++layer) {
    b.layer(layer);
  }
  add_layer_drops(*m, c.layers, stage);
  StageEdges edges;
  edges.hidden = c.hidden;
  edges.vocab = c.vocab;
  edges.tie_embeddings = c.tie_embeddings;
  add_stage_edges(*m, edges, layout);
  add_rope_cache_drops(*m);
  m->finish();
  return m;
}

std::unique_ptr<Model> make_moe_family(const nlohmann::json& hf_config,
                                       const std::string& architecture,
                                       const ParallelLayout& layout, DType dtype,
                                       const ModelOptions& options) {
  return make_moe_model(parse_moe_config(hf_config, architecture), layout, dtype, options);
}

}  // namespace ferry::models
