// The placement building blocks on their own: ranges of each rule and the
// block-to-piece arithmetic, including the errors for splits that do not divide.
#include "models/placement.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/error.hpp"

namespace ferry::models {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Placement, EvenShardSplitsAndRefusesRemainders) {
  EXPECT_EQ(even_shard(12, 0, 4, "x"), (Range{0, 3}));
  EXPECT_EQ(even_shard(12, 3, 4, "x"), (Range{9, 3}));
  EXPECT_THAT(error_of([] { even_shard(28, 0, 8, "num_attention_heads"); }),
              HasSubstr("num_attention_heads (28) is not divisible by tensor parallel size 8"));
  EXPECT_THAT(error_of([] { even_shard(8, 4, 4, "x"); }), HasSubstr("does not exist"));
  EXPECT_THAT(error_of([] { even_shard(8, 0, 0, "x"); }), HasSubstr("does not exist"));
}

TEST(Placement, KvHeadsAreSplitOrReplicated) {
  QkvShape s{8, 2, 16};
  // tp 2: one kv head each.
  EXPECT_EQ(kv_heads_of_rank(s, 0, 2), (Range{0, 1}));
  EXPECT_EQ(kv_heads_of_rank(s, 1, 2), (Range{1, 1}));
  // tp 8, 2 kv heads: ranks 0-3 hold head 0, ranks 4-7 head 1.
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(kv_heads_of_rank(s, r, 8), (Range{static_cast<std::uint64_t>(r / 4), 1})) << r;
  }
  QkvShape wide{32, 8, 128};
  EXPECT_EQ(kv_heads_of_rank(wide, 1, 2), (Range{4, 4}));
  EXPECT_EQ(qkv_local_rows(wide, 2, Unaligned::kRefuse), (16u + 8u) * 128u);
  EXPECT_EQ(qkv_local_rows(s, 8, Unaligned::kRefuse), (1u + 2u) * 16u);
}

TEST(Placement, CheckQkvRefusesHeadsThatMakeNoAttention) {
  EXPECT_THAT(error_of([] {
                check_qkv({12, 5, 64}, 1);
              }),
              HasSubstr("num_attention_heads (12) is not a multiple of num_key_value_heads (5)"));
  EXPECT_THAT(error_of([] { check_qkv({8, 0, 16}, 2); }), HasSubstr("> 0"));
  EXPECT_THAT(error_of([] { check_qkv({8, 2, 16}, 0); }), HasSubstr("does not exist"));
  EXPECT_NO_THROW(check_qkv({8, 2, 16}, 8));
  // Whether tp splits them is padded_qkv's question.
  EXPECT_NO_THROW(check_qkv({28, 4, 128}, 8));
}

// Under refuse, exactly what SGLang's GPU path accepts (LlamaAttention.__init__ and
// QKVParallelLinear in python/sglang/srt/models/llama.py (SGLang 0.5.23) and
// layers/linear.py (SGLang 0.5.23)): q heads % tp == 0, and kv heads split
// (kv % tp == 0) or replicated (tp % kv == 0).
TEST(Placement, RefuseKeepsWhatTheGpuAcceptsAndNamesTheFieldAndTheOption) {
  EXPECT_EQ(padded_qkv({32, 8, 128}, 8, Unaligned::kRefuse), (QkvShape{32, 8, 128}));
  EXPECT_EQ(padded_qkv({8, 2, 16}, 8, Unaligned::kRefuse), (QkvShape{8, 2, 16}));  // replicated
  EXPECT_EQ(padded_qkv({12, 2, 64}, 4, Unaligned::kRefuse), (QkvShape{12, 2, 64}));
  EXPECT_THAT(error_of([] {
                padded_qkv({28, 4, 128}, 8, Unaligned::kRefuse);
              }),
              AllOf(HasSubstr("num_attention_heads (28)"), HasSubstr("tensor parallel size 8"),
                    HasSubstr("model.unaligned_tp=pad")));
  EXPECT_THAT(error_of([] {
                padded_qkv({12, 6, 64}, 4, Unaligned::kRefuse);
              }),
              AllOf(HasSubstr("num_key_value_heads (6"), HasSubstr("model.unaligned_tp")));
  EXPECT_EQ(padded_intermediate(14336, 8, Unaligned::kRefuse, "intermediate_size"), 14336u);
  EXPECT_EQ(padded_intermediate(1408, 8, Unaligned::kRefuse, "moe_intermediate_size"), 1408u);
  EXPECT_THAT(
      error_of([] { padded_intermediate(14336, 6, Unaligned::kRefuse, "intermediate_size"); }),
      AllOf(HasSubstr("intermediate_size (14336)"), HasSubstr("model.unaligned_tp")));
  EXPECT_EQ(padded_heads(128, 8, Unaligned::kRefuse, "num_attention_heads"), 128u);
  EXPECT_THAT(error_of([] { padded_heads(20, 8, Unaligned::kRefuse, "num_attention_heads"); }),
              HasSubstr("num_attention_heads (20)"));
}

