// postprocess.target=sm100's fused experts through the whole pipeline on the host
// device, each against a naive reference of SGLang 0.5.23's layout applied to a
// plain (loader) load of the same checkpoint: NVFP4 experts under the default
// runner (each expert's scales swizzled) and under flashinfer_trtllm (FlashInfer's
// row permutations, padded shares, scalars), BF16 experts in its block layout, block
// FP8 experts loaded up rows first, per-tensor FP8 experts requantized and shuffled.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "models/postprocess.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/postprocess_load_util.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/dtype_codec.hpp"
#include "testing/synth_tiny.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using postprocess_testing::as_fp8_format;
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

// `family`'s small preset with `quant` in dir/<name> (sizes flashinfer_trtllm and
// the sm100 expert paths take at tp 2: intermediate 128, hidden 256).
// DeepSeek: qk_rope_head_dim 32, so that fused_qkv_a_proj_with_mqa (128 + 64 + 32
// rows) is one pad_nvfp4_weight leaves.
std::string synth_small(const TempDir& dir, const std::string& family, synth::SynthQuant quant,
                        const std::string& name) {
  synth::SynthOptions o;
  nlohmann::json config = synth::synth_config(family, "small", DType::kBF16, false);
  if (family == "deepseek_v3") {
    config["qk_rope_head_dim"] = 32;
  }
  o.from_config = dir.file(name + "-config.json");
  std::ofstream(o.from_config) << config.dump();
  o.quant = quant;
  o.quant_block = 128;
  o.out = dir.file(name);
  o.fsync = false;
  synth::synthesize(o);
  return o.out;
}

// The E4M3 block scales [E][m][c] of a plain load, each expert swizzled.
std::vector<std::byte> swizzle_experts(const std::vector<std::byte>& scale, std::uint64_t experts,
                                       std::uint64_t m, std::uint64_t c) {
  std::vector<std::byte> out;
  for (std::uint64_t e = 0; e < experts; ++e) {
    const std::vector<std::byte> one(scale.begin() + e * m * c, scale.begin() + (e + 1) * m * c);
    const std::vector<std::byte> swizzled = swizzle_blockscale(one, m, c);
    out.insert(out.end(), swizzled.begin(), swizzled.end());
  }
  return out;
}

// Distinct experts' scalars (w1's and w3's second scales differ, so that taking the
// wrong column shows; input scales of w1, w3 and w2 differ), under the family's
// names of the three projections, then a plain and an sm100 load at tp 2.
Loads load_sm100_distinct_experts(const std::string& ck, const std::string& w1,
                                  const std::string& w3, const std::string& w2) {
  set_scalars(ck, w1 + ".weight_scale_2", {0.0015f, 0.003f, 0.002f});
  set_scalars(ck, w3 + ".weight_scale_2", {0.0025f, 0.0005f});
  set_scalars(ck, w1 + ".input_scale", {0.5f, 0.75f});
  set_scalars(ck, w3 + ".input_scale", {0.25f, 1.5f, 0.125f});
  set_scalars(ck, w2 + ".input_scale", {2.0f, 0.375f});
  return load_both(ck, "sm100");
}

