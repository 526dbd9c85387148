// postprocess.target through the whole pipeline on the host device: each target's
// params hold what a naive reference, written here from SGLang 0.5.23's definitions,
// makes of a plain (loader) load of the same checkpoint. Also: the capture-safe
// startup runs the hooks again on the real weights in the same storage, the dummy
// format allocates what a real load does, the report and the plan say the target,
// and bad values are refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gpu/kernels_host.hpp"
#include "io/safetensors.hpp"
#include "models/postprocess.hpp"
#include "models/quant.hpp"
#include "models/requant.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/plan_report.hpp"
#include "runtime/postprocess_load_util.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/dtype_codec.hpp"
#include "testing/synth_tiny.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using postprocess_testing::as_fp8_format;
using postprocess_testing::committed_overlap;
using postprocess_testing::f16;
using postprocess_testing::floats;
using postprocess_testing::load_both;
using postprocess_testing::Loads;
using postprocess_testing::overlap_and_dummy_match;
using postprocess_testing::requant_value;
using postprocess_testing::set_scalars;
using postprocess_testing::swizzle_blockscale;
using testing::make_config;
using testing::synth_tiny;
using testing::TempDir;

// compressed-tensors' fused experts need equal w1 / w3 input scales (SGLang refuses
// others): each expert's gate and up scales set to one value, which varies from
// expert to expert (synth's equal pairs, made independent of its values).
void equal_w1_w3_input_scales(const std::string& ck) {
  std::vector<float> values;
  for (int i = 0; i < 4096; ++i) {
    values.push_back(0.01f * static_cast<float>(i % 37 + 1));
  }
  set_scalars(ck, "gate_proj.input_scale", values);
  set_scalars(ck, "up_proj.input_scale", values);
}

// The rows each shard of a dense param's scales covers: the loader's [S] scales over
// the weight's N rows, found from the q / k / v and gate / up widths of the config.
std::vector<std::uint64_t> widths(const nlohmann::json& c, const std::string& weight, int tp,
                                  std::uint64_t rows) {
  if (weight.find("qkv_proj") != std::string::npos) {
    const std::uint64_t heads = c["num_attention_heads"].get<std::uint64_t>();
    const std::uint64_t kv = c["num_key_value_heads"].get<std::uint64_t>();
    const std::uint64_t d = c.value("head_dim", c["hidden_size"].get<std::uint64_t>() / heads);
    const std::uint64_t q = heads / tp * d;
    const std::uint64_t k = std::max<std::uint64_t>(1, kv / tp) * d;
    EXPECT_EQ(q + 2 * k, rows);
    return {q, k, k};
  }
  if (weight.find("gate_up_proj") != std::string::npos) {
    return {rows / 2, rows / 2};
  }
  return {rows};
}

void check_dense(const Loads& l, const std::string& ck, const std::string& format) {
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  const nlohmann::json c = nlohmann::json::parse(std::ifstream(ck + "/config.json"));
  std::size_t checked = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : l.target.model->ranks()[r].params) {
      if (p.dtype != DType::kF8E4M3) {
        continue;
      }
      ++checked;
      const std::string base = p.name.substr(0, p.name.size() - 6);
      const std::vector<std::byte> w = l.plain.model->read_param(r, p.name);
      const std::vector<float> s = floats(l.plain.model->read_param(r, base + "weight_scale"));
      const std::vector<float> in = floats(l.plain.model->read_param(r, base + "input_scale"));
      const std::uint64_t rows = p.shape[0];
      const std::uint64_t cols = p.shape[1];
      const std::vector<std::uint64_t> wd = widths(c, p.name, 2, rows);
      ASSERT_EQ(wd.size(), s.size()) << p.name;
      const float smax = *std::max_element(s.begin(), s.end());
      // input_scale.max(), F32 [].
      EXPECT_EQ(floats(l.target.model->read_param(r, base + "input_scale")),
                std::vector<float>{*std::max_element(in.begin(), in.end())})
          << p.name;
      const std::vector<std::byte> got_w = l.target.model->read_param(r, p.name);
      const std::vector<float> got_s = floats(l.target.model->read_param(r, base + "weight_scale"));
      const bool aligned = rows % 16 == 0 && cols % 16 == 0;
      if (format == "fp8") {
        // convert_to_channelwise: each row its shard's scale; the weight as loaded.
        std::vector<float> want;
        for (std::size_t i = 0; i < wd.size(); ++i) {
          want.insert(want.end(), wd[i], s[i]);
        }
        EXPECT_EQ(got_s, want) << p.name;
        EXPECT_EQ(got_w, w) << p.name;
        continue;
      }
      // requantize_with_max_scale: every shard to the largest scale.
      if (format == "modelopt" && !aligned) {
        EXPECT_EQ(got_s, std::vector<float>(rows, smax)) << p.name;
      } else {
        EXPECT_EQ(got_s, std::vector<float>{smax}) << p.name;
      }
      std::uint64_t row = 0;
      for (std::size_t i = 0; i < wd.size(); ++i) {
        for (std::uint64_t e = row * cols; e < (row + wd[i]) * cols; ++e) {
          const float want = requant_value(static_cast<std::uint8_t>(w[e]), s[i], smax);
          const float got = testing::e4m3_value(static_cast<std::uint8_t>(got_w[e]));
          ASSERT_EQ(got, want) << p.name << " element " << e;
        }
        row += wd[i];
      }
    }
  }
  EXPECT_GT(checked, 8u);
}

