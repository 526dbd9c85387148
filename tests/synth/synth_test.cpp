// ferry synth: tensor lists against the real Hugging Face names and config fields,
// the value function and its encoders, shard planning, the files a synthesis
// writes (read back byte by byte), atomic replacement, and the command line. The
// families added later (mistral, qwen2_moe, deepseek_v2, glm4_moe) and fused experts
// have their own file, synth_families_test.cpp.
#include "synth/synth.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/safetensors.hpp"
#include "synth/cli_util.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::synth {
namespace {

namespace fs = std::filesystem;
using ferry::testing::read_file;
using ferry::testing::TempDir;
using nlohmann::json;

constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;
constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

// ---- independent decoding (not the code under test) ---------------------------

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

float f16_to_float(std::uint16_t h) {
  int sign = (h >> 15) & 1;
  int exp = (h >> 10) & 0x1f;
  int mant = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(mant, -24);
  } else if (exp == 31) {
    v = mant != 0 ? NAN : INFINITY;
  } else {
    v = std::ldexp(1024 + mant, exp - 25);
  }
  return static_cast<float>(sign ? -v : v);
}

// One shard read back with a minimal reader of its own.
struct Shard {
  nlohmann::ordered_json header;  // file order, to check that offsets are contiguous
  std::string bytes;
  std::uint64_t data_start = 0;
};

Shard read_shard(const std::string& path) {
  Shard s;
  s.bytes = read_file(path);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) {
    n = (n << 8) | static_cast<unsigned char>(s.bytes.at(static_cast<std::size_t>(i)));
  }
  s.header = nlohmann::ordered_json::parse(s.bytes.substr(8, n));
  s.data_start = 8 + n;
  return s;
}

// Element `index` of tensor `name` as stored in the shard.
float element(const Shard& s, const std::string& name, std::uint64_t index) {
  const auto& t = s.header.at(name);
  std::uint64_t begin = t["data_offsets"][0].get<std::uint64_t>();
  std::string dtype = t["dtype"];
  std::size_t at = static_cast<std::size_t>(s.data_start + begin);
  if (dtype == "F32") {
    std::uint32_t bits;
    std::memcpy(&bits, s.bytes.data() + at + index * 4, 4);
    return std::bit_cast<float>(bits);
  }
  std::uint16_t bits;
  std::memcpy(&bits, s.bytes.data() + at + index * 2, 2);
  return dtype == "BF16" ? bf16_to_float(bits) : f16_to_float(bits);
}

SynthOptions options_for(const std::string& family, const fs::path& out, DType dtype = DType::kBF16,
                         std::uint64_t seed = 1) {
  SynthOptions o;
  o.family = family;
  o.preset = "tiny";
  o.out = out.string();
  o.dtype = dtype;
  o.seed = seed;
  o.fsync = false;  // keeps the suite fast; the durable path is covered once below
  return o;
}

std::map<std::string, SynthTensor> by_name(const std::vector<SynthTensor>& list) {
  std::map<std::string, SynthTensor> out;
  for (const auto& t : list) {
    out[t.name] = t;
  }
  return out;
}

std::uint64_t total_bytes(const std::vector<SynthTensor>& list) {
  std::uint64_t n = 0;
  for (const auto& t : list) {
    n += t.nbytes();
  }
  return n;
}

// Reads every shard of a synthesized checkpoint and checks it against the plan:
// names, shapes, dtypes, contiguous offsets, sizes, and sampled element values.
void check_checkpoint(const fs::path& dir, const std::string& family, DType dtype,
                      std::uint64_t seed, bool tie = false) {
  SCOPED_TRACE(family + " " + std::string(dtype_name(dtype)));
  std::vector<SynthTensor> list = synth_tensor_list(family, "tiny", dtype, tie);
  auto expected = by_name(list);

  json index = json::parse(read_file((dir / "model.safetensors.index.json").string()));
  std::set<std::string> mapped;
  std::set<std::string> shard_files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    mapped.insert(name);
    shard_files.insert(file.get<std::string>());
  }
  // The index lists every tensor but those of an unindexed file (GLM's mtp.safetensors).
  std::set<std::string> names;
  std::set<std::string> unindexed_files;
  std::uint64_t indexed_bytes = 0;
  for (const auto& t : list) {
    if (t.file.empty()) {
      names.insert(t.name);
      indexed_bytes += t.nbytes();
    } else {
      unindexed_files.insert(t.file);
    }
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<std::uint64_t>(), indexed_bytes);
  EXPECT_EQ(mapped, names);
  EXPECT_GE(shard_files.size(), 2u);
  EXPECT_TRUE(fs::exists(dir / "config.json"));

  std::size_t seen = 0;
  std::set<std::string> all_files = shard_files;
  all_files.insert(unindexed_files.begin(), unindexed_files.end());
  for (const auto& file : all_files) {
    const bool indexed = shard_files.count(file) != 0;
    if (indexed) {
      EXPECT_THAT(file, ::testing::MatchesRegex("model-[0-9]{5}-of-[0-9]{5}\\.safetensors"));
      EXPECT_EQ(file.substr(15, 5), (std::to_string(100000 + shard_files.size())).substr(1));
    }
    Shard s = read_shard((dir / file).string());
    EXPECT_EQ(s.data_start % 8, 0u);
    EXPECT_EQ(s.header["__metadata__"]["format"], "pt");
    std::uint64_t end = 0;
    // Offsets are contiguous in header order (which is declaration order).
    for (const auto& [name, t] : s.header.items()) {
      if (name == "__metadata__") {
        continue;
      }
      ++seen;
      ASSERT_TRUE(expected.count(name)) << name;
      const SynthTensor& want = expected[name];
      if (indexed) {
        EXPECT_EQ(index["weight_map"][name], file) << name;
      } else {
        EXPECT_EQ(want.file, file) << name;
        EXPECT_FALSE(index["weight_map"].contains(name)) << name;
      }
      EXPECT_EQ(t["dtype"], std::string(dtype_name(want.dtype))) << name;
      EXPECT_EQ(t["shape"].get<std::vector<std::uint64_t>>(), want.shape) << name;
      std::uint64_t b = t["data_offsets"][0].get<std::uint64_t>();
      std::uint64_t e = t["data_offsets"][1].get<std::uint64_t>();
      EXPECT_EQ(b, end) << name;
      EXPECT_EQ(e - b, want.elements() * dtype_size(want.dtype)) << name;
      end = e;
      std::uint64_t n = want.elements();
      for (std::uint64_t i : {std::uint64_t{0}, std::uint64_t{1}, n / 2, n - 1}) {
        ASSERT_EQ(element(s, name, i), synth_value(seed, name, i)) << name << "[" << i << "]";
      }
    }
    EXPECT_EQ(s.bytes.size(), s.data_start + end) << file;
  }
  EXPECT_EQ(seen, list.size());
}

