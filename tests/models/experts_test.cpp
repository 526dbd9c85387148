// Fused experts with expert parallelism (models/experts.hpp) and the MoE families
// Mixtral, Qwen3-MoE and Qwen2-MoE (models/moe.hpp):
// - the EPLB map parser, every malformed form named with its file and field;
// - placement contract: every tensor of a synthetic checkpoint is routed, its pieces
//   run by the naive executor (which sees only the route's read range), the fills
//   run, and every byte of every local param must be written exactly once with the
//   value the independent reference (moe_reference.hpp) computes; every dropped
//   tensor must be dropped for the reason the test derives on its own (an expert no
//   local rank owns, another pipeline stage);
// - bad inputs: layouts that do not split, wrong expert shapes, refused fused layouts.
#include "models/experts.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "common/error.hpp"
#include "models/coverage.hpp"
#include "models/model.hpp"
#include "models/moe_reference.hpp"
#include "models/reference_util.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::testing {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;

// ---- the EPLB map parser ----------------------------------------------------------

nlohmann::json good_map() {
  return nlohmann::json::parse(R"({
    "num_physical_experts": 6,
    "layers": {"0": [[0, 4], [1], [2, 5], [3]], "3": [[5], [4], [3], [0, 1, 2]]}
  })");
}

TEST(EplbMap, ParsesAGoodMap) {
  models::ModelOptions::Eplb e = models::parse_eplb_map(good_map(), "eplb.json");
  EXPECT_EQ(e.num_physical_experts, 6u);
  ASSERT_EQ(e.layers.size(), 2u);
  using V = std::vector<std::vector<std::uint64_t>>;
  EXPECT_EQ(e.layers.at(0), (V{{0, 4}, {1}, {2, 5}, {3}}));
  EXPECT_EQ(e.layers.at(3), (V{{5}, {4}, {3}, {0, 1, 2}}));
}

struct BadMap {
  const char* what;
  std::function<void(nlohmann::json&)> edit;
  const char* field;  // the message must name it
};

TEST(EplbMap, EveryMalformedFormNamesTheFileAndField) {
  const std::vector<BadMap> cases{
      {"not an object",
       [](nlohmann::json& j) {
         j = nlohmann::json::array({1, 2});
       },
       "expected a JSON object"},
      {"unknown field", [](nlohmann::json& j) { j["replicas"] = 2; }, "unknown field \"replicas\""},
      {"P missing", [](nlohmann::json& j) { j.erase("num_physical_experts"); },
       "num_physical_experts"},
      {"P zero", [](nlohmann::json& j) { j["num_physical_experts"] = 0; }, "num_physical_experts"},
      {"P negative", [](nlohmann::json& j) { j["num_physical_experts"] = -6; },
       "num_physical_experts"},
      {"P text", [](nlohmann::json& j) { j["num_physical_experts"] = "6"; },
       "num_physical_experts"},
      {"layers missing", [](nlohmann::json& j) { j.erase("layers"); }, "layers"},
      {"layers a list", [](nlohmann::json& j) { j["layers"] = nlohmann::json::array(); }, "layers"},
      {"layer key not an index", [](nlohmann::json& j) { j["layers"]["x1"] = j["layers"]["0"]; },
       "layer key \"x1\""},
      {"layer not a list", [](nlohmann::json& j) { j["layers"]["0"] = 7; }, "layers[\"0\"]"},
      {"expert not a list", [](nlohmann::json& j) { j["layers"]["0"][1] = 1; }, "layers[\"0\"][1]"},
      {"expert with no ids",
       [](nlohmann::json& j) { j["layers"]["0"][1] = nlohmann::json::array(); },
       "layers[\"0\"][1]"},
      {"id >= P",
       [](nlohmann::json& j) {
         j["layers"]["3"][3] = {0, 1, 2, 6};
       },
       "layers[\"3\"][3] holds 6"},
      {"id not a number", [](nlohmann::json& j) { j["layers"]["3"][0] = {"5"}; },
       "layers[\"3\"][0]"},
      {"id used twice",
       [](nlohmann::json& j) {
         j["layers"]["0"][3] = {3, 4};
       },
       "physical id 4 is given to logical experts 0 and 3"},
      {"slot unused", [](nlohmann::json& j) { j["layers"]["0"][2] = {2}; },
       "physical id 5 holds no logical expert"},
  };
  for (const BadMap& c : cases) {
    SCOPED_TRACE(c.what);
    nlohmann::json j = good_map();
    c.edit(j);
    const std::string msg =
        error_of(Stage::kConfig, [&] { models::parse_eplb_map(j, "/maps/eplb.json"); });
    EXPECT_THAT(
        msg, AllOf(HasSubstr("/maps/eplb.json"), HasSubstr("model.eplb_map"), HasSubstr(c.field)));
  }
}

TEST(EplbMap, LoadsAFileAndNamesItWhenItCannot) {
  TempDir dir;
  write_file(dir.file("eplb.json"), good_map().dump());
  EXPECT_EQ(models::load_eplb_map(dir.file("eplb.json")).num_physical_experts, 6u);
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::load_eplb_map(dir.file("missing.json")); }),
              AllOf(HasSubstr("missing.json"), HasSubstr("cannot open")));
  write_file(dir.file("bad.json"), "{\"num_physical_experts\": 6,");
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::load_eplb_map(dir.file("bad.json")); }),
              AllOf(HasSubstr("bad.json"), HasSubstr("not valid JSON")));
}