// Under pad, SGLang's CPU rule (adjust_config_with_unaligned_cpu_tp and
// update_intermediate_size, python/sglang/srt/configs/update_config.py in
// SGLang 0.5.23): when q or kv heads are not a multiple
// of tp, kv heads are rounded up to one and q heads follow; an intermediate size
// not a multiple of tp * 32 is rounded up to one. Worked by hand from that code.
TEST(Placement, PadFollowsSglangsCpuTriggersAndSizes) {
  EXPECT_EQ(padded_qkv({32, 8, 128}, 8, Unaligned::kPad), (QkvShape{32, 8, 128}));
  // Qwen2.5-7B at tp 8: 28 q / 4 kv -> 56 / 8; at tp 3 -> 42 / 6.
  EXPECT_EQ(padded_qkv({28, 4, 128}, 8, Unaligned::kPad), (QkvShape{56, 8, 128}));
  EXPECT_EQ(padded_qkv({28, 4, 128}, 3, Unaligned::kPad), (QkvShape{42, 6, 128}));
  // 12 q / 2 kv at tp 4: the GPU would replicate kv; the CPU rule pads to 24 / 4.
  EXPECT_EQ(padded_qkv({12, 2, 64}, 4, Unaligned::kPad), (QkvShape{24, 4, 64}));
  EXPECT_EQ(padded_qkv({8, 2, 16}, 8, Unaligned::kPad), (QkvShape{32, 8, 16}));
  EXPECT_EQ(padded_qkv({12, 6, 64}, 4, Unaligned::kPad), (QkvShape{16, 8, 64}));
  EXPECT_EQ(qkv_local_rows({28, 4, 128}, 8, Unaligned::kPad), (7u + 2u) * 128u);
  // Qwen2.5-7B's 18944 is 74 * 256: unchanged at tp 8, 19008 at tp 3 (a multiple of 96).
  EXPECT_EQ(padded_intermediate(18944, 8, Unaligned::kPad, "intermediate_size"), 18944u);
  EXPECT_EQ(padded_intermediate(18944, 3, Unaligned::kPad, "intermediate_size"), 19008u);
  // DeepSeek-V2-Lite's moe_intermediate_size 1408 at tp 8: tp divides it, but it is
  // not a multiple of 256, so 1536.
  EXPECT_EQ(padded_intermediate(1408, 8, Unaligned::kPad, "moe_intermediate_size"), 1536u);
  EXPECT_EQ(padded_intermediate(14336, 6, Unaligned::kPad, "intermediate_size"), 14400u);
  EXPECT_EQ(padded_intermediate(7, 1, Unaligned::kPad, "intermediate_size"), 32u);
  EXPECT_THAT(error_of([] { padded_intermediate(64, 0, Unaligned::kPad, "x"); }),
              HasSubstr("does not exist"));
  EXPECT_EQ(padded_heads(20, 8, Unaligned::kPad, "num_attention_heads"), 24u);
}

