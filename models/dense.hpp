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
  bool qkv_bias = false;  // Qwen2 always; Llama/Mistral with attention_bias
  bool o_bias = false;    // Llama/Mistral attention_bias
};

// Reads the fields of `architecture` (one of the three above) from config.json.
// Throws Error(Stage::kConfig) naming a missing or malformed field.
DenseConfig parse_dense_config(const nlohmann::json& hf_config, const std::string& architecture);

// The model for `config` under `layout` (already normalized) with params of `dtype`.
// A pipeline stage (layout.pp > 1) holds only its layers (models/stages.hpp: the
// others' tensors are dropped "pp_stage") and the edges that fall to it. Throws
// Error(Stage::kPlacement) when the layout cannot split it (sizes tp does not
// divide, unless options.unaligned_tp pads them), Error(kConfig) for ep > 1, a bad
// pp_partition, or an option only MoE or MTP models take (draft, eplb, switch_w13,
// pad_moe_intermediate_to, fuse_shared_experts=true): refused, not ignored.
std::unique_ptr<Model> make_dense_model(const DenseConfig& config, const ParallelLayout& layout,
                                        DType dtype, const ModelOptions& options);

}  // namespace ferry::models