// ---- values ----------------------------------------------------------------------

TEST(SynthValue, IsAMultipleOfOneOver128InRangeAndDependsOnAllInputs) {
  std::set<float> distinct;
  for (std::uint64_t i = 0; i < 5000; ++i) {
    float v = synth_value(1, "model.norm.weight", i);
    ASSERT_LE(std::fabs(v), 127.0f / 128.0f);
    ASSERT_EQ(v * 128.0f, std::round(v * 128.0f));
    distinct.insert(v);
  }
  EXPECT_GT(distinct.size(), 250u);  // uses (nearly) all 255 values
  int differ_seed = 0;
  int differ_name = 0;
  for (std::uint64_t i = 0; i < 100; ++i) {
    differ_seed += synth_value(1, "a", i) != synth_value(2, "a", i);
    differ_name += synth_value(1, "a", i) != synth_value(1, "b", i);
  }
  EXPECT_GT(differ_seed, 90);
  EXPECT_GT(differ_name, 90);
}

TEST(SynthValue, KnownHashes) {
  // Pins the documented formulas so other tools can reimplement them.
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(splitmix64(0), 0xe220a8397b1dcdafULL);
  std::uint64_t k = splitmix64((7 ^ fnv1a64("x")) + 3) % 255;
  EXPECT_EQ(synth_value(7, "x", 3), (static_cast<float>(k) - 127.0f) / 128.0f);
}

TEST(SynthEncode, MatchesSynthValueInEveryDtypeFromAnyOffset) {
  const std::string name = "model.layers.0.mlp.up_proj.weight";
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    std::size_t es = dtype_size(dtype);
    std::vector<std::byte> buf(1000 * es);
    synth_encode(dtype, 42, name, 123456789, buf);
    for (std::size_t i = 0; i < 1000; ++i) {
      float got;
      if (dtype == DType::kF32) {
        std::memcpy(&got, buf.data() + i * 4, 4);
      } else {
        std::uint16_t bits;
        std::memcpy(&bits, buf.data() + i * 2, 2);
        got = dtype == DType::kBF16 ? bf16_to_float(bits) : f16_to_float(bits);
      }
      ASSERT_EQ(got, synth_value(42, name, 123456789 + i)) << dtype_name(dtype) << " " << i;
    }
  }
}

TEST(SynthEncode, RejectsOtherDtypesAndPartialElements) {
  std::vector<std::byte> buf(7);
  EXPECT_THROW(synth_encode(DType::kI32, 1, "a", 0, std::span(buf).first(4)), Error);
  EXPECT_THROW(synth_encode(DType::kBF16, 1, "a", 0, buf), Error);
  EXPECT_THROW(synth_encode(DType::kF32, 1, "a", 0, std::span(buf).first(6)), Error);
  try {
    synth_encode(DType::kF16, 1, "t.weight", 0, buf);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_EQ(e.tensor(), "t.weight");
  }
}

TEST(HalfConversion, KnownValuesRoundingAndSpecials) {
  EXPECT_EQ(float_to_f16_bits(0.0f), 0x0000);
  EXPECT_EQ(float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16_bits(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16_bits(0.1f), 0x2e66);
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65519.0f), 0x7bff);  // below the midpoint to infinity
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7c00);  // the midpoint rounds to even: infinity
  EXPECT_EQ(float_to_f16_bits(1e10f), 0x7c00);
  EXPECT_EQ(float_to_f16_bits(-INFINITY), 0xfc00);
  std::uint16_t nan = float_to_f16_bits(NAN);
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);             // smallest subnormal
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);             // tie to even: zero
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.5f, -25)), 0x0001);             // above the tie
  EXPECT_EQ(float_to_f16_bits(std::ldexp(3.0f, -25)), 0x0002);             // 1.5 ulp ties to even 2
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -14)), 0x0400);             // smallest normal
  EXPECT_EQ(float_to_f16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie: even
  EXPECT_EQ(float_to_f16_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie: even
}

TEST(HalfConversion, RoundTripsEveryHalfAndRoundsEveryMidpointToEven) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00) {
      continue;  // infinities and NaNs are covered above
    }
    float f = f16_to_float(static_cast<std::uint16_t>(h));
    ASSERT_EQ(float_to_f16_bits(f), h) << std::hex << h;
    std::uint32_t next = h + 1;
    if ((h & 0x7fff) == 0x7bff) {
      continue;  // the next one is infinity, checked above
    }
    // Half significands have 11 bits: the midpoint is exact in float.
    float mid = (f + f16_to_float(static_cast<std::uint16_t>(next))) / 2.0f;
    std::uint16_t want = static_cast<std::uint16_t>((h & 1) == 0 ? h : next);
    ASSERT_EQ(float_to_f16_bits(mid), want) << std::hex << h;
  }
}

TEST(BFloatConversion, RoundsToNearestEvenAndKeepsNaN) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(-0.5f), 0xbf00);
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie: even
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie: even
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x3f808001u)), 0x3f81);  // above tie
  EXPECT_EQ(float_to_bf16_bits(std::bit_cast<float>(0x7f7fffffu)), 0x7f80);  // to infinity
  std::uint16_t nan = float_to_bf16_bits(std::bit_cast<float>(0x7f800001u));
  EXPECT_EQ(nan & 0x7f80, 0x7f80);
  EXPECT_NE(nan & 0x007f, 0);
}

// ---- tensor lists and configs --------------------------------------------------

