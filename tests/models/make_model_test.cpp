// make_model: dispatch on the architecture, the config fields it reads and their
// defaults, the dtype, the parallel layout, and the errors for each bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/error.hpp"
#include "models/coverage.hpp"
#include "models/model.hpp"
#include "models/reference_util.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;

nlohmann::json llama_config() {
  return tiny_case("llama", DType::kBF16, false).config;
}

models::ParallelLayout tp_layout(int tp, std::vector<int> local = {}) {
  models::ParallelLayout l;
  l.tp = tp;
  l.local_ranks = std::move(local);
  return l;
}

const models::ParamSpec& param(const models::Model& m, const std::string& name,
                               std::size_t local = 0) {
  const auto& shell = m.shells().at(local);
  return shell.params.at(shell.by_name.at(name));
}

TEST(MakeModel, DispatchesOnTheArchitecture) {
  EXPECT_EQ(models::make_model(llama_config(), {})->family(), "llama");
  EXPECT_EQ(models::make_model(tiny_case("qwen2", DType::kBF16, false).config, {})->family(),
            "qwen2");
  EXPECT_EQ(models::make_model(tiny_case("mistral", DType::kBF16, false).config, {})->family(),
            "mistral");
  EXPECT_THAT(models::supported_architectures(),
              ::testing::UnorderedElementsAre(
                  "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                  "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                  "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                  "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                  "Glm4MoeForCausalLM"));
}

TEST(MakeModel, UnknownArchitectureNamesItAndTheSupportedOnes) {
  nlohmann::json c = llama_config();
  c["architectures"] = {"GPT2LMHeadModel"};
  std::string msg = error_of(Stage::kMapping, [&] { models::make_model(c, {}); });
  EXPECT_THAT(msg, AllOf(HasSubstr("GPT2LMHeadModel"), HasSubstr("LlamaForCausalLM"),
                         HasSubstr("Qwen2ForCausalLM"), HasSubstr("MistralForCausalLM")));
  c.erase("architectures");
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("architectures"));
  c["architectures"] = nlohmann::json::array();
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("architectures"));
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(nlohmann::json::array(), {}); }),
              HasSubstr("JSON object"));
}

TEST(MakeModel, MissingOrMalformedFieldsAreNamed) {
  for (const char* key : {"hidden_size", "num_attention_heads", "intermediate_size",
                          "num_hidden_layers", "vocab_size"}) {
    nlohmann::json c = llama_config();
    c.erase(key);
    std::string msg = error_of(Stage::kConfig, [&] { models::make_model(c, {}); });
    EXPECT_THAT(msg, AllOf(HasSubstr(key), HasSubstr("config.json"))) << key;
  }
  nlohmann::json c = llama_config();
  c["hidden_size"] = "128";
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("'hidden_size' must be a positive integer (got \"128\")"));
  c = llama_config();
  c["num_key_value_heads"] = -2;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("num_key_value_heads"));
  c = llama_config();
  c["intermediate_size"] = 256.5;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("intermediate_size"));
  c = llama_config();
  c["tie_word_embeddings"] = "yes";
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("tie_word_embeddings"));
}

TEST(MakeModel, DefaultsForOptionalFields) {
  nlohmann::json c = llama_config();
  c.erase("num_key_value_heads");  // default: as many as attention heads
  c.erase("head_dim");             // default: hidden / heads = 16
  c.erase("tie_word_embeddings");  // default: untied
  auto m = models::make_model(c, tp_layout(2));
  // (4 q + 4 kv + 4 kv heads) * 16 rows at tp 2.
  EXPECT_EQ(param(*m, "model.layers.0.self_attn.qkv_proj.weight").shape,
            (std::vector<std::uint64_t>{192, 128}));
  EXPECT_EQ(m->shells()[0].by_name.count("lm_head.weight"), 1u);

  // An explicit head_dim is honoured even when it is not hidden / heads.
  c = tiny_case("qwen2", DType::kBF16, false).config;
  c["head_dim"] = 32;
  auto q = models::make_model(c, tp_layout(1));
  EXPECT_EQ(param(*q, "model.layers.0.self_attn.qkv_proj.weight").shape,
            (std::vector<std::uint64_t>{(8 + 2 + 2) * 32, 128}));
  EXPECT_EQ(param(*q, "model.layers.0.self_attn.o_proj.weight").shape,
            (std::vector<std::uint64_t>{128, 8 * 32}));
  c.erase("head_dim");
  c["hidden_size"] = 130;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("not divisible by num_attention_heads"));
}

