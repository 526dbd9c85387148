// Quantized checkpoints (models/quant.hpp: FP8 with block, channel or tensor scales,
// ModelOpt FP8, NVFP4) on the dense and MoE families, element by element against
// their naive references read several ways (quant_reference.hpp), and the bad
// inputs: quantization_config fields, methods ferry does not load, shares that are
// not whole blocks, missing or misshapen scales, FP8 weights a config does not
// declare.
#include "models/quant.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/fp8.hpp"
#include "models/coverage.hpp"
#include "models/model.hpp"
#include "models/moe_reference.hpp"
#include "models/placement.hpp"
#include "models/quant_reference.hpp"
#include "models/reference_util.hpp"
#include "models/table_model.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr std::uint64_t kSeed = 5;

struct Case {
  std::string family;  // a synth family
  int tp = 1;
  int ep = 1;
  synth::SynthQuant kind = synth::SynthQuant::kFp8Block;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string kind(synth::to_string(info.param.kind));
  std::replace(kind.begin(), kind.end(), '-', '_');
  return info.param.family + "_tp" + std::to_string(info.param.tp) + "_ep" +
         std::to_string(info.param.ep) + "_" + kind;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name({c, 0});
}

class QuantContract : public ::testing::TestWithParam<Case> {};

TEST_P(QuantContract, WeightsAndScalesMatchTheReference) {
  const Case& c = GetParam();
  nlohmann::json config = synth::synth_config(c.family, "tiny", DType::kBF16, false);
  std::vector<synth::SynthTensor> tensors =
      synth::synth_tensor_list(c.family, "tiny", DType::kBF16, false);
  std::map<std::string, std::vector<std::uint64_t>> bf16_shapes;
  for (const synth::SynthTensor& t : tensors) {
    bf16_shapes[t.name] = t.shape;
  }
  quant::Values values(kSeed, quant::quantize(tensors, config, c.kind));
  models::ParallelLayout layout;
  layout.tp = c.tp;
  layout.ep = c.ep;
  std::unique_ptr<models::Model> model = models::make_model(config, layout);
  ParamBuffers buffers = make_buffers(*model);
  const std::vector<models::Route> routes = quant::load(*model, tensors, values, buffers);
  EXPECT_TRUE(models::check_coverage(*model, routes).empty());

  const bool dense = !synth::synth_family_has_experts(c.family);
  std::size_t scales = 0;
  std::map<std::string, TensorMap> checkpoints;  // by reading: the same for every rank
  for (std::size_t i = 0; i < model->shells().size(); ++i) {
    const int rank = model->shells()[i].tp_rank;
    if (dense) {
      // reference_util's account of a Llama-like rank, from the full tensors.
      scales += quant::check_rank(
          *model, i, buffers, values, [&](const std::string& reading, const quant::ValueFn& fn) {
            TensorMap& checkpoint = checkpoints[reading];
            if (checkpoint.empty()) {
              for (const auto& [name, shape] : bf16_shapes) {
                HostTensor& t = checkpoint[name];
                t.shape = shape;
                t.values.resize(models::element_count(shape));
                for (std::uint64_t e = 0; e < t.values.size(); ++e) {
                  t.values[e] = fn(name, e);
                }
              }
            }
            return reference_params(ref_config(config), checkpoint, rank, c.tp);
          });
    } else {
      moe_ref::Options o;
      o.tp = c.tp;
      o.ep = c.ep;
      scales += quant::check_rank(*model, i, buffers, values,
                                  [&](const std::string&, const quant::ValueFn& fn) {
                                    moe_ref::Values v(fn);
                                    return moe_ref::reference_rank(config, v, o, rank);
                                  });
    }
  }
  EXPECT_GT(scales, 0u);
}