TEST(SynthTensorList, PresetSizes) {
  for (const auto& family : synth_families()) {
    SCOPED_TRACE(family);
    std::uint64_t tiny = total_bytes(synth_tensor_list(family, "tiny", DType::kBF16, false));
    std::uint64_t small = total_bytes(synth_tensor_list(family, "small", DType::kBF16, false));
    std::uint64_t medium = total_bytes(synth_tensor_list(family, "medium", DType::kBF16, false));
    EXPECT_GE(tiny, 1 * kMiB);
    EXPECT_LT(tiny, 8 * kMiB);
    EXPECT_GE(small, 10 * kMiB);
    EXPECT_LT(small, 100 * kMiB);
    EXPECT_GE(medium, 2 * kGiB);
    EXPECT_LT(medium, 3 * kGiB);
    // F32 doubles everything but DeepSeek's F32 router bias.
    auto f32 = synth_tensor_list(family, "tiny", DType::kF32, false);
    EXPECT_LE(total_bytes(f32), 2 * tiny);
    EXPECT_GT(total_bytes(f32), 2 * tiny - 4096);
  }
}

TEST(SynthTensorList, TinyHasAPaddableVocabAndGroupedQueryAttention) {
  json c = synth_config("llama", "tiny", DType::kBF16, false);
  EXPECT_NE(c["vocab_size"].get<int>() % 64, 0);
  EXPECT_EQ(c["num_attention_heads"], 8);
  EXPECT_EQ(c["num_key_value_heads"], 2);
  auto list = by_name(synth_tensor_list("llama", "tiny", DType::kBF16, false));
  EXPECT_EQ(list.at("model.layers.0.self_attn.q_proj.weight").shape,
            (std::vector<std::uint64_t>{128, 128}));
  EXPECT_EQ(list.at("model.layers.0.self_attn.k_proj.weight").shape,
            (std::vector<std::uint64_t>{32, 128}));
  EXPECT_EQ(list.at("model.embed_tokens.weight").shape, (std::vector<std::uint64_t>{1000, 128}));
  EXPECT_EQ(list.at("lm_head.weight").shape, (std::vector<std::uint64_t>{1000, 128}));
  auto tied = by_name(synth_tensor_list("llama", "tiny", DType::kBF16, true));
  EXPECT_EQ(tied.count("lm_head.weight"), 0u);
  EXPECT_EQ(tied.size() + 1, list.size());
  EXPECT_EQ(synth_config("llama", "tiny", DType::kBF16, true)["tie_word_embeddings"], true);
}

// Layer-0 and non-layer names of a real index, with "layers.0." kept.
std::set<std::string> real_layer0_names(const std::string& model) {
  std::string path =
      ::ferry::testing::test_data_path("models/" + model + "/model.safetensors.index.json");
  json index = json::parse(read_file(path));
  std::set<std::string> out;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (name.find(".layers.") == std::string::npos ||
        name.find(".layers.0.") != std::string::npos) {
      out.insert(name);
    }
  }
  return out;
}

std::set<std::string> synth_layer0_names(const std::string& family) {
  std::set<std::string> out;
  for (const auto& t : synth_tensor_list(family, "tiny", DType::kBF16, false)) {
    if (t.name.find(".layers.") == std::string::npos ||
        t.name.find(".layers.0.") != std::string::npos) {
      out.insert(t.name);
    }
  }
  return out;
}

TEST(SynthTensorList, NamesMatchRealHuggingFaceCheckpoints) {
  FERRY_NEED_TEST_DATA();
  // Mistral 7B has the Llama layout untied; Sakura is a Qwen2.5-14B; Mixtral has 8
  // experts like the tiny preset, so the sets must be identical.
  EXPECT_EQ(synth_layer0_names("llama"), real_layer0_names("mistral-7b-instruct-v0.3"));
  EXPECT_EQ(synth_layer0_names("llama"), real_layer0_names("llama3-chinese-8b"));
  EXPECT_EQ(synth_layer0_names("qwen2"), real_layer0_names("sakura-14b-qwen2.5"));
  EXPECT_EQ(synth_layer0_names("mixtral"), real_layer0_names("mixtral-8x7b-v0.1"));
  EXPECT_EQ(synth_layer0_names("mistral"), real_layer0_names("mistral-7b-instruct-v0.3"));
}

TEST(SynthConfig, UsesTheRealConfigsFieldNames) {
  FERRY_NEED_TEST_DATA();
  const std::map<std::string, std::string> real{
      {"llama", "llama-3.2-3b-instruct"}, {"qwen2", "qwen2.5-7b"},
      {"mixtral", "mixtral-8x7b-v0.1"},   {"qwen3_moe", "qwen3-30b-a3b"},
      {"deepseek_v3", "deepseek-v3"},
  };
  // Fields a synthetic BF16 checkpoint must not claim (FP8 quantization, remote code)
  // or that only record who wrote the file.
  const std::set<std::string> not_copied{"quantization_config", "auto_map", "transformers_version"};
  for (const auto& [family, model] : real) {
    SCOPED_TRACE(family);
    std::string path = ::ferry::testing::test_data_path("models/" + model + "/config.json");
    json want = json::parse(read_file(path));
    json got = synth_config(family, "tiny", DType::kBF16, false);
    for (const auto& [key, value] : got.items()) {
      EXPECT_TRUE(want.contains(key)) << "invented field " << key;
    }
    for (const auto& [key, value] : want.items()) {
      if (!not_copied.count(key)) {
        EXPECT_TRUE(got.contains(key)) << "missing field " << key;
      }
    }
    EXPECT_EQ(got["architectures"], want["architectures"]);
    EXPECT_EQ(got["model_type"], want["model_type"]);
    EXPECT_EQ(got["model_type"], family);
  }
}

