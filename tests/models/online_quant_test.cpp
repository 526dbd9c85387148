// quantization.online (models/online_quant.hpp): the three quantizations against a
// naive reference written from SGLang's definitions (the per-token kernel,
// input_to_float8, scaled_fp8_quant), and the params, routes and hooks a model gets.
#include "models/online_quant.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/fp8.hpp"
#include "models/model.hpp"
#include "models/quant.hpp"
#include "models/reference_util.hpp"
#include "synth/synth.hpp"
#include "testing/dtype_codec.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using ::testing::HasSubstr;
using Online = models::QuantScheme::Online;

std::vector<float> random_values(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> out(n);
  for (float& v : out) {
    v = d(rng);
  }
  return out;
}

float clamp448(float v) {
  return std::fmax(-448.0f, std::fmin(448.0f, v));
}

TEST(OnlineQuant, PerChannelIsARowMaxOver448) {
  const std::uint64_t rows = 6;
  const std::uint64_t cols = 50;
  std::vector<float> x = random_values(rows * cols, 1);
  for (std::uint64_t c = 0; c < cols; ++c) {
    x[3 * cols + c] = 0;  // an all-zero row: scale 0, codes 0
  }
  std::vector<std::uint8_t> q(x.size());
  std::vector<float> s(rows);
  models::online_quant_per_channel(x.data(), rows, cols, q.data(), s.data());
  for (std::uint64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (std::uint64_t c = 0; c < cols; ++c) {
      amax = std::fmax(amax, std::fabs(x[r * cols + c]));
    }
    EXPECT_EQ(s[r], amax / 448.0f) << r;
    for (std::uint64_t c = 0; c < cols; ++c) {
      const float want = amax == 0 ? 0.0f : round_to_e4m3(clamp448(x[r * cols + c] * (1 / s[r])));
      ASSERT_EQ(e4m3_value(q[r * cols + c]), want) << r << ", " << c;
    }
  }
  // The largest element of a row maps to +-448.
  std::uint64_t top = 0;
  for (std::uint64_t c = 1; c < cols; ++c) {
    top = std::fabs(x[c]) > std::fabs(x[top]) ? c : top;
  }
  EXPECT_EQ(std::fabs(e4m3_value(q[top])), 448.0f);
}

TEST(OnlineQuant, PerTensorIsInputToFloat8AndPerExpertScaledFp8Quant) {
  std::vector<float> x = random_values(300, 2);
  float amax = 0;
  for (float v : x) {
    amax = std::fmax(amax, std::fabs(v));
  }
  std::vector<std::uint8_t> q(x.size());
  const float mul = 448.0f / amax;
  EXPECT_EQ(models::online_quant_per_tensor(x.data(), x.size(), q.data()), 1.0f / mul);
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(e4m3_value(q[i]), round_to_e4m3(clamp448(x[i] * mul))) << i;
  }
  const float s = amax / 448.0f;
  EXPECT_EQ(models::online_quant_per_expert(x.data(), x.size(), q.data()), s);
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(e4m3_value(q[i]), round_to_e4m3(clamp448(x[i] * (1.0f / s)))) << i;
  }
  // An all-zero tensor: per tensor amax is clamped to 1e-12; per expert scale 0.
  std::vector<float> zeros(8, 0.0f);
  EXPECT_FLOAT_EQ(models::online_quant_per_tensor(zeros.data(), 8, q.data()), 1e-12f / 448.0f);
  EXPECT_EQ(models::online_quant_per_expert(zeros.data(), 8, q.data()), 0.0f);
  EXPECT_EQ(q[0], 0);
}

TEST(OnlineQuant, TheModelLoadsFullPrecisionIntoTransientsAndQuantizesThem) {
  const nlohmann::json llama = synth::synth_config("llama", "tiny", DType::kBF16, false);
  for (Online kind : {Online::kChannel, Online::kTensor}) {
    models::ModelOptions o;
    o.online = kind;
    models::ParallelLayout l;
    l.tp = 2;
    auto m = models::make_model(llama, l, o);
    const auto& shell = m->shells()[0];
    auto spec = [&](const std::string& n) { return shell.params.at(shell.by_name.at(n)); };
    const std::string qkv = "model.layers.0.self_attn.qkv_proj.";
    EXPECT_EQ(spec(qkv + "weight").dtype, DType::kF8E4M3);
    EXPECT_EQ(spec(qkv + "weight_unquantized").dtype, DType::kBF16);
    EXPECT_TRUE(spec(qkv + "weight_unquantized").transient);
    EXPECT_EQ(spec(qkv + "weight_unquantized").shape, spec(qkv + "weight").shape);
    EXPECT_EQ(spec(qkv + "weight_scale").shape,
              kind == Online::kChannel
                  ? (std::vector<std::uint64_t>{spec(qkv + "weight").shape[0], 1})
                  : std::vector<std::uint64_t>{1});
    EXPECT_FALSE(spec("model.embed_tokens.weight").transient);
    EXPECT_EQ(spec("model.layers.0.input_layernorm.weight").dtype, DType::kBF16);
    // The checkpoint's q_proj goes to the transient.
    const models::Route r =
        m->route(tensor_info("model.layers.0.self_attn.q_proj.weight", DType::kBF16, {128, 128}));
    ASSERT_FALSE(r.pieces.empty());
    EXPECT_EQ(shell.params[r.pieces[0].param].name, qkv + "weight_unquantized");
    std::size_t quant_hooks = 0;
    for (const models::PostLoadHook& h : m->hooks()) {
      quant_hooks += h.name.rfind("online_quant_fp8:", 0) == 0 ? 1 : 0;
    }
    EXPECT_EQ(quant_hooks, 2u * 4 * 4);  // 2 ranks x 4 layers x (qkv, o, gate_up, down)
  }
  // Fused experts: one scale an expert in either mode.
  models::ModelOptions o;
  o.online = Online::kChannel;
  auto moe =
      models::make_model(synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false), {}, o);
  const auto& ms = moe->shells()[0];
  EXPECT_EQ(ms.params[ms.by_name.at("model.layers.0.mlp.experts.w13_weight_scale")].shape,
            std::vector<std::uint64_t>{8});
  // A checkpoint that is already quantized is refused.
  nlohmann::json fp8 = llama;
  fp8["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 16);
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(fp8, {}, o); }),
              HasSubstr("already quantized (fp8 block [16, 16])"));
}

}  // namespace
}  // namespace ferry::testing