// ---- synthetic cases -----------------------------------------------------------------

constexpr std::uint64_t kSeed = 7;
constexpr std::uint64_t kPhysical = 12;  // EPLB: 8 logical experts on 12 slots

// A map with replicas: physical ids of layer l are the permutation i -> (5i + 3l) % 12
// (5 is prime to 12); logical expert x gets id perm[x], and experts 0..3 also
// perm[8 + x]. Layer 0, ep 2: expert 0 has ids 0 and 4, both on ep rank 0.
std::map<std::uint64_t, std::vector<std::vector<std::uint64_t>>> test_eplb(std::uint64_t layers,
                                                                           std::uint64_t experts) {
  std::map<std::uint64_t, std::vector<std::vector<std::uint64_t>>> out;
  for (std::uint64_t l = 0; l < layers; ++l) {
    std::vector<std::uint64_t> perm(kPhysical);
    for (std::uint64_t i = 0; i < kPhysical; ++i) {
      perm[i] = (5 * i + 3 * l) % kPhysical;
    }
    auto& layer = out[l];
    for (std::uint64_t x = 0; x < experts; ++x) {
      layer.push_back({perm[x]});
      if (experts + x < kPhysical) {
        layer.back().push_back(perm[experts + x]);
      }
    }
  }
  return out;
}

nlohmann::json eplb_json(
    const std::map<std::uint64_t, std::vector<std::vector<std::uint64_t>>>& m) {
  nlohmann::json j;
  j["num_physical_experts"] = kPhysical;
  j["layers"] = nlohmann::json::object();
  for (const auto& [layer, experts] : m) {
    j["layers"][std::to_string(layer)] = experts;
  }
  return j;
}

// What the checkpoint holds: config and every tensor's shape, in file order.
struct Ckpt {
  nlohmann::json config;
  std::vector<std::pair<std::string, std::vector<std::uint64_t>>> tensors;
};

Ckpt synth_ckpt(const std::string& family, bool fused) {
  Ckpt c;
  c.config = synth::synth_config(family, "tiny", DType::kBF16, false);
  for (const synth::SynthTensor& t :
       synth::synth_tensor_list(family, "tiny", DType::kBF16, false, fused)) {
    c.tensors.emplace_back(t.name, t.shape);
  }
  return c;
}

struct Case {
  std::string family;  // mixtral, qwen3_moe, qwen2_moe
  int tp = 1;
  int ep = 1;
  std::vector<int> local{};  // empty: every rank
  bool switch_w13 = false;
  std::uint64_t pad = 0;
  bool eplb = false;
  bool unaligned_pad = false;  // model.unaligned_tp=pad
  bool fused_ckpt = false;
  int pp = 1;
  int pp_rank = 0;
  DType dtype = DType::kBF16;
  // Non-zero: the checkpoint's vocabulary, so that tp 3 or 6 splits the padded
  // vocabulary (tiny's 1000 pads to 1024 = 2^10).
  std::uint64_t vocab = 0;
  // Attention data parallelism (parallel.attn_dp, parallel.dp_lm_head).
  int attn_dp = 1;
  bool dp_lm_head = false;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string n = c.family + "_tp" + std::to_string(c.tp) + "_ep" + std::to_string(c.ep);
  if (!c.local.empty()) {
    n += "_local";
    for (int r : c.local) {
      n += std::to_string(r);
    }
  }
  if (c.switch_w13) {
    n += "_switch";
  }
  if (c.pad != 0) {
    n += "_pad" + std::to_string(c.pad);
  }
  if (c.eplb) {
    n += "_eplb";
  }
  if (c.unaligned_pad) {
    n += "_tppad";
  }
  if (c.fused_ckpt) {
    n += "_fusedckpt";
  }
  if (c.pp > 1) {
    n += "_pp" + std::to_string(c.pp) + "s" + std::to_string(c.pp_rank);
  }
  if (c.dtype != DType::kBF16) {
    n += "_" + std::string(dtype_name(c.dtype));
  }
  if (c.vocab != 0) {
    n += "_vocab" + std::to_string(c.vocab);
  }
  if (c.attn_dp > 1) {
    n += "_attndp" + std::to_string(c.attn_dp);
  }
  if (c.dp_lm_head) {
    n += "_dplmhead";
  }
  return n;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name({c, 0});
}

// Checkpoint values per seed, shared by every case (a name's values do not depend
// on the family or the dtype).
moe_ref::Values& values() {
  static moe_ref::Values v(kSeed);
  return v;
}

std::uint64_t numel(const std::vector<std::uint64_t>& shape) {
  std::uint64_t n = 1;
  for (std::uint64_t d : shape) {
    n *= d;
  }
  return n;
}

// The bytes of a tensor as the checkpoint stores them, each encoding made once.
const std::vector<std::byte>& encoded(const std::string& name, const std::vector<float>& v,
                                      DType dtype) {
  static std::map<std::tuple<std::string, std::size_t, DType>, std::vector<std::byte>> cache;
  auto key = std::make_tuple(name, v.size(), dtype);
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache.emplace(std::move(key), encode(v, dtype)).first;
  }
  return it->second;
}

// "model.layers.<l>." -> l; nullopt for names outside the decoder layers.
std::optional<std::uint64_t> layer_of(const std::string& name) {
  const std::string p = "model.layers.";
  if (name.rfind(p, 0) != 0) {
    return std::nullopt;
  }
  return std::stoull(name.substr(p.size()));
}

