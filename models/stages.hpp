// Pipeline-stage rules every decoder family shares: which decoder layers a stage
// keeps, and the model's two edges — embed_tokens on the first stage, the final
// norm and lm_head on the last. Families call these from their factories; the
// drop reasons are the stable codes of `ferry plan` (docs/plan-json.md).
#pragma once

#include <cstdint>
#include <string>

#include "models/placement.hpp"
#include "models/table_model.hpp"

namespace ferry::models {

struct StageEdges {
  std::uint64_t hidden = 0;
  std::uint64_t vocab = 0;  // real vocabulary; params are padded to kVocabPadding
  bool tie_embeddings = false;
  // The embedding is a plain nn.Embedding (Gemma 3): every rank holds all `vocab`
  // rows, unpadded; a tied last stage that is not first does the same for lm_head.
  bool replicated_embedding = false;
  // The groups the embedding and lm_head are split over (tp rank r holds group rank
  // r % size): 0 = every tp rank; under attention data parallelism the family's
  // AttentionDpLayout (models/family.hpp) may split either over the attention tp
  // group (embedding_group / lm_head_group).
  int embed_group = 0;
  int head_group = 0;
  // The family builds its (untied) lm_head on every pipeline stage, not only the
  // last, and loads it there too (SGLang 0.5.23: LlamaForCausalLM,
  // MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM and
  // Glm4MoeForCausalLM make a ParallelLMHead whatever the stage; Qwen2, Qwen3 and
  // DeepSeek a PPMissingLayer off the last).
  bool head_on_every_stage = false;
  std::string embed_name = "model.embed_tokens.weight";
  std::string norm_name = "model.norm.weight";
  std::string head_name = "lm_head.weight";
};

// Declares and targets, for the stage `layout.pp_rank` of `layout.pp`:
// - the first stage: embed_tokens (vocab-parallel: the vocabulary padded to a
//   multiple of kVocabPadding and split evenly over tp, padded rows zero-filled);
//   elsewhere the tensor is dropped with "first_stage_only" — except on a last
//   stage with tied embeddings, which reads it into its own lm_head param;
// - the last stage: the final norm (replicated) and lm_head (vocab-parallel). Tied:
//   a checkpoint's lm_head.weight is never read ("tied_lm_head"); a stage that is
//   first and last keeps no lm_head param (the engine uses embed_tokens), a last
//   stage that is not first declares lm_head.weight and fills it from embed_name.
//   On every other stage the norm and lm_head.weight are dropped "last_stage_only",
//   except that with head_on_every_stage an untied lm_head is held on every stage.
// With pp == 1 this is exactly the single-model layout. Call it once per model,
// before finish(); the param and tensor names come from `edges`.
void add_stage_edges(TableModel& m, const StageEdges& edges, const ParallelLayout& layout);

// Drops every tensor of a decoder layer in [0, num_layers) outside `stage`
// (names containing "model.layers.<i>." — the trailing dot keeps layer 1 from
// matching layer 11 — with reason "pp_stage"). Layers from num_layers up (MTP) are
// the family's business. Drops are checked in the order they were added, so a
// family that calls this before its own pattern drops (rotary caches) reports
// another stage's tensors as "pp_stage".
void add_layer_drops(TableModel& m, std::uint64_t num_layers, Range stage);

}  // namespace ferry::models
