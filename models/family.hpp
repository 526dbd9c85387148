// One descriptor per architecture: what make_model needs to know of a family, in
// one place. A new family is one file in models/families/ (its descriptors and its
// config parse) plus one line in models/families/registry.cpp.
//
// A descriptor holds
// - its names: the architecture (config.json's architectures[0]) and the family
//   name ferry reports (Model::family());
// - the config.json fields it requires (checked by make_model before the build, so
//   that a missing one is named with the architecture);
// - its fused mappings (SGLang's stacked_params_mapping / expert_params_mapping:
//   which checkpoint names, in slot order, feed one fused param), which the layer
//   builders read their names from;
// - the options it takes beyond the common ones (make_model refuses the others by
//   name, before building);
// - its layout under attention data parallelism (parallel.attn_dp > 1), where SGLang
//   builds one for the family (refused by name where it does not);
// - its post-load hooks, as rules that make them from the built model (make_model
//   registers them, then the quantization's, through TableModel::add_hooks: the one
//   place hooks are registered).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "models/model.hpp"
#include "models/stages.hpp"

namespace ferry::models {

class TableModel;

// Options a family takes beyond the common ones (dtype, strict, unaligned_tp, the
// quantization): bits of FamilyDescriptor::options.
enum FamilyOption : unsigned {
  kTakesExperts = 1u << 0,  // ep > 1, model.eplb_map, switch_w13, pad_moe_intermediate_to
  kTakesDraft = 1u << 1,    // model.draft (an MTP layer)
  kTakesSharedExpertFusion = 1u << 2,  // model.fuse_shared_experts=true
  kTakesMoeDenseTp = 1u << 4,          // parallel.moe_dense_tp 1
  kTakesDeepep = 1u << 5,              // parallel.moe_a2a deepep
  // Its attention's RadixAttention is built without the quant config (SGLang
  // 0.5.23: Qwen3Attention, Qwen3MoeAttention, Glm4MoeAttention), so an FP8 KV
  // cache's k_scale / v_scale have no param: the checkpoint's are dropped
  // ("no_kv_scale_param") as SGLang's load_weights skips them.
  kNoKvCacheScales = 1u << 6,
  // Its untied lm_head is on every pipeline stage (StageEdges::head_on_every_stage).
  kLmHeadOnEveryStage = 1u << 7,
};

// What SGLang 0.5.23 splits over the attention tp group (tp / attn_dp ranks, tp rank
// r holding attention rank r % attn_tp: runtime_context.py, derive_attention_ranks)
// when attention data parallelism is on (--attn-dp-size / --enable-dp-attention).
// Everything not named here keeps its usual group: dense MLPs and shared experts
// over all tp ranks (or whole, where moe_dense_tp / DeepEP say so), routed experts
// over tp / ep.
struct AttentionDpLayout {
  // qkv_proj / o_proj (MLA: q_b_proj or q_proj, kv_b_proj, o_proj) built with
  // parallel_group="attn_tp"; false: over all tp ranks, as without attention DP.
  bool attention = false;
  // embed_tokens a VocabParallelEmbedding(use_attn_tp_group=is_dp_attention_enabled())
  // (or get_embedding_tp_kwargs); false: over all tp ranks.
  bool embedding = false;
  // lm_head a ParallelLMHead(use_attn_tp_group=enable_dp_lm_head): takes
  // parallel.dp_lm_head (refused by name otherwise).
  bool dp_lm_head = false;
};

// One fused param and the checkpoint names that feed it, in slot order: e.g.
// "qkv_proj" <- q_proj, k_proj, v_proj; "experts.w13_weight" <- w1, w3 (Mixtral).
struct FusedMapping {
  std::string param;
  std::vector<std::string> sources;
};

struct FamilyDescriptor;

// What a family's build gets: config.json, the normalized layout, the param dtype
// and the options (quantization resolved by make_model).
struct FamilyInput {
  const nlohmann::json& config;
  const FamilyDescriptor& descriptor;
  const ParallelLayout& layout;
  DType dtype;
  const ModelOptions& options;
};

// Makes a family's post-load hooks from its built model (every local rank).
using HookRule = std::function<std::vector<PostLoadHook>(const Model& model, const FamilyInput& in)>;

struct FamilyDescriptor {
  std::string architecture;                   // "LlamaForCausalLM"
  std::string family;                         // "llama"
  std::vector<std::string> required_fields;   // config.json fields it cannot do without
  std::vector<FusedMapping> fused;            // its fused params
  unsigned options = 0;                       // FamilyOption bits
  // Its layout under attention data parallelism; none: parallel.attn_dp > 1 refused
  // (SGLang's model for it builds nothing for attention DP).
  std::optional<AttentionDpLayout> attention_dp;
  // Declares the params, targets, fills and drops and calls finish().
  std::function<std::unique_ptr<TableModel>(const FamilyInput& in)> build;
  std::vector<HookRule> hooks;

  // The sources of fused param `param` (Error(Stage::kPlacement), internal, when the
  // descriptor has no such mapping).
  const std::vector<std::string>& sources(std::string_view param) const;
  bool takes(FamilyOption option) const { return (options & option) != 0; }
};

// The groups a family's build splits over under `in.layout` (each a group size; tp
// rank r holds group rank r % size): the attention's (attn_tp() where the family's
// attention_dp splits it, else tp), and the embedding's and lm_head's for
// StageEdges (0: every tp rank).
int attention_group(const FamilyInput& in);
int embedding_group(const FamilyInput& in);
int lm_head_group(const FamilyInput& in);

// The pipeline edges of a decoder of `hidden` x `vocab` as the family builds them
// under `in`: embedding and lm_head groups as above, lm_head on every stage where the
// descriptor says so (kLmHeadOnEveryStage).
StageEdges stage_edges(const FamilyInput& in, std::uint64_t hidden, std::uint64_t vocab,
                       bool tie_embeddings);

// Sets the model's quantization (TableModel::set_quantization) as the family takes
// it: without KV-cache scales, and their tensors dropped, for kNoKvCacheScales.
void set_family_quantization(TableModel& m, const FamilyInput& in, QuantScheme quant);

// The mappings most decoders share: qkv_proj <- q/k/v_proj, gate_up_proj <-
// gate/up_proj, experts.w13_weight <- gate/up_proj, experts.w2_weight <- down_proj.
std::vector<FusedMapping> standard_fused_mappings();

// Every descriptor (models/families/registry.cpp), and the one for an
// architecture (null when none).
const std::vector<FamilyDescriptor>& family_descriptors();
const FamilyDescriptor* find_family(std::string_view architecture);

}  // namespace ferry::models
