#include "models/moe.hpp"

#include <array>
#include <set>
#include <utility>

#include "common/error.hpp"
#include "models/experts.hpp"
#include "models/hf_config.hpp"
#include "models/layers.hpp"
#include "models/placement.hpp"
#include "models/stages.hpp"
#include "models/table_model.hpp"

namespace ferry::models {
namespace {

using Blocks = std::vector<Block>;

class Builder {
 public:
  Builder(TableModel& m, const MoeConfig& c, const FamilyInput& in)
      : m_(m), c_(c), in_(in) {}

  void layer(std::uint64_t layer) {
    const std::string p = layer_prefix(layer);
    attention(p);
    for (const char* norm : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
      add_replicated(m_, p + norm, p + norm, Shape{c_.hidden});
    }
    if (!c_.sparse[layer]) {
      dense_mlp(p + "mlp.", c_.dense_intermediate, "intermediate_size");
      return;
    }
    const std::string moe = p + c_.moe_block;
    // The router is a ReplicatedLinear: every rank holds all of it.
    const std::string gate = moe + "gate.weight";
    add_replicated(m_, gate, gate, Shape{c_.experts, c_.hidden});

    MoeLayerSpec spec = routed_experts(in_.descriptor, layer, c_.experts, c_.hidden,
                                       c_.moe_intermediate, moe + "experts.", moe + "experts.");
    spec.intermediate_field = c_.moe_intermediate_field;
    add_moe_experts(m_, spec, in_.layout, in_.options);

    if (c_.shared_intermediate > 0) {
      // Qwen2-MoE's shared expert is never fused (SGLang's Qwen2MoeSparseMoeBlock
      // builds it as its own tensor-parallel MLP, gated by shared_expert_gate).
      dense_mlp(moe + "shared_expert.", c_.shared_intermediate, "shared_expert_intermediate_size");
      // The shared expert's sigmoid gate: a [1, H] ReplicatedLinear.
      const std::string sg = moe + "shared_expert_gate.weight";
      add_replicated(m_, sg, sg, Shape{1, c_.hidden});
    }
  }

 private:
  // q, k and v fused into qkv_proj (slots q, k, v), o_proj row-parallel; Qwen3's
  // per-head q/k RMSNorm weights are replicated.
  void attention(const std::string& p) {
    GqaAttention attention = gqa_attention(c_, c_.qkv_bias, c_.o_bias, in_.options.unaligned_tp);
    attention.sources = in_.descriptor.sources("qkv_proj");
    const int attn_tp = attention_group(in_);
    attention.ranks = attn_tp == in_.layout.tp ? "tp ranks" : "attention tp ranks";
    add_gqa_attention(m_, p + "self_attn.", p + "self_attn.", attention, attn_tp);
    if (c_.qk_norm) {
      for (const char* norm : {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}) {
        add_replicated(m_, p + norm, p + norm, Shape{c_.head_dim});
      }
    }
  }

  // A tensor-parallel gated MLP under `p` (dense layers, Qwen2-MoE's shared expert).
  void dense_mlp(const std::string& p, std::uint64_t inter, const char* what) {
    add_gated_mlp(m_, p, p, c_.hidden, inter, in_.layout.tp, in_.options.unaligned_tp, what,
                  in_.descriptor.sources("gate_up_proj"));
  }

  TableModel& m_;
  const MoeConfig& c_;
  const FamilyInput& in_;
};

// Every split the layout needs, checked before any param is declared so the error
// names the config field rather than a tensor.
void check_splits(const MoeConfig& c, const FamilyInput& in) {
  const std::string& architecture = in.descriptor.architecture;
  const ParallelLayout& layout = in.layout;
  const ModelOptions& options = in.options;
  const int tp = layout.tp;
  padded_qkv(QkvShape{c.heads, c.kv_heads, c.head_dim}, attention_group(in),
             options.unaligned_tp);
  for (const int group : {embedding_group(in), lm_head_group(in)}) {
    even_shard(padded_vocab(c.vocab), 0, group != 0 ? group : tp, "padded vocab_size");
  }
  std::vector<std::uint64_t> moe_layers;
  for (std::uint64_t l = 0; l < c.layers; ++l) {
    if (c.sparse[l]) {
      moe_layers.push_back(l);
    }
  }
  check_expert_parallel(layout, c.experts, options, architecture, c.experts_field, moe_layers);
  if (c.shared_intermediate > 0) {
    padded_intermediate(c.shared_intermediate, tp, options.unaligned_tp,
                        "shared_expert_intermediate_size");
  }
  if (moe_layers.size() < c.layers) {
    padded_intermediate(c.dense_intermediate, tp, options.unaligned_tp, "intermediate_size");
  }
  // SGLang fuses shared experts only for DeepSeek-V3/R1-shaped models and GLM-4 MoE
  // (shared_experts_fusion_disable_reason): asking for it here is refused.
  if (options.fuse_shared_experts.value_or(false)) {
    throw Error(Stage::kConfig, kConfigFile, "",
                "model.fuse_shared_experts=true: " + architecture +
                    (c.shared_intermediate > 0
                         ? " keeps its shared expert as a separate, gated MLP; SGLang never "
                           "fuses it into the routed experts"
                         : " has no shared experts"));
  }
}

}  // namespace

std::unique_ptr<TableModel> make_moe_model(const FamilyInput& in, const MoeConfig& c) {
  const ParallelLayout& layout = in.layout;
  const ModelOptions& options = in.options;
  if (c.sparse.size() != c.layers) {
    throw Error(Stage::kConfig, kConfigFile, "",
                "internal: the sparse-layer list has " + std::to_string(c.sparse.size()) +
                    " entries for num_hidden_layers " + std::to_string(c.layers));
  }
  check_splits(c, in);
  const Range stage = pp_layers(c.layers, layout.pp, layout.pp_rank, layout.pp_partition);

  auto m = std::make_unique<TableModel>(in.descriptor.family, in.descriptor.architecture, layout,
                                        in.dtype, options.strict);
  set_family_quantization(*m, in, options.quant);
  Builder b(*m, c, in);
  for (std::uint64_t layer = stage.begin; layer < stage.end(); ++layer) {
    b.layer(layer);
  }
  add_layer_drops(*m, c.layers, stage);
  StageEdges edges = stage_edges(in, c.hidden, c.vocab, c.tie_embeddings);
  add_stage_edges(*m, edges, layout);
  add_rope_cache_drops(*m);
  m->finish();
  return m;
}

}  // namespace ferry::models
