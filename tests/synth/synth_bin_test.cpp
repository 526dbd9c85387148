// `ferry synth --format bin`: PyTorch .bin shards with the safetensors output's
// tensors, values and shard plan (each member of each ZIP, read by a small reader of
// this test's own, against the safetensors shard of the same number), the names
// save_pretrained gives them and their index, the refusals (--sparse, glm4_moe's
// unindexed MTP file), --force across formats, and the command line. That the files
// are what torch.save writes is io/torch_writer's test and interop.torch_bin's.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/safetensors.hpp"
#include "io/torch_writer.hpp"
#include "synth/cli_util.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::synth {
namespace {

namespace fs = std::filesystem;
using ferry::testing::read_file;
using ferry::testing::TempDir;
using nlohmann::json;

// ---- a minimal ZIP reader (stored members, the ZIP64 end records torch writes) ----

std::uint64_t le(const std::string& b, std::uint64_t at, int n) {
  if (at + static_cast<std::uint64_t>(n) > b.size()) {
    throw std::runtime_error("read past the end at " + std::to_string(at));
  }
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) {
    v = (v << 8) | static_cast<unsigned char>(b[at + static_cast<std::uint64_t>(i)]);
  }
  return v;
}

// Member name -> its data, in central-directory order (names() keeps the order).
struct Zip {
  std::vector<std::string> names;
  std::map<std::string, std::string> data;
};

Zip read_zip(const std::string& b) {
  const std::uint64_t eocd = b.size() - 22;
  if (le(b, eocd, 4) != 0x06054b50 || le(b, eocd - 20, 4) != 0x07064b50) {
    throw std::runtime_error("no ZIP64 end records");
  }
  const std::uint64_t z64 = le(b, eocd - 12, 8);
  const std::uint64_t entries = le(b, z64 + 32, 8);
  std::uint64_t at = le(b, z64 + 48, 8);
  Zip zip;
  for (std::uint64_t i = 0; i < entries; ++i) {
    if (le(b, at, 4) != 0x02014b50 || le(b, at + 10, 2) != 0) {
      throw std::runtime_error("not a stored member's central header");
    }
    const std::uint64_t size = le(b, at + 24, 4);
    const std::uint64_t n = le(b, at + 28, 2), x = le(b, at + 30, 2), c = le(b, at + 32, 2);
    const std::uint64_t local = le(b, at + 42, 4);
    if (size == 0xFFFFFFFFu || local == 0xFFFFFFFFu) {
      throw std::runtime_error("ZIP64 member fields in a small test file");
    }
    const std::string name = b.substr(at + 46, n);
    at += 46 + n + x + c;
    const std::uint64_t data = local + 30 + le(b, local + 26, 2) + le(b, local + 28, 2);
    zip.names.push_back(name);
    zip.data[name] = b.substr(data, size);
  }
  return zip;
}

// "00002-of-00004" of pytorch_model-00002-of-00004.bin or model-00002-of-00004.safetensors.
std::string shard_number(const std::string& file) {
  const std::string stem = file.substr(0, file.rfind('.'));
  return stem.substr(stem.find('-') + 1);
}

SynthOptions options_for(const std::string& family, const fs::path& out, SynthFormat format) {
  SynthOptions o;
  o.family = family;
  o.preset = "tiny";
  o.out = out.string();
  o.format = format;
  o.fsync = false;
  return o;
}

