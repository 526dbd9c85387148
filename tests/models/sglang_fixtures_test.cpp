// Golden fixtures taken from SGLang's own rules, not from ferry's formulas: the
// parameter names and per-rank shapes SGLang builds for real models, and its
// shared-expert fusion decisions. Each table was derived by hand from the SGLang
// code it cites (sgl-project/sglang; the files and commits are named per fixture),
// with the configs in ../shared/data; ferry's shells must match them exactly.
//
// Common rules used in the derivations (cited once):
// - VocabParallelEmbedding / ParallelLMHead (python/sglang/srt/layers/
//   vocab_parallel_embedding.py (SGLang 0.5.23)): the vocabulary is padded to a
//   multiple of DEFAULT_VOCAB_PADDING_SIZE = 64 and divided by tp.
// - QKVParallelLinear (python/sglang/srt/layers/linear.py (SGLang 0.5.23)): rows
//   (q heads / tp + 2 * max(1, kv heads / tp)) * head_dim; kv heads are replicated
//   when tp > kv heads. MergedColumnParallelLinear: gate rows then up rows, each
//   intermediate / tp. RowParallelLinear: [out, in / tp].
// - FusedMoE / UnquantizedFusedMoEMethod.create_weights (python/sglang/srt/layers/
//   moe/fused_moe_triton/layer.py (SGLang 0.5.23), quantization/unquant.py
//   (SGLang 0.5.23)): w13_weight [experts / ep, 2 * I / moe_tp, H], w2_weight
//   [experts / ep, H, I / moe_tp] with moe_tp = tp / ep.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "models/coverage.hpp"
#include "models/deepseek.hpp"
#include "models/model.hpp"
#include "models/reference_util.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"
#include "testing/test_data.hpp"

