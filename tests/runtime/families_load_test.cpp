// The families added with the descriptors through the whole runtime (the actor
// pipeline onto host devices at tp 2): Gemma 1's norm + 1 runs as a post-load hook
// that rewrites a loaded param, Phi-3's fused qkv_proj / gate_up_proj are read once
// and split, Gemma 3's embedding is whole on both ranks. Their placement is proven
// element by element in tests/models/families_test.cpp; here the values that reach
// the devices are checked against the checkpoint by plain index arithmetic.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/runtime.hpp"
#include "gpu/kernels_host.hpp"
#include "io/safetensors_writer.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::make_config;
using testing::TempDir;

using Shapes = std::map<std::string, std::vector<std::uint64_t>>;

// config.json and one BF16 shard of synth_value(1, name, i).
std::string write_checkpoint(TempDir& dir, const std::string& name, const nlohmann::json& config,
                             const Shapes& shapes) {
  const std::string out = dir.file(name);
  std::filesystem::create_directories(out);
  std::ofstream(out + "/config.json") << config.dump(2);
  io::SafetensorsWriter w(out + "/model.safetensors");
  for (const auto& [tensor, shape] : shapes) {
    w.add(tensor, DType::kBF16, shape);
  }
  w.begin();
  for (const auto& [tensor, shape] : shapes) {
    std::uint64_t n = 1;
    for (std::uint64_t d : shape) {
      n *= d;
    }
    std::vector<std::byte> bytes(n * 2);
    synth::synth_encode(DType::kBF16, 1, tensor, 0, bytes);
    w.write(bytes);
  }
  w.finish();
  return out;
}

// Element i of checkpoint tensor `name`, as its BF16 value.
float ck(const std::string& name, std::uint64_t i) {
  std::byte b[2];
  synth::synth_encode(DType::kBF16, 1, name, i, b);
  float f = 0;
  gpu::host::cast(reinterpret_cast<std::byte*>(&f), DType::kF32, b, DType::kBF16, 1);
  return f;
}

std::vector<float> values(const LoadedModel& m, std::size_t rank, const std::string& name) {
  const std::vector<std::byte> bytes = m.read_param(rank, name);
  std::vector<float> out(bytes.size() / 2);
  gpu::host::cast(reinterpret_cast<std::byte*>(out.data()), DType::kF32, bytes.data(),
                  DType::kBF16, out.size());
  return out;
}

float bf16(float v) {
  std::byte b[2];
  gpu::host::cast(b, DType::kBF16, reinterpret_cast<const std::byte*>(&v), DType::kF32, 1);
  float f = 0;
  gpu::host::cast(reinterpret_cast<std::byte*>(&f), DType::kF32, b, DType::kBF16, 1);
  return f;
}

// hidden 64, 4 q / 2 kv heads, intermediate 96, vocabulary 300, 2 layers.
nlohmann::json config_of(const std::string& architecture) {
  return {{"architectures", {architecture}}, {"hidden_size", 64}, {"num_attention_heads", 4},
          {"num_key_value_heads", 2},        {"intermediate_size", 96},
          {"num_hidden_layers", 2},          {"vocab_size", 300},
          {"torch_dtype", "bfloat16"}};
}

