// Routes of single tensors: drops with their reasons, unmapped names (and strict
// mode), shape and dtype mismatches, the byte ranges the reader must fetch, and
// the tensor-independent fill pieces.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "common/error.hpp"
#include "models/model.hpp"
#include "models/reference_util.hpp"

namespace ferry::testing {
namespace {

using models::Piece;
using models::Route;
using models::RouteKind;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::unique_ptr<models::Model> tiny_model(const std::string& family, int tp,
                                          std::vector<int> local = {}, bool tied = false,
                                          bool strict = false) {
  SynthCase ck = tiny_case(family, DType::kBF16, tied);
  models::ParallelLayout layout;
  layout.tp = tp;
  layout.local_ranks = std::move(local);
  models::ModelOptions options;
  options.strict = strict;
  return models::make_model(ck.config, layout, options);
}

// Tiny llama: hidden 128, 8 heads, 2 kv heads, head_dim 16, intermediate 256,
// vocab 1000, 4 layers; BF16 (2 bytes).
constexpr std::uint64_t kHidden = 128;
constexpr std::uint64_t kRow = kHidden * 2;  // bytes per checkpoint row

Route route_of(const models::Model& m, const std::string& name, std::vector<std::uint64_t> shape,
               DType dtype = DType::kBF16) {
  return m.route(tensor_info(name, dtype, shape));
}

TEST(Routes, RotaryInvFreqIsDroppedUnread) {
  auto m = tiny_model("llama", 2);
  Route r = route_of(*m, "model.layers.0.self_attn.rotary_emb.inv_freq", {8}, DType::kF32);
  EXPECT_EQ(r.kind, RouteKind::kDropped);
  EXPECT_EQ(r.reason, "inv_freq");
  EXPECT_TRUE(r.pieces.empty());
  EXPECT_EQ(r.src_begin, r.src_end);
  Route cos = route_of(*m, "model.layers.3.self_attn.rotary_emb.cos_cached", {4, 8});
  EXPECT_EQ(cos.kind, RouteKind::kDropped);
  EXPECT_EQ(cos.reason, "rope_cache");
}

TEST(Routes, TiedLmHeadIsDroppedAndHasNoParam) {
  auto tied = tiny_model("llama", 2, {}, /*tied=*/true);
  Route r = route_of(*tied, "lm_head.weight", {1000, kHidden});
  EXPECT_EQ(r.kind, RouteKind::kDropped);
  EXPECT_EQ(r.reason, "tied_lm_head");
  for (const auto& shell : tied->shells()) {
    EXPECT_EQ(shell.by_name.count("lm_head.weight"), 0u);
    EXPECT_EQ(shell.by_name.count("model.embed_tokens.weight"), 1u);
  }
  auto untied = tiny_model("llama", 2);
  EXPECT_EQ(route_of(*untied, "lm_head.weight", {1000, kHidden}).kind, RouteKind::kPlaced);
}

TEST(Routes, UnknownNamesAreUnmappedOrStrictErrors) {
  auto m = tiny_model("qwen2", 2);
  for (const std::string name : {"model.layers.4.self_attn.q_proj.weight",  // past the last layer
                                 "model.vision_tower.proj.weight", "lm_head.bias",
                                 "model.layers.0.self_attn.o_proj.bias"}) {  // qwen2 has none
    Route r = route_of(*m, name, {4});
    EXPECT_EQ(r.kind, RouteKind::kUnmapped) << name;
    EXPECT_EQ(r.reason, "unknown_name") << name;
    EXPECT_TRUE(r.pieces.empty());
  }
  auto strict = tiny_model("qwen2", 2, {}, false, /*strict=*/true);
  try {
    route_of(*strict, "model.vision_tower.proj.weight", {4});
    FAIL() << "strict mode accepted an unknown name";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kMapping);
    EXPECT_EQ(e.tensor(), "model.vision_tower.proj.weight");
    EXPECT_EQ(e.file(), "model-00001-of-00001.safetensors");
    EXPECT_THAT(e.what(), HasSubstr("Qwen2ForCausalLM"));
  }
  // Strict mode still drops what is known to be dropped.
  EXPECT_EQ(route_of(*strict, "model.layers.0.self_attn.rotary_emb.inv_freq", {8}).kind,
            RouteKind::kDropped);
}

TEST(Routes, ShapeMismatchNamesTensorAndParam) {
  auto m = tiny_model("llama", 2);
  try {
    route_of(*m, "model.layers.0.self_attn.q_proj.weight", {130, kHidden});
    FAIL() << "a wrong shape was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kPlacement);
    EXPECT_EQ(e.tensor(), "model.layers.0.self_attn.q_proj.weight");
    // Local qkv rows at tp 2: (4 + 1 + 1) heads * 16 = 96.
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("Attempted to load weight model.layers.0.self_attn.q_proj.weight "
                                "[130, 128] into parameter "
                                "model.layers.0.self_attn.qkv_proj.weight [96, 128]"),
                      HasSubstr("must be [128, 128]")));
  }
  // A 1-D norm given as 2-D, and a bias of the wrong length.
  EXPECT_THROW(route_of(*m, "model.norm.weight", {1, kHidden}), Error);
  auto q = tiny_model("qwen2", 1);
  EXPECT_THROW(route_of(*q, "model.layers.1.self_attn.k_proj.bias", {31}), Error);
}