// NVFP4 fused experts on sm100 where the global MoE runner stays auto (Mixtral; the
// CUTLASS branch of ModelOptNvFp4FusedMoEMethod.process_weights_after_loading):
// each expert's block scales swizzled over the scale; per expert
// g1_alphas = max(w13_input_scale[e]) * w13_weight_scale_2[e][0], g1_alphas_up with
// [e][1], g2_alphas = w2_input_scale[e] * w2_weight_scale_2[e], and the input
// scales' reciprocals; the weights and everything else as a plain load has them.
TEST(PostprocessLoad, Nvfp4ExpertsOnSm100SwizzleEachExpert) {
  TempDir dir;
  const std::string ck = synth_small(dir, "mixtral", synth::SynthQuant::kNvfp4, "moe");
  const Loads l = load_sm100_distinct_experts(ck, "w1", "w3", "w2");
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t checked = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
      const std::vector<std::byte> plain = l.plain.model->read_param(r, p.name);
      if (p.dtype != DType::kU8 || p.shape.size() != 3) {
        // (The dense layers' scales: Nvfp4OnSm100IsTheSwizzleOfAPlainLoad.)
        if (!p.name.ends_with("weight_scale")) {
          EXPECT_EQ(l.target.model->read_param(r, p.name), plain) << p.name;
        }
        continue;
      }
      ++checked;
      EXPECT_EQ(l.target.model->read_param(r, p.name), plain) << p.name;
      const std::string base = p.name.substr(0, p.name.size() - 6);
      const std::string layer = p.name.substr(0, p.name.rfind('.') + 1);
      const bool w13 = p.name.ends_with("w13_weight");
      const std::uint64_t experts = p.shape[0];
      const std::uint64_t c = p.shape[2] * 2 / 16;
      EXPECT_EQ(l.target.model->read_param(r, base + "weight_scale"),
                swizzle_experts(l.plain.model->read_param(r, base + "weight_scale"), experts,
                                p.shape[1], c))
          << base;
      const std::vector<float> in = floats(l.plain.model->read_param(r, base + "input_scale"));
      const std::vector<float> s2 = floats(l.plain.model->read_param(r, base + "weight_scale_2"));
      std::vector<float> alphas;
      std::vector<float> alphas_up;
      std::vector<float> quant;
      for (std::uint64_t e = 0; e < experts; ++e) {
        const float x = w13 ? std::max(in[2 * e], in[2 * e + 1]) : in[e];
        alphas.push_back(x * s2[w13 ? 2 * e : e]);
        alphas_up.push_back(w13 ? x * s2[2 * e + 1] : 0.0f);
        quant.push_back(1.0f / x);
      }
      EXPECT_EQ(floats(l.target.model->read_param(r, base + "input_scale_quant")), quant) << base;
      if (w13) {
        EXPECT_EQ(floats(l.target.model->read_param(r, layer + "g1_alphas")), alphas) << layer;
        EXPECT_EQ(floats(l.target.model->read_param(r, layer + "g1_alphas_up")), alphas_up);
        EXPECT_NE(alphas, alphas_up);  // w1's and w3's second scales differ
      } else {
        EXPECT_EQ(floats(l.target.model->read_param(r, layer + "g2_alphas")), alphas) << layer;
      }
    }
  }
  EXPECT_EQ(checked, 2u * 4 * 2);  // w13 and w2, four layers, two ranks
  overlap_and_dummy_match(ck, "sm100", l.target);
}

// FlashInfer 0.7.2's row order for flashinfer_trtllm, as SGLang 0.5.23's
// prepare_static_weights_for_trtllm_fp4_moe gathers it: out row n is row
// perm[n] of the expert as SGLang loads it. get_reorder_rows_for_gated_act_gemm_row_indices
// (gated w13: 0, M/2, 1, M/2 + 1, ...), then get_shuffle_matrix_a_row_indices with
// epilogue_tile_m 128 (blocks of 32 rows, srcToDstBlk32RowMap: row_indices[new] = old).
std::vector<std::uint64_t> trtllm_rows(std::uint64_t rows, bool gated) {
  static const std::uint64_t kBlk32[32] = {0,  8,  16, 24, 1,  9,  17, 25, 2,  10, 18,
                                           26, 3,  11, 19, 27, 4,  12, 20, 28, 5,  13,
                                           21, 29, 6,  14, 22, 30, 7,  15, 23, 31};
  std::vector<std::uint64_t> permute0(rows);
  for (std::uint64_t i = 0; i < rows; ++i) {
    permute0[i] = !gated ? i : (i % 2 == 0 ? i / 2 : rows / 2 + i / 2);
  }
  std::vector<std::uint64_t> permute1(rows);
  for (std::uint64_t old = 0; old < rows; ++old) {
    permute1[old / 32 * 32 + kBlk32[old % 32]] = old;
  }
  std::vector<std::uint64_t> out(rows);
  for (std::uint64_t n = 0; n < rows; ++n) {
    out[n] = permute0[permute1[n]];
  }
  return out;
}

