// DeepSeek-V2 / DeepSeek-V3 (multi-head latent attention, DeepSeekMoE, the MTP
// layer) and GLM-4 MoE (grouped-query attention with the same MoE and MTP layout),
// with SGLang's parameter names:
//
//   MLA, q_lora_rank set:  self_attn.fused_qkv_a_proj_with_mqa.weight  q_a_proj rows,
//                          then kv_a_proj_with_mqa rows (replicated)
//                          self_attn.q_a_layernorm / kv_a_layernorm (replicated)
//                          self_attn.q_b_proj.weight (column-parallel by heads)
//   MLA, q_lora_rank null: self_attn.q_proj.weight (column-parallel by heads),
//                          self_attn.kv_a_proj_with_mqa.weight (replicated)
//   MLA, both:             self_attn.kv_b_proj.weight (column-parallel by heads),
//                          self_attn.o_proj.weight (row-parallel), and the post-load
//                          outputs self_attn.w_kc / w_vc (models/mla_hook.hpp)
//   GLM-4 MoE:             self_attn.qkv_proj (+ bias with attention_bias),
//                          o_proj, q_norm / k_norm with use_qk_norm
//   dense layers:          mlp.gate_up_proj / mlp.down_proj (intermediate_size)
//   MoE layers:            mlp.gate.weight (replicated; F32 for GLM-4 MoE and with
//                          router_fp32), mlp.gate.e_score_correction_bias
//                          (replicated, F32; DeepSeek only with topk_method noaux_tc),
//                          mlp.experts.w13_weight / w2_weight (models/experts.hpp),
//                          mlp.shared_experts.gate_up_proj / down_proj (tensor-parallel,
//                          n_shared_experts * moe_intermediate_size) unless
//                          fuse_shared_experts folds them into the experts.
//
// A layer is MoE when n_routed_experts is set, its index is >= first_k_dense_replace
// and (DeepSeek) a multiple of moe_layer_freq; the MTP layer always is.
//
// MTP (NextN) layers are stored after the decoder layers, at indices
// num_hidden_layers .. num_hidden_layers + num_nextn_predict_layers - 1.
// - Target model (ModelOptions::draft off): their tensors are dropped, "mtp_layer".
// - Draft model (draft on): only layer num_hidden_layers is loaded. Its enorm, hnorm,
//   eh_proj (replicated) and shared_head.norm become model.enorm.weight,
//   model.hnorm.weight, model.eh_proj.weight, model.shared_head.norm.weight; the
//   rest of it becomes model.decoder.* (placed as a normal MoE layer). Its
//   shared_head.head and embed_tokens are dropped with "draft_shared" (the draft
//   uses the target's embedding and head); every tensor of the target model
//   (decoder layers, model.embed_tokens, model.norm, lm_head) is dropped with
//   "draft_target". Refused unless num_nextn_predict_layers is 1 (SGLang asserts
//   it), and with pp > 1. As SGLang builds it with layer id 0, the MTP layer reads
//   row 0 of an EPLB map. A stand-alone NextN checkpoint (num_hidden_layers 1)
//   keeps its MTP layer at model.layers.0.
// DeepSeek-V3.2 (DeepseekV32ForCausalLM, or any DeepSeek config with index_topk) has
// a sparse-attention indexer in the layers dsa_layer_has_indexer picks (every layer
// unless indexer_types / index_topk_pattern / index_topk_freq say otherwise; the MTP
// layer always), all of it replicated on every rank:
//   self_attn.indexer.wq_b.weight [index_n_heads * index_head_dim, q_lora_rank]
//                      wk.weight   [index_head_dim, hidden]      (both quantized linears)
//                      weights_proj.weight [index_n_heads, hidden] (BF16)
//                      k_norm.weight / k_norm.bias [index_head_dim] (F32, a LayerNorm)
//   or, where SGLang 0.5.23 fuses them (the Indexer's use_dsa_indexer_fusion, on CUDA:
//   config.json's indexer_rope_interleave true, so not is_neox_style, and
//   SGLANG_DISABLE_DSA_INDEXER_FUSION unset), instead of wk and weights_proj:
//                      wk_weights_proj.weight [index_head_dim + index_n_heads, hidden]
//                          (BF16) filled by the fusion hook (models/indexer_hook.hpp)
//                          from wk and weights_proj loaded as transients
// The indexer tensors of a layer without one are dropped ("no_indexer").
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "models/family.hpp"
#include "models/model.hpp"
#include "models/table_model.hpp"

