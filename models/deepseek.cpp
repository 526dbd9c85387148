#include "models/deepseek.hpp"

#include <array>
#include <cctype>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "models/experts.hpp"
#include "models/hf_config.hpp"
#include "models/indexer_hook.hpp"
#include "models/layers.hpp"
#include "models/mla_hook.hpp"
#include "models/placement.hpp"
#include "models/stages.hpp"
#include "models/table_model.hpp"

namespace ferry::models {
namespace {

using Blocks = std::vector<Block>;

// The per-rank sizes of an MLA attention module (heads % tp == 0 is checked first).
MlaDims mla_dims(const DeepseekConfig& c, int tp, Unaligned u) {
  return {padded_heads(c.heads, tp, u, "num_attention_heads") / static_cast<std::uint64_t>(tp),
          c.qk_nope, c.v_head, c.kv_lora_rank};
}

// Where one decoder layer's params go and where its tensors come from: the same
// "model.layers.<i>." for the target model; the draft's MTP layer is read from
// "model.layers.<num_hidden_layers>." into "model.decoder.".
struct LayerNames {
  std::uint64_t index = 0;  // checkpoint layer index (the EPLB map's key)
  std::string param;
  std::string tensor;
  bool mtp = false;  // the MTP (NextN) layer
};

// Declares params and targets of one model, layer by layer.
class Builder {
 public:
  Builder(TableModel& m, const DeepseekConfig& c, const FamilyInput& in,
          const ModelOptions& options)
      : m_(m),
        c_(c),
        in_(in),
        options_(options),
        tp_(in.layout.tp),
        attn_tp_(attention_group(in)),
        dense_tp_(in.layout.moe_dense_tp == 1 ? 1 : in.layout.tp),
        shared_tp_(in.layout.moe_a2a == ParallelLayout::MoeA2a::kDeepep ? 1 : in.layout.tp) {}

  void layer(const LayerNames& n, bool moe) {
    if (c_.mla) {
      mla(n.param + "self_attn.", n.tensor + "self_attn.");
      if (c_.indexer && deepseek_indexer_layer(c_, n.index, n.mtp)) {
        indexer(n.param + "self_attn.indexer.", n.tensor + "self_attn.indexer.");
      } else if (c_.indexer) {
        m_.add_drop_pattern(n.tensor + "self_attn.indexer.", "no_indexer");
      }
    } else {
      gqa(n.param + "self_attn.", n.tensor + "self_attn.");
    }
    if (moe) {
      moe_mlp(n);
    } else {
      gated_mlp(n.param + "mlp.", n.tensor + "mlp.", c_.intermediate, "intermediate_size",
                dense_tp_);
    }
    for (const char* norm : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
      add_replicated(m_, n.param + norm, n.tensor + norm, Shape{c_.hidden});
    }
  }

 private:
  // ColumnParallelLinear by heads: `per_head` rows a head, whole heads per rank.
  // Heads tp does not divide are padded (padded_heads): the padded heads' rows
  // are zero fills.
  void column_heads(const std::string& param, const std::string& tensor, std::uint64_t per_head,
                    std::uint64_t cols, const std::string& what) {
    const std::uint64_t rows = c_.heads * per_head;
    const std::uint64_t padded =
        padded_heads(c_.heads, attn_tp_, options_.unaligned_tp, "num_attention_heads") * per_head;
    m_.add_param(param, Shape{padded / static_cast<std::uint64_t>(attn_tp_), cols});
    m_.add_target(tensor, param, Shape{rows, cols}, [=, tp = attn_tp_](int rank) {
      return Blocks{padded_shard(0, rows, padded, rank % tp, tp, what).copy};
    });
    if (padded != rows) {
      m_.add_fill(param, [=, tp = attn_tp_](int rank) {
        return Blocks{padded_shard(0, rows, padded, rank % tp, tp, what).zero};
      });
    }
  }