TEST(PostprocessLoad, Fp8PerTensorExpandsEachShardsScaleOverItsRows) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "llama", synth::SynthQuant::kFp8Tensor, "fp8");
  as_fp8_format(ck);
  for (const std::string target : {"sm90", "sm100"}) {
    SCOPED_TRACE(target);
    const Loads l = load_both(ck, target);
    check_dense(l, ck, "fp8");
    EXPECT_EQ(l.target.model->report().postprocess_target, target);
    EXPECT_EQ(l.plain.model->report().postprocess_target, "loader");
    // The twins are freed with the load.
    EXPECT_EQ(
        l.target.model->ranks()[0].find("model.layers.0.self_attn.qkv_proj.weight_scale_loaded"),
        nullptr);
  }
}

TEST(PostprocessLoad, CompressedTensorsAndModelOptRequantizeToTheLargestScale) {
  TempDir dir;
  const std::string ct = synth_tiny(dir, "qwen3", synth::SynthQuant::kFp8Tensor, "ct");
  check_dense(load_both(ct, "sm90"), ct, "compressed-tensors");
  const std::string mo = synth_tiny(dir, "llama", synth::SynthQuant::kModelOptFp8, "modelopt");
  // Valid FP8 KV-cache scales (synth's may be negative; see KvCacheScales below).
  set_scalars(mo, "k_scale", {0.5f});
  set_scalars(mo, "v_scale", {0.25f});
  check_dense(load_both(mo, "sm100"), mo, "modelopt");
}

// BaseKVCacheMethod.process_weights_after_loading: both valid kept, neither 1.0,
// only k_scale the larger in both; a valid v_scale beside an invalid k_scale is
// refused, as SGLang asserts. fp8 checkpoints get 1.0 on every attention.
TEST(PostprocessLoad, KvCacheScales) {
  TempDir dir;
  const std::string mo = synth_tiny(dir, "llama", synth::SynthQuant::kModelOptFp8, "modelopt");
  // Layer 0: k 2, v -1 (one kv_scale); layer 1: both -1 (not calibrated).
  set_scalars(mo, "k_scale", {2.0f, -1.0f});
  set_scalars(mo, "v_scale", {-1.0f, -1.0f});
  const Loads l = load_both(mo, "sm90");
  ASSERT_TRUE(l.target) << l.target.error->message;
  for (std::size_t r = 0; r < 2; ++r) {
    auto at = [&](const std::string& name) { return floats(l.target.model->read_param(r, name)); };
    EXPECT_EQ(at("model.layers.0.self_attn.attn.k_scale"), std::vector<float>{2.0f});
    EXPECT_EQ(at("model.layers.0.self_attn.attn.v_scale"), std::vector<float>{2.0f});
    EXPECT_EQ(at("model.layers.1.self_attn.attn.k_scale"), std::vector<float>{1.0f});
    EXPECT_EQ(at("model.layers.1.self_attn.attn.v_scale"), std::vector<float>{1.0f});
  }
  // As loaded under loader.
  EXPECT_EQ(floats(l.plain.model->read_param(0, "model.layers.1.self_attn.attn.k_scale")),
            std::vector<float>{-1.0f});
  set_scalars(mo, "k_scale", {-1.0f});
  set_scalars(mo, "v_scale", {3.0f});
  Runtime rt(to_config(make_config(mo, {"parallel.tp=2", "postprocess.target=sm90"})));
  LoadResult refused = rt.load();
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error->stage, Stage::kPostProcess);
  EXPECT_THAT(
      refused.error->message,
      ::testing::ContainsRegex("tensor 'model\\.layers\\.[0-9]+\\.self_attn\\.attn\\.k_scale'"));
  EXPECT_THAT(refused.error->message, ::testing::HasSubstr("asserts k_scale > 0"));
  // fp8: Fp8KVCacheMethod on every attention, nothing loads them: 1.0.
  const std::string fp8 = synth_tiny(dir, "llama", synth::SynthQuant::kFp8Tensor, "fp8");
  as_fp8_format(fp8);
  const Loads f = load_both(fp8, "sm100");
  ASSERT_TRUE(f.target) << f.target.error->message;
  EXPECT_EQ(floats(f.target.model->read_param(1, "model.layers.1.self_attn.attn.v_scale")),
            std::vector<float>{1.0f});
  EXPECT_EQ(f.plain.model->ranks()[0].find("model.layers.1.self_attn.attn.v_scale"), nullptr);
}

