// quantization.requant through the whole pipeline: an FP8 DeepSeek-V3 (128 x 128
// blocks) loaded with requant ue8m0 / tensor holds exactly what the conversions of
// models/requant.hpp make of a plain load's weights and scales, the MLA split still
// reads kv_b_proj as loaded, every layer is announced only once its rewrites ran,
// and the capture-safe startup runs the rewrites again on the real weights.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "models/quant.hpp"
#include "models/requant.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::make_config;
using testing::TempDir;

TEST(RequantLoad, TheRewritesOfAPlainLoad) {
  TempDir dir;
  const std::string ck = testing::synth_deepseek_v3_block128(dir);
  Runtime plain_rt(to_config(make_config(ck, {"parallel.tp=1"})));
  LoadResult plain = plain_rt.load();
  ASSERT_TRUE(plain) << plain.error->message;
  for (const std::string kind : {"ue8m0", "tensor"}) {
    SCOPED_TRACE(kind);
    Runtime rt(to_config(make_config(ck, {"parallel.tp=1", "quantization.requant=" + kind})));
    testing::LayerLog log;
    LoadResult r = rt.start(log.callbacks()).wait();
    ASSERT_TRUE(r) << r.error->message;
    EXPECT_EQ(log.layers(), (std::set<std::uint64_t>{0, 1}));
    std::size_t fp8 = 0;
    for (const LoadedParam& p : r.model->ranks()[0].params) {
      if (p.dtype != DType::kF8E4M3) {
        // Not converted: as loaded (scales and requant outputs are checked with their
        // weight).
        const bool scale = p.name.ends_with("_scale_inv");
        if (!scale && plain.model->ranks()[0].find(p.name) != nullptr) {
          EXPECT_EQ(r.model->read_param(0, p.name), plain.model->read_param(0, p.name)) << p.name;
        }
        continue;
      }
      ++fp8;
      std::vector<std::byte> w = plain.model->read_param(0, p.name);
      std::vector<std::byte> s = plain.model->read_param(0, p.name + "_scale_inv");
      const std::uint64_t rows = p.shape[p.shape.size() - 2];
      const std::uint64_t cols = p.shape.back();
      const std::uint64_t matrices = p.shape.size() == 3 ? p.shape[0] : 1;
      // ue8m0: weight_scale_inv itself holds the packed I32 scales (SGLang 0.5.23's
      // requant_weight_ue8m0_inplace); no F32 copy is left in the model.
      const std::string out =
          models::companion_name(p.name, kind == "ue8m0" ? "weight_scale_inv" : "weight_scale");
      EXPECT_EQ(r.model->ranks()[0].find(p.name + "_scale_inv_f32"), nullptr);
      EXPECT_EQ(r.model->ranks()[0].find(p.name + "_scale_ue8m0"), nullptr);
      std::vector<std::byte> want(r.model->ranks()[0].find(out)->nbytes);
      for (std::uint64_t e = 0; e < matrices; ++e) {
        auto* mw = reinterpret_cast<std::uint8_t*>(w.data()) + e * rows * cols;
        auto* ms = reinterpret_cast<float*>(s.data()) + e * (s.size() / 4 / matrices);
        if (kind == "ue8m0") {
          const std::uint64_t words = ((cols + 127) / 128 + 3) / 4;
          models::requant_ue8m0(
              mw, ms, reinterpret_cast<std::int32_t*>(want.data()) + e * words * rows, rows, cols);
        } else {
          const float t = models::requant_tensor(mw, ms, rows, cols, 128, 128);
          std::memcpy(want.data() + e * 4, &t, 4);
        }
      }
      EXPECT_EQ(r.model->read_param(0, p.name), w) << p.name;
      if (kind != "ue8m0") {
        EXPECT_EQ(r.model->read_param(0, p.name + "_scale_inv"), s) << p.name;
      }
      EXPECT_EQ(r.model->read_param(0, out), want) << out;
    }
    EXPECT_GT(fp8, 10u);
    // The MLA split is the plain load's: it read kv_b_proj before its rewrite.
    EXPECT_EQ(r.model->read_param(0, "model.layers.1.self_attn.w_kc"),
              plain.model->read_param(0, "model.layers.1.self_attn.w_kc"));
  }
  // The capture-safe startup: the rewrites run on the sentinel, then again on the
  // real weights, in the same storage.
  Runtime overlap(to_config(
      make_config(ck, {"parallel.tp=1", "quantization.requant=ue8m0", "startup.mode=overlap"})));
  ASSERT_TRUE(overlap.prepare().wait());
  LoadResult committed = overlap.commit().wait();
  ASSERT_TRUE(committed) << committed.error->message;
  Runtime serial(to_config(make_config(ck, {"parallel.tp=1", "quantization.requant=ue8m0"})));
  LoadResult s = serial.load();
  ASSERT_TRUE(s);
  for (const LoadedParam& p : s.model->ranks()[0].params) {
    EXPECT_EQ(committed.model->read_param(0, p.name), s.model->read_param(0, p.name)) << p.name;
  }
}

TEST(RequantLoad, ABadValueIsAConfigError) {
  EXPECT_THROW(make_config("/x", {"quantization.requant=e8m0"}), Error);
  TempDir dir;
  synth::SynthOptions o;
  o.family = "llama";
  o.preset = "tiny";
  o.out = dir.file("plain");
  o.fsync = false;
  synth::synthesize(o);
  Runtime rt(to_config(make_config(o.out, {"quantization.requant=tensor"})));
  LoadResult r = rt.load();
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, ::testing::HasSubstr("quantization.requant converts FP8 block"));
}

}  // namespace
}  // namespace ferry::runtime