TEST(SynthConfig, DescribesTheTensorsAndTheDtype) {
  EXPECT_EQ(synth_config("qwen2", "tiny", DType::kF16, false)["torch_dtype"], "float16");
  EXPECT_EQ(synth_config("qwen2", "tiny", DType::kF32, false)["torch_dtype"], "float32");
  EXPECT_EQ(synth_config("qwen2", "tiny", DType::kBF16, false)["torch_dtype"], "bfloat16");

  for (const auto& family : synth_families()) {
    SCOPED_TRACE(family);
    json c = synth_config(family, "small", DType::kBF16, false);
    auto list = by_name(synth_tensor_list(family, "small", DType::kBF16, false));
    std::uint64_t h = c["hidden_size"];
    std::uint64_t v = c["vocab_size"];
    std::uint64_t layers = c["num_hidden_layers"];
    EXPECT_EQ(list.at("model.embed_tokens.weight").shape, (std::vector<std::uint64_t>{v, h}));
    EXPECT_EQ(list.at("model.norm.weight").shape, (std::vector<std::uint64_t>{h}));
    std::string last = "model.layers." + std::to_string(layers - 1) + ".input_layernorm.weight";
    EXPECT_TRUE(list.count(last)) << last;
    EXPECT_FALSE(
        list.count("model.layers." + std::to_string(layers + 1) + ".input_layernorm.weight"));
    if (family == "deepseek_v3" || family == "deepseek_v2" || family == "deepseek_v32") {
      continue;  // MLA: checked in its own tests
    }
    std::uint64_t heads = c["num_attention_heads"];
    std::uint64_t kv = c["num_key_value_heads"];
    std::uint64_t hd = c.contains("head_dim") ? c["head_dim"].get<std::uint64_t>() : h / heads;
    if (family == "phi3") {
      // Phi-3 stores q, k and v fused, and gate and up.
      const std::uint64_t inter = c["intermediate_size"];
      EXPECT_EQ(list.at("model.layers.1.self_attn.qkv_proj.weight").shape,
                (std::vector<std::uint64_t>{(heads + 2 * kv) * hd, h}));
      EXPECT_EQ(list.at("model.layers.1.mlp.gate_up_proj.weight").shape,
                (std::vector<std::uint64_t>{2 * inter, h}));
      EXPECT_EQ(list.count("model.layers.1.self_attn.q_proj.weight"), 0u);
      continue;
    }
    EXPECT_EQ(list.at("model.layers.1.self_attn.q_proj.weight").shape,
              (std::vector<std::uint64_t>{heads * hd, h}));
    EXPECT_EQ(list.at("model.layers.1.self_attn.v_proj.weight").shape,
              (std::vector<std::uint64_t>{kv * hd, h}));
    EXPECT_EQ(list.at("model.layers.1.self_attn.o_proj.weight").shape,
              (std::vector<std::uint64_t>{h, heads * hd}));
    const bool qkv_bias = family == "qwen2" || family == "qwen2_moe" || family == "glm4_moe";
    EXPECT_EQ(list.count("model.layers.1.self_attn.q_proj.bias"), qkv_bias ? 1u : 0u);
    EXPECT_EQ(list.count("model.layers.1.self_attn.o_proj.bias"), 0u);
    if (qkv_bias) {
      EXPECT_EQ(list.at("model.layers.1.self_attn.k_proj.bias").shape,
                (std::vector<std::uint64_t>{kv * hd}));
    }
    if (family == "mixtral") {
      std::uint64_t e = c["num_local_experts"];
      std::uint64_t i = c["intermediate_size"];
      EXPECT_EQ(list.at("model.layers.1.block_sparse_moe.gate.weight").shape,
                (std::vector<std::uint64_t>{e, h}));
      std::string x = "model.layers.1.block_sparse_moe.experts." + std::to_string(e - 1);
      EXPECT_EQ(list.at(x + ".w1.weight").shape, (std::vector<std::uint64_t>{i, h}));
      EXPECT_EQ(list.at(x + ".w2.weight").shape, (std::vector<std::uint64_t>{h, i}));
      EXPECT_EQ(list.at(x + ".w3.weight").shape, (std::vector<std::uint64_t>{i, h}));
      EXPECT_FALSE(list.count("model.layers.1.block_sparse_moe.experts." + std::to_string(e) +
                              ".w1.weight"));
    }
    if (family == "qwen3_moe") {
      std::uint64_t e = c["num_experts"];
      std::uint64_t mi = c["moe_intermediate_size"];
      EXPECT_NE(heads * hd, h);  // head_dim is independent of hidden_size, as in Qwen3
      EXPECT_EQ(list.at("model.layers.1.self_attn.q_norm.weight").shape,
                (std::vector<std::uint64_t>{hd}));
      EXPECT_EQ(list.at("model.layers.1.self_attn.k_norm.weight").shape,
                (std::vector<std::uint64_t>{hd}));
      EXPECT_EQ(list.at("model.layers.1.mlp.gate.weight").shape,
                (std::vector<std::uint64_t>{e, h}));
      std::string x = "model.layers.1.mlp.experts." + std::to_string(e - 1);
      EXPECT_EQ(list.at(x + ".gate_proj.weight").shape, (std::vector<std::uint64_t>{mi, h}));
      EXPECT_EQ(list.at(x + ".down_proj.weight").shape, (std::vector<std::uint64_t>{h, mi}));
      EXPECT_EQ(c["mlp_only_layers"], json::array());
      EXPECT_EQ(c["decoder_sparse_step"], 1);
    }
  }
}