namespace ferry::testing {
namespace {

using models::Shape;
using ::testing::HasSubstr;

nlohmann::json config_of(const std::string& model) {
  std::ifstream in(test_data_path("models/" + model + "/config.json"));
  EXPECT_TRUE(in) << model;
  nlohmann::json c = nlohmann::json::parse(in);
  // The BF16 layout of an FP8 checkpoint (quantized checkpoints are a later issue).
  c.erase("quantization_config");
  return c;
}

struct Fixture {
  std::string model;  // folder in ../shared/data/models
  int tp = 8;
  int ep = 1;
  int rank = 0;                 // the tp rank whose shell is compared
  std::string layer;            // "model.layers.<i>.": every param under it is listed
  std::map<std::string, Shape> params;  // names relative to the model (layer ones too)
  models::Unaligned unaligned = models::Unaligned::kRefuse;
  // SGLang's DeepSeek deployment layouts (models::ParallelLayout).
  int attn_dp = 1;
  bool dp_lm_head = false;
  int moe_dense_tp = 0;
  bool deepep = false;
  // The config, where it is not in ../shared/data (null: config_of(model)).
  nlohmann::json config = nullptr;
};

void expect_fixture(const Fixture& f) {
  SCOPED_TRACE(f.model + " tp " + std::to_string(f.tp) + " ep " + std::to_string(f.ep));
  models::ParallelLayout layout;
  layout.tp = f.tp;
  layout.ep = f.ep;
  layout.local_ranks = {f.rank};
  layout.attn_dp = f.attn_dp;
  layout.dp_lm_head = f.dp_lm_head;
  layout.moe_dense_tp = f.moe_dense_tp;
  layout.moe_a2a =
      f.deepep ? models::ParallelLayout::MoeA2a::kDeepep : models::ParallelLayout::MoeA2a::kNone;
  models::ModelOptions options;
  options.unaligned_tp = f.unaligned;
  std::unique_ptr<models::Model> m =
      models::make_model(f.config.is_null() ? config_of(f.model) : f.config, layout, options);
  const models::RankShell& shell = m->shells().at(0);
  for (const auto& [name, shape] : f.params) {
    auto it = shell.by_name.find(name);
    ASSERT_NE(it, shell.by_name.end()) << "no param " << name;
    EXPECT_EQ(shell.params[it->second].shape, shape) << name;
  }
  // The layer holds exactly the fixture's params, no more.
  std::set<std::string> got;
  for (const models::ParamSpec& p : shell.params) {
    if (p.name.rfind(f.layer, 0) == 0) {
      got.insert(p.name);
    }
  }
  std::set<std::string> want;
  for (const auto& [name, shape] : f.params) {
    if (name.rfind(f.layer, 0) == 0) {
      want.insert(name);
    }
  }
  EXPECT_EQ(got, want) << f.layer;
}

// `common` at tp 8 and `ep`, plus the layer's fused experts (`experts` is their
// param prefix) of the shapes given.
void expect_with_experts(const std::string& model, int ep, int rank, const std::string& layer,
                         std::map<std::string, Shape> params, const std::string& experts,
                         Shape w13, Shape w2) {
  params[experts + "w13_weight"] = std::move(w13);
  params[experts + "w2_weight"] = std::move(w2);
  expect_fixture({model, 8, ep, rank, layer, std::move(params)});
}

// python/sglang/srt/models/llama.py (SGLang 0.5.23) (LlamaAttention, LlamaMLP,
// LlamaForCausalLM): Llama-3.1-8B, H 4096, 32 q / 8 kv heads of 128, I 14336,
// vocabulary 128256 (2004 * 64), untied.
TEST(SglangFixtures, Llama31_8bAtTp8) {
  FERRY_NEED_TEST_DATA();
  const std::string l = "model.layers.5.";
  expect_fixture({"llama-3.1-8b", 8, 1, 3, l,
                  {{"model.embed_tokens.weight", {16032, 4096}},
                   {"lm_head.weight", {16032, 4096}},
                   {"model.norm.weight", {4096}},
                   {l + "self_attn.qkv_proj.weight", {(4 + 2 * 1) * 128, 4096}},
                   {l + "self_attn.o_proj.weight", {4096, 512}},
                   {l + "mlp.gate_up_proj.weight", {2 * 1792, 4096}},
                   {l + "mlp.down_proj.weight", {4096, 1792}},
                   {l + "input_layernorm.weight", {4096}},
                   {l + "post_attention_layernorm.weight", {4096}}}});
}

// python/sglang/srt/models/qwen2.py (SGLang 0.5.23) (Qwen2Attention: q/k/v biases,
// none on o_proj): Qwen2.5-7B, H 3584, 28 q / 4 kv heads of 128, I 18944,
// vocabulary 152064 (2376 * 64).
TEST(SglangFixtures, Qwen25_7bAtTp4AndTp8) {
  FERRY_NEED_TEST_DATA();
  const std::string l = "model.layers.0.";
  expect_fixture({"qwen2.5-7b", 4, 1, 1, l,
                  {{"model.embed_tokens.weight", {38016, 3584}},
                   {"lm_head.weight", {38016, 3584}},
                   {l + "self_attn.qkv_proj.weight", {(7 + 2 * 1) * 128, 3584}},
                   {l + "self_attn.qkv_proj.bias", {(7 + 2 * 1) * 128}},
                   {l + "self_attn.o_proj.weight", {3584, 896}},
                   {l + "mlp.gate_up_proj.weight", {2 * 4736, 3584}},
                   {l + "mlp.down_proj.weight", {3584, 4736}},
                   {l + "input_layernorm.weight", {3584}},
                   {l + "post_attention_layernorm.weight", {3584}}}});
  // tp 8: LlamaAttention-style `assert self.total_num_heads % tp_size == 0` fails on
  // GPU (28 % 8), so the default refuses it.
  models::ParallelLayout tp8;
  tp8.tp = 8;
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] { models::make_model(config_of("qwen2.5-7b"), tp8); }),
              HasSubstr("num_attention_heads (28) is not divisible by tensor parallel size 8"));
  // Under pad, adjust_config_with_unaligned_cpu_tp (python/sglang/srt/configs/
  // update_config.py (SGLang 0.5.23)): kv 4 -> 8, q -> 8 * 7 = 56 (7 q + 1 kv a rank);
  // 18944 is a multiple of 8 * 32 and stays (2368 a rank).
  expect_fixture({"qwen2.5-7b",
                  8,
                  1,
                  6,
                  l,
                  {{"model.embed_tokens.weight", {19008, 3584}},
                   {l + "self_attn.qkv_proj.weight", {(7 + 2 * 1) * 128, 3584}},
                   {l + "self_attn.qkv_proj.bias", {(7 + 2 * 1) * 128}},
                   {l + "self_attn.o_proj.weight", {3584, 896}},
                   {l + "mlp.gate_up_proj.weight", {2 * 2368, 3584}},
                   {l + "mlp.down_proj.weight", {3584, 2368}},
                   {l + "input_layernorm.weight", {3584}},
                   {l + "post_attention_layernorm.weight", {3584}}},
                  models::Unaligned::kPad});
}