// Experts [E][rows][row_bytes] of a plain load (w13: gate rows, then up) as
// flashinfer_trtllm serves them: loaded up first (load_up_proj_weight_first), rows
// gathered by trtllm_rows, and (scales) each expert swizzled.
std::vector<std::byte> trtllm_experts(const std::vector<std::byte>& plain, std::uint64_t experts,
                                      std::uint64_t rows, std::uint64_t row_bytes, bool w13,
                                      bool scales) {
  const std::vector<std::uint64_t> perm = trtllm_rows(rows, w13);
  std::vector<std::byte> out;
  for (std::uint64_t e = 0; e < experts; ++e) {
    const std::byte* expert = plain.data() + e * rows * row_bytes;
    std::vector<std::byte> shuffled(rows * row_bytes);
    for (std::uint64_t n = 0; n < rows; ++n) {
      std::uint64_t src = perm[n];
      if (w13) {
        src = (src + rows / 2) % rows;  // SGLang's row src holds ferry's row src +- rows / 2
      }
      std::memcpy(shuffled.data() + n * row_bytes, expert + src * row_bytes, row_bytes);
    }
    if (scales) {
      shuffled = swizzle_blockscale(shuffled, rows, row_bytes);
    }
    out.insert(out.end(), shuffled.begin(), shuffled.end());
  }
  return out;
}

// DeepSeek-V3 NVFP4 on sm100 without an all-to-all backend: flashinfer_trtllm
// (align_fp4_moe_weights_for_flashinfer_trtllm): the experts' weights and block
// scales as trtllm_experts makes them from a plain load; one input scale for all
// experts (the max): g1_alphas[e] = max(w13_input_scale) * w13_weight_scale_2[e][0],
// g1_alphas_up with [e][1], g2_alphas from w2's, the reciprocals F32 [], g1_scale_c =
// w2_input_scale_quant * g1_alphas_up.
// A plain and an sm100 load of DeepSeek NVFP4 `l` (flashinfer_trtllm's experts) at
// tp 2 with `ranks` local ranks: each expert's weights and block scales in FlashInfer's
// layout, and the scalars from the input scales' max over all of them (the plain
// load's w13_input_scale / w2_input_scale, every global expert on each rank) and the
// rank's experts' second scales. Returns the weights checked.
std::size_t expect_trtllm_nvfp4_experts(const Loads& l) {
  std::size_t checked = 0;
  for (std::size_t r = 0; r < l.plain.model->ranks().size(); ++r) {
    for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
      if (p.dtype != DType::kU8 || p.shape.size() != 3) {
        continue;
      }
      ++checked;
      const std::string base = p.name.substr(0, p.name.size() - 6);
      const std::string layer = p.name.substr(0, p.name.rfind('.') + 1);
      const bool w13 = p.name.ends_with("w13_weight");
      const std::uint64_t experts = p.shape[0];
      const std::uint64_t n = p.shape[1];
      const std::uint64_t k = p.shape[2] * 2;
      const std::vector<std::byte> plain = l.plain.model->read_param(r, p.name);
      const std::vector<std::byte> want = trtllm_experts(plain, experts, n, k / 2, w13, false);
      EXPECT_NE(want, plain) << p.name;  // the layout moves bytes
      EXPECT_EQ(l.target.model->read_param(r, p.name), want) << p.name;
      EXPECT_EQ(l.target.model->read_param(r, base + "weight_scale"),
                trtllm_experts(l.plain.model->read_param(r, base + "weight_scale"), experts, n,
                               k / 16, w13, true))
          << base;
      if (!w13) {
        continue;
      }
      const std::vector<float> in13 = floats(l.plain.model->read_param(r, base + "input_scale"));
      const std::vector<float> in2 = floats(l.plain.model->read_param(r, layer + "w2_input_scale"));
      EXPECT_EQ(floats(l.target.model->read_param(r, base + "input_scale")), in13) << layer;
      const std::vector<float> s2 = floats(l.plain.model->read_param(r, base + "weight_scale_2"));
      const std::vector<float> w2s2 =
          floats(l.plain.model->read_param(r, layer + "w2_weight_scale_2"));
      const float m13 = *std::max_element(in13.begin(), in13.end());
      const float m2 = *std::max_element(in2.begin(), in2.end());
      std::vector<float> g1;
      std::vector<float> g1_up;
      std::vector<float> g2;
      std::vector<float> c;
      for (std::uint64_t e = 0; e < experts; ++e) {
        g1.push_back(m13 * s2[2 * e]);
        g1_up.push_back(m13 * s2[2 * e + 1]);
        g2.push_back(m2 * w2s2[e]);
        c.push_back((1.0f / m2) * g1_up.back());
      }
      EXPECT_EQ(floats(l.target.model->read_param(r, layer + "g1_alphas")), g1) << layer;
      EXPECT_EQ(floats(l.target.model->read_param(r, layer + "g1_alphas_up")), g1_up);
      EXPECT_EQ(floats(l.target.model->read_param(r, layer + "g2_alphas")), g2);
      EXPECT_EQ(floats(l.target.model->read_param(r, layer + "g1_scale_c")), c);
      EXPECT_EQ(floats(l.target.model->read_param(r, base + "input_scale_quant")),
                std::vector<float>{1.0f / m13});
      EXPECT_EQ(floats(l.target.model->read_param(r, layer + "w2_input_scale_quant")),
                std::vector<float>{1.0f / m2});
    }
  }
  return checked;
}