// The logical expert of a per-expert tensor name ("...experts.<x>.<proj>.weight").
std::optional<std::uint64_t> expert_of(const std::string& name) {
  const std::string k = "experts.";
  auto at = name.find(k);
  if (at == std::string::npos || !std::isdigit(static_cast<unsigned char>(name[at + k.size()]))) {
    return std::nullopt;
  }
  return std::stoull(name.substr(at + k.size()));
}

// Runs the contract on `ck` under `c`; returns the number of params compared.
std::size_t run_contract(const Case& c, const Ckpt& ck) {
  models::ParallelLayout layout = testing::case_layout(c);
  models::ModelOptions options;
  options.switch_w13 = c.switch_w13;
  options.pad_moe_intermediate_to = c.pad;
  options.unaligned_tp = c.unaligned_pad ? models::Unaligned::kPad : models::Unaligned::kRefuse;
  moe_ref::Options ro;
  ro.tp = c.tp;
  ro.ep = c.ep;
  ro.pp = c.pp;
  ro.pp_rank = c.pp_rank;
  ro.switch_w13 = c.switch_w13;
  ro.pad = c.pad;
  ro.unaligned_pad = c.unaligned_pad;
  ro.fused_checkpoint = c.fused_ckpt;
  ro.attn_dp = c.attn_dp;
  ro.dp_lm_head = c.dp_lm_head;
  const moe_ref::Config rc = moe_ref::read_config(ck.config);
  if (c.eplb) {
    ro.physical = kPhysical;
    ro.eplb = test_eplb(rc.L, rc.E);
    options.eplb = models::parse_eplb_map(eplb_json(ro.eplb), "eplb.json");
  }
  std::unique_ptr<models::Model> model = models::make_model(ck.config, layout, options);
  EXPECT_EQ(model->family(), c.family);

  std::vector<int> local = c.local;
  if (local.empty()) {
    for (int r = 0; r < c.tp; ++r) {
      local.push_back(r);
    }
  }
  EXPECT_EQ(model->layout().local_ranks, local);
  const auto [l0, l1] = sglang::get_pp_indices(rc.L, static_cast<std::uint64_t>(c.pp_rank),
                                               static_cast<std::uint64_t>(c.pp));

  ParamBuffers buffers = make_buffers(*model);
  std::vector<models::Route> routes;
  for (const auto& [name, shape] : ck.tensors) {
    const std::vector<float>& v = values().get(name, numel(shape));
    models::Route route = model->route(tensor_info(name, c.dtype, shape));
    // Why this tensor may not be placed, derived here.
    std::string expected_drop;
    const std::optional<std::uint64_t> layer = layer_of(name);
    if (layer && (*layer < l0 || *layer >= l1)) {
      expected_drop = "pp_stage";
    } else if (name == "model.embed_tokens.weight" && c.pp_rank != 0 &&
               !(rc.tied && c.pp_rank == c.pp - 1)) {
      expected_drop = "first_stage_only";
    } else if ((name == "model.norm.weight" || (name == "lm_head.weight" && rc.tied)) &&
               c.pp_rank != c.pp - 1) {
      // lm_head: every stage (every MoE family here builds its ParallelLMHead so).
      expected_drop = "last_stage_only";
    } else if (layer && expert_of(name) &&
               !moe_ref::expert_is_local(rc, ro, *layer, *expert_of(name), local)) {
      // Held by no local rank, or only by ranks whose share is padding.
      ro.unaligned_pad = false;
      const bool owned = moe_ref::expert_is_local(rc, ro, *layer, *expert_of(name), local);
      ro.unaligned_pad = c.unaligned_pad;
      expected_drop = owned ? "no_local_slice" : "remote_expert";
    }
    if (!expected_drop.empty()) {
      EXPECT_EQ(route.kind, models::RouteKind::kDropped) << name;
      EXPECT_EQ(route.reason, expected_drop) << name;
      EXPECT_TRUE(route.pieces.empty()) << name;
      continue;
    }
    if (route.kind != models::RouteKind::kPlaced || route.pieces.empty()) {
      ADD_FAILURE() << name << " is " << models::to_string(route.kind) << " (" << route.reason
                    << ")";
      continue;
    }
    const std::vector<std::byte>& bytes = encoded(name, v, c.dtype);
    EXPECT_LE(route.src_begin, route.src_end) << name;
    EXPECT_LE(route.src_end, bytes.size()) << name;
    std::span<const std::byte> window(bytes.data() + route.src_begin,
                                      route.src_end - route.src_begin);
    for (const models::Piece& p : route.pieces) {
      EXPECT_EQ(p.kind, models::Piece::Kind::kCopy) << name;
      EXPECT_NO_THROW(apply_piece(p, window, route.src_begin, buffers)) << name;
    }
    routes.push_back(std::move(route));
  }
  for (const models::Piece& p : model->fill_pieces()) {
    EXPECT_EQ(p.kind, models::Piece::Kind::kZero);
    EXPECT_NO_THROW(apply_piece(p, {}, 0, buffers));
  }
  EXPECT_TRUE(models::check_coverage(*model, routes).empty());

  std::size_t compared = 0;
  for (std::size_t i = 0; i < local.size(); ++i) {
    const models::RankShell& shell = model->shells()[i];
    EXPECT_EQ(shell.tp_rank, local[i]);
    std::map<std::string, moe_ref::Tensor> want =
        moe_ref::reference_rank(ck.config, values(), ro, local[i]);
    std::vector<std::string> want_names;
    for (const auto& [name, t] : want) {
      want_names.push_back(name);
    }
    std::vector<std::string> names;
    for (const models::ParamSpec& p : shell.params) {
      names.push_back(p.name);
    }
    EXPECT_EQ(names, want_names) << "rank " << local[i];
    for (std::size_t k = 0; k < shell.params.size(); ++k) {
      const models::ParamSpec& spec = shell.params[k];
      auto it = want.find(spec.name);
      if (it == want.end()) {
        continue;
      }
      const moe_ref::Tensor& w = it->second;
      EXPECT_EQ(spec.shape, w.shape) << spec.name;
      if (spec.shape != w.shape) {
        continue;
      }
      const auto& bytes = buffers.bytes[i][k];
      const auto& writes = buffers.writes[i][k];
      auto bad = std::find_if(writes.begin(), writes.end(), [](auto n) { return n != 1; });
      if (bad != writes.end()) {
        ADD_FAILURE() << spec.name << " rank " << local[i] << ": byte " << (bad - writes.begin())
                      << " written " << int(*bad) << " times";
        continue;
      }
      const std::size_t es = dtype_size(spec.dtype);
      for (std::size_t e = 0; e < w.values.size(); ++e) {
        const float got = decode_one(bytes.data() + e * es, spec.dtype);
        if (got != w.values[e]) {
          ADD_FAILURE() << spec.name << " rank " << local[i] << " element " << e << ": got " << got
                        << ", reference " << w.values[e];
          break;
        }
      }
      ++compared;
    }
  }
  return compared;
}

