// Qwen3MoeForCausalLM (q/k norms, head_dim independent of hidden) and
// Qwen2MoeForCausalLM (as Qwen1.5-MoE-A2.7B: q/k/v biases, mlp.shared_expert.* and the
// [1, H] mlp.shared_expert_gate.weight). Every layer is sparse (decoder_sparse_step 1,
// no mlp_only_layers), as in the real checkpoints.
#include "models/hf_config.hpp"
#include "synth/family.hpp"

namespace ferry::synth::families {
namespace {

// clang-format off
Dims qwen3_moe_preset_dims(Preset preset) {
  switch (preset) {
    case Preset::kTiny:
      return {.hidden = 128, .intermediate = 256, .layers = 4, .heads = 8, .kv_heads = 2,
              .head_dim = 16, .vocab = 1000, .experts = 8, .experts_per_tok = 2,
              .moe_intermediate = 64};
    case Preset::kSmall:
      return {.hidden = 256, .intermediate = 768, .layers = 4, .heads = 8, .kv_heads = 2,
              .head_dim = 64, .vocab = 8000, .experts = 16, .experts_per_tok = 4,
              .moe_intermediate = 128};
    case Preset::kMedium:
      return {.hidden = 1024, .intermediate = 2816, .layers = 19, .heads = 16, .kv_heads = 4,
              .head_dim = 128, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
              .moe_intermediate = 512};
  }
  fail("", "no sizes for this family and preset");
}

// Tiny's shared expert is exactly as wide as a routed one, so a loader may fuse it in
// as one more expert; small and medium keep the real models' 4x ratio
// (Qwen1.5-MoE-A2.7B: 1408 and 5632).
Dims qwen2_moe_preset_dims(Preset preset) {
  switch (preset) {
    case Preset::kTiny:
      return {.hidden = 128, .intermediate = 256, .layers = 4, .heads = 8, .kv_heads = 2,
              .head_dim = 16, .vocab = 1000, .experts = 8, .experts_per_tok = 2,
              .moe_intermediate = 64, .shared_intermediate = 64};
    case Preset::kSmall:
      return {.hidden = 256, .intermediate = 1024, .layers = 4, .heads = 8, .kv_heads = 2,
              .head_dim = 32, .vocab = 8000, .experts = 16, .experts_per_tok = 4,
              .moe_intermediate = 128, .shared_intermediate = 512};
    case Preset::kMedium:
      return {.hidden = 1024, .intermediate = 2816, .layers = 18, .heads = 16, .kv_heads = 4,
              .head_dim = 64, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
              .moe_intermediate = 512, .shared_intermediate = 2048};
  }
  fail("", "no sizes for this family and preset");
}
// clang-format on

// The fields both read; every layer must be sparse.
void qwen_moe_config_dims(const nlohmann::json& config, Dims& d) {
  const std::string every_layer_sparse = "every layer is an MoE layer here";
  d.intermediate = models::config_count(config, "intermediate_size", 0);
  d.head_dim = models::config_head_dim(config, d.hidden, d.heads);
  d.experts = models::config_positive(config, "num_experts");
  d.experts_per_tok = models::config_optional_positive(config, "num_experts_per_tok").value_or(1);
  d.moe_intermediate = models::config_positive(config, "moe_intermediate_size");
  require_count(config, "decoder_sparse_step", 1, 1, every_layer_sparse);
  require_empty_list(config, "mlp_only_layers", every_layer_sparse);
}

// The fields both write.
void qwen_moe_config(nlohmann::json& c, const Dims& d) {
  c["decoder_sparse_step"] = 1;
  c["max_window_layers"] = d.layers;
  c["mlp_only_layers"] = nlohmann::json::array();
  c["moe_intermediate_size"] = d.moe_intermediate;
  c["num_experts"] = d.experts;
  c["num_experts_per_tok"] = d.experts_per_tok;
  c["output_router_logits"] = false;
  c["rms_norm_eps"] = 1e-6;
  c["rope_theta"] = 1000000.0;
  c["router_aux_loss_coef"] = 0.001;
  c["use_sliding_window"] = false;
}

// The router, then the routed experts.
void qwen_moe_block(ListBuilder& b, const Dims& d, const std::string& p) {
  b.add(p + "mlp.gate.weight", {d.experts, d.hidden});
  b.routed_experts(p + "mlp.", d.moe_intermediate, false);
}

}  // namespace

SynthFamily qwen3_moe() {
  return {
      .name = "qwen3_moe",
      .architectures = {"Qwen3MoeForCausalLM"},
      .routed_experts = true,
      .preset_dims = qwen3_moe_preset_dims,
      .config_dims =
          [](const nlohmann::json& config, Dims& d) {
            qwen_moe_config_dims(config, d);
            require_bool(config, "attention_bias", false, false,
                         "Qwen3-MoE's projections have no biases here");
          },
      .layer =
          [](ListBuilder& b, const Dims& d, std::uint64_t, const std::string& p) {
            b.attention(p, false, true);
            qwen_moe_block(b, d, p);
          },
      .config =
          [](nlohmann::json& c, const Dims& d) {
            qwen_moe_config(c, d);
            c["attention_bias"] = false;
            c["head_dim"] = d.head_dim;
            c["norm_topk_prob"] = true;
            c["rope_scaling"] = nullptr;
            c["sliding_window"] = nullptr;
          },
  };
}

SynthFamily qwen2_moe() {
  return {
      .name = "qwen2_moe",
      .architectures = {"Qwen2MoeForCausalLM"},
      .routed_experts = true,
      .preset_dims = qwen2_moe_preset_dims,
      .config_dims =
          [](const nlohmann::json& config, Dims& d) {
            qwen_moe_config_dims(config, d);
            d.shared_intermediate =
                models::config_positive(config, "shared_expert_intermediate_size");
          },
      // Qwen2MoeSparseMoeBlock registers the router, the experts, one shared expert and
      // the shared expert's one-row sigmoid gate, in that order.
      .layer =
          [](ListBuilder& b, const Dims& d, std::uint64_t, const std::string& p) {
            b.attention(p, true, false);
            qwen_moe_block(b, d, p);
            b.gated_mlp(p + "mlp.shared_expert.", d.shared_intermediate);
            b.add(p + "mlp.shared_expert_gate.weight", {1, d.hidden});
          },
      // q/k/v biases by construction (no attention_bias field), no top-k
      // renormalization.
      .config =
          [](nlohmann::json& c, const Dims& d) {
            qwen_moe_config(c, d);
            c["norm_topk_prob"] = false;
            c["shared_expert_intermediate_size"] = d.shared_intermediate;
            c["sliding_window"] = 4096;
          },
  };
}

}  // namespace ferry::synth::families
