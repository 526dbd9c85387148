// `ferry synth --quant Q`: the FP8 block layout (every quantized linear weight
// F8_E4M3, its F32 weight_scale_inv right after it, quantization_config in
// config.json), its values, and a real FP8 config kept (--sparse) or stripped
// (--dtype bf16); the compressed-tensors and ModelOpt layouts (their companions,
// quantization_config or hf_quant_config.json), each loaded by `ferry load`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/fp8.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::synth {
namespace {

using ferry::testing::run;
using ferry::testing::RunResult;
using ferry::testing::TempDir;
using nlohmann::json;
using ::testing::HasSubstr;

RunResult ferry(const std::vector<std::string>& args) {
  std::vector<std::string> argv{FERRY_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv);
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

// Every tensor of every shard: name -> (file, header entry, data start).
struct Entry {
  std::string file;
  json info;
  std::uint64_t data_start = 0;
};
std::map<std::string, Entry> entries(const std::string& dir) {
  std::map<std::string, Entry> out;
  const json index = read_json(dir + "/model.safetensors.index.json");
  std::map<std::string, bool> files;
  for (const auto& [name, file] : index.at("weight_map").items()) {
    files[file.get<std::string>()] = true;
  }
  for (const auto& [file, unused] : files) {
    std::ifstream in(dir + "/" + file, std::ios::binary);
    std::uint64_t len = 0;
    in.read(reinterpret_cast<char*>(&len), 8);
    std::string text(len, '\0');
    in.read(text.data(), static_cast<std::streamsize>(len));
    const json header = json::parse(text);
    for (const auto& [name, info] : header.items()) {
      if (name != "__metadata__") {
        out[name] = {dir + "/" + file, info, 8 + len};
      }
    }
  }
  return out;
}

TEST(SynthQuant, Fp8BlockWritesF8WeightsTheirScalesAndTheConfig) {
  TempDir dir;
  const std::string out = dir.file("q");
  RunResult r = ferry({"synth", "--family", "qwen3_moe", "--preset", "tiny", "--quant", "fp8-block",
                       "--quant-block", "16", "--out", out, "--no-fsync"});
  ASSERT_EQ(r.status, 0) << r.err;
  const json q = read_json(out + "/config.json").at("quantization_config");
  EXPECT_EQ(q.at("quant_method"), "fp8");
  EXPECT_EQ(q.at("activation_scheme"), "dynamic");
  EXPECT_EQ(q.at("weight_block_size"), json({16, 16}));
  const std::map<std::string, Entry> e = entries(out);
  std::size_t fp8 = 0;
  for (const auto& [name, entry] : e) {
    const std::string dtype = entry.info.at("dtype");
    const bool linear = (name.find("_proj.weight") != std::string::npos &&
                         name.compare(name.size() - 7, 7, ".weight") == 0);
    EXPECT_EQ(dtype == "F8_E4M3", linear) << name;
    if (!linear) {
      continue;
    }
    ++fp8;
    const auto& shape = entry.info.at("shape");
    const auto it = e.find(name + "_scale_inv");
    ASSERT_NE(it, e.end()) << name;
    EXPECT_EQ(it->second.info.at("dtype"), "F32");
    const std::uint64_t rows = shape[0], cols = shape[1];
    EXPECT_EQ(it->second.info.at("shape"), json({(rows + 15) / 16, (cols + 15) / 16})) << name;
  }
  EXPECT_GT(fp8, 0u);
  // The bytes: the E4M3 value nearest each synth value.
  const std::string w = "model.layers.0.self_attn.q_proj.weight";
  const Entry& entry = e.at(w);
  std::ifstream in(entry.file, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(entry.data_start +
                                       entry.info.at("data_offsets")[0].get<std::uint64_t>()));
  std::vector<char> bytes(64);
  in.read(bytes.data(), 64);
  for (std::uint64_t i = 0; i < 64; ++i) {
    EXPECT_EQ(static_cast<std::uint8_t>(bytes[i]), float_to_e4m3(synth_value(1, w, i))) << i;
  }
}

// Each other layout: the tensors beside every quantized weight (dtype and shape),
// where the settings go, and a load of the result at tp 2 (every param filled).
TEST(SynthQuant, EachLayoutWritesItsCompanionsAndLoads) {
  struct Want {
    std::string quant;
    std::string weight_dtype;
    std::map<std::string, std::pair<std::string, json>> companions;  // suffix -> dtype, shape
    bool hf_quant_config = false;
  };
  // q_proj of tiny llama: [128, 128].
  const std::vector<Want> wants{
      {"fp8-channel", "F8_E4M3", {{"weight_scale", {"F32", json({128, 1})}}}},
      {"fp8-tensor",
       "F8_E4M3",
       {{"weight_scale", {"F32", json::array()}}, {"input_scale", {"F32", json::array()}}}},
      {"modelopt-fp8",
       "F8_E4M3",
       {{"weight_scale", {"F32", json::array()}}, {"input_scale", {"F32", json::array()}}},
       true},
      {"nvfp4",
       "U8",
       {{"weight_scale", {"F8_E4M3", json({128, 8})}},
        {"weight_scale_2", {"F32", json::array()}},
        {"input_scale", {"F32", json::array()}}},
       true},
  };
  for (const Want& want : wants) {
    TempDir dir;
    const std::string out = dir.file("q");
    RunResult r = ferry({"synth", "--family", "llama", "--preset", "tiny", "--quant", want.quant,
                         "--out", out, "--no-fsync"});
    ASSERT_EQ(r.status, 0) << want.quant << ": " << r.err;
    const std::map<std::string, Entry> e = entries(out);
    const std::string w = "model.layers.0.self_attn.q_proj.";
    EXPECT_EQ(e.at(w + "weight").info.at("dtype"), want.weight_dtype) << want.quant;
    EXPECT_EQ(e.at(w + "weight").info.at("shape"), json({128, want.quant == "nvfp4" ? 64 : 128}))
        << want.quant;
    for (const auto& [suffix, dtype_shape] : want.companions) {
      ASSERT_EQ(e.count(w + suffix), 1u) << want.quant << " " << suffix;
      EXPECT_EQ(e.at(w + suffix).info.at("dtype"), dtype_shape.first) << want.quant << suffix;
      EXPECT_EQ(e.at(w + suffix).info.at("shape"), dtype_shape.second) << want.quant << suffix;
    }
    const json config = read_json(out + "/config.json");
    EXPECT_EQ(std::ifstream(out + "/hf_quant_config.json").good(), want.hf_quant_config)
        << want.quant;
    EXPECT_EQ(config.contains("quantization_config"), !want.hf_quant_config) << want.quant;
    if (want.quant == "modelopt-fp8") {
      EXPECT_EQ(e.count("model.layers.0.self_attn.k_proj.k_scale"), 1u);
      EXPECT_EQ(e.count("model.layers.0.self_attn.v_proj.v_scale"), 1u);
    }
    RunResult load = ferry({"load", "--model", out, "--tp", "2", "--set", "load.strict=true"});
    EXPECT_EQ(load.status, 0) << want.quant << ": " << load.err;
  }
}

TEST(SynthQuant, ARealFp8ConfigKeepsItsLayoutWhenSparseUnlessADtypeIsGiven) {
  FERRY_NEED_TEST_DATA();
  TempDir dir;
  const std::string cfg = ::ferry::testing::test_data_path("models/deepseek-v3/config.json");
  RunResult fp8 =
      ferry({"synth", "--from-config", cfg, "--sparse", "--out", dir.file("f"), "--no-fsync"});
  ASSERT_EQ(fp8.status, 0) << fp8.err;
  EXPECT_THAT(fp8.out, HasSubstr("91991 tensors"));
  EXPECT_EQ(read_json(dir.file("f/config.json")).at("quantization_config"),
            read_json(cfg).at("quantization_config"));
  RunResult bf16 = ferry({"synth", "--from-config", cfg, "--sparse", "--dtype", "bf16", "--out",
                          dir.file("b"), "--no-fsync"});
  ASSERT_EQ(bf16.status, 0) << bf16.err;
  EXPECT_THAT(bf16.out, HasSubstr("46183 tensors"));
  EXPECT_FALSE(read_json(dir.file("b/config.json")).contains("quantization_config"));
}

TEST(SynthQuant, BadQuantArgumentsAreRefused) {
  TempDir dir;
  RunResult r = ferry({"synth", "--family", "llama", "--preset", "tiny", "--quant", "int4", "--out",
                       dir.file("a")});
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.err, HasSubstr("--quant"));
  r = ferry({"synth", "--family", "llama", "--preset", "tiny", "--quant-block", "16", "--out",
             dir.file("b")});
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.err, HasSubstr("--quant-block needs --quant fp8-block"));
  r = ferry({"synth", "--family", "mixtral", "--preset", "tiny", "--quant", "fp8-block",
             "--fused-experts", "--out", dir.file("c")});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("fused 3-D experts"));
  std::vector<SynthTensor> bad{{"x.q_proj.weight", DType::kBF16, {4, 4, 4}}};
  EXPECT_THAT(ferry::testing::error_of(Stage::kSynth,
                                       [&] { synth_quantize(bad, SynthQuant::kFp8Block, 8); }),
              HasSubstr("2-D weights only"));
  EXPECT_THAT(ferry::testing::error_of(Stage::kSynth,
                                       [&] { synth_quantize(bad, SynthQuant::kFp8Block, 0); }),
              HasSubstr("block size must be positive"));
  std::vector<SynthTensor> odd{{"x.q_proj.weight", DType::kBF16, {16, 24}}};
  EXPECT_THAT(
      ferry::testing::error_of(Stage::kSynth, [&] { synth_quantize(odd, SynthQuant::kNvfp4, 0); }),
      HasSubstr("whole groups of 16"));
}

}  // namespace
}  // namespace ferry::synth