// (Mixtral's and Qwen3-MoE's reference runs take 20-30 s each under ASan: the
// layouts are chosen so that each split kind appears once per format: tp-split
// experts, ep, and both together.)
std::vector<Case> cases() {
  using synth::SynthQuant;
  std::vector<Case> out = {{"llama", 1, 1},     {"llama", 2, 1},     {"llama", 4, 1},
                           {"qwen2", 2, 1},     {"qwen3_moe", 1, 1}, {"qwen3_moe", 4, 1},
                           {"qwen3_moe", 4, 2}, {"mixtral", 2, 2}};
  for (SynthQuant kind : {SynthQuant::kFp8Channel, SynthQuant::kFp8Tensor, SynthQuant::kModelOptFp8,
                          SynthQuant::kNvfp4}) {
    out.push_back({"llama", 1, 1, kind});
    out.push_back({"llama", 2, 1, kind});
    out.push_back({"llama", 4, 1, kind});
  }
  // MoE: tp-split experts and ep, once per format.
  out.push_back({"qwen3_moe", 2, 1, SynthQuant::kFp8Channel});
  out.push_back({"mixtral", 2, 2, SynthQuant::kFp8Tensor});
  out.push_back({"qwen3_moe", 4, 2, SynthQuant::kModelOptFp8});
  out.push_back({"qwen3_moe", 4, 2, SynthQuant::kNvfp4});
  out.push_back({"qwen2", 2, 1, SynthQuant::kNvfp4});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Families, QuantContract, ::testing::ValuesIn(cases()), case_name);

// ---- bad inputs ---------------------------------------------------------------------