// python/sglang/srt/models/mixtral.py (SGLang 0.5.23) (MixtralAttention,
// MixtralMoE): Mixtral-8x7B, H 4096, 32 q / 8 kv heads of 128, 8 experts of I 14336,
// vocabulary 32000 (500 * 64).
TEST(SglangFixtures, Mixtral8x7bAtTp8Ep1AndEp8) {
  FERRY_NEED_TEST_DATA();
  const std::string l = "model.layers.9.";
  std::map<std::string, Shape> common{
      {"model.embed_tokens.weight", {4000, 4096}},
      {"lm_head.weight", {4000, 4096}},
      {l + "self_attn.qkv_proj.weight", {768, 4096}},
      {l + "self_attn.o_proj.weight", {4096, 512}},
      {l + "block_sparse_moe.gate.weight", {8, 4096}},
      {l + "input_layernorm.weight", {4096}},
      {l + "post_attention_layernorm.weight", {4096}}};
  const std::string experts = l + "block_sparse_moe.experts.";
  expect_with_experts("mixtral-8x7b-v0.1", 1, 2, l, common, experts, {8, 2 * 1792, 4096},
                      {8, 4096, 1792});
  expect_with_experts("mixtral-8x7b-v0.1", 8, 2, l, common, experts, {1, 2 * 14336, 4096},
                      {1, 4096, 14336});
}

// python/sglang/srt/models/qwen3_moe.py (SGLang 0.5.23) (Qwen3MoeAttention with
// q_norm / k_norm, Qwen3MoeSparseMoeBlock): Qwen3-30B-A3B, H 2048, 32 q / 4 kv heads
// of 128 (kv replicated twice at tp 8), 128 experts of I 768, vocabulary 151936
// (2374 * 64).
TEST(SglangFixtures, Qwen3_30bA3bAtTp8Ep1AndEp8) {
  FERRY_NEED_TEST_DATA();
  const std::string l = "model.layers.11.";
  std::map<std::string, Shape> common{
      {"model.embed_tokens.weight", {18992, 2048}},
      {"lm_head.weight", {18992, 2048}},
      {l + "self_attn.qkv_proj.weight", {(4 + 2 * 1) * 128, 2048}},
      {l + "self_attn.o_proj.weight", {2048, 512}},
      {l + "self_attn.q_norm.weight", {128}},
      {l + "self_attn.k_norm.weight", {128}},
      {l + "mlp.gate.weight", {128, 2048}},
      {l + "input_layernorm.weight", {2048}},
      {l + "post_attention_layernorm.weight", {2048}}};
  const std::string experts = l + "mlp.experts.";
  expect_with_experts("qwen3-30b-a3b", 1, 7, l, common, experts, {128, 2 * 96, 2048},
                      {128, 2048, 96});
  expect_with_experts("qwen3-30b-a3b", 8, 7, l, common, experts, {16, 2 * 768, 2048},
                      {16, 2048, 768});
}

// python/sglang/srt/models/deepseek_v2.py (SGLang 0.5.23) (DeepseekV2AttentionMLA,
// DeepseekV2MLP, DeepseekV2MoE, MoEGate, post_load_weights): DeepSeek-V3, H 7168,
// 128 heads (16 a rank), q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v 128,
// dense I 18432 on layers 0-2, 256 experts of I 2048 and 1 shared expert,
// vocabulary 129280 (2020 * 64). At ep 1 SGLang fuses the shared expert as expert
// 256 (shared_experts_fusion_disable_reason); at ep 8 it does not, and the shared
// expert is a tensor-parallel DeepseekV2MLP of 1 * 2048.
TEST(SglangFixtures, DeepseekV3AtTp8Ep1AndEp8) {
  FERRY_NEED_TEST_DATA();
  const std::string l = "model.layers.3.";
  const std::string a = l + "self_attn.";
  std::map<std::string, Shape> common{
      {"model.embed_tokens.weight", {16160, 7168}},
      {"lm_head.weight", {16160, 7168}},
      {"model.layers.2.mlp.gate_up_proj.weight", {2 * 2304, 7168}},
      {"model.layers.2.mlp.down_proj.weight", {7168, 2304}},
      {a + "fused_qkv_a_proj_with_mqa.weight", {1536 + 512 + 64, 7168}},
      {a + "q_a_layernorm.weight", {1536}},
      {a + "kv_a_layernorm.weight", {512}},
      {a + "q_b_proj.weight", {16 * 192, 1536}},
      {a + "kv_b_proj.weight", {16 * 256, 512}},
      {a + "o_proj.weight", {7168, 16 * 128}},
      {a + "w_kc", {16, 128, 512}},
      {a + "w_vc", {16, 512, 128}},
      {l + "mlp.gate.weight", {256, 7168}},
      {l + "mlp.gate.e_score_correction_bias", {256}},
      {l + "input_layernorm.weight", {7168}},
      {l + "post_attention_layernorm.weight", {7168}}};
  const std::string experts = l + "mlp.experts.";
  expect_with_experts("deepseek-v3", 1, 4, l, common, experts, {257, 2 * 256, 7168},
                      {257, 7168, 256});
  std::map<std::string, Shape> unfused = common;
  unfused[l + "mlp.shared_experts.gate_up_proj.weight"] = {2 * 256, 7168};
  unfused[l + "mlp.shared_experts.down_proj.weight"] = {7168, 256};
  expect_with_experts("deepseek-v3", 8, 4, l, unfused, experts, {32, 2 * 2048, 7168},
                      {32, 7168, 2048});
}