TEST(MakeModel, ParamDtypeComesFromTheConfigOrTheOptions) {
  nlohmann::json c = llama_config();
  c["torch_dtype"] = "float16";
  EXPECT_EQ(param(*models::make_model(c, {}), "model.norm.weight").dtype, DType::kF16);
  models::ModelOptions o;
  o.dtype = DType::kF32;
  auto m = models::make_model(c, {}, o);
  const auto& p = param(*m, "model.norm.weight");
  EXPECT_EQ(p.dtype, DType::kF32);
  EXPECT_EQ(p.nbytes, 128u * 4u);
  // SGLang's _get_and_verify_dtype for "auto" (python/sglang/srt/configs/
  // model_config.py (SGLang 0.5.23)): config.dtype first (newer transformers), then
  // torch_dtype; float32, missing or unknown load as float16, or bfloat16 for a
  // model_type starting with "gemma"; bfloat16 and float16 as given.
  auto dtype_of = [&](const nlohmann::json& config) {
    return param(*models::make_model(config, {}), "model.norm.weight").dtype;
  };
  c["torch_dtype"] = "bfloat16";
  EXPECT_EQ(dtype_of(c), DType::kBF16);
  c["dtype"] = "float16";  // wins over torch_dtype
  EXPECT_EQ(dtype_of(c), DType::kF16);
  c["dtype"] = "float32";
  EXPECT_EQ(dtype_of(c), DType::kF16);
  c["model_type"] = "gemma2";
  EXPECT_EQ(dtype_of(c), DType::kBF16);
  c["model_type"] = "llama";
  c.erase("dtype");
  c.erase("torch_dtype");
  EXPECT_EQ(dtype_of(c), DType::kF16);  // missing
  c["torch_dtype"] = "int8";
  EXPECT_EQ(dtype_of(c), DType::kF16);  // unknown: as float32
  c["torch_dtype"] = 16;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("'torch_dtype' must be a string"));
  EXPECT_EQ(param(*models::make_model(c, {}, o), "model.norm.weight").dtype, DType::kF32);
}

TEST(MakeModel, ParseModelDtype) {
  EXPECT_EQ(models::parse_model_dtype("auto"), std::nullopt);
  EXPECT_EQ(models::parse_model_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(models::parse_model_dtype("half"), DType::kF16);
  EXPECT_EQ(models::parse_model_dtype("float16"), DType::kF16);
  EXPECT_EQ(models::parse_model_dtype("float"), DType::kF32);
  EXPECT_EQ(models::parse_model_dtype("F32"), DType::kF32);
  EXPECT_THAT(error_of(Stage::kConfig, [] { models::parse_model_dtype("fp8"); }),
              HasSubstr("\"fp8\""));
}

TEST(MakeModel, LayoutIsValidatedAndCompleted) {
  nlohmann::json c = llama_config();
  auto m = models::make_model(c, tp_layout(4));
  EXPECT_EQ(m->layout().local_ranks, (std::vector<int>{0, 1, 2, 3}));
  auto sub = models::make_model(c, tp_layout(4, {3, 1}));
  ASSERT_EQ(sub->shells().size(), 2u);
  EXPECT_EQ(sub->shells()[0].tp_rank, 3);
  EXPECT_EQ(sub->shells()[1].tp_rank, 1);
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, tp_layout(0)); }),
              HasSubstr("tp must be >= 1"));
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, tp_layout(4, {4})); }),
              HasSubstr("local rank 4 is outside"));
  EXPECT_THAT(error_of(Stage::kConfig,
                       [&] {
                         models::make_model(c, tp_layout(4, {1, 1}));
                       }),
              HasSubstr("listed twice"));
  models::ParallelLayout l = tp_layout(2);
  l.ep = 2;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, l); }),
              HasSubstr("has no experts"));
  l = tp_layout(2);
  l.pp = 2;
  EXPECT_NO_THROW(models::make_model(c, l));  // pipeline stages: tests/models/stages_test.cpp
  l.pp_rank = 2;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, l); }), HasSubstr("pp_rank 2"));
}

