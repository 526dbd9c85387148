// ferry synth at a real model's dimensions: the family and sizes read from the
// published config.json files of shared/data (tensor counts and name sets against the
// real checkpoints' indexes), every preset's config read back into its own tensor list,
// --sparse files (real headers over holes that read as zeros), --scale-dims (the real
// tensor set at a fraction of the width, plannable by `ferry plan`), and every bad input.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "io/safetensors.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::synth {
namespace {

namespace fs = std::filesystem;
using ferry::testing::read_file;
using ferry::testing::run;
using ferry::testing::RunResult;
using ferry::testing::TempDir;
using ferry::testing::write_file;
using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Shape = std::vector<std::uint64_t>;

std::string model_config(const std::string& model) {
  return ::ferry::testing::test_data_path("models/" + model + "/config.json");
}

json read_json(const std::string& path) {
  return json::parse(read_file(path));
}

std::map<std::string, SynthTensor> by_name(const std::vector<SynthTensor>& list) {
  std::map<std::string, SynthTensor> out;
  for (const auto& t : list) {
    out[t.name] = t;
  }
  return out;
}

Shape shape_of(const std::vector<SynthTensor>& list, const std::string& name) {
  for (const auto& t : list) {
    if (t.name == name) {
      return t.shape;
    }
  }
  ADD_FAILURE() << "no tensor " << name;
  return {};
}

std::uint64_t total_bytes(const std::vector<SynthTensor>& list) {
  std::uint64_t n = 0;
  for (const auto& t : list) {
    n += t.nbytes();
  }
  return n;
}

// The message of the ferry::Error(Stage::kSynth) `f` must throw.
template <typename F>
std::string error_of(F&& f) {
  return ferry::testing::error_of(Stage::kSynth, std::forward<F>(f));
}

RunResult ferry(const std::vector<std::string>& args) {
  std::vector<std::string> argv{FERRY_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv);
}

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// `n` bytes at `offset` of the file at `path`.
std::string pread_bytes(const std::string& path, std::uint64_t offset, std::size_t n) {
  std::string out(n, '\x7f');
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    ADD_FAILURE() << "cannot open " << path;
    return out;
  }
  ssize_t got = ::pread(fd, out.data(), n, static_cast<off_t>(offset));
  ::close(fd);
  EXPECT_EQ(got, static_cast<ssize_t>(n)) << path << " at " << offset;
  return out;
}

SynthOptions options_for(const std::string& config, const std::string& out) {
  SynthOptions o;
  o.from_config = config;
  o.out = out;
  o.fsync = false;
  return o;
}

// ---- family detection and tensor counts ----------------------------------------

TEST(SynthFromConfig, DetectsTheFamilyOfEveryRealConfig) {
  FERRY_NEED_TEST_DATA();
  const std::map<std::string, std::string> want{
      {"deepseek-v3", "deepseek_v3"},   {"deepseek-v3-base", "deepseek_v3"},
      {"llama-3.1-8b", "llama"},        {"llama-3.2-3b-instruct", "llama"},
      {"llama3-chinese-8b", "llama"},   {"mistral-7b-instruct-v0.3", "mistral"},
      {"mixtral-8x7b-v0.1", "mixtral"}, {"qwen2.5-7b", "qwen2"},
      {"qwen3-30b-a3b", "qwen3_moe"},   {"qwen3-30b-a3b-fp8", "qwen3_moe"},
      {"sakura-14b-qwen2.5", "qwen2"},
  };
  std::set<std::string> seen;
  for (const auto& entry : fs::directory_iterator(::ferry::testing::test_data_path("models"))) {
    std::string model = entry.path().filename().string();
    if (!fs::exists(entry.path() / "config.json")) {
      continue;
    }
    SCOPED_TRACE(model);
    ASSERT_TRUE(want.count(model)) << "a new model in shared/data: add it to this table";
    SynthSource s = read_synth_source(model_config(model));
    EXPECT_EQ(s.family, want.at(model));
    EXPECT_EQ(s.hidden_size, read_json(model_config(model))["hidden_size"].get<std::uint64_t>());
    EXPECT_EQ(s.file, model_config(model));
    seen.insert(model);
  }
  EXPECT_EQ(seen.size(), want.size());
}

