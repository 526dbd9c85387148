// LlamaForCausalLM and MistralForCausalLM (SGLang's MistralForCausalLM is its
// Llama): python/sglang/srt/models/llama.py (SGLang 0.5.23).
#include "models/families/llama.hpp"

#include "models/dense.hpp"

namespace ferry::models::families {
namespace {

// LlamaDecoderLayer: attention_bias (or bias) gives qkv_proj and o_proj a bias; its
// LlamaMLP has none, whatever mlp_bias says.
DenseConfig llama_config(const nlohmann::json& config) {
  DenseConfig c = dense_config(config);
  const bool attention_bias =
      config_bool(config, "attention_bias", false) || config_bool(config, "bias", false);
  c.qkv_bias = attention_bias;
  c.o_bias = attention_bias;
  c.drop_unused_biases = true;
  return c;
}

}  // namespace

FamilyDescriptor llama_descriptor(std::string architecture, std::string family) {
  FamilyDescriptor d =
      dense_descriptor(std::move(architecture), std::move(family), llama_config);
  // Under attention data parallelism SGLang 0.5.23's Llama keeps its attention, MLP
  // and embedding over all tp ranks (LlamaAttention and LlamaModel's
  // VocabParallelEmbedding take the tp group); only lm_head takes
  // use_attn_tp_group=enable_dp_lm_head (LlamaForCausalLM.__init__). Mistral and
  // Phi-3 are its subclasses.
  d.attention_dp = AttentionDpLayout{.attention = false, .embedding = false, .dp_lm_head = true};
  // LlamaForCausalLM.__init__ builds its ParallelLMHead on every pipeline stage.
  d.options |= kLmHeadOnEveryStage;
  return d;
}

std::vector<FamilyDescriptor> llama() {
  return {llama_descriptor("LlamaForCausalLM", "llama"),
          llama_descriptor("MistralForCausalLM", "mistral")};
}

}  // namespace ferry::models::families
