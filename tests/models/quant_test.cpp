// FP8 block-quantized checkpoints (models/quant.hpp) on the dense and MoE families,
// element by element against their naive references read three ways
// (fp8_reference.hpp), and the bad inputs: quantization_config fields, methods
// ferry does not load, shares that are not whole blocks, missing or misshapen
// scales, FP8 weights a config does not declare.
#include "models/quant.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/fp8.hpp"
#include "models/coverage.hpp"
#include "models/fp8_reference.hpp"
#include "models/model.hpp"
#include "models/moe_reference.hpp"
#include "models/placement.hpp"
#include "models/reference_util.hpp"
#include "models/table_model.hpp"
#include "testing/error_of.hpp"
#include "tools/synth.hpp"

namespace ferry::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr std::uint64_t kSeed = 5;

struct Case {
  std::string family;  // a synth family
  int tp = 1;
  int ep = 1;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.family + "_tp" + std::to_string(info.param.tp) + "_ep" +
         std::to_string(info.param.ep);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name({c, 0});
}

class Fp8Contract : public ::testing::TestWithParam<Case> {};

TEST_P(Fp8Contract, WeightsAndScalesMatchTheReference) {
  const Case& c = GetParam();
  nlohmann::json config = tools::synth_config(c.family, "tiny", DType::kBF16, false);
  std::vector<tools::SynthTensor> tensors =
      tools::synth_tensor_list(c.family, "tiny", DType::kBF16, false);
  std::map<std::string, std::vector<std::uint64_t>> bf16_shapes;
  for (const tools::SynthTensor& t : tensors) {
    bf16_shapes[t.name] = t.shape;
  }
  fp8::Values values(kSeed, fp8::quantize(tensors, config));
  models::ParallelLayout layout;
  layout.tp = c.tp;
  layout.ep = c.ep;
  std::unique_ptr<models::Model> model = models::make_model(config, layout);
  ParamBuffers buffers = make_buffers(*model);
  const std::vector<models::Route> routes = fp8::load(*model, tensors, values, buffers);
  EXPECT_TRUE(models::check_coverage(*model, routes).empty());

  const bool dense = !tools::synth_family_has_experts(c.family);
  std::size_t scales = 0;
  for (std::size_t i = 0; i < model->shells().size(); ++i) {
    const int rank = model->shells()[i].tp_rank;
    if (dense) {
      // reference_util's account of a Llama-like rank, from the full tensors.
      auto read = [&](auto fn) {
        TensorMap checkpoint;
        for (const auto& [name, shape] : bf16_shapes) {
          HostTensor& t = checkpoint[name];
          t.shape = shape;
          t.values.resize(models::element_count(shape));
          for (std::uint64_t e = 0; e < t.values.size(); ++e) {
            t.values[e] = fn(name, e);
          }
        }
        return reference_params(ref_config(config), checkpoint, rank, c.tp);
      };
      const TensorMap w =
          read([&](const std::string& n, std::uint64_t e) { return values.weight(n, e); });
      const TensorMap s =
          read([&](const std::string& n, std::uint64_t e) { return values.own_scale(n, e); });
      scales += fp8::check_rank(*model, i, buffers, w, s, w);
    } else {
      moe_ref::Options o;
      o.tp = c.tp;
      o.ep = c.ep;
      moe_ref::Values vw(
          [&](const std::string& n, std::uint64_t e) { return values.weight(n, e); });
      moe_ref::Values vs(
          [&](const std::string& n, std::uint64_t e) { return values.own_scale(n, e); });
      const auto w = moe_ref::reference_rank(config, vw, o, rank);
      const auto s = moe_ref::reference_rank(config, vs, o, rank);
      scales += fp8::check_rank(*model, i, buffers, w, s, w);
    }
  }
  EXPECT_GT(scales, 0u);
}

// (Mixtral's and Qwen3-MoE's reference runs take 20-30 s each under ASan: the
// layouts are chosen so that each split kind appears once: tp-split experts, ep,
// and both together.)
std::vector<Case> cases() {
  return {{"llama", 1, 1},     {"llama", 2, 1},     {"llama", 4, 1},     {"qwen2", 2, 1},
          {"qwen3_moe", 1, 1}, {"qwen3_moe", 4, 1}, {"qwen3_moe", 4, 2}, {"mixtral", 2, 2}};
}

