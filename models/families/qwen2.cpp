// Qwen2ForCausalLM (python/sglang/srt/models/qwen2.py): Llama's layout with q/k/v
// biases (Qwen2Attention always has them; o_proj has none).
#include "models/dense.hpp"

namespace ferry::models::families {

std::vector<FamilyDescriptor> qwen2() {
  FamilyDescriptor d;
  d.architecture = "Qwen2ForCausalLM";
  d.family = "qwen2";
  d.required_fields = dense_required_fields();
  d.fused = standard_fused_mappings();
  d.build = [](const FamilyInput& in) {
    DenseConfig c;
    static_cast<GqaDecoderDims&>(c) = config_gqa_decoder_dims(in.config);
    c.intermediate = config_positive(in.config, "intermediate_size");
    c.qkv_bias = true;
    return make_dense_model(in, c);
  };
  return {d};
}

}  // namespace ferry::models::families