TEST(PostprocessLoad, Nvfp4DeepseekExpertsOnSm100AreFlashinferTrtllms) {
  TempDir dir;
  const std::string ck = synth_small(dir, "deepseek_v3", synth::SynthQuant::kNvfp4, "ds");
  const Loads l = load_sm100_distinct_experts(ck, "gate_proj", "up_proj", "down_proj");
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  EXPECT_GT(expect_trtllm_nvfp4_experts(l), 0u);
  overlap_and_dummy_match(ck, "sm100", l.target);
}

// Under expert parallelism (tp 2, ep 2: rank 0 holds routed experts 0-7, rank 1
// 8-15) SGLang's input scales hold every global expert on each rank
// (_sglang_require_global_experts) and flashinfer_trtllm's max runs over all of them:
// the largest input scales are put on rank 1's experts, so a max over the local ones
// would differ on rank 0.
TEST(PostprocessLoad, Nvfp4TrtllmExpertsUnderEpTakeTheGlobalMax) {
  TempDir dir;
  const std::string ck = synth_small(dir, "deepseek_v3", synth::SynthQuant::kNvfp4, "ds");
  set_scalars(ck, "layers.1.mlp.experts.15.up_proj.input_scale", {64.0f});
  set_scalars(ck, "layers.1.mlp.experts.9.down_proj.input_scale", {32.0f});
  const Loads l = load_both(ck, "sm100", {"parallel.tp=2", "parallel.ep=2"});
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  const std::string layer = "model.layers.1.mlp.experts.";
  ASSERT_EQ(l.plain.model->ranks()[0].params.size(), l.plain.model->ranks()[1].params.size());
  for (std::size_t r = 0; r < 2; ++r) {
    const std::vector<float> in13 = floats(l.plain.model->read_param(r, layer + "w13_input_scale"));
    const std::vector<float> in2 = floats(l.plain.model->read_param(r, layer + "w2_input_scale"));
    ASSERT_GE(in13.size(), 32u);  // [16 (+ the fused shared expert), 2]
    EXPECT_EQ(in13[30], 64.0f);
    EXPECT_EQ(in13[31], 64.0f);
    EXPECT_EQ(in2[9], 32.0f);
    // Rank 0's own experts' largest scales are smaller: a local max would show.
    EXPECT_LT(*std::max_element(in13.begin(), in13.begin() + 16), 64.0f);
    EXPECT_LT(*std::max_element(in2.begin(), in2.begin() + 8), 32.0f);
    EXPECT_EQ(floats(l.target.model->read_param(r, layer + "w13_input_scale_quant")),
              std::vector<float>{1.0f / 64.0f});
    EXPECT_EQ(floats(l.target.model->read_param(r, layer + "w2_input_scale_quant")),
              std::vector<float>{1.0f / 32.0f});
  }
  EXPECT_EQ(l.plain.model->read_param(0, layer + "w13_input_scale"),
            l.plain.model->read_param(1, layer + "w13_input_scale"));
  EXPECT_NE(l.plain.model->read_param(0, layer + "w13_weight_scale_2"),
            l.plain.model->read_param(1, layer + "w13_weight_scale_2"));
  EXPECT_GT(expect_trtllm_nvfp4_experts(l), 0u);
}