class MoeContract : public ::testing::TestWithParam<Case> {};

TEST_P(MoeContract, EveryElementMatchesTheReference) {
  const Case& c = GetParam();
  Ckpt ck = synth_ckpt(c.family, c.fused_ckpt);
  if (c.vocab != 0) {
    const std::uint64_t old = ck.config.at("vocab_size").get<std::uint64_t>();
    ck.config["vocab_size"] = c.vocab;
    for (auto& [name, shape] : ck.tensors) {
      if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
        ASSERT_EQ(shape[0], old) << name;
        shape[0] = c.vocab;
      }
    }
  }
  const std::size_t compared = run_contract(c, ck);
  EXPECT_GT(compared, 0u);
}

std::vector<Case> contract_cases() {
  std::vector<Case> out;
  for (const char* f : {"mixtral", "qwen3_moe", "qwen2_moe"}) {
    const std::string family = f;
    // Every tp in {1, 2, 4} with every ep that divides it (E = 8), all ranks local.
    for (int tp : {1, 2, 4}) {
      for (int ep : {1, 2, 4}) {
        if (tp % ep == 0) {
          out.push_back({.family = family, .tp = tp, .ep = ep});
        }
      }
    }
    // Subsets of ranks, in any device order.
    out.push_back({.family = family, .tp = 4, .ep = 2, .local = {3, 0}});
    out.push_back({.family = family, .tp = 4, .ep = 4, .local = {2}});
    out.push_back({.family = family, .tp = 4, .ep = 1, .local = {1}});
    // switch_w13, padding, EPLB with replicas, fused 3-D checkpoint tensors.
    out.push_back({.family = family, .tp = 2, .ep = 2, .switch_w13 = true});
    out.push_back({.family = family, .tp = 4, .ep = 2, .pad = 128});
    out.push_back({.family = family, .tp = 2, .ep = 1, .pad = 128});
    out.push_back({.family = family, .tp = 1, .ep = 1, .eplb = true});
    out.push_back({.family = family, .tp = 4, .ep = 2, .eplb = true});
    out.push_back({.family = family, .tp = 4, .ep = 4, .local = {3, 1}, .eplb = true});
    out.push_back({.family = family, .tp = 2, .ep = 2, .fused_ckpt = true});
    out.push_back(
        {.family = family, .tp = 4, .ep = 2, .local = {2}, .eplb = true, .fused_ckpt = true});
    // Everything at once, from an F32 checkpoint into the config's BF16 params.
    out.push_back({.family = family,
                   .tp = 4,
                   .ep = 2,
                   .local = {1, 2},
                   .switch_w13 = true,
                   .pad = 128,
                   .eplb = true,
                   .dtype = DType::kF32});
    // Pipeline stages: only the stage's layers, edges on the first / last stage.
    out.push_back({.family = family, .tp = 2, .ep = 2, .pp = 2, .pp_rank = 1});
    out.push_back({.family = family, .tp = 2, .ep = 1, .eplb = true, .pp = 2, .pp_rank = 0});
  }
  // Uneven tensor parallelism under model.unaligned_tp=pad, SGLang's CPU sizes:
  // 8 q / 2 kv heads padded to 12 / 3 at tp 3 (rank 2's heads are zeros), 24 / 6 at
  // tp 6 and 64 / 16 at tp 16; every intermediate size (the experts' 64, Mixtral's
  // 128, Qwen2-MoE's dense and shared MLPs) rounded up to a multiple of tp * 32 and
  // the experts' split by moe_tp.
  for (const char* f : {"mixtral", "qwen3_moe", "qwen2_moe"}) {
    const std::string family = f;
    out.push_back({.family = family, .tp = 3, .ep = 1, .unaligned_pad = true, .vocab = 960});
    out.push_back({.family = family,
                   .tp = 3,
                   .ep = 1,
                   .local = {2, 0},
                   .pad = 128,
                   .unaligned_pad = true,
                   .vocab = 960});
    out.push_back({.family = family,
                   .tp = 6,
                   .ep = 2,
                   .switch_w13 = true,
                   .unaligned_pad = true,
                   .vocab = 1152});
    out.push_back(
        {.family = family, .tp = 16, .ep = 8, .local = {0, 5, 15}, .unaligned_pad = true});
    // Even layouts under pad: 2 kv heads at tp 4 become 4 (16 q heads), and the
    // experts' 64 becomes 128.
    out.push_back({.family = family, .tp = 4, .ep = 2, .unaligned_pad = true});
  }
  out.push_back({.family = "qwen2_moe",
                 .tp = 3,
                 .ep = 1,
                 .eplb = true,
                 .unaligned_pad = true,
                 .fused_ckpt = true,
                 .pp = 2,
                 .pp_rank = 1,
                 .vocab = 960});
  // Attention data parallelism (Qwen2-MoE, Qwen3-MoE): attention tp 2 and 1 of tp 4
  // (kv heads replicated at 1 and split at 2), with experts over ep, lm_head with
  // dp_lm_head, on a subset, on a last pipeline stage.
  for (const char* f : {"qwen3_moe", "qwen2_moe"}) {
    const std::string family = f;
    out.push_back({.family = family, .tp = 4, .ep = 2, .attn_dp = 2, .dp_lm_head = true});
    out.push_back({.family = family, .tp = 4, .ep = 1, .attn_dp = 4});
    out.push_back(
        {.family = family, .tp = 4, .ep = 4, .local = {3, 0}, .attn_dp = 4, .dp_lm_head = true});
    out.push_back({.family = family,
                   .tp = 2,
                   .ep = 2,
                   .pp = 2,
                   .pp_rank = 1,
                   .attn_dp = 2,
                   .dp_lm_head = true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Families, MoeContract, ::testing::ValuesIn(contract_cases()), case_name);

// The map of test_eplb really puts two replicas of one expert on one rank, so the
// EPLB cases test "one tensor feeds several slots of one param".
TEST(MoeEplb, TheTestMapHasTwoReplicasOnOneRank) {
  auto m = test_eplb(4, 8);
  EXPECT_EQ(m.at(0).at(0), (std::vector<std::uint64_t>{0, 4}));  // both < 12 / 2
  models::ParallelLayout layout;
  layout.tp = 2;
  layout.ep = 2;
  layout.local_ranks = {0};
  models::ModelOptions options;
  options.eplb = models::parse_eplb_map(eplb_json(m), "eplb.json");
  auto model = models::make_model(synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false),
                                  layout, options);
  models::Route r = model->route(
      tensor_info("model.layers.0.mlp.experts.0.gate_proj.weight", DType::kBF16, {64, 128}));
  ASSERT_EQ(r.kind, models::RouteKind::kPlaced);
  EXPECT_EQ(r.pieces.size(), 2u);
  // Six physical slots per ep rank: w13 has 6 slots.
  const auto& shell = model->shells()[0];
  EXPECT_EQ(shell.params[shell.by_name.at("model.layers.0.mlp.experts.w13_weight")].shape,
            (models::Shape{6, 128, 128}));
}

// ---- Qwen-MoE dense layers and a shared expert of its own width -------------------

// Turns layers that `config` makes dense into Llama MLPs (intermediate_size wide).
Ckpt with_dense_layers(Ckpt ck) {
  const moe_ref::Config rc = moe_ref::read_config(ck.config);
  std::vector<std::pair<std::string, std::vector<std::uint64_t>>> out;
  std::set<std::uint64_t> done;
  for (const auto& [name, shape] : ck.tensors) {
    const std::optional<std::uint64_t> layer = layer_of(name);
    if (layer && !rc.sparse[*layer] && name.find(".mlp.") != std::string::npos) {
      if (done.insert(*layer).second) {
        const std::string p = "model.layers." + std::to_string(*layer) + ".mlp.";
        out.emplace_back(p + "gate_proj.weight", std::vector<std::uint64_t>{rc.dense_I, rc.H});
        out.emplace_back(p + "up_proj.weight", std::vector<std::uint64_t>{rc.dense_I, rc.H});
        out.emplace_back(p + "down_proj.weight", std::vector<std::uint64_t>{rc.H, rc.dense_I});
      }
      continue;
    }
    out.emplace_back(name, shape);
  }
  ck.tensors = std::move(out);
  return ck;
}

TEST(MoeDenseLayers, MlpOnlyLayersAndDecoderSparseStepAreDense) {
  for (const char* family : {"qwen3_moe", "qwen2_moe"}) {
    for (int variant = 0; variant < 2; ++variant) {
      Ckpt ck = synth_ckpt(family, false);
      if (variant == 0) {
        ck.config["mlp_only_layers"] = {1};
      } else {
        ck.config["decoder_sparse_step"] = 2;  // layers 1 and 3 sparse
      }
      ck = with_dense_layers(ck);
      SCOPED_TRACE(std::string(family) + " variant " + std::to_string(variant));
      for (auto [tp, ep] : {std::pair{1, 1}, std::pair{2, 2}, std::pair{4, 2}}) {
        SCOPED_TRACE("tp " + std::to_string(tp) + " ep " + std::to_string(ep));
        Case c{.family = family, .tp = tp, .ep = ep, .eplb = variant == 1};
        EXPECT_GT(run_contract(c, ck), 0u);
      }
      // The dense layer's params are Llama's, not experts.
      models::ParallelLayout layout;
      layout.tp = 2;
      auto m = models::make_model(ck.config, layout);
      const auto& shell = m->shells()[0];
      const std::string dense = variant == 0 ? "model.layers.1.mlp." : "model.layers.0.mlp.";
      const std::string sparse = variant == 0 ? "model.layers.0.mlp." : "model.layers.1.mlp.";
      EXPECT_EQ(shell.params[shell.by_name.at(dense + "gate_up_proj.weight")].shape,
                (models::Shape{256, 128}));
      EXPECT_FALSE(shell.by_name.contains(dense + "experts.w13_weight"));
      EXPECT_TRUE(shell.by_name.contains(sparse + "experts.w13_weight"));
    }
  }
}

TEST(MoeQwen2Shared, AWiderSharedExpertIsATensorParallelMlp) {
  Ckpt ck = synth_ckpt("qwen2_moe", false);
  ck.config["shared_expert_intermediate_size"] = 128;
  for (auto& [name, shape] : ck.tensors) {
    if (name.find("shared_expert.gate_proj") != std::string::npos ||
        name.find("shared_expert.up_proj") != std::string::npos) {
      shape = {128, 128};
    } else if (name.find("shared_expert.down_proj") != std::string::npos) {
      shape = {128, 128};
    }
  }
  for (auto [tp, ep] : {std::pair{2, 1}, std::pair{4, 4}, std::pair{8, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " ep " + std::to_string(ep));
    EXPECT_GT(run_contract({.family = "qwen2_moe", .tp = tp, .ep = ep}, ck), 0u);
  }
  // SGLang never folds Qwen2-MoE's gated shared expert into the routed experts:
  // asking for it is refused, at any width and layout.
  models::ParallelLayout layout;
  layout.tp = 2;
  models::ModelOptions options;
  options.fuse_shared_experts = true;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(ck.config, layout, options); }),
              AllOf(HasSubstr("model.fuse_shared_experts=true"), HasSubstr("Qwen2MoeForCausalLM"),
                    HasSubstr("never fuses")));
  // Families without shared experts refuse it too, rather than ignore it.
  for (const char* family : {"mixtral", "qwen3_moe"}) {
    Ckpt other = synth_ckpt(family, false);
    EXPECT_THAT(
        error_of(Stage::kConfig, [&] { models::make_model(other.config, layout, options); }),
        HasSubstr("has no shared experts"))
        << family;
    options.fuse_shared_experts = false;
    EXPECT_NO_THROW(models::make_model(other.config, layout, options)) << family;
    options.fuse_shared_experts = true;
  }
}

