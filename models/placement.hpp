// Placement rules: small pure functions that say which part of a checkpoint tensor
// one tensor-parallel rank keeps and where it lands in the rank's param. Families
// compose them (models/dense.cpp); rules follow SGLang's parameter weight loaders
// (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
// VocabParallelEmbedding, replicated default_weight_loader).
//
// Everything is expressed as Blocks: "along `axis`, copy `length` slices starting
// at src_start of the tensor to dst_start of the param" (or zero them). A block of a
// row-major array narrowed on one axis is a 2-D copy, so every block becomes exactly
// one Piece (block_to_piece).
//
// How the next families are meant to use the same pieces (TableModel carries them):
// - experts (w13 / w2 stacked over local experts, EP): a Block with dst_index
//   {local expert} and the rank's share of that expert's gate/up rows or down
//   columns; an expert no local rank owns yields no blocks and the target's
//   empty_reason "remote_expert" drops it unread; EPLB replicas are several blocks
//   (one per local physical slot) from the same tensor.
// - fused checkpoint tensors (w13 stored stacked, MLA kv_b_proj): src_index picks
//   the expert, and one tensor may feed several params (several targets).
// - pipeline stages: tensors of other stages' layers are drop names ("pp_stage").
// - padding and uneven TP: padded_shard (a copy block and a zero fill), padded_qkv
//   and padded_intermediate; shapes may differ per rank (TableModel::ShapeRule
//   takes the tp rank).
// - post-load hooks: models/model.hpp PostLoadHook, registered on TableModel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "common/dtype.hpp"
#include "models/model.hpp"

namespace ferry::models {

// A half-open interval [begin, begin + length) along one axis.
struct Range {
  std::uint64_t begin = 0;
  std::uint64_t length = 0;
  std::uint64_t end() const { return begin + length; }
  bool operator==(const Range&) const = default;
};

struct Block {
  enum class Kind { kCopy, kZero };
  Kind kind = Kind::kCopy;
  // The axis narrowed, counted after the fixed leading indices below.
  std::size_t axis = 0;
  // Fixed leading indices: the block lives in tensor[src_index...] and
  // param[dst_index...] (e.g. one expert of a stacked expert param). Empty for
  // dense families.
  std::vector<std::uint64_t> src_index;
  std::vector<std::uint64_t> dst_index;
  std::uint64_t src_start = 0;  // ignored for kZero
  std::uint64_t dst_start = 0;
  std::uint64_t length = 0;  // 0: nothing to do (the block makes no piece)