// flashinfer_trtllm's padded shares (create_weights, narrow_padded_param_and_loaded_weight):
// DeepSeek-V3 small's intermediate 128 at tp 4 is 32 a rank, padded to 64, and SGLang
// shards the padded size: tp rank r holds rows [64 r, +64) of it, so ranks 0 and 1
// hold what tp 2's ranks hold and ranks 2 and 3 zeros (weights and block scales).
TEST(PostprocessLoad, Nvfp4TrtllmExpertsShardThePaddedIntermediate) {
  TempDir dir;
  const std::string ck = synth_small(dir, "deepseek_v3", synth::SynthQuant::kNvfp4, "ds");
  Runtime tp2_rt(to_config(make_config(ck, {"parallel.tp=2", "postprocess.target=sm100"})));
  Runtime tp4_rt(to_config(make_config(ck, {"parallel.tp=4", "postprocess.target=sm100"})));
  const LoadResult tp2 = tp2_rt.load();
  const LoadResult tp4 = tp4_rt.load();
  ASSERT_TRUE(tp2) << tp2.error->message;
  ASSERT_TRUE(tp4) << tp4.error->message;
  std::size_t checked = 0;
  for (const LoadedParam& p : tp2.model->ranks()[0].params) {
    if (p.name.find("mlp.experts.w") == std::string::npos || p.shape.size() != 3) {
      continue;  // the experts' weights and block scales (3-D)
    }
    ++checked;
    for (std::size_t r = 0; r < 4; ++r) {
      const std::vector<std::byte> got = tp4.model->read_param(r, p.name);
      if (r < 2) {
        EXPECT_EQ(got, tp2.model->read_param(r, p.name)) << p.name << " rank " << r;
      } else {
        EXPECT_EQ(got, std::vector<std::byte>(got.size())) << p.name << " rank " << r;
      }
    }
  }
  EXPECT_EQ(checked, 4u * 3);  // w13, w2 and their scales, three MoE layers
}

// convert_to_block_layout of each expert's rows as bytes with blockK 128 (FlashInfer
// 0.7.2): [E][rows][row_bytes] to [E][row_bytes / 128][rows][128].
std::vector<std::byte> block_layout(const std::vector<std::byte>& experts, std::uint64_t count,
                                    std::uint64_t rows, std::uint64_t row_bytes) {
  std::vector<std::byte> out(experts.size());
  for (std::uint64_t e = 0; e < count; ++e) {
    const std::byte* in = experts.data() + e * rows * row_bytes;
    std::byte* to = out.data() + e * rows * row_bytes;
    for (std::uint64_t n = 0; n < rows; ++n) {
      for (std::uint64_t b = 0; b < row_bytes / 128; ++b) {
        std::memcpy(to + (b * rows + n) * 128, in + n * row_bytes + b * 128, 128);
      }
    }
  }
  return out;
}