// SGLang's DeepSeek deployment layouts, for DeepSeek-V3 at tp 8, from SGLang 0.5.23,
// python/sglang/srt/models/deepseek_v2.py, and runtime_context.py's
// derive_attn_tp_size / derive_attention_ranks (attn_tp_size = tp_size //
// attn_dp_size, attn_tp_rank = tp_rank % attn_tp_size):
// - attention DP 8 (attention tp 1) and 2 (attention tp 4):
//   DeepseekV2AttentionMLA builds q_b_proj, kv_b_proj, o_proj with (attn_tp_rank,
//   attn_tp_size), fused_qkv_a_proj_with_mqa is a ReplicatedLinear;
//   DeepseekV2Model.__init__'s VocabParallelEmbedding(**get_embedding_tp_kwargs())
//   splits over the attention tp group (use_attn_tp_group=is_dp_attention_enabled();
//   at commit 3e4a39ee7330 it was enable_tp=not enable_dp_attention, whole);
//   ParallelLMHead(use_attn_tp_group=enable_dp_lm_head) splits over all 8 ranks
//   unless enable_dp_lm_head; the dense layers' DeepseekV2MLP and the experts keep
//   the full tp world;
// - moe_dense_tp_size 1 (enable_moe_dense_fully_dp): DeepseekV2DecoderLayer builds a
//   dense layer's DeepseekV2MLP with tp_rank 0, tp_size 1;
// - moe_a2a_backend deepep (ep 8 = tp): DeepseekV2MoE builds shared_experts with
//   tp_rank 0, tp_size 1; routed experts 256 / 8 a rank with moe_tp 1.
TEST(SglangFixtures, DeepseekV3DeploymentLayoutsAtTp8) {
  FERRY_NEED_TEST_DATA();
  const std::string l = "model.layers.3.";
  const std::string a = l + "self_attn.";
  const std::string experts = l + "mlp.experts.";
  // attention tp 1 (dp 8), rank 5: every MLA head, the whole embedding (an
  // attention tp group of 1).
  std::map<std::string, Shape> dp8{
      {"model.embed_tokens.weight", {129280, 7168}},
      {"lm_head.weight", {16160, 7168}},
      {"model.layers.2.mlp.gate_up_proj.weight", {2 * 2304, 7168}},
      {"model.layers.2.mlp.down_proj.weight", {7168, 2304}},
      {a + "fused_qkv_a_proj_with_mqa.weight", {2112, 7168}},
      {a + "q_a_layernorm.weight", {1536}},
      {a + "kv_a_layernorm.weight", {512}},
      {a + "q_b_proj.weight", {24576, 1536}},
      {a + "kv_b_proj.weight", {32768, 512}},
      {a + "o_proj.weight", {7168, 16384}},
      {a + "w_kc", {128, 128, 512}},
      {a + "w_vc", {128, 512, 128}},
      {l + "mlp.gate.weight", {256, 7168}},
      {l + "mlp.gate.e_score_correction_bias", {256}},
      {l + "input_layernorm.weight", {7168}},
      {l + "post_attention_layernorm.weight", {7168}},
      {l + "mlp.shared_experts.gate_up_proj.weight", {2 * 256, 7168}},
      {l + "mlp.shared_experts.down_proj.weight", {7168, 256}},
      {experts + "w13_weight", {32, 2 * 2048, 7168}},
      {experts + "w2_weight", {32, 7168, 2048}}};
  Fixture f{"deepseek-v3", 8, 8, 5, l, dp8};
  f.attn_dp = 8;
  expect_fixture(f);
  // ... with enable_dp_lm_head: lm_head over the attention group of 1.
  f.params["lm_head.weight"] = {129280, 7168};
  f.dp_lm_head = true;
  expect_fixture(f);
  // attention tp 4 (dp 2), rank 6 (attention rank 2): 32 heads; dp_lm_head's
  // lm_head 129280 / 4.
  std::map<std::string, Shape> dp2 = dp8;
  dp2[a + "q_b_proj.weight"] = {6144, 1536};
  dp2[a + "kv_b_proj.weight"] = {8192, 512};
  dp2[a + "o_proj.weight"] = {7168, 4096};
  dp2[a + "w_kc"] = {32, 128, 512};
  dp2[a + "w_vc"] = {32, 512, 128};
  dp2["lm_head.weight"] = {32320, 7168};
  dp2["model.embed_tokens.weight"] = {32320, 7168};  // 129280 / attention tp 4
  Fixture g{"deepseek-v3", 8, 8, 6, l, dp2};
  g.attn_dp = 2;
  g.dp_lm_head = true;
  expect_fixture(g);
  // moe_dense_tp_size 1: dense layer 2's MLP whole; DeepEP: the shared expert whole.
  std::map<std::string, Shape> whole = dp2;
  whole["model.layers.2.mlp.gate_up_proj.weight"] = {2 * 18432, 7168};
  whole["model.layers.2.mlp.down_proj.weight"] = {7168, 18432};
  whole[l + "mlp.shared_experts.gate_up_proj.weight"] = {2 * 2048, 7168};
  whole[l + "mlp.shared_experts.down_proj.weight"] = {7168, 2048};
  Fixture h = g;
  h.params = whole;
  h.moe_dense_tp = 1;
  h.deepep = true;
  expect_fixture(h);
}

