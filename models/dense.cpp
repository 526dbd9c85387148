#include "models/dense.hpp"

#include <array>

#include "common/error.hpp"
#include "models/hf_config.hpp"
#include "models/placement.hpp"
#include "models/stages.hpp"
#include "models/table_model.hpp"

namespace ferry::models {
namespace {

using Blocks = std::vector<Block>;

std::string layer_prefix(std::uint64_t layer) {
  return "model.layers." + std::to_string(layer) + ".";
}

// Declares the params of one layer and the checkpoint names that feed them.
void add_layer(TableModel& m, const DenseConfig& c, const QkvShape& qkv, int tp,
               std::uint64_t layer) {
  const std::string p = layer_prefix(layer);
  const std::uint64_t q_rows = qkv_slot_rows(qkv, QkvSlot::kQ);
  const std::uint64_t kv_rows = qkv_slot_rows(qkv, QkvSlot::kK);
  const std::uint64_t qkv_rows = qkv_local_rows(qkv, tp);
  const std::uint64_t inter_local = even_shard(c.intermediate, 0, tp, "intermediate_size").length;
  const std::uint64_t q_local = q_rows / static_cast<std::uint64_t>(tp);

  // Attention: q, k and v fused into qkv_proj (slots q, k, v), o_proj row-parallel.
  const std::string qkv_w = p + "self_attn.qkv_proj.weight";
  const std::string qkv_b = p + "self_attn.qkv_proj.bias";
  m.add_param(qkv_w, Shape{qkv_rows, c.hidden});
  if (c.qkv_bias) {
    m.add_param(qkv_b, Shape{qkv_rows});
  }
  constexpr std::array<std::pair<const char*, QkvSlot>, 3> kSlots{{
      {"q_proj", QkvSlot::kQ},
      {"k_proj", QkvSlot::kK},
      {"v_proj", QkvSlot::kV},
  }};
  for (const auto& [name, slot] : kSlots) {
    const std::string src = p + "self_attn." + name;
    const std::uint64_t rows = slot == QkvSlot::kQ ? q_rows : kv_rows;
    auto rule = [qkv, slot = slot, tp](int rank) { return Blocks{qkv_slot(qkv, slot, rank, tp)}; };
    m.add_target(src + ".weight", qkv_w, Shape{rows, c.hidden}, rule);
    if (c.qkv_bias) {
      m.add_target(src + ".bias", qkv_b, Shape{rows}, rule);
    }
  }
  const std::string o_w = p + "self_attn.o_proj.weight";
  m.add_param(o_w, Shape{c.hidden, q_local});
  m.add_target(o_w, o_w, Shape{c.hidden, q_rows},
               [q_rows, tp](int rank) { return Blocks{row_parallel(q_rows, rank, tp)}; });
  if (c.o_bias) {
    // A row-parallel layer's bias is not split: every rank holds all of it.
    const std::string o_b = p + "self_attn.o_proj.bias";
    m.add_param(o_b, Shape{c.hidden});
    m.add_target(o_b, o_b, Shape{c.hidden}, [h = c.hidden](int) { return Blocks{replicated(h)}; });
  }

  // MLP: gate and up fused into gate_up_proj (this rank's gate rows, then its up
  // rows), down_proj row-parallel.
  const std::string gu_w = p + "mlp.gate_up_proj.weight";
  const std::string gu_b = p + "mlp.gate_up_proj.bias";
  m.add_param(gu_w, Shape{2 * inter_local, c.hidden});
  if (c.mlp_bias) {
    m.add_param(gu_b, Shape{2 * inter_local});
  }
  const std::array<std::uint64_t, 2> sizes{c.intermediate, c.intermediate};
  constexpr std::array<const char*, 2> kMerged{"gate_proj", "up_proj"};
  for (std::size_t slot = 0; slot < kMerged.size(); ++slot) {
    const std::string src = p + "mlp." + kMerged[slot];
    auto rule = [sizes, slot, tp](int rank) {
      return Blocks{merged_column_slot(sizes, slot, rank, tp)};
    };
    m.add_target(src + ".weight", gu_w, Shape{c.intermediate, c.hidden}, rule);
    if (c.mlp_bias) {
      m.add_target(src + ".bias", gu_b, Shape{c.intermediate}, rule);
    }
  }
  const std::string down_w = p + "mlp.down_proj.weight";
  m.add_param(down_w, Shape{c.hidden, inter_local});
  m.add_target(down_w, down_w, Shape{c.hidden, c.intermediate},
               [i = c.intermediate, tp](int rank) { return Blocks{row_parallel(i, rank, tp)}; });
  if (c.mlp_bias) {
    const std::string down_b = p + "mlp.down_proj.bias";
    m.add_param(down_b, Shape{c.hidden});
    m.add_target(down_b, down_b, Shape{c.hidden},
                 [h = c.hidden](int) { return Blocks{replicated(h)}; });
  }

  for (const char* norm : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
    const std::string name = p + norm;
    m.add_param(name, Shape{c.hidden});
    m.add_target(name, name, Shape{c.hidden},
                 [h = c.hidden](int) { return Blocks{replicated(h)}; });
  }
}

}  // namespace

DenseConfig parse_dense_config(const nlohmann::json& hf_config, const std::string& architecture) {
  DenseConfig c;
  c.architecture = architecture;
  if (architecture == "LlamaForCausalLM") {
    c.family = "llama";
  } else if (architecture == "MistralForCausalLM") {
    c.family = "mistral";
  } else if (architecture == "Qwen2ForCausalLM") {
    c.family = "qwen2";
  } else {
    throw Error(Stage::kMapping, kConfigFile, "",
                "internal: " + architecture + " is not a dense Llama-like architecture");
  }
  c.hidden = config_positive(hf_config, "hidden_size");
  c.heads = config_positive(hf_config, "num_attention_heads");
  c.kv_heads = config_optional_positive(hf_config, "num_key_value_heads").value_or(c.heads);
  if (auto hd = config_optional_positive(hf_config, "head_dim")) {
    c.head_dim = *hd;
  } else {
    if (c.hidden % c.heads != 0) {
      throw Error(Stage::kConfig, kConfigFile, "",
                  "hidden_size (" + std::to_string(c.hidden) +
                      ") is not divisible by num_attention_heads (" + std::to_string(c.heads) +
                      ") and there is no head_dim field");
    }
    c.head_dim = c.hidden / c.heads;
  }
  c.intermediate = config_positive(hf_config, "intermediate_size");
  c.layers = config_positive(hf_config, "num_hidden_layers");
  c.vocab = config_positive(hf_config, "vocab_size");
  c.tie_embeddings = config_bool(hf_config, "tie_word_embeddings", false);
  if (c.family == "qwen2") {
    c.qkv_bias = true;  // Qwen2Attention always has q/k/v biases, o_proj has none
  } else {
    // LlamaAttention's bias flag covers qkv_proj and o_proj.
    bool attention_bias = config_bool(hf_config, "attention_bias", false);
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
    c.mlp_bias = config_bool(hf_config, "mlp_bias", false);
  }
  return c;
}

std::unique_ptr<Model> make_dense_model(const DenseConfig& c, const ParallelLayout& layout,
                                        DType dtype, bool strict) {
  if (layout.ep != 1) {
    throw Error(Stage::kConfig, "", "",
                "parallel layout: ep " + std::to_string(layout.ep) + " needs a mixture-of-" +
                    "experts model; " + c.architecture + " has no experts (use ep 1)");
  }
  const int tp = layout.tp;
  const QkvShape qkv{c.heads, c.kv_heads, c.head_dim};
  // Check every split up front so the error names the config field, not a tensor.
  check_qkv(qkv, tp);
  even_shard(c.intermediate, 0, tp, "intermediate_size");
  even_shard(padded_vocab(c.vocab), 0, tp, "padded vocab_size");

  // Pipeline stage: only this stage's layers get params; the others' tensors are
  // dropped unread, and the embedding / final norm / lm_head live on the edges.
  const Range stage = pp_layers(c.layers, layout.pp, layout.pp_rank, layout.pp_partition);

  auto m = std::make_unique<TableModel>(c.family, c.architecture, layout, dtype, strict);
  for (std::uint64_t layer = stage.begin; layer < stage.end(); ++layer) {
    add_layer(*m, c, qkv, tp, layer);
  }
  add_layer_drops(*m, c.layers, stage);
  StageEdges edges;
  edges.hidden = c.hidden;
  edges.vocab = c.vocab;
  edges.tie_embeddings = c.tie_embeddings;
  add_stage_edges(*m, edges, layout);
  // A cache older Hugging Face checkpoints saved; the engine computes it.
  m->add_drop_pattern("rotary_emb.inv_freq", "inv_freq");
  // Models trained with ColossalAI may carry rotary caches too (SGLang skips them).
  m->add_drop_pattern("rotary_emb.cos_cached", "rope_cache");
  m->add_drop_pattern("rotary_emb.sin_cached", "rope_cache");
  m->finish();
  return m;
}

}  // namespace ferry::models