// Unquantized DeepSeek-V3 on sm100 without an all-to-all backend: flashinfer_trtllm's
// BF16 experts (UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout): each
// expert's rows as trtllm_rows gathers them from the rows SGLang loads (up first),
// then convert_to_block_layout, served [E, K / 64, N, 64]; everything else as a plain
// load. At tp 2 a rank's share (64) is padded to 128 and the padded size sharded:
// rank 0 holds tp 1's experts, rank 1 zeros. The capture-safe startup and the dummy
// format agree.
TEST(PostprocessLoad, Bf16ExpertsOnSm100AreFlashinferTrtllmBlocks) {
  TempDir dir;
  const std::string ck = synth_small(dir, "deepseek_v3", synth::SynthQuant::kNone, "ds");
  const Loads l = load_both(ck, "sm100", {"parallel.tp=1"});
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t checked = 0;
  for (const LoadedParam& p : l.plain.model->ranks()[0].params) {
    const std::vector<std::byte> plain = l.plain.model->read_param(0, p.name);
    const LoadedParam* served = l.target.model->ranks()[0].find(p.name);
    ASSERT_NE(served, nullptr) << p.name;
    if (p.name.find("mlp.experts.w") == std::string::npos) {
      EXPECT_EQ(served->shape, p.shape) << p.name;
      EXPECT_EQ(l.target.model->read_param(0, p.name), plain) << p.name;
      continue;
    }
    ++checked;
    const bool w13 = p.name.ends_with("w13_weight");
    const std::uint64_t experts = p.shape[0];
    const std::uint64_t n = p.shape[1];
    const std::uint64_t k = p.shape[2];
    EXPECT_EQ(served->shape, (models::Shape{experts, k / 64, n, 64})) << p.name;
    const std::vector<std::byte> want =
        block_layout(trtllm_experts(plain, experts, n, k * 2, w13, false), experts, n, k * 2);
    EXPECT_NE(want, plain) << p.name;
    EXPECT_EQ(l.target.model->read_param(0, p.name), want) << p.name;
  }
  EXPECT_EQ(checked, 2u * 3);  // w13 and w2 of three MoE layers
  Runtime tp2_rt(to_config(make_config(ck, {"parallel.tp=2", "postprocess.target=sm100"})));
  const LoadResult tp2 = tp2_rt.load();
  ASSERT_TRUE(tp2) << tp2.error->message;
  for (const LoadedParam& p : l.target.model->ranks()[0].params) {
    if (p.name.find("mlp.experts.w") != std::string::npos) {
      EXPECT_EQ(tp2.model->read_param(0, p.name), l.target.model->read_param(0, p.name));
      const std::vector<std::byte> zeros = tp2.model->read_param(1, p.name);
      EXPECT_EQ(zeros, std::vector<std::byte>(zeros.size())) << p.name;
    }
  }
  overlap_and_dummy_match(ck, "sm100", tp2);
}

// Block FP8 DeepSeek-V3 on sm100 without an all-to-all backend: flashinfer_trtllm's
// Fp8MoEMethod experts are loaded w3 first (FusedMoE._weight_loader_impl swaps the
// shard ids), weight and block scales alike; process_weights_after_loading_block_quant
// leaves them (no DeepGEMM requant there). Everything else as on sm100 with DeepEP.
TEST(PostprocessLoad, BlockFp8DeepseekExpertsOnSm100LoadUpFirst) {
  TempDir dir;
  const std::string ck = synth_small(dir, "deepseek_v3", synth::SynthQuant::kFp8Block, "ds");
  const Loads l = load_both(ck, "sm100", {"parallel.tp=1"});
  ASSERT_TRUE(l.plain) << l.plain.error->message;
  ASSERT_TRUE(l.target) << l.target.error->message;
  std::size_t checked = 0;
  for (const LoadedParam& p : l.plain.model->ranks()[0].params) {
    if (p.shape.size() != 3 || p.name.find("experts.w13_weight") == std::string::npos) {
      continue;
    }
    ++checked;
    const std::vector<std::byte> plain = l.plain.model->read_param(0, p.name);
    const std::uint64_t expert = plain.size() / p.shape[0];
    std::vector<std::byte> want(plain.size());
    for (std::uint64_t e = 0; e < p.shape[0]; ++e) {  // the two halves of each expert swapped
      const std::byte* from = plain.data() + e * expert;
      std::memcpy(want.data() + e * expert, from + expert / 2, expert / 2);
      std::memcpy(want.data() + e * expert + expert / 2, from, expert / 2);
    }
    EXPECT_EQ(l.target.model->read_param(0, p.name), want) << p.name;
    const std::string w2 =
        p.name.substr(0, p.name.find("w13_")) + "w2_" + p.name.substr(p.name.find("w13_") + 4);
    EXPECT_EQ(l.target.model->read_param(0, w2), l.plain.model->read_param(0, w2)) << w2;
  }
  EXPECT_EQ(checked, 2u * 3);  // weight and scales of three MoE layers
}

