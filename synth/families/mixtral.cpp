// MixtralForCausalLM: Llama's attention, block_sparse_moe.experts.<e>.w1/w2/w3.
#include "models/hf_config.hpp"
#include "synth/families/llama.hpp"

namespace ferry::synth::families {
namespace {

// clang-format off
Dims mixtral_preset_dims(Preset preset) {
  switch (preset) {
    case Preset::kTiny:
      return {.hidden = 128, .intermediate = 128, .layers = 4, .heads = 8, .kv_heads = 2,
              .head_dim = 16, .vocab = 1000, .experts = 8, .experts_per_tok = 2};
    case Preset::kSmall:
      return {.hidden = 256, .intermediate = 512, .layers = 4, .heads = 8, .kv_heads = 2,
              .head_dim = 32, .vocab = 8000, .experts = 8, .experts_per_tok = 2};
    case Preset::kMedium:
      return {.hidden = 1024, .intermediate = 2560, .layers = 16, .heads = 16, .kv_heads = 4,
              .head_dim = 64, .vocab = 32000, .experts = 8, .experts_per_tok = 2};
  }
  fail("", "no sizes for this family and preset");
}
// clang-format on

void mixtral_config_dims(const nlohmann::json& config, Dims& d) {
  dense_config_dims(config, d);
  d.experts = models::config_positive(config, "num_local_experts");
  d.experts_per_tok = models::config_optional_positive(config, "num_experts_per_tok").value_or(2);
}

void mixtral_layer(ListBuilder& b, const Dims& d, std::uint64_t, const std::string& p) {
  b.attention(p, false, false);
  b.add(p + "block_sparse_moe.gate.weight", {d.experts, d.hidden});
  b.routed_experts(p + "block_sparse_moe.", d.intermediate, true);
}

void mixtral_config(nlohmann::json& c, const Dims& d) {
  c["num_experts_per_tok"] = d.experts_per_tok;
  c["num_local_experts"] = d.experts;
  c["output_router_logits"] = false;
  c["rms_norm_eps"] = 1e-5;
  c["rope_theta"] = 1000000.0;
  c["router_aux_loss_coef"] = 0.02;
  c["sliding_window"] = nullptr;
}

}  // namespace

SynthFamily mixtral() {
  return {
      .name = "mixtral",
      .architectures = {"MixtralForCausalLM"},
      .routed_experts = true,
      .preset_dims = mixtral_preset_dims,
      .config_dims = mixtral_config_dims,
      .layer = mixtral_layer,
      .config = mixtral_config,
  };
}

}  // namespace ferry::synth::families
