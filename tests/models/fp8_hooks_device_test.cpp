// The FP8 post-load hooks run on the device: the quantized MLA split (block,
// channel and tensor scales), the V3.2 indexer fusion, quantization.requant (ue8m0,
// tensor) and quantization.online (per channel, per tensor, fused experts) read no
// weight back to the host. Each model's hooks run on a forwarding device that counts
// copy_d2h calls; what the hooks compute is checked against the references by
// deepseek_test, requant_test, online_quant_test and the runtime's load tests.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.hpp"
#include "gpu/forwarding_device.hpp"
#include "gpu/host_device.hpp"
#include "models/host_hook_context.hpp"
#include "models/model.hpp"
#include "models/quant.hpp"
#include "synth/synth.hpp"

namespace ferry::testing {
namespace {

struct HookRun {
  std::size_t reads = 0;                     // copy_d2h calls while the hooks ran
  std::map<std::string, std::size_t> kinds;  // hooks run, by the name's prefix
};

// Runs every hook of every rank of `model` on params holding the dummy format's
// values, counting read-backs.
HookRun run_hooks_counting_reads(const models::Model& model) {
  auto device = std::make_shared<gpu::testing::ForwardingDevice>(gpu::make_host_device(0));
  HookRun run;
  bool counting = false;
  device->faults().on_copy_d2h = [&](std::size_t) { run.reads += counting ? 1 : 0; };
  auto stream = device->create_stream();
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    const models::RankShell& shell = model.shells()[r];
    std::vector<gpu::DeviceAllocation> storage;
    std::vector<std::byte*> ptrs;
    for (std::size_t k = 0; k < shell.params.size(); ++k) {
      const models::ParamSpec& p = shell.params[k];
      storage.push_back(device->allocate(p.nbytes));
      ptrs.push_back(storage.back().data());
      const models::DummyRange range = models::dummy_range(p);
      if (range.random && gpu::random_fillable_dtype(p.dtype)) {
        stream->fill_random(ptrs.back(), p.nbytes / dtype_size(p.dtype), p.dtype, range.low,
                            range.high, k);
      } else {
        stream->zero(ptrs.back(), p.nbytes);
      }
    }
    stream->synchronize();
    counting = true;
    for (const models::PostLoadHook& h : model.hooks()) {
      if (h.local_rank != r) {
        continue;
      }
      // compressed-tensors' w1 / w3 input-scale check reads two scalars an expert
      // back by design (models/postprocess.hpp); the FP8 weight hooks read nothing.
      counting = h.name.rfind("input_scale_check:", 0) != 0;
      HostHookContext ctx(*stream, ptrs, h, device.get());
      h.run(ctx);
      stream->synchronize();
      ++run.kinds[h.name.substr(0, h.name.find(':'))];
    }
    counting = false;
  }
  return run;
}

nlohmann::json quantized(const std::string& family, synth::SynthQuant kind, std::uint64_t block) {
  nlohmann::json config = synth::synth_config(family, "tiny", DType::kBF16, false);
  config["quantization_config"] = synth::synth_quant_config(kind, block);
  return config;
}

TEST(Fp8HooksOnDevice, TheCounterSeesAReadBack) {
  auto device = std::make_shared<gpu::testing::ForwardingDevice>(gpu::make_host_device(0));
  std::size_t reads = 0;
  device->faults().on_copy_d2h = [&](std::size_t) { ++reads; };
  gpu::DeviceAllocation a = device->allocate(16);
  auto stream = device->create_stream();
  std::byte out[16];
  stream->copy_d2h(out, a.data(), sizeof out);
  stream->synchronize();
  EXPECT_EQ(reads, 1u);
}

TEST(Fp8HooksOnDevice, MlaSplitAndIndexerFusionReadNothingBack) {
  struct Case {
    synth::SynthQuant kind;
    std::uint64_t block;
  };
  for (const Case c :
       {Case{synth::SynthQuant::kFp8Block, 8}, Case{synth::SynthQuant::kFp8Channel, 0},
        Case{synth::SynthQuant::kFp8Tensor, 0}}) {
    SCOPED_TRACE(std::string(synth::to_string(c.kind)));
    // The fused indexer layout (indexer_rope_interleave: SGLang 0.5.23's
    // use_dsa_indexer_fusion), so that the fusion hook runs.
    nlohmann::json config = quantized("deepseek_v32", c.kind, c.block);
    config["indexer_rope_interleave"] = true;
    auto model = models::make_model(config, {}, {});
    const HookRun run = run_hooks_counting_reads(*model);
    EXPECT_GT(run.kinds.count("mla_dequant_split_kv_b"), 0u);
    EXPECT_GT(run.kinds.count("indexer_fuse_wk_weights_proj"), 0u);
    EXPECT_EQ(run.reads, 0u);
  }
}

TEST(Fp8HooksOnDevice, RequantReadsNothingBack) {
  for (auto kind : {models::QuantScheme::Requant::kUe8m0, models::QuantScheme::Requant::kTensor}) {
    nlohmann::json config = synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false);
    config["q_lora_rank"] = 128;
    config["kv_lora_rank"] = 128;
    config["moe_intermediate_size"] = 128;
    config["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 128);
    models::ModelOptions options;
    options.requant = kind;
    auto model = models::make_model(config, {}, options);
    const HookRun run = run_hooks_counting_reads(*model);
    EXPECT_GT(run.kinds.count(kind == models::QuantScheme::Requant::kUe8m0 ? "requant_ue8m0"
                                                                           : "requant_tensor"),
              0u);
    EXPECT_GT(run.kinds.count("mla_dequant_split_kv_b"), 0u);
    EXPECT_EQ(run.reads, 0u);
  }
}

TEST(Fp8HooksOnDevice, OnlineQuantizationReadsNothingBack) {
  for (auto kind : {models::QuantScheme::Online::kChannel, models::QuantScheme::Online::kTensor}) {
    for (const char* family : {"llama", "qwen3_moe", "deepseek_v32"}) {
      SCOPED_TRACE(family);
      models::ModelOptions options;
      options.online = kind;
      auto model =
          models::make_model(synth::synth_config(family, "tiny", DType::kBF16, false), {}, options);
      const HookRun run = run_hooks_counting_reads(*model);
      EXPECT_GT(run.kinds.count("online_quant_fp8"), 0u);
      EXPECT_EQ(run.reads, 0u);
    }
  }
}

}  // namespace
}  // namespace ferry::testing