  // gate_proj and up_proj fused into gate_up_proj, down_proj row-parallel, over a
  // group of `group` ranks (all tp ranks, or 1: whole on every rank).
  void gated_mlp(const std::string& param_prefix, const std::string& tensor_prefix,
                 std::uint64_t inter, const char* what, int group) {
    add_gated_mlp(m_, param_prefix, tensor_prefix, c_.hidden, inter, group, options_.unaligned_tp,
                  what, in_.descriptor.sources("gate_up_proj"));
  }

  void mla(const std::string& pa, const std::string& ta) {
    if (const std::uint64_t padded =
            padded_heads(c_.heads, attn_tp_, options_.unaligned_tp, "num_attention_heads");
        padded != c_.heads) {
      m_.add_note(uneven_note("num_attention_heads " + std::to_string(c_.heads) + " (MLA)", "heads",
                              padded, c_.heads, attn_tp_, std::to_string(padded),
                              attn_tp_ == tp_ ? "tp ranks" : "attention tp ranks"));
    }
    const std::uint64_t qk_head = c_.qk_nope + c_.qk_rope;
    const std::uint64_t kv_a_rows = c_.kv_lora_rank + c_.qk_rope;
    if (c_.q_lora_rank != 0) {
      // SGLang caches q_a_proj and kv_a_proj_with_mqa and concatenates them along
      // the output dim: q_a rows first, then kv_a rows. Both go to every rank.
      const std::string fused = pa + "fused_qkv_a_proj_with_mqa.weight";
      const std::vector<std::string>& src = in_.descriptor.sources("fused_qkv_a_proj_with_mqa");
      const std::uint64_t q = c_.q_lora_rank;
      m_.add_param(fused, Shape{q + kv_a_rows, c_.hidden});
      m_.add_target(ta + src.at(0) + ".weight", fused, Shape{q, c_.hidden},
                    [q](int) { return Blocks{replicated(q)}; });
      m_.add_target(ta + src.at(1) + ".weight", fused, Shape{kv_a_rows, c_.hidden},
                    [q, kv_a_rows](int) {
                      Block b = replicated(kv_a_rows);
                      b.dst_start = q;
                      return Blocks{b};
                    });
      add_replicated(m_, pa + "q_a_layernorm.weight", ta + "q_a_layernorm.weight", Shape{q});
      column_heads(pa + "q_b_proj.weight", ta + "q_b_proj.weight", qk_head, q,
                   "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)");
    } else {
      column_heads(pa + "q_proj.weight", ta + "q_proj.weight", qk_head, c_.hidden,
                   "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)");
      add_replicated(m_, pa + "kv_a_proj_with_mqa.weight", ta + "kv_a_proj_with_mqa.weight",
                     Shape{kv_a_rows, c_.hidden});
    }
    add_replicated(m_, pa + "kv_a_layernorm.weight", ta + "kv_a_layernorm.weight",
                   Shape{c_.kv_lora_rank});
    // Whole heads per rank, each owning dn + dv consecutive rows (models/mla_hook.hpp);
    // padded heads are zero rows, which the hook splits into zero w_kc / w_vc heads.
    column_heads(pa + "kv_b_proj.weight", ta + "kv_b_proj.weight", c_.qk_nope + c_.v_head,
                 c_.kv_lora_rank, "num_attention_heads * (qk_nope_head_dim + v_head_dim)");
    // o_proj's input dim follows the heads, padded columns included.
    const std::uint64_t o_in = c_.heads * c_.v_head;
    const std::uint64_t o_padded =
        padded_heads(c_.heads, attn_tp_, options_.unaligned_tp, "num_attention_heads") * c_.v_head;
    m_.add_param(pa + "o_proj.weight",
                 Shape{c_.hidden, o_padded / static_cast<std::uint64_t>(attn_tp_)});
    add_row_parallel(m_, ta + "o_proj.weight", pa + "o_proj.weight", c_.hidden, o_in, o_padded,
                     attn_tp_, "num_attention_heads * v_head_dim");
    // Filled by the post-load hook only.
    // Their dtype follows kv_b_proj's format (mla_split_form, models/mla_hook.hpp).
    const MlaDims dims = mla_dims(c_, attn_tp_, options_.unaligned_tp);
    const QuantScheme& q = options_.quant;
    const MlaSplitForm form =
        mla_split_form(q, q.quantized() && !module_skipped(q, pa + "kv_b_proj"));
    std::optional<DType> split_dtype;
    if (form == MlaSplitForm::kBf16) {
      split_dtype = DType::kBF16;
    } else if (form == MlaSplitForm::kFp8Tensor) {
      split_dtype = DType::kF8E4M3;
      m_.add_param(pa + "w_scale", Shape{1}, DType::kF32);
    }
    m_.add_param(pa + "w_kc", mla_w_kc_shape(dims), split_dtype,
                 [dims](const Shape&) { return mla_w_kc_strides(dims); });
    m_.add_param(pa + "w_vc", mla_w_vc_shape(dims), split_dtype,
                 [dims](const Shape&) { return mla_w_vc_strides(dims); });
  }