TEST(Placement, PaddedQkvSlotsCopyRealHeadsAndZeroTheRest) {
  // 6 q / 2 kv heads, head_dim 4, tp 4: padded to 12 q / 4 kv; each rank 3 q heads
  // and 1 kv head (rows: q 0..11, k 12..15, v 16..19).
  const QkvShape s{6, 2, 4};
  // Rank 1: q heads 3..5, kv head 1 -- all real.
  PaddedShard q1 = qkv_slot(s, QkvSlot::kQ, 1, 4, Unaligned::kPad);
  EXPECT_EQ(q1.copy.src_start, 12u);
  EXPECT_EQ(q1.copy.length, 12u);
  EXPECT_EQ(q1.zero.length, 0u);
  PaddedShard v1 = qkv_slot(s, QkvSlot::kV, 1, 4, Unaligned::kPad);
  EXPECT_EQ(v1.copy.src_start, 4u);
  EXPECT_EQ(v1.copy.dst_start, 16u);
  EXPECT_EQ(v1.copy.length, 4u);
  // Rank 2: q heads 6..8 and kv head 2 -- all padding.
  for (QkvSlot slot : {QkvSlot::kQ, QkvSlot::kK, QkvSlot::kV}) {
    PaddedShard p = qkv_slot(s, slot, 2, 4, Unaligned::kPad);
    EXPECT_EQ(p.copy.length, 0u);
    EXPECT_EQ(p.zero.kind, Block::Kind::kZero);
  }
  PaddedShard k2 = qkv_slot(s, QkvSlot::kK, 2, 4, Unaligned::kPad);
  EXPECT_EQ(k2.zero.dst_start, 12u);
  EXPECT_EQ(k2.zero.length, 4u);
  // 5 q / 5 kv heads at tp 2 (padded to 6 / 6): rank 1 holds q heads 3, 4 and a
  // zero head 5 in each slot.
  PaddedShard q = qkv_slot({5, 5, 2}, QkvSlot::kQ, 1, 2, Unaligned::kPad);
  EXPECT_EQ(q.copy.src_start, 6u);
  EXPECT_EQ(q.copy.length, 4u);
  EXPECT_EQ(q.zero.dst_start, 4u);
  EXPECT_EQ(q.zero.length, 2u);
  PaddedShard v = qkv_slot({5, 5, 2}, QkvSlot::kV, 1, 2, Unaligned::kPad);
  EXPECT_EQ(v.copy.dst_start, 12u);
  EXPECT_EQ(v.zero.dst_start, 16u);
  EXPECT_EQ(v.zero.length, 2u);
}

TEST(Placement, QkvSlotsFollowEachOther) {
  QkvShape s{8, 2, 16};
  // tp 2 rank 1: q heads 4..7 (rows 64..127) at 0, k head 1 (rows 16..31) at 64,
  // v head 1 at 80.
  Block q = qkv_slot(s, QkvSlot::kQ, 1, 2, Unaligned::kRefuse).copy;
  Block k = qkv_slot(s, QkvSlot::kK, 1, 2, Unaligned::kRefuse).copy;
  Block v = qkv_slot(s, QkvSlot::kV, 1, 2, Unaligned::kRefuse).copy;
  EXPECT_EQ(qkv_slot(s, QkvSlot::kQ, 1, 2, Unaligned::kRefuse).zero.length, 0u);
  EXPECT_EQ(q.src_start, 64u);
  EXPECT_EQ(q.dst_start, 0u);
  EXPECT_EQ(q.length, 64u);
  EXPECT_EQ(k.src_start, 16u);
  EXPECT_EQ(k.dst_start, 64u);
  EXPECT_EQ(k.length, 16u);
  EXPECT_EQ(v.src_start, 16u);
  EXPECT_EQ(v.dst_start, 80u);
  EXPECT_EQ(v.length, 16u);
}

TEST(Placement, VocabParallelPadsTheTailWithZeros) {
  EXPECT_EQ(padded_vocab(1000), 1024u);
  EXPECT_EQ(padded_vocab(128256), 128256u);
  // tp 8: 128 rows each; rank 7 holds 896..1023 of which 896..999 are real.
  PaddedShard last = vocab_parallel(1000, 7, 8);
  EXPECT_EQ(last.copy.src_start, 896u);
  EXPECT_EQ(last.copy.length, 104u);
  EXPECT_EQ(last.zero.kind, Block::Kind::kZero);
  EXPECT_EQ(last.zero.dst_start, 104u);
  EXPECT_EQ(last.zero.length, 24u);
  PaddedShard first = vocab_parallel(1000, 0, 8);
  EXPECT_EQ(first.copy.length, 128u);
  EXPECT_EQ(first.zero.length, 0u);
  // A part entirely in the padding copies nothing.
  PaddedShard empty = padded_shard(0, 65, 128, 5, 8, "vocab");
  EXPECT_EQ(empty.copy.length, 0u);
  EXPECT_EQ(empty.zero.dst_start, 0u);
  EXPECT_EQ(empty.zero.length, 16u);
  EXPECT_THAT(error_of([] { padded_shard(0, 10, 8, 0, 2, "x"); }), HasSubstr("smaller"));
  EXPECT_THAT(error_of([] { vocab_parallel(1000, 0, 3); }), HasSubstr("not divisible"));
}

