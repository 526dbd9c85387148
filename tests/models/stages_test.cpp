// Pipeline stages: which layers a stage holds (pp_layers), the model's edges
// (embed_tokens on the first stage, the final norm and lm_head on the last, tied
// embeddings on a last stage that is not the first), and the "pp_stage" drops of
// the other stages' layers — on a bare TableModel and through the dense families.
// Expected ranges and rows are written out here from the definitions.
#include "models/stages.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "models/model.hpp"
#include "models/placement.hpp"
#include "models/reference_util.hpp"
#include "models/sglang_rules.hpp"
#include "models/table_model.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using models::Range;
using models::Route;
using models::RouteKind;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr std::uint64_t kHidden = 8;
constexpr std::uint64_t kVocab = 1000;            // padded to 1024: 512 rows per rank at tp 2
constexpr std::uint64_t kRowBytes = kHidden * 2;  // BF16

// ---- pp_layers ----------------------------------------------------------------------

// Fixtures from SGLang's get_pp_indices (python/sglang/srt/distributed/utils.py in
// SGLang 0.5.23): every stage gets L // pp layers
// and the last L % pp stages one more each. Worked by hand from that code, for
// remainders 0, 1, 2, 5 and 7.
TEST(PpLayers, SglangGetPpIndicesFixtures) {
  struct Fixture {
    std::uint64_t layers;
    int pp;
    std::vector<std::uint64_t> counts;
  };
  const std::vector<Fixture> fixtures{
      {32, 4, {8, 8, 8, 8}},              // remainder 0
      {48, 2, {24, 24}},                  // remainder 0
      {33, 4, {8, 8, 8, 9}},              // remainder 1
      {61, 4, {15, 15, 15, 16}},          // remainder 1
      {62, 4, {15, 15, 16, 16}},          // remainder 2
      {94, 4, {23, 23, 24, 24}},          // remainder 2 (Qwen3-235B-A22B)
      {61, 8, {7, 7, 7, 8, 8, 8, 8, 8}},  // remainder 5 (DeepSeek-V3)
      {63, 8, {7, 8, 8, 8, 8, 8, 8, 8}},  // remainder 7
      {15, 8, {1, 2, 2, 2, 2, 2, 2, 2}},  // remainder 7
      {10, 3, {3, 3, 4}},                 // remainder 1
  };
  for (const Fixture& f : fixtures) {
    std::uint64_t begin = 0;
    for (int s = 0; s < f.pp; ++s) {
      SCOPED_TRACE(std::to_string(f.layers) + " layers, pp " + std::to_string(f.pp) + ", stage " +
                   std::to_string(s));
      const Range got = models::pp_layers(f.layers, f.pp, s, {});
      EXPECT_EQ(got, (Range{begin, f.counts[static_cast<std::size_t>(s)]}));
      // The transliteration of SGLang's code agrees with the table.
      const auto [start, end] = sglang::get_pp_indices(f.layers, static_cast<std::uint64_t>(s),
                                                       static_cast<std::uint64_t>(f.pp));
      EXPECT_EQ(start, begin);
      EXPECT_EQ(end, begin + f.counts[static_cast<std::size_t>(s)]);
      begin += f.counts[static_cast<std::size_t>(s)];
    }
    EXPECT_EQ(begin, f.layers);
  }
  EXPECT_EQ(models::pp_layers(4, 1, 0, {}), (Range{0, 4}));
}

TEST(PpLayers, MoreStagesThanLayersIsRefusedAsSglangAsserts) {
  // SGLang's make_layers asserts num_hidden_layers >= pp_size.
  EXPECT_THAT(error_of(Stage::kConfig, [] { models::pp_layers(2, 4, 0, {}); }),
              AllOf(HasSubstr("num_hidden_layers 2"), HasSubstr("pp 4")));
  EXPECT_THAT(error_of(Stage::kConfig,
                       [] {
                         models::pp_layers(2, 4, 0, {1, 1, 0, 0});
                       }),
              HasSubstr("num_hidden_layers 2"));
}

