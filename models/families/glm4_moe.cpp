// Glm4MoeForCausalLM (python/sglang/srt/models/glm4_moe.py in
// SGLang 0.5.23): DeepSeek's MoE and MTP layout with
// grouped-query attention (qkv_proj, q_norm / k_norm with use_qk_norm); SGLang folds
// a single shared expert into the routed experts at ep 1.
#include "models/deepseek.hpp"
#include "models/hf_config.hpp"

namespace ferry::models::families {

std::vector<FamilyDescriptor> glm4_moe() {
  FamilyDescriptor d;
  d.architecture = "Glm4MoeForCausalLM";
  d.family = "glm4_moe";
  d.required_fields = {"hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                       "intermediate_size"};
  d.fused = standard_fused_mappings();
  d.options = kTakesExperts | kTakesDraft | kTakesSharedExpertFusion | kTakesMoeDenseTp |
              kNoKvCacheScales | kLmHeadOnEveryStage;  // Glm4MoeForCausalLM: lm_head every stage
  // Under attention data parallelism (SGLang 0.5.23, glm4_moe.py): Glm4MoeAttention
  // builds qkv_proj and o_proj with parallel_group="attn_tp", Glm4MoeModel splits
  // embed_tokens over the attention tp group, the ParallelLMHead takes
  // use_attn_tp_group=enable_dp_lm_head. Glm4MoeDecoderLayer builds a dense layer's
  // Glm4MoeMLP "replicated" when is_dense_ffn_fully_dp() (moe_dense_tp 1), else
  // over the tp group.
  d.attention_dp = AttentionDpLayout{.attention = true, .embedding = true, .dp_lm_head = true};
  d.build = [](const FamilyInput& in) {
    const nlohmann::json& hf_config = in.config;
    DeepseekConfig c = deepseek_common_config(hf_config, in.descriptor.architecture);
    c.fusion = SharedExpertFusion::kSingleShared;
    c.mla = false;
    c.kv_heads = config_optional_positive(hf_config, "num_key_value_heads").value_or(c.heads);
    c.head_dim = config_head_dim(hf_config, c.hidden, c.heads);
    c.qkv_bias = config_bool(hf_config, "attention_bias", false);
    c.qk_norm = config_bool(hf_config, "use_qk_norm", false);
    // GLM-4 MoE has no moe_layer_freq; every layer from first_k_dense_replace on is
    // sparse, and its router always has the correction bias.
    c.moe_layer_freq = 1;
    c.gate_bias = true;
    // SGLang 0.5.23, glm4_moe.py Glm4MoeGate.__init__: weight and
    // e_score_correction_bias are both created float32.
    c.gate_f32 = true;
    return make_deepseek_model(in, c);
  };
  return {d};
}

}  // namespace ferry::models::families
