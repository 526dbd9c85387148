#include "models/dense.hpp"

#include "common/error.hpp"
#include "models/hf_config.hpp"
#include "models/layers.hpp"
#include "models/placement.hpp"
#include "models/stages.hpp"

namespace ferry::models {
namespace {

// Declares the params of one layer and the checkpoint names that feed them.
void add_layer(TableModel& m, const FamilyInput& in, const DenseConfig& c, std::uint64_t layer) {
  const int tp = in.layout.tp;
  const int attn_tp = attention_group(in);
  const Unaligned u = in.options.unaligned_tp;
  const std::string p = layer_prefix(layer);
  // Attention: q, k and v fused into qkv_proj, o_proj row-parallel, over the
  // attention tp group where the family splits it so (attention_dp).
  GqaAttention attention = gqa_attention(c, c.qkv_bias, c.o_bias, u);
  attention.sources = in.descriptor.sources("qkv_proj");
  attention.ranks = attn_tp == tp ? "tp ranks" : "attention tp ranks";
  add_gqa_attention(m, p + "self_attn.", p + "self_attn.", attention, attn_tp);
  if (c.qk_norm) {
    for (const char* norm : {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}) {
      add_replicated(m, p + norm, p + norm, Shape{c.head_dim});
    }
  }
  // MLP: gate and up fused into gate_up_proj, down_proj row-parallel.
  add_gated_mlp(m, p + "mlp.", p + "mlp.", c.hidden, c.intermediate, tp, u, "intermediate_size",
                in.descriptor.sources("gate_up_proj"));
  for (const std::string& norm : c.layer_norms) {
    add_replicated(m, p + norm + ".weight", p + norm + ".weight", Shape{c.hidden});
  }
}

}  // namespace

DenseConfig dense_config(const nlohmann::json& config) {
  DenseConfig c;
  static_cast<GqaDecoderDims&>(c) = config_gqa_decoder_dims(config);
  c.intermediate = config_positive(config, "intermediate_size");
  return c;
}

FamilyDescriptor dense_descriptor(std::string architecture, std::string family,
                                  std::function<DenseConfig(const nlohmann::json&)> parse) {
  FamilyDescriptor d;
  d.architecture = std::move(architecture);
  d.family = std::move(family);
  d.required_fields = dense_required_fields();
  d.fused = standard_fused_mappings();
  d.build = [parse = std::move(parse)](const FamilyInput& in) {
    return make_dense_model(in, parse(in.config));
  };
  return d;
}

std::vector<std::string> dense_required_fields() {
  return {"hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
          "intermediate_size"};
}

std::unique_ptr<TableModel> make_dense_model(const FamilyInput& in, const DenseConfig& c) {
  const ParallelLayout& layout = in.layout;
  const std::string& arch = in.descriptor.architecture;
  const int tp = layout.tp;
  if (!c.pipeline_stages && layout.pp != 1) {
    throw Error(Stage::kConfig, "", "",
                "parallel layout: pp " + std::to_string(layout.pp) + ": ferry does not split " +
                    arch + " into pipeline stages (its output projection is the embedding; use "
                    "pp 1)");
  }
  const QkvShape qkv{c.heads, c.kv_heads, c.head_dim};
  // Check every split up front so the error names the config field, not a tensor.
  padded_qkv(qkv, attention_group(in), in.options.unaligned_tp);
  padded_intermediate(c.intermediate, tp, in.options.unaligned_tp, "intermediate_size");
  if (!c.replicated_embedding) {
    for (const int group : {embedding_group(in), lm_head_group(in)}) {
      even_shard(padded_vocab(c.vocab), 0, group != 0 ? group : tp, "padded vocab_size");
    }
  }

  // Pipeline stage: only this stage's layers get params; the others' tensors are
  // dropped unread, and the embedding / final norm / lm_head live on the edges.
  const Range stage = pp_layers(c.layers, layout.pp, layout.pp_rank, layout.pp_partition);

  auto m = std::make_unique<TableModel>(in.descriptor.family, arch, layout, in.dtype,
                                        in.options.strict);
  set_family_quantization(*m, in, in.options.quant);
  for (std::uint64_t layer = stage.begin; layer < stage.end(); ++layer) {
    add_layer(*m, in, c, layer);
  }
  add_layer_drops(*m, c.layers, stage);
  StageEdges edges = stage_edges(in, c.hidden, c.vocab, c.tie_embeddings);
  edges.replicated_embedding = c.replicated_embedding;
  add_stage_edges(*m, edges, layout);
  add_rope_cache_drops(*m);
  // A bias the model has no param for (an mlp_bias checkpoint's MLP biases, or
  // attention biases without attention_bias): SGLang's load_weights skips any
  // ".bias" not among its params; ferry drops it, with its reason.
  if (c.drop_unused_biases) {
    for (const char* proj : {"mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias",
                             "mlp.gate_up_proj.bias"}) {
      m->add_drop_pattern(proj, "no_bias_param");
    }
    if (!c.qkv_bias) {
      for (const char* proj : {"self_attn.q_proj.bias", "self_attn.k_proj.bias",
                               "self_attn.v_proj.bias", "self_attn.qkv_proj.bias"}) {
        m->add_drop_pattern(proj, "no_bias_param");
      }
    }
    if (!c.o_bias) {
      m->add_drop_pattern("self_attn.o_proj.bias", "no_bias_param");
    }
  }
  if (c.norms_through_f32) {
    m->load_through("norm.weight", "_loaded", DType::kF32);
  }
  m->finish();
  return m;
}

}  // namespace ferry::models