// Checks the .bin checkpoint at `bin` against the safetensors one at `st` written
// with the same options: the same index (but its file names), the same config, and
// each .bin shard's members: data.pkl the state dict of the safetensors shard's
// tensors in their order, data/<k> the bytes of its k-th tensor.
void check_same_checkpoint(const fs::path& bin, const fs::path& st) {
  const json bin_index = json::parse(read_file((bin / "pytorch_model.bin.index.json").string()));
  const json st_index = json::parse(read_file((st / "model.safetensors.index.json").string()));
  EXPECT_EQ(bin_index["metadata"], st_index["metadata"]);
  ASSERT_EQ(bin_index["weight_map"].size(), st_index["weight_map"].size());
  for (const auto& [name, file] : st_index["weight_map"].items()) {
    const std::string bin_file = bin_index["weight_map"].value(name, "");
    EXPECT_EQ(bin_file, "pytorch_model-" + shard_number(file.get<std::string>()) + ".bin") << name;
  }
  EXPECT_EQ(read_file((bin / "config.json").string()), read_file((st / "config.json").string()));
  std::size_t shards = 0;
  for (const auto& e : fs::directory_iterator(st)) {
    const std::string file = e.path().filename().string();
    if (e.path().extension() != ".safetensors") {
      continue;
    }
    ++shards;
    SCOPED_TRACE(file);
    const std::string bin_file = "pytorch_model-" + shard_number(file) + ".bin";
    const io::SafetensorsHeader h = io::read_safetensors_header(e.path().string(), file);
    const std::string st_bytes = read_file(e.path().string());
    const Zip zip = read_zip(read_file((bin / bin_file).string()));
    const std::string prefix = bin_file.substr(0, bin_file.size() - 4) + "/";
    std::vector<io::TorchEntry> entries;
    for (std::size_t k = 0; k < h.tensors.size(); ++k) {
      const auto& t = h.tensors[k];
      entries.push_back({t.name, t.dtype, t.shape});
      const auto it = zip.data.find(prefix + "data/" + std::to_string(k));
      ASSERT_NE(it, zip.data.end()) << t.name;
      EXPECT_EQ(it->second, st_bytes.substr(t.offset, t.nbytes)) << t.name;
    }
    EXPECT_EQ(zip.data.at(prefix + "data.pkl"), io::torch_state_dict_pickle(entries, bin_file));
    EXPECT_EQ(zip.names.size(), h.tensors.size() + 6);
  }
  EXPECT_GE(shards, 1u);
  std::size_t bins = 0;
  for (const auto& e : fs::directory_iterator(bin)) {
    bins += e.path().extension() == ".bin" ? 1 : 0;
    EXPECT_NE(e.path().extension(), ".safetensors") << e.path();
  }
  EXPECT_EQ(bins, shards);
}

TEST(SynthBin, FormatNamesAndIndexFile) {
  EXPECT_EQ(parse_synth_format("safetensors"), SynthFormat::kSafetensors);
  EXPECT_EQ(parse_synth_format("bin"), SynthFormat::kTorchBin);
  EXPECT_EQ(parse_synth_format("pt"), std::nullopt);
  EXPECT_EQ(to_string(SynthFormat::kTorchBin), "bin");
  EXPECT_EQ(to_string(SynthFormat::kSafetensors), "safetensors");
  EXPECT_EQ(synth_index_file(SynthFormat::kTorchBin), "pytorch_model.bin.index.json");
  EXPECT_EQ(synth_index_file(SynthFormat::kSafetensors), "model.safetensors.index.json");
}

TEST(SynthBin, ShardPlanIsTheSafetensorsOneUnderSavePretrainedsNames) {
  const auto list = synth_tensor_list("qwen3_moe", "tiny", DType::kBF16, false);
  const auto st = synth_shard_plan(list, 300 << 10);
  const auto bin = synth_shard_plan(list, 300 << 10, SynthFormat::kTorchBin);
  ASSERT_EQ(bin.size(), st.size());
  ASSERT_GE(bin.size(), 2u);
  for (std::size_t s = 0; s < bin.size(); ++s) {
    EXPECT_EQ(bin[s].tensors, st[s].tensors);
    EXPECT_EQ(bin[s].data_bytes, st[s].data_bytes);
    EXPECT_TRUE(bin[s].indexed);
  }
  EXPECT_EQ(bin[0].file, "pytorch_model-00001-of-0000" + std::to_string(bin.size()) + ".bin");
  EXPECT_EQ(bin.back().file, "pytorch_model-0000" + std::to_string(bin.size()) + "-of-0000" +
                                 std::to_string(bin.size()) + ".bin");
}

TEST(SynthBin, EveryFamilyButGlmWritesTheSafetensorsTensorsAndValues) {
  TempDir dir;
  for (const auto& family : synth_families()) {
    if (family == "glm4_moe") {
      continue;  // its unindexed MTP file is refused below
    }
    SCOPED_TRACE(family);
    const fs::path bin = dir.path() / (family + "-bin");
    const fs::path st = dir.path() / (family + "-st");
    const SynthResult r = synthesize(options_for(family, bin, SynthFormat::kTorchBin));
    const SynthResult s = synthesize(options_for(family, st, SynthFormat::kSafetensors));
    EXPECT_EQ(r.tensors, s.tensors);
    EXPECT_EQ(r.total_bytes, s.total_bytes);
    EXPECT_EQ(r.shards, s.shards);
    ASSERT_EQ(r.files.size(), s.files.size());
    EXPECT_EQ(r.files[r.shards], (bin / "pytorch_model.bin.index.json").string());
    for (const auto& f : r.files) {
      EXPECT_TRUE(fs::is_regular_file(f)) << f;
    }
    check_same_checkpoint(bin, st);
  }
}