nlohmann::json fp8_llama(std::uint64_t block = quant::kBlock) {
  nlohmann::json c = synth::synth_config("llama", "tiny", DType::kBF16, false);
  c["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, block);
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
  EXPECT_FALSE(models::parse_quant_scheme(synth::synth_config("llama", "tiny", DType::kBF16, false))
                   .quantized());
  nlohmann::json null_config = c;
  null_config["quantization_config"] = nullptr;  // an explicit null is no quantization
  EXPECT_FALSE(models::parse_quant_scheme(null_config).quantized());
}

TEST(QuantScheme, MethodsFerryDoesNotLoadAreRefusedByName) {
  nlohmann::json c = fp8_llama();
  for (const char* method : {"gptq", "awq", "bitsandbytes", "gguf", "mxfp4", "w8a8_int8"}) {
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
}

// compressed-tensors' FP8 schemes: what each parses to, and what is refused by name.
TEST(QuantScheme, CompressedTensorsFp8SchemesAndRefusals) {
  using Method = models::QuantScheme::Method;
  auto with = [](const nlohmann::json& q) {
    nlohmann::json c = fp8_llama();
    c["quantization_config"] = q;
    return c;
  };
  const nlohmann::json channel = synth::synth_quant_config(synth::SynthQuant::kFp8Channel, 0);
  models::QuantScheme q = models::parse_quant_scheme(with(channel));
  EXPECT_EQ(q.method, Method::kFp8Channel);
  EXPECT_FALSE(q.input_scales);
  EXPECT_EQ(q.scale_suffix, "weight_scale");
  EXPECT_EQ(models::describe(q), "fp8 per-channel (compressed-tensors)");
  q = models::parse_quant_scheme(with(synth::synth_quant_config(synth::SynthQuant::kFp8Tensor, 0)));
  EXPECT_EQ(q.method, Method::kFp8Tensor);
  EXPECT_TRUE(q.input_scales);
  nlohmann::json block = channel;
  block["config_groups"]["group_0"]["weights"]["strategy"] = "block";
  block["config_groups"]["group_0"]["weights"]["block_structure"] = {128, 64};
  q = models::parse_quant_scheme(with(block));
  EXPECT_EQ(q.method, Method::kFp8Block);
  EXPECT_EQ(q.block_n, 128u);
  EXPECT_EQ(q.block_k, 64u);
  EXPECT_EQ(q.scale_suffix, "weight_scale");
  block["config_groups"]["group_0"]["weights"]["block_structure"] = "64x32";  // vLLM's spelling
  q = models::parse_quant_scheme(with(block));
  EXPECT_EQ(q.block_n, 64u);
  EXPECT_EQ(q.block_k, 32u);
  nlohmann::json w8a16 = channel;  // weights only
  w8a16["config_groups"]["group_0"]["input_activations"] = nullptr;
  EXPECT_EQ(models::parse_quant_scheme(with(w8a16)).method, Method::kFp8Channel);

  struct Bad {
    std::function<void(nlohmann::json&)> edit;
    Stage stage;
    const char* says;
  };
  const std::vector<Bad> bad{
      {[](nlohmann::json& j) { j["format"] = "pack-quantized"; }, Stage::kMapping,
       "format \"pack-quantized\" is not supported"},
      {[](nlohmann::json& j) { j["config_groups"]["group_0"]["weights"]["type"] = "int"; },
       Stage::kMapping, "weights are int with num_bits 8"},
      {[](nlohmann::json& j) { j["config_groups"]["group_0"]["weights"]["num_bits"] = 4; },
       Stage::kMapping, "num_bits 4"},
      {[](nlohmann::json& j) { j["config_groups"]["group_0"]["weights"]["strategy"] = "group"; },
       Stage::kMapping, "strategy \"group\" is not supported"},
      {[](nlohmann::json& j) { j["config_groups"]["group_0"]["weights"]["symmetric"] = false; },
       Stage::kMapping, "asymmetric"},
      {[](nlohmann::json& j) {
         j["config_groups"]["group_0"]["input_activations"]["dynamic"] = false;  // static token
       },
       Stage::kMapping, "static but not per-tensor"},
      {[](nlohmann::json& j) {
         j["config_groups"]["group_1"] = j["config_groups"]["group_0"];
         j["config_groups"]["group_1"]["weights"]["strategy"] = "tensor";
       },
       Stage::kMapping, "different schemes to different layers"},
      {[](nlohmann::json& j) { j["config_groups"]["group_0"]["targets"] = {"Attention"}; },
       Stage::kMapping, "do not target \"Linear\""},
      {[](nlohmann::json& j) {
         j["sparsity_config"] = {{"format", "sparse-24"}};
       },
       Stage::kMapping, "sparsity_config"},
      {[](nlohmann::json& j) { j["config_groups"] = nlohmann::json::object(); }, Stage::kConfig,
       "config_groups must be an object"},
      {[](nlohmann::json& j) { j["ignore"] = {"re:(unclosed"}; }, Stage::kConfig,
       "is not a regular expression"},
      {[](nlohmann::json& j) {
         j["config_groups"]["group_0"]["weights"]["strategy"] = "block";
         j["config_groups"]["group_0"]["weights"]["block_structure"] = "12x";
       },
       Stage::kConfig, "block_structure must be two positive integers"},
  };
  for (const Bad& b : bad) {
    nlohmann::json j = channel;
    b.edit(j);
    EXPECT_THAT(error_of(b.stage, [&] { models::make_model(with(j), {}); }), HasSubstr(b.says))
        << j.dump();
  }
  // SGLang's FusedMoE takes per-tensor FP8 weights only with static input scales.
  nlohmann::json moe = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  nlohmann::json dynamic_tensor = channel;
  dynamic_tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor";
  moe["quantization_config"] = dynamic_tensor;
  EXPECT_THAT(error_of(Stage::kMapping, [&] { models::make_model(moe, {}); }),
              AllOf(HasSubstr("experts.w13_weight"), HasSubstr("static per-tensor input scales")));
  EXPECT_NO_THROW(models::make_model(with(dynamic_tensor), {}));  // a dense model takes it
}

// quant_method fp8 without weight_block_size: one scale per tensor (AutoFP8's layout).
TEST(QuantScheme, Fp8WithoutBlocksIsPerTensor) {
  nlohmann::json c = fp8_llama();
  c["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"}};
  models::QuantScheme q = models::parse_quant_scheme(c);
  EXPECT_EQ(q.method, models::QuantScheme::Method::kFp8Tensor);
  EXPECT_TRUE(q.input_scales);
  EXPECT_EQ(models::describe(q), "fp8 per-tensor, static input scales");
  c["quantization_config"]["activation_scheme"] = "dynamic";
  EXPECT_FALSE(models::parse_quant_scheme(c).input_scales);
  c["quantization_config"].erase("activation_scheme");
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}); }),
              HasSubstr("activation_scheme must be \"dynamic\" or \"static\""));
}