// The whole DeepSeek-V3 at full size (its 46,183 BF16 tensors, from the real config)
// under the full deployment layout, one rank: every tensor is placed or dropped for a
// reason (none unmapped), and every byte of every param is written exactly once.
TEST(SglangFixtures, DeepseekV3AtFullSizeUnderTheDeploymentLayout) {
  FERRY_NEED_TEST_DATA();
  const nlohmann::json config = config_of("deepseek-v3");
  const synth::SynthSource source = synth::synth_source(config, "deepseek-v3/config.json");
  const std::vector<synth::SynthTensor> tensors = synth::synth_tensor_list(source, DType::kBF16);
  ASSERT_EQ(tensors.size(), 46183u);
  models::ParallelLayout layout;
  layout.tp = 8;
  layout.ep = 8;
  layout.local_ranks = {5};
  layout.attn_dp = 8;
  layout.dp_lm_head = true;
  layout.moe_dense_tp = 1;
  layout.moe_a2a = models::ParallelLayout::MoeA2a::kDeepep;
  auto m = models::make_model(config, layout);
  std::vector<models::Route> routes;
  std::map<std::string, std::size_t> dropped;
  for (const synth::SynthTensor& t : tensors) {
    models::Route r = m->route(tensor_info(t.name, t.dtype, t.shape));
    ASSERT_NE(r.kind, models::RouteKind::kUnmapped) << t.name;
    if (r.kind == models::RouteKind::kDropped) {
      ++dropped[r.reason];
    }
    routes.push_back(std::move(r));
  }
  EXPECT_TRUE(models::check_coverage(*m, routes).empty());
  // The MTP layer, and the 7 of 8 ranks' experts in each of the 58 MoE layers.
  EXPECT_EQ(dropped.size(), 2u);
  EXPECT_GT(dropped["mtp_layer"], 0u);
  EXPECT_EQ(dropped["remote_expert"], 58u * 224 * 3);
}

// Attention data parallelism at tp 8 with attn_dp 8 (attention tp 1) and 4
// (attention tp 2), from SGLang 0.5.23 (runtime_context.py: derive_attn_tp_size,
// attn_tp_size = tp_size // attn_dp_size; derive_attention_ranks, attn_tp_rank =
// tp_rank % attn_tp_size), for the families SGLang builds a layout for:
// - Qwen3-MoE (python/sglang/srt/models/qwen3_moe.py): Qwen3MoeAttention.__init__
//   builds qkv_proj / o_proj with parallel_group="attn_tp" (q heads / attn_tp, kv
//   heads split or replicated over attn_tp); Qwen3MoeModel is Qwen2MoeModel
//   (qwen2_moe.py), whose __init__ builds VocabParallelEmbedding(
//   use_attn_tp_group=is_dp_attention_enabled()); Qwen3MoeForCausalLM.__init__'s
//   ParallelLMHead(use_attn_tp_group=enable_dp_lm_head); Qwen3MoeSparseMoeBlock's
//   experts keep moe_tp = tp / ep (moe_tp_size), the gate is a ReplicatedLinear.
// - Llama (python/sglang/srt/models/llama.py): LlamaAttention.__init__ and
//   LlamaMLP keep the tp group, LlamaModel.__init__'s VocabParallelEmbedding takes
//   no use_attn_tp_group; only LlamaForCausalLM.__init__'s ParallelLMHead takes
//   use_attn_tp_group=enable_dp_lm_head.
// Vocabulary 151936 = 2374 * 64 (Qwen3) and 128256 = 2004 * 64 (Llama).