TEST(SynthFromConfig, DeepseekV3HasTheRealCheckpointsTensorCount) {
  FERRY_NEED_TEST_DATA();
  for (const char* model : {"deepseek-v3", "deepseek-v3-base"}) {
    SCOPED_TRACE(model);
    std::vector<SynthTensor> list =
        synth_tensor_list(read_synth_source(model_config(model)), DType::kBF16);
    // 61 layers (3 dense) and the MTP layer 61, 256 routed experts and 1 shared.
    EXPECT_EQ(list.size(), 46183u);
    auto names = by_name(list);
    EXPECT_EQ(names.size(), list.size()) << "a name listed twice";
    EXPECT_TRUE(names.count("model.layers.2.mlp.gate_proj.weight"));
    EXPECT_FALSE(names.count("model.layers.3.mlp.gate_proj.weight"));
    EXPECT_TRUE(names.count("model.layers.3.mlp.experts.255.down_proj.weight"));
    EXPECT_FALSE(names.count("model.layers.3.mlp.experts.256.down_proj.weight"));
    EXPECT_TRUE(names.count("model.layers.60.mlp.shared_experts.up_proj.weight"));
    EXPECT_TRUE(names.count("model.layers.61.eh_proj.weight"));
    EXPECT_TRUE(names.count("model.layers.61.shared_head.head.weight"));
    EXPECT_TRUE(names.count("model.layers.61.mlp.experts.255.gate_proj.weight"));
    EXPECT_FALSE(names.count("model.layers.62.input_layernorm.weight"));
    EXPECT_TRUE(names.count("lm_head.weight"));
    // The real shapes (BF16 DeepSeek-V3).
    EXPECT_EQ(shape_of(list, "model.embed_tokens.weight"), (Shape{129280, 7168}));
    EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.q_a_proj.weight"), (Shape{1536, 7168}));
    EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.q_b_proj.weight"), (Shape{128 * 192, 1536}));
    EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
              (Shape{576, 7168}));
    EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.kv_b_proj.weight"), (Shape{128 * 256, 512}));
    EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.o_proj.weight"), (Shape{7168, 128 * 128}));
    EXPECT_EQ(shape_of(list, "model.layers.0.mlp.down_proj.weight"), (Shape{7168, 18432}));
    EXPECT_EQ(shape_of(list, "model.layers.3.mlp.experts.0.down_proj.weight"), (Shape{7168, 2048}));
    EXPECT_EQ(names.at("model.layers.3.mlp.gate.e_score_correction_bias").dtype, DType::kF32);
    EXPECT_EQ(total_bytes(list), 1368979721216u);  // about 1.37 TB in BF16
  }
}

TEST(SynthFromConfig, DenseAndMoeCountsFollowTheirConfigs) {
  FERRY_NEED_TEST_DATA();
  // Llama-3.1-8B: embed, 32 layers of 9, norm, lm_head.
  EXPECT_EQ(synth_tensor_list(read_synth_source(model_config("llama-3.1-8b")), DType::kBF16).size(),
            1u + 32 * 9 + 2);
  // Qwen2.5-7B: q/k/v biases, so 12 per layer.
  EXPECT_EQ(synth_tensor_list(read_synth_source(model_config("qwen2.5-7b")), DType::kBF16).size(),
            1u + 28 * 12 + 2);
  // Qwen3-30B-A3B: 4 projections, 2 q/k norms, router, 128 experts of 3, 2 norms.
  for (const char* model : {"qwen3-30b-a3b", "qwen3-30b-a3b-fp8"}) {
    std::vector<SynthTensor> list =
        synth_tensor_list(read_synth_source(model_config(model)), DType::kBF16);
    EXPECT_EQ(list.size(), 1u + 48 * (4 + 2 + 1 + 128 * 3 + 2) + 2) << model;
    EXPECT_EQ(shape_of(list, "model.layers.47.self_attn.q_proj.weight"), (Shape{32 * 128, 2048}));
    EXPECT_EQ(shape_of(list, "model.layers.0.mlp.experts.127.up_proj.weight"), (Shape{768, 2048}));
  }
}

// The synthesized name set is the real index's, and at two bytes per element the
// data adds up to its total_size.
TEST(SynthFromConfig, NamesEqualTheRealIndex) {
  FERRY_NEED_TEST_DATA();
  for (const char* model : {"llama-3.2-3b-instruct", "llama3-chinese-8b", "mixtral-8x7b-v0.1",
                            "mistral-7b-instruct-v0.3", "sakura-14b-qwen2.5"}) {
    SCOPED_TRACE(model);
    json index = read_json(::ferry::testing::test_data_path(std::string("models/") + model +
                                                            "/model.safetensors.index.json"));
    std::set<std::string> want;
    for (const auto& [name, file] : index["weight_map"].items()) {
      want.insert(name);
    }
    std::vector<SynthTensor> list =
        synth_tensor_list(read_synth_source(model_config(model)), DType::kBF16);
    std::set<std::string> got;
    for (const auto& t : list) {
      got.insert(t.name);
      EXPECT_TRUE(t.file.empty()) << t.name;
    }
    EXPECT_EQ(got, want);
    EXPECT_EQ(got.size(), list.size());
    EXPECT_EQ(total_bytes(list), index["metadata"]["total_size"].get<std::uint64_t>());
  }
}

// Every preset's own config.json, read back as a source, gives the preset's tensors:
// the field reading agrees with what the presets write, for every family.
TEST(SynthFromConfig, EveryPresetsConfigGivesThePresetsTensors) {
  for (const std::string& family : synth_families()) {
    for (const std::string& preset : synth_presets()) {
      for (bool tied : {false, true}) {
        for (bool fused : {false, true}) {
          if (fused && !synth_family_has_experts(family)) {
            continue;
          }
          SCOPED_TRACE(family + "/" + preset + (tied ? " tied" : "") + (fused ? " fused" : ""));
          SynthSource s =
              synth_source(synth_config(family, preset, DType::kF16, tied), "preset.json");
          EXPECT_EQ(s.family, family);
          std::vector<SynthTensor> want =
              synth_tensor_list(family, preset, DType::kF16, tied, fused);
          std::vector<SynthTensor> got = synth_tensor_list(s, DType::kF16, 0, fused);
          ASSERT_EQ(got.size(), want.size());
          for (std::size_t i = 0; i < got.size(); ++i) {
            EXPECT_EQ(got[i].name, want[i].name);
            EXPECT_EQ(got[i].shape, want[i].shape) << got[i].name;
            EXPECT_EQ(got[i].dtype, want[i].dtype) << got[i].name;
            EXPECT_EQ(got[i].file, want[i].file) << got[i].name;
          }
        }
      }
    }
  }
}

