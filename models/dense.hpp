// The dense decoder every Llama-like family shares (models/families/: Llama,
// Mistral, Qwen2, Qwen3, Gemma 1-3, Phi-3): per layer, SGLang's fused qkv_proj and
// o_proj, optional per-head q_norm / k_norm, the gated MLP (gate_up_proj,
// down_proj) and the layer's norms; the vocabulary edges and pipeline stages of
// models/stages.hpp. A family's file reads its config fields into a DenseConfig;
// what differs between families is data here, not a check on the family's name.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/family.hpp"
#include "models/hf_config.hpp"
#include "models/table_model.hpp"

namespace ferry::models {

// The config a dense family reads (hidden, heads, kv_heads, head_dim, layers, vocab,
// tie_embeddings from GqaDecoderDims), and how the family differs.
struct DenseConfig : GqaDecoderDims {
  std::uint64_t intermediate = 0;
  bool qkv_bias = false;  // q/k/v biases (Qwen2 always; others with attention_bias)
  bool o_bias = false;    // o_proj bias (Llama / Qwen3 / Gemma with attention_bias)
  bool qk_norm = false;   // self_attn.q_norm / k_norm, [head_dim] each (Qwen3, Gemma 3)
  // The layer's norms, each [hidden] and replicated: Gemma 2 and 3 add
  // pre_feedforward_layernorm and post_feedforward_layernorm.
  std::vector<std::string> layer_norms{"input_layernorm", "post_attention_layernorm"};
  // SGLang's loader skips a ".bias" it has no param for: an mlp_bias checkpoint's MLP
  // biases, attention biases without attention_bias. Dropped "no_bias_param".
  bool drop_unused_biases = false;
  // Gemma 3's embedding is a plain nn.Embedding: every rank holds the whole,
  // unpadded vocabulary (and the tied output projection uses it).
  bool replicated_embedding = false;
  // False: pp > 1 is refused (Gemma: no lm_head module to put on a last stage).
  bool pipeline_stages = true;
  // Gemma 1: every "...norm.weight" loads into an F32 transient "<name>_loaded",
  // which its post-load hook reads to compute the param (TableModel::load_through).
  bool norms_through_f32 = false;
};

// The fields every dense family reads alike: GqaDecoderDims and intermediate_size;
// the rest at their defaults, for the family to set.
DenseConfig dense_config(const nlohmann::json& config);

// The model of `c` for `in` (layout normalized, options resolved): every split is
// checked up front so the error names the config field (Stage::kPlacement; sizes tp
// does not divide are padded under unaligned_tp=pad); a pipeline stage holds only
// its layers. Returns the finished table.
std::unique_ptr<TableModel> make_dense_model(const FamilyInput& in, const DenseConfig& c);

// A dense family's descriptor: `architecture` reported as `family`, the standard
// fused mappings and required fields, built from `parse(config.json)`.
FamilyDescriptor dense_descriptor(std::string architecture, std::string family,
                                  std::function<DenseConfig(const nlohmann::json&)> parse);

// The fields every dense family reads (required ones; head_dim, num_key_value_heads
// and tie_word_embeddings have defaults).
std::vector<std::string> dense_required_fields();

}  // namespace ferry::models