// Qwen3-30B-A3B (../shared/data): H 2048, 32 q / 4 kv heads of 128, 128 experts of
// I 768, rank 5.
TEST(SglangFixtures, Qwen3_30bA3bUnderAttentionDpAtTp8) {
  FERRY_NEED_TEST_DATA();
  const std::string l = "model.layers.11.";
  const std::string experts = l + "mlp.experts.";
  // attn_dp 8: every head (attention tp 1), the whole embedding; lm_head over all 8
  // ranks, or whole with dp_lm_head; experts at ep 1 (moe_tp 8).
  std::map<std::string, Shape> dp8{{"model.embed_tokens.weight", {151936, 2048}},
                                   {"lm_head.weight", {18992, 2048}},
                                   {l + "self_attn.qkv_proj.weight", {(32 + 2 * 4) * 128, 2048}},
                                   {l + "self_attn.o_proj.weight", {2048, 4096}},
                                   {l + "self_attn.q_norm.weight", {128}},
                                   {l + "self_attn.k_norm.weight", {128}},
                                   {l + "mlp.gate.weight", {128, 2048}},
                                   {l + "input_layernorm.weight", {2048}},
                                   {l + "post_attention_layernorm.weight", {2048}},
                                   {experts + "w13_weight", {128, 2 * 96, 2048}},
                                   {experts + "w2_weight", {128, 2048, 96}}};
  Fixture f{"qwen3-30b-a3b", 8, 1, 5, l, dp8};
  f.attn_dp = 8;
  expect_fixture(f);
  f.params["lm_head.weight"] = {151936, 2048};
  f.dp_lm_head = true;
  expect_fixture(f);
  // attn_dp 4 (attention tp 2, rank 5 is attention rank 1): 16 q / 2 kv heads; the
  // embedding and dp_lm_head's lm_head 151936 / 2; experts at ep 8 (16 a rank).
  std::map<std::string, Shape> dp4 = dp8;
  dp4[l + "self_attn.qkv_proj.weight"] = {(16 + 2 * 2) * 128, 2048};
  dp4[l + "self_attn.o_proj.weight"] = {2048, 2048};
  dp4["model.embed_tokens.weight"] = {75968, 2048};
  dp4["lm_head.weight"] = {75968, 2048};
  dp4[experts + "w13_weight"] = {16, 2 * 768, 2048};
  dp4[experts + "w2_weight"] = {16, 2048, 768};
  Fixture g{"qwen3-30b-a3b", 8, 8, 5, l, dp4};
  g.attn_dp = 4;
  g.dp_lm_head = true;
  expect_fixture(g);
}

// Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B's config.json, written here: it is not in
// ../shared/data): H 4096, 64 q / 4 kv heads of 128, 94 layers, 128 experts of I
// 1536 (intermediate_size 12288 for dense layers, none here), vocabulary 151936,
// untied; rank 6.
TEST(SglangFixtures, Qwen3_235bA22bUnderAttentionDpAtTp8) {
  const nlohmann::json config = {{"architectures", {"Qwen3MoeForCausalLM"}},
                                 {"attention_bias", false},
                                 {"decoder_sparse_step", 1},
                                 {"head_dim", 128},
                                 {"hidden_size", 4096},
                                 {"intermediate_size", 12288},
                                 {"mlp_only_layers", nlohmann::json::array()},
                                 {"model_type", "qwen3_moe"},
                                 {"moe_intermediate_size", 1536},
                                 {"num_attention_heads", 64},
                                 {"num_experts", 128},
                                 {"num_experts_per_tok", 8},
                                 {"num_hidden_layers", 94},
                                 {"num_key_value_heads", 4},
                                 {"tie_word_embeddings", false},
                                 {"torch_dtype", "bfloat16"},
                                 {"vocab_size", 151936}};
  const std::string l = "model.layers.93.";
  const std::string experts = l + "mlp.experts.";
  // attn_dp 8: every head; experts at ep 8 (16 a rank, moe_tp 1).
  std::map<std::string, Shape> dp8{{"model.embed_tokens.weight", {151936, 4096}},
                                   {"lm_head.weight", {18992, 4096}},
                                   {"model.norm.weight", {4096}},
                                   {l + "self_attn.qkv_proj.weight", {(64 + 2 * 4) * 128, 4096}},
                                   {l + "self_attn.o_proj.weight", {4096, 8192}},
                                   {l + "self_attn.q_norm.weight", {128}},
                                   {l + "self_attn.k_norm.weight", {128}},
                                   {l + "mlp.gate.weight", {128, 4096}},
                                   {l + "input_layernorm.weight", {4096}},
                                   {l + "post_attention_layernorm.weight", {4096}},
                                   {experts + "w13_weight", {16, 2 * 1536, 4096}},
                                   {experts + "w2_weight", {16, 4096, 1536}}};
  Fixture f{"qwen3-235b-a22b", 8, 8, 6, l, dp8};
  f.config = config;
  f.attn_dp = 8;
  expect_fixture(f);
  f.params["lm_head.weight"] = {151936, 4096};
  f.dp_lm_head = true;
  expect_fixture(f);
  // attn_dp 4 (attention tp 2, rank 6 is attention rank 0): 32 q / 2 kv heads, the
  // embedding 151936 / 2; lm_head over all 8 ranks without dp_lm_head; experts at
  // ep 1 (moe_tp 8: 1536 / 8 = 192).
  std::map<std::string, Shape> dp4 = dp8;
  dp4[l + "self_attn.qkv_proj.weight"] = {(32 + 2 * 2) * 128, 4096};
  dp4[l + "self_attn.o_proj.weight"] = {4096, 4096};
  dp4["model.embed_tokens.weight"] = {75968, 4096};
  dp4["lm_head.weight"] = {18992, 4096};
  dp4[experts + "w13_weight"] = {128, 2 * 192, 4096};
  dp4[experts + "w2_weight"] = {128, 4096, 192};
  Fixture g{"qwen3-235b-a22b", 8, 1, 6, l, dp4};
  g.config = config;
  g.attn_dp = 4;
  expect_fixture(g);
}