INSTANTIATE_TEST_SUITE_P(Families, Fp8Contract, ::testing::ValuesIn(cases()), case_name);

// ---- bad inputs ---------------------------------------------------------------------

nlohmann::json fp8_llama(std::uint64_t block = fp8::kBlock) {
  nlohmann::json c = tools::synth_config("llama", "tiny", DType::kBF16, false);
  c["quantization_config"] = tools::synth_fp8_quant_config(block);
  return c;
}

TEST(QuantScheme, ParsesFp8BlockAndItsExclusions) {
  nlohmann::json c = fp8_llama(128);
  c["quantization_config"]["scale_fmt"] = "ue8m0";
  c["quantization_config"]["modules_to_not_convert"] = {"lm_head", "model.layers.0.mlp.gate"};
  const models::QuantScheme q = models::parse_quant_scheme(c);
  EXPECT_EQ(q.method, models::QuantScheme::Method::kFp8Block);
  EXPECT_EQ(q.block_n, 128u);
  EXPECT_EQ(q.block_k, 128u);
  EXPECT_EQ(q.scale_fmt, "ue8m0");
  EXPECT_EQ(models::describe(q), "fp8 block [128, 128] scale_fmt ue8m0");
  EXPECT_TRUE(models::module_skipped(q, "lm_head"));
  EXPECT_TRUE(models::module_skipped(q, "model.layers.0.mlp.gate"));
  EXPECT_FALSE(models::module_skipped(q, "model.layers.0.mlp.gate_up_proj"));
  EXPECT_FALSE(models::parse_quant_scheme(tools::synth_config("llama", "tiny", DType::kBF16, false))
                   .quantized());
  nlohmann::json null_config = c;
  null_config["quantization_config"] = nullptr;  // an explicit null is no quantization
  EXPECT_FALSE(models::parse_quant_scheme(null_config).quantized());
}

TEST(QuantScheme, MethodsFerryDoesNotLoadAreRefusedByName) {
  nlohmann::json c = fp8_llama();
  for (const char* method : {"gptq", "awq", "bitsandbytes", "gguf", "compressed-tensors"}) {
    c["quantization_config"] = {{"quant_method", method}, {"bits", 4}};
    EXPECT_THAT(error_of(Stage::kMapping, [&] { models::make_model(c, {}); }),
                AllOf(HasSubstr(std::string("\"") + method + "\""), HasSubstr("not supported")));
  }
  c["quantization_config"] = {{"quant_method", "turbo9"}};
  EXPECT_THAT(error_of(Stage::kMapping, [&] { models::make_model(c, {}); }),
              HasSubstr("unknown quantization method \"turbo9\""));
  c["quantization_config"] = {{"bits", 4}};
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("quant_method"));
  c["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"}};
  EXPECT_THAT(error_of(Stage::kMapping, [&] { models::make_model(c, {}); }),
              HasSubstr("without weight_block_size (per-tensor FP8"));
}

TEST(QuantScheme, MalformedFieldsAreNamed) {
  nlohmann::json c = fp8_llama();
  c["quantization_config"]["weight_block_size"] = {128};
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("weight_block_size must be two positive integers"));
  c["quantization_config"]["weight_block_size"] = {0, 128};
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("weight_block_size"));
  c = fp8_llama();
  c["quantization_config"]["activation_scheme"] = "static";
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("only supports the dynamic activation scheme"));
  c = fp8_llama();
  c["quantization_config"]["scale_fmt"] = "e5m2";
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }), HasSubstr("scale_fmt"));
  c = fp8_llama();
  c["quantization_config"]["modules_to_not_convert"] = "lm_head";
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("modules_to_not_convert must be a list"));
}

