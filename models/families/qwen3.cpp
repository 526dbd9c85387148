// Qwen3ForCausalLM (python/sglang/srt/models/qwen3.py at commit
// 01b5f572b7b678e2fa5a727881f1ff3ab4dd3c6d): Qwen3Attention has per-head q_norm /
// k_norm (RMSNorm(head_dim)) and biases on qkv_proj and o_proj only with
// attention_bias (none by default); head_dim from config.json (128 for Qwen3-8B,
// whose q width 32 * 128 equals hidden only by chance); Qwen2's MLP; a tied
// lm_head is the embedding. Its load_weights skips a ".bias" it has no param for.
#include "models/dense.hpp"

namespace ferry::models::families {

std::vector<FamilyDescriptor> qwen3() {
  FamilyDescriptor d;
  d.architecture = "Qwen3ForCausalLM";
  d.family = "qwen3";
  d.required_fields = dense_required_fields();
  d.fused = standard_fused_mappings();
  d.build = [](const FamilyInput& in) {
    DenseConfig c;
    static_cast<GqaDecoderDims&>(c) = config_gqa_decoder_dims(in.config);
    c.intermediate = config_positive(in.config, "intermediate_size");
    c.qkv_bias = config_bool(in.config, "attention_bias", false);
    c.o_bias = c.qkv_bias;
    c.qk_norm = true;
    c.drop_unused_biases = true;
    return make_dense_model(in, c);
  };
  return {d};
}

}  // namespace ferry::models::families