// ModelOpt: hf_quant_config.json's nested form (merged into config.json as the
// runtime does) and config.json's flat one.
TEST(QuantScheme, ModelOptFp8AndNvfp4FromEitherForm) {
  using Method = models::QuantScheme::Method;
  const nlohmann::json plain = synth::synth_config("llama", "tiny", DType::kBF16, false);
  const nlohmann::json nvfp4 = synth::synth_hf_quant_config(synth::SynthQuant::kNvfp4);
  models::QuantScheme q = models::parse_quant_scheme(models::with_hf_quant_config(plain, nvfp4));
  EXPECT_EQ(q.method, Method::kNvfp4);
  EXPECT_EQ(q.group_size, 16u);
  EXPECT_TRUE(q.input_scales);
  EXPECT_FALSE(q.kv_cache_scales);
  EXPECT_EQ(q.ignored, std::vector<std::string>{"lm_head"});
  EXPECT_EQ(models::describe(q), "nvfp4 group 16 (modelopt), static input scales");
  q = models::parse_quant_scheme(models::with_hf_quant_config(
      plain, synth::synth_hf_quant_config(synth::SynthQuant::kModelOptFp8)));
  EXPECT_EQ(q.method, Method::kFp8Tensor);
  EXPECT_TRUE(q.kv_cache_scales);
  // config.json's own quantization_config wins over the file.
  EXPECT_EQ(models::parse_quant_scheme(models::with_hf_quant_config(fp8_llama(), nvfp4)).method,
            Method::kFp8Block);
  EXPECT_THAT(error_of(Stage::kConfig,
                       [&] {
                         models::with_hf_quant_config(plain, {1, 2});
                       }),
              HasSubstr("hf_quant_config.json"));
  // The flat form, newer exports' config.json.
  nlohmann::json flat = plain;
  flat["quantization_config"] = {{"quant_method", "modelopt"},
                                 {"quant_algo", "NVFP4"},
                                 {"group_size", 16},
                                 {"kv_cache_scheme", {{"type", "float"}, {"num_bits", 8}}},
                                 {"ignore", {"lm_head", "model.layers.0.*"}}};
  q = models::parse_quant_scheme(flat);
  EXPECT_EQ(q.method, Method::kNvfp4);
  EXPECT_TRUE(q.kv_cache_scales);
  EXPECT_EQ(q.ignored.size(), 2u);
  nlohmann::json fp4 = plain;  // quant_method modelopt_fp4 names the algorithm itself
  fp4["quantization_config"] = {{"quant_method", "modelopt_fp4"}, {"group_size", 16}};
  EXPECT_EQ(models::parse_quant_scheme(fp4).method, Method::kNvfp4);

  auto nested = [&](const nlohmann::json& quantization) {
    return models::with_hf_quant_config(
        plain, {{"producer", {{"name", "modelopt"}}}, {"quantization", quantization}});
  };
  EXPECT_THAT(error_of(Stage::kMapping,
                       [&] {
                         models::make_model(nested({{"quant_algo", "FP8_PB_WO"}}), {});
                       }),
              HasSubstr("quant_algo \"FP8_PB_WO\" is not supported"));
  EXPECT_THAT(error_of(Stage::kMapping,
                       [&] {
                         models::make_model(
                             nested({{"quant_algo", "FP8"}, {"kv_cache_quant_algo", "NVFP4"}}), {});
                       }),
              HasSubstr("KV cache quantization NVFP4 is not supported"));
  EXPECT_THAT(error_of(Stage::kConfig,
                       [&] {
                         models::make_model(nested({{"quant_algo", "NVFP4"}}), {});
                       }),
              HasSubstr("group_size must be a positive integer for NVFP4"));
  EXPECT_THAT(error_of(Stage::kConfig,
                       [&] {
                         models::make_model(nested({{"x", 1}}), {});
                       }),
              HasSubstr("cannot find 'quant_algo'"));
  nlohmann::json other = models::with_hf_quant_config(
      plain, {{"producer", {{"name", "awq"}}}, {"quantization", {{"quant_algo", "FP8"}}}});
  EXPECT_THAT(error_of(Stage::kMapping, [&] { models::make_model(other, {}); }),
              HasSubstr("must come from modelopt"));
}