TEST(SynthTensorList, DeepseekV3HasMlaDenseLayersMoeAndTheMtpLayer) {
  json c = synth_config("deepseek_v3", "tiny", DType::kF16, false);
  auto list = synth_tensor_list("deepseek_v3", "tiny", DType::kF16, false);
  auto names = by_name(list);
  std::uint64_t h = c["hidden_size"];
  std::uint64_t v = c["vocab_size"];
  std::uint64_t layers = c["num_hidden_layers"];
  std::uint64_t heads = c["num_attention_heads"];
  std::uint64_t q_lora = c["q_lora_rank"];
  std::uint64_t kv_lora = c["kv_lora_rank"];
  std::uint64_t nope = c["qk_nope_head_dim"];
  std::uint64_t rope = c["qk_rope_head_dim"];
  std::uint64_t vh = c["v_head_dim"];
  std::uint64_t e = c["n_routed_experts"];
  std::uint64_t mi = c["moe_intermediate_size"];
  std::uint64_t shared = c["n_shared_experts"];
  std::uint64_t dense = c["first_k_dense_replace"];
  EXPECT_EQ(layers, 2u);
  EXPECT_EQ(dense, 1u);
  EXPECT_EQ(e, 8u);
  EXPECT_EQ(c["num_nextn_predict_layers"], 1);
  EXPECT_EQ(c["topk_method"], "noaux_tc");
  EXPECT_EQ(c["num_key_value_heads"], c["num_attention_heads"]);

  auto shape = [&](const std::string& n) {
    EXPECT_TRUE(names.count(n)) << n;
    return names.count(n) ? names.at(n).shape : std::vector<std::uint64_t>{};
  };
  using S = std::vector<std::uint64_t>;
  for (std::uint64_t i = 0; i <= layers; ++i) {  // the MTP layer has attention too
    std::string p = "model.layers." + std::to_string(i) + ".";
    EXPECT_EQ(shape(p + "self_attn.q_a_proj.weight"), (S{q_lora, h}));
    EXPECT_EQ(shape(p + "self_attn.q_a_layernorm.weight"), (S{q_lora}));
    EXPECT_EQ(shape(p + "self_attn.q_b_proj.weight"), (S{heads * (nope + rope), q_lora}));
    EXPECT_EQ(shape(p + "self_attn.kv_a_proj_with_mqa.weight"), (S{kv_lora + rope, h}));
    EXPECT_EQ(shape(p + "self_attn.kv_a_layernorm.weight"), (S{kv_lora}));
    EXPECT_EQ(shape(p + "self_attn.kv_b_proj.weight"), (S{heads * (nope + vh), kv_lora}));
    EXPECT_EQ(shape(p + "self_attn.o_proj.weight"), (S{h, heads * vh}));
    EXPECT_EQ(shape(p + "input_layernorm.weight"), (S{h}));
    EXPECT_EQ(shape(p + "post_attention_layernorm.weight"), (S{h}));
    EXPECT_FALSE(names.count(p + "self_attn.q_proj.weight"));
    if (i < dense) {
      EXPECT_EQ(shape(p + "mlp.gate_proj.weight"),
                (S{c["intermediate_size"].get<std::uint64_t>(), h}));
      EXPECT_FALSE(names.count(p + "mlp.gate.weight"));
      EXPECT_FALSE(names.count(p + "mlp.experts.0.up_proj.weight"));
      continue;
    }
    EXPECT_FALSE(names.count(p + "mlp.gate_proj.weight"));
    EXPECT_EQ(shape(p + "mlp.gate.weight"), (S{e, h}));
    EXPECT_EQ(shape(p + "mlp.gate.e_score_correction_bias"), (S{e}));
    EXPECT_EQ(names.at(p + "mlp.gate.e_score_correction_bias").dtype, DType::kF32);
    EXPECT_EQ(names.at(p + "mlp.gate.weight").dtype, DType::kF16);
    for (std::uint64_t x = 0; x < e; ++x) {
      std::string ex = p + "mlp.experts." + std::to_string(x) + ".";
      EXPECT_EQ(shape(ex + "gate_proj.weight"), (S{mi, h}));
      EXPECT_EQ(shape(ex + "up_proj.weight"), (S{mi, h}));
      EXPECT_EQ(shape(ex + "down_proj.weight"), (S{h, mi}));
    }
    EXPECT_FALSE(names.count(p + "mlp.experts." + std::to_string(e) + ".up_proj.weight"));
    EXPECT_EQ(shape(p + "mlp.shared_experts.gate_proj.weight"), (S{mi * shared, h}));
    EXPECT_EQ(shape(p + "mlp.shared_experts.down_proj.weight"), (S{h, mi * shared}));
  }
  std::string mtp = "model.layers." + std::to_string(layers) + ".";
  EXPECT_EQ(shape(mtp + "embed_tokens.weight"), (S{v, h}));
  EXPECT_EQ(shape(mtp + "enorm.weight"), (S{h}));
  EXPECT_EQ(shape(mtp + "hnorm.weight"), (S{h}));
  EXPECT_EQ(shape(mtp + "eh_proj.weight"), (S{h, 2 * h}));
  EXPECT_EQ(shape(mtp + "shared_head.norm.weight"), (S{h}));
  EXPECT_EQ(shape(mtp + "shared_head.head.weight"), (S{v, h}));
  EXPECT_FALSE(names.count("model.layers." + std::to_string(layers + 1) + ".enorm.weight"));
  EXPECT_EQ(list.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(list.back().name, "lm_head.weight");
  // Only the MoE layers' router biases are F32.
  std::size_t f32 = 0;
  for (const auto& t : list) {
    f32 += t.dtype == DType::kF32;
  }
  EXPECT_EQ(f32, layers + 1 - dense);
}

TEST(SynthTensorList, UnknownFamilyPresetOrDtypeIsAnError) {
  try {
    synth_tensor_list("gpt2", "tiny", DType::kBF16, false);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_NE(e.rule().find("unknown family 'gpt2'"), std::string::npos) << e.what();
    EXPECT_NE(e.rule().find("deepseek_v3"), std::string::npos) << e.what();
    EXPECT_NE(e.rule().find("glm4_moe"), std::string::npos) << e.what();
  }
  EXPECT_THROW(synth_tensor_list("llama", "huge", DType::kBF16, false), Error);
  EXPECT_THROW(synth_tensor_list("llama", "tiny", DType::kI8, false), Error);
  EXPECT_THROW(synth_config("llama", "huge", DType::kBF16, false), Error);
  EXPECT_THROW(synth_default_shard_bytes("huge"), Error);
  EXPECT_FALSE(parse_synth_dtype("fp8").has_value());
  EXPECT_EQ(parse_synth_dtype("bf16"), DType::kBF16);
  EXPECT_EQ(parse_synth_dtype("F16"), DType::kF16);
}

// ---- shard planning -----------------------------------------------------------------

TEST(SynthShardPlan, PacksGreedilyAndGivesBigTensorsTheirOwnShard) {
  std::vector<SynthTensor> list{
      {"a", DType::kU8, {40}},  {"b", DType::kU8, {60}}, {"c", DType::kU8, {1}},
      {"d", DType::kU8, {250}}, {"e", DType::kU8, {10}}, {"f", DType::kU8, {90}},
  };
  auto plan = synth_shard_plan(list, 100);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].tensors, (std::vector<std::size_t>{0, 1}));  // exactly 100 fits
  EXPECT_EQ(plan[1].tensors, (std::vector<std::size_t>{2}));
  EXPECT_EQ(plan[2].tensors, (std::vector<std::size_t>{3}));  // larger than a shard
  EXPECT_EQ(plan[3].tensors, (std::vector<std::size_t>{4, 5}));
  EXPECT_EQ(plan[2].data_bytes, 250u);
  EXPECT_EQ(plan[0].file, "model-00001-of-00004.safetensors");
  EXPECT_EQ(plan[3].file, "model-00004-of-00004.safetensors");
  EXPECT_EQ(synth_shard_plan(list, 1000).size(), 1u);
  EXPECT_THROW(synth_shard_plan(list, 0), Error);
}