TEST(MoeQwen3, AttentionBiasAddsQkvAndOBiases) {
  Ckpt ck = synth_ckpt("qwen3_moe", false);
  ck.config["attention_bias"] = true;
  const moe_ref::Config rc = moe_ref::read_config(ck.config);
  for (std::uint64_t l = 0; l < rc.L; ++l) {
    const std::string a = "model.layers." + std::to_string(l) + ".self_attn.";
    ck.tensors.emplace_back(a + "q_proj.bias", std::vector<std::uint64_t>{rc.heads * rc.hd});
    ck.tensors.emplace_back(a + "k_proj.bias", std::vector<std::uint64_t>{rc.kv * rc.hd});
    ck.tensors.emplace_back(a + "v_proj.bias", std::vector<std::uint64_t>{rc.kv * rc.hd});
    ck.tensors.emplace_back(a + "o_proj.bias", std::vector<std::uint64_t>{rc.H});
  }
  EXPECT_GT(run_contract({.family = "qwen3_moe", .tp = 4, .ep = 2}, ck), 0u);
}

// ---- real configurations -------------------------------------------------------------

nlohmann::json real_config(const std::string& model) {
  std::ifstream in(::ferry::testing::test_data_path("models/" + model + "/config.json"));
  return nlohmann::json::parse(in);
}