// Fused experts: each expert's w1 and w3 requantized to the larger of its two
// scales, which w13_weight_scale [E] holds; the input scales' max; w2 as loaded.
TEST(PostprocessLoad, PerTensorExpertsRequantizeW1AndW3ToOneScale) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "qwen3_moe", synth::SynthQuant::kFp8Tensor, "moe");
  equal_w1_w3_input_scales(ck);
  const Loads l = load_both(ck, "sm90", {"parallel.tp=2", "parallel.ep=2"});
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t checked = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : l.target.model->ranks()[r].params) {
      if (!p.name.ends_with("experts.w13_weight")) {
        continue;
      }
      ++checked;
      const std::string e = p.name.substr(0, p.name.size() - std::string("w13_weight").size());
      const std::vector<std::byte> w = l.plain.model->read_param(r, p.name);
      const std::vector<float> s = floats(l.plain.model->read_param(r, e + "w13_weight_scale"));
      const std::vector<std::byte> got_w = l.target.model->read_param(r, p.name);
      const std::vector<float> got_s =
          floats(l.target.model->read_param(r, e + "w13_weight_scale"));
      const std::uint64_t experts = p.shape[0];
      const std::uint64_t half = p.shape[1] / 2;
      const std::uint64_t cols = p.shape[2];
      ASSERT_EQ(s.size(), 2 * experts);
      ASSERT_EQ(got_s.size(), experts);
      for (std::uint64_t x = 0; x < experts; ++x) {
        const float smax = std::max(s[2 * x], s[2 * x + 1]);
        EXPECT_EQ(got_s[x], smax);
        for (std::uint64_t i = 0; i < 2 * half * cols; ++i) {
          const std::uint64_t at = x * 2 * half * cols + i;
          const float own = s[2 * x + (i / cols >= half ? 1 : 0)];
          ASSERT_EQ(testing::e4m3_value(static_cast<std::uint8_t>(got_w[at])),
                    requant_value(static_cast<std::uint8_t>(w[at]), own, smax))
              << p.name << " expert " << x << " element " << i;
        }
      }
      for (const std::string name : {"w2_weight", "w2_weight_scale"}) {
        EXPECT_EQ(l.target.model->read_param(r, e + name), l.plain.model->read_param(r, e + name));
      }
      for (const std::string name : {"w13_input_scale", "w2_input_scale"}) {
        const std::vector<float> in = floats(l.plain.model->read_param(r, e + name));
        EXPECT_EQ(floats(l.target.model->read_param(r, e + name)),
                  std::vector<float>{*std::max_element(in.begin(), in.end())});
      }
    }
  }
  EXPECT_GT(checked, 1u);
}

// Block FP8 on sm100 with DeepEP: the UE8M0 repack of models/requant.hpp on exactly
// the weights DeepGEMM runs; the MLA split still reads kv_b_proj as loaded.
TEST(PostprocessLoad, BlockFp8OnSm100IsTheUe8m0RepackOfAPlainLoad) {
  TempDir dir;
  const std::string ck = testing::synth_deepseek_v3_block128(dir);
  const std::vector<std::string> sets = {"parallel.tp=1", "parallel.moe_a2a=deepep"};
  const Loads l = load_both(ck, "sm100", sets);
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t repacked = 0;
  for (const LoadedParam& p : l.target.model->ranks()[0].params) {
    if (p.dtype != DType::kF8E4M3) {
      continue;
    }
    const std::string scale = p.name + "_scale_inv";
    const LoadedParam* packed = l.target.model->ranks()[0].find(scale);
    ASSERT_NE(packed, nullptr);
    if (packed->dtype == DType::kF32) {
      EXPECT_EQ(l.target.model->read_param(0, p.name), l.plain.model->read_param(0, p.name));
      continue;
    }
    ++repacked;
    std::vector<std::byte> w = l.plain.model->read_param(0, p.name);
    std::vector<std::byte> s = l.plain.model->read_param(0, scale);
    const std::uint64_t rows = p.shape[p.shape.size() - 2];
    const std::uint64_t cols = p.shape.back();
    const std::uint64_t matrices = p.shape.size() == 3 ? p.shape[0] : 1;
    EXPECT_EQ(rows % 64, 0u);
    EXPECT_EQ(cols % 128, 0u);
    std::vector<std::byte> want(packed->nbytes);
    const std::uint64_t words = ((cols + 127) / 128 + 3) / 4;
    for (std::uint64_t e = 0; e < matrices; ++e) {
      models::requant_ue8m0(reinterpret_cast<std::uint8_t*>(w.data()) + e * rows * cols,
                            reinterpret_cast<float*>(s.data()) + e * (s.size() / 4 / matrices),
                            reinterpret_cast<std::int32_t*>(want.data()) + e * words * rows, rows,
                            cols);
    }
    EXPECT_EQ(l.target.model->read_param(0, p.name), w) << p.name;
    EXPECT_EQ(l.target.model->read_param(0, scale), want) << scale;
  }
  EXPECT_GT(repacked, 10u);
  EXPECT_EQ(l.target.model->read_param(0, "model.layers.1.self_attn.w_kc"),
            l.plain.model->read_param(0, "model.layers.1.self_attn.w_kc"));
}