TEST(SynthShardPlan, TensorsOfAnUnindexedFileGetOneShardOfTheirOwnAtTheEnd) {
  std::vector<SynthTensor> list{
      {"a", DType::kU8, {40}, ""},
      {"m1", DType::kU8, {500}, "mtp.safetensors"},
      {"b", DType::kU8, {70}, ""},
      {"m2", DType::kU8, {1}, "mtp.safetensors"},
      {"x", DType::kU8, {3}, "x.safetensors"},
      {"c", DType::kU8, {30}, ""},
  };
  auto plan = synth_shard_plan(list, 100);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].file, "model-00001-of-00002.safetensors");  // numbered without them
  EXPECT_EQ(plan[0].tensors, (std::vector<std::size_t>{0}));
  EXPECT_EQ(plan[1].file, "model-00002-of-00002.safetensors");
  EXPECT_EQ(plan[1].tensors, (std::vector<std::size_t>{2, 5}));
  EXPECT_TRUE(plan[0].indexed && plan[1].indexed);
  EXPECT_EQ(plan[2].file, "mtp.safetensors");
  EXPECT_FALSE(plan[2].indexed);
  EXPECT_EQ(plan[2].tensors, (std::vector<std::size_t>{1, 3}));  // larger than a shard: still one
  EXPECT_EQ(plan[2].data_bytes, 501u);
  EXPECT_EQ(plan[3].file, "x.safetensors");
  EXPECT_EQ(plan[3].tensors, (std::vector<std::size_t>{4}));
}

TEST(SynthShardPlan, DefaultsGiveSeveralShardsForTinyAndMedium) {
  EXPECT_EQ(synth_default_shard_bytes("tiny"), 512u << 10);
  EXPECT_EQ(synth_default_shard_bytes("small"), 16u << 20);
  EXPECT_EQ(synth_default_shard_bytes("medium"), 512u << 20);
  for (const auto& family : synth_families()) {
    for (bool tie : {false, true}) {
      auto plan = synth_shard_plan(synth_tensor_list(family, "tiny", DType::kBF16, tie),
                                   synth_default_shard_bytes("tiny"));
      EXPECT_GE(plan.size(), 2u) << family;
    }
    auto medium = synth_shard_plan(synth_tensor_list(family, "medium", DType::kBF16, false),
                                   synth_default_shard_bytes("medium"));
    EXPECT_GE(medium.size(), 4u) << family;
  }
}

// ---- writing ----------------------------------------------------------------------

TEST(Synthesize, EveryFamilyTinyReadsBackExactly) {
  TempDir dir;
  for (const auto& family : synth_families()) {
    fs::path out = dir.path() / family;
    SynthResult r = synthesize(options_for(family, out));
    auto list = synth_tensor_list(family, "tiny", DType::kBF16, false);
    EXPECT_EQ(r.tensors, list.size());
    EXPECT_EQ(r.total_bytes, total_bytes(list));
    EXPECT_EQ(r.files.size(), r.shards + 2);
    for (const auto& f : r.files) {
      EXPECT_TRUE(fs::is_regular_file(f)) << f;
    }
    check_checkpoint(out, family, DType::kBF16, 1);
    json config = json::parse(read_file((out / "config.json").string()));
    EXPECT_EQ(config, synth_config(family, "tiny", DType::kBF16, false));
  }
  // Nothing but the checkpoints: no temporary siblings left behind.
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) {
    ++entries;
  }
  EXPECT_EQ(entries, synth_families().size());
}

TEST(Synthesize, F16AndF32ValuesAndTheF32RouterBias) {
  TempDir dir;
  for (DType dtype : {DType::kF16, DType::kF32}) {
    fs::path out = dir.path() / ("ds-" + std::string(dtype_name(dtype)));
    synthesize(options_for("deepseek_v3", out, dtype, 9));
    check_checkpoint(out, "deepseek_v3", dtype, 9);
    fs::path llama = dir.path() / ("llama-" + std::string(dtype_name(dtype)));
    synthesize(options_for("llama", llama, dtype, 9));
    check_checkpoint(llama, "llama", dtype, 9);
  }
}

TEST(Synthesize, TiedEmbeddingsAndExplicitShardBytes) {
  TempDir dir;
  SynthOptions o = options_for("qwen2", dir.path() / "q");
  o.tie_embeddings = true;
  o.shard_bytes = 200 << 10;
  o.fsync = true;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> progress;
  o.progress = [&](std::uint64_t done, std::uint64_t total) { progress.emplace_back(done, total); };
  SynthResult r = synthesize(o);
  auto plan = synth_shard_plan(synth_tensor_list("qwen2", "tiny", DType::kBF16, true), 200 << 10);
  EXPECT_EQ(r.shards, plan.size());
  ASSERT_EQ(progress.size(), plan.size());
  EXPECT_EQ(progress.back(), std::make_pair(r.total_bytes, r.total_bytes));
  check_checkpoint(dir.path() / "q", "qwen2", DType::kBF16, 1, true);
  json config = json::parse(read_file((dir.path() / "q" / "config.json").string()));
  EXPECT_EQ(config["tie_word_embeddings"], true);
  EXPECT_EQ(fs::status(dir.path() / "q").permissions() & fs::perms::others_read,
            fs::perms::others_read);
}

