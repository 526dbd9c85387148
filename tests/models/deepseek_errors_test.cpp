// DeepSeek's refusals that need no checkpoint: strides that do not lay a param out
// densely, malformed config fields, and the deployment layouts (attention DP, the
// DP LM head, dense TP, DeepEP) where they do not apply, each named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "models/model.hpp"
#include "models/placement.hpp"
#include "models/reference_util.hpp"
#include "models/table_model.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using ::testing::HasSubstr;

nlohmann::json tiny_config(const std::string& family) {
  return synth::synth_config(family, "tiny", DType::kBF16, false);
}

void expect_error(const std::function<void()>& f, Stage stage, const std::string& what) {
  EXPECT_THAT(error_of(stage, f), HasSubstr(what));
}

TEST(DeepseekErrors, StridesMustLayOutTheParamDensely) {
  // Strides are declared on the param (TableModel::add_param); finish() refuses
  // strides that do not address every element once.
  models::TableModel toy("toy", "ToyForCausalLM", models::normalize_layout({}), DType::kBF16,
                         false);
  toy.add_param("model.layers.0.self_attn.w_kc", models::Shape{8, 16, 64}, {},
                [](const models::Shape&) {
                  return std::vector<std::uint64_t>{512, 1, 8};
                });
  expect_error([&] { toy.finish(); }, Stage::kPlacement, "do not lay out");
  // The real model declares the split's strides: a dense permutation, not row-major.
  std::shared_ptr<const models::Model> m = models::make_model(tiny_config("deepseek_v3"), {});
  const auto& shell = m->shells()[0];
  const models::ParamSpec& w_kc = shell.params[shell.by_name.at("model.layers.0.self_attn.w_kc")];
  EXPECT_NE(w_kc.strides, models::contiguous_strides(w_kc.shape));
}

TEST(DeepseekErrors, MalformedConfigFieldsAreNamed) {
  nlohmann::json config = tiny_config("deepseek_v3");
  config.erase("kv_lora_rank");
  expect_error([&] { models::make_model(config, {}); }, Stage::kConfig, "kv_lora_rank");
  config = tiny_config("deepseek_v3");
  config["first_k_dense_replace"] = -1;
  expect_error([&] { models::make_model(config, {}); }, Stage::kConfig, "first_k_dense_replace");
  config = tiny_config("deepseek_v3");
  config["topk_method"] = 3;
  expect_error([&] { models::make_model(config, {}); }, Stage::kConfig, "topk_method");
}

TEST(DeepseekErrors, DeploymentLayoutsAreRefusedWhereTheyDoNotApply) {
  const nlohmann::json v3 = tiny_config("deepseek_v3");
  auto layout = [](int tp, int ep) {
    models::ParallelLayout l;
    l.tp = tp;
    l.ep = ep;
    return l;
  };
  // attn_dp must divide tp; dp_lm_head needs attn_dp > 1; moe_dense_tp is 1 or none;
  // DeepEP needs ep = tp (SGLang's server_args rules).
  models::ParallelLayout l = layout(4, 1);
  l.attn_dp = 3;
  expect_error([&] { models::make_model(v3, l); }, Stage::kConfig, "attn_dp 3 must divide tp 4");
  l = layout(4, 1);
  l.dp_lm_head = true;
  expect_error([&] { models::make_model(v3, l); }, Stage::kConfig, "needs attn_dp > 1");
  l = layout(4, 1);
  l.moe_dense_tp = 2;
  expect_error([&] { models::make_model(v3, l); }, Stage::kConfig,
               "moe_dense_tp 2 is not 1 or none");
  l = layout(4, 2);
  l.moe_a2a = models::ParallelLayout::MoeA2a::kDeepep;
  expect_error([&] { models::make_model(v3, l); }, Stage::kConfig, "ep = tp");
  // Under DeepEP SGLang never folds the shared expert: asking for it is refused.
  l = layout(1, 1);
  l.moe_a2a = models::ParallelLayout::MoeA2a::kDeepep;
  models::ModelOptions fuse;
  fuse.fuse_shared_experts = true;
  expect_error([&] { models::make_model(v3, l, fuse); }, Stage::kConfig, "DeepEP");
  // Families whose placement under these layouts ferry does not know refuse them.
  const nlohmann::json glm = tiny_config("glm4_moe");
  l = layout(4, 4);
  l.moe_a2a = models::ParallelLayout::MoeA2a::kDeepep;
  expect_error([&] { models::make_model(glm, l); }, Stage::kConfig, "parallel.moe_a2a deepep");
  l = layout(2, 1);
  l.moe_dense_tp = 1;
  expect_error([&] { models::make_model(tiny_case("llama", DType::kBF16, false).config, l); },
               Stage::kConfig, "parallel.moe_dense_tp 1");
  // Heads the attention group does not split are named (8 MLA heads, attention tp 16).
  l = layout(32, 1);
  l.attn_dp = 2;
  expect_error([&] { models::make_model(v3, l); }, Stage::kPlacement, "num_attention_heads");
}

}  // namespace
}  // namespace ferry::testing
