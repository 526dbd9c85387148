// The families added with the descriptors (Qwen3, Gemma 1-3, Phi-3), proven two ways:
// - contract tests: a synthetic checkpoint of each family is routed, its pieces run
//   by the naive executor, the fills and post-load hooks run, and every element of
//   every local param must equal the independent reference (reference_util.*) at
//   tp 1, 2 and 4;
// - fixtures: SGLang's parameter names and rank-0 shapes at tp 4 for each family's
//   public config (written here: no copy of them is in ../shared/data), derived by
//   hand from the SGLang code each cites.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "models/coverage.hpp"
#include "models/model.hpp"
#include "models/reference_util.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using models::Shape;
using ::testing::AllOf;
using ::testing::HasSubstr;

// ---- synthetic checkpoints -------------------------------------------------------

struct Family {
  std::string name;          // ferry's family name
  std::string architecture;  // config.json's
  bool qk_norm = false;
  bool feedforward_norms = false;  // Gemma 2 / 3
  bool prefused = false;           // Phi-3: qkv_proj and gate_up_proj stored fused
  bool tied = false;
  bool lm_head_tensor = true;  // the checkpoint has lm_head.weight
  bool attention_bias = false;
};

struct Checkpoint {
  nlohmann::json config;
  std::map<std::string, std::vector<std::uint64_t>> shapes;
};

// hidden 64, 4 q / 2 kv heads of 32 (q width 128, not hidden: head_dim is read from
// the config), intermediate 96, vocabulary 300 (padded to 320), 2 layers. Phi-3 has
// no head_dim field (hidden / heads = 16).
Checkpoint make_case(const Family& f) {
  const std::uint64_t hidden = 64, heads = 4, kv = 2, inter = 96, vocab = 300, layers = 2;
  const std::uint64_t hd = f.prefused ? hidden / heads : 32;
  Checkpoint ck;
  ck.config = {{"architectures", {f.architecture}},
               {"hidden_size", hidden},
               {"num_attention_heads", heads},
               {"num_key_value_heads", kv},
               {"intermediate_size", inter},
               {"num_hidden_layers", layers},
               {"vocab_size", vocab},
               {"torch_dtype", "bfloat16"},
               {"tie_word_embeddings", f.tied}};
  if (!f.prefused) {
    ck.config["head_dim"] = hd;
  }
  if (f.attention_bias) {
    ck.config["attention_bias"] = true;
  }
  ck.shapes["model.embed_tokens.weight"] = {vocab, hidden};
  if (f.lm_head_tensor) {
    ck.shapes["lm_head.weight"] = {vocab, hidden};
  }
  ck.shapes["model.norm.weight"] = {hidden};
  for (std::uint64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ck.shapes[p + "input_layernorm.weight"] = {hidden};
    ck.shapes[p + "post_attention_layernorm.weight"] = {hidden};
    if (f.feedforward_norms) {
      ck.shapes[p + "pre_feedforward_layernorm.weight"] = {hidden};
      ck.shapes[p + "post_feedforward_layernorm.weight"] = {hidden};
    }
    if (f.qk_norm) {
      ck.shapes[p + "self_attn.q_norm.weight"] = {hd};
      ck.shapes[p + "self_attn.k_norm.weight"] = {hd};
    }
    if (f.prefused) {
      ck.shapes[p + "self_attn.qkv_proj.weight"] = {(heads + 2 * kv) * hd, hidden};
      ck.shapes[p + "mlp.gate_up_proj.weight"] = {2 * inter, hidden};
    } else {
      ck.shapes[p + "self_attn.q_proj.weight"] = {heads * hd, hidden};
      ck.shapes[p + "self_attn.k_proj.weight"] = {kv * hd, hidden};
      ck.shapes[p + "self_attn.v_proj.weight"] = {kv * hd, hidden};
      ck.shapes[p + "mlp.gate_proj.weight"] = {inter, hidden};
      ck.shapes[p + "mlp.up_proj.weight"] = {inter, hidden};
      if (f.attention_bias) {
        ck.shapes[p + "self_attn.q_proj.bias"] = {heads * hd};
        ck.shapes[p + "self_attn.k_proj.bias"] = {kv * hd};
        ck.shapes[p + "self_attn.v_proj.bias"] = {kv * hd};
        ck.shapes[p + "self_attn.o_proj.bias"] = {hidden};
      }
    }
    ck.shapes[p + "self_attn.o_proj.weight"] = {hidden, heads * hd};
    ck.shapes[p + "mlp.down_proj.weight"] = {hidden, inter};
    ck.shapes[p + "self_attn.rotary_emb.inv_freq"] = {hd / 2};
  }
  return ck;
}