TEST(Routes, DtypesThatCannotCastAreRefused) {
  auto m = tiny_model("llama", 1);
  try {
    route_of(*m, "model.norm.weight", {kHidden}, DType::kI32);
    FAIL() << "an I32 tensor was accepted into a BF16 param";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kPlacement);
    EXPECT_THAT(e.what(), AllOf(HasSubstr("I32"), HasSubstr("BF16"), HasSubstr("model.norm")));
  }
  EXPECT_EQ(route_of(*m, "model.norm.weight", {kHidden}, DType::kF32).kind, RouteKind::kPlaced);
  EXPECT_EQ(route_of(*m, "model.norm.weight", {kHidden}, DType::kF16).kind, RouteKind::kPlaced);
}

TEST(Routes, TensorInfoTooShortForItsShapeIsRefused) {
  auto m = tiny_model("llama", 1);
  io::TensorInfo t = tensor_info("model.norm.weight", DType::kBF16, {kHidden});
  t.nbytes -= 2;
  EXPECT_THROW(m->route(t), Error);
}

TEST(Routes, RowSlicesReadOnlyTheRanksRows) {
  // One local rank (tp 2, rank 1): q rows 64..127 of q_proj, nothing else.
  auto m = tiny_model("llama", 2, {1});
  Route q = route_of(*m, "model.layers.0.self_attn.q_proj.weight", {128, kHidden});
  ASSERT_EQ(q.pieces.size(), 1u);
  EXPECT_EQ(q.src_begin, 64 * kRow);
  EXPECT_EQ(q.src_end, 128 * kRow);
  EXPECT_EQ(q.pieces[0].rows, 1u);
  // k_proj has 2 kv heads (32 rows): rank 1 holds head 1, rows 16..31.
  Route k = route_of(*m, "model.layers.0.self_attn.k_proj.weight", {32, kHidden});
  EXPECT_EQ(k.src_begin, 16 * kRow);
  EXPECT_EQ(k.src_end, 32 * kRow);
  // gate: intermediate 256, rank 1 holds rows 128..255.
  Route gate = route_of(*m, "model.layers.0.mlp.gate_proj.weight", {256, kHidden});
  EXPECT_EQ(gate.src_begin, 128 * kRow);
  EXPECT_EQ(gate.src_end, 256 * kRow);
  // Replicated norms read everything.
  Route norm = route_of(*m, "model.norm.weight", {kHidden});
  EXPECT_EQ(norm.src_begin, 0u);
  EXPECT_EQ(norm.src_end, kHidden * 2);
}

TEST(Routes, KvReplicationReadsOneHead) {
  // tp 8 with 2 kv heads: rank 5 holds head 1 = rows 16..31.
  auto m = tiny_model("llama", 8, {5});
  Route v = route_of(*m, "model.layers.2.self_attn.v_proj.weight", {32, kHidden});
  EXPECT_EQ(v.src_begin, 16 * kRow);
  EXPECT_EQ(v.src_end, 32 * kRow);
}