// How each format's list of excluded modules reads an entry.
TEST(QuantScheme, ExclusionsMatchAsEachFormatReadsThem) {
  models::QuantScheme ct;
  ct.ignore_match = models::QuantScheme::IgnoreMatch::kSubstringOrRegex;
  ct.ignored = {"LM_HEAD", "re:.*mlp\\.gate$", "re:model\\.layers\\.1\\."};
  const models::ExcludedModules c(ct);
  EXPECT_TRUE(c.skipped("lm_head"));  // case-insensitive substring
  EXPECT_TRUE(c.skipped("model.layers.3.mlp.gate"));
  EXPECT_FALSE(c.skipped("model.layers.3.mlp.gate_up_proj"));
  EXPECT_TRUE(c.skipped("model.layers.1.self_attn.qkv_proj"));  // anchored at the start
  EXPECT_FALSE(c.skipped("model.layers.11.self_attn.qkv_proj"));
  ct.ignored = {"model.layers.2.self_attn.q_proj"};
  EXPECT_THAT(error_of(Stage::kMapping,
                       [&] {
                         models::module_skipped(
                             ct, "model.layers.2.self_attn.qkv_proj",
                             {"model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.k_proj",
                              "model.layers.2.self_attn.v_proj"});
                       }),
              HasSubstr("some but not all shards"));

  models::QuantScheme mo;
  mo.ignore_match = models::QuantScheme::IgnoreMatch::kGlob;
  mo.ignored = {"model.layers.0.*", "*shared_experts*", "kv_b_proj", "model.layers.5.mlp"};
  const models::ExcludedModules m(mo);
  EXPECT_TRUE(m.skipped("model.layers.0.self_attn.qkv_proj"));
  EXPECT_FALSE(m.skipped("model.layers.10.self_attn.qkv_proj"));
  EXPECT_TRUE(m.skipped("model.layers.3.mlp.shared_experts.gate_up_proj"));
  EXPECT_TRUE(m.skipped("model.layers.3.self_attn.kv_b_proj"));  // one dotted part
  EXPECT_TRUE(m.skipped("model.layers.5.mlp.experts"));          // under the entry
  EXPECT_FALSE(m.skipped("model.layers.55.mlp.experts"));
  EXPECT_TRUE(m.skipped("language_model.model.layers.0.mlp.gate_up_proj"));
  mo.ignored = {"model.layers.*.self_attn.kv_a_proj_with_mqa"};  // inside the fused MLA param
  EXPECT_TRUE(models::module_skipped(mo, "model.layers.4.self_attn.fused_qkv_a_proj_with_mqa"));
  EXPECT_FALSE(models::module_skipped(mo, "model.decoder.self_attn.fused_qkv_a_proj_with_mqa"));
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
              HasSubstr("of a quantized parameter (fp8 block [8, 8]) is not supported"));
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
  std::vector<synth::SynthTensor> tensors =
      synth::synth_tensor_list("llama", "tiny", DType::kBF16, false);
  synth::synth_quantize(tensors, synth::SynthQuant::kFp8Block, quant::kBlock);
  std::vector<models::Route> routes;
  for (const synth::SynthTensor& t : tensors) {
    if (t.name != w + "_scale_inv") {
      routes.push_back(m->route(tensor_info(t.name, t.dtype, t.shape)));
    }
  }
  EXPECT_THAT(models::gap_names(models::check_coverage(*m, routes)),
              ::testing::ElementsAre(w + "_scale_inv"));
}