Family qwen3() {
  return {"qwen3", "Qwen3ForCausalLM", true, false, false, false, true, false};
}
Family gemma(int version) {
  const char* arch = version == 1   ? "GemmaForCausalLM"
                     : version == 2 ? "Gemma2ForCausalLM"
                                    : "Gemma3ForCausalLM";
  const char* name = version == 1 ? "gemma" : version == 2 ? "gemma2" : "gemma3";
  // Gemma checkpoints have no lm_head.weight; one that does has it dropped.
  return {name, arch, version == 3, version >= 2, false, true, version == 2, false};
}
Family phi3() {
  return {"phi3", "Phi3ForCausalLM", false, false, true, false, true, false};
}

// ---- contract tests ---------------------------------------------------------------

struct Case {
  Family family;
  int tp = 1;
  // Attention data parallelism (parallel.attn_dp, parallel.dp_lm_head).
  int attn_dp = 1;
  bool dp_lm_head = false;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string name = info.param.family.name + "_tp" + std::to_string(info.param.tp);
  if (info.param.family.attention_bias) {
    name += "_bias";
  }
  if (info.param.family.tied) {
    name += "_tied";
  }
  if (info.param.attn_dp > 1) {
    name += "_attndp" + std::to_string(info.param.attn_dp);
  }
  if (info.param.dp_lm_head) {
    name += "_dplmhead";
  }
  return name;
}

// gtest prints a failing parameter with this (instead of its raw bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name({c, 0});
}

class FamilyReference : public ::testing::TestWithParam<Case> {};