TEST(SynthFromConfig, MtpLayerQkNormAndTiesFollowTheConfig) {
  json v3 = synth_config("deepseek_v3", "tiny", DType::kBF16, false);
  v3["num_nextn_predict_layers"] = 0;
  auto names = by_name(synth_tensor_list(synth_source(v3, "v3.json"), DType::kBF16));
  EXPECT_FALSE(names.count("model.layers.2.eh_proj.weight"));
  v3.erase("num_nextn_predict_layers");  // absent: no MTP layer, as ferry's models read it
  EXPECT_FALSE(by_name(synth_tensor_list(synth_source(v3, "v3.json"), DType::kBF16))
                   .count("model.layers.2.eh_proj.weight"));

  json glm = synth_config("glm4_moe", "tiny", DType::kBF16, false);
  glm["use_qk_norm"] = true;  // GLM-4.5 (not -Air)
  names = by_name(synth_tensor_list(synth_source(glm, "glm.json"), DType::kBF16));
  EXPECT_EQ(names.at("model.layers.0.self_attn.q_norm.weight").shape, Shape{32});
  EXPECT_EQ(names.at("model.layers.2.self_attn.k_norm.weight").file, kSynthMtpFile);
  glm["num_nextn_predict_layers"] = 0;
  for (const auto& t : synth_tensor_list(synth_source(glm, "glm.json"), DType::kBF16)) {
    EXPECT_TRUE(t.file.empty()) << t.name;
  }

  json llama = synth_config("llama", "tiny", DType::kBF16, false);
  llama["tie_word_embeddings"] = true;
  EXPECT_FALSE(by_name(synth_tensor_list(synth_source(llama, "l.json"), DType::kBF16))
                   .count("lm_head.weight"));
  llama.erase("head_dim");             // default hidden / heads
  llama.erase("num_key_value_heads");  // default heads
  names = by_name(synth_tensor_list(synth_source(llama, "l.json"), DType::kBF16));
  EXPECT_EQ(names.at("model.layers.0.self_attn.k_proj.weight").shape, (Shape{128, 128}));
}

// ---- config.json -----------------------------------------------------------------

TEST(SynthFromConfig, WrittenConfigIsTheSourceLessQuantization) {
  FERRY_NEED_TEST_DATA();
  for (const char* model : {"deepseek-v3", "qwen3-30b-a3b-fp8", "llama3-chinese-8b"}) {
    SCOPED_TRACE(model);
    json source = read_json(model_config(model));
    json got = synth_config(read_synth_source(model_config(model)), DType::kF32);
    EXPECT_FALSE(got.contains("quantization_config"));
    EXPECT_EQ(got["torch_dtype"], "float32");
    for (const auto& [key, value] : source.items()) {
      if (key != "quantization_config" && key != "torch_dtype") {
        EXPECT_EQ(got[key], value) << key;
      }
    }
    EXPECT_EQ(got.size(), source.size() - (source.contains("quantization_config") ? 1 : 0));
  }
  // The newer spelling of torch_dtype is kept in step.
  json c = synth_config("qwen2", "tiny", DType::kBF16, false);
  c["dtype"] = "float32";
  json got = synth_config(synth_source(c, "c.json"), DType::kF16);
  EXPECT_EQ(got["dtype"], "float16");
  EXPECT_EQ(got["torch_dtype"], "float16");
}

// ---- --scale-dims ------------------------------------------------------------------

TEST(SynthScaleDims, WidthsScaleRoundUpToEightAndAtLeastEight) {
  EXPECT_EQ(synth_scaled_width(18432, 7168, 64), 168u);  // 164.6 -> 165 -> 168
  EXPECT_EQ(synth_scaled_width(2048, 7168, 64), 24u);    // 18.3
  EXPECT_EQ(synth_scaled_width(1536, 7168, 64), 16u);    // 13.7
  EXPECT_EQ(synth_scaled_width(64, 7168, 64), 8u);       // 0.6, at least 8
  EXPECT_EQ(synth_scaled_width(14336, 4096, 64), 224u);  // exact: 224
  EXPECT_EQ(synth_scaled_width(128, 4096, 1024), 32u);   // exact: 32
  EXPECT_EQ(synth_scaled_width(0, 4096, 64), 0u);        // absent stays absent
}

