// Qwen3ForCausalLM (python/sglang/srt/models/qwen3.py in
// SGLang 0.5.23): Qwen3Attention has per-head q_norm /
// k_norm (RMSNorm(head_dim)) and biases on qkv_proj and o_proj only with
// attention_bias (none by default); head_dim from config.json (128 for Qwen3-8B,
// whose q width 32 * 128 equals hidden only by chance); Qwen2's MLP; a tied
// lm_head is the embedding. Its load_weights skips a ".bias" it has no param for.
#include "models/dense.hpp"

namespace ferry::models::families {

std::vector<FamilyDescriptor> qwen3() {
  FamilyDescriptor d =
      dense_descriptor("Qwen3ForCausalLM", "qwen3", [](const nlohmann::json& config) {
        DenseConfig c = dense_config(config);
        c.qkv_bias = config_bool(config, "attention_bias", false);
        c.o_bias = c.qkv_bias;
        c.qk_norm = true;
        c.drop_unused_biases = true;
        return c;
      });
  // Under attention data parallelism (SGLang 0.5.23): Qwen3Attention builds qkv_proj
  // and o_proj with parallel_group="attn_tp"; Qwen3Model (Qwen2Model) splits
  // embed_tokens over the attention tp group; Qwen3MLP (Qwen2MLP) keeps the tp
  // group; Qwen3ForCausalLM's ParallelLMHead takes use_attn_tp_group=
  // enable_dp_lm_head (a tied lm_head on one stage is the embedding).
  d.attention_dp = AttentionDpLayout{.attention = true, .embedding = true, .dp_lm_head = true};
  d.options |= kNoKvCacheScales;
  return {d};
}

}  // namespace ferry::models::families