TEST_P(FamilyReference, EveryElementMatchesTheReference) {
  const Case& c = GetParam();
  const Family& f = c.family;
  const Checkpoint ck = make_case(f);
  const TensorMap full = make_checkpoint(ck.shapes, /*seed=*/11);
  const DType dtype = DType::kBF16;

  models::ParallelLayout layout;
  layout.tp = c.tp;
  layout.attn_dp = c.attn_dp;
  layout.dp_lm_head = c.dp_lm_head;
  std::unique_ptr<models::Model> model = models::make_model(ck.config, layout);
  ASSERT_EQ(model->family(), f.name);
  ASSERT_EQ(model->shells().size(), static_cast<std::size_t>(c.tp));

  ParamBuffers buffers = make_buffers(*model);
  std::vector<models::Route> routes;
  for (const auto& [name, shape] : ck.shapes) {
    const HostTensor& t = full.at(name);
    models::Route route = model->route(tensor_info(name, dtype, t.shape));
    if (name.ends_with("rotary_emb.inv_freq")) {
      EXPECT_EQ(route.kind, models::RouteKind::kDropped) << name;
      EXPECT_EQ(route.reason, "inv_freq") << name;
      continue;
    }
    if (name == "lm_head.weight" && f.architecture.starts_with("Gemma")) {
      // Gemma's output projection is the embedding: SGLang skips lm_head.weight.
      EXPECT_EQ(route.kind, models::RouteKind::kDropped) << name;
      EXPECT_EQ(route.reason, "tied_lm_head") << name;
      continue;
    }
    ASSERT_EQ(route.kind, models::RouteKind::kPlaced) << name << " " << route.reason;
    std::vector<std::byte> bytes = encode(t.values, dtype);
    ASSERT_LE(route.src_end, bytes.size()) << name;
    std::span<const std::byte> window(bytes.data() + route.src_begin,
                                      route.src_end - route.src_begin);
    for (const models::Piece& p : route.pieces) {
      ASSERT_NO_THROW(apply_piece(p, window, route.src_begin, buffers)) << name;
    }
    routes.push_back(std::move(route));
  }
  for (const models::Piece& p : model->fill_pieces()) {
    ASSERT_NO_THROW(apply_piece(p, {}, 0, buffers));
  }
  EXPECT_TRUE(models::check_coverage(*model, routes).empty());
  run_hooks(*model, buffers);

  RefConfig rc = ref_config(ck.config);
  // SGLang 0.5.23's Qwen3 under attention data parallelism: Qwen3Attention's
  // qkv_proj / o_proj (parallel_group="attn_tp") and Qwen2Model's embedding
  // (use_attn_tp_group=is_dp_attention_enabled()) over the attention tp group,
  // lm_head too with enable_dp_lm_head (Qwen3ForCausalLM.__init__).
  if (c.attn_dp > 1) {
    const auto attn_tp = static_cast<std::uint64_t>(c.tp / c.attn_dp);
    rc.attn_group = attn_tp;
    rc.embed_group = attn_tp;
    rc.head_group = c.dp_lm_head ? attn_tp : 0;
  }
  for (int rank = 0; rank < c.tp; ++rank) {
    const models::RankShell& shell = model->shells()[static_cast<std::size_t>(rank)];
    TensorMap expected = reference_params(rc, full, rank, c.tp);
    std::vector<std::string> want_names;
    for (const auto& [name, t] : expected) {
      want_names.push_back(name);
    }
    std::vector<std::string> names;
    for (const models::ParamSpec& p : shell.params) {
      if (!p.transient) {  // loaded for a hook (Gemma 1's norms), then freed
        names.push_back(p.name);
      }
    }
    ASSERT_EQ(names, want_names) << "rank " << rank;
    for (std::size_t k = 0; k < shell.params.size(); ++k) {
      const models::ParamSpec& spec = shell.params[k];
      if (spec.transient) {
        continue;
      }
      HostTensor want = expected.at(spec.name);
      ASSERT_EQ(spec.shape, want.shape) << spec.name;
      if (rc.norm_plus_one && spec.name.ends_with("norm.weight")) {
        // SGLang's Gemma adds 1 at load: the sum, rounded once to the param dtype.
        for (float& v : want.values) {
          std::byte b[4];
          encode_one(v + 1.0f, dtype, b);
          v = decode_one(b, dtype);
        }
      }
      const auto& got = buffers.bytes[static_cast<std::size_t>(rank)][k];
      for (std::size_t e = 0; e < want.values.size(); ++e) {
        const float g = decode_one(got.data() + e * dtype_size(dtype), dtype);
        if (g != want.values[e]) {
          FAIL() << spec.name << " rank " << rank << " element " << e << ": got " << g
                 << ", reference " << want.values[e];
        }
      }
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int tp : {1, 2, 4}) {
    out.push_back({qwen3(), tp});
    out.push_back({gemma(1), tp});
    out.push_back({gemma(2), tp});
    out.push_back({gemma(3), tp});
    out.push_back({phi3(), tp});
  }
  Family biased = qwen3();
  biased.attention_bias = true;
  biased.tied = true;
  biased.lm_head_tensor = false;
  out.push_back({biased, 2});
  Family gemma2_bias = gemma(2);
  gemma2_bias.attention_bias = true;
  out.push_back({gemma2_bias, 4});
  // Qwen3 under attention data parallelism: attention tp 2 and 1 of tp 4, 1 of tp
  // 2 (kv heads replicated over an attention group of 2 and split at 1), tied too.
  out.push_back({qwen3(), 4, 2, true});
  out.push_back({qwen3(), 4, 4, false});
  out.push_back({biased, 2, 2, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyReference, ::testing::ValuesIn(cases()), case_name);

TEST(FamilyReference, TheComparisonCatchesAShiftedFusedSplit) {
  // The contract can fail: ferry's own pieces for Phi-3's fused qkv_proj on rank 1,
  // executed one head (16 rows of 64) earlier in the tensor, no longer give the
  // reference's values; executed as routed, they do.
  const Checkpoint ck = make_case(phi3());
  const TensorMap full = make_checkpoint(ck.shapes, 11);
  models::ParallelLayout layout;
  layout.tp = 2;
  auto model = models::make_model(ck.config, layout);
  const std::string name = "model.layers.0.self_attn.qkv_proj.weight";
  const HostTensor& t = full.at(name);
  const std::vector<std::byte> bytes = encode(t.values, DType::kBF16);
  const models::Route route = model->route(tensor_info(name, DType::kBF16, t.shape));
  const RefConfig rc = ref_config(ck.config);
  const std::vector<float> want = reference_params(rc, full, 1, 2).at(name).values;
  const std::size_t param = model->shells()[1].by_name.at(name);
  for (const std::uint64_t shift : {std::uint64_t{0}, std::uint64_t{16 * 64 * 2}}) {
    ParamBuffers buffers = make_buffers(*model);
    for (models::Piece p : route.pieces) {
      if (p.local_rank != 1) {
        continue;
      }
      ASSERT_GE(p.src_offset, shift);
      p.src_offset -= shift;
      ASSERT_NO_THROW(apply_piece(p, bytes, 0, buffers));
    }
    std::vector<float> got(want.size());
    for (std::size_t e = 0; e < got.size(); ++e) {
      got[e] = decode_one(buffers.bytes[1][param].data() + 2 * e, DType::kBF16);
    }
    EXPECT_EQ(got == want, shift == 0) << "shift " << shift;
  }
}

// SGLang 0.5.23's LlamaForCausalLM (so Mistral and Phi-3) builds its ParallelLMHead
// on every pipeline stage and loads it there; Qwen2ForCausalLM and
// Qwen3ForCausalLM make a PPMissingLayer off the last stage.
TEST(FamilyFixtures, LmHeadOnEveryStageWhereSglangBuildsIt) {
  models::ParallelLayout first;
  first.pp = 2;
  first.pp_rank = 0;
  for (const Family& f : {phi3(), qwen3()}) {
    const Checkpoint ck = make_case(f);
    auto m = models::make_model(ck.config, first);
    const bool every = f.architecture == "Phi3ForCausalLM";
    SCOPED_TRACE(f.architecture);
    EXPECT_EQ(m->shells()[0].by_name.count("lm_head.weight"), every ? 1u : 0u);
    EXPECT_EQ(m->shells()[0].by_name.count("model.norm.weight"), 0u);
  }
}

// SGLang 0.5.23's GemmaForCausalLM.load_weights adds 1.0 to the checkpoint tensor
// in its own dtype (`loaded_weight += 1.0`) and the weight_loader then copies it into
// the param: the sum is rounded in the checkpoint's dtype first. 2^-9 + 1 is 1.0 in
// BF16 but exact in F32, so a BF16 checkpoint loaded into an F32 model holds 1.0,
// and an F32 checkpoint 1 + 2^-9 (synthetic values are multiples of 1/128, whose
// sums are exact everywhere: they cannot show this).
TEST(FamilyFixtures, GemmaNormPlusOneRoundsInTheCheckpointsDtype) {
  for (const char* declared : {"bfloat16", "float32"}) {
    nlohmann::json config = make_case(gemma(1)).config;
    config["torch_dtype"] = declared;
    config.erase("dtype");
    models::ModelOptions f32;
    f32.dtype = DType::kF32;
    auto m = models::make_model(config, {}, f32);
    const models::RankShell& shell = m->shells()[0];
    const std::string norm = "model.layers.0.input_layernorm.weight";
    const std::size_t twin = shell.by_name.at(norm + "_loaded");
    ASSERT_TRUE(shell.params[twin].transient);
    ASSERT_EQ(shell.params[twin].dtype, DType::kF32);
    ParamBuffers buffers = make_buffers(*m);
    const float x = 1.0f / 512;  // 2^-9, exact in BF16
    for (std::size_t e = 0; e < shell.params[twin].nbytes / 4; ++e) {
      std::memcpy(buffers.bytes[0][twin].data() + e * 4, &x, 4);
    }
    run_hooks(*m, buffers);
    const std::size_t k = shell.by_name.at(norm);
    float got = 0;
    std::memcpy(&got, buffers.bytes[0][k].data(), 4);
    SCOPED_TRACE(declared);
    EXPECT_EQ(shell.params[k].dtype, DType::kF32);
    EXPECT_EQ(got, std::string(declared) == "bfloat16" ? 1.0f : 1.0f + x);
  }
}

TEST(FamilyErrors, GemmaIsNotSplitIntoPipelineStages) {
  models::ParallelLayout layout;
  layout.pp = 2;
  EXPECT_THAT(error_of(Stage::kConfig,
                       [&] { models::make_model(make_case(gemma(2)).config, layout); }),
              HasSubstr("Gemma2ForCausalLM into pipeline stages"));
}

TEST(FamilyErrors, MissingFieldsAndUntakenOptionsAreNamed) {
  for (const Family& f : {qwen3(), gemma(1), gemma(3), phi3()}) {
    nlohmann::json config = make_case(f).config;
    config.erase("intermediate_size");
    EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(config, {}); }),
                HasSubstr("intermediate_size"))
        << f.name;
    models::ModelOptions draft;
    draft.draft = true;
    EXPECT_THAT(error_of(Stage::kConfig,
                         [&] { models::make_model(make_case(f).config, {}, draft); }),
                HasSubstr("model.draft: " + f.architecture + " has no MTP"))
        << f.name;
  }
  // Heads tp does not split are refused, naming the fields.
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         models::ParallelLayout l;
                         l.tp = 3;
                         models::make_model(make_case(qwen3()).config, l);
                       }),
              HasSubstr("num_attention_heads"));
}

