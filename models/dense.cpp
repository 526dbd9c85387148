#include "models/dense.hpp"

#include "common/error.hpp"
#include "models/hf_config.hpp"
#include "models/layers.hpp"
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
void add_layer(TableModel& m, const DenseConfig& c, int tp, std::uint64_t layer) {
  const std::string p = layer_prefix(layer);
  // Attention: q, k and v fused into qkv_proj (slots q, k, v), o_proj row-parallel.
  add_gqa_attention(m, p + "self_attn.", p + "self_attn.",
                    gqa_attention(c, c.qkv_bias, c.o_bias), tp);
  // MLP: gate and up fused into gate_up_proj, down_proj row-parallel.
  add_gated_mlp(m, p + "mlp.", p + "mlp.", c.hidden, c.intermediate, c.mlp_bias, tp,
                "intermediate_size");
  for (const char* norm : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
    add_replicated(m, p + norm, p + norm, Shape{c.hidden});
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
  static_cast<GqaDecoderDims&>(c) = config_gqa_decoder_dims(hf_config);
  c.intermediate = config_positive(hf_config, "intermediate_size");
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
  even_shard(padded_vocab(c.vocab), 0, tp, "padded vocab_size");

  // Pipeline stage: only this stage's layers get params; the others' tensors are
  // dropped unread, and the embedding / final norm / lm_head live on the edges.
  const Range stage = pp_layers(c.layers, layout.pp, layout.pp_rank, layout.pp_partition);

  auto m = std::make_unique<TableModel>(c.family, c.architecture, layout, dtype, strict);
  for (std::uint64_t layer = stage.begin; layer < stage.end(); ++layer) {
    add_layer(*m, c, tp, layer);
  }
  add_layer_drops(*m, c.layers, stage);
  StageEdges edges;
  edges.hidden = c.hidden;
  edges.vocab = c.vocab;
  edges.tie_embeddings = c.tie_embeddings;
  add_stage_edges(*m, edges, layout);
  add_rope_cache_drops(*m);
  m->finish();
  return m;
}

}  // namespace ferry::models
