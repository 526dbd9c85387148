// What GLM-4 MoE shares with DeepSeek's MoE (synth/families/deepseek.cpp).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "synth/family.hpp"

namespace ferry::synth::families {

// The routing sizes of a real config: intermediate_size, n_routed_experts,
// num_experts_per_tok, moe_intermediate_size, n_shared_experts, first_k_dense_replace,
// n_group, topk_group, num_nextn_predict_layers.
void deepseek_routing_dims(const nlohmann::json& config, Dims& d);
// Refuses num_nextn_predict_layers above 1.
void refuse_more_than_one_mtp_layer(const Dims& d);
// Those routing fields, written (but num_nextn_predict_layers).
void deepseek_routing_config(nlohmann::json& c, const Dims& d);
// Layer `i`'s MLP: a dense one for the first first_k_dense_replace layers, then
// DeepseekV3MoE (with e_score_correction_bias for `score_bias`).
void deepseek_mlp(ListBuilder& b, const Dims& d, std::uint64_t i, const std::string& p,
                  bool score_bias);

}  // namespace ferry::synth::families