TEST(FamilyErrors, AFusedTensorOfTheWrongShapeIsRefused) {
  const Checkpoint ck = make_case(phi3());
  auto model = models::make_model(ck.config, {});
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         model->route(tensor_info("model.layers.0.self_attn.qkv_proj.weight",
                                                  DType::kBF16, {100, 64}));
                       }),
              AllOf(HasSubstr("model.layers.0.self_attn.qkv_proj.weight [100, 64]"),
                    HasSubstr("must be [128, 64]")));
}

// ---- SGLang fixtures --------------------------------------------------------------

struct Fixture {
  nlohmann::json config;
  std::map<std::string, Shape> params;  // every param of layer 0, and the edges named
  std::set<std::string> absent;         // params SGLang does not have
};

// Rank 0 of tp 4: the listed params have these shapes, layer 0 holds exactly the
// listed layer-0 params, and the absent ones do not exist.
void expect_fixture(const Fixture& f) {
  SCOPED_TRACE(f.config["architectures"][0].get<std::string>());
  models::ParallelLayout layout;
  layout.tp = 4;
  layout.local_ranks = {0};
  auto m = models::make_model(f.config, layout);
  const models::RankShell& shell = m->shells().at(0);
  std::set<std::string> got;
  for (const models::ParamSpec& p : shell.params) {
    if (p.name.starts_with("model.layers.0.") && !p.transient) {  // transients are freed
      got.insert(p.name);
    }
  }
  std::set<std::string> want;
  for (const auto& [name, shape] : f.params) {
    auto it = shell.by_name.find(name);
    ASSERT_NE(it, shell.by_name.end()) << "no param " << name;
    EXPECT_EQ(shell.params[it->second].shape, shape) << name;
    if (name.starts_with("model.layers.0.")) {
      want.insert(name);
    }
  }
  EXPECT_EQ(got, want);
  for (const std::string& name : f.absent) {
    EXPECT_EQ(shell.by_name.count(name), 0u) << name;
  }
}