TEST(MoeRealConfigs, ExpertShapesFollowTpAndEp) {
  FERRY_NEED_TEST_DATA();
  struct Want {
    const char* model;
    int tp;
    int ep;
    const char* param;
    models::Shape w13;
    models::Shape w2;
  };
  const std::vector<Want> wants{
      {"mixtral-8x7b-v0.1",
       8,
       8,
       "model.layers.0.block_sparse_moe.experts.",
       {1, 28672, 4096},
       {1, 4096, 14336}},
      {"mixtral-8x7b-v0.1",
       8,
       2,
       "model.layers.31.block_sparse_moe.experts.",
       {4, 7168, 4096},
       {4, 4096, 3584}},
      {"qwen3-30b-a3b", 8, 8, "model.layers.47.mlp.experts.", {16, 1536, 2048}, {16, 2048, 768}},
      {"qwen3-30b-a3b", 4, 1, "model.layers.0.mlp.experts.", {128, 384, 2048}, {128, 2048, 192}},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(std::string(w.model) + " tp " + std::to_string(w.tp) + " ep " +
                 std::to_string(w.ep));
    models::ParallelLayout layout;
    layout.tp = w.tp;
    layout.ep = w.ep;
    layout.local_ranks = {w.tp - 1};
    auto m = models::make_model(real_config(w.model), layout);
    const auto& shell = m->shells()[0];
    const std::string p = w.param;
    ASSERT_TRUE(shell.by_name.contains(p + "w13_weight"));
    EXPECT_EQ(shell.params[shell.by_name.at(p + "w13_weight")].shape, w.w13);
    EXPECT_EQ(shell.params[shell.by_name.at(p + "w2_weight")].shape, w.w2);
  }
}

