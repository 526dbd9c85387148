// The pieces the families' tensor lists share, and the refusals of config fields.
#include "synth/family.hpp"

#include <utility>

#include "common/error.hpp"
#include "models/hf_config.hpp"

namespace ferry::synth {

void fail(const std::string& file, std::string rule) {
  throw Error(Stage::kSynth, file, "", std::move(rule));
}

void check_dtype(DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32) {
    fail("", "synthetic weights are BF16, F16 or F32, not " + std::string(dtype_name(dtype)));
  }
}

std::string layer_prefix(std::uint64_t i) {
  return "model.layers." + std::to_string(i) + ".";
}

// ---- refusals ----------------------------------------------------------------------

void refuse(std::string_view key, const std::string& why) {
  models::config_error("field '" + std::string(key) + "' " + why);
}

bool config_has(const nlohmann::json& config, std::string_view key) {
  auto it = config.find(key);
  return it != config.end() && !it->is_null();
}

void require_count(const nlohmann::json& config, std::string_view key, std::uint64_t fallback,
                   std::uint64_t want, const std::string& why) {
  if (std::uint64_t n = models::config_count(config, key, fallback); n != want) {
    refuse(key, "is " + std::to_string(n) + "; only " + std::to_string(want) + " is supported (" +
                    why + ")");
  }
}

void require_bool(const nlohmann::json& config, std::string_view key, bool fallback, bool want,
                  const std::string& why) {
  if (models::config_bool(config, key, fallback) != want) {
    refuse(key, std::string("is ") + (want ? "false" : "true") +
                    (config_has(config, key) ? "" : " (absent)") + "; only " +
                    (want ? "true" : "false") + " is supported (" + why + ")");
  }
}

void require_empty_list(const nlohmann::json& config, std::string_view key,
                        const std::string& why) {
  auto it = config.find(key);
  if (it != config.end() && !it->is_null() && !(it->is_array() && it->empty())) {
    refuse(key, "is " + it->dump() + "; only an empty list is supported (" + why + ")");
  }
}

// ---- ListBuilder -------------------------------------------------------------------

void ListBuilder::add(std::string name, std::vector<std::uint64_t> shape) {
  add_typed(std::move(name), dtype_, std::move(shape));
}

void ListBuilder::add_typed(std::string name, DType dtype, std::vector<std::uint64_t> shape) {
  out_.push_back({std::move(name), dtype, std::move(shape), file_});
}

void ListBuilder::attention(const std::string& p, bool bias, bool qk_norm) {
  std::uint64_t q = d_.heads * d_.head_dim;
  std::uint64_t kv = d_.kv_heads * d_.head_dim;
  add(p + "self_attn.q_proj.weight", {q, d_.hidden});
  if (bias) {
    add(p + "self_attn.q_proj.bias", {q});
  }
  add(p + "self_attn.k_proj.weight", {kv, d_.hidden});
  if (bias) {
    add(p + "self_attn.k_proj.bias", {kv});
  }
  add(p + "self_attn.v_proj.weight", {kv, d_.hidden});
  if (bias) {
    add(p + "self_attn.v_proj.bias", {kv});
  }
  add(p + "self_attn.o_proj.weight", {d_.hidden, q});
  if (qk_norm) {
    add(p + "self_attn.q_norm.weight", {d_.head_dim});
    add(p + "self_attn.k_norm.weight", {d_.head_dim});
  }
}

void ListBuilder::mla(const std::string& p) {
  std::uint64_t qk_head = d_.qk_nope + d_.qk_rope;
  if (d_.q_lora_rank == 0) {
    add(p + "self_attn.q_proj.weight", {d_.heads * qk_head, d_.hidden});
  } else {
    add(p + "self_attn.q_a_proj.weight", {d_.q_lora_rank, d_.hidden});
    add(p + "self_attn.q_a_layernorm.weight", {d_.q_lora_rank});
    add(p + "self_attn.q_b_proj.weight", {d_.heads * qk_head, d_.q_lora_rank});
  }
  add(p + "self_attn.kv_a_proj_with_mqa.weight", {d_.kv_lora_rank + d_.qk_rope, d_.hidden});
  add(p + "self_attn.kv_a_layernorm.weight", {d_.kv_lora_rank});
  add(p + "self_attn.kv_b_proj.weight", {d_.heads * (d_.qk_nope + d_.v_head), d_.kv_lora_rank});
  add(p + "self_attn.o_proj.weight", {d_.hidden, d_.heads * d_.v_head});
  if (d_.index_heads != 0) {
    // DeepSeek-V3.2's indexer (the reference model's Indexer): wq_b from the query
    // latent, wk and weights_proj from the hidden state, a LayerNorm on the keys.
    const std::string i = p + "self_attn.indexer.";
    add(i + "wq_b.weight", {d_.index_heads * d_.index_head_dim, d_.q_lora_rank});
    add(i + "wk.weight", {d_.index_head_dim, d_.hidden});
    add(i + "k_norm.weight", {d_.index_head_dim});
    add(i + "k_norm.bias", {d_.index_head_dim});
    add(i + "weights_proj.weight", {d_.index_heads, d_.hidden});
  }
}

void ListBuilder::gated_mlp(const std::string& p, std::uint64_t inter) {
  add(p + "gate_proj.weight", {inter, d_.hidden});
  add(p + "up_proj.weight", {inter, d_.hidden});
  add(p + "down_proj.weight", {d_.hidden, inter});
}

void ListBuilder::routed_experts(const std::string& p, std::uint64_t inter, bool mixtral_names) {
  if (fused_experts_) {
    add(p + "experts.gate_up_proj", {d_.experts, 2 * inter, d_.hidden});
    add(p + "experts.down_proj", {d_.experts, d_.hidden, inter});
    return;
  }
  for (std::uint64_t e = 0; e < d_.experts; ++e) {
    std::string x = p + "experts." + std::to_string(e) + ".";
    if (mixtral_names) {  // w1 = gate, w2 = down, w3 = up
      add(x + "w1.weight", {inter, d_.hidden});
      add(x + "w2.weight", {d_.hidden, inter});
      add(x + "w3.weight", {inter, d_.hidden});
    } else {
      gated_mlp(x, inter);
    }
  }
}

void ListBuilder::deepseek_moe(const std::string& p, bool score_bias) {
  routed_experts(p + "mlp.", d_.moe_intermediate, false);
  add(p + "mlp.gate.weight", {d_.experts, d_.hidden});
  if (score_bias) {
    add_typed(p + "mlp.gate.e_score_correction_bias", DType::kF32, {d_.experts});
  }
  gated_mlp(p + "mlp.shared_experts.", d_.moe_intermediate * d_.shared_experts);
}

void ListBuilder::mtp_inputs(const std::string& p) {
  add(p + "enorm.weight", {d_.hidden});
  add(p + "hnorm.weight", {d_.hidden});
  add(p + "eh_proj.weight", {d_.hidden, 2 * d_.hidden});
}

void ListBuilder::mtp_head(const std::string& p) {
  layer_norms(p);
  add(p + "shared_head.norm.weight", {d_.hidden});
  add(p + "shared_head.head.weight", {d_.vocab, d_.hidden});
}

void ListBuilder::layer_norms(const std::string& p) {
  add(p + "input_layernorm.weight", {d_.hidden});
  add(p + "post_attention_layernorm.weight", {d_.hidden});
}

}  // namespace ferry::synth
