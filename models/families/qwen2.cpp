// Qwen2ForCausalLM (python/sglang/srt/models/qwen2.py): Llama's layout with q/k/v
// biases (Qwen2Attention always has them; o_proj has none).
#include "models/dense.hpp"

namespace ferry::models::families {

std::vector<FamilyDescriptor> qwen2() {
  return {dense_descriptor("Qwen2ForCausalLM", "qwen2", [](const nlohmann::json& config) {
    DenseConfig c = dense_config(config);
    c.qkv_bias = true;
    return c;
  })};
}

}  // namespace ferry::models::families