TEST(QuantPlacement, ASliceThatIsNotWholeBlocksIsRefusedWithSglangsWords) {
  // tiny llama: intermediate_size 256; at tp 8 with 64-row blocks each rank's
  // gate / up share is 32 rows.
  nlohmann::json c = fp8_llama(64);
  models::ParallelLayout layout;
  layout.tp = 8;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(c, layout); }),
              AllOf(HasSubstr("is not divisible by weight quantization block_"),
                    HasSubstr("tp rank 0 of 8")));
  // Whole 16-row blocks at tp 2 (k / v: 16 rows a rank): accepted.
  layout.tp = 2;
  EXPECT_NO_THROW(models::make_model(fp8_llama(16), layout));
  // Row-parallel: down_proj's input share.
  nlohmann::json k = fp8_llama(8);
  k["quantization_config"]["weight_block_size"] = {8, 48};
  layout.tp = 2;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(k, layout); }),
              HasSubstr("Weight input_size_per_partition = "));
  // Padding (model.unaligned_tp=pad) of an FP8 param is refused, not guessed.
  nlohmann::json u = fp8_llama(8);
  u["intermediate_size"] = 100;
  models::ModelOptions pad;
  pad.unaligned_tp = models::Unaligned::kPad;
  layout.tp = 8;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::make_model(u, layout, pad); }),
              HasSubstr("FP8 block-quantized parameter is not supported"));
}

TEST(QuantPlacement, MissingMisshapenAndUndeclaredFp8TensorsAreNamed) {
  const nlohmann::json c = fp8_llama();
  std::unique_ptr<models::Model> m = models::make_model(c, {});
  const std::string w = "model.layers.0.mlp.down_proj.weight";
  const auto& shell = m->shells()[0];
  const models::ParamSpec& down = shell.params[shell.by_name.at(w)];
  ASSERT_EQ(down.dtype, DType::kF8E4M3);
  const std::vector<std::uint64_t> scale_shape{(down.shape[0] + 7) / 8, (down.shape[1] + 7) / 8};
  EXPECT_EQ(shell.params[shell.by_name.at(w + "_scale_inv")].shape, scale_shape);
  // A scale whose shape disagrees with the weight and block size.
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         m->route(tensor_info(w + "_scale_inv", DType::kF32,
                                              {scale_shape[0] + 1, scale_shape[1]}));
                       }),
              AllOf(HasSubstr(w + "_scale_inv"), HasSubstr("the checkpoint tensor must be")));
  // A BF16 weight where the config says FP8.
  EXPECT_THAT(
      error_of(Stage::kPlacement, [&] { m->route(tensor_info(w, DType::kBF16, down.shape)); }),
      AllOf(HasSubstr(w), HasSubstr("says this weight is stored as F8_E4M3")));
  // An FP8 weight where the config says BF16 (no quantization_config).
  nlohmann::json plain = c;
  plain.erase("quantization_config");
  std::unique_ptr<models::Model> p = models::make_model(plain, {});
  EXPECT_THAT(
      error_of(Stage::kPlacement, [&] { p->route(tensor_info(w, DType::kF8E4M3, down.shape)); }),
      AllOf(HasSubstr(w), HasSubstr("config.json has no quantization_config")));
  // A missing weight_scale_inv: the scale param is left unwritten (a coverage gap,
  // which the runtime reports naming it).
  std::vector<tools::SynthTensor> tensors =
      tools::synth_tensor_list("llama", "tiny", DType::kBF16, false);
  tools::synth_quantize_fp8_block(tensors, fp8::kBlock);
  std::vector<models::Route> routes;
  for (const tools::SynthTensor& t : tensors) {
    if (t.name != w + "_scale_inv") {
      routes.push_back(m->route(tensor_info(t.name, t.dtype, t.shape)));
    }
  }
  EXPECT_THAT(models::gap_names(models::check_coverage(*m, routes)),
              ::testing::ElementsAre(w + "_scale_inv"));
}