TEST(Routes, ColumnSlicesReadEveryRow) {
  // o_proj [128, 128] at tp 2, rank 0: columns 0..63 of every row, so the range
  // runs from the first row to the end of the last row's slice.
  auto m = tiny_model("llama", 2, {0});
  Route o = route_of(*m, "model.layers.0.self_attn.o_proj.weight", {kHidden, 128});
  ASSERT_EQ(o.pieces.size(), 1u);
  const Piece& p = o.pieces[0];
  EXPECT_EQ(p.rows, kHidden);
  EXPECT_EQ(p.width_elems, 64u);
  EXPECT_EQ(p.src_pitch, 128u * 2u);
  EXPECT_EQ(o.src_begin, 0u);
  EXPECT_EQ(o.src_end, (kHidden - 1) * 256 + 128);
  // down_proj [128, 256], local ranks 1 and 3 of 4: from rank 1's first column to
  // the end of the tensor (rank 3 holds the last columns).
  auto m2 = tiny_model("llama", 4, {1, 3});
  Route d = route_of(*m2, "model.layers.1.mlp.down_proj.weight", {kHidden, 256});
  ASSERT_EQ(d.pieces.size(), 2u);
  EXPECT_EQ(d.pieces[0].local_rank, 0u);
  EXPECT_EQ(d.pieces[1].local_rank, 1u);
  EXPECT_EQ(d.src_begin, 64u * 2u);
  EXPECT_EQ(d.src_end, kHidden * 256 * 2);
}

TEST(Routes, SeveralLocalRanksReadTheUnionOnce) {
  // tp 4, all local: q_proj's four row slices cover the whole tensor.
  auto m = tiny_model("llama", 4);
  Route q = route_of(*m, "model.layers.0.self_attn.q_proj.weight", {128, kHidden});
  ASSERT_EQ(q.pieces.size(), 4u);
  EXPECT_EQ(q.src_begin, 0u);
  EXPECT_EQ(q.src_end, 128 * kRow);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(q.pieces[i].local_rank, i);
    EXPECT_EQ(q.pieces[i].src_offset, i * 32 * kRow);
  }
  // Ranks 1 and 2 of 4: gate rows 64..191.
  auto m2 = tiny_model("llama", 4, {1, 2});
  Route gate = route_of(*m2, "model.layers.0.mlp.gate_proj.weight", {256, kHidden});
  EXPECT_EQ(gate.src_begin, 64 * kRow);
  EXPECT_EQ(gate.src_end, 192 * kRow);
}

TEST(Routes, VocabRowsAndPaddingFills) {
  // tp 8: 1024 padded rows, 128 per rank; rank 7 holds rows 896..1023, of which
  // 896..999 come from the checkpoint and 1000..1023 are zero.
  auto m = tiny_model("llama", 8, {7});
  Route e = route_of(*m, "model.embed_tokens.weight", {1000, kHidden});
  ASSERT_EQ(e.pieces.size(), 1u);
  EXPECT_EQ(e.src_begin, 896 * kRow);
  EXPECT_EQ(e.src_end, 1000 * kRow);
  EXPECT_EQ(e.pieces[0].dst_offset, 0u);
  EXPECT_EQ(e.pieces[0].width_elems, 104 * kHidden);
  std::vector<Piece> fills = m->fill_pieces();
  ASSERT_EQ(fills.size(), 2u);  // embed_tokens and lm_head
  const auto& shell = m->shells()[0];
  std::vector<std::string> filled;
  for (const Piece& f : fills) {
    EXPECT_EQ(f.kind, Piece::Kind::kZero);
    EXPECT_EQ(f.dst_offset, 104 * kRow);
    EXPECT_EQ(f.dst_bytes(), 24 * kRow);
    filled.push_back(shell.params[f.param].name);
  }
  EXPECT_THAT(filled,
              ::testing::UnorderedElementsAre("model.embed_tokens.weight", "lm_head.weight"));
  // Rank 0 of 8 holds only real rows: nothing to fill.
  EXPECT_TRUE(tiny_model("llama", 8, {0})->fill_pieces().empty());
  // Tied: only embed_tokens is padded.
  EXPECT_EQ(tiny_model("llama", 1, {}, true)->fill_pieces().size(), 1u);
}