TEST(SynthScaleDims, DeepseekV3KeepsEveryTensorAtAFractionOfTheWidth) {
  FERRY_NEED_TEST_DATA();
  SynthSource s = read_synth_source(model_config("deepseek-v3"));
  std::vector<SynthTensor> list = synth_tensor_list(s, DType::kBF16, 64);
  EXPECT_EQ(list.size(), 46183u);
  // hidden 64; intermediate 168, moe 24, q_lora 16, kv_lora 8, qk_nope 8, qk_rope 8,
  // v_head 8; 128 heads, 256 experts and the vocabulary stay.
  EXPECT_EQ(shape_of(list, "model.embed_tokens.weight"), (Shape{129280, 64}));
  EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.q_a_proj.weight"), (Shape{16, 64}));
  EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.q_b_proj.weight"), (Shape{128 * 16, 16}));
  EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), (Shape{16, 64}));
  EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.kv_b_proj.weight"), (Shape{128 * 16, 8}));
  EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.o_proj.weight"), (Shape{64, 128 * 8}));
  EXPECT_EQ(shape_of(list, "model.layers.0.mlp.up_proj.weight"), (Shape{168, 64}));
  EXPECT_EQ(shape_of(list, "model.layers.3.mlp.experts.255.down_proj.weight"), (Shape{64, 24}));
  EXPECT_EQ(shape_of(list, "model.layers.3.mlp.gate.weight"), (Shape{256, 64}));
  EXPECT_EQ(shape_of(list, "model.layers.61.eh_proj.weight"), (Shape{64, 128}));
  std::uint64_t bytes = total_bytes(list);
  EXPECT_GT(bytes, std::uint64_t{150} << 20);
  EXPECT_LT(bytes, std::uint64_t{250} << 20);

  json c = synth_config(s, DType::kBF16, 64);
  EXPECT_EQ(c["hidden_size"], 64);
  EXPECT_EQ(c["intermediate_size"], 168);
  EXPECT_EQ(c["moe_intermediate_size"], 24);
  EXPECT_EQ(c["q_lora_rank"], 16);
  EXPECT_EQ(c["kv_lora_rank"], 8);
  EXPECT_EQ(c["qk_nope_head_dim"], 8);
  EXPECT_EQ(c["qk_rope_head_dim"], 8);
  EXPECT_EQ(c["v_head_dim"], 8);
  EXPECT_EQ(c["num_attention_heads"], 128);
  EXPECT_EQ(c["n_routed_experts"], 256);
  EXPECT_EQ(c["vocab_size"], 129280);
  EXPECT_FALSE(c.contains("head_dim"));  // MLA has none
  EXPECT_FALSE(c.contains("quantization_config"));
  // The written config is a source of its own with the same tensors.
  std::vector<SynthTensor> again = synth_tensor_list(synth_source(c, "scaled.json"), DType::kBF16);
  ASSERT_EQ(again.size(), list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    ASSERT_EQ(again[i].name, list[i].name);
    ASSERT_EQ(again[i].shape, list[i].shape) << list[i].name;
  }
}

TEST(SynthScaleDims, GroupedQueryConfigsGetAnExplicitHeadDim) {
  FERRY_NEED_TEST_DATA();
  SynthSource s = read_synth_source(model_config("llama-3.1-8b"));  // no head_dim field
  json c = synth_config(s, DType::kBF16, 64);
  EXPECT_EQ(c["hidden_size"], 64);
  EXPECT_EQ(c["intermediate_size"], 224);
  EXPECT_EQ(c["head_dim"], 8);  // 128 / 64, at least 8 (hidden / heads would be 2)
  EXPECT_EQ(c["num_attention_heads"], 32);
  EXPECT_EQ(c["num_key_value_heads"], 8);
  std::vector<SynthTensor> list = synth_tensor_list(s, DType::kBF16, 64);
  EXPECT_EQ(list.size(), 291u);
  EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.q_proj.weight"), (Shape{32 * 8, 64}));
  EXPECT_EQ(shape_of(list, "model.layers.0.self_attn.k_proj.weight"), (Shape{8 * 8, 64}));
  EXPECT_EQ(shape_of(list, "model.layers.0.mlp.down_proj.weight"), (Shape{64, 224}));
  EXPECT_EQ(shape_of(list, "lm_head.weight"), (Shape{128256, 64}));
}