TEST(MakeModel, HeadsAndWidthsTpDoesNotSplitArePadded) {
  // (Every element of padded layouts is checked in dense_reference_test.cpp.)
  nlohmann::json c = llama_config();  // 8 q / 2 kv heads of 16, intermediate 256
  // Refused by default, naming the field and the option.
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(c, tp_layout(16)); }),
              AllOf(HasSubstr("num_attention_heads (8) is not divisible by tensor parallel "
                              "size 16"),
                    HasSubstr("model.unaligned_tp=pad")));
  models::ModelOptions pad;
  pad.unaligned_tp = models::Unaligned::kPad;
  // Under pad, 8 heads over 16 ranks: kv heads padded to 16, q heads to 64; one kv
  // head and 4 q heads a rank, and o_proj 4 heads wide.
  auto m = models::make_model(c, tp_layout(16, {0, 15}), pad);
  EXPECT_EQ(param(*m, "model.layers.0.self_attn.qkv_proj.weight").shape,
            (models::Shape{(4 + 2) * 16, 128}));
  EXPECT_EQ(param(*m, "model.layers.0.self_attn.o_proj.weight", 1).shape, (models::Shape{128, 64}));
  // The operator is told, once (not per layer): the heads, and the intermediate
  // size 256, which is not a multiple of 16 * 32.
  ASSERT_EQ(m->notes().size(), 2u);
  EXPECT_THAT(m->notes(),
              Contains(AllOf(HasSubstr("16 tp ranks do not split num_attention_heads / "
                                       "num_key_value_heads 8 / 2; padded to 64 / 16 with zero "
                                       "heads"),
                             HasSubstr("of the tp ranks, 2..15 hold only zero heads"))));
  EXPECT_TRUE(models::make_model(c, tp_layout(2))->notes().empty());
  EXPECT_TRUE(models::make_model(c, tp_layout(2), pad)->notes().empty());
  // The checkpoint must hold the real heads: a q_proj already padded is refused,
  // naming the shape the config implies.
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         m->route(tensor_info("model.layers.0.self_attn.q_proj.weight",
                                              DType::kBF16, {64 * 16, 128}));
                       }),
              AllOf(HasSubstr("Attempted to load weight"), HasSubstr("[128, 128]")));
  // intermediate 260 at tp 8: padded to 512 (a multiple of 8 * 32), 64 a rank.
  c["intermediate_size"] = 260;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(c, tp_layout(8)); }),
              HasSubstr("intermediate_size (260) is not divisible by tensor parallel size 8"));
  m = models::make_model(c, tp_layout(8, {7}), pad);
  EXPECT_EQ(param(*m, "model.layers.0.mlp.gate_up_proj.weight").shape,
            (models::Shape{2 * 64, 128}));
  EXPECT_EQ(param(*m, "model.layers.0.mlp.down_proj.weight").shape, (models::Shape{128, 64}));
  EXPECT_THAT(m->notes(),
              Contains(AllOf(HasSubstr("intermediate_size 260; padded to 512 with zero rows"),
                             HasSubstr("of the tp ranks, 5..7 hold only zero rows"))));
}

TEST(MakeModel, ARankThatHoldsOnlyPaddedHeadsReadsNoAttentionTensor) {
  // Under pad, 8 q / 2 kv heads at tp 16: ranks 0 and 1 hold the real heads, rank
  // 15 only padding (and of the intermediate size 256, padded to 512, only zero
  // rows). Its attention and MLP tensors are dropped unread, those params are zero
  // fills, and nothing is left unfilled.
  SynthCase ck = tiny_case("llama", DType::kBF16, false);
  models::ModelOptions pad;
  pad.unaligned_tp = models::Unaligned::kPad;
  auto m = models::make_model(ck.config, tp_layout(16, {15}), pad);
  std::vector<models::Route> routes;
  for (const std::string& name : ck.names) {
    models::Route r = m->route(tensor_info(name, DType::kBF16, ck.shapes.at(name)));
    const bool padding_only =
        name.find("self_attn.") != std::string::npos || name.find(".mlp.") != std::string::npos;
    if (padding_only) {
      EXPECT_EQ(r.kind, models::RouteKind::kDropped) << name;
      EXPECT_EQ(r.reason, "no_local_slice") << name;
    } else {
      EXPECT_EQ(r.kind, models::RouteKind::kPlaced) << name;
    }
    routes.push_back(std::move(r));
  }
  EXPECT_TRUE(models::check_coverage(*m, routes).empty());
  // The fills cover the whole qkv and o params of layer 0 on rank 15.
  const models::RankShell& shell = m->shells()[0];
  std::uint64_t qkv_zeroed = 0;
  const std::size_t qkv = shell.by_name.at("model.layers.0.self_attn.qkv_proj.weight");
  for (const models::Piece& p : m->fill_pieces()) {
    if (p.param == qkv) {
      qkv_zeroed += p.rows * p.width_elems * dtype_size(p.dst_dtype);
    }
  }
  EXPECT_EQ(qkv_zeroed, shell.params[qkv].nbytes);
}