// ---- bad inputs -------------------------------------------------------------------------

models::ParallelLayout ep_layout(int tp, int ep, std::vector<int> local = {}) {
  models::ParallelLayout l;
  l.tp = tp;
  l.ep = ep;
  l.local_ranks = std::move(local);
  return l;
}

TEST(MoeBadInputs, EpMustDivideTp) {
  for (const char* family : {"mixtral", "qwen3_moe", "qwen2_moe"}) {
    auto config = synth::synth_config(family, "tiny", DType::kBF16, false);
    EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(config, ep_layout(4, 3)); }),
                AllOf(HasSubstr("parallel.ep (3)"), HasSubstr("parallel.tp (4)")));
  }
  EXPECT_THAT(
      error_of(Stage::kConfig, [&] { models::check_expert_parallel(ep_layout(2, 4), 8, {}, "X"); }),
      HasSubstr("parallel.ep (4) must divide parallel.tp (2)"));
}

TEST(MoeBadInputs, ExpertsMustSplitOverEp) {
  auto mixtral = synth::synth_config("mixtral", "tiny", DType::kBF16, false);
  mixtral["num_local_experts"] = 6;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(mixtral, ep_layout(4, 4)); }),
              AllOf(HasSubstr("MixtralForCausalLM"), HasSubstr("num_local_experts (6)"),
                    HasSubstr("ep 4"), HasSubstr("tp 4")));
  auto qwen = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  qwen["num_experts"] = 6;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(qwen, ep_layout(4, 4)); }),
              AllOf(HasSubstr("num_experts (6)"), HasSubstr("ep 4")));
  // With EPLB the physical count must split instead (6 logical on 8 slots: fine).
  models::ModelOptions options;
  options.eplb = models::ModelOptions::Eplb{};
  options.eplb->num_physical_experts = 8;
  for (std::uint64_t l = 0; l < 4; ++l) {
    options.eplb->layers[l] = {{0, 6}, {1}, {2}, {3, 7}, {4}, {5}};
  }
  EXPECT_NO_THROW(models::make_model(qwen, ep_layout(4, 4), options));
  options.eplb->num_physical_experts = 12;
  EXPECT_THAT(
      error_of(Stage::kPlacement, [&] { models::make_model(qwen, ep_layout(8, 8), options); }),
      AllOf(HasSubstr("num_physical_experts (12)"), HasSubstr("ep 8")));
}

TEST(MoeBadInputs, EplbMapMustMatchTheModel) {
  auto config = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  models::ModelOptions options;
  options.eplb = models::parse_eplb_map(eplb_json(test_eplb(4, 8)), "eplb.json");
  options.eplb->layers.erase(2);
  EXPECT_THAT(
      error_of(Stage::kConfig, [&] { models::make_model(config, ep_layout(2, 2), options); }),
      AllOf(HasSubstr("model.eplb_map"), HasSubstr("MoE layer 2")));
  options.eplb = models::parse_eplb_map(eplb_json(test_eplb(4, 8)), "eplb.json");
  options.eplb->layers[1].pop_back();
  EXPECT_THAT(
      error_of(Stage::kConfig, [&] { models::make_model(config, ep_layout(2, 2), options); }),
      AllOf(HasSubstr("layers[\"1\"] lists 7 logical experts"), HasSubstr("num_experts 8")));
}

TEST(MoeUneven, AnIntermediateMoeTpDoesNotSplitIsPaddedPerShare) {
  // (Every element of such layouts is checked by the contract cases at tp 3 / 6.)
  auto qwen = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  qwen["moe_intermediate_size"] = 100;
  const std::string w13 = "model.layers.0.mlp.experts.w13_weight";
  const std::string w2 = "model.layers.0.mlp.experts.w2_weight";
  // Refused by default: SGLang's FusedMoE asserts that moe_tp divides it.
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(qwen, ep_layout(8, 1)); }),
              AllOf(HasSubstr("moe_intermediate_size (100)"), HasSubstr("model.unaligned_tp")));
  // Under pad, moe_tp 8: 100 padded to 256 (a multiple of 8 * 32), 32 rows a share;
  // with pad_moe_intermediate_to 128 each share is 128 wide.
  for (std::uint64_t pad : {0u, 128u}) {
    models::ModelOptions options;
    options.pad_moe_intermediate_to = pad;
    options.unaligned_tp = models::Unaligned::kPad;
    auto m = models::make_model(qwen, ep_layout(8, 1), options);
    const std::uint64_t share = pad == 0 ? 32 : 128;
    for (const models::RankShell& shell : m->shells()) {
      EXPECT_EQ(shell.params[shell.by_name.at(w13)].shape, (models::Shape{8, 2 * share, 128}));
      EXPECT_EQ(shell.params[shell.by_name.at(w2)].shape, (models::Shape{8, 128, share}));
    }
    // Ranks 4..7 hold no real rows: their shares are all fill.
    EXPECT_FALSE(m->fill_pieces().empty());
    // (Pad also pads tiny's 2 kv heads to 8: a note of its own.)
    EXPECT_THAT(m->notes(),
                Contains(AllOf(HasSubstr("moe_intermediate_size 100; padded to 256"),
                               HasSubstr("of the moe-tp ranks (tp rank % (tp / ep)), 4..7 hold"))));
  }
  // moe_tp = 8 / 2 = 4 divides 100: 25 rows a share, no padding.
  auto even = models::make_model(qwen, ep_layout(8, 2));
  EXPECT_EQ(even->shells()[0].params[even->shells()[0].by_name.at(w2)].shape,
            (models::Shape{4, 128, 25}));
  // add_moe_experts refuses a zero width on its own (another family calls it directly).
  models::TableModel m("t", "T", models::normalize_layout(ep_layout(8, 1)), DType::kBF16, false);
  models::MoeLayerSpec spec;
  spec.num_experts = 8;
  spec.hidden = 128;
  spec.intermediate = 0;
  spec.param_prefix = "x.";
  spec.checkpoint_prefix = "x.";
  EXPECT_THAT(
      error_of(Stage::kPlacement, [&] { models::add_moe_experts(m, spec, m.layout(), {}); }),
      HasSubstr("moe_intermediate_size is 0"));
}