// The capture-safe startup runs the hooks on the sentinel, then on the real weights,
// in the same storage; the dummy format allocates what a real load does.
TEST(PostprocessLoad, OverlapStartupAndDummyFormatKeepTheTargetsLayout) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "qwen3_moe", synth::SynthQuant::kFp8Tensor, "moe");
  equal_w1_w3_input_scales(ck);
  const std::vector<std::string> sets = {"parallel.tp=2", "postprocess.target=sm90"};
  LoadResult committed = committed_overlap(ck, sets);
  ASSERT_TRUE(committed) << committed.error->message;
  EXPECT_TRUE(committed.model->report().startup_refusals.empty());
  Runtime serial(to_config(make_config(ck, sets)));
  LoadResult s = serial.load();
  ASSERT_TRUE(s) << s.error->message;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : s.model->ranks()[r].params) {
      EXPECT_EQ(committed.model->read_param(r, p.name), s.model->read_param(r, p.name)) << p.name;
    }
    // The overlap keeps the load-only params the hooks read (the loaded scales, w1's
    // input scales), in storage that does not move, for the run on the real
    // weights; nothing else is extra.
    for (const LoadedParam& p : committed.model->ranks()[r].params) {
      if (s.model->ranks()[r].find(p.name) == nullptr) {
        EXPECT_TRUE(p.name.ends_with("_loaded") || p.name.ends_with("_w1")) << p.name;
      }
    }
  }
  std::vector<std::string> dummy_sets = sets;
  dummy_sets.push_back("model.load_format=dummy");
  Runtime dummy(to_config(make_config(ck, dummy_sets)));
  LoadResult d = dummy.load();
  ASSERT_TRUE(d) << d.error->message;
  EXPECT_EQ(d.model->report().postprocess_target, "sm90");
  for (std::size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(d.model->ranks()[r].params.size(), s.model->ranks()[r].params.size());
    for (std::size_t i = 0; i < s.model->ranks()[r].params.size(); ++i) {
      const LoadedParam& a = d.model->ranks()[r].params[i];
      const LoadedParam& b = s.model->ranks()[r].params[i];
      EXPECT_EQ(a.name, b.name);
      EXPECT_EQ(a.dtype, b.dtype) << a.name;
      EXPECT_EQ(a.shape, b.shape) << a.name;
      EXPECT_EQ(a.nbytes, b.nbytes) << a.name;
    }
  }
  // The plan names the target.
  const PlanReport plan = make_plan_report(make_config(ck, sets));
  EXPECT_EQ(plan.to_json()["postprocess_target"], "sm90");
  EXPECT_THAT(plan.summary(), ::testing::HasSubstr("postprocess.target sm90"));
  EXPECT_EQ(make_plan_report(make_config(ck, {"postprocess.target=auto"})).postprocess_target,
            "loader");  // auto on host devices
}

// SGLang's FusedMoE.weight_loader for compressed-tensors: an expert's w1 and w3
// input scales must be equal (within 1e-5, unless w1's is 1), on every target.
TEST(PostprocessLoad, CompressedTensorsExpertsNeedEqualW1W3InputScales) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "qwen3_moe", synth::SynthQuant::kFp8Tensor, "moe");
  // synth gives w1 and w3 one value (synth_value_name); make them differ.
  set_scalars(ck, "gate_proj.input_scale", {0.5f});
  set_scalars(ck, "up_proj.input_scale", {0.25f});
  for (const std::string target : {"loader", "sm90"}) {
    Runtime rt(to_config(make_config(ck, {"parallel.tp=2", "postprocess.target=" + target})));
    LoadResult r = rt.load();
    ASSERT_FALSE(r) << target;
    EXPECT_EQ(r.error->stage, Stage::kPostProcess);
    EXPECT_THAT(r.error->message, ::testing::HasSubstr("input_scales of w1 and w3"));
    EXPECT_THAT(r.error->message, ::testing::ContainsRegex("w13_input_scale(_loaded)?'"));
  }
  equal_w1_w3_input_scales(ck);
  // A w1 scale of exactly 1 is let through whatever w3's is (SGLang's slot starts at 1).
  set_scalars(ck, "experts.0.gate_proj.input_scale", {1.0f});
  set_scalars(ck, "experts.0.up_proj.input_scale", {0.75f});
  Runtime rt(to_config(make_config(ck, {"parallel.tp=2"})));
  LoadResult ok = rt.load();
  ASSERT_TRUE(ok) << ok.error->message;
  // The slot holds w3's; the w1 transient is gone.
  EXPECT_EQ(floats(ok.model->read_param(0, "model.layers.0.mlp.experts.w13_input_scale"))[0],
            0.75f);
  EXPECT_EQ(ok.model->ranks()[0].find("model.layers.0.mlp.experts.w13_input_scale_w1"), nullptr);
}