  // DeepSeek-V3.2's sparse-attention indexer: every param replicated; the fused
  // wk_weights_proj is the hook's (models/indexer_hook.hpp).
  void indexer(const std::string& pi, const std::string& ti) {
    const std::uint64_t d = c_.index_head_dim;
    const std::uint64_t h = c_.index_heads;
    add_replicated(m_, pi + "wq_b.weight", ti + "wq_b.weight", Shape{h * d, c_.q_lora_rank});
    // SGLang 0.5.23's Indexer.__init__ (layers/attention/dsa/dsa_indexer.py): either
    // wk (a quantized linear) and weights_proj (BF16), or, with use_dsa_indexer_fusion,
    // one BF16 wk_weights_proj instead, which the fusion hook fills from the two
    // loaded as transients (wk in BF16 unless quantized, as the fused param's loader
    // copies it).
    const bool fused = c_.indexer_rope_interleave;
    add_replicated(m_, pi + "wk.weight", ti + "wk.weight", Shape{d, c_.hidden},
                   fused ? std::optional<DType>(DType::kBF16) : std::nullopt);
    add_replicated(m_, pi + "weights_proj.weight", ti + "weights_proj.weight", Shape{h, c_.hidden},
                   DType::kBF16);
    // A LayerNorm built in F32 (SGLang's Indexer.k_norm).
    add_replicated(m_, pi + "k_norm.weight", ti + "k_norm.weight", Shape{d}, DType::kF32);
    add_replicated(m_, pi + "k_norm.bias", ti + "k_norm.bias", Shape{d}, DType::kF32);
    if (fused) {
      m_.set_transient(pi + "wk.weight");
      m_.set_transient(pi + "weights_proj.weight");
      m_.add_param(pi + "wk_weights_proj.weight", Shape{d + h, c_.hidden}, DType::kBF16);
    }
  }

  // Grouped-query attention as Qwen2's: q, k, v fused into qkv_proj, over the
  // attention tp group (Glm4MoeAttention: parallel_group="attn_tp").
  void gqa(const std::string& pa, const std::string& ta) {
    add_gqa_attention(m_, pa, ta,
                      {.hidden = c_.hidden,
                       .heads = c_.heads,
                       .kv_heads = c_.kv_heads,
                       .head_dim = c_.head_dim,
                       .qkv_bias = c_.qkv_bias,
                       .o_bias = false,
                       .unaligned = options_.unaligned_tp,
                       .sources = in_.descriptor.sources("qkv_proj"),
                       .ranks = attn_tp_ == tp_ ? "tp ranks" : "attention tp ranks"},
                      attn_tp_);
    if (c_.qk_norm) {
      for (const char* norm : {"q_norm.weight", "k_norm.weight"}) {
        add_replicated(m_, pa + norm, ta + norm, Shape{c_.head_dim});
      }
    }
  }