  bool operator==(const Block&) const = default;
};

inline constexpr std::uint64_t kVocabPadding = 64;  // SGLang's DEFAULT_VOCAB_PADDING_SIZE

std::uint64_t round_up(std::uint64_t value, std::uint64_t multiple);

// Part `index` of `total` split evenly into `parts`. Throws Error(Stage::kPlacement)
// when `total` is not divisible by `parts`; `what` names the dimension in the
// message ("num_attention_heads (28) is not divisible by tensor parallel size 8").
Range even_shard(std::uint64_t total, int index, int parts, std::string_view what);

// ---- pipeline stages -------------------------------------------------------------

// The decoder layers [begin, begin + length) stage `pp_rank` of `pp` holds out of
// `layers`: with an empty `partition`, SGLang's get_pp_indices (every stage L / pp
// layers, and the last L % pp stages one more each: 61 layers at pp 8 are
// 7,7,7,8,8,8,8,8); else, like SGLANG_PP_LAYER_PARTITION, partition[s] layers
// after the earlier stages' (the counts must be pp
// non-negative numbers summing to L). Throws Error(Stage::kConfig) naming the
// mismatch (wrong count, wrong sum, pp_rank outside [0, pp)).
Range pp_layers(std::uint64_t layers, int pp, int pp_rank, const std::vector<int>& partition);

// ---- padded shards --------------------------------------------------------------

// A dim of `real` entries padded with zeros to `padded` and split evenly over
// `parts`: part `index` holds padded entries [index*per, (index+1)*per); those below
// `real` are copied (`copy`), the rest zero-filled (`zero`). Either block may be
// empty (length 0). Throws when `padded` < `real` or is not divisible by `parts`.
struct PaddedShard {
  Block copy;
  Block zero;
};
PaddedShard padded_shard(std::size_t axis, std::uint64_t real, std::uint64_t padded, int index,
                         int parts, std::string_view what);

// ---- uneven tensor parallelism -----------------------------------------------------
//
// Sizes tp does not divide. SGLang on GPU asserts that they divide (its attention
// modules, QKVParallelLinear, MergedColumnParallelLinear, FusedMoE); only on CPU does
// it pad them (adjust_config_with_unaligned_cpu_tp in
// python/sglang/srt/configs/update_config.py, with narrow_padded_param_and_loaded_weight
// at load). ferry refuses by default on every backend (model.unaligned_tp=refuse),
// naming the field and the option; with `pad` it uses exactly SGLang's CPU
// triggers and sizes: every rank gets an even share of the padded size, and the
// share's entries past the real size are zeros (the last ranks'). The policy,
// Unaligned, is declared with ModelOptions (models/model.hpp).

// SGLang's DEFAULT_MOE_PADDING_SIZE: under `pad`, an intermediate size that is not a
// multiple of tp * 32 is rounded up to one.
inline constexpr std::uint64_t kIntermediatePadding = 32;
// kRefuse: `intermediate` when `parts` divides it, else Error(Stage::kPlacement)
// naming `what`. kPad (`parts` is then tp): rounded up to a multiple of
// parts * 32 unless it is one already (SGLang's update_intermediate_size).
std::uint64_t padded_intermediate(std::uint64_t intermediate, int parts, Unaligned policy,
                                  std::string_view what);
// Attention heads without groups (MLA, where every head reads the one shared
// latent): `heads` when tp divides it; else refused, or under kPad rounded up to a
// multiple of tp (SGLang's CPU rule for MLA is not ferry's spec here: see
// docs/ARCHITECTURE.md).
std::uint64_t padded_heads(std::uint64_t heads, int tp, Unaligned policy, std::string_view what);

// ---- QKVParallelLinear -------------------------------------------------------

struct QkvShape {
  std::uint64_t q_heads = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;
  bool operator==(const QkvShape&) const = default;
};

enum class QkvSlot { kQ, kK, kV };

// Throws Error(Stage::kPlacement) when the heads make no attention: a count or
// head_dim of 0, or q_heads not a multiple of kv_heads. Whether tp splits them is
// padded_qkv's question.
void check_qkv(const QkvShape& shape, int tp);
// The heads every rank's share is cut from. kRefuse (SGLang on GPU): `real` itself
// when q_heads % tp == 0 and either kv_heads % tp == 0 (kv heads split) or
// tp % kv_heads == 0 (kv heads replicated), else Error(Stage::kPlacement) naming
// the field and model.unaligned_tp. kPad (SGLang on CPU): `real` when both counts
// are multiples of tp; otherwise (28 q / 4 kv heads at tp 8, and also 12 q / 2 kv
// at tp 4, which the GPU would replicate) the kv heads are padded to a multiple of
// tp and the q heads to padded kv heads * (q_heads / kv_heads), so each rank keeps
// whole GQA groups and the padded heads (the last ranks') are zeros.
QkvShape padded_qkv(const QkvShape& real, int tp, Unaligned policy);
// KV heads rank `rank` holds of an evenly splitting `shape` (padded_qkv's result):
// heads [rank*kv/tp, ...) when kv_heads >= tp, else the single head
// rank / (tp / kv_heads).
Range kv_heads_of_rank(const QkvShape& shape, int rank, int tp);
// Rows of the local qkv param: (q_heads/tp + 2 * local kv heads) * head_dim of the
// padded heads.
std::uint64_t qkv_local_rows(const QkvShape& real, int tp, Unaligned policy);
// Full checkpoint rows of one slot (q: q_heads*head_dim, k/v: kv_heads*head_dim).
std::uint64_t qkv_slot_rows(const QkvShape& real, QkvSlot slot);
// Where the slot's rows of rank `rank` come from and go: q at 0, k after the local
// q rows, v after the local k rows. `copy` holds the real heads of the rank's share
// of padded_qkv(real, tp, policy), `zero` its padded heads (either may be empty).
// Axis 0, so it serves the weight and the bias.
PaddedShard qkv_slot(const QkvShape& real, QkvSlot slot, int rank, int tp, Unaligned policy);

// ---- column / row parallel, replicated ------------------------------------------
//
// Column-parallel (output dim, axis 0), merged column slots and row-parallel
// (input dim, axis 1: a 2-D copy with a pitch, for which the reader needs every
// row of the tensor) shares are padded_shard()s of the possibly padded size;
// models/layers.hpp composes them (gate_up_proj slots, add_row_parallel).

// The whole tensor, as is (norms, biases of row-parallel layers).
Block replicated(std::uint64_t dim0);

// VocabParallelEmbedding / ParallelLMHead: the vocabulary padded to a multiple of
// kVocabPadding, split evenly over tp (axis 0).
std::uint64_t padded_vocab(std::uint64_t vocab);
PaddedShard vocab_parallel(std::uint64_t vocab, int rank, int tp);

// ---- blocks to pieces -----------------------------------------------------------

// Contiguous row-major strides in elements.
std::vector<std::uint64_t> contiguous_strides(const Shape& shape);
std::uint64_t element_count(const Shape& shape);
// True when `strides` address every element of `shape` exactly once within
// element_count(shape) slots: sorted by stride, each dim's stride is the product of
// the sizes of the dims below it (dims of size 1 may have any stride).
bool dense_permutation(const Shape& shape, const std::vector<std::uint64_t>& strides);

// The one piece that performs `block` from a tensor of `src_shape`/`src_dtype` into
// a param of `dst_shape`/`dst_dtype`. The shapes after the fixed indices must agree
// on every axis but `axis`, and the block must lie inside both. A block contiguous
// on both sides becomes a single row. Violations are bugs in a family's rules and
// throw Error(Stage::kPlacement) naming `param_name`. local_rank/param are left 0.
Piece block_to_piece(const Block& block, const Shape& src_shape, DType src_dtype,
                     const Shape& dst_shape, DType dst_dtype, std::string_view param_name);

}  // namespace ferry::models