// NVFP4 on sm100 (ModelOptFp4LinearMethod.process_weights_after_loading, W4A4):
// the scales swizzled over weight_scale or into weight_scale_interleaved, alpha =
// input_scale.max() * weight_scale_2.max(), input_scale_inv = 1 / input_scale.max(),
// everything else as a plain load has it. Also the capture-safe startup (the hooks
// run again on the real weights) and the dummy format.
TEST(PostprocessLoad, Nvfp4OnSm100IsTheSwizzleOfAPlainLoad) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "llama", synth::SynthQuant::kNvfp4, "nvfp4");
  // Distinct scalars, so that a max or a product of the wrong ones shows.
  set_scalars(ck, "input_scale", {0.5f, 0.75f, 0.25f, 1.5f, 0.125f});
  set_scalars(ck, "weight_scale_2", {0.0015f, 0.003f, 0.002f, 0.0005f});  // none 1e-3, the
  // capture-safe startup's sentinel
  const Loads l = load_both(ck, "sm100");
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t in_place = 0;
  std::size_t beside = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    const LoadedRank& got = l.target.model->ranks()[r];
    for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
      ASSERT_NE(got.find(p.name), nullptr) << p.name;
      const std::vector<std::byte> plain = l.plain.model->read_param(r, p.name);
      if (p.dtype != DType::kU8) {
        if (!p.name.ends_with("weight_scale")) {
          EXPECT_EQ(l.target.model->read_param(r, p.name), plain) << p.name;
        }
        continue;
      }
      const std::string base = p.name.substr(0, p.name.size() - 6);
      EXPECT_EQ(l.target.model->read_param(r, p.name), plain) << p.name;  // the weight
      const LoadedParam* scale = l.plain.model->ranks()[r].find(base + "weight_scale");
      ASSERT_NE(scale, nullptr);
      const std::vector<std::byte> want = swizzle_blockscale(
          l.plain.model->read_param(r, scale->name), scale->shape[0], scale->shape[1]);
      if (got.find(base + "weight_scale_interleaved") != nullptr) {
        ++beside;
        EXPECT_EQ(l.target.model->read_param(r, base + "weight_scale_interleaved"), want);
        EXPECT_EQ(l.target.model->read_param(r, scale->name),
                  l.plain.model->read_param(r, scale->name));
      } else {
        ++in_place;
        EXPECT_EQ(l.target.model->read_param(r, scale->name), want) << scale->name;
      }
      const std::vector<float> in = floats(l.plain.model->read_param(r, base + "input_scale"));
      const std::vector<float> s2 = floats(l.plain.model->read_param(r, base + "weight_scale_2"));
      const float is = *std::max_element(in.begin(), in.end());
      const float ws = *std::max_element(s2.begin(), s2.end());
      EXPECT_EQ(floats(l.target.model->read_param(r, base + "alpha")), std::vector<float>{is * ws})
          << base;
      EXPECT_EQ(floats(l.target.model->read_param(r, base + "input_scale_inv")),
                std::vector<float>{1.0f / is})
          << base;
    }
    EXPECT_EQ(got.find("model.layers.0.self_attn.o_proj.weight_scale_loaded"), nullptr);
    // ModelOptFp4Config's "auto" KV cache: k_scale / v_scale on every attention, 1.0.
    EXPECT_EQ(floats(l.target.model->read_param(r, "model.layers.3.self_attn.attn.v_scale")),
              std::vector<float>{1.0f});
  }
  EXPECT_EQ(beside, 4u * 2);  // qkv_proj of four layers, two ranks
  EXPECT_EQ(in_place, 12u * 2);
  overlap_and_dummy_match(ck, "sm100", l.target);
}