TEST(SynthBin, QuantizedFusedAndF32CheckpointsToo) {
  TempDir dir;
  struct Case {
    std::string family;
    SynthQuant quant;
    DType dtype;
    bool fused;
  };
  for (const Case& c : {Case{"deepseek_v3", SynthQuant::kFp8Block, DType::kBF16, false},
                        Case{"llama", SynthQuant::kNvfp4, DType::kF32, false},
                        Case{"mixtral", SynthQuant::kNone, DType::kF16, true}}) {
    SCOPED_TRACE(c.family);
    for (SynthFormat format : {SynthFormat::kTorchBin, SynthFormat::kSafetensors}) {
      SynthOptions o =
          options_for(c.family, dir.path() / (c.family + std::string(to_string(format))), format);
      o.quant = c.quant;
      o.dtype = c.dtype;
      o.fused_experts = c.fused;
      o.seed = 11;
      synthesize(o);
    }
    check_same_checkpoint(dir.path() / (c.family + "bin"), dir.path() / (c.family + "safetensors"));
  }
}

TEST(SynthBin, SparseAndUnindexedFilesAreRefusedAndWriteNothing) {
  TempDir dir;
  SynthOptions sparse = options_for("llama", dir.path() / "sparse", SynthFormat::kTorchBin);
  sparse.sparse = true;
  try {
    synthesize(sparse);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_NE(e.rule().find("--sparse"), std::string::npos) << e.what();
    EXPECT_NE(e.rule().find("CRC-32"), std::string::npos) << e.what();
  }
  try {
    synthesize(options_for("glm4_moe", dir.path() / "glm", SynthFormat::kTorchBin));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_NE(e.rule().find("unindexed mtp.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(e.rule().find("--format bin"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(SynthBin, ForceReplacesACheckpointOfEitherFormat) {
  TempDir dir;
  const fs::path out = dir.path() / "ck";
  synthesize(options_for("llama", out, SynthFormat::kTorchBin));
  SynthOptions st = options_for("qwen2", out, SynthFormat::kSafetensors);
  EXPECT_THROW(synthesize(st), Error);  // not empty, no --force
  st.force = true;
  synthesize(st);
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(out / "pytorch_model.bin.index.json"));
  SynthOptions bin = options_for("llama", out, SynthFormat::kTorchBin);
  bin.force = true;
  synthesize(bin);  // *.bin, *.json and *.safetensors are all a checkpoint's
  EXPECT_TRUE(fs::exists(out / "pytorch_model.bin.index.json"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));
  check_same_checkpoint(out, [&] {
    const fs::path ref = dir.path() / "ref";
    synthesize(options_for("llama", ref, SynthFormat::kSafetensors));
    return ref;
  }());
}

TEST(SynthBin, CommandLineFormat) {
  TempDir dir;
  std::string out;
  std::string err;
  EXPECT_EQ(run_cli({"--help"}, &out), 0);
  EXPECT_NE(out.find("--format"), std::string::npos);
  EXPECT_NE(out.find("pytorch_model.bin.index.json"), std::string::npos);
  const std::string bin = dir.file("bin");
  ASSERT_EQ(run_cli({"--family=llama", "--preset=tiny", "--out", bin, "--format", "bin",
                     "--shard-bytes=256K", "--no-fsync"},
                    &out),
            0);
  EXPECT_NE(out.find("llama/tiny format bin seed 1"), std::string::npos) << out;
  const std::string st = dir.file("st");
  ASSERT_EQ(run_cli({"--family=llama", "--preset=tiny", "--out", st, "--format=safetensors",
                     "--shard-bytes=256K", "--no-fsync"}),
            0);
  check_same_checkpoint(bin, st);
  const std::string other = dir.file("other");
  EXPECT_EQ(
      run_cli({"--family=llama", "--preset=tiny", "--out", other, "--format", "pt"}, nullptr, &err),
      2);
  EXPECT_NE(err.find("--format: pt not in {safetensors,bin,gguf}"), std::string::npos) << err;
  // Refusals are failures of the run (exit 1 from main), naming the flag.
  try {
    run_cli({"--family=llama", "--preset=tiny", "--out", other, "--format=bin", "--sparse"});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(e.rule().find("--sparse cannot write .bin shards"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(other));
}

}  // namespace
}  // namespace ferry::synth