// A scaled Mixtral written with real values: headers parse, shapes as scaled, values
// are synth_value's, and `ferry plan` routes every tensor with tp 8 and ep 8.
TEST(SynthScaleDims, WritesRealValuesThatFerryPlans) {
  FERRY_NEED_TEST_DATA();
  TempDir dir;
  SynthOptions o = options_for(model_config("mixtral-8x7b-v0.1"), dir.file("mixtral"));
  o.scale_hidden = 32;
  o.seed = 7;
  SynthResult r = synthesize(o);
  EXPECT_EQ(r.family, "mixtral");
  EXPECT_EQ(r.tensors, 995u);

  json c = read_json(dir.file("mixtral/config.json"));
  EXPECT_EQ(c["hidden_size"], 32);
  EXPECT_EQ(c["intermediate_size"], 112);  // 14336 / 128
  EXPECT_EQ(c["head_dim"], 8);             // 128 / 128, at least 8
  EXPECT_EQ(c["num_local_experts"], 8);
  EXPECT_EQ(c["torch_dtype"], "bfloat16");

  json index = read_json(dir.file("mixtral/model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"].size(), 995u);
  EXPECT_EQ(index["metadata"]["total_size"].get<std::uint64_t>(), r.total_bytes);
  std::size_t checked = 0;
  for (const std::string& file : r.files) {
    if (!file.ends_with(".safetensors")) {
      continue;
    }
    io::SafetensorsHeader h = io::read_safetensors_header(file, file);
    for (const io::TensorInfo& t : h.tensors) {
      if (t.name == "model.layers.31.block_sparse_moe.experts.7.w2.weight") {
        EXPECT_EQ(t.shape, (Shape{32, 112}));
      }
      if (t.name == "model.layers.0.self_attn.q_proj.weight") {
        EXPECT_EQ(t.shape, (Shape{32 * 8, 32}));
      }
      std::uint64_t n = t.elements();
      for (std::uint64_t i : {std::uint64_t{0}, n / 3, n - 1}) {
        std::string b = pread_bytes(file, t.offset + 2 * i, 2);
        auto bits = static_cast<std::uint16_t>(static_cast<unsigned char>(b[0]) |
                                               (static_cast<unsigned char>(b[1]) << 8));
        ASSERT_EQ(bf16_to_float(bits), synth_value(7, t.name, i)) << t.name << "[" << i << "]";
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 995u);

  RunResult plan = ferry(
      {"plan", "--model", dir.file("mixtral"), "--tp", "8", "--ep", "8", "--ranks", "0", "--json"});
  ASSERT_EQ(plan.status, 0) << plan.err;
  json p = json::parse(plan.out);
  ASSERT_EQ(p["tensors"].size(), 995u);
  for (const auto& t : p["tensors"]) {
    EXPECT_NE(t["route"], "unmapped") << t["name"];
  }
  EXPECT_EQ(p["totals"]["checkpoint_bytes"].get<std::uint64_t>(), r.total_bytes);
}

// DeepSeek-V3 at hidden 64 plans (headers only, so written sparse to stay fast, and in
// small shards: the header writer's time grows with the square of a file's tensors).
TEST(SynthScaleDims, ScaledDeepseekV3IsPlannable) {
  FERRY_NEED_TEST_DATA();
  TempDir dir;
  SynthOptions o = options_for(model_config("deepseek-v3"), dir.file("v3"));
  o.scale_hidden = 64;
  o.sparse = true;
  o.shard_bytes = std::uint64_t{16} << 20;
  SynthResult r = synthesize(o);
  EXPECT_EQ(r.tensors, 46183u);
  RunResult plan = ferry(
      {"plan", "--model", dir.file("v3"), "--tp", "8", "--ep", "8", "--ranks", "0", "--json"});
  ASSERT_EQ(plan.status, 0) << plan.err;
  json p = json::parse(plan.out);
  EXPECT_EQ(p["tensors"].size(), 46183u);
  std::size_t placed = 0;
  for (const auto& t : p["tensors"]) {
    EXPECT_NE(t["route"], "unmapped") << t["name"];
    placed += t["route"] == "placed" ? 1 : 0;
  }
  EXPECT_GT(placed, 0u);
  EXPECT_EQ(p["totals"]["checkpoint_bytes"].get<std::uint64_t>(), r.total_bytes);
}

// ---- --sparse ----------------------------------------------------------------------

// Each shard: a header ferry's reader accepts, the size it promises, zeros everywhere
// in the data region, and next to no disk.
void expect_sparse_shards(const SynthResult& r) {
  std::size_t shards = 0;
  for (const std::string& file : r.files) {
    if (!file.ends_with(".safetensors")) {
      continue;
    }
    SCOPED_TRACE(file);
    ++shards;
    io::SafetensorsHeader h = io::read_safetensors_header(file, file);
    std::uint64_t data = 0;
    for (const io::TensorInfo& t : h.tensors) {
      data += t.nbytes;
    }
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0);
    EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), h.header_bytes + data);
    EXPECT_EQ(h.file_size, h.header_bytes + data);
    EXPECT_THAT(h.metadata.at("ferry_synth"), HasSubstr("sparse"));
    if (data >= (std::uint64_t{64} << 20)) {
      // Holes: what the disk holds is the header, not the data.
      EXPECT_LT(static_cast<std::uint64_t>(st.st_blocks) * 512, std::uint64_t{4} << 20)
          << st.st_blocks << " blocks for " << st.st_size << " bytes";
    }
    const std::uint64_t n = std::min<std::uint64_t>(64, data);
    for (std::uint64_t at :
         {h.header_bytes, h.header_bytes + data / 2, h.header_bytes + data - n}) {
      EXPECT_EQ(pread_bytes(file, at, n), std::string(n, '\0')) << "at " << at;
    }
  }
  EXPECT_EQ(shards, r.shards);
}