// Dense NVFP4 on sm100 that pad_nvfp4_weight pads (the CUTLASS / cuDNN branch of
// ModelOptFp4LinearMethod.process_weights_after_loading: N and K to multiples of 32):
// Llama with intermediate 96 at tp 2, down_proj [H, 48] a rank, served [H, 64] (packed
// [H, 32]): the plain load's rows with zeros after each; its block scales swizzled
// from the unpadded [H, 3] (padded to 4 columns by the swizzle alone); everything
// else as on sm100 without padding. The capture-safe startup and the dummy format agree.
TEST(PostprocessLoad, Nvfp4OnSm100PadsWhatPadNvfp4WeightPads) {
  TempDir dir;
  synth::SynthOptions o;
  nlohmann::json config = synth::synth_config("llama", "tiny", DType::kBF16, false);
  config["intermediate_size"] = 96;
  o.from_config = dir.file("config.json");
  std::ofstream(o.from_config) << config.dump();
  o.quant = synth::SynthQuant::kNvfp4;
  o.out = dir.file("padded");
  o.fsync = false;
  synth::synthesize(o);
  const Loads l = load_both(o.out, "sm100");
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t checked = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
      if (p.dtype != DType::kU8) {
        continue;
      }
      const LoadedParam* served = l.target.model->ranks()[r].find(p.name);
      ASSERT_NE(served, nullptr) << p.name;
      EXPECT_EQ(
          l.target.model->ranks()[r].find(p.name.substr(0, p.name.size() - 6) + "weight_loaded"),
          nullptr);  // the twin is freed with the load
      const std::vector<std::byte> plain = l.plain.model->read_param(r, p.name);
      if (!p.name.ends_with("down_proj.weight")) {
        EXPECT_EQ(served->shape, p.shape) << p.name;
        EXPECT_EQ(l.target.model->read_param(r, p.name), plain) << p.name;
        continue;
      }
      ++checked;
      const std::uint64_t rows = p.shape[0];
      ASSERT_EQ(p.shape, (models::Shape{rows, 24}));
      ASSERT_EQ(served->shape, (models::Shape{rows, 32}));
      std::vector<std::byte> want(rows * 32);
      for (std::uint64_t n = 0; n < rows; ++n) {
        std::memcpy(want.data() + n * 32, plain.data() + n * 24, 24);
      }
      EXPECT_EQ(l.target.model->read_param(r, p.name), want) << p.name;
      const std::string base = p.name.substr(0, p.name.size() - 6);
      const std::vector<std::byte> scale = l.plain.model->read_param(r, base + "weight_scale");
      EXPECT_EQ(l.target.model->read_param(r, base + "weight_scale_interleaved"),
                swizzle_blockscale(scale, rows, 3))
          << base;
    }
  }
  EXPECT_EQ(checked, 4u * 2);  // down_proj of four layers, two ranks
  overlap_and_dummy_match(o.out, "sm100", l.target);
}

// NVFP4 on sm90 (the marlin branch of ModelOptFp4LinearMethod.
// process_weights_after_loading, prepare_nvfp4_layer_for_marlin): the plain load's
// weight and scales zero-padded to Marlin's shape and put through the host twins of
// the device layouts (which tests/gpu/kernels_host_test checks against SGLang's
// repack kernel and scale code), the global scales and alpha from the plain scalars.
TEST(PostprocessLoad, Nvfp4OnSm90IsMarlinsLayoutOfAPlainLoad) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "llama", synth::SynthQuant::kNvfp4, "nvfp4");
  set_scalars(ck, "input_scale", {0.5f, 0.75f, 0.25f, 1.5f, 0.125f});
  set_scalars(ck, "weight_scale_2", {0.0015f, 0.003f, 0.002f, 0.0005f});
  const Loads l = load_both(ck, "sm90");
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t padded = 0;
  std::size_t checked = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
      if (p.dtype != DType::kU8) {
        continue;
      }
      ++checked;
      const std::string base = p.name.substr(0, p.name.size() - 6);
      const std::uint64_t n = p.shape[0];
      const std::uint64_t k = p.shape[1] * 2;
      const models::Shape np_kp = models::marlin_padded_shape({n, k});
      const std::uint64_t np = np_kp[0];
      const std::uint64_t kp = np_kp[1];
      padded += np != n || kp != k ? 1 : 0;
      // The weight and the scales, padded with zeros, through the host layouts.
      const std::vector<std::byte> w = l.plain.model->read_param(r, p.name);
      const std::vector<std::byte> s = l.plain.model->read_param(r, base + "weight_scale");
      std::vector<std::byte> wp(np * kp / 2);
      std::vector<std::byte> sp(np * kp / 16);
      for (std::uint64_t row = 0; row < n; ++row) {
        std::copy_n(w.begin() + row * k / 2, k / 2, wp.begin() + row * kp / 2);
        std::copy_n(s.begin() + row * k / 16, k / 16, sp.begin() + row * kp / 16);
      }
      std::vector<std::byte> want_w(wp.size());
      std::vector<std::byte> want_s(sp.size());
      gpu::host::repack_marlin_fp4(want_w.data(), wp.data(), np, kp);
      gpu::host::marlin_fp4_scales(want_s.data(), sp.data(), np, kp / 16);
      const LoadedParam* got_w = l.target.model->ranks()[r].find(p.name);
      ASSERT_NE(got_w, nullptr);
      EXPECT_EQ(got_w->dtype, DType::kI32);
      EXPECT_EQ(got_w->shape, (models::Shape{kp / 16, 2 * np}));
      EXPECT_EQ(l.target.model->read_param(r, p.name), want_w) << p.name;
      EXPECT_EQ(l.target.model->read_param(r, base + "weight_scale"), want_s) << base;
      // The scalars.
      const std::vector<float> in = floats(l.plain.model->read_param(r, base + "input_scale"));
      const std::vector<float> s2 = floats(l.plain.model->read_param(r, base + "weight_scale_2"));
      const float is = *std::max_element(in.begin(), in.end());
      const float ws = *std::max_element(s2.begin(), s2.end());
      auto scalar = [&](const std::string& name) {
        return floats(l.target.model->read_param(r, base + name));
      };
      EXPECT_EQ(scalar("alpha"), std::vector<float>{is * ws});
      EXPECT_EQ(scalar("input_scale_inv"), std::vector<float>{1.0f / is});
      EXPECT_EQ(scalar("input_global_scale"), std::vector<float>{is});
      // bf16(bf16(ws) * 2^119): nvfp4_marlin_process_global_scale in BF16.
      const std::uint32_t ws_bf16 = std::uint32_t{synth::float_to_bf16_bits(ws)} << 16;
      float rounded = 0;
      std::memcpy(&rounded, &ws_bf16, 4);
      const float global = std::ldexp(rounded, 119);
      std::vector<std::byte> want_global(2);
      testing::encode_one(global, DType::kBF16, want_global.data());
      EXPECT_EQ(l.target.model->read_param(r, base + "weight_global_scale"), want_global) << base;
      // What Marlin does not touch stays as loaded.
      for (const std::string kept : {"input_scale", "weight_scale_2"}) {
        EXPECT_EQ(l.target.model->read_param(r, base + kept),
                  l.plain.model->read_param(r, base + kept))
            << base << kept;
      }
    }
    // The loaded twins are freed with the load.
    EXPECT_EQ(l.target.model->ranks()[r].find("model.layers.0.mlp.down_proj.weight_loaded"),
              nullptr);
  }
  EXPECT_EQ(checked, 16u * 2);
  EXPECT_EQ(padded, 4u * 2);  // qkv_proj [96, 128] on both ranks
  overlap_and_dummy_match(ck, "sm90", l.target);
}