TEST(Placement, RowSliceIsOneContiguousPiece) {
  // Rows 64..127 of a [128, 32] BF16 tensor into rows 0..63 of a [96, 32] F32 param.
  Block b{Block::Kind::kCopy, 0, {}, {}, 64, 0, 64};
  Piece p = block_to_piece(b, {128, 32}, DType::kBF16, {96, 32}, DType::kF32, "w");
  EXPECT_EQ(p.rows, 1u);
  EXPECT_EQ(p.width_elems, 64u * 32u);
  EXPECT_EQ(p.src_offset, 64u * 32u * 2u);
  EXPECT_EQ(p.dst_offset, 0u);
  EXPECT_EQ(p.src_pitch, 64u * 32u * 2u);
  EXPECT_EQ(p.dst_pitch, 64u * 32u * 4u);
  EXPECT_EQ(p.src_end(), 128u * 32u * 2u);
  EXPECT_EQ(p.dst_bytes(), 64u * 32u * 4u);
}

TEST(Placement, ColumnSliceIsAPitchedPiece) {
  // Columns 8..15 of a [4, 16] tensor into a [4, 8] param.
  Block b = padded_shard(1, 16, 16, 1, 2, "o_proj").copy;
  Piece p = block_to_piece(b, {4, 16}, DType::kBF16, {4, 8}, DType::kBF16, "o");
  EXPECT_EQ(p.rows, 4u);
  EXPECT_EQ(p.width_elems, 8u);
  EXPECT_EQ(p.src_offset, 16u);
  EXPECT_EQ(p.src_pitch, 32u);
  EXPECT_EQ(p.dst_offset, 0u);
  EXPECT_EQ(p.dst_pitch, 16u);
  EXPECT_EQ(p.src_end(), 3u * 32u + 16u + 16u);
}

TEST(Placement, FixedLeadingIndicesSelectASubArray) {
  // Expert 2's rows 4..7 of a [4, 8, 3] tensor into slot 1 rows 0..3 of a [2, 4, 3]
  // param: what stacked expert params will need.
  Block b{Block::Kind::kCopy, 0, {2}, {1}, 4, 0, 4};
  Piece p = block_to_piece(b, {4, 8, 3}, DType::kF32, {2, 4, 3}, DType::kF32, "w13");
  EXPECT_EQ(p.rows, 1u);
  EXPECT_EQ(p.width_elems, 12u);
  EXPECT_EQ(p.src_offset, (2u * 24u + 4u * 3u) * 4u);
  EXPECT_EQ(p.dst_offset, (1u * 12u) * 4u);
}

TEST(Placement, ZeroBlockHasNoSource) {
  Block z{Block::Kind::kZero, 0, {}, {}, 0, 104, 24};
  Piece p = block_to_piece(z, {128, 16}, DType::kBF16, {128, 16}, DType::kBF16, "embed");
  EXPECT_EQ(p.kind, Piece::Kind::kZero);
  EXPECT_EQ(p.dst_offset, 104u * 16u * 2u);
  EXPECT_EQ(p.width_elems, 24u * 16u);
  EXPECT_EQ(p.src_offset, 0u);
  EXPECT_EQ(p.src_end(), 0u);
}

TEST(Placement, BlocksOutsideTheirArraysAreRefused) {
  Block b{Block::Kind::kCopy, 0, {}, {}, 100, 0, 64};
  EXPECT_THAT(error_of([&] {
                block_to_piece(b, {128, 32}, DType::kBF16, {64, 32}, DType::kBF16, "w");
              }),
              HasSubstr("exceeds"));
  Block wide{Block::Kind::kCopy, 0, {}, {}, 0, 0, 4};
  EXPECT_THAT(error_of([&] {
                block_to_piece(wide, {4, 32}, DType::kBF16, {4, 16}, DType::kBF16, "w");
              }),
              HasSubstr("differ on axis 1"));
  Block axis{Block::Kind::kCopy, 2, {}, {}, 0, 0, 1};
  EXPECT_THAT(error_of([&] {
                block_to_piece(axis, {4, 4}, DType::kBF16, {4, 4}, DType::kBF16, "w");
              }),
              HasSubstr("axis 2"));
  Block index{Block::Kind::kCopy, 0, {5}, {}, 0, 0, 1};
  EXPECT_THAT(error_of([&] {
                block_to_piece(index, {4, 4}, DType::kBF16, {4}, DType::kBF16, "w");
              }),
              HasSubstr("outside dim 0"));
}

TEST(Placement, StridesAreRowMajor) {
  EXPECT_EQ(contiguous_strides({2, 3, 4}), (std::vector<std::uint64_t>{12, 4, 1}));
  EXPECT_EQ(contiguous_strides({}), (std::vector<std::uint64_t>{}));
  EXPECT_EQ(element_count({2, 3, 4}), 24u);
  EXPECT_EQ(round_up(1000, 64), 1024u);
  EXPECT_EQ(round_up(1024, 64), 1024u);
}

}  // namespace
}  // namespace ferry::models
