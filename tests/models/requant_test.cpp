// quantization.requant (models/requant.hpp): the two conversions against a naive
// reference written from SGLang's definitions (per_block_cast_to_fp8 with
// ceil_to_ue8m0 and transform_scale_ue8m0; block_quant_to_tensor_quant), the params
// and hooks a model gets, their order after the MLA split, and what is refused.
#include "models/requant.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/fp8.hpp"
#include "gpu/device.hpp"
#include "gpu/host_device.hpp"
#include "models/coverage.hpp"
#include "models/host_hook_context.hpp"
#include "models/model.hpp"
#include "models/quant.hpp"
#include "models/quant_reference.hpp"
#include "models/reference_util.hpp"
#include "synth/synth.hpp"
#include "testing/dtype_codec.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using ::testing::HasSubstr;
using Requant = models::QuantScheme::Requant;

float bf16(float v) {
  const std::uint32_t bits = static_cast<std::uint32_t>(synth::float_to_bf16_bits(v)) << 16;
  float out = 0;
  std::memcpy(&out, &bits, 4);
  return out;
}

// A matrix of E4M3 codes (no NaN) and positive block scales of `block`.
struct Matrix {
  std::uint64_t rows = 0, cols = 0, block = 0;
  std::vector<std::uint8_t> w;
  std::vector<float> s;
};

Matrix random_matrix(std::uint64_t rows, std::uint64_t cols, std::uint64_t block, unsigned seed) {
  Matrix m{rows, cols, block, {}, {}};
  std::mt19937 rng(seed);
  for (std::uint64_t i = 0; i < rows * cols; ++i) {
    std::uint8_t code = 0;
    do {
      code = static_cast<std::uint8_t>(rng());
    } while ((code & 0x7F) == 0x7F);
    m.w.push_back(code);
  }
  const std::uint64_t n = ((rows + block - 1) / block) * ((cols + block - 1) / block);
  for (std::uint64_t i = 0; i < n; ++i) {
    m.s.push_back(std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f,
                             -static_cast<int>(rng() % 20)));
  }
  return m;
}

TEST(Requant, CeilToUe8m0IsThePowerOfTwoAtOrAbove) {
  EXPECT_EQ(models::ceil_to_ue8m0(1.0f), 1.0f);
  EXPECT_EQ(models::ceil_to_ue8m0(1.5f), 2.0f);
  EXPECT_EQ(models::ceil_to_ue8m0(0.75f), 1.0f);
  EXPECT_EQ(models::ceil_to_ue8m0(-3.0f), 4.0f);
  EXPECT_EQ(models::ceil_to_ue8m0(0x1p-20f * 1.01f), 0x1p-19f);
  EXPECT_EQ(models::ceil_to_ue8m0(0.0f), 0x1p-126f);  // exponent clamped to 1
  EXPECT_EQ(models::ceil_to_ue8m0(3e38f), 0x1p127f);  // and to 254
}

// SGLang's requant_weight_ue8m0 written out naively: dequantize to BF16, a
// power-of-two scale per 128 x 128 tile, requantize, pack.
TEST(Requant, Ue8m0MatchesTheNaiveReference) {
  for (const auto& [rows, cols] :
       std::vector<std::pair<std::uint64_t, std::uint64_t>>{{256, 384}, {200, 640}, {132, 100}}) {
    Matrix m = random_matrix(rows, cols, 128, static_cast<unsigned>(rows + cols));
    const std::uint64_t kb = (cols + 127) / 128;
    const std::uint64_t nb = (rows + 127) / 128;
    std::vector<float> x(rows * cols);
    for (std::uint64_t i = 0; i < rows; ++i) {
      for (std::uint64_t j = 0; j < cols; ++j) {
        x[i * cols + j] = bf16(e4m3_value(m.w[i * cols + j]) * m.s[(i / 128) * kb + j / 128]);
      }
    }
    std::vector<float> sf(nb * kb);
    for (std::uint64_t bi = 0; bi < nb; ++bi) {
      for (std::uint64_t bj = 0; bj < kb; ++bj) {
        float amax = 1e-4f;
        for (std::uint64_t i = bi * 128; i < std::min(rows, bi * 128 + 128); ++i) {
          for (std::uint64_t j = bj * 128; j < std::min(cols, bj * 128 + 128); ++j) {
            amax = std::max(amax, std::fabs(x[i * cols + j]));
          }
        }
        sf[bi * kb + bj] = std::exp2(std::ceil(std::log2(amax / 448.0f)));
      }
    }
    std::vector<std::int32_t> packed(((kb + 3) / 4) * rows, -1);
    models::requant_ue8m0(m.w.data(), m.s.data(), packed.data(), rows, cols);
    EXPECT_EQ(m.s, sf);
    for (std::uint64_t i = 0; i < rows * cols; ++i) {
      const float want = round_to_e4m3(x[i] / sf[(i / cols / 128) * kb + (i % cols) / 128]);
      ASSERT_EQ(e4m3_value(m.w[i]), want) << "element " << i << " of " << rows << "x" << cols;
    }
    // Packed: element (r, j) at j * rows + r, byte b the exponent of block column 4j+b.
    for (std::uint64_t r = 0; r < rows; ++r) {
      for (std::uint64_t j = 0; j < (kb + 3) / 4; ++j) {
        std::uint32_t want = 0;
        for (std::uint64_t b = 0; b < 4 && 4 * j + b < kb; ++b) {
          const int e = std::ilogb(sf[(r / 128) * kb + 4 * j + b]) + 127;
          want |= static_cast<std::uint32_t>(e) << (8 * b);
        }
        ASSERT_EQ(static_cast<std::uint32_t>(packed[j * rows + r]), want) << r << ", " << j;
      }
    }
  }
}

