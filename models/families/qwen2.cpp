// Qwen2ForCausalLM (python/sglang/srt/models/qwen2.py): Llama's layout with q/k/v
// biases (Qwen2Attention always has them; o_proj has none).
#include "models/dense.hpp"

namespace ferry::models::families {

std::vector<FamilyDescriptor> qwen2() {
  FamilyDescriptor d =
      dense_descriptor("Qwen2ForCausalLM", "qwen2", [](const nlohmann::json& config) {
        DenseConfig c = dense_config(config);
        c.qkv_bias = true;
        return c;
      });
  // Under attention data parallelism SGLang 0.5.23's Qwen2Model splits embed_tokens
  // over the attention tp group (VocabParallelEmbedding(use_attn_tp_group=
  // is_dp_attention_enabled())); Qwen2Attention and Qwen2MLP keep the tp group, and
  // Qwen2ForCausalLM's ParallelLMHead takes no use_attn_tp_group (dp_lm_head refused).
  d.attention_dp = AttentionDpLayout{.attention = false, .embedding = true, .dp_lm_head = false};
  return {d};
}

}  // namespace ferry::models::families