TEST(MakeModel, SplitsThatCannotBePaddedAreRefused) {
  nlohmann::json c = llama_config();
  // The vocabulary is padded to a multiple of 64 (1024 here), not further, even
  // under pad.
  models::ModelOptions pad;
  pad.unaligned_tp = models::Unaligned::kPad;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(c, tp_layout(3), pad); }),
              HasSubstr("padded vocab_size (1024) is not divisible by tensor parallel size 3"));
  // Heads that make no attention.
  c["num_key_value_heads"] = 3;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(c, tp_layout(2)); }),
              HasSubstr("num_attention_heads (8) is not a multiple of num_key_value_heads (3)"));
}

TEST(MakeModel, OptionsADenseFamilyIgnoresAreRefused) {
  // Options of MoE and MTP models mean nothing to Llama: refused, naming the
  // option, rather than silently ignored.
  const nlohmann::json c = llama_config();
  auto refusal = [&](const models::ModelOptions& o) {
    return error_of(Stage::kConfig, [&] { models::make_model(c, {}, o); });
  };
  models::ModelOptions draft;
  draft.draft = true;
  EXPECT_THAT(refusal(draft), AllOf(HasSubstr("model.draft"), HasSubstr("no MTP")));
  models::ModelOptions eplb;
  eplb.eplb.emplace().num_physical_experts = 8;
  EXPECT_THAT(refusal(eplb), HasSubstr("model.eplb_map: LlamaForCausalLM has no experts"));
  models::ModelOptions switched;
  switched.switch_w13 = true;
  EXPECT_THAT(refusal(switched), HasSubstr("model.switch_w13"));
  models::ModelOptions padded;
  padded.pad_moe_intermediate_to = 128;
  EXPECT_THAT(refusal(padded), HasSubstr("model.pad_moe_intermediate_to"));
  models::ModelOptions fused;
  fused.fuse_shared_experts = true;
  EXPECT_THAT(refusal(fused),
              HasSubstr("model.fuse_shared_experts: LlamaForCausalLM has no shared experts"));
  models::ModelOptions unfused;
  unfused.fuse_shared_experts = false;  // false (and auto) ask for nothing
  EXPECT_NO_THROW(models::make_model(c, {}, unfused));
}

TEST(MakeModel, ShellsAreSortedWithContiguousStrides) {
  auto m = models::make_model(llama_config(), tp_layout(2));
  for (const auto& shell : m->shells()) {
    // embed, 4 layers x 6 params, norm, lm_head.
    ASSERT_EQ(shell.params.size(), 1u + 4u * 6u + 2u);
    ASSERT_EQ(shell.by_name.size(), shell.params.size());
    for (std::size_t i = 0; i < shell.params.size(); ++i) {
      const auto& p = shell.params[i];
      if (i > 0) {
        EXPECT_LT(shell.params[i - 1].name, p.name);
      }
      EXPECT_EQ(shell.by_name.at(p.name), i);
      ASSERT_EQ(p.strides.size(), p.shape.size());
      std::uint64_t expect = 1;
      for (std::size_t d = p.shape.size(); d > 0; --d) {
        EXPECT_EQ(p.strides[d - 1], expect) << p.name;
        expect *= p.shape[d - 1];
      }
      EXPECT_EQ(p.nbytes, expect * 2) << p.name;
    }
  }
  const auto& shell = m->shells()[0];
  EXPECT_EQ(param(*m, "model.embed_tokens.weight").shape, (std::vector<std::uint64_t>{512, 128}));
  EXPECT_EQ(param(*m, "model.layers.3.mlp.gate_up_proj.weight").shape,
            (std::vector<std::uint64_t>{256, 128}));
  EXPECT_EQ(param(*m, "model.layers.3.mlp.down_proj.weight").shape,
            (std::vector<std::uint64_t>{128, 128}));
  EXPECT_EQ(shell.by_name.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(shell.by_name.count("model.layers.0.self_attn.qkv_proj.bias"), 0u);
}

}  // namespace
}  // namespace ferry::testing