// block_quant_to_tensor_quant: dequantize in F32, one scale amax / 448.
TEST(Requant, TensorMatchesTheNaiveReference) {
  Matrix m = random_matrix(40, 72, 16, 3);
  const std::uint64_t kb = (72 + 15) / 16;
  std::vector<float> x(m.w.size());
  float amax = 0;
  for (std::uint64_t i = 0; i < x.size(); ++i) {
    x[i] = e4m3_value(m.w[i]) * m.s[(i / 72 / 16) * kb + (i % 72) / 16];
    amax = std::max(amax, std::fabs(x[i]));
  }
  const float s = amax / 448.0f;
  const float got = models::requant_tensor(m.w.data(), m.s.data(), 40, 72, 16, 16);
  EXPECT_EQ(got, s);
  for (std::uint64_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(e4m3_value(m.w[i]), round_to_e4m3(x[i] * (1.0f / s))) << i;
  }
  EXPECT_EQ(m.s, std::vector<float>(m.s.size(), s));  // every block holds it now
  // An all-zero matrix keeps zeros (scale 1, not a division by zero).
  std::vector<std::uint8_t> zeros(64, 0);
  std::vector<float> one{2.0f};
  EXPECT_EQ(models::requant_tensor(zeros.data(), one.data(), 8, 8, 8, 8), 1.0f);
  EXPECT_EQ(zeros, std::vector<std::uint8_t>(64, 0));
}