// Llama-3.1-8B (../shared/data): H 4096, 32 q / 8 kv heads of 128, I 14336;
// attention, MLP and embedding over all 8 ranks under any attn_dp; lm_head over the
// attention tp group only with dp_lm_head. Rank 3.
TEST(SglangFixtures, Llama31_8bUnderAttentionDpAtTp8) {
  FERRY_NEED_TEST_DATA();
  const std::string l = "model.layers.5.";
  std::map<std::string, Shape> common{{"model.embed_tokens.weight", {16032, 4096}},
                                      {"lm_head.weight", {16032, 4096}},
                                      {"model.norm.weight", {4096}},
                                      {l + "self_attn.qkv_proj.weight", {(4 + 2 * 1) * 128, 4096}},
                                      {l + "self_attn.o_proj.weight", {4096, 512}},
                                      {l + "mlp.gate_up_proj.weight", {2 * 1792, 4096}},
                                      {l + "mlp.down_proj.weight", {4096, 1792}},
                                      {l + "input_layernorm.weight", {4096}},
                                      {l + "post_attention_layernorm.weight", {4096}}};
  for (const int attn_dp : {8, 4}) {
    Fixture f{"llama-3.1-8b", 8, 1, 3, l, common};
    f.attn_dp = attn_dp;
    expect_fixture(f);
    // dp_lm_head: 128256 over attention tp 1 (whole) or 2 (64128).
    f.params["lm_head.weight"] = {128256 / static_cast<std::uint64_t>(8 / attn_dp), 4096};
    f.dp_lm_head = true;
    expect_fixture(f);
  }
}

// The families SGLang 0.5.23 builds nothing for under attention data parallelism
// (gemma.py, gemma2.py, gemma3_causal.py, mixtral.py: no attn_tp group, no
// use_attn_tp_group) are refused by name, and dp_lm_head where the family's
// ParallelLMHead takes no use_attn_tp_group (qwen2.py, Qwen2ForCausalLM.__init__).
TEST(SglangFixtures, AttentionDpIsRefusedWhereSglangBuildsNoLayoutForIt) {
  FERRY_NEED_TEST_DATA();
  models::ParallelLayout layout;
  layout.tp = 8;
  layout.attn_dp = 4;
  layout.local_ranks = {0};
  nlohmann::json mixtral = config_of("mixtral-8x7b-v0.1");
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(mixtral, layout); }),
              HasSubstr("parallel.attn_dp 4: MixtralForCausalLM (family mixtral) has no layout "
                        "under attention data parallelism"));
  nlohmann::json gemma = config_of("llama-3.1-8b");
  gemma["architectures"] = {"GemmaForCausalLM"};
  gemma["head_dim"] = 128;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(gemma, layout); }),
              HasSubstr("GemmaForCausalLM (family gemma) has no layout under attention data "
                        "parallelism"));
  // Qwen2 takes attn_dp (its embedding over the attention tp group; 28 heads keep
  // tp 4) but not dp_lm_head.
  const nlohmann::json qwen2 = config_of("qwen2.5-7b");
  layout.tp = 4;
  layout.attn_dp = 2;
  auto m = models::make_model(qwen2, layout);
  EXPECT_EQ(m->shells()[0].params[m->shells()[0].by_name.at("model.embed_tokens.weight")].shape,
            (Shape{76032, 3584}));
  layout.dp_lm_head = true;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(qwen2, layout); }),
              HasSubstr("parallel.dp_lm_head: Qwen2ForCausalLM (family qwen2) builds its "
                        "lm_head over all tp ranks"));
}

