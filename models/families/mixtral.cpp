// MixtralForCausalLM (python/sglang/srt/models/mixtral.py): every layer sparse, an
// expert's width is intermediate_size, the router and experts under
// block_sparse_moe., and the checkpoint names an expert's gate, up and down w1, w3
// and w2. Attention data parallelism is refused: SGLang 0.5.23's mixtral.py builds
// nothing for it (MixtralAttention, its embedding and lm_head over the tp group).
#include "models/moe.hpp"

namespace ferry::models::families {

std::vector<FamilyDescriptor> mixtral() {
  FamilyDescriptor d;
  d.architecture = "MixtralForCausalLM";
  d.family = "mixtral";
  d.required_fields = {"hidden_size",       "num_attention_heads", "num_hidden_layers",
                       "vocab_size",        "num_local_experts",   "intermediate_size"};
  d.fused = {
      {"qkv_proj", {"q_proj", "k_proj", "v_proj"}},
      {"gate_up_proj", {"gate_proj", "up_proj"}},
      {"experts.w13_weight", {"w1", "w3"}},
      {"experts.w2_weight", {"w2"}},
  };
  d.options = kTakesExperts | kLmHeadOnEveryStage;  // MixtralForCausalLM's lm_head: every stage
  d.build = [](const FamilyInput& in) {
    MoeConfig c;
    static_cast<GqaDecoderDims&>(c) = config_gqa_decoder_dims(in.config);
    c.moe_block = "block_sparse_moe.";
    c.experts_field = "num_local_experts";
    c.moe_intermediate_field = "intermediate_size";
    c.experts = config_positive(in.config, "num_local_experts");
    c.moe_intermediate = config_positive(in.config, "intermediate_size");
    c.sparse.assign(c.layers, true);
    return make_moe_model(in, c);
  };
  return {d};
}

}  // namespace ferry::models::families
