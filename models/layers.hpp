// Layer building blocks several families share (dense.cpp, moe.cpp, deepseek.cpp):
// SGLang's fused attention and MLP params under tensor parallelism, and replicated
// params. Param and checkpoint prefixes are separate because the draft (MTP) model
// renames what it loads ("model.layers.61.self_attn." -> "model.decoder.self_attn.").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/hf_config.hpp"
#include "models/model.hpp"
#include "models/table_model.hpp"

namespace ferry::models {

// "model.layers.<layer>.": where decoder layer `layer`'s tensors and params live.
std::string layer_prefix(std::uint64_t layer);

struct GqaAttention {
  std::uint64_t hidden = 0;
  std::uint64_t heads = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;
  bool qkv_bias = false;  // q/k/v biases, placed like their weights' qkv slots
  bool o_bias = false;    // o_proj bias: replicated (a row-parallel layer's bias is whole)
  Unaligned unaligned = Unaligned::kRefuse;  // heads tp does not split: model.unaligned_tp
  // The checkpoint names of the q, k and v slots (FamilyDescriptor::sources("qkv_proj")).
  std::vector<std::string> sources{"q_proj", "k_proj", "v_proj"};
  // The ranks the attention is split over, in notes: "tp ranks", or "attention tp
  // ranks" under attention data parallelism.
  std::string ranks = "tp ranks";
};

// <param_prefix>qkv_proj.weight (and .bias): q, k and v slots of this rank (GQA
// replication rule in placement.hpp) from <tensor_prefix>{q,k,v}_proj, or from a
// checkpoint that stores <tensor_prefix>qkv_proj already fused (Phi-3): split into
// its q, k and v rows by the head counts, as SGLang's QKVParallelLinear.weight_loader
// does when it gets no shard id; and
// <param_prefix>o_proj.weight, row-parallel, from <tensor_prefix>o_proj. Heads tp
// does not split are refused, or padded (padded_qkv, `a.unaligned`): the padded
// heads' qkv rows and o_proj columns are zero fills. The caller checks the heads first (check_qkv)
// so the error names the config fields. `tp` is the size of the group the attention
// is split over: tp rank r holds group rank r % tp (all tp ranks, or the attention tp
// group under attention data parallelism).
void add_gqa_attention(TableModel& m, const std::string& param_prefix,
                       const std::string& tensor_prefix, const GqaAttention& a, int tp);
// The attention of a family whose config has the common GQA decoder fields.
GqaAttention gqa_attention(const GqaDecoderDims& d, bool qkv_bias, bool o_bias,
                           Unaligned unaligned);

// <param_prefix>gate_up_proj.weight (this rank's gate rows, then its up rows) from
// <tensor_prefix>{gate,up}_proj (`sources`), or from a checkpoint's fused
// <tensor_prefix>gate_up_proj (gate rows, then up rows: MergedColumnParallelLinear
// without a shard id), and <param_prefix>down_proj row-parallel (no
// biases: SGLang's gated MLPs have none). An intermediate size tp does not divide is
// refused; under Unaligned::kPad one SGLang's CPU rule pads (padded_intermediate)
// ends each rank's share in zero rows of gate and up and zero columns of down.
// `what` names the config field in messages. `tp` is the size of the group the MLP
// is split over: tp rank r holds group rank r % tp (all tp ranks, or 1: whole on
// every rank, as SGLang's DeepSeek builds its dense layers under moe_dense_tp_size 1
// and its shared experts under DeepEP).
void add_gated_mlp(TableModel& m, const std::string& param_prefix, const std::string& tensor_prefix,
                   std::uint64_t hidden, std::uint64_t intermediate, int tp, Unaligned policy,
                   const char* what,
                   const std::vector<std::string>& sources = {"gate_proj", "up_proj"});

// The operator's note (Model::notes) for a size `parts` ranks do not split: `what`
// names it ("intermediate_size 100"), `padded_text` its padded form, `unit` what
// the zeros are ("heads", "rows"), `ranks` the kind of rank ("tp ranks"); the
// ranks whose whole share is padding are named.
std::string uneven_note(const std::string& what, const std::string& unit, std::uint64_t padded,
                        std::uint64_t real, int parts, const std::string& padded_text,
                        const std::string& ranks);

// RowParallelLinear of a [rows, input] tensor into `param` (declared by the caller
// as [rows, padded_input / tp]): tp rank r's share (group rank r % tp) of the input
// dim; with
// padded_input > input the columns past the real input are zero fills.
void add_row_parallel(TableModel& m, const std::string& tensor, const std::string& param,
                      std::uint64_t rows, std::uint64_t input, std::uint64_t padded_input, int tp,
                      const std::string& what);

// Drops the rotary caches older checkpoints saved (the engine computes them):
// rotary_emb.inv_freq ("inv_freq"), rotary_emb.cos_cached / sin_cached
// ("rope_cache", ColossalAI-trained models; SGLang skips them too).
void add_rope_cache_drops(TableModel& m);

// A param every rank holds whole, filled from `tensor` of the same shape; of the
// model's dtype unless `dtype` says otherwise.
void add_replicated(TableModel& m, const std::string& param, const std::string& tensor,
                    const Shape& shape, std::optional<DType> dtype = {});

}  // namespace ferry::models