// The layer-0 params every one of these families has, at tp 4 rank 0.
std::map<std::string, Shape> layer0(Shape qkv, Shape o, Shape gate_up, Shape down,
                                    std::uint64_t hidden) {
  const std::string p = "model.layers.0.";
  return {{p + "self_attn.qkv_proj.weight", qkv},     {p + "self_attn.o_proj.weight", o},
          {p + "mlp.gate_up_proj.weight", gate_up},   {p + "mlp.down_proj.weight", down},
          {p + "input_layernorm.weight", {hidden}},   {p + "post_attention_layernorm.weight", {hidden}}};
}

// python/sglang/srt/models/qwen3.py (SGLang 0.5.23)
// (Qwen3Attention: QKVParallelLinear(hidden, head_dim, 32, 8), q_norm / k_norm
// RMSNorm(head_dim); Qwen2MLP; ParallelLMHead untied). Qwen/Qwen3-8B's config.
TEST(FamilyFixtures, Qwen3_8bAtTp4) {
  Fixture f;
  f.config = {{"architectures", {"Qwen3ForCausalLM"}}, {"hidden_size", 4096},
              {"intermediate_size", 12288},            {"num_attention_heads", 32},
              {"num_key_value_heads", 8},              {"head_dim", 128},
              {"num_hidden_layers", 36},               {"vocab_size", 151936},
              {"tie_word_embeddings", false},          {"attention_bias", false},
              {"torch_dtype", "bfloat16"}};
  f.params = layer0({1536, 4096}, {4096, 1024}, {6144, 4096}, {4096, 3072}, 4096);
  f.params["model.layers.0.self_attn.q_norm.weight"] = {128};
  f.params["model.layers.0.self_attn.k_norm.weight"] = {128};
  f.params["model.embed_tokens.weight"] = {37984, 4096};  // 151936 = 2374 * 64, / 4
  f.params["lm_head.weight"] = {37984, 4096};
  f.params["model.norm.weight"] = {4096};
  expect_fixture(f);
}