// The other formats' scales: misshapen ones named, NVFP4's K refused in SGLang's
// words, excluded modules left whole, ModelOpt's kv scales under both names.
TEST(QuantPlacement, ChannelTensorAndNvfp4ScalesAreCheckedAndNamed) {
  const std::string w = "model.layers.0.mlp.down_proj.weight";
  auto model_of = [](synth::SynthQuant kind, nlohmann::json c, models::ParallelLayout l = {}) {
    quant::set_quant_config(c, kind);
    return models::make_model(c, l);
  };
  const nlohmann::json llama = synth::synth_config("llama", "tiny", DType::kBF16, false);
  // A channel scale is [N, 1]: a 1-D [N] one is refused naming the shape.
  auto channel = model_of(synth::SynthQuant::kFp8Channel, llama);
  const auto& cs = channel->shells()[0];
  const std::uint64_t n = cs.params[cs.by_name.at(w)].shape[0];
  EXPECT_EQ(cs.params[cs.by_name.at("model.layers.0.mlp.down_proj.weight_scale")].shape,
            (std::vector<std::uint64_t>{n, 1}));
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         channel->route(tensor_info("model.layers.0.mlp.down_proj.weight_scale",
                                                    DType::kF32, {n}));
                       }),
              HasSubstr("the checkpoint tensor must be [" + std::to_string(n) + ", 1]"));
  // A per-tensor scale is one value; qkv_proj holds one per shard.
  auto tensor = model_of(synth::SynthQuant::kFp8Tensor, llama);
  const auto& ts = tensor->shells()[0];
  EXPECT_EQ(ts.params[ts.by_name.at("model.layers.0.self_attn.qkv_proj.weight_scale")].shape,
            std::vector<std::uint64_t>{3});
  EXPECT_EQ(ts.params[ts.by_name.at("model.layers.0.mlp.gate_up_proj.input_scale")].shape,
            std::vector<std::uint64_t>{2});
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         tensor->route(tensor_info("model.layers.0.self_attn.k_proj.weight_scale",
                                                   DType::kF32, {2}));
                       }),
              HasSubstr("the checkpoint tensor must be []"));
  // NVFP4: K of every share a multiple of 16 (intermediate 200: down_proj's K).
  nlohmann::json odd = llama;
  odd["intermediate_size"] = 200;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { model_of(synth::SynthQuant::kNvfp4, odd); }),
              AllOf(HasSubstr("Unsupported model when in features size is not multiple of 16"),
                    HasSubstr("down_proj.weight has 200 input features")));
  models::ParallelLayout tp8;
  tp8.tp = 8;  // 256 / 8 = 32 rows of gate / up, but down_proj's K is 32: fine; o_proj's 16
  EXPECT_NO_THROW(model_of(synth::SynthQuant::kNvfp4, llama, tp8));
  nlohmann::json narrow = llama;
  narrow["intermediate_size"] = 192;  // 192 / 8 = 24 input features of down_proj a rank
  EXPECT_THAT(
      error_of(Stage::kPlacement, [&] { model_of(synth::SynthQuant::kNvfp4, narrow, tp8); }),
      HasSubstr("has 24 input features on tp rank 0"));
  // NVFP4 bytes: a BF16 weight is refused by dtype; the packed shape is [N, K / 2].
  auto fp4 = model_of(synth::SynthQuant::kNvfp4, llama);
  const auto& fs = fp4->shells()[0];
  const models::ParamSpec& down = fs.params[fs.by_name.at(w)];
  EXPECT_EQ(down.dtype, DType::kU8);
  EXPECT_EQ(down.shape, (std::vector<std::uint64_t>{128, 128}));  // [hidden, 256 / 2]
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] {
                         fp4->route(tensor_info(w, DType::kBF16, {128, 256}));
                       }),
              HasSubstr("cannot load a BF16 weight"));
  // Excluded modules keep their dtype and get no companions.
  nlohmann::json excluded = llama;
  quant::set_quant_config(excluded, synth::SynthQuant::kNvfp4);
  excluded["quantization_config"]["quantization"]["exclude_modules"] = {"lm_head",
                                                                        "model.layers.1.*"};
  auto ex = models::make_model(excluded, {});
  const auto& es = ex->shells()[0];
  EXPECT_EQ(es.params[es.by_name.at("model.layers.1.mlp.down_proj.weight")].dtype, DType::kBF16);
  EXPECT_EQ(es.by_name.count("model.layers.1.mlp.down_proj.weight_scale"), 0u);
  EXPECT_EQ(es.by_name.count("model.layers.1.mlp.down_proj.input_scale"), 0u);
  EXPECT_EQ(es.params[es.by_name.at(w)].dtype, DType::kU8);
  // ModelOpt's kv scales: self_attn.k_proj.k_scale or self_attn.k_scale, one param.
  auto kv = model_of(synth::SynthQuant::kModelOptFp8, llama);
  for (const char* name :
       {"model.layers.2.self_attn.k_proj.k_scale", "model.layers.2.self_attn.k_scale"}) {
    const models::Route r = kv->route(tensor_info(name, DType::kF32, {}));
    ASSERT_EQ(r.kind, models::RouteKind::kPlaced) << name;
    EXPECT_EQ(kv->shells()[0].params[r.pieces.at(0).param].name,
              "model.layers.2.self_attn.attn.k_scale");
  }
  // MLA (DeepSeek): SGLang 0.5.23's DeepSeek loader (deepseek_weight_loader.py,
  // load_weights) renames self_attn.k_proj.k_scale to self_attn.attn_mqa.k_scale.
  {
    auto mla = model_of(synth::SynthQuant::kModelOptFp8,
                        synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false));
    for (const std::string s : {"k", "v"}) {
      const std::string name = "model.layers.0.self_attn." + s + "_proj." + s + "_scale";
      const models::Route r = mla->route(tensor_info(name, DType::kF32, {}));
      ASSERT_EQ(r.kind, models::RouteKind::kPlaced) << name;
      EXPECT_EQ(mla->shells()[0].params[r.pieces.at(0).param].name,
                "model.layers.0.self_attn.attn_mqa." + s + "_scale");
      EXPECT_EQ(mla->shells()[0].by_name.count("model.layers.0.self_attn.attn." + s + "_scale"),
                0u);
    }
  }
  // Qwen3, Qwen3-MoE and GLM-4 MoE: SGLang 0.5.23 builds their RadixAttention
  // without the quant config (Qwen3Attention, Qwen3MoeAttention, Glm4MoeAttention),
  // so they have no k_scale / v_scale and the checkpoint's are skipped.
  for (const char* family : {"qwen3", "qwen3_moe"}) {
    auto q3 = model_of(synth::SynthQuant::kModelOptFp8,
                       synth::synth_config(family, "tiny", DType::kBF16, false));
    const models::Route r =
        q3->route(tensor_info("model.layers.0.self_attn.k_proj.k_scale", DType::kF32, {}));
    EXPECT_EQ(r.kind, models::RouteKind::kDropped) << family;
    EXPECT_EQ(r.reason, "no_kv_scale_param") << family;
    EXPECT_EQ(q3->shells()[0].by_name.count("model.layers.0.self_attn.attn.k_scale"), 0u) << family;
  }
  // Without an FP8 KV cache in the config, k_scale has no param (unmapped).
  EXPECT_EQ(
      tensor->route(tensor_info("model.layers.2.self_attn.k_proj.k_scale", DType::kF32, {})).kind,
      models::RouteKind::kUnmapped);
}