// NVFP4 fused experts on sm90 (ModelOptNvFp4FusedMoEMethod's Marlin branch,
// prepare_moe_nvfp4_layer_for_marlin): each expert's weight and scales through the
// host layouts, unpadded; weight_scale_2 [E] in BF16 from w1's column (w13) or as
// loaded (w2), times 2^119; the input scales as loaded.
TEST(PostprocessLoad, Nvfp4ExpertsOnSm90AreMarlinsLayoutExpertByExpert) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "qwen3_moe", synth::SynthQuant::kNvfp4, "moe");
  // w1 and w3 second scales that differ, so that taking w3's would show.
  set_scalars(ck, "gate_proj.weight_scale_2", {0.0015f, 0.003f, 0.002f});
  set_scalars(ck, "up_proj.weight_scale_2", {0.0025f});
  const Loads l = load_both(ck, "sm90");
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t checked = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
      if (p.dtype != DType::kU8 || p.shape.size() != 3) {
        continue;
      }
      ++checked;
      const std::string base = p.name.substr(0, p.name.size() - 6);
      const std::uint64_t experts = p.shape[0];
      const std::uint64_t n = p.shape[1];
      const std::uint64_t k = p.shape[2] * 2;
      const std::vector<std::byte> w = l.plain.model->read_param(r, p.name);
      const std::vector<std::byte> s = l.plain.model->read_param(r, base + "weight_scale");
      std::vector<std::byte> want_w(w.size());
      std::vector<std::byte> want_s(s.size());
      for (std::uint64_t e = 0; e < experts; ++e) {
        gpu::host::repack_marlin_fp4(want_w.data() + e * n * k / 2, w.data() + e * n * k / 2, n, k);
        gpu::host::marlin_fp4_scales(want_s.data() + e * n * k / 16, s.data() + e * n * k / 16, n,
                                     k / 16);
      }
      EXPECT_EQ(l.target.model->read_param(r, p.name), want_w) << p.name;
      EXPECT_EQ(l.target.model->read_param(r, base + "weight_scale"), want_s) << base;
      const std::vector<float> s2 = floats(l.plain.model->read_param(r, base + "weight_scale_2"));
      const std::uint64_t columns = s2.size() / experts;
      std::vector<std::byte> want_global(experts * 2);
      for (std::uint64_t e = 0; e < experts; ++e) {
        const std::uint32_t bf16 = std::uint32_t{synth::float_to_bf16_bits(s2[e * columns])} << 16;
        float rounded = 0;
        std::memcpy(&rounded, &bf16, 4);
        testing::encode_one(std::ldexp(rounded, 119), DType::kBF16, want_global.data() + 2 * e);
      }
      EXPECT_EQ(l.target.model->read_param(r, base + "weight_scale_2"), want_global) << base;
      EXPECT_EQ(l.target.model->read_param(r, base + "input_scale"),
                l.plain.model->read_param(r, base + "input_scale"))
          << base;
    }
  }
  EXPECT_EQ(checked, 2u * 4 * 2);  // w13 and w2, four layers, two ranks
  overlap_and_dummy_match(ck, "sm90", l.target);
}