  void moe_mlp(const LayerNames& n) {
    const std::string pm = n.param + "mlp.";
    const std::string tm = n.tensor + "mlp.";
    // The router's weight: the model dtype, or F32 where SGLang 0.5.23 declares it so
    // (Glm4MoeGate.__init__ always; MoEGate.__init__ with config.router_fp32).
    add_replicated(m_, pm + "gate.weight", tm + "gate.weight", Shape{c_.experts, c_.hidden},
                   c_.gate_f32 ? std::optional<DType>(DType::kF32) : std::nullopt);
    if (c_.gate_bias) {
      // The router's correction bias stays float32 whatever the model dtype (the
      // checkpoints store it so, and SGLang declares it so).
      add_replicated(m_, pm + "gate.e_score_correction_bias", tm + "gate.e_score_correction_bias",
                     Shape{c_.experts}, DType::kF32);
    }
    MoeLayerSpec spec = routed_experts(in_.descriptor, n.index, c_.experts, c_.hidden,
                                       c_.moe_intermediate, pm + "experts.", tm + "experts.");
    const bool fused = options_.fuse_shared_experts.value_or(false);
    if (fused) {
      spec.shared_checkpoint_prefix = tm + "shared_experts.";
    }
    add_moe_experts(m_, spec, in_.layout, options_);
    if (!fused && c_.shared_experts > 0) {
      gated_mlp(pm + "shared_experts.", tm + "shared_experts.",
                c_.shared_experts * c_.moe_intermediate, "n_shared_experts * moe_intermediate_size",
                shared_tp_);
    }
  }