// QuantizedMatrix::at, the host reading the MLA split uses, by each format's
// definition.
TEST(QuantizedMatrix, ReadsEachFormatByItsDefinition) {
  using Method = models::QuantScheme::Method;
  models::QuantScheme s;
  const std::vector<std::uint8_t> w{float_to_e4m3(1.5f), float_to_e4m3(-2.0f), float_to_e4m3(0.25f),
                                    float_to_e4m3(4.0f)};  // [2, 2]
  const std::vector<float> scales{2.0f, 0.5f, 3.0f, 8.0f};
  const auto* sb = reinterpret_cast<const std::byte*>(scales.data());
  s.method = Method::kFp8Block;
  s.block_n = 1;
  s.block_k = 2;  // scale [2, 1]
  models::QuantizedMatrix m{&s, 2, 2, w.data(), sb};
  EXPECT_EQ(m.at(0, 1), -4.0f);
  EXPECT_EQ(m.at(1, 0), 0.125f);
  s.method = Method::kFp8Channel;  // scale [2, 1]
  EXPECT_EQ(m.at(1, 1), 2.0f);
  s.method = Method::kFp8Tensor;
  EXPECT_EQ(m.at(1, 1), 8.0f);
  // NVFP4: element 2i in the low nibble; code 0b1011 is -1.5, 0b0111 is 6.
  s.method = Method::kNvfp4;
  s.group_size = 2;
  const std::vector<std::uint8_t> packed{0x7B, 0x21};  // row 0: -1.5, 6; row 1: 0.5, 1
  const std::vector<std::uint8_t> group_scales{float_to_e4m3(2.0f), float_to_e4m3(0.5f)};
  models::QuantizedMatrix f{
      &s, 2, 2, packed.data(), reinterpret_cast<const std::byte*>(group_scales.data()), 3.0f};
  EXPECT_EQ(f.at(0, 0), -1.5f * 2.0f * 3.0f);
  EXPECT_EQ(f.at(0, 1), 6.0f * 2.0f * 3.0f);
  EXPECT_EQ(f.at(1, 0), 0.5f * 0.5f * 3.0f);
  EXPECT_EQ(f.at(1, 1), 1.0f * 0.5f * 3.0f);
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
