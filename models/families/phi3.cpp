// Phi3ForCausalLM: SGLang's Llama (python/sglang/srt/models/llama.py in
// SGLang 0.5.23: `class Phi3ForCausalLM(LlamaForCausalLM)`
// with no changes). Its checkpoints store qkv_proj and gate_up_proj already fused;
// Llama's load_weights matches its stacked names with dots (".q_proj"), so those
// reach the weight loaders without a shard id, which split them by the head counts
// and output sizes (models/layers.hpp does the same). head_dim is hidden / heads (96
// for Phi-3-mini); partial_rotary_factor and longrope change no weight.
#include "models/families/llama.hpp"

namespace ferry::models::families {

std::vector<FamilyDescriptor> phi3() {
  return {llama_descriptor("Phi3ForCausalLM", "phi3")};
}

}  // namespace ferry::models::families