namespace ferry::models {

// When SGLang folds the shared expert into the routed experts (at ep 1; see
// sglang_shared_expert_fusion).
enum class SharedExpertFusion {
  kNever,            // DeepSeek-V2, V3.2
  kDeepseekV3Shape,  // DeepseekV3ForCausalLM with 256 routed and 1 shared expert
  kSingleShared,     // GLM-4 MoE (ferry: with 1 shared expert)
};

// The config fields these families use, after defaults (models/families/deepseek.cpp
// and glm4_moe.cpp read them).
struct DeepseekConfig {
  std::string architecture;  // "DeepseekV2ForCausalLM", ...
  SharedExpertFusion fusion = SharedExpertFusion::kNever;
  std::uint64_t hidden = 0;
  std::uint64_t layers = 0;  // num_hidden_layers (without the MTP layers)
  std::uint64_t vocab = 0;
  std::uint64_t heads = 0;
  bool tie_embeddings = false;
  bool mla = true;  // DeepSeek; GLM-4 MoE uses grouped-query attention
  // MLA
  std::uint64_t q_lora_rank = 0;  // 0: q_lora_rank null (q_proj, no q_a/q_b)
  std::uint64_t kv_lora_rank = 0;
  std::uint64_t qk_nope = 0;  // qk_nope_head_dim
  std::uint64_t qk_rope = 0;  // qk_rope_head_dim
  std::uint64_t v_head = 0;   // v_head_dim
  // Grouped-query attention (GLM-4 MoE)
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;
  bool qkv_bias = false;  // attention_bias
  bool qk_norm = false;   // use_qk_norm
  // MLP and MoE
  std::uint64_t intermediate = 0;  // dense layers' intermediate_size
  std::uint64_t experts = 0;       // n_routed_experts; 0: every layer dense
  std::uint64_t moe_intermediate = 0;
  std::uint64_t shared_experts = 0;  // n_shared_experts (0 when null)
  std::uint64_t first_k_dense = 0;   // first_k_dense_replace
  std::uint64_t moe_layer_freq = 1;
  bool gate_bias = false;          // mlp.gate.e_score_correction_bias exists
  // mlp.gate.weight is F32 whatever the model dtype (SGLang 0.5.23: Glm4MoeGate
  // always; DeepSeek's MoEGate with config.json's router_fp32).
  bool gate_f32 = false;
  std::uint64_t nextn_layers = 0;  // num_nextn_predict_layers
  // DeepSeek-V3.2's sparse-attention indexer (index_topk set; SGLang's
  // is_deepseek_dsa): its heads and head dim, and which layers have one.
  bool indexer = false;
  std::uint64_t index_heads = 0;           // index_n_heads
  std::uint64_t index_head_dim = 0;        // index_head_dim
  bool indexer_rope_interleave = false;    // fuses wk and weights_proj (see above)
  std::vector<std::string> indexer_types;  // per layer ("full" / "shared", ...), may be empty
  std::uint64_t index_topk_freq = 1;
  std::optional<std::uint64_t> index_skip_topk_offset;
};

// The fields DeepSeek and GLM-4 MoE read alike (sizes, experts, dense layers, MTP).
DeepseekConfig deepseek_common_config(const nlohmann::json& hf_config,
                                      const std::string& architecture);

// Reads the fields of a DeepSeek architecture (DeepseekV2ForCausalLM,
// DeepseekV3ForCausalLM, DeepseekV32ForCausalLM; models/families/deepseek.cpp).
// Throws Error(Stage::kConfig) naming a missing or malformed field.
DeepseekConfig parse_deepseek_config(const nlohmann::json& hf_config,
                                     const std::string& architecture);

// Whether decoder layer `layer` (< c.layers) has a MoE MLP.
bool deepseek_moe_layer(const DeepseekConfig& c, std::uint64_t layer);

// Whether `layer` has a sparse-attention indexer (c.indexer set): SGLang's
// dsa_layer_has_indexer / dsa_layer_skips_topk. The MTP layer always has one; a layer
// of type "shared" (indexer_types, else index_topk_pattern) reuses the previous
// layer's top-k and has none, "full" has one; otherwise with index_topk_freq f > 1
// only the layers where max(layer - offset + 1, 0) % f == 0 (offset
// index_skip_topk_offset, else max(layer - 1, 0) % f == 0) have one.
bool deepseek_indexer_layer(const DeepseekConfig& c, std::uint64_t layer, bool mtp);

// Whether SGLang fuses the shared expert into the routed experts, as its
// shared_experts_fusion_disable_reason decides on an NVIDIA GPU of compute capability
// >= 8.0 with default server options (python/sglang/srt/models/deepseek_v2.py in
// SGLang 0.5.23; glm4_moe.py (SGLang 0.5.23)):
// DeepseekV3ForCausalLM with 256 routed experts and 1 shared expert, or GLM-4 MoE
// (ferry: with 1 shared expert), at ep 1. No DeepEP and no W4AFP8 in ferry, so
// those conditions never apply. `why_not` says why not, for the refusal of true.
// `enforce` (model.fuse_shared_experts=true) is SGLang 0.5.23's
// --enforce-shared-experts-fusion: a DeepSeek-architecture model with exactly one
// shared expert fuses it whatever its architecture name, expert count or ep
// (shared_experts_fusion_disable_reason returns None first), except under DeepEP,
// whose per-rank shared slots ferry does not build (refused). GLM-4 MoE ignores it.
// SGLang's other cases need keys ferry has no (Quark's 384 experts, AMD's EP, SBO /
// TBO, which disable it): not expressible, so never chosen. `trtllm`
// (QuantScheme::trtllm_experts): the flashinfer_trtllm MoE runner, under which
// SGLang sets disable_shared_experts_fusion (overrides.py _moe_runner_fusion_disable),
// which wins over the enforce flag (resolve_shared_experts_config): never fused.
struct FusionDecision {
  bool fuse = false;
  std::string why_not;
};
FusionDecision sglang_shared_expert_fusion(const DeepseekConfig& c, const ParallelLayout& layout,
                                           bool enforce = false, bool trtllm = false);

// The model for `c` under `in` (layout normalized) with params of in.dtype (the
// gate's correction bias is F32 regardless). Sizes tp does not divide are refused,
// or zero-padded under options.unaligned_tp; throws Error(Stage::kPlacement) when
// the padded vocabulary does not split over tp or the experts over ep;
// Error(Stage::kConfig) for a draft request without exactly one MTP layer or with
// pp > 1, and for fuse_shared_experts=true where SGLang would not fuse. MLA's
// w_kc / w_vc are declared with the split's strides (models/mla_hook.hpp).
std::unique_ptr<TableModel> make_deepseek_model(const FamilyInput& in, const DeepseekConfig& c);

// The families' hook rules: the MLA split of every attention with a w_kc param, and
// the V3.2 indexer fusion of every indexer with a wk_weights_proj param.
std::vector<PostLoadHook> deepseek_mla_hooks(const Model& model, const FamilyInput& in);
std::vector<PostLoadHook> deepseek_indexer_hooks(const Model& model, const FamilyInput& in);

}  // namespace ferry::models
