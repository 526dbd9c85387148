// Glm4MoeForCausalLM (as GLM-4.5-Air: q/k/v biases, no o_proj bias, head_dim x heads
// != hidden, F32 e_score_correction_bias, first layer dense; the MTP layer
// num_hidden_layers is written to kSynthMtpFile, which the index does not list, as in
// the real checkpoints).
#include "models/hf_config.hpp"
#include "synth/families/deepseek.hpp"

namespace ferry::synth::families {
namespace {

// GLM-4.5-Air-shaped: heads x head_dim is twice hidden, one shared expert, one dense
// layer first, one group.
// clang-format off
Dims glm4_moe_preset_dims(Preset preset) {
  switch (preset) {
    case Preset::kTiny:
      return {.hidden = 128, .intermediate = 256, .layers = 2, .heads = 8, .kv_heads = 2,
              .head_dim = 32, .vocab = 1000, .experts = 8, .experts_per_tok = 2,
              .moe_intermediate = 64, .shared_experts = 1, .first_k_dense = 1,
              .n_group = 1, .topk_group = 1};
    case Preset::kSmall:
      return {.hidden = 256, .intermediate = 768, .layers = 4, .heads = 8, .kv_heads = 2,
              .head_dim = 64, .vocab = 8000, .experts = 16, .experts_per_tok = 4,
              .moe_intermediate = 128, .shared_experts = 1, .first_k_dense = 1,
              .n_group = 1, .topk_group = 1};
    case Preset::kMedium:
      return {.hidden = 1024, .intermediate = 2816, .layers = 18, .heads = 16, .kv_heads = 4,
              .head_dim = 128, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
              .moe_intermediate = 512, .shared_experts = 1, .first_k_dense = 1,
              .n_group = 1, .topk_group = 1};
  }
  fail("", "no sizes for this family and preset");
}
// clang-format on

void glm4_moe_config_dims(const nlohmann::json& config, Dims& d) {
  deepseek_routing_dims(config, d);
  d.head_dim = models::config_head_dim(config, d.hidden, d.heads);
  d.qk_norm = models::config_bool(config, "use_qk_norm", false);
  require_bool(config, "attention_bias", false, true,
               "GLM-4 MoE's q/k/v projections have biases here");
  refuse_more_than_one_mtp_layer(d);
}

// attention_bias true: q/k/v biases, none on o_proj; use_qk_norm as configured.
void glm4_moe_layer(ListBuilder& b, const Dims& d, std::uint64_t i, const std::string& p) {
  b.attention(p, true, d.qk_norm);
  deepseek_mlp(b, d, i, p, true);
}

// GLM-4.5's MTP layer, also layer num_hidden_layers, ships in an mtp.safetensors that
// the index does not list. It has no embedding of its own.
void glm4_moe_mtp(ListBuilder& b, const Dims& d) {
  std::string p = layer_prefix(d.layers);
  b.set_file(kSynthMtpFile);
  b.mtp_inputs(p);
  b.attention(p, true, d.qk_norm);
  b.deepseek_moe(p, true);
  b.mtp_head(p);
  b.set_file("");
}

// As GLM-4.5-Air: no bos_token_id, a pad_token_id, half-rotary heads.
void glm4_moe_config(nlohmann::json& c, const Dims& d) {
  c.erase("bos_token_id");
  deepseek_routing_config(c, d);
  c["attention_bias"] = true;
  c["head_dim"] = d.head_dim;
  c["norm_topk_prob"] = true;
  c["num_nextn_predict_layers"] = 1;
  c["pad_token_id"] = 0;
  c["partial_rotary_factor"] = 0.5;
  c["rms_norm_eps"] = 1e-5;
  c["rope_scaling"] = nullptr;
  c["rope_theta"] = 1000000;
  c["routed_scaling_factor"] = 1.0;
  c["use_qk_norm"] = false;
}

}  // namespace

SynthFamily glm4_moe() {
  return {
      .name = "glm4_moe",
      .architectures = {"Glm4MoeForCausalLM"},
      .routed_experts = true,
      .preset_dims = glm4_moe_preset_dims,
      .config_dims = glm4_moe_config_dims,
      .layer = glm4_moe_layer,
      .mtp = glm4_moe_mtp,
      .config = glm4_moe_config,
  };
}

}  // namespace ferry::synth::families