TEST(Routes, RanksHoldingOnlyPaddingReadNothing) {
  // vocab 65 -> padded 128, 16 rows per rank at tp 8: rank 4 holds row 64 (real) and
  // 15 padding rows; ranks 5..7 hold padding only.
  nlohmann::json c = tiny_case("llama", DType::kBF16, false).config;
  c["vocab_size"] = 65;
  models::ParallelLayout layout;
  layout.tp = 8;
  layout.local_ranks = {6};
  auto m = models::make_model(c, layout);
  Route e = route_of(*m, "model.embed_tokens.weight", {65, kHidden});
  EXPECT_EQ(e.kind, RouteKind::kDropped);
  EXPECT_EQ(e.reason, "no_local_slice");
  EXPECT_TRUE(e.pieces.empty());
  EXPECT_EQ(e.src_begin, e.src_end);
  const auto& shell = m->shells()[0];
  for (const Piece& f : m->fill_pieces()) {
    EXPECT_EQ(f.dst_offset, 0u);
    EXPECT_EQ(f.dst_bytes(), shell.params[f.param].nbytes);  // the whole param is zero
  }
  layout.local_ranks = {4, 6};
  auto m2 = models::make_model(c, layout);
  Route e2 = route_of(*m2, "model.embed_tokens.weight", {65, kHidden});
  ASSERT_EQ(e2.kind, RouteKind::kPlaced);
  ASSERT_EQ(e2.pieces.size(), 1u);
  EXPECT_EQ(e2.pieces[0].local_rank, 0u);
  EXPECT_EQ(e2.src_begin, 64 * kRow);
  EXPECT_EQ(e2.src_end, 65 * kRow);
}

TEST(Routes, QwenBiasesFollowTheQkvSlots) {
  // tp 2 rank 1: q bias elements 64..127 -> 0, k bias head 1 (16..31) -> 64, v -> 80.
  auto m = tiny_model("qwen2", 2, {1});
  const auto& shell = m->shells()[0];
  const std::size_t bias = shell.by_name.at("model.layers.0.self_attn.qkv_proj.bias");
  EXPECT_EQ(shell.params[bias].shape, (std::vector<std::uint64_t>{96}));
  Route q = route_of(*m, "model.layers.0.self_attn.q_proj.bias", {128});
  Route k = route_of(*m, "model.layers.0.self_attn.k_proj.bias", {32});
  Route v = route_of(*m, "model.layers.0.self_attn.v_proj.bias", {32});
  for (const Route* r : {&q, &k, &v}) {
    ASSERT_EQ(r->pieces.size(), 1u);
    EXPECT_EQ(r->pieces[0].param, bias);
  }
  EXPECT_EQ(q.pieces[0].src_offset, 64u * 2u);
  EXPECT_EQ(q.pieces[0].dst_offset, 0u);
  EXPECT_EQ(k.pieces[0].src_offset, 16u * 2u);
  EXPECT_EQ(k.pieces[0].dst_offset, 64u * 2u);
  EXPECT_EQ(v.pieces[0].dst_offset, 80u * 2u);
  // Llama without attention_bias has no bias param: SGLang's loader skips such a
  // tensor, ferry drops it with its reason.
  Route llama = route_of(*tiny_model("llama", 2), "model.layers.0.self_attn.q_proj.bias", {128});
  EXPECT_EQ(llama.kind, RouteKind::kDropped);
  EXPECT_EQ(llama.reason, "no_bias_param");
}

TEST(Routes, RoutingIsSafeFromSeveralThreads) {
  auto m = tiny_model("llama", 4);
  SynthCase ck = tiny_case("llama", DType::kBF16, false);
  std::vector<std::vector<Route>> results(4);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < results.size(); ++t) {
    threads.emplace_back([&, t] {
      for (const std::string& name : ck.names) {
        results[t].push_back(route_of(*m, name, ck.shapes.at(name)));
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (std::size_t t = 1; t < results.size(); ++t) {
    ASSERT_EQ(results[t].size(), results[0].size());
    for (std::size_t i = 0; i < results[t].size(); ++i) {
      EXPECT_EQ(results[t][i].pieces, results[0][i].pieces);
    }
  }
}

}  // namespace
}  // namespace ferry::testing
