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
void add_layer(TableModel& m, const DenseConfig& c, int tp, Unaligned u, std::uint64_t layer) {
  const std::string p = layer_prefix(layer);
  // Attention: q, k and v fused into qkv_proj (slots q, k, v), o_proj row-parallel.
  add_gqa_attention(m, p + "self_attn.", p + "self_attn.",
                    gqa_attention(c, c.qkv_bias, c.o_bias, u), tp);
  // MLP: gate and up fused into gate_up_proj, down_proj row-parallel.
  add_gated_mlp(m, p + "mlp.", p + "mlp.", c.hidden, c.intermediate, tp, u, "intermediate_size");
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
    // SGLang's LlamaDecoderLayer (python/sglang/srt/models/llama.py at commit
    // 00239548f1cd): attention_bias or bias gives qkv_proj and o_proj a bias; its
    // LlamaMLP has none, whatever mlp_bias says.
    const bool attention_bias =
        config_bool(hf_config, "attention_bias", false) || config_bool(hf_config, "bias", false);
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
  }
  return c;
}

std::unique_ptr<Model> make_dense_model(const DenseConfig& c, const ParallelLayout& layout,
                                        DType dtype, const ModelOptions& options) {
  // Options of MoE and MTP models mean nothing here: refused rather than ignored.
  auto refuse = [&](const std::string& option, const std::string& why) {
    throw Error(Stage::kConfig, kConfigFile, "",
                option + ": " + c.architecture + " " + why + ", so the option does not apply");
  };
  if (options.draft) {
    refuse("model.draft", "has no MTP (NextN) layers and no draft model");
  }
  if (options.eplb) {
    refuse("model.eplb_map", "has no experts to place");
  }
  if (options.switch_w13) {
    refuse("model.switch_w13", "has no fused expert weights (w13)");
  }
  if (options.pad_moe_intermediate_to != 0) {
    refuse("model.pad_moe_intermediate_to", "has no MoE intermediate size");
  }
  if (options.fuse_shared_experts.value_or(false)) {
    refuse("model.fuse_shared_experts", "has no shared experts");
  }
  if (layout.ep != 1) {
    throw Error(Stage::kConfig, "", "",
                "parallel layout: ep " + std::to_string(layout.ep) + " needs a mixture-of-" +
                    "experts model; " + c.architecture + " has no experts (use ep 1)");
  }
  const int tp = layout.tp;
  const QkvShape qkv{c.heads, c.kv_heads, c.head_dim};
  // Check every split up front so the error names the config field, not a tensor.
  padded_qkv(qkv, tp, options.unaligned_tp);
  padded_intermediate(c.intermediate, tp, options.unaligned_tp, "intermediate_size");
  even_shard(padded_vocab(c.vocab), 0, tp, "padded vocab_size");

  // Pipeline stage: only this stage's layers get params; the others' tensors are
  // dropped unread, and the embedding / final norm / lm_head live on the edges.
  const Range stage = pp_layers(c.layers, layout.pp, layout.pp_rank, layout.pp_partition);

  auto m = std::make_unique<TableModel>(c.family, c.architecture, layout, dtype, options.strict);
  m->set_quantization(options.quant);
  for (std::uint64_t layer = stage.begin; layer < stage.end(); ++layer) {
    add_layer(*m, c, tp, options.unaligned_tp, layer);
  }
  add_layer_drops(*m, c.layers, stage);
  StageEdges edges;
  edges.hidden = c.hidden;
  edges.vocab = c.vocab;
  edges.tie_embeddings = c.tie_embeddings;
  add_stage_edges(*m, edges, layout);
  add_rope_cache_drops(*m);
  // A bias the model has no param for (an mlp_bias checkpoint's MLP biases, or
  // attention biases without attention_bias): SGLang's load_weights skips any
  // ".bias" not among its params; ferry drops it, with its reason.
  if (c.family != "qwen2") {
    for (const char* proj : {"mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"}) {
      m->add_drop_pattern(proj, "no_bias_param");
    }
    if (!c.qkv_bias) {
      for (const char* proj : {"self_attn.q_proj.bias", "self_attn.k_proj.bias",
                               "self_attn.v_proj.bias", "self_attn.o_proj.bias"}) {
        m->add_drop_pattern(proj, "no_bias_param");
      }
    }
  }
  m->finish();
  return m;
}

}  // namespace ferry::models