TEST(QuantPlacement, ExcludedModulesStayInTheModelDtype) {
  nlohmann::json c = fp8_llama();
  c["quantization_config"]["modules_to_not_convert"] = {
      "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
      "model.layers.1.self_attn.v_proj", "layers.0.mlp"};
  std::unique_ptr<models::Model> m = models::make_model(c, {});
  const auto& shell = m->shells()[0];
  auto dtype = [&](const std::string& n) { return shell.params[shell.by_name.at(n)].dtype; };
  EXPECT_EQ(dtype("model.layers.1.self_attn.qkv_proj.weight"), DType::kBF16);
  EXPECT_EQ(shell.by_name.count("model.layers.1.self_attn.qkv_proj.weight_scale_inv"), 0u);
  EXPECT_EQ(dtype("model.layers.1.self_attn.o_proj.weight"), DType::kF8E4M3);
  EXPECT_EQ(dtype("model.layers.0.mlp.gate_up_proj.weight"),
            DType::kBF16);  // a parent, no "model."
  EXPECT_EQ(dtype("model.layers.0.mlp.down_proj.weight"), DType::kBF16);
  EXPECT_EQ(dtype("model.layers.0.self_attn.qkv_proj.weight"), DType::kF8E4M3);
  EXPECT_EQ(dtype("lm_head.weight"), DType::kBF16);
  EXPECT_EQ(dtype("model.layers.0.input_layernorm.weight"), DType::kBF16);
  // Some but not all shards of a fused param: refused, as SGLang does.
  c["quantization_config"]["modules_to_not_convert"] = {"model.layers.1.self_attn.q_proj"};
  EXPECT_THAT(error_of(Stage::kMapping, [&] { models::make_model(c, {}); }),
              HasSubstr("some but not all shards of model.layers.1.self_attn.qkv_proj"));
}

TEST(QuantPlacement, AScalarLoadsIntoAOneElementParamAndTheReverse) {
  // Per-tensor scales are stored 0-d by some exporters and [1] by others.
  models::ParallelLayout l;
  models::TableModel m("toy", "ToyForTest", models::normalize_layout(l), DType::kBF16, false);
  m.add_param("toy.one", models::Shape{1}, DType::kF32);
  m.add_param("toy.scalar", models::Shape{}, DType::kF32);
  m.add_target("one", "toy.one", models::Shape{1},
               [](int) { return std::vector<models::Block>{models::replicated(1)}; });
  m.add_target("scalar", "toy.scalar", models::Shape{},
               [](int) { return std::vector<models::Block>{models::replicated(1)}; });
  m.finish();
  const auto& shell = m.shells()[0];
  EXPECT_EQ(shell.params[shell.by_name.at("toy.scalar")].nbytes, 4u);
  for (const auto& [tensor, shape] :
       std::vector<std::pair<std::string, std::vector<std::uint64_t>>>{
           {"one", {}}, {"one", {1}}, {"scalar", {1}}, {"scalar", {}}}) {
    const models::Route r = m.route(tensor_info(tensor, DType::kF32, shape));
    ASSERT_EQ(r.kind, models::RouteKind::kPlaced) << tensor;
    ASSERT_EQ(r.pieces.size(), 1u) << tensor;
    EXPECT_EQ(r.pieces[0].dst_bytes(), 4u) << tensor;
    EXPECT_EQ(r.src_end, 4u) << tensor;
  }
  // Two elements are not a scalar.
  EXPECT_THAT(
      error_of(Stage::kPlacement, [&] { m.route(tensor_info("scalar", DType::kF32, {2})); }),
      HasSubstr("the checkpoint tensor must be []"));
}

TEST(Fp8Values, E4m3RoundTripsEveryCodeAndRoundsToNearestEven) {
  for (int code = 0; code < 256; ++code) {
    const auto b = static_cast<std::uint8_t>(code);
    const float v = e4m3_to_float(b);
    EXPECT_EQ(std::isnan(v), std::isnan(e4m3_value(b))) << code;
    if (!std::isnan(v)) {
      EXPECT_EQ(v, e4m3_value(b)) << code;
      EXPECT_EQ(e4m3_to_float(float_to_e4m3(v)), v) << code;
    }
  }
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1000.0f)), 448.0f);  // saturates
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(-1000.0f)), -448.0f);
  // 1.0625 lies halfway between 1.0 (code 0x38, even) and 1.125 (0x39).
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);  // between 0x39 and 0x3A: the even one
  EXPECT_EQ(float_to_e4m3(std::nanf("")), 0x7F);
}

}  // namespace
}  // namespace ferry::testing