std::string shard_data(const fs::path& dir, const std::string& file) {
  Shard s = read_shard((dir / file).string());
  return s.bytes.substr(static_cast<std::size_t>(s.data_start));
}

TEST(Synthesize, SameSeedSameBytesOtherSeedOtherBytes) {
  TempDir dir;
  synthesize(options_for("mixtral", dir.path() / "a", DType::kBF16, 5));
  synthesize(options_for("mixtral", dir.path() / "b", DType::kBF16, 5));
  synthesize(options_for("mixtral", dir.path() / "c", DType::kBF16, 6));
  const std::string first = "model-00001-of-00008.safetensors";
  const std::string last = "model-00008-of-00008.safetensors";
  for (const auto& f : {first, last}) {
    EXPECT_EQ(read_file((dir.path() / "a" / f).string()),
              read_file((dir.path() / "b" / f).string()));
    std::string a = shard_data(dir.path() / "a", f);
    std::string c = shard_data(dir.path() / "c", f);
    ASSERT_EQ(a.size(), c.size());
    std::size_t same = 0;
    for (std::size_t i = 0; i < a.size(); i += 2) {
      same += a.compare(i, 2, c, i, 2) == 0;
    }
    EXPECT_LT(same, a.size() / 2 / 20) << f;  // ~1/255 of elements agree by chance
  }
}

TEST(Synthesize, FerrysIndexReaderAgrees) {
  TempDir dir;
  synthesize(options_for("qwen3_moe", dir.path() / "m"));
  io::WeightIndex index =
      io::read_weight_index((dir.path() / "m" / "model.safetensors.index.json").string(), "index");
  auto list = synth_tensor_list("qwen3_moe", "tiny", DType::kBF16, false);
  ASSERT_TRUE(index.total_size.has_value());
  EXPECT_EQ(*index.total_size, total_bytes(list));
  EXPECT_EQ(index.weight_map.size(), list.size());
  std::set<std::string> files;
  for (const auto& [name, file] : index.weight_map) {
    files.insert(file);
  }
  std::uint64_t sum = 0;
  for (const auto& file : files) {
    io::SafetensorsHeader h = io::read_safetensors_header((dir.path() / "m" / file).string(), file);
    for (const auto& t : h.tensors) {
      EXPECT_EQ(index.weight_map.at(t.name), file);
      sum += t.nbytes;
    }
  }
  EXPECT_EQ(sum, *index.total_size);
}

