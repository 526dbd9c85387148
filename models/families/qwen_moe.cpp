// Qwen2MoeForCausalLM (python/sglang/srt/models/qwen2_moe.py) and
// Qwen3MoeForCausalLM (qwen3_moe.py): num_experts routed experts of
// moe_intermediate_size in the sparse layers (Hugging Face's rule below), dense
// layers of intermediate_size. Qwen2-MoE: q/k/v biases and a gated shared expert,
// never fused into the routed experts. Qwen3-MoE: per-head q_norm / k_norm, biases
// with attention_bias.
#include <set>

#include "models/moe.hpp"

namespace ferry::models::families {
namespace {

// Layer l is sparse unless it is in mlp_only_layers or (l + 1) is not a multiple
// of decoder_sparse_step.
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

MoeConfig qwen_moe_config(const nlohmann::json& config, bool qwen3) {
  MoeConfig c;
  static_cast<GqaDecoderDims&>(c) = config_gqa_decoder_dims(config);
  c.experts_field = "num_experts";
  c.moe_intermediate_field = "moe_intermediate_size";
  c.experts = config_positive(config, "num_experts");
  c.moe_intermediate = config_positive(config, "moe_intermediate_size");
  c.sparse = qwen_sparse_layers(config, c.layers);
  for (bool sparse : c.sparse) {
    if (!sparse) {
      c.dense_intermediate = config_positive(config, "intermediate_size");
      break;
    }
  }
  if (qwen3) {
    c.qk_norm = true;
    // Qwen3MoeAttention's attention_bias covers qkv_proj and o_proj.
    c.qkv_bias = config_bool(config, "attention_bias", false);
    c.o_bias = c.qkv_bias;
  } else {
    c.qkv_bias = true;  // Qwen2MoeAttention: q/k/v biases, none on o_proj
    c.shared_intermediate = config_count(config, "shared_expert_intermediate_size", 0);
  }
  return c;
}

FamilyDescriptor qwen_moe(std::string architecture, std::string family, bool qwen3) {
  FamilyDescriptor d;
  d.architecture = std::move(architecture);
  d.family = std::move(family);
  d.required_fields = {"hidden_size", "num_attention_heads", "num_hidden_layers",
                       "vocab_size",  "num_experts",         "moe_intermediate_size"};
  d.fused = standard_fused_mappings();
  // Qwen2-MoE has a shared expert: it takes the fusion option to refuse it with
  // SGLang's reason (never fused) rather than "no shared experts".
  // Qwen2MoeForCausalLM / Qwen3MoeForCausalLM build their lm_head on every stage.
  d.options = kTakesExperts | kLmHeadOnEveryStage |
              (qwen3 ? unsigned{kNoKvCacheScales} : unsigned{kTakesSharedExpertFusion});
  d.build = [qwen3](const FamilyInput& in) {
    return make_moe_model(in, qwen_moe_config(in.config, qwen3));
  };
  // Under attention data parallelism (SGLang 0.5.23, qwen2_moe.py / qwen3_moe.py):
  // Qwen2MoeAttention / Qwen3MoeAttention build qkv_proj and o_proj with
  // parallel_group="attn_tp"; Qwen2MoeModel splits embed_tokens over the attention
  // tp group; the ParallelLMHead takes use_attn_tp_group=enable_dp_lm_head. The
  // dense layers' and the shared expert's Qwen2MoeMLP keep the tp group, the
  // routed experts moe_tp = tp / ep.
  d.attention_dp = AttentionDpLayout{.attention = true, .embedding = true, .dp_lm_head = true};
  return d;
}

}  // namespace

std::vector<FamilyDescriptor> qwen_moe() {
  return {qwen_moe("Qwen2MoeForCausalLM", "qwen2_moe", false),
          qwen_moe("Qwen3MoeForCausalLM", "qwen3_moe", true)};
}

}  // namespace ferry::models::families