// shared_experts_fusion_disable_reason outcomes on an NVIDIA GPU of compute
// capability >= 8.0 with default server options: DeepSeek from
// python/sglang/srt/models/deepseek_v2.py (SGLang 0.5.23), GLM-4 MoE from
// python/sglang/srt/models/glm4_moe.py (SGLang 0.5.23). The fields the rule reads
// are written here where the config is not in ../shared/data, from each model
// card's config.json: deepseek-ai/DeepSeek-R1 (DeepseekV3ForCausalLM, 256 routed,
// 1 shared), deepseek-ai/DeepSeek-V2-Lite (DeepseekV2ForCausalLM, 64 routed, 2
// shared), zai-org/GLM-4.5 (Glm4MoeForCausalLM, 160 routed, 1 shared).
TEST(SglangFixtures, SharedExpertFusionDecisions) {
  FERRY_NEED_TEST_DATA();
  struct Row {
    std::string model;
    models::DeepseekConfig config;
    bool fused_at_ep1;
    bool fused_at_ep8;
  };
  auto fields = [](const std::string& arch, models::SharedExpertFusion fusion,
                   std::uint64_t routed, std::uint64_t shared) {
    models::DeepseekConfig c;
    c.architecture = arch;
    c.fusion = fusion;
    c.experts = routed;
    c.shared_experts = shared;
    return c;
  };
  using F = models::SharedExpertFusion;
  const nlohmann::json v3 = config_of("deepseek-v3");
  const std::vector<Row> rows{
      {"DeepSeek-V3 (../shared/data)",
       models::parse_deepseek_config(v3, v3["architectures"][0].get<std::string>()), true, false},
      {"DeepSeek-R1", fields("DeepseekV3ForCausalLM", F::kDeepseekV3Shape, 256, 1), true, false},
      {"DeepSeek-V2-Lite", fields("DeepseekV2ForCausalLM", F::kNever, 64, 2), false, false},
      {"GLM-4.5", fields("Glm4MoeForCausalLM", F::kSingleShared, 160, 1), true, false},
  };
  for (const Row& r : rows) {
    for (int ep : {1, 8}) {
      models::ParallelLayout layout;
      layout.tp = 8;
      layout.ep = ep;
      const models::FusionDecision d = models::sglang_shared_expert_fusion(r.config, layout);
      EXPECT_EQ(d.fuse, ep == 1 ? r.fused_at_ep1 : r.fused_at_ep8) << r.model << " ep " << ep;
      EXPECT_EQ(d.why_not.empty(), d.fuse) << r.model << " ep " << ep;
    }
  }
  // Qwen2-MoE (Qwen1.5-MoE-A2.7B: 60 routed experts and a gated shared expert of
  // 5632, python/sglang/srt/models/qwen2_moe.py (SGLang 0.5.23)): never fused, at any
  // ep; its shared expert stays a tensor-parallel MLP.
  nlohmann::json qwen2_moe = config_of("qwen3-30b-a3b");
  qwen2_moe["architectures"] = {"Qwen2MoeForCausalLM"};
  qwen2_moe["model_type"] = "qwen2_moe";
  qwen2_moe["num_experts"] = 64;
  qwen2_moe["shared_expert_intermediate_size"] = 5632;
  for (int ep : {1, 8}) {
    models::ParallelLayout layout;
    layout.tp = 8;
    layout.ep = ep;
    layout.local_ranks = {0};
    auto m = models::make_model(qwen2_moe, layout);
    const models::RankShell& shell = m->shells()[0];
    EXPECT_TRUE(shell.by_name.contains("model.layers.0.mlp.shared_expert.gate_up_proj.weight"))
        << "ep " << ep;
    EXPECT_EQ(shell.params[shell.by_name.at("model.layers.0.mlp.experts.w13_weight")].shape[0],
              64u / static_cast<std::uint64_t>(ep))
        << "ep " << ep;
  }
}

}  // namespace
}  // namespace ferry::testing