// python/sglang/srt/models/gemma.py (SGLang 0.5.23)
// (GemmaAttention with head_dim 256 from the config, no biases; no lm_head module).
// google/gemma-7b's config (tie_word_embeddings absent: GemmaConfig's default true).
TEST(FamilyFixtures, Gemma7bAtTp4) {
  Fixture f;
  f.config = {{"architectures", {"GemmaForCausalLM"}}, {"hidden_size", 3072},
              {"intermediate_size", 24576},            {"num_attention_heads", 16},
              {"num_key_value_heads", 16},             {"head_dim", 256},
              {"num_hidden_layers", 28},               {"vocab_size", 256000},
              {"torch_dtype", "bfloat16"},             {"model_type", "gemma"}};
  f.params = layer0({3072, 3072}, {3072, 1024}, {12288, 3072}, {3072, 6144}, 3072);
  f.params["model.embed_tokens.weight"] = {64000, 3072};
  f.params["model.norm.weight"] = {3072};
  f.absent = {"lm_head.weight"};
  expect_fixture(f);
}

// python/sglang/srt/models/gemma2.py (SGLang 0.5.23)
// (Gemma2DecoderLayer's four norms; no lm_head module). google/gemma-2-9b's config.
TEST(FamilyFixtures, Gemma2_9bAtTp4) {
  Fixture f;
  f.config = {{"architectures", {"Gemma2ForCausalLM"}}, {"hidden_size", 3584},
              {"intermediate_size", 14336},             {"num_attention_heads", 16},
              {"num_key_value_heads", 8},               {"head_dim", 256},
              {"num_hidden_layers", 42},                {"vocab_size", 256000},
              {"model_type", "gemma2"}};
  f.params = layer0({2048, 3584}, {3584, 1024}, {7168, 3584}, {3584, 3584}, 3584);
  f.params["model.layers.0.pre_feedforward_layernorm.weight"] = {3584};
  f.params["model.layers.0.post_feedforward_layernorm.weight"] = {3584};
  f.params["model.embed_tokens.weight"] = {64000, 3584};
  f.absent = {"lm_head.weight"};
  expect_fixture(f);
}