TEST(MoeBadInputs, WrongExpertShapeNamesTensorAndParam) {
  auto model = models::make_model(synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false),
                                  ep_layout(2, 2));
  const std::string t = "model.layers.0.mlp.experts.3.gate_proj.weight";
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         model->route(tensor_info(t, DType::kBF16, {65, 128}));
                       }),
              AllOf(HasSubstr("Attempted to load weight " + t + " [65, 128]"),
                    HasSubstr("model.layers.0.mlp.experts.w13_weight"), HasSubstr("[64, 128]")));
  // A remote expert's tensor is checked all the same (rank 1 does not own expert 3).
  auto remote = models::make_model(synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false),
                                   ep_layout(2, 2, {1}));
  const std::string d = "model.layers.0.mlp.experts.3.down_proj.weight";
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         remote->route(tensor_info(d, DType::kBF16, {64, 128}));
                       }),
              AllOf(HasSubstr(d), HasSubstr("w2_weight"), HasSubstr("[128, 64]")));
  EXPECT_EQ(remote->route(tensor_info(d, DType::kBF16, {128, 64})).reason, "remote_expert");
}

TEST(MoeBadInputs, OtherFusedLayoutsAreRefusedNamingTheExpectedShape) {
  // Mixtral tiny: H 128, I 128, so [E, H, 2I] differs from [E, 2I, H].
  auto model = models::make_model(synth::synth_config("mixtral", "tiny", DType::kBF16, false),
                                  ep_layout(2, 2));
  const std::string gu = "model.layers.0.block_sparse_moe.experts.gate_up_proj";
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         model->route(tensor_info(gu, DType::kBF16, {8, 128, 256}));
                       }),
              AllOf(HasSubstr(gu), HasSubstr("[8, 128, 256]"), HasSubstr("[8, 256, 128]")));
  auto qwen = models::make_model(synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false),
                                 ep_layout(2, 2));
  const std::string down = "model.layers.0.mlp.experts.down_proj";
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         qwen->route(tensor_info(down, DType::kBF16, {8, 64, 128}));
                       }),
              AllOf(HasSubstr(down), HasSubstr("[8, 128, 64]")));
}

TEST(MoeBadInputs, NoDraftModel) {
  models::ModelOptions options;
  options.draft = true;
  EXPECT_THAT(error_of(Stage::kConfig,
                       [&] {
                         models::make_model(
                             synth::synth_config("mixtral", "tiny", DType::kBF16, false),
                             ep_layout(1, 1), options);
                       }),
              HasSubstr("model.draft"));
}

TEST(MoeRoutes, CachesAndRemoteExpertsAreDroppedUnread) {
  auto model = models::make_model(synth::synth_config("mixtral", "tiny", DType::kBF16, false),
                                  ep_layout(4, 4, {1}));
  models::Route r =
      model->route(tensor_info("model.layers.2.self_attn.rotary_emb.inv_freq", DType::kF32, {8}));
  EXPECT_EQ(r.kind, models::RouteKind::kDropped);
  EXPECT_EQ(r.reason, "inv_freq");
  // ep rank 1 of 4 owns experts 2 and 3.
  for (std::uint64_t e = 0; e < 8; ++e) {
    models::Route w = model->route(
        tensor_info("model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".w2.weight",
                    DType::kBF16, {128, 128}));
    const bool mine = e == 2 || e == 3;
    EXPECT_EQ(w.kind, mine ? models::RouteKind::kPlaced : models::RouteKind::kDropped) << e;
    EXPECT_EQ(w.reason, mine ? "" : "remote_expert") << e;
    EXPECT_EQ(w.src_end - w.src_begin, mine ? 128u * 128 * 2 : 0u) << e;
  }
  // A fused tensor is read only over the local experts' range.
  models::Route f = model->route(tensor_info("model.layers.0.block_sparse_moe.experts.down_proj",
                                             DType::kBF16, {8, 128, 128}));
  ASSERT_EQ(f.kind, models::RouteKind::kPlaced);
  EXPECT_EQ(f.src_begin, 2u * 128 * 128 * 2);
  EXPECT_EQ(f.src_end, 4u * 128 * 128 * 2);
}

}  // namespace
}  // namespace ferry::testing
