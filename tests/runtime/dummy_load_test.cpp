// model.load_format=dummy (SGLang's DummyModelLoader): every parameter from
// config.json alone, filled with deterministic random values in the ranges of
// models::dummy_range, the post-load hooks run on them (the MLA split of a dummy
// FP8 kv_b_proj), on host devices and on null devices at DeepSeek-V3's real size;
// `ferry plan` of it; and what is refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/fp8.hpp"
#include "models/quant.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/plan_report.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/dtype_codec.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::runtime {
namespace {

using testing::decode_one;
using ::testing::HasSubstr;
using testing::make_config;
using testing::TempDir;

// A tiny FP8 DeepSeek-V3's config.json (no weights beside it).
std::string write_fp8_config(TempDir& dir) {
  nlohmann::json config = synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false);
  config["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 16);
  const std::string path = dir.file("config.json");
  std::ofstream(path) << config.dump(2);
  return path;
}

float element(const std::vector<std::byte>& bytes, DType dtype, std::size_t i) {
  return dtype == DType::kU8 ? static_cast<float>(static_cast<std::uint8_t>(bytes[i]))
                             : decode_one(bytes.data() + i * dtype_size(dtype), dtype);
}

TEST(DummyLoad, FillsEveryParamInItsRangeAndRunsTheHooksOnIt) {
  TempDir dir;
  const std::string config = write_fp8_config(dir);
  // model.path is the file or the folder that holds it.
  for (const std::string& path : {config, dir.str()}) {
    Runtime rt(to_config(
        make_config(path, {"model.load_format=dummy", "parallel.tp=2", "parallel.ep=2"})));
    LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
    const LoadReport& report = r.model->report();
    EXPECT_EQ(report.load_format, "dummy");
    EXPECT_EQ(report.bytes_read, 0u);
    EXPECT_EQ(report.files, 0u);
    EXPECT_TRUE(report.hooks_skipped.empty());
    std::uint64_t filled = 0;
    std::size_t fp8 = 0;
    for (std::size_t rank = 0; rank < r.model->ranks().size(); ++rank) {
      for (const LoadedParam& p : r.model->ranks()[rank].params) {
        const std::vector<std::byte> bytes = r.model->read_param(rank, p.name);
        const bool split = p.name.ends_with("w_kc") || p.name.ends_with("w_vc") ||
                           p.name.ends_with("self_attn.w_scale");
        if (split) {
          continue;  // checked below, as the hook's output
        }
        filled += p.nbytes;
        models::ParamSpec spec;
        spec.name = p.name;
        spec.dtype = p.dtype;
        const models::DummyRange range = models::dummy_range(spec);
        ASSERT_TRUE(range.random) << p.name;
        fp8 += p.dtype == DType::kF8E4M3 ? 1 : 0;
        const std::size_t n = p.nbytes / dtype_size(p.dtype);
        double sum = 0;
        for (std::size_t i = 0; i < n; ++i) {
          const float v = element(bytes, p.dtype, i);
          // BF16 rounds the range's ends by up to half a unit of its last place.
          const double slack = (range.high - range.low) * (p.dtype == DType::kBF16 ? 4e-3 : 0);
          ASSERT_GE(v, range.low - slack) << p.name << " element " << i;
          ASSERT_LE(v, range.high + slack) << p.name << " element " << i;
          sum += v;
        }
        // Not constant: a param of more than a few elements takes many values.
        if (n > 64) {
          EXPECT_NE(element(bytes, p.dtype, 0), element(bytes, p.dtype, n / 2)) << p.name;
        }
        // Weights center on zero, scales on the middle of their range.
        EXPECT_NEAR(sum / static_cast<double>(n), (range.low + range.high) / 2,
                    (range.high - range.low) * (n > 1000 ? 0.05 : 0.5))
            << p.name;
      }
    }
    EXPECT_GT(fp8, 0u);
    EXPECT_EQ(report.bytes_copied, filled);
    // The MLA split ran on the dummy kv_b_proj: with 16 x 16 blocks (not 128 x 128),
    // SGLang 0.5.23's post_load_weights requantizes it with one scale, so w_kc holds
    // its key rows in E4M3 and w_scale that scale (models/mla_hook.hpp).
    const LoadedRank& rank0 = r.model->ranks()[0];
    const std::string attn = "model.layers.1.self_attn.";
    const LoadedParam* kv = rank0.find(attn + "kv_b_proj.weight");
    const LoadedParam* scale = rank0.find(attn + "kv_b_proj.weight_scale_inv");
    const LoadedParam* kc = rank0.find(attn + "w_kc");
    const LoadedParam* ws = rank0.find(attn + "w_scale");
    ASSERT_TRUE(kv && scale && kc && ws);
    ASSERT_EQ(kc->dtype, DType::kF8E4M3);
    const float w_scale = decode_one(r.model->read_param(0, ws->name).data(), DType::kF32);
    EXPECT_GT(w_scale, 0.0f);
    const std::vector<std::byte> w = r.model->read_param(0, kv->name);
    const std::vector<std::byte> s = r.model->read_param(0, scale->name);
    const std::vector<std::byte> k = r.model->read_param(0, kc->name);
    const std::uint64_t cols = kv->shape[1];  // kv_lora_rank
    const std::uint64_t dn = kc->shape[1];    // qk_nope_head_dim
    const std::uint64_t scale_cols = scale->shape[1];
    for (std::uint64_t i = 0; i < dn; ++i) {
      for (std::uint64_t c = 0; c < cols; ++c) {
        const float want = e4m3_to_float(static_cast<std::uint8_t>(w[i * cols + c])) *
                           decode_one(s.data() + ((i / 16) * scale_cols + c / 16) * 4, DType::kF32);
        // Head 0; E4M3 keeps 3 mantissa bits (half an ulp: 1/16 relative), subnormals
        // an absolute 2^-10 of the scale.
        const float got = e4m3_to_float(static_cast<std::uint8_t>(k[c * dn + i])) * w_scale;
        EXPECT_NEAR(got, want, std::fabs(want) / 16 + w_scale / 1024)
            << "w_kc[0, " << i << ", " << c << "]";
      }
    }
  }
}

TEST(DummyLoad, TheSameSeedGivesTheSameBytesAndReplicatedParamsAgree) {
  TempDir dir;
  const std::string config = write_fp8_config(dir);
  auto load = [&](const std::string& seed) {
    Runtime rt(to_config(make_config(
        config, {"model.load_format=dummy", "parallel.tp=2", "model.dummy_seed=" + seed})));
    LoadResult r = rt.load();
    EXPECT_TRUE(r) << r.error->message;
    return r.model;
  };
  auto a = load("7");
  auto b = load("7");
  auto c = load("8");
  ASSERT_TRUE(a && b && c);
  const std::string norm = "model.layers.0.input_layernorm.weight";
  const std::string q = "model.layers.0.self_attn.q_b_proj.weight";
  EXPECT_EQ(a->read_param(0, q), b->read_param(0, q));
  EXPECT_NE(a->read_param(0, q), c->read_param(0, q));
  EXPECT_EQ(a->read_param(0, norm), a->read_param(1, norm));  // replicated: one value set
}

// DeepSeek-V3's real config at its real size, one rank of tp 8 / ep 8 on a null
// device: nothing but config.json, every byte the plan allocates filled (but the
// MLA hooks' outputs, whose hooks a null device skips).
TEST(DummyLoad, ARealConfigAtFullSizeOnANullDevice) {
  FERRY_NEED_TEST_DATA();
  const std::string config = ::ferry::testing::test_data_path("models/deepseek-v3/config.json");
  const std::vector<std::string> sets{"model.load_format=dummy", "parallel.tp=8", "parallel.ep=8",
                                      "parallel.ranks=0", "devices=null:1"};
  const PlanReport plan = make_plan_report(make_config(config, sets));
  EXPECT_TRUE(plan.dummy);
  EXPECT_TRUE(plan.tensors.empty());
  ASSERT_EQ(plan.rank_params.size(), 1u);
  EXPECT_GT(plan.rank_params[0].param_bytes, std::uint64_t{80} * 1000 * 1000 * 1000);  // ~85 GB
  EXPECT_EQ(plan.to_json().at("load_format"), "dummy");
  Runtime rt(to_config(make_config(config, sets)));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  std::uint64_t split_bytes = 0;
  for (const LoadedParam& p : r.model->ranks()[0].params) {
    if (p.name.ends_with("w_kc") || p.name.ends_with("w_vc")) {
      split_bytes += p.nbytes;
    }
  }
  EXPECT_EQ(r.model->report().bytes_copied, plan.rank_params[0].param_bytes - split_bytes);
  EXPECT_EQ(r.model->report().hooks_skipped.size(), 61u);  // one MLA split a layer
}

TEST(DummyLoad, BadInputsAndTheStartupAreRefusedClearly) {
  TempDir dir;
  // No config.json where model.path says.
  Runtime none(to_config(make_config(dir.str(), {"model.load_format=dummy"})));
  LoadResult r = none.load();
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, HasSubstr("config.json"));
  // An architecture ferry does not know.
  const std::string path = dir.file("config.json");
  std::ofstream(path) << R"({"architectures": ["VisionForAnything"]})";
  Runtime unknown(to_config(make_config(path, {"model.load_format=dummy"})));
  r = unknown.load();
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, HasSubstr("VisionForAnything is not supported"));
  // A bad seed and a bad format name are config errors naming the key.
  EXPECT_THROW(make_config(path, {"model.load_format=dummy", "model.dummy_seed=-1"}), Error);
  try {
    make_config(path, {"model.load_format=dumy"});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                HasSubstr("expected auto, safetensors, mistral, pt, gguf, dummy, presharded, "
                          "sharded_state, ipc_cache or remote_instance"));
  }
  // The capture-safe startup has nothing to overlap: overlap is refused with the
  // load_format code, auto runs serially.
  const std::string config = write_fp8_config(dir);
  Runtime overlap(
      to_config(make_config(config, {"model.load_format=dummy", "startup.mode=overlap"})));
  r = overlap.prepare().wait();
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, HasSubstr("load_format: the dummy format reads nothing"));
  Runtime autorun(to_config(make_config(config, {"model.load_format=dummy", "startup.mode=auto"})));
  ASSERT_TRUE(autorun.prepare().wait());
  r = autorun.commit().wait();
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_EQ(r.model->report().startup_mode, "serial");
  ASSERT_EQ(r.model->report().startup_refusals.size(), 1u);
  EXPECT_EQ(r.model->report().startup_refusals[0].code, "load_format");
}

}  // namespace
}  // namespace ferry::runtime