  TableModel& m_;
  const DeepseekConfig& c_;
  const FamilyInput& in_;
  const ModelOptions& options_;
  int tp_;
  int attn_tp_;    // MLA's q_b / kv_b / o_proj, GLM's qkv_proj / o_proj: tp / attn_dp
  int dense_tp_;   // the dense layers' MLP: tp, or 1 under moe_dense_tp 1
  int shared_tp_;  // the shared experts: tp, or 1 under DeepEP
};

// Every split the layout needs, checked before any table is built so that the error
// names the config field rather than a tensor.
void check_splits(const DeepseekConfig& c, const FamilyInput& in, const ModelOptions& options,
                  bool any_moe, const std::vector<std::uint64_t>& moe_layers) {
  const ParallelLayout& layout = in.layout;
  const int tp = layout.tp;
  const Unaligned u = options.unaligned_tp;
  if (c.mla) {
    padded_heads(c.heads, attention_group(in), u, "num_attention_heads");
  } else {
    padded_qkv(QkvShape{c.heads, c.kv_heads, c.head_dim}, attention_group(in), u);
  }
  if (!options.draft) {
    for (const int group : {embedding_group(in), lm_head_group(in)}) {
      even_shard(padded_vocab(c.vocab), 0, group != 0 ? group : tp, "padded vocab_size");
    }
  }
  if (!any_moe || c.first_k_dense > 0 || c.moe_layer_freq > 1) {
    padded_intermediate(c.intermediate, layout.moe_dense_tp == 1 ? 1 : tp, u, "intermediate_size");
  }
  if (any_moe && c.shared_experts > 0 && !options.fuse_shared_experts.value_or(false)) {
    padded_intermediate(c.shared_experts * c.moe_intermediate,
                        layout.moe_a2a == ParallelLayout::MoeA2a::kDeepep ? 1 : tp, u,
                        "n_shared_experts * moe_intermediate_size");
  }
  if (!any_moe) {
    for (const auto& [set, option] :
         {std::pair{options.eplb.has_value(), "model.eplb_map"},
          std::pair{options.switch_w13, "model.switch_w13"},
          std::pair{options.pad_moe_intermediate_to != 0, "model.pad_moe_intermediate_to"}}) {
      if (set) {
        throw Error(Stage::kConfig, kConfigFile, "",
                    std::string(option) + ": " + c.architecture +
                        " as configured has no MoE layers, so the option does not apply");
      }
    }
    if (layout.ep != 1) {
      throw Error(Stage::kConfig, "", "",
                  "parallel layout: ep " + std::to_string(layout.ep) + " needs MoE layers; " +
                      c.architecture + " as configured has none (use ep 1)");
    }
    return;
  }
  check_expert_parallel(layout, c.experts, options, c.architecture, "n_routed_experts", moe_layers);
}

}  // namespace

DeepseekConfig deepseek_common_config(const nlohmann::json& hf_config,
                                      const std::string& architecture) {
  DeepseekConfig c;
  c.architecture = architecture;
  c.hidden = config_positive(hf_config, "hidden_size");
  c.layers = config_positive(hf_config, "num_hidden_layers");
  c.vocab = config_positive(hf_config, "vocab_size");
  c.heads = config_positive(hf_config, "num_attention_heads");
  c.tie_embeddings = config_bool(hf_config, "tie_word_embeddings", false);
  c.intermediate = config_positive(hf_config, "intermediate_size");
  c.experts = config_optional_positive(hf_config, "n_routed_experts").value_or(0);
  if (c.experts != 0) {
    c.moe_intermediate = config_positive(hf_config, "moe_intermediate_size");
  }
  c.shared_experts = config_count(hf_config, "n_shared_experts", 0);
  c.first_k_dense = config_count(hf_config, "first_k_dense_replace", 0);
  c.nextn_layers = config_count(hf_config, "num_nextn_predict_layers", 0);

  return c;
}

bool deepseek_moe_layer(const DeepseekConfig& c, std::uint64_t layer) {
  return c.experts != 0 && layer >= c.first_k_dense && layer % c.moe_layer_freq == 0;
}

bool deepseek_indexer_layer(const DeepseekConfig& c, std::uint64_t layer, bool mtp) {
  if (!c.indexer) {
    return false;
  }
  if (mtp) {
    return true;
  }
  if (layer < c.indexer_types.size()) {
    std::string t = c.indexer_types[layer];
    for (char& ch : t) {
      ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    }
    if (t == "f" || t == "full" || t == "compute") {
      return true;
    }
    if (t == "s" || t == "shared" || t == "skip") {
      return false;
    }
    if (!t.empty()) {
      throw Error(Stage::kConfig, kConfigFile, "",
                  "unsupported DSA indexer type \"" + c.indexer_types[layer] + "\" for layer " +
                      std::to_string(layer) + " (indexer_types / index_topk_pattern)");
    }
  }
  const std::uint64_t f = c.index_topk_freq;
  if (f <= 1) {
    return true;
  }
  const std::uint64_t offset = c.index_skip_topk_offset.value_or(0);
  const std::uint64_t from = c.index_skip_topk_offset ? offset - 1 : 1;
  return (layer > from ? layer - from : 0) % f == 0;
}

FusionDecision sglang_shared_expert_fusion(const DeepseekConfig& c, const ParallelLayout& layout,
                                           bool enforce, bool trtllm) {
  if (c.experts == 0 || c.shared_experts == 0) {
    return {false, c.architecture + " as configured has no shared experts"};
  }
  if (trtllm) {
    return {false,
            "SGLang 0.5.23 disables shared-expert fusion under the flashinfer_trtllm MoE "
            "runner (_moe_runner_fusion_disable), its default for these experts on sm100"};
  }
  if (enforce && c.fusion != SharedExpertFusion::kSingleShared) {
    // --enforce-shared-experts-fusion: DeepseekV2ForCausalLM's
    // shared_experts_fusion_disable_reason returns None before any check of the
    // architecture, the expert count or ep (SGLang 0.5.23, deepseek_v2.py); the
    // loader then asserts a single shared expert.
    if (c.shared_experts != 1) {
      return {false,
              "SGLang fuses exactly one shared expert (its loader asserts "
              "num_fused_shared_experts == 1); this " +
                  c.architecture + " config has " + std::to_string(c.shared_experts)};
    }
    if (layout.moe_a2a == ParallelLayout::MoeA2a::kDeepep) {
      return {false,
              "under DeepEP (parallel.moe_a2a=deepep) SGLang's enforced fusion gives each "
              "rank its own shared-expert slot after all routed experts, a layout ferry "
              "does not build"};
    }
    return {true, ""};
  }
  if (layout.moe_a2a == ParallelLayout::MoeA2a::kDeepep) {
    return {false, "SGLang does not fuse the shared expert under DeepEP (moe_a2a deepep)"};
  }
  switch (c.fusion) {
    case SharedExpertFusion::kSingleShared:
      if (c.shared_experts != 1) {
        return {false, "ferry fuses a single shared expert; this " + c.architecture +
                           " config has " + std::to_string(c.shared_experts)};
      }
      break;
    case SharedExpertFusion::kDeepseekV3Shape:
      if (c.experts == 256 && c.shared_experts == 1) {
        break;
      }
      [[fallthrough]];
    case SharedExpertFusion::kNever:
      return {false,
              "SGLang fuses the shared expert by default only for DeepSeek-V3/R1-shaped models "
              "(DeepseekV3ForCausalLM, 256 routed experts, 1 shared expert; 384 only for a "
              "Quark checkpoint, which ferry does not load); this is " +
                  c.architecture + " with " + std::to_string(c.experts) + " routed and " +
                  std::to_string(c.shared_experts) + " shared"};
  }
  if (layout.ep > 1) {
    return {false, "SGLang does not fuse the shared expert under expert parallelism (ep " +
                       std::to_string(layout.ep) + ")"};
  }
  return {true, ""};
}

std::unique_ptr<TableModel> make_deepseek_model(const FamilyInput& in, const DeepseekConfig& c) {
  const ParallelLayout& layout = in.layout;
  const ModelOptions& options = in.options;
  if (options.draft) {
    if (c.nextn_layers == 0) {
      throw Error(Stage::kConfig, kConfigFile, "",
                  "model.draft: " + c.architecture +
                      " config has no MTP layer (num_nextn_predict_layers is 0 or missing), so "
                      "there is no draft model to load");
    }
    if (c.nextn_layers != 1) {
      // SGLang's NextN loader asserts num_nextn_predict_layers == 1.
      throw Error(Stage::kConfig, kConfigFile, "",
                  "model.draft: num_nextn_predict_layers is " + std::to_string(c.nextn_layers) +
                      "; the draft model has exactly one MTP layer (as SGLang asserts)");
    }
    if (layout.pp != 1) {
      throw Error(Stage::kConfig, "", "",
                  "model.draft: the MTP draft model is a single layer and is not split into "
                  "pipeline stages (parallel.pp is " +
                      std::to_string(layout.pp) + "; use pp 1)");
    }
    if (c.experts == 0) {
      throw Error(Stage::kConfig, kConfigFile, "",
                  "model.draft: the MTP layer is a MoE layer but n_routed_experts is not set");
    }
  }
  // Shared-expert fusion: SGLang's decision, or the operator's where it agrees.
  ModelOptions o = options;
  const FusionDecision fusion = sglang_shared_expert_fusion(
      c, layout, options.fuse_shared_experts.value_or(false), options.quant.trtllm_experts);
  if (!options.fuse_shared_experts) {
    o.fuse_shared_experts = fusion.fuse;
  } else if (*options.fuse_shared_experts && !fusion.fuse) {
    throw Error(Stage::kConfig, kConfigFile, "",
                "model.fuse_shared_experts=true: " + fusion.why_not);
  }
  // The draft's MTP layer: model.layers.<num_hidden_layers>, or layer 0 of a
  // stand-alone NextN checkpoint (num_hidden_layers == 1), as SGLang's loader reads.
  const std::uint64_t mtp = c.layers == 1 && options.draft ? 0 : c.layers;
  const Range stage = options.draft
                          ? Range{0, 0}
                          : pp_layers(c.layers, layout.pp, layout.pp_rank, layout.pp_partition);
  // Experts are checked whenever the model has any, so that every pipeline stage
  // of one layout accepts or refuses the same ep.
  std::vector<std::uint64_t> moe_layers;  // the MoE layers this model holds (EPLB rows)
  if (options.draft) {
    moe_layers.push_back(0);  // SGLang builds the NextN layer with layer id 0
  } else {
    for (std::uint64_t l = stage.begin; l < stage.end(); ++l) {
      if (deepseek_moe_layer(c, l)) {
        moe_layers.push_back(l);
      }
    }
  }
  check_splits(c, in, o, c.experts != 0, moe_layers);

  auto m = std::make_unique<TableModel>(in.descriptor.family, c.architecture, layout, in.dtype,
                                        o.strict);
  set_family_quantization(*m, in, o.quant);
  Builder b(*m, c, in, o);
  if (!o.draft) {
    for (std::uint64_t l = stage.begin; l < stage.end(); ++l) {
      b.layer({l, layer_prefix(l), layer_prefix(l)}, deepseek_moe_layer(c, l));
    }
    add_layer_drops(*m, c.layers, stage);
    for (std::uint64_t l = mtp; l < mtp + c.nextn_layers; ++l) {
      m->add_drop_pattern(layer_prefix(l), "mtp_layer");
    }
    // Under attention data parallelism the embedding splits over the attention tp
    // group (SGLang 0.5.23, DeepseekV2Model: VocabParallelEmbedding(
    // **get_embedding_tp_kwargs()), use_attn_tp_group=is_dp_attention_enabled();
    // GLM-4 MoE's Glm4MoeModel likewise), and lm_head with dp_lm_head
    // (ParallelLMHead(use_attn_tp_group=enable_dp_lm_head)).
    StageEdges edges = stage_edges(in, c.hidden, c.vocab, c.tie_embeddings);
    add_stage_edges(*m, edges, layout);
  } else {
    const std::string t = layer_prefix(mtp);
    // The NextN-specific weights live directly under model.; eh_proj is a plain
    // (replicated) nn.Linear from [embedding; hidden] (2 * hidden) to hidden.
    for (const char* norm : {"enorm.weight", "hnorm.weight", "shared_head.norm.weight"}) {
      add_replicated(*m, std::string("model.") + norm, t + norm, Shape{c.hidden});
    }
    add_replicated(*m, "model.eh_proj.weight", t + "eh_proj.weight", Shape{c.hidden, 2 * c.hidden});
    m->add_drop_pattern(t + "shared_head.head", "draft_shared");
    m->add_drop_pattern(t + "embed_tokens", "draft_shared");
    b.layer({0, "model.decoder.", t, /*mtp=*/true}, /*moe=*/true);  // EPLB row 0, as SGLang's id
    for (std::uint64_t l = 0; l < c.layers; ++l) {
      if (l != mtp) {
        m->add_drop_pattern(layer_prefix(l), "draft_target");
      }
    }
    for (const char* name : {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}) {
      m->add_drop_name(name, "draft_target");
    }
  }
  m->add_drop_pattern("rotary_emb.inv_freq", "inv_freq");
  m->finish();
  return m;
}

std::vector<PostLoadHook> deepseek_mla_hooks(const Model& model, const FamilyInput& in) {
  std::vector<PostLoadHook> hooks;
  for (std::size_t i = 0; i < model.shells().size(); ++i) {
    const RankShell& shell = model.shells()[i];
    for (const ParamSpec& p : shell.params) {
      if (!p.name.ends_with("self_attn.w_kc")) {
        continue;
      }
      // The split's sizes are the outputs' declared shapes: w_kc [H, dn, r], w_vc
      // [H, r, dv] (make_deepseek_model declares them from the config and layout).
      const std::string prefix = p.name.substr(0, p.name.size() - 4);
      auto vc = shell.by_name.find(prefix + "w_vc");
      if (vc == shell.by_name.end()) {
        throw Error(Stage::kPostProcess, "", p.name, "internal: no w_vc beside w_kc");
      }
      const Shape& w_vc = shell.params[vc->second].shape;
      const MlaDims dims{p.shape.at(0), p.shape.at(1), w_vc.at(2), p.shape.at(2)};
      hooks.push_back(make_mla_split_hook(model, i, prefix, dims, in.options.quant));
    }
  }
  return hooks;
}

std::vector<PostLoadHook> deepseek_indexer_hooks(const Model& model, const FamilyInput& in) {
  std::vector<PostLoadHook> hooks;
  const std::string fused = "wk_weights_proj.weight";
  for (std::size_t i = 0; i < model.shells().size(); ++i) {
    for (const ParamSpec& p : model.shells()[i].params) {
      if (p.name.ends_with("self_attn.indexer." + fused)) {
        const std::string prefix = p.name.substr(0, p.name.size() - fused.size());
        hooks.push_back(make_indexer_fuse_hook(model, i, prefix, in.options.quant));
      }
    }
  }
  return hooks;
}

}  // namespace ferry::models