// python/sglang/srt/models/gemma3_causal.py (SGLang 0.5.23)
// (Gemma3TextScaledWordEmbedding is a torch nn.Embedding: whole and unpadded on every
// rank; QKVParallelLinear with 1 kv head replicated over 4 ranks; q_norm / k_norm
// Gemma3RMSNorm(head_dim); lm_head is the embedding). google/gemma-3-1b-it's config.
TEST(FamilyFixtures, Gemma3_1bAtTp4) {
  Fixture f;
  f.config = {{"architectures", {"Gemma3ForCausalLM"}}, {"hidden_size", 1152},
              {"intermediate_size", 6912},              {"num_attention_heads", 4},
              {"num_key_value_heads", 1},               {"head_dim", 256},
              {"num_hidden_layers", 26},                {"vocab_size", 262144},
              {"torch_dtype", "bfloat16"},              {"model_type", "gemma3_text"}};
  f.params = layer0({768, 1152}, {1152, 256}, {3456, 1152}, {1152, 1728}, 1152);
  f.params["model.layers.0.pre_feedforward_layernorm.weight"] = {1152};
  f.params["model.layers.0.post_feedforward_layernorm.weight"] = {1152};
  f.params["model.layers.0.self_attn.q_norm.weight"] = {256};
  f.params["model.layers.0.self_attn.k_norm.weight"] = {256};
  f.params["model.embed_tokens.weight"] = {262144, 1152};
  f.absent = {"lm_head.weight"};
  expect_fixture(f);
}

// python/sglang/srt/models/llama.py (SGLang 0.5.23)
// (Phi3ForCausalLM(LlamaForCausalLM); head_dim = hidden / heads = 96).
// microsoft/Phi-3-mini-4k-instruct's config.
TEST(FamilyFixtures, Phi3MiniAtTp4) {
  Fixture f;
  f.config = {{"architectures", {"Phi3ForCausalLM"}}, {"hidden_size", 3072},
              {"intermediate_size", 8192},            {"num_attention_heads", 32},
              {"num_key_value_heads", 32},            {"num_hidden_layers", 32},
              {"vocab_size", 32064},                  {"tie_word_embeddings", false},
              {"torch_dtype", "bfloat16"}};
  f.params = layer0({2304, 3072}, {3072, 768}, {4096, 3072}, {3072, 2048}, 3072);
  f.params["model.embed_tokens.weight"] = {8016, 3072};  // 32064 = 501 * 64, / 4
  f.params["lm_head.weight"] = {8016, 3072};
  expect_fixture(f);
  // Rank 0's k rows come from rows 3072.. of the fused tensor (k after all 32 q
  // heads of 96), its up rows from 8192.. (after all of gate).
  models::ParallelLayout layout;
  layout.tp = 4;
  layout.local_ranks = {0};
  auto m = models::make_model(f.config, layout);
  auto pieces_of = [&](const std::string& name, std::vector<std::uint64_t> shape) {
    return m->route(tensor_info(name, DType::kBF16, shape)).pieces;
  };
  const std::uint64_t row = 3072 * 2;  // bytes of one row
  std::vector<std::uint64_t> starts;
  for (const models::Piece& p : pieces_of("model.layers.0.self_attn.qkv_proj.weight", {9216, 3072})) {
    starts.push_back(p.src_offset / row);
  }
  EXPECT_THAT(starts, ::testing::UnorderedElementsAre(0u, 3072u, 6144u));
  starts.clear();
  for (const models::Piece& p : pieces_of("model.layers.0.mlp.gate_up_proj.weight", {16384, 3072})) {
    starts.push_back(p.src_offset / row);
  }
  EXPECT_THAT(starts, ::testing::UnorderedElementsAre(0u, 8192u));
}

}  // namespace
}  // namespace ferry::testing