// nvfp4_marlin_process_global_scale in an F16 model: weight_scale_2.max() rounded
// to F16, times 2^(2^4 - 2 - 7) = 2^7, in F16. A scale that is subnormal in F16 shows
// the order: rounded before the scaling, it keeps only its subnormal bits.
TEST(PostprocessLoad, Nvfp4GlobalScaleInF16) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "llama", synth::SynthQuant::kNvfp4, "nvfp4");
  const float subnormal = 3.0e-6f;  // F16's normals start at 6.1e-5
  set_scalars(ck, "weight_scale_2", {subnormal, 0.003f});
  const Loads l = load_both(ck, "sm90", {"parallel.tp=2", "model.dtype=f16"});
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t checked = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
      if (p.dtype != DType::kU8) {
        continue;
      }
      ++checked;
      const std::string base = p.name.substr(0, p.name.size() - 6);
      const std::vector<float> s2 = floats(l.plain.model->read_param(r, base + "weight_scale_2"));
      const float ws = *std::max_element(s2.begin(), s2.end());
      const float want = std::ldexp(f16(ws), 7);
      std::vector<std::byte> want_bytes(2);
      testing::encode_one(want, DType::kF16, want_bytes.data());
      EXPECT_EQ(l.target.model->read_param(r, base + "weight_global_scale"), want_bytes) << base;
    }
  }
  EXPECT_EQ(checked, 16u * 2);
  // The first weight's scale is the subnormal one: rounding first loses bits that
  // scaling first would keep.
  const float first = std::ldexp(f16(subnormal), 7);
  EXPECT_NE(first, f16(subnormal * 128.0f));
}

// A biased NVFP4 linear on sm90 (Qwen2's qkv_proj): the bias zero-padded to N' and
// permuted as marlin_permute_bias does (marlin_utils.py: each run of 32 through
// scale_perm_single), the weight repacked as without one.
TEST(PostprocessLoad, Nvfp4BiasOnSm90IsMarlinPermuted) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "qwen2", synth::SynthQuant::kNvfp4, "qwen2");
  const Loads l = load_both(ck, "sm90");
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::vector<std::size_t> perm_single;
  for (std::size_t i = 0; i < 4; ++i) {
    for (std::size_t j : {0, 1, 8, 9, 16, 17, 24, 25}) {
      perm_single.push_back(2 * i + j);
    }
  }
  std::size_t checked = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
      if (!p.name.ends_with("qkv_proj.bias")) {
        continue;
      }
      ++checked;
      const std::vector<std::byte> plain = l.plain.model->read_param(r, p.name);
      const LoadedParam* got = l.target.model->ranks()[r].find(p.name);
      ASSERT_NE(got, nullptr);
      const std::size_t np = got->shape.at(0);
      ASSERT_EQ(np % 32, 0u);
      ASSERT_GE(np, p.shape[0]);
      std::vector<std::byte> padded(np * 2);
      std::copy(plain.begin(), plain.end(), padded.begin());
      std::vector<std::byte> want(np * 2);
      for (std::size_t e = 0; e < np; ++e) {
        const std::size_t from = e - e % 32 + perm_single[e % 32];
        want[2 * e] = padded[2 * from];
        want[2 * e + 1] = padded[2 * from + 1];
      }
      EXPECT_EQ(l.target.model->read_param(r, p.name), want) << p.name;
    }
  }
  EXPECT_EQ(checked, 4u * 2);
}

// DeepSeek on sm90 with NVFP4: the MLA split reads kv_b_proj as loaded (SGLang's
// post_load_weights runs before process_weights_after_loading repacks it), so w_kc
// and w_vc are a plain load's, and kv_b_proj itself is Marlin's.
TEST(PostprocessLoad, Nvfp4MlaSplitReadsKvBProjAsLoadedOnSm90) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "deepseek_v3", synth::SynthQuant::kNvfp4, "ds");
  const Loads l = load_both(ck, "sm90", {"parallel.tp=1"});
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  for (const std::string name :
       {"model.layers.0.self_attn.w_kc", "model.layers.1.self_attn.w_vc"}) {
    EXPECT_EQ(l.target.model->read_param(0, name), l.plain.model->read_param(0, name)) << name;
  }
  const LoadedParam* kv_b =
      l.target.model->ranks()[0].find("model.layers.0.self_attn.kv_b_proj.weight");
  ASSERT_NE(kv_b, nullptr);
  EXPECT_EQ(kv_b->dtype, DType::kI32);
}

TEST(PostprocessLoad, BadValuesAreRefusedByName) {
  try {
    make_config("/x", {"postprocess.target=sm89"});
    FAIL() << "accepted sm89";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("postprocess.target"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("expected loader, sm90, sm100 or auto"));
  }
  TempDir dir;
  const std::string ck = synth_tiny(dir, "mixtral", synth::SynthQuant::kNvfp4, "nvfp4");
  Runtime rt(to_config(make_config(ck, {"postprocess.target=sm100", "parallel.tp=4"})));
  LoadResult r = rt.load();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kPlacement);
  EXPECT_THAT(r.error->message,
              ::testing::HasSubstr("cannot pad a gated layer's w13 block scales to 128 rows"));
}

}  // namespace
}  // namespace ferry::runtime
