// DeepseekV2ForCausalLM (MLA without a correction bias or MTP layer; tiny and medium
// have q_lora_rank null, so self_attn.q_proj.weight, and greedy top-k; small has
// q_a_proj/q_a_layernorm/q_b_proj and group_limited_greedy; n_shared_experts is 2 as
// in the real models, except tiny's 1, which can be fused), DeepseekV3ForCausalLM
// (MLA, F32 e_score_correction_bias, first layer dense, MTP layer num_hidden_layers in
// the indexed shards) and DeepseekV32ForCausalLM (V3 with the sparse-attention
// indexer in every layer).
#include "synth/families/deepseek.hpp"

#include "models/hf_config.hpp"

namespace ferry::synth::families {

void deepseek_routing_dims(const nlohmann::json& config, Dims& d) {
  d.intermediate = models::config_positive(config, "intermediate_size");
  d.experts = models::config_positive(config, "n_routed_experts");
  d.experts_per_tok = models::config_optional_positive(config, "num_experts_per_tok").value_or(1);
  d.moe_intermediate = models::config_positive(config, "moe_intermediate_size");
  d.shared_experts = models::config_positive(config, "n_shared_experts");
  d.first_k_dense = models::config_count(config, "first_k_dense_replace", 0);
  d.n_group = models::config_optional_positive(config, "n_group").value_or(1);
  d.topk_group = models::config_optional_positive(config, "topk_group").value_or(1);
  d.nextn_layers = models::config_count(config, "num_nextn_predict_layers", 0);
}

void refuse_more_than_one_mtp_layer(const Dims& d) {
  if (d.nextn_layers > 1) {
    refuse("num_nextn_predict_layers",
           "is " + std::to_string(d.nextn_layers) + "; only 0 or 1 MTP layer is supported");
  }
}

void deepseek_routing_config(nlohmann::json& c, const Dims& d) {
  c["first_k_dense_replace"] = d.first_k_dense;
  c["moe_intermediate_size"] = d.moe_intermediate;
  c["n_group"] = d.n_group;
  c["n_routed_experts"] = d.experts;
  c["n_shared_experts"] = d.shared_experts;
  c["num_experts_per_tok"] = d.experts_per_tok;
  c["topk_group"] = d.topk_group;
}

void deepseek_mlp(ListBuilder& b, const Dims& d, std::uint64_t i, const std::string& p,
                  bool score_bias) {
  if (i < d.first_k_dense) {
    b.gated_mlp(p + "mlp.", d.intermediate);
  } else {
    b.deepseek_moe(p, score_bias);
  }
}

namespace {

// MLA keeps one key/value head per query head: num_key_value_heads = heads.
// clang-format off
Dims v3_preset_dims(Preset preset) {
  switch (preset) {
    case Preset::kTiny:
      return {.hidden = 128, .intermediate = 256, .layers = 2, .heads = 8, .kv_heads = 8,
              .vocab = 1000, .experts = 8, .experts_per_tok = 2, .moe_intermediate = 32,
              .q_lora_rank = 64, .kv_lora_rank = 32, .qk_nope = 16, .qk_rope = 8,
              .v_head = 16, .shared_experts = 1, .first_k_dense = 1, .n_group = 4,
              .topk_group = 2};
    case Preset::kSmall:
      return {.hidden = 256, .intermediate = 768, .layers = 4, .heads = 8, .kv_heads = 8,
              .vocab = 8000, .experts = 16, .experts_per_tok = 4, .moe_intermediate = 128,
              .q_lora_rank = 128, .kv_lora_rank = 64, .qk_nope = 32, .qk_rope = 16,
              .v_head = 32, .shared_experts = 1, .first_k_dense = 1, .n_group = 4,
              .topk_group = 2};
    case Preset::kMedium:
      return {.hidden = 1024, .intermediate = 2816, .layers = 18, .heads = 16,
              .kv_heads = 16, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
              .moe_intermediate = 512, .q_lora_rank = 384, .kv_lora_rank = 256,
              .qk_nope = 64, .qk_rope = 32, .v_head = 64, .shared_experts = 1,
              .first_k_dense = 1, .n_group = 8, .topk_group = 4};
  }
  fail("", "no sizes for this family and preset");
}

// Tiny and medium are DeepSeek-V2-Lite-shaped (q_lora_rank null, greedy top-k, one
// group); small is DeepSeek-V2-shaped (q_lora_rank set, group-limited top-k). The real
// models have 2 shared experts, as small and medium do; tiny has 1 so that a loader
// can fuse it in as one more routed expert.
Dims v2_preset_dims(Preset preset) {
  switch (preset) {
    case Preset::kTiny:
      return {.hidden = 128, .intermediate = 256, .layers = 3, .heads = 8, .kv_heads = 8,
              .vocab = 1000, .experts = 8, .experts_per_tok = 2, .moe_intermediate = 32,
              .q_lora_rank = 0, .kv_lora_rank = 32, .qk_nope = 16, .qk_rope = 8,
              .v_head = 16, .shared_experts = 1, .first_k_dense = 1, .n_group = 1,
              .topk_group = 1};
    case Preset::kSmall:
      return {.hidden = 256, .intermediate = 768, .layers = 4, .heads = 8, .kv_heads = 8,
              .vocab = 8000, .experts = 16, .experts_per_tok = 4, .moe_intermediate = 128,
              .q_lora_rank = 128, .kv_lora_rank = 64, .qk_nope = 32, .qk_rope = 16,
              .v_head = 32, .shared_experts = 2, .first_k_dense = 1, .n_group = 4,
              .topk_group = 2};
    case Preset::kMedium:
      return {.hidden = 1024, .intermediate = 2816, .layers = 20, .heads = 16,
              .kv_heads = 16, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
              .moe_intermediate = 512, .q_lora_rank = 0, .kv_lora_rank = 256,
              .qk_nope = 64, .qk_rope = 32, .v_head = 64, .shared_experts = 2,
              .first_k_dense = 1, .n_group = 1, .topk_group = 1};
  }
  fail("", "no sizes for this family and preset");
}
// clang-format on

// DeepSeek-V3's sizes with the indexer (V3.2: 64 heads of 128).
Dims v32_preset_dims(Preset preset) {
  Dims d = v3_preset_dims(preset);
  d.index_heads = preset == Preset::kMedium ? 16 : 4;
  d.index_head_dim = preset == Preset::kTiny ? 32 : 64;
  return d;
}

// V3 (and V3.2) against V2: the router has e_score_correction_bias exactly for
// noaux_tc routing, which the family fixes: always for V3, never for V2 (the defaults
// of ferry's models).
template <bool v3>
void mla_config_dims(const nlohmann::json& config, Dims& d) {
  deepseek_routing_dims(config, d);
  d.q_lora_rank = models::config_optional_positive(config, "q_lora_rank").value_or(0);
  d.kv_lora_rank = models::config_positive(config, "kv_lora_rank");
  d.qk_nope = models::config_positive(config, "qk_nope_head_dim");
  d.qk_rope = models::config_positive(config, "qk_rope_head_dim");
  d.v_head = models::config_positive(config, "v_head_dim");
  require_count(config, "moe_layer_freq", 1, 1, "every layer from first_k_dense_replace on is MoE");
  require_bool(config, "attention_bias", false, false, "MLA's projections have no biases here");
  const std::string topk = models::config_string(config, "topk_method", v3 ? "noaux_tc" : "greedy");
  if ((topk == "noaux_tc") != v3) {
    refuse("topk_method", "is \"" + topk + "\"; " +
                              (v3 ? "DeepSeek-V3 is synthesized with noaux_tc routing "
                                    "(a gate with e_score_correction_bias)"
                                  : "DeepSeek-V2 is synthesized without noaux_tc routing "
                                    "(a gate without e_score_correction_bias)"));
  }
  if (v3) {
    refuse_more_than_one_mtp_layer(d);
  }
  if (v3 && config_has(config, "index_topk")) {
    d.index_heads = models::config_positive(config, "index_n_heads");
    d.index_head_dim = models::config_positive(config, "index_head_dim");
    require_count(config, "index_topk_freq", 1, 1, "an indexer is synthesized in every layer");
    for (const char* key : {"indexer_types", "index_topk_pattern"}) {
      if (config_has(config, key)) {
        refuse(key, "is set; an indexer is synthesized in every layer");
      }
    }
  }
  if (!v3 && d.nextn_layers != 0) {
    refuse("num_nextn_predict_layers", "is " + std::to_string(d.nextn_layers) +
                                           "; DeepSeek-V2 is synthesized without an MTP layer");
  }
}

template <bool v3>
void mla_layer(ListBuilder& b, const Dims& d, std::uint64_t i, const std::string& p) {
  b.mla(p);
  deepseek_mlp(b, d, i, p, v3);
}

// The multi-token-prediction layer (num_nextn_predict_layers = 1) is stored as layer
// num_hidden_layers: its own embedding, norms and projection, a full MoE decoder layer
// and its own head.
void v3_mtp(ListBuilder& b, const Dims& d) {
  std::string p = layer_prefix(d.layers);
  b.add(p + "embed_tokens.weight", {d.vocab, d.hidden});
  b.mtp_inputs(p);
  b.mla(p);
  b.deepseek_moe(p, true);
  b.mtp_head(p);
}

// The fields V2 and V3 write alike.
void mla_config(nlohmann::json& c, const Dims& d) {
  deepseek_routing_config(c, d);
  c["attention_bias"] = false;
  c["ep_size"] = 1;
  c["kv_lora_rank"] = d.kv_lora_rank;
  c["moe_layer_freq"] = 1;
  c["q_lora_rank"] = d.q_lora_rank == 0 ? nlohmann::json(nullptr) : nlohmann::json(d.q_lora_rank);
  c["qk_nope_head_dim"] = d.qk_nope;
  c["qk_rope_head_dim"] = d.qk_rope;
  c["rms_norm_eps"] = 1e-6;
  c["rope_scaling"] = nullptr;  // the real one is YaRN to 160K; 4096 positions need none
  c["rope_theta"] = 10000;
  c["v_head_dim"] = d.v_head;
}

// As the real config, less quantization_config (these weights are not FP8) and
// auto_map (no remote code ships with a synthetic checkpoint).
void v3_config(nlohmann::json& c, const Dims& d) {
  mla_config(c, d);
  c["norm_topk_prob"] = true;
  c["num_nextn_predict_layers"] = 1;
  c["routed_scaling_factor"] = 2.5;
  c["scoring_func"] = "sigmoid";
  c["topk_method"] = "noaux_tc";
}

SynthFamily v3_family(std::string name, std::string architecture, Dims (*dims)(Preset),
                      void (*config)(nlohmann::json&, const Dims&)) {
  return {
      .name = std::move(name),
      .architectures = {std::move(architecture)},
      .routed_experts = true,
      .mla = true,
      .preset_dims = dims,
      .config_dims = mla_config_dims<true>,
      .layer = mla_layer<true>,
      .mtp = v3_mtp,
      .config = config,
  };
}

}  // namespace

SynthFamily deepseek_v3() {
  return v3_family("deepseek_v3", "DeepseekV3ForCausalLM", v3_preset_dims, v3_config);
}

SynthFamily deepseek_v32() {
  return v3_family("deepseek_v32", "DeepseekV32ForCausalLM", v32_preset_dims,
                   [](nlohmann::json& c, const Dims& d) {
                     v3_config(c, d);
                     c["index_head_dim"] = d.index_head_dim;
                     c["index_n_heads"] = d.index_heads;
                     c["index_topk"] = 16;
                   });
}

SynthFamily deepseek_v2() {
  return {
      .name = "deepseek_v2",
      .architectures = {"DeepseekV2ForCausalLM"},
      .routed_experts = true,
      .mla = true,
      .preset_dims = v2_preset_dims,
      .config_dims = mla_config_dims<false>,
      .layer = mla_layer<false>,
      // As DeepSeek-V2(-Lite), less auto_map. One group means greedy top-k with
      // routed_scaling_factor 1 (V2-Lite); several mean group-limited top-k with V2's
      // factor 16.
      .config =
          [](nlohmann::json& c, const Dims& d) {
            mla_config(c, d);
            c["aux_loss_alpha"] = 0.001;
            c["norm_topk_prob"] = false;
            c["pretraining_tp"] = 1;
            c["routed_scaling_factor"] = d.n_group > 1 ? 16.0 : 1.0;
            c["scoring_func"] = "softmax";
            c["seq_aux"] = true;
            c["topk_method"] = d.n_group > 1 ? "group_limited_greedy" : "greedy";
          },
  };
}

}  // namespace ferry::synth::families