TEST(Synthesize, RefusesANonEmptyFolderWithoutForceAndReplacesItWithForce) {
  TempDir dir;
  fs::path out = dir.path() / "ckpt";
  synthesize(options_for("llama", out, DType::kBF16, 1));
  std::string before = read_file((out / "model-00001-of-00004.safetensors").string());
  try {
    synthesize(options_for("llama", out, DType::kBF16, 2));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_EQ(e.file(), out.string());
    EXPECT_NE(e.rule().find("--force"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file((out / "model-00001-of-00004.safetensors").string()), before);

  // A different layout replaces the old one completely (no stale shards).
  SynthOptions o = options_for("mixtral", out, DType::kBF16, 2);
  o.force = true;
  synthesize(o);
  check_checkpoint(out, "mixtral", DType::kBF16, 2);
  EXPECT_FALSE(fs::exists(out / "model-00001-of-00004.safetensors"));
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) {
    ++entries;
  }
  EXPECT_EQ(entries, 1u);  // the old checkpoint and the temporary folder are gone
}

TEST(Synthesize, ForceNeverReplacesAFolderThatIsNotACheckpoint) {
  TempDir dir;
  fs::path out = dir.path() / "home";
  ferry::testing::write_file((out / "notes.txt").string(), "keep me");
  SynthOptions o = options_for("llama", out);
  o.force = true;
  try {
    synthesize(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(e.rule().find("notes.txt"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file((out / "notes.txt").string()), "keep me");
  fs::remove(out / "notes.txt");
  fs::create_directories(out / "sub");
  EXPECT_THROW(synthesize(o), Error);
  EXPECT_TRUE(fs::exists(out / "sub"));
}

TEST(Synthesize, AnEmptyFolderIsUsedAndAFileIsRefused) {
  TempDir dir;
  fs::create_directories(dir.path() / "empty");
  synthesize(options_for("llama", dir.path() / "empty/"));  // trailing slash too
  check_checkpoint(dir.path() / "empty", "llama", DType::kBF16, 1);

  ferry::testing::write_file((dir.path() / "file").string(), "x");
  SynthOptions o = options_for("llama", dir.path() / "file");
  o.force = true;
  EXPECT_THROW(synthesize(o), Error);
  EXPECT_EQ(read_file((dir.path() / "file").string()), "x");
  EXPECT_THROW(synthesize(options_for("llama", "")), Error);

  // Parents are created.
  synthesize(options_for("llama", dir.path() / "a" / "b" / "c"));
  EXPECT_TRUE(fs::exists(dir.path() / "a" / "b" / "c" / "config.json"));
}

TEST(Synthesize, BadFamilyPresetOrDtypeWritesNothing) {
  TempDir dir;
  SynthOptions bad_family = options_for("gpt2", dir.path() / "x");
  SynthOptions bad_preset = options_for("llama", dir.path() / "x");
  bad_preset.preset = "large";
  SynthOptions bad_dtype = options_for("llama", dir.path() / "x", DType::kF8E4M3);
  for (const auto* o : {&bad_family, &bad_preset, &bad_dtype}) {
    try {
      synthesize(*o);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kSynth);
    }
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(Synthesize, OfficialPythonLibraryReadsTinyLlama) {
  if (std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 with safetensors and numpy is not available";
  }
  TempDir dir;
  synthesize(options_for("llama", dir.path() / "bf16", DType::kBF16, 3));
  synthesize(options_for("llama", dir.path() / "f32", DType::kF32, 3));
  // numpy has no bfloat16: dtypes and shapes from the BF16 checkpoint, values
  // from the F32 one (same seed, same values by construction).
  const std::string script = R"(import sys, json, glob, os
from safetensors import safe_open
root = sys.argv[1]
index = json.load(open(os.path.join(root, "bf16", "model.safetensors.index.json")))
count = 0
for path in sorted(glob.glob(os.path.join(root, "bf16", "*.safetensors"))):
    with safe_open(path, framework="numpy") as f:
        for k in f.keys():
            s = f.get_slice(k)
            assert s.get_dtype() == "BF16", k
            assert index["weight_map"][k] == os.path.basename(path), k
            count += 1
print("count", count)
index = json.load(open(os.path.join(root, "f32", "model.safetensors.index.json")))
shard = index["weight_map"]["model.layers.3.mlp.down_proj.weight"]
with safe_open(os.path.join(root, "f32", shard), framework="numpy") as f:
    t = f.get_tensor("model.layers.3.mlp.down_proj.weight").reshape(-1)
    print("shape", list(f.get_slice("model.layers.3.mlp.down_proj.weight").get_shape()))
    for i in (0, 1, 777, t.size - 1):
        print("value", i, repr(float(t[i])))
)";
  std::string script_path = dir.file("check.py");
  ferry::testing::write_file(script_path, script);
  std::string cmd = "python3 " + script_path + " " + dir.str() + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) {
    out.append(buf, n);
  }
  ASSERT_EQ(::pclose(pipe), 0) << out;
  auto list = synth_tensor_list("llama", "tiny", DType::kBF16, false);
  EXPECT_NE(out.find("count " + std::to_string(list.size()) + "\n"), std::string::npos) << out;
  EXPECT_NE(out.find("shape [128, 256]"), std::string::npos) << out;
  std::istringstream lines(out);
  std::string line;
  int values = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("value ", 0) != 0) {
      continue;
    }
    std::istringstream fields(line.substr(6));
    std::uint64_t index;
    double value;
    fields >> index >> value;
    EXPECT_EQ(static_cast<float>(value),
              synth_value(3, "model.layers.3.mlp.down_proj.weight", index))
        << line;
    ++values;
  }
  EXPECT_EQ(values, 4);
}

// ---- command line ----------------------------------------------------------------

TEST(SynthCli, HelpAndUsageErrorsExitTwo) {
  std::string out;
  std::string err;
  EXPECT_EQ(run_cli({"--help"}, &out), 0);
  EXPECT_NE(out.find("--family"), std::string::npos);
  EXPECT_NE(out.find("deepseek_v3"), std::string::npos);
  EXPECT_NE(out.find("glm4_moe"), std::string::npos);
  EXPECT_NE(out.find("--fused-experts"), std::string::npos);
  TempDir dir;
  std::string o = dir.file("o");
  EXPECT_EQ(run_cli({"--family", "gpt2", "--preset", "tiny", "--out", o}, nullptr, &err), 2);
  EXPECT_NE(err.find("unknown family 'gpt2'"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"--family", "llama", "--preset", "xl", "--out", o}, nullptr, &err), 2);
  EXPECT_NE(err.find("unknown preset 'xl'"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"--family", "llama", "--preset", "tiny", "--dtype", "fp8", "--out", o},
                    nullptr, &err),
            2);
  EXPECT_NE(err.find("unknown dtype 'fp8'"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"--family", "llama", "--preset", "tiny", "--out", o, "--colour", "x"}, nullptr,
                    &err),
            2);
  EXPECT_NE(err.find("were not expected: x --colour"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"--family", "llama", "--preset", "tiny"}, nullptr, &err), 2);
  EXPECT_NE(err.find("--out is required"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"--family", "llama", "--preset", "tiny", "--out"}, nullptr, &err), 2);
  EXPECT_NE(err.find("--out: 1 required DIR missing"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"--family=llama", "--preset=tiny", "--out", o, "--seed", "-3"}, nullptr, &err),
            2);
  EXPECT_NE(err.find("--seed: expected a whole number, not '-3'"), std::string::npos) << err;
  EXPECT_EQ(
      run_cli({"--family=llama", "--preset=tiny", "--out", o, "--seed", "18446744073709551616"}),
      2);
  EXPECT_EQ(run_cli({"--family=llama", "--preset=tiny", "--out", o, "--shard-bytes", "0"}), 2);
  EXPECT_EQ(run_cli({"--family=llama", "--preset=tiny", "--out", o, "--shard-bytes", "9X"}), 2);
  EXPECT_EQ(run_cli({"--family=llama", "--preset=tiny", "--out", o, "stray"}), 2);
  EXPECT_EQ(run_cli({"--family=llama", "--preset=tiny", "--out", o, "--force=yes"}, nullptr, &err),
            2);
  EXPECT_NE(err.find("force was given a disallowed flag override"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(o));
}

TEST(SynthCli, WritesACheckpointAndSummarizesIt) {
  TempDir dir;
  std::string o = dir.file("ck");
  std::string out;
  ASSERT_EQ(run_cli({"--family=qwen2", "--preset", "tiny", "--out=" + o, "--seed=4", "--dtype",
                     "f16", "--shard-bytes=256K", "--tie-embeddings", "--no-fsync"},
                    &out),
            0);
  auto list = synth_tensor_list("qwen2", "tiny", DType::kF16, true);
  auto plan = synth_shard_plan(list, 256 << 10);
  EXPECT_NE(out.find(std::to_string(list.size()) + " tensors"), std::string::npos) << out;
  EXPECT_NE(out.find(std::to_string(total_bytes(list)) + " bytes"), std::string::npos) << out;
  EXPECT_NE(out.find("(" + std::to_string(plan.size()) + " shards)"), std::string::npos) << out;
  check_checkpoint(o, "qwen2", DType::kF16, 4, true);
  // Existing output without --force is a failure of the run (exit 1 from main).
  EXPECT_THROW(run_cli({"--family=qwen2", "--preset=tiny", "--out=" + o}), Error);
  EXPECT_EQ(run_cli({"--family=llama", "--preset=tiny", "--out=" + o, "--force", "--no-fsync"}), 0);
  check_checkpoint(o, "llama", DType::kBF16, 1);
}

TEST(SynthCli, TheBinaryExitsTwoOnUsageErrors) {
  std::string cmd =
      std::string(FERRY_BINARY) + " synth --family nope --preset tiny --out /x 2>/dev/null";
  int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
}

}  // namespace
}  // namespace ferry::synth
