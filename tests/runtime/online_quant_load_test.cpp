// quantization.online and load.layered through the whole pipeline: a BF16 checkpoint
// loaded with online FP8 holds exactly what models/online_quant.hpp's quantizations
// make of a plain load's weights (the MLA split and the V3.2 indexer fusion taken
// from full precision), the load-only weights are gone from the loaded model, a
// layered load holds the same bytes with a lower device peak, and what is refused
// (the configuration refuses load.layered with what it cannot follow).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "gpu/kernels_host.hpp"
#include "models/online_quant.hpp"
#include "models/quant.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/error_of.hpp"
#include "synth/synth.hpp"
#include "testing/synth_tiny.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_tiny;
using testing::TempDir;

std::vector<float> as_f32(const std::vector<std::byte>& bytes, DType dtype) {
  std::vector<float> out(bytes.size() / dtype_size(dtype));
  gpu::host::cast(reinterpret_cast<std::byte*>(out.data()), DType::kF32, bytes.data(), dtype,
                  out.size());
  return out;
}

// Every FP8 param of `online` and its scale against the quantization of the plain
// load's param of the same name; every other param equal to the plain load's.
void expect_quantized_plain(const LoadedModel& online, const LoadedModel& plain, bool channel) {
  std::size_t fp8 = 0;
  for (std::size_t r = 0; r < online.ranks().size(); ++r) {
    for (const LoadedParam& p : online.ranks()[r].params) {
      EXPECT_FALSE(p.name.ends_with("weight_unquantized")) << p.name << " was kept";
      const LoadedParam* base = plain.ranks()[r].find(p.name);
      if (p.dtype != DType::kF8E4M3) {
        if (base != nullptr) {
          EXPECT_EQ(online.read_param(r, p.name), plain.read_param(r, p.name)) << p.name;
        }
        continue;
      }
      ++fp8;
      ASSERT_NE(base, nullptr) << p.name;
      const std::vector<float> x = as_f32(plain.read_param(r, p.name), base->dtype);
      const bool experts = p.shape.size() == 3;
      const std::uint64_t rows = p.shape[p.shape.size() - 2];
      const std::uint64_t cols = p.shape.back();
      const std::uint64_t matrices = experts ? p.shape[0] : 1;
      std::vector<std::uint8_t> q(x.size());
      std::vector<float> s(experts ? matrices : channel ? rows : 1);
      for (std::uint64_t e = 0; e < matrices && experts; ++e) {
        s[e] = models::online_quant_per_expert(x.data() + e * rows * cols, rows * cols,
                                               q.data() + e * rows * cols);
      }
      if (!experts && channel) {
        models::online_quant_per_channel(x.data(), rows, cols, q.data(), s.data());
      } else if (!experts) {
        s[0] = models::online_quant_per_tensor(x.data(), x.size(), q.data());
      }
      const std::vector<std::byte> got = online.read_param(r, p.name);
      EXPECT_EQ(0, std::memcmp(got.data(), q.data(), q.size())) << p.name;
      const std::vector<std::byte> got_s =
          online.read_param(r, models::companion_name(p.name, "weight_scale"));
      ASSERT_EQ(got_s.size(), s.size() * 4) << p.name;
      EXPECT_EQ(0, std::memcmp(got_s.data(), s.data(), got_s.size())) << p.name;
    }
  }
  EXPECT_GT(fp8, 0u);
}

TEST(OnlineQuantLoad, LayeredOrNotTheQuantizationOfAPlainLoadWithALowerPeak) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "llama");
  Runtime plain_rt(to_config(make_config(ck, {"parallel.tp=2"})));
  LoadResult plain = plain_rt.load();
  ASSERT_TRUE(plain) << plain.error->message;
  std::vector<std::shared_ptr<LoadedModel>> loads;
  for (const std::string layered : {"false", "true"}) {
    SCOPED_TRACE("layered " + layered);
    // Small chunks and staging, so that the reader runs only a few layers ahead of
    // the copies and hooks of a tiny model (a real one is far larger than staging).
    Runtime rt(to_config(make_config(
        ck, {"parallel.tp=2", "quantization.online=fp8_channel", "load.layered=" + layered,
             "io.chunk_bytes=4096", "io.staging_bytes=16KiB"})));
    testing::LayerLog log;
    LoadResult r = rt.start(log.callbacks()).wait();
    ASSERT_TRUE(r) << r.error->message;
    EXPECT_EQ(log.layers(), (std::set<std::uint64_t>{0, 1, 2, 3}));
    expect_quantized_plain(*r.model, *plain.model, true);
    loads.push_back(r.model);
  }
  // The same bytes either way; a layered load never holds every full-precision
  // weight at once: each device's peak is below the plain BF16 load's, and the
  // load that allocates them all up front peaks above it.
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : loads[0]->ranks()[r].params) {
      EXPECT_EQ(loads[0]->read_param(r, p.name), loads[1]->read_param(r, p.name)) << p.name;
    }
  }
  for (const auto& [device, peak] : plain.model->report().peak_device_bytes) {
    const std::uint64_t up_front = loads[0]->report().peak_device_bytes.at(device);
    const std::uint64_t layered = loads[1]->report().peak_device_bytes.at(device);
    EXPECT_LT(layered, peak) << device;
    EXPECT_GT(up_front, peak) << device;
  }
}