TEST(SynthSparse, Llama32HasRealHeadersOverHoles) {
  FERRY_NEED_TEST_DATA();
  TempDir dir;
  SynthOptions o = options_for(model_config("llama-3.2-3b-instruct"), dir.file("llama"));
  o.sparse = true;
  o.fsync = true;  // cheap for a sparse file
  SynthResult r = synthesize(o);
  // Tied, 28 layers: 6.4 GB, two shards at the 5 GiB default.
  EXPECT_EQ(r.tensors, 254u);
  EXPECT_EQ(r.shards, 2u);
  EXPECT_EQ(r.total_bytes, 6425499648u);
  expect_sparse_shards(r);
  json index = read_json(dir.file("llama/model.safetensors.index.json"));
  json real = read_json(::ferry::testing::test_data_path(
      "models/llama-3.2-3b-instruct/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], real["metadata"]["total_size"]);
  std::set<std::string> got;
  std::set<std::string> want;
  for (const auto& [name, file] : index["weight_map"].items()) {
    got.insert(name);
  }
  for (const auto& [name, file] : real["weight_map"].items()) {
    want.insert(name);
  }
  EXPECT_EQ(got, want);  // tied: no lm_head.weight
}

TEST(SynthSparse, PresetsCanBeSparseToo) {
  TempDir dir;
  SynthOptions o;
  o.family = "glm4_moe";  // its unindexed mtp.safetensors is sparse as well
  o.preset = "tiny";
  o.out = dir.file("glm");
  o.sparse = true;
  o.fsync = false;
  SynthResult r = synthesize(o);
  EXPECT_EQ(r.tensors, synth_tensor_list("glm4_moe", "tiny", DType::kBF16, false).size());
  expect_sparse_shards(r);
  EXPECT_TRUE(fs::exists(dir.file(std::string("glm/") + kSynthMtpFile)));
  // The index is written as usual.
  json index = read_json(dir.file("glm/model.safetensors.index.json"));
  std::uint64_t indexed = 0;
  for (const auto& t : synth_tensor_list("glm4_moe", "tiny", DType::kBF16, false)) {
    indexed += t.file.empty() ? t.nbytes() : 0;
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<std::uint64_t>(), indexed);
}

TEST(SynthSparse, FullSizeDeepseekV3InSeconds) {
  FERRY_NEED_TEST_DATA();
  TempDir dir;
  SynthOptions o = options_for(model_config("deepseek-v3"), dir.file("v3"));
  o.sparse = true;
  auto start = std::chrono::steady_clock::now();
  SynthResult r = synthesize(o);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Writing 1.37 TB would take hours and fill the disk; holes take about a second.
  EXPECT_LT(seconds, 60.0);
  EXPECT_EQ(r.tensors, 46183u);
  EXPECT_EQ(r.total_bytes, 1368979721216u);
  EXPECT_EQ(r.shards, 257u);  // ceil-ish of 1.37 TB / 5 GiB, tensors never split
  json index = read_json(dir.file("v3/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"].get<std::uint64_t>(), 1368979721216u);
  EXPECT_EQ(index["weight_map"].size(), 46183u);
  std::uint64_t apparent = 0;
  std::uint64_t on_disk = 0;
  std::size_t shards = 0;
  for (const auto& entry : fs::directory_iterator(dir.file("v3"))) {
    if (entry.path().extension() != ".safetensors") {
      continue;
    }
    struct stat st {};
    ASSERT_EQ(::stat(entry.path().c_str(), &st), 0);
    apparent += static_cast<std::uint64_t>(st.st_size);
    on_disk += static_cast<std::uint64_t>(st.st_blocks) * 512;
    ++shards;
  }
  EXPECT_EQ(shards, 257u);
  EXPECT_GT(apparent, 1368979721216u);  // data plus the headers
  EXPECT_LT(on_disk, std::uint64_t{64} << 20);
  // Spot-check one shard in full.
  io::SafetensorsHeader h = io::read_safetensors_header(
      dir.file("v3/model-00100-of-00257.safetensors"), "model-00100-of-00257.safetensors");
  EXPECT_FALSE(h.tensors.empty());
  EXPECT_EQ(h.file_size, fs::file_size(dir.file("v3/model-00100-of-00257.safetensors")));
}

// ---- errors ------------------------------------------------------------------------

TEST(SynthFromConfigErrors, BadFilesNameTheFile) {
  TempDir dir;
  EXPECT_THAT(error_of([&] { read_synth_source(dir.file("missing.json")); }),
              AllOf(HasSubstr(dir.file("missing.json")), HasSubstr("does not exist")));
  write_file(dir.file("bad.json"), "{\"architectures\": [");
  EXPECT_THAT(error_of([&] { read_synth_source(dir.file("bad.json")); }),
              AllOf(HasSubstr(dir.file("bad.json")), HasSubstr("not valid JSON")));
  // A number beyond a double is nlohmann's out_of_range, not parse_error: still
  // a synth error naming the file (it escaped as another exception before).
  write_file(dir.file("huge.json"), "{\"hidden_size\": 1e400}");
  EXPECT_THAT(error_of([&] { read_synth_source(dir.file("huge.json")); }),
              AllOf(HasSubstr(dir.file("huge.json")), HasSubstr("not valid JSON"),
                    HasSubstr("number overflow")));
  write_file(dir.file("array.json"), "[1, 2]");
  EXPECT_THAT(error_of([&] { read_synth_source(dir.file("array.json")); }),
              AllOf(HasSubstr(dir.file("array.json")), HasSubstr("JSON object")));
  EXPECT_THAT(error_of([&] { read_synth_source(dir.str()); }),
              AllOf(HasSubstr(dir.str()), HasSubstr("not a regular file")));

  json gpt2 = {{"architectures", {"GPT2LMHeadModel"}}, {"hidden_size", 768}};
  EXPECT_THAT(error_of([&] { synth_source(gpt2, "gpt2/config.json"); }),
              AllOf(HasSubstr("gpt2/config.json"), HasSubstr("GPT2LMHeadModel"),
                    HasSubstr("LlamaForCausalLM")));
  for (json arch : {json(nullptr), json::array(), json("LlamaForCausalLM"), json::array({1})}) {
    json c = synth_config("llama", "tiny", DType::kBF16, false);
    c["architectures"] = arch;
    EXPECT_THAT(error_of([&] { synth_source(c, "c.json"); }),
                AllOf(HasSubstr("c.json"), HasSubstr("'architectures'")))
        << arch.dump();
  }
}

// Values the family's tensor list cannot express are refused, naming file and field.
TEST(SynthFromConfigErrors, UnsupportedValuesNameTheField) {
  struct Case {
    std::string family;
    std::string field;
    json value;  // null: erase the field
  };
  const std::vector<Case> cases{
      {"qwen3_moe", "mlp_only_layers", json::array({1})},
      {"qwen3_moe", "mlp_only_layers", "all"},
      {"qwen3_moe", "decoder_sparse_step", 2},
      {"qwen3_moe", "attention_bias", true},
      {"qwen2_moe", "mlp_only_layers", json::array({0, 3})},
      {"qwen2_moe", "decoder_sparse_step", 2},
      {"qwen2_moe", "shared_expert_intermediate_size", 0},
      {"deepseek_v3", "moe_layer_freq", 2},
      {"deepseek_v3", "num_nextn_predict_layers", 2},
      {"deepseek_v3", "topk_method", "greedy"},
      {"deepseek_v3", "attention_bias", true},
      {"deepseek_v3", "n_shared_experts", 0},
      {"deepseek_v3", "n_routed_experts", nullptr},
      {"deepseek_v3", "kv_lora_rank", nullptr},
      {"deepseek_v2", "num_nextn_predict_layers", 1},
      {"deepseek_v2", "topk_method", "noaux_tc"},
      {"deepseek_v2", "moe_layer_freq", 3},
      {"glm4_moe", "attention_bias", false},
      {"glm4_moe", "attention_bias", nullptr},
      {"glm4_moe", "num_nextn_predict_layers", 2},
      {"llama", "attention_bias", true},
      {"llama", "mlp_bias", true},
      {"llama", "hidden_size", nullptr},
      {"llama", "hidden_size", 0},
      {"llama", "hidden_size", -128},
      {"llama", "hidden_size", 128.5},
      {"llama", "hidden_size", "128"},
      {"llama", "tie_word_embeddings", "yes"},
      {"mistral", "vocab_size", nullptr},
      {"mixtral", "num_local_experts", nullptr},
      {"qwen2", "num_attention_heads", 0},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.family + " " + k.field + " = " + k.value.dump());
    json c = synth_config(k.family, "tiny", DType::kBF16, false);
    if (k.value.is_null()) {
      c.erase(k.field);
    } else {
      c[k.field] = k.value;
    }
    EXPECT_THAT(error_of([&] { synth_source(c, "models/x/config.json"); }),
                AllOf(HasSubstr("models/x/config.json"), HasSubstr("'" + k.field + "'")));
  }
  // head_dim absent and hidden / heads not whole.
  json c = synth_config("qwen2", "tiny", DType::kBF16, false);
  c["num_attention_heads"] = 3;
  c["num_key_value_heads"] = 3;
  EXPECT_THAT(error_of([&] { synth_source(c, "q.json"); }),
              AllOf(HasSubstr("q.json"), HasSubstr("there is no head_dim field")));
  // A source edited after synth_source checked it: its file is still named.
  SynthSource edited = synth_source(synth_config("llama", "tiny", DType::kBF16, false), "e.json");
  edited.config["tie_word_embeddings"] = "yes";
  EXPECT_THAT(error_of([&] { synth_tensor_list(edited, DType::kBF16); }),
              AllOf(HasSubstr("e.json"), HasSubstr("'tie_word_embeddings'")));
}

TEST(SynthFromConfigErrors, ScaleDimsMustBeAMultipleOfEightBelowHidden) {
  SynthSource s = synth_source(synth_config("llama", "small", DType::kBF16, false), "s.json");
  for (std::uint64_t h : {std::uint64_t{60}, std::uint64_t{512}, std::uint64_t{1024}}) {
    EXPECT_THAT(error_of([&] { synth_tensor_list(s, DType::kBF16, h); }),
                AllOf(HasSubstr("s.json"), HasSubstr("--scale-dims"), HasSubstr("512")))
        << h;
    EXPECT_THAT(error_of([&] { synth_config(s, DType::kBF16, h); }), HasSubstr("--scale-dims"));
  }
  EXPECT_NO_THROW(synth_tensor_list(s, DType::kBF16, 504));
}

TEST(SynthFromConfigErrors, SynthesizeRefusesMixedWays) {
  FERRY_NEED_TEST_DATA();
  TempDir dir;
  SynthOptions o = options_for(model_config("llama-3.1-8b"), dir.file("out"));
  o.family = "llama";
  o.preset = "tiny";
  EXPECT_THAT(error_of([&] { synthesize(o); }), HasSubstr("one or the other"));
  o = options_for(model_config("llama-3.1-8b"), dir.file("out"));
  o.tie_embeddings = true;
  EXPECT_THAT(error_of([&] { synthesize(o); }), HasSubstr("tie_word_embeddings"));
  SynthOptions p;
  p.family = "llama";
  p.preset = "tiny";
  p.out = dir.file("out");
  p.scale_hidden = 64;
  EXPECT_THAT(error_of([&] { synthesize(p); }), HasSubstr("--from-config"));
  EXPECT_FALSE(fs::exists(dir.file("out")));
}

// ---- the command line ----------------------------------------------------------------

TEST(SynthFromConfigCli, HelpListsTheNewFlags) {
  RunResult r = ferry({"synth", "--help"});
  ASSERT_EQ(r.status, 0);
  for (const char* flag :
       {"--from-config", "--scale-dims", "--sparse", "DeepseekV3ForCausalLM", "5G", "zeros"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
}

TEST(SynthFromConfigCli, WritesAScaledCheckpoint) {
  FERRY_NEED_TEST_DATA();
  TempDir dir;
  RunResult r = ferry({"synth", "--from-config", model_config("llama-3.2-3b-instruct"), "--out",
                       dir.file("l"), "--scale-dims", "16", "--dtype", "f16", "--no-fsync"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("llama from "), HasSubstr("scaled to hidden 16"),
                           HasSubstr("254 tensors")));
  json c = read_json(dir.file("l/config.json"));
  EXPECT_EQ(c["hidden_size"], 16);
  EXPECT_EQ(c["torch_dtype"], "float16");
  EXPECT_EQ(c["tie_word_embeddings"], true);
}

TEST(SynthFromConfigCli, UsageErrorsExitTwo) {
  FERRY_NEED_TEST_DATA();
  TempDir dir;
  const std::string llama = model_config("llama-3.1-8b");
  const std::string out = dir.file("out");
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases{
      {{"--out", out}, "--from-config"},
      {{"--from-config", llama, "--family", "llama", "--out", out}, "--from-config"},
      {{"--from-config", llama, "--preset", "tiny", "--out", out}, "--from-config"},
      {{"--family", "llama", "--out", out}, "--preset"},
      {{"--preset", "tiny", "--out", out}, "--family"},
      {{"--family", "llama", "--preset", "tiny", "--scale-dims", "64", "--out", out},
       "--scale-dims"},
      {{"--from-config", llama, "--scale-dims", "60", "--out", out}, "multiple of 8"},
      {{"--from-config", llama, "--scale-dims", "0", "--out", out}, "multiple of 8"},
      {{"--from-config", llama, "--scale-dims", "-64", "--out", out}, "--scale-dims"},
      {{"--from-config", llama, "--scale-dims", "4096", "--out", out}, "hidden_size 4096"},
      {{"--from-config", llama, "--scale-dims", "8192", "--out", out}, llama},
      {{"--from-config", llama, "--tie-embeddings", "--out", out}, "--tie-embeddings"},
      {{"--from-config", llama, "--fused-experts", "--out", out}, "dense"},
      {{"--from-config", llama}, "--out"},
  };
  for (const Case& k : cases) {
    std::vector<std::string> args{"synth"};
    args.insert(args.end(), k.args.begin(), k.args.end());
    RunResult r = ferry(args);
    std::string line;
    for (const auto& a : args) {
      line += a + " ";
    }
    EXPECT_EQ(r.status, 2) << line << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(k.says)) << line;
  }
  EXPECT_FALSE(fs::exists(out));
}

TEST(SynthFromConfigCli, BadConfigFilesExitOneNamingFileAndField) {
  TempDir dir;
  write_file(dir.file("bad.json"), "{not json");
  json gpt2 = {{"architectures", {"GPT2LMHeadModel"}}};
  write_file(dir.file("gpt2.json"), gpt2.dump());
  json qwen = synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  qwen["mlp_only_layers"] = {0};
  write_file(dir.file("qwen.json"), qwen.dump());
  json v3 = synth_config("deepseek_v3", "tiny", DType::kBF16, false);
  v3["num_nextn_predict_layers"] = 3;
  write_file(dir.file("v3.json"), v3.dump());
  struct Case {
    std::string file;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases{
      {dir.file("missing.json"), {"does not exist"}},
      {dir.file("bad.json"), {"not valid JSON"}},
      {dir.file("gpt2.json"), {"GPT2LMHeadModel"}},
      {dir.file("qwen.json"), {"'mlp_only_layers'"}},
      {dir.file("v3.json"), {"'num_nextn_predict_layers'"}},
  };
  for (const Case& k : cases) {
    for (bool scaled : {false, true}) {
      std::vector<std::string> args{"synth", "--from-config", k.file, "--out", dir.file("out")};
      if (scaled) {
        args.insert(args.end(), {"--scale-dims", "64"});
      }
      RunResult r = ferry(args);
      EXPECT_EQ(r.status, 1) << k.file << "\n" << r.err;
      EXPECT_THAT(r.err, HasSubstr(k.file));
      for (const std::string& s : k.says) {
        EXPECT_THAT(r.err, HasSubstr(s)) << k.file;
      }
    }
  }
  EXPECT_FALSE(fs::exists(dir.file("out")));
}

}  // namespace
}  // namespace ferry::synth