Shapes layer_shapes(std::uint64_t hd, bool fused, bool gemma3) {
  Shapes s{{"model.embed_tokens.weight", {300, 64}}, {"model.norm.weight", {64}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    s[p + "input_layernorm.weight"] = {64};
    s[p + "post_attention_layernorm.weight"] = {64};
    if (fused) {
      s[p + "self_attn.qkv_proj.weight"] = {8 * hd, 64};
      s[p + "mlp.gate_up_proj.weight"] = {192, 64};
    } else {
      s[p + "self_attn.q_proj.weight"] = {4 * hd, 64};
      s[p + "self_attn.k_proj.weight"] = {2 * hd, 64};
      s[p + "self_attn.v_proj.weight"] = {2 * hd, 64};
      s[p + "mlp.gate_proj.weight"] = {96, 64};
      s[p + "mlp.up_proj.weight"] = {96, 64};
    }
    s[p + "self_attn.o_proj.weight"] = {64, 4 * hd};
    s[p + "mlp.down_proj.weight"] = {64, 96};
    if (gemma3) {
      s[p + "pre_feedforward_layernorm.weight"] = {64};
      s[p + "post_feedforward_layernorm.weight"] = {64};
      s[p + "self_attn.q_norm.weight"] = {hd};
      s[p + "self_attn.k_norm.weight"] = {hd};
    }
  }
  return s;
}

TEST(FamiliesLoad, GemmaNormsArePlusOneAfterTheLoad) {
  TempDir dir;
  nlohmann::json config = config_of("GemmaForCausalLM");
  config["head_dim"] = 32;
  const std::string path = write_checkpoint(dir, "gemma", config, layer_shapes(32, false, false));
  Runtime rt(to_config(make_config(path, {"parallel.tp=2"})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  for (std::size_t rank = 0; rank < 2; ++rank) {
    for (const std::string name : {"model.norm.weight", "model.layers.1.input_layernorm.weight"}) {
      const std::vector<float> got = values(*r.model, rank, name);
      ASSERT_EQ(got.size(), 64u);
      for (std::uint64_t i = 0; i < 64; ++i) {
        ASSERT_EQ(got[i], bf16(ck(name, i) + 1.0f)) << name << " " << i;
      }
    }
    EXPECT_EQ(r.model->ranks()[rank].find("lm_head.weight"), nullptr);
  }
  // Host devices keep data: no hook was skipped (the values above show they ran).
  EXPECT_TRUE(r.model->report().hooks_skipped.empty());
}

TEST(FamiliesLoad, Phi3FusedTensorsAreSplitByTheHeadCounts) {
  TempDir dir;
  nlohmann::json config = config_of("Phi3ForCausalLM");
  config["tie_word_embeddings"] = false;
  Shapes shapes = layer_shapes(16, true, false);
  shapes["lm_head.weight"] = {300, 64};
  const std::string path = write_checkpoint(dir, "phi3", config, shapes);
  Runtime rt(to_config(make_config(path, {"parallel.tp=2"})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  // Rank 1: q heads 2-3 (fused rows 32..63), kv head 1 (k rows 64 + 16.., v rows
  // 96 + 16..); gate rows 48..95, up rows 96 + 48...
  const std::string qkv = "model.layers.0.self_attn.qkv_proj.weight";
  const std::vector<float> got = values(*r.model, 1, qkv);
  ASSERT_EQ(got.size(), 64u * 64);
  std::vector<std::uint64_t> rows;
  for (std::uint64_t i = 32; i < 64; ++i) rows.push_back(i);
  for (std::uint64_t i = 80; i < 96; ++i) rows.push_back(i);
  for (std::uint64_t i = 112; i < 128; ++i) rows.push_back(i);
  for (std::size_t k = 0; k < rows.size(); ++k) {
    for (std::uint64_t j = 0; j < 64; ++j) {
      ASSERT_EQ(got[k * 64 + j], ck(qkv, rows[k] * 64 + j)) << "row " << k;
    }
  }
  const std::string gu = "model.layers.1.mlp.gate_up_proj.weight";
  const std::vector<float> mlp = values(*r.model, 1, gu);
  ASSERT_EQ(mlp.size(), 96u * 64);
  for (std::uint64_t k = 0; k < 96; ++k) {
    const std::uint64_t row = k < 48 ? 48 + k : 96 + 48 + (k - 48);
    for (std::uint64_t j = 0; j < 64; ++j) {
      ASSERT_EQ(mlp[k * 64 + j], ck(gu, row * 64 + j)) << "row " << k;
    }
  }
  // Every tensor was placed: nothing unmapped, nothing dropped.
  EXPECT_EQ(r.model->report().tensors.placed, shapes.size());
  EXPECT_EQ(r.model->report().tensors.unmapped, 0u);
}

TEST(FamiliesLoad, Gemma3KeepsTheWholeEmbeddingOnEveryRank) {
  TempDir dir;
  nlohmann::json config = config_of("Gemma3ForCausalLM");
  config["head_dim"] = 32;
  const std::string path = write_checkpoint(dir, "gemma3", config, layer_shapes(32, false, true));
  Runtime rt(to_config(make_config(path, {"parallel.tp=2"})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  for (std::size_t rank = 0; rank < 2; ++rank) {
    const std::vector<float> embed = values(*r.model, rank, "model.embed_tokens.weight");
    ASSERT_EQ(embed.size(), 300u * 64);
    for (std::uint64_t i = 0; i < embed.size(); i += 97) {
      ASSERT_EQ(embed[i], ck("model.embed_tokens.weight", i)) << i;
    }
    // Gemma 3 stores norms as they are (its RMSNorm adds 1 in the forward).
    EXPECT_EQ(values(*r.model, rank, "model.norm.weight")[5], ck("model.norm.weight", 5));
  }
}

}  // namespace
}  // namespace ferry::runtime
