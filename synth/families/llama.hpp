// What the dense families derived from Llama's layout share (synth/families/llama.cpp).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "synth/family.hpp"

namespace ferry::synth::families {

// Llama's (and Qwen2's) preset sizes, which Qwen3, Gemma and Phi-3 start from.
Dims llama_preset_dims(Preset preset);
// intermediate_size, and head_dim (or hidden / heads) of a real config.
void dense_config_dims(const nlohmann::json& config, Dims& d);
// Llama's sizes with head_dim 32 in tiny (Qwen3, Gemma).
Dims wide_head_preset_dims(Preset preset);
// dense_config_dims, refusing attention_bias true (Qwen3, Gemma, Phi-3).
void unbiased_config_dims(const nlohmann::json& config, Dims& d);
// A Llama-style layer: attention (with q/k/v biases for `bias`, per-head q/k norms for
// `qk_norm`) and a gated MLP.
template <bool bias, bool qk_norm>
void dense_layer(ListBuilder& b, const Dims& d, std::uint64_t, const std::string& p) {
  b.attention(p, bias, qk_norm);
  b.gated_mlp(p + "mlp.", d.intermediate);
}

}  // namespace ferry::synth::families