// Per-tensor FP8 Qwen3-MoE on sm100 without an all-to-all backend, quant_method fp8
// (Fp8MoEMethod) and ModelOpt (ModelOptFp8MoEMethod): flashinfer_trtllm
// (align_fp8_moe_weights_for_flashinfer_trtllm). A rank's share of the intermediate
// size (64 at tp 1) is padded to 128 with zeros; each expert's w1 and w3 requantized
// to the larger of their scales, then gathered by trtllm_rows from SGLang's up-first
// rows (Fp8MoEMethod loads them so, ModelOpt flips its halves: the same bytes); w2's
// rows shuffled alike. The input scales their max, w13_weight_scale the larger of
// each expert's two, and output1_scales_scalar[e] = w13_weight_scale[e] * in13 *
// (1 / in2), output1_scales_gate_scalar[e] = w13_weight_scale[e] * in13,
// output2_scales_scalar[e] = in2 * w2_weight_scale[e]. Both against a plain load. At
// tp 2 the padded size is sharded: rank 0 holds tp 1's experts, rank 1 zeros.
TEST(PostprocessLoad, Fp8TensorExpertsOnSm100AreFlashinferTrtllms) {
  TempDir dir;
  for (const synth::SynthQuant quant :
       {synth::SynthQuant::kFp8Tensor, synth::SynthQuant::kModelOptFp8}) {
    const std::string ck =
        synth_tiny(dir, "qwen3_moe", quant, std::string(synth::to_string(quant)));
    if (quant == synth::SynthQuant::kFp8Tensor) {
      as_fp8_format(ck);
    }
    set_scalars(ck, "gate_proj.weight_scale", {0.0015f, 0.003f, 0.002f});
    set_scalars(ck, "up_proj.weight_scale", {0.0025f, 0.0005f});
    set_scalars(ck, "gate_proj.input_scale", {0.5f, 0.75f});
    set_scalars(ck, "up_proj.input_scale", {0.25f, 1.5f, 0.125f});
    set_scalars(ck, "down_proj.input_scale", {2.0f, 0.375f});
    const Loads l = load_both(ck, "sm100", {"parallel.tp=1"});
    ASSERT_TRUE(l.plain) << l.plain.error->message;
    ASSERT_TRUE(l.target) << l.target.error->message;
    std::size_t checked = 0;
    for (std::size_t r = 0; r < 1; ++r) {
      for (const LoadedParam& p : l.plain.model->ranks()[r].params) {
        if (!p.name.ends_with("experts.w13_weight")) {
          continue;
        }
        ++checked;
        const std::string e = p.name.substr(0, p.name.size() - std::string("w13_weight").size());
        auto plain = [&](const std::string& n) { return l.plain.model->read_param(r, e + n); };
        auto served = [&](const std::string& n) { return l.target.model->read_param(r, e + n); };
        const std::uint64_t experts = p.shape[0];
        const std::uint64_t half = p.shape[1] / 2;
        const std::uint64_t hidden = p.shape[2];
        const std::uint64_t padded = 128;
        ASSERT_NE(l.target.model->ranks()[r].find(p.name), nullptr) << p.name;
        ASSERT_EQ(l.target.model->ranks()[r].find(p.name)->shape,
                  (models::Shape{experts, 2 * padded, hidden}));
        const std::vector<std::byte> w13 = plain("w13_weight");
        const std::vector<std::byte> w2 = plain("w2_weight");
        const std::vector<float> s = floats(plain("w13_weight_scale"));
        const std::vector<float> w2s = floats(plain("w2_weight_scale"));
        const std::vector<std::byte> got13 = served("w13_weight");
        const std::vector<std::byte> got2 = served("w2_weight");
        const std::vector<std::uint64_t> perm13 = trtllm_rows(2 * padded, true);
        const std::vector<std::uint64_t> perm2 = trtllm_rows(hidden, false);
        std::vector<float> smax;
        for (std::uint64_t x = 0; x < experts; ++x) {
          smax.push_back(std::max(s[2 * x], s[2 * x + 1]));
          for (std::uint64_t n = 0; n < 2 * padded; ++n) {
            // Served row n is SGLang's up-first row perm13[n]: up's rows, then gate's.
            const std::uint64_t src = perm13[n];
            const std::uint64_t shard = src < padded ? 1 : 0;  // ferry's: 0 gate, 1 up
            const std::uint64_t row = src % padded;
            for (std::uint64_t c = 0; c < hidden; ++c) {
              const std::uint8_t q =
                  static_cast<std::uint8_t>(got13[(x * 2 * padded + n) * hidden + c]);
              const float want =
                  row >= half
                      ? 0.0f
                      : requant_value(static_cast<std::uint8_t>(
                                          w13[(x * 2 * half + shard * half + row) * hidden + c]),
                                      s[2 * x + shard], smax[x]);
              ASSERT_EQ(testing::e4m3_value(q), want)
                  << p.name << " expert " << x << " row " << n << " col " << c;
            }
          }
          for (std::uint64_t n = 0; n < hidden; ++n) {
            for (std::uint64_t c = 0; c < padded; ++c) {
              const std::byte want =
                  c < half ? w2[(x * hidden + perm2[n]) * half + c] : std::byte{0};
              ASSERT_EQ(got2[(x * hidden + n) * padded + c], want)
                  << e << "w2_weight expert " << x << " row " << n << " col " << c;
            }
          }
        }
        EXPECT_EQ(floats(served("w13_weight_scale")), smax);
        EXPECT_EQ(floats(served("w2_weight_scale")), w2s);
        const std::vector<float> in13 = floats(plain("w13_input_scale"));
        const std::vector<float> in2 = floats(plain("w2_input_scale"));
        const float m13 = *std::max_element(in13.begin(), in13.end());
        const float m2 = *std::max_element(in2.begin(), in2.end());
        EXPECT_EQ(floats(served("w13_input_scale")), std::vector<float>{m13});
        EXPECT_EQ(floats(served("w2_input_scale")), std::vector<float>{m2});
        std::vector<float> out1;
        std::vector<float> gate;
        std::vector<float> out2;
        for (std::uint64_t x = 0; x < experts; ++x) {
          gate.push_back(smax[x] * m13);
          out1.push_back(gate.back() * (1.0f / m2));
          out2.push_back(m2 * w2s[x]);
        }
        EXPECT_EQ(floats(served("output1_scales_scalar")), out1) << e;
        EXPECT_EQ(floats(served("output1_scales_gate_scalar")), gate) << e;
        EXPECT_EQ(floats(served("output2_scales_scalar")), out2) << e;
      }
    }
    EXPECT_EQ(checked, 4u) << synth::to_string(quant);  // four MoE layers
    Runtime tp2_rt(to_config(make_config(ck, {"parallel.tp=2", "postprocess.target=sm100"})));
    const LoadResult tp2 = tp2_rt.load();
    ASSERT_TRUE(tp2) << tp2.error->message;
    for (const LoadedParam& p : l.target.model->ranks()[0].params) {
      if (p.name.find("mlp.experts.") != std::string::npos) {
        const std::vector<std::byte> want = l.target.model->read_param(0, p.name);
        EXPECT_EQ(tp2.model->read_param(0, p.name), want) << p.name;
        const std::vector<std::byte> other = tp2.model->read_param(1, p.name);
        if (p.name.ends_with("_weight")) {
          EXPECT_EQ(other, std::vector<std::byte>(other.size())) << p.name;
        } else {
          EXPECT_EQ(other, want) << p.name;  // an expert's scalars load on every rank
        }
      }
    }
    overlap_and_dummy_match(ck, "sm100", tp2);
  }
}

}  // namespace
}  // namespace ferry::runtime
