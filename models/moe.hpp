// Mixture-of-experts decoders with Llama-style attention (models/families/:
// Mixtral, Qwen2-MoE, Qwen3-MoE). Attention, norms and the vocabulary edges are
// placed as in the dense families; each sparse layer has a replicated router
// (`gate`) and fused experts (models/experts.hpp). Param names follow SGLang:
//   Mixtral    block_sparse_moe.gate.weight, block_sparse_moe.experts.w13_weight /
//              w2_weight (checkpoint experts.<e>.w1 = gate, w3 = up, w2 = down)
//   Qwen3-MoE  q_norm / k_norm per head ([head_dim], replicated), mlp.gate.weight,
//              mlp.experts.*; layers in mlp_only_layers or off decoder_sparse_step
//              are dense (mlp.gate_up_proj / down_proj of intermediate_size)
//   Qwen2-MoE  q/k/v biases, the same sparse rule, plus one shared expert: a
//              tensor-parallel MLP mlp.shared_expert.gate_up_proj / down_proj of
//              shared_expert_intermediate_size and its [1, H]
//              mlp.shared_expert_gate.weight.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/family.hpp"
#include "models/hf_config.hpp"
#include "models/table_model.hpp"

namespace ferry::models {

// The config fields these families use, after defaults (hidden, heads, kv_heads,
// head_dim, layers, vocab, tie_embeddings from GqaDecoderDims), and how the family
// differs.
struct MoeConfig : GqaDecoderDims {
  bool qkv_bias = false;                  // Qwen2-MoE always; Qwen3-MoE with attention_bias
  bool o_bias = false;                    // Qwen3-MoE with attention_bias
  bool qk_norm = false;                   // Qwen3-MoE
  std::string moe_block = "mlp.";         // where a sparse layer's router and experts live
  std::uint64_t experts = 0;              // routed experts E
  std::string experts_field;              // num_local_experts (Mixtral) or num_experts
  std::uint64_t moe_intermediate = 0;     // I of one routed expert
  std::string moe_intermediate_field;     // intermediate_size (Mixtral) or moe_intermediate_size
  std::uint64_t dense_intermediate = 0;   // intermediate_size of dense layers (0: none)
  std::uint64_t shared_intermediate = 0;  // Qwen2-MoE shared expert (0: none)
  std::vector<bool> sparse;               // per decoder layer: an MoE layer
};

// The model of `c` for `in`. Checks every split up front (Stage::kPlacement for
// experts ep does not divide or a padded vocabulary tp does not split; heads and
// widths tp does not divide are padded; Stage::kConfig for tp % ep, or a shared
// expert that cannot be fused). A pipeline stage holds only its layers
// (models/stages.hpp). The experts' checkpoint names are the descriptor's
// "experts.w13_weight" (gate, up) and "experts.w2_weight" (down) sources.
std::unique_ptr<TableModel> make_moe_model(const FamilyInput& in, const MoeConfig& c);

}  // namespace ferry::models
