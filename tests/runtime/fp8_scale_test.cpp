// FP8 block-quantized checkpoints at real scale: the real config.json files of
// DeepSeek-V3 and Qwen3-30B-A3B-FP8 (quantization_config: fp8, weight_block_size
// [128, 128]) synthesized as sparse checkpoints with their real FP8 tensor set
// (every quantized linear weight F8_E4M3 with its F32 weight_scale_inv), then one
// rank at tp 8 / ep 8 planned and loaded onto a null device: nothing unmapped, the
// load reads exactly its plan (plus the headers), and every parameter byte, scales
// and the MLA split's outputs included, is written.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "gpu/null_device.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/plan_report.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::runtime {
namespace {

struct Fp8Model {
  std::string config;       // under ../shared/data/models
  std::size_t tensors = 0;  // weights, scales and the rest
  std::size_t scales = 0;   // weight_scale_inv tensors
  // Pipeline stages: DeepSeek-V3's rank at tp 8 / ep 8 reads 85 GB (zeros from
  // holes, at about 1 GB/s here), so the load takes the last of 16 stages (4 of 61
  // layers, the norm and lm_head); the whole rank is planned too.
  int pp = 1;
};

class Fp8FullSize : public ::testing::TestWithParam<Fp8Model> {};

TEST_P(Fp8FullSize, OneRankAtTp8Ep8PlansReadsItsPlanAndFillsEveryParameter) {
  FERRY_NEED_TEST_DATA();
  const Fp8Model& m = GetParam();
  testing::TempDir dir;
  synth::SynthOptions o;
  o.from_config = ::ferry::testing::test_data_path("models/" + m.config + "/config.json");
  o.quant_from_config = true;  // the config's own FP8 layout (as `ferry synth` without --dtype)
  o.sparse = true;
  o.out = dir.file(m.config);
  o.fsync = false;
  synth::SynthResult written = synth::synthesize(o);
  ASSERT_EQ(written.tensors, m.tensors);
  {
    std::ifstream in(o.out + "/config.json");
    const nlohmann::json c = nlohmann::json::parse(in);
    ASSERT_EQ(c.at("quantization_config").at("quant_method"), "fp8");
    EXPECT_EQ(c.at("quantization_config").at("weight_block_size"), nlohmann::json({128, 128}));
    std::ifstream idx(o.out + "/model.safetensors.index.json");
    std::size_t scales = 0;
    const nlohmann::json map = nlohmann::json::parse(idx).at("weight_map");
    for (auto it = map.begin(); it != map.end(); ++it) {
      const std::string& name = it.key();
      scales += name.size() > 16 && name.compare(name.size() - 16, 16, "weight_scale_inv") == 0;
    }
    EXPECT_EQ(scales, m.scales);
  }

  const std::vector<std::string> rank3 = {"parallel.tp=8", "parallel.ep=8", "parallel.ranks=3",
                                          "devices=null"};
  PlanReport whole = make_plan_report(testing::make_config(o.out, rank3));
  EXPECT_EQ(whole.unmapped, 0u);
  EXPECT_GT(whole.placed, 0u);
  EXPECT_LT(whole.read_bytes, whole.checkpoint_bytes / 4);  // 1 of 8 expert-parallel ranks
  std::vector<std::string> settings = rank3;
  if (m.pp > 1) {
    settings.push_back("parallel.pp=" + std::to_string(m.pp));
    settings.push_back("parallel.pp_rank=" + std::to_string(m.pp - 1));
  }
  LoadConfig config = testing::make_config(o.out, settings);
  PlanReport plan = make_plan_report(config);
  EXPECT_EQ(plan.unmapped, 0u);

  RuntimeTestSeams hooks;
  hooks.devices = {gpu::make_null_device(0)};
  Runtime rt = make_runtime(to_config(config), hooks);
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  const LoadReport& rep = r.model->report();
  EXPECT_EQ(rep.bytes_read, plan.read_bytes + testing::synth_header_bytes(written));
  EXPECT_EQ(rep.tensors.unmapped, 0u);
  std::uint64_t param_bytes = 0;
  std::size_t fp8 = 0;
  std::size_t scale_params = 0;
  for (const LoadedParam& p : r.model->ranks()[0].params) {
    const bool hook_output =
        p.name.size() > 4 && (p.name.compare(p.name.size() - 4, 4, "w_kc") == 0 ||
                              p.name.compare(p.name.size() - 4, 4, "w_vc") == 0);
    // A null device keeps no bytes, so the MLA split (a post-load hook) does not run
    // on it; every other param is written by the load's pieces.
    param_bytes += hook_output ? 0 : p.nbytes;
    fp8 += p.dtype == DType::kF8E4M3 ? 1 : 0;
    scale_params +=
        p.name.size() > 16 && p.name.compare(p.name.size() - 16, 16, "weight_scale_inv") == 0;
  }
  EXPECT_GT(fp8, 0u);
  EXPECT_EQ(scale_params, fp8);  // every FP8 param has its block scales
  EXPECT_EQ(gpu::null_device_bytes_written(*hooks.devices[0]), param_bytes);
}

// Tensor counts: DeepSeek-V3 91991, the real checkpoint's, i.e. the 46183 names of
// the BF16 layout plus 45808 scales (3 dense layers x 8 linears, and 58 MoE layers
// plus the MTP layer x (5 attention + 256 x 3 expert + 3 shared-expert linears));
// Qwen3-30B-A3B-FP8 37491: 18867 plus 48 layers x (4 + 128 x 3) = 18624 scales.
INSTANTIATE_TEST_SUITE_P(RealConfigs, Fp8FullSize,
                         ::testing::Values(Fp8Model{"deepseek-v3", 91991, 45808, 16},
                                           Fp8Model{"qwen3-30b-a3b-fp8", 37491, 18624}),
                         [](const ::testing::TestParamInfo<Fp8Model>& param) {
                           std::string n = param.param.config;
                           for (char& ch : n) {
                             ch = (ch == '-' || ch == '.') ? '_' : ch;
                           }
                           return n;
                         });

// DeepSeek-V3.2 at full size: DeepSeek-V3's real FP8 config with the V3.2
// architecture and indexer fields (64 heads of 128, top-k 2048, as DeepSeek-V3.2-Exp
// ships), written sparse with its real FP8 tensor set plus the indexer in all 61
// layers and the MTP layer: one rank of tp 8 / ep 8 plans with nothing unmapped and
// holds every indexer, its wq_b and wk in FP8.
TEST(Fp8FullSize, DeepseekV32IndexersPlanWithNothingUnmapped) {
  FERRY_NEED_TEST_DATA();
  testing::TempDir dir;
  nlohmann::json config;
  {
    std::ifstream in(::ferry::testing::test_data_path("models/deepseek-v3/config.json"));
    config = nlohmann::json::parse(in);
  }
  config["architectures"] = {"DeepseekV32ForCausalLM"};
  config["index_topk"] = 2048;
  config["index_n_heads"] = 64;
  config["index_head_dim"] = 128;
  const std::string path = dir.file("v32.json");
  std::ofstream(path) << config.dump();
  synth::SynthOptions o;
  o.from_config = path;
  o.quant_from_config = true;
  o.sparse = true;
  o.out = dir.file("v32");
  o.fsync = false;
  const synth::SynthResult written = synth::synthesize(o);
  // DeepSeek-V3's 91991, and per layer (61 and the MTP one) wq_b, wk and their
  // scales, k_norm's weight and bias, weights_proj.
  EXPECT_EQ(written.tensors, 91991u + 62 * 7);
  PlanReport plan = make_plan_report(testing::make_config(
      o.out, {"parallel.tp=8", "parallel.ep=8", "parallel.ranks=0", "devices=null"}));
  EXPECT_EQ(plan.unmapped, 0u);
  std::size_t indexers = 0;
  for (const PlannedTensor& t : plan.tensors) {
    if (t.name.find(".indexer.wk.weight") != std::string::npos &&
        t.name.find("scale") == std::string::npos) {
      if (t.name.rfind("model.layers.61.", 0) == 0) {  // the MTP layer: not the target's
        EXPECT_EQ(t.reason, "mtp_layer");
        continue;
      }
      ASSERT_EQ(t.route, models::RouteKind::kPlaced) << t.name;
      ++indexers;
    }
  }
  EXPECT_EQ(indexers, 61u);
  auto model = make_configured_model(
      testing::make_config(o.out, {"parallel.tp=8", "parallel.ep=8", "parallel.ranks=0"}), config);
  const models::RankShell& shell = model->shells()[0];
  const std::string i = "model.layers.60.self_attn.indexer.";
  EXPECT_EQ(shell.params[shell.by_name.at(i + "wk.weight")].dtype, DType::kF8E4M3);
  EXPECT_EQ(shell.params[shell.by_name.at(i + "wk.weight_scale_inv")].shape,
            (std::vector<std::uint64_t>{1, 56}));
  EXPECT_EQ(shell.params[shell.by_name.at(i + "wq_b.weight")].shape,
            (std::vector<std::uint64_t>{8192, 1536}));
  // The default config (no indexer_rope_interleave: neox rope): SGLang 0.5.23 builds
  // wk and a BF16 weights_proj, no fused wk_weights_proj.
  EXPECT_EQ(shell.by_name.count(i + "wk_weights_proj.weight"), 0u);
  EXPECT_EQ(shell.params[shell.by_name.at(i + "weights_proj.weight")].shape,
            (std::vector<std::uint64_t>{64, 7168}));
  EXPECT_EQ(shell.params[shell.by_name.at(i + "weights_proj.weight")].dtype, DType::kBF16);
  // indexer_rope_interleave: one fused BF16 wk_weights_proj instead (wk and
  // weights_proj transients the fusion hook reads).
  config["indexer_rope_interleave"] = true;
  auto fused = make_configured_model(
      testing::make_config(o.out, {"parallel.tp=8", "parallel.ep=8", "parallel.ranks=0"}), config);
  const models::RankShell& fs = fused->shells()[0];
  EXPECT_EQ(fs.params[fs.by_name.at(i + "wk_weights_proj.weight")].shape,
            (std::vector<std::uint64_t>{192, 7168}));
  EXPECT_EQ(fs.params[fs.by_name.at(i + "wk_weights_proj.weight")].dtype, DType::kBF16);
  EXPECT_TRUE(fs.params[fs.by_name.at(i + "wk.weight")].transient);
  EXPECT_TRUE(fs.params[fs.by_name.at(i + "wk.weight_scale_inv")].transient);
}

}  // namespace
}  // namespace ferry::runtime