TEST(PpLayers, PartitionGivesEachStageItsCountInOrder) {
  const std::vector<int> partition{3, 0, 1, 2};
  EXPECT_EQ(models::pp_layers(6, 4, 0, partition), (Range{0, 3}));
  EXPECT_EQ(models::pp_layers(6, 4, 1, partition), (Range{3, 0}));
  EXPECT_EQ(models::pp_layers(6, 4, 2, partition), (Range{3, 1}));
  EXPECT_EQ(models::pp_layers(6, 4, 3, partition), (Range{4, 2}));
}

std::string config_error(std::uint64_t layers, int pp, int pp_rank, std::vector<int> partition) {
  try {
    models::pp_layers(layers, pp, pp_rank, partition);
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kConfig);
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(PpLayers, BadPartitionsAndStagesAreConfigErrors) {
  EXPECT_THAT(config_error(6, 2, 0, {6}),
              AllOf(HasSubstr("pp_partition has 1 entries"), HasSubstr("pp 2")));
  EXPECT_THAT(config_error(6, 2, 0, {2, 3}),
              AllOf(HasSubstr("pp_partition sums to 5"), HasSubstr("num_hidden_layers 6")));
  EXPECT_THAT(config_error(6, 2, 1, {7, -1}),
              AllOf(HasSubstr("pp_partition[1] is negative"), HasSubstr("-1")));
  EXPECT_THAT(config_error(6, 2, 2, {}), HasSubstr("pp_rank 2 is not a stage of pp 2"));
  EXPECT_THAT(config_error(6, 2, -1, {}), HasSubstr("pp_rank -1"));
}

// ---- stage edges on a bare TableModel --------------------------------------------

struct StageCase {
  int pp = 1;
  int pp_rank = 0;
  bool tied = false;
  int tp = 1;
};

std::unique_ptr<models::TableModel> edges_model(const StageCase& s, bool head_on_every_stage = false) {
  models::ParallelLayout layout;
  layout.tp = s.tp;
  layout.pp = s.pp;
  layout.pp_rank = s.pp_rank;
  layout = models::normalize_layout(layout);
  auto m = std::make_unique<models::TableModel>("toy", "ToyForCausalLM", layout, DType::kBF16,
                                                /*strict=*/false);
  models::StageEdges edges;
  edges.hidden = kHidden;
  edges.vocab = kVocab;
  edges.tie_embeddings = s.tied;
  edges.head_on_every_stage = head_on_every_stage;
  models::add_stage_edges(*m, edges, layout);
  m->finish();
  return m;
}

std::set<std::string> param_names(const models::Model& m, std::size_t local_rank = 0) {
  std::set<std::string> out;
  for (const models::ParamSpec& p : m.shells().at(local_rank).params) {
    out.insert(p.name);
  }
  return out;
}

Route route_edge(const models::Model& m, const std::string& name) {
  std::vector<std::uint64_t> shape = name == "model.norm.weight"
                                         ? std::vector<std::uint64_t>{kHidden}
                                         : std::vector<std::uint64_t>{kVocab, kHidden};
  return m.route(tensor_info(name, DType::kBF16, shape));
}

// "placed" or the drop reason.
std::string fate(const models::Model& m, const std::string& name) {
  Route r = route_edge(m, name);
  return r.kind == RouteKind::kPlaced ? "placed" : r.reason;
}

// The params a placed tensor writes on local rank 0.
std::set<std::string> written(const models::Model& m, const std::string& name) {
  std::set<std::string> out;
  for (const models::Piece& p : route_edge(m, name).pieces) {
    out.insert(m.shells()[p.local_rank].params[p.param].name);
  }
  return out;
}

const std::string kEmbed = "model.embed_tokens.weight";
const std::string kNorm = "model.norm.weight";
const std::string kHead = "lm_head.weight";

TEST(StageEdges, SingleStageIsUnchanged) {
  auto untied = edges_model({1, 0, false, 1});
  EXPECT_EQ(param_names(*untied), (std::set<std::string>{kHead, kEmbed, kNorm}));
  EXPECT_EQ(fate(*untied, kEmbed), "placed");
  EXPECT_EQ(fate(*untied, kNorm), "placed");
  EXPECT_EQ(fate(*untied, kHead), "placed");
  EXPECT_EQ(written(*untied, kEmbed), (std::set<std::string>{kEmbed}));
  EXPECT_EQ(written(*untied, kHead), (std::set<std::string>{kHead}));

  auto tied = edges_model({1, 0, true, 1});
  EXPECT_EQ(param_names(*tied), (std::set<std::string>{kEmbed, kNorm}));
  EXPECT_EQ(written(*tied, kEmbed), (std::set<std::string>{kEmbed}));
  EXPECT_EQ(fate(*tied, kHead), "tied_lm_head");
}

TEST(StageEdges, UntiedFirstMiddleLast) {
  auto first = edges_model({3, 0, false, 1});
  EXPECT_EQ(param_names(*first), (std::set<std::string>{kEmbed}));
  EXPECT_EQ(fate(*first, kEmbed), "placed");
  EXPECT_EQ(fate(*first, kNorm), "last_stage_only");
  EXPECT_EQ(fate(*first, kHead), "last_stage_only");

  auto middle = edges_model({3, 1, false, 1});
  EXPECT_TRUE(param_names(*middle).empty());
  EXPECT_EQ(fate(*middle, kEmbed), "first_stage_only");
  EXPECT_EQ(fate(*middle, kNorm), "last_stage_only");
  EXPECT_EQ(fate(*middle, kHead), "last_stage_only");

  auto last = edges_model({3, 2, false, 1});
  EXPECT_EQ(param_names(*last), (std::set<std::string>{kHead, kNorm}));
  EXPECT_EQ(fate(*last, kEmbed), "first_stage_only");
  EXPECT_EQ(fate(*last, kNorm), "placed");
  EXPECT_EQ(written(*last, kHead), (std::set<std::string>{kHead}));
}

// SGLang 0.5.23's LlamaForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM,
// Qwen3MoeForCausalLM and Glm4MoeForCausalLM build their ParallelLMHead on every
// pipeline stage: an untied lm_head is held on every stage; a tied one is not.
TEST(StageEdges, HeadOnEveryStage) {
  for (int stage : {0, 1}) {
    auto m = edges_model({3, stage, false, 1}, true);
    SCOPED_TRACE("stage " + std::to_string(stage));
    EXPECT_EQ(fate(*m, kHead), "placed");
    EXPECT_EQ(written(*m, kHead), (std::set<std::string>{kHead}));
    EXPECT_EQ(fate(*m, kNorm), "last_stage_only");
  }
  auto tied = edges_model({3, 1, true, 1}, true);
  EXPECT_EQ(fate(*tied, kHead), "last_stage_only");
}

TEST(StageEdges, TiedFirstMiddleLast) {
  auto first = edges_model({2, 0, true, 1});
  EXPECT_EQ(param_names(*first), (std::set<std::string>{kEmbed}));
  EXPECT_EQ(written(*first, kEmbed), (std::set<std::string>{kEmbed}));
  EXPECT_EQ(fate(*first, kNorm), "last_stage_only");
  EXPECT_EQ(fate(*first, kHead), "last_stage_only");

  auto middle = edges_model({3, 1, true, 1});
  EXPECT_TRUE(param_names(*middle).empty());
  EXPECT_EQ(fate(*middle, kEmbed), "first_stage_only");
  EXPECT_EQ(fate(*middle, kHead), "last_stage_only");

  // The last stage reads the embedding into its own lm_head param; a checkpoint's
  // lm_head.weight is still not read.
  auto last = edges_model({2, 1, true, 1});
  EXPECT_EQ(param_names(*last), (std::set<std::string>{kHead, kNorm}));
  EXPECT_EQ(written(*last, kEmbed), (std::set<std::string>{kHead}));
  EXPECT_EQ(fate(*last, kHead), "tied_lm_head");
  EXPECT_EQ(fate(*last, kNorm), "placed");
}

TEST(StageEdges, TiedLastStageLmHeadIsVocabParallelWithZeroPadding) {
  // tp 2: vocab 1000 padded to 1024 (a multiple of 64), 512 rows per rank. Rank 0
  // copies embedding rows [0, 512); rank 1 copies [512, 1000) into its rows
  // [0, 488) and zero-fills its rows [488, 512).
  auto last = edges_model({2, 1, true, 2});
  ASSERT_EQ(last->shells().size(), 2u);
  for (std::size_t r = 0; r < 2; ++r) {
    const models::RankShell& shell = last->shells()[r];
    const models::ParamSpec& head = shell.params[shell.by_name.at(kHead)];
    EXPECT_EQ(head.shape, (models::Shape{512, kHidden}));
  }
  Route route = route_edge(*last, kEmbed);
  ASSERT_EQ(route.kind, RouteKind::kPlaced);
  ASSERT_EQ(route.pieces.size(), 2u);
  const models::Piece& p0 = route.pieces[0];
  const models::Piece& p1 = route.pieces[1];
  EXPECT_EQ(p0.local_rank, 0u);
  EXPECT_EQ(p0.src_offset, 0u);
  EXPECT_EQ(p0.dst_offset, 0u);
  EXPECT_EQ(p0.dst_bytes(), 512 * kRowBytes);
  EXPECT_EQ(p1.local_rank, 1u);
  EXPECT_EQ(p1.src_offset, 512 * kRowBytes);
  EXPECT_EQ(p1.dst_offset, 0u);
  EXPECT_EQ(p1.dst_bytes(), 488 * kRowBytes);
  EXPECT_EQ(route.src_begin, 0u);
  EXPECT_EQ(route.src_end, kVocab * kRowBytes);

  std::vector<models::Piece> fills = last->fill_pieces();
  ASSERT_EQ(fills.size(), 1u);
  EXPECT_EQ(fills[0].kind, models::Piece::Kind::kZero);
  EXPECT_EQ(fills[0].local_rank, 1u);
  EXPECT_EQ(last->shells()[1].params[fills[0].param].name, kHead);
  EXPECT_EQ(fills[0].dst_offset, 488 * kRowBytes);
  EXPECT_EQ(fills[0].dst_bytes(), 24 * kRowBytes);
}

// ---- layer drops ------------------------------------------------------------------

std::unique_ptr<models::TableModel> drops_model(std::uint64_t layers, Range stage) {
  models::ParallelLayout layout = models::normalize_layout({});
  auto m = std::make_unique<models::TableModel>("toy", "ToyForCausalLM", layout, DType::kBF16,
                                                /*strict=*/false);
  models::add_layer_drops(*m, layers, stage);
  m->finish();
  return m;
}

Route layer_route(const models::Model& m, std::uint64_t layer) {
  return m.route(tensor_info("model.layers." + std::to_string(layer) + ".mlp.down_proj.weight",
                             DType::kBF16, {4, 4}));
}

TEST(LayerDrops, OnlyLayersOutsideTheStageAreDroppedAndLayer1IsNotLayer11) {
  // Stage holds only layer 1 of 12: layers 10 and 11 (which contain "1") are
  // dropped, layer 1 is left to the family (here: no target, so unmapped).
  auto only1 = drops_model(12, {1, 1});
  for (std::uint64_t l = 0; l < 12; ++l) {
    Route r = layer_route(*only1, l);
    if (l == 1) {
      EXPECT_EQ(r.kind, RouteKind::kUnmapped) << l;
    } else {
      EXPECT_EQ(r.kind, RouteKind::kDropped) << l;
      EXPECT_EQ(r.reason, "pp_stage") << l;
    }
  }
  // And the other way round: the stage holds layer 11, layer 1 is dropped.
  auto only11 = drops_model(12, {11, 1});
  EXPECT_EQ(layer_route(*only11, 11).kind, RouteKind::kUnmapped);
  EXPECT_EQ(layer_route(*only11, 1).reason, "pp_stage");
  // Layers from num_layers up (MTP layers) are the family's business.
  EXPECT_EQ(layer_route(*only11, 12).kind, RouteKind::kUnmapped);
  // Names that merely contain a layer's prefix further in are not layer tensors of
  // another stage either: "model.layers.1" must be followed by a dot.
  EXPECT_EQ(only1->route(tensor_info("model.layers.1x.w", DType::kBF16, {1})).kind,
            RouteKind::kUnmapped);
}

// ---- through the dense families -------------------------------------------------------

std::unique_ptr<models::Model> dense_stage(const std::string& family, std::uint64_t layers, int pp,
                                           int pp_rank, std::vector<int> partition = {},
                                           bool tied = false, int tp = 1) {
  SynthCase ck = tiny_case(family, DType::kBF16, tied);
  ck.config["num_hidden_layers"] = layers;
  models::ParallelLayout layout;
  layout.tp = tp;
  layout.pp = pp;
  layout.pp_rank = pp_rank;
  layout.pp_partition = std::move(partition);
  return models::make_model(ck.config, layout);
}

// The layers whose params a shell holds.
std::set<std::uint64_t> layers_of(const models::Model& m) {
  std::set<std::uint64_t> out;
  const std::string prefix = "model.layers.";
  for (const models::ParamSpec& p : m.shells()[0].params) {
    if (p.name.rfind(prefix, 0) == 0) {
      out.insert(std::stoull(p.name.substr(prefix.size())));
    }
  }
  return out;
}

TEST(DenseStages, ShellsHoldOnlyTheStagesLayersForEveryDenseFamily) {
  for (const char* family : {"llama", "qwen2", "mistral"}) {
    SCOPED_TRACE(family);
    // 12 layers over 4 stages: [0,3), [3,6), [6,9), [9,12).
    for (int s = 0; s < 4; ++s) {
      auto m = dense_stage(family, 12, 4, s);
      std::set<std::uint64_t> want;
      const auto stage = static_cast<std::uint64_t>(s);
      for (std::uint64_t l = 3 * stage; l < 3 * (stage + 1); ++l) {
        want.insert(l);
      }
      EXPECT_EQ(layers_of(*m), want) << "stage " << s;
      const bool has_embed = m->shells()[0].by_name.count(kEmbed) > 0;
      const bool has_norm = m->shells()[0].by_name.count(kNorm) > 0;
      EXPECT_EQ(has_embed, s == 0);
      EXPECT_EQ(has_norm, s == 3);
    }
  }
}

TEST(DenseStages, OtherStagesLayersAreDroppedAndLayer1IsNotLayer11) {
  // Partition {2, 9, 1} of 12 layers: stage 0 holds layers 0 and 1, stage 2 holds
  // layer 11 only.
  auto first = dense_stage("llama", 12, 3, 0, {2, 9, 1});
  auto last = dense_stage("llama", 12, 3, 2, {2, 9, 1});
  const std::string l1 = "model.layers.1.mlp.down_proj.weight";
  const std::string l11 = "model.layers.11.mlp.down_proj.weight";
  const std::vector<std::uint64_t> down{128, 256};  // tiny llama: hidden 128, inter 256
  EXPECT_EQ(first->route(tensor_info(l1, DType::kBF16, down)).kind, RouteKind::kPlaced);
  Route r11 = first->route(tensor_info(l11, DType::kBF16, down));
  EXPECT_EQ(r11.kind, RouteKind::kDropped);
  EXPECT_EQ(r11.reason, "pp_stage");
  EXPECT_EQ(last->route(tensor_info(l11, DType::kBF16, down)).kind, RouteKind::kPlaced);
  EXPECT_EQ(last->route(tensor_info(l1, DType::kBF16, down)).reason, "pp_stage");
  EXPECT_EQ(layers_of(*last), (std::set<std::uint64_t>{11}));
  // Another stage's rotary cache counts as that stage's tensor.
  EXPECT_EQ(
      last->route(tensor_info("model.layers.1.self_attn.rotary_emb.inv_freq", DType::kF32, {8}))
          .reason,
      "pp_stage");
  EXPECT_EQ(
      last->route(tensor_info("model.layers.11.self_attn.rotary_emb.inv_freq", DType::kF32, {8}))
          .reason,
      "inv_freq");
}

TEST(DenseStages, BadPartitionFailsMakeModelNamingIt) {
  try {
    dense_stage("qwen2", 4, 2, 0, {1, 2});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kConfig);
    EXPECT_THAT(std::string(e.what()),
                AllOf(HasSubstr("pp_partition sums to 3"), HasSubstr("num_hidden_layers 4")));
  }
}

TEST(DenseStages, ExpertParallelIsStillRefused) {
  SynthCase ck = tiny_case("llama", DType::kBF16, false);
  models::ParallelLayout layout;
  layout.tp = 2;
  layout.ep = 2;
  layout.pp = 2;
  EXPECT_THROW(models::make_model(ck.config, layout), Error);
}

}  // namespace
}  // namespace ferry::testing