TEST(OnlineQuantLoad, TheMlaSplitAndTheIndexerReadFullPrecision) {
  TempDir dir;
  for (const std::string family : {"deepseek_v3", "deepseek_v32"}) {
    SCOPED_TRACE(family);
    const std::string ck = synth_tiny(dir, family);
    if (family == "deepseek_v32") {
      // The fused indexer layout (SGLang 0.5.23's use_dsa_indexer_fusion), whose hook
      // reads wk before any quantization.
      std::ifstream in(ck + "/config.json");
      nlohmann::json config = nlohmann::json::parse(in);
      config["indexer_rope_interleave"] = true;
      std::ofstream(ck + "/config.json") << config.dump();
    }
    Runtime plain_rt(to_config(make_config(ck, {"parallel.tp=2", "parallel.ep=2"})));
    LoadResult plain = plain_rt.load();
    ASSERT_TRUE(plain) << plain.error->message;
    Runtime rt(to_config(make_config(ck, {"parallel.tp=2", "parallel.ep=2",
                                          "quantization.online=fp8_tensor", "load.layered=true"})));
    LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
    expect_quantized_plain(*r.model, *plain.model, false);
    const std::string attn = "model.layers.1.self_attn.";
    for (const std::string name : {"w_kc", "w_vc"}) {
      EXPECT_EQ(r.model->read_param(0, attn + name), plain.model->read_param(0, attn + name));
    }
    if (family == "deepseek_v32") {
      const std::string fused = attn + "indexer.wk_weights_proj.weight";
      EXPECT_EQ(r.model->read_param(1, fused), plain.model->read_param(1, fused));
    }
  }
}

TEST(OnlineQuantLoad, RefusalsAndTheDummyFormat) {
  TempDir dir;
  const std::string ck = synth_tiny(dir, "llama");
  // Refused by the configuration built whole (the checks that span several keys),
  // and, for a configuration set call by call, by the load, with the same words.
  auto fails = [&](const std::vector<std::string>& sets) {
    const std::string message = testing::error_of(Stage::kConfig, [&] { make_config(ck, sets); });
    Runtime rt(to_config(make_config(ck, sets, ConfigBuilder::Rules::kAllButLoad)));
    LoadResult r = rt.load();
    EXPECT_FALSE(r);
    if (!r) {
      EXPECT_EQ(r.error->stage, Stage::kConfig);
      EXPECT_NE(message.find(r.error->rule), std::string::npos) << r.error->message;
    }
    return message;
  };
  EXPECT_THAT(fails({"load.layered=true"}), HasSubstr("only quantization.online makes any"));
  EXPECT_THAT(fails({"load.layered=true", "quantization.online=auto", "model.load_format=dummy"}),
              HasSubstr("a dummy load fills every parameter at once"));
  EXPECT_THAT(fails({"load.layered=true", "quantization.online=auto", "io.direct_to_device=on"}),
              HasSubstr("io.direct_to_device=on with load.layered"));
  EXPECT_THROW(make_config(ck, {"quantization.online=fp8_block"}), Error);
  // The capture-safe startup: overlap refused with both codes.
  Runtime overlap(to_config(make_config(
      ck, {"quantization.online=fp8_tensor", "load.layered=true", "startup.mode=overlap"})));
  LoadResult r = overlap.prepare().wait();
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, HasSubstr("quantization: quantization.online"));
  EXPECT_THAT(r.error->message, HasSubstr("layered: load.layered"));
  // A dummy load quantizes its full-precision dummy weights (auto: per channel on a
  // host device, as on an SM90 GPU).
  Runtime dummy(to_config(
      make_config(ck + "/config.json", {"model.load_format=dummy", "quantization.online=auto"})));
  r = dummy.load();
  ASSERT_TRUE(r) << r.error->message;
  const LoadedParam* q = r.model->ranks()[0].find("model.layers.0.mlp.down_proj.weight");
  const LoadedParam* s = r.model->ranks()[0].find("model.layers.0.mlp.down_proj.weight_scale");
  ASSERT_TRUE(q && s);
  EXPECT_EQ(q->dtype, DType::kF8E4M3);
  EXPECT_EQ(s->shape, (std::vector<std::uint64_t>{128, 1}));
  EXPECT_EQ(r.model->ranks()[0].find("model.layers.0.mlp.down_proj.weight_unquantized"), nullptr);
}

}  // namespace
}  // namespace ferry::runtime
