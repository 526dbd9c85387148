// Dense decoder families that share Llama's layout: LlamaForCausalLM,
// MistralForCausalLM and Qwen2ForCausalLM (SGLang's MistralForCausalLM is its
// Llama; Qwen2 differs by q/k/v biases). Param names and shapes follow SGLang.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "models/hf_config.hpp"
#include "models/model.hpp"

namespace ferry::models {

// The config fields a dense family uses, after defaults (hidden, heads, kv_heads,
// head_dim, layers, vocab, tie_embeddings from GqaDecoderDims).
struct DenseConfig : GqaDecoderDims {
  std::string family;        // "llama", "mistral", "qwen2"
  std::string architecture;  // "LlamaForCausalLM", ...
  std::uint64_t intermediate = 0;
  bool qkv_bias = false;        // Qwen2 always; Llama/Mistral with attention_bias
  bool o_bias = false;          // Llama/Mistral attention_bias
  bool mlp_bias = false;        // Llama/Mistral mlp_bias
};

// Reads the fields of `architecture` (one of the three above) from config.json.
// Throws Error(Stage::kConfig) naming a missing or malformed field.
DenseConfig parse_dense_config(const nlohmann::json& hf_config, const std::string& architecture);

// The model for `config` under `layout` (already normalized) with params of `dtype`.
// A pipeline stage (layout.pp > 1) holds only its layers (models/stages.hpp: the
// others' tensors are dropped "pp_stage") and the edges that fall to it. Throws
// Error(Stage::kPlacement) when the layout cannot split it, Error(kConfig) for ep > 1
// or a bad pp_partition.
std::unique_ptr<Model> make_dense_model(const DenseConfig& config, const ParallelLayout& layout,
                                        DType dtype, bool strict);

}  // namespace ferry::models