// A small DeepSeek-V3 (tiny, widened so that every fused slot starts on a 128-row
// block) with 128 x 128 FP8 blocks at tp 1: every FP8 param gets its
// requant output, the hooks rewrite weights and scales as the reference does, and
// the MLA split still reads kv_b_proj as loaded (the requant of kv_b_proj waits for
// it).
TEST(Requant, ModelHooksRewriteEveryFp8ParamAfterTheMlaSplit) {
  for (Requant kind : {Requant::kUe8m0, Requant::kTensor}) {
    nlohmann::json config = synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false);
    config["q_lora_rank"] = 128;
    config["kv_lora_rank"] = 128;
    config["moe_intermediate_size"] = 128;
    std::vector<synth::SynthTensor> tensors =
        synth::synth_tensor_list(synth::synth_source(config, "config.json"), DType::kBF16);
    config["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 128);
    synth::synth_quantize(tensors, synth::SynthQuant::kFp8Block, 128);
    models::ModelOptions options;
    options.requant = kind;
    std::unique_ptr<models::Model> model = models::make_model(config, {}, options);
    const models::RankShell& shell = model->shells()[0];
    quant::Layout layout;
    quant::Values values(5, layout);
    ParamBuffers buffers = make_buffers(*model);
    const std::vector<models::Route> routes = quant::load(*model, tensors, values, buffers);
    EXPECT_TRUE(models::check_coverage(*model, routes).empty());
    // The loaded bytes, before any hook.
    const std::vector<std::vector<std::byte>> loaded = buffers.bytes[0];
    auto device = gpu::make_host_device(0);
    auto stream = device->create_stream();
    std::vector<gpu::DeviceAllocation> storage;
    std::vector<std::byte*> ptrs;
    for (std::size_t k = 0; k < shell.params.size(); ++k) {
      storage.push_back(device->allocate(shell.params[k].nbytes));
      ptrs.push_back(storage.back().data());
      stream->copy_h2d(ptrs.back(), loaded[k].data(), loaded[k].size());
    }
    std::size_t requants = 0;
    for (const models::PostLoadHook& h : model->hooks()) {
      HostHookContext ctx(*stream, ptrs, h, device.get());
      h.run(ctx);
      stream->synchronize();
      requants += h.rewrites.empty() ? 0 : 1;
    }
    auto read = [&](const std::string& name) {
      const std::size_t k = shell.by_name.at(name);
      std::vector<std::byte> out(shell.params[k].nbytes);
      stream->copy_d2h(out.data(), ptrs[k], out.size());
      stream->synchronize();
      return out;
    };
    std::size_t fp8 = 0;
    for (std::size_t k = 0; k < shell.params.size(); ++k) {
      const models::ParamSpec& p = shell.params[k];
      if (p.dtype != DType::kF8E4M3) {
        continue;
      }
      ++fp8;
      SCOPED_TRACE(p.name);
      // ue8m0: SGLang 0.5.23's requant_weight_ue8m0_inplace leaves weight_scale_inv
      // holding the packed I32 scales; the F32 ones load into a transient.
      const bool ue8m0 = kind == Requant::kUe8m0;
      const std::size_t sk = shell.by_name.at(p.name + (ue8m0 ? "_scale_inv_f32" : "_scale_inv"));
      EXPECT_EQ(shell.params[sk].transient, ue8m0);
      EXPECT_EQ(shell.params[sk].dtype, DType::kF32);
      // The reference: the conversion of what was loaded.
      std::vector<std::uint8_t> w(loaded[k].size());
      std::memcpy(w.data(), loaded[k].data(), w.size());
      std::vector<float> s(loaded[sk].size() / 4);
      std::memcpy(s.data(), loaded[sk].data(), loaded[sk].size());
      const std::uint64_t rows = p.shape[p.shape.size() - 2];
      const std::uint64_t cols = p.shape.back();
      const std::uint64_t matrices = p.shape.size() == 3 ? p.shape[0] : 1;
      const std::string out = models::companion_name(p.name, ue8m0 ? "weight_scale_inv" : "weight_scale");
      EXPECT_EQ(shell.by_name.count(p.name + "_scale_ue8m0"), 0u);
      const std::size_t ok = shell.by_name.at(out);
      std::vector<std::byte> want_out(shell.params[ok].nbytes);
      for (std::uint64_t e = 0; e < matrices; ++e) {
        std::uint8_t* mw = w.data() + e * rows * cols;
        float* ms = s.data() + e * (s.size() / matrices);
        if (kind == Requant::kUe8m0) {
          const std::uint64_t words = ((cols + 127) / 128 + 3) / 4;
          models::requant_ue8m0(mw, ms,
                                reinterpret_cast<std::int32_t*>(want_out.data()) + e * words * rows,
                                rows, cols);
        } else {
          const float t = models::requant_tensor(mw, ms, rows, cols, 128, 128);
          std::memcpy(want_out.data() + e * 4, &t, 4);
        }
      }
      const std::vector<std::byte> got_w = read(p.name);
      EXPECT_EQ(0, std::memcmp(got_w.data(), w.data(), w.size()));
      EXPECT_EQ(0, std::memcmp(read(shell.params[sk].name).data(), s.data(), s.size() * 4));
      EXPECT_EQ(read(out), want_out);
      if (kind == Requant::kUe8m0) {
        EXPECT_EQ(shell.params[ok].dtype, DType::kI32);
        EXPECT_EQ(shell.params[ok].strides.back(), rows);  // MN-major
      }
    }
    EXPECT_EQ(requants, fp8);
    // w_kc: the split of kv_b_proj as loaded (the MLA hook ran first).
    const std::string attn = "model.layers.1.self_attn.";
    const std::size_t kv = shell.by_name.at(attn + "kv_b_proj.weight");
    const std::size_t ks = shell.by_name.at(
        attn + (kind == Requant::kUe8m0 ? "kv_b_proj.weight_scale_inv_f32" : "kv_b_proj.weight_scale_inv"));
    const std::vector<std::byte> kc = read(attn + "w_kc");
    const std::uint64_t r = 128;  // kv_lora_rank
    const std::uint64_t dn = 16;
    float s00 = 0;
    std::memcpy(&s00, loaded[ks].data(), 4);
    for (std::uint64_t i = 0; i < dn; ++i) {
      const float want =
          bf16(e4m3_value(static_cast<std::uint8_t>(loaded[kv][i * r])) * s00);  // column 0
      EXPECT_EQ(decode_one(kc.data() + i * 2, DType::kBF16), want) << "w_kc[0, " << i << ", 0]";
    }
  }
}

TEST(Requant, IsRefusedWhereItCannotApply) {
  models::ModelOptions o;
  o.requant = Requant::kUe8m0;
  nlohmann::json c = synth::synth_config("llama", "tiny", DType::kBF16, false);
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}, o); }),
              HasSubstr("this checkpoint's quantization is none"));
  c["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Channel, 0);
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}, o); }),
              HasSubstr("converts FP8 block scales"));
  c["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 16);
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}, o); }),
              HasSubstr("needs 128 x 128 blocks"));
  o.requant = Requant::kTensor;  // any block size
  auto m = models::make_model(c, {}, o);
  const auto& shell = m->shells()[0];
  EXPECT_EQ(shell.params[shell.by_name.at("model.layers.0.mlp.down_proj.weight_scale")].shape,
            std::vector<std::uint64_t>{1});
  // A fused-experts param gets one scale an expert.
  nlohmann::json moe = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  moe["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 16);
  auto mm = models::make_model(moe, {}, o);
  const auto& ms = mm->shells()[0];
  EXPECT_EQ(ms.params[ms.by_name.at("model.layers.0.mlp.experts.w13_weight_scale")].shape,
            std::vector<std::uint64_t>{8});
}

}  // namespace
}  // namespace ferry::testing
