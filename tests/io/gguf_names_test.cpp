// llama.cpp's names back to Hugging Face's (io/gguf_names.hpp) and config.json
// from GGUF metadata (io/gguf_config.hpp), for each architecture; the inverse of
// the converter's Q/K permutation at Llama-3-8B's sizes; DeepSeek's split kv_b_proj
// put back together.
#include "io/gguf_names.hpp"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/gguf_config.hpp"
#include "io/gguf_writer.hpp"
#include "testing/error_of.hpp"

namespace ferry::io {
namespace {

using ferry::testing::error_of;
using nlohmann::json;

// A GGUF file in memory: metadata, tensors of zeros.
struct Model {
  std::string arch;
  GgufMetadata meta;
  std::vector<GgufWriterTensor> tensors;

  explicit Model(std::string a) : arch(std::move(a)) {
    meta.emplace_back("general.architecture", GgufValue::of_string(arch));
  }
  Model& u32(const std::string& key, std::uint32_t v) {
    meta.emplace_back(arch + "." + key, GgufValue::of_u32(v));
    return *this;
  }
  Model& f32(const std::string& key, float v) {
    meta.emplace_back(arch + "." + key, GgufValue::of_f32(v));
    return *this;
  }
  Model& flag(const std::string& key, bool v) {
    meta.emplace_back(arch + "." + key, GgufValue::of_bool(v));
    return *this;
  }
  Model& t(std::string name, std::vector<std::uint64_t> dims, GgmlType type = GgmlType::kF16) {
    tensors.push_back({std::move(name), type, std::move(dims)});
    return *this;
  }
  Model& without(std::string_view key) {
    std::erase_if(meta, [&](const auto& kv) { return kv.first == key; });
    return *this;
  }
  GgufHeader header() const {
    std::vector<GgufWriterTensor> ts = tensors;
    gguf_header_bytes(meta, ts, 32, "m.gguf");  // sizes each tensor
    std::vector<std::vector<std::byte>> data;
    std::vector<std::span<const std::byte>> spans;
    for (const GgufWriterTensor& w : ts) {
      data.emplace_back(w.nbytes);
    }
    for (const auto& d : data) {
      spans.emplace_back(d);
    }
    return parse_gguf_header(gguf_file_bytes(meta, tensors, spans), "m.gguf");
  }
};

// The dense decoder's keys every architecture writes: hidden 64, 8 heads of 8.
Model& dense_keys(Model& m, std::uint32_t kv_heads) {
  return m.u32("block_count", 1)
      .u32("context_length", 4096)
      .u32("embedding_length", 64)
      .u32("feed_forward_length", 128)
      .u32("attention.head_count", 8)
      .u32("attention.head_count_kv", kv_heads)
      .f32("attention.layer_norm_rms_epsilon", 1e-5f)
      .f32("rope.freq_base", 500000.0f);
}

Model& dense_layer(Model& m, bool output = true) {
  m.t("token_embd.weight", {64, 100});
  m.t("output_norm.weight", {64}, GgmlType::kF32);
  if (output) {
    m.t("output.weight", {64, 100});
  }
  m.t("blk.0.attn_norm.weight", {64}, GgmlType::kF32);
  m.t("blk.0.attn_q.weight", {64, 64}, GgmlType::kQ8_0);
  m.t("blk.0.attn_k.weight", {64, 16}, GgmlType::kQ8_0);
  m.t("blk.0.attn_v.weight", {64, 16});
  m.t("blk.0.attn_output.weight", {64, 64});
  m.t("blk.0.ffn_norm.weight", {64}, GgmlType::kF32);
  m.t("blk.0.ffn_gate.weight", {64, 128});
  m.t("blk.0.ffn_up.weight", {64, 128});
  m.t("blk.0.ffn_down.weight", {128, 64});
  return m;
}

const GgufHfTensor& by_gguf(const GgufHfMap& map, std::string_view name) {
  for (const GgufHfTensor& t : map.tensors) {
    if (t.gguf_name == name) {
      return t;
    }
  }
  throw std::runtime_error("no " + std::string(name));
}

std::vector<std::string> hf_names(const GgufHfMap& map) {
  std::vector<std::string> out;
  for (const GgufHfTensor& t : map.tensors) {
    for (const GgufHfPiece& p : t.pieces) {
      out.push_back(p.hf_name);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(GgufNames, LlamaMapsEveryTensorAndMarksQAndKForUnpermuting) {
  Model m("llama");
  dense_keys(m, 2).u32("rope.dimension_count", 8);
  dense_layer(m).t("rope_freqs.weight", {4}, GgmlType::kF32);
  const GgufHeader h = m.header();
  const GgufHfMap map = map_gguf_to_hf(h);
  EXPECT_EQ(map.arch, GgufArch::kLlama);
  EXPECT_EQ(map.skipped, (std::vector<std::string>{"rope_freqs.weight"}));
  EXPECT_EQ(hf_names(map), (std::vector<std::string>{
                               "lm_head.weight",
                               "model.embed_tokens.weight",
                               "model.layers.0.input_layernorm.weight",
                               "model.layers.0.mlp.down_proj.weight",
                               "model.layers.0.mlp.gate_proj.weight",
                               "model.layers.0.mlp.up_proj.weight",
                               "model.layers.0.post_attention_layernorm.weight",
                               "model.layers.0.self_attn.k_proj.weight",
                               "model.layers.0.self_attn.o_proj.weight",
                               "model.layers.0.self_attn.q_proj.weight",
                               "model.layers.0.self_attn.v_proj.weight",
                               "model.norm.weight",
                           }));
  const GgufHfTensor& q = by_gguf(map, "blk.0.attn_q.weight");
  EXPECT_EQ(q.how, GgufToHf::kUnpermuteRows);
  EXPECT_EQ(q.heads, 8u);
  EXPECT_EQ(q.rows, 64u);
  EXPECT_EQ(q.row_bytes, 68u);  // two Q8_0 blocks
  const GgufHfTensor& k = by_gguf(map, "blk.0.attn_k.weight");
  EXPECT_EQ(k.heads, 2u);  // permuted with n_head_kv
  EXPECT_EQ(k.rows, 16u);
  EXPECT_EQ(k.pieces[0].hf_shape, (std::vector<std::uint64_t>{16, 64}));
  EXPECT_EQ(k.pieces[0].offset, h.find_tensor("blk.0.attn_k.weight")->offset);
  EXPECT_EQ(by_gguf(map, "blk.0.attn_v.weight").how, GgufToHf::kSame);

  const GgufHfConfig cfg = gguf_hf_config(h);
  const json& c = cfg.config;
  EXPECT_EQ(c["architectures"], json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(c["model_type"], "llama");
  EXPECT_EQ(c["vocab_size"], 100);
  EXPECT_EQ(c["hidden_size"], 64);
  EXPECT_EQ(c["intermediate_size"], 128);
  EXPECT_EQ(c["num_hidden_layers"], 1);
  EXPECT_EQ(c["num_attention_heads"], 8);
  EXPECT_EQ(c["num_key_value_heads"], 2);
  EXPECT_EQ(c["head_dim"], 8);
  EXPECT_EQ(c["max_position_embeddings"], 4096);
  EXPECT_EQ(c["rms_norm_eps"].get<double>(), 1e-5);  // f32's shortest decimal, not 9.99e-06
  EXPECT_EQ(c["rope_theta"].get<double>(), 500000.0);
  EXPECT_EQ(c["tie_word_embeddings"], false);
  EXPECT_EQ(c["torch_dtype"], "float16");
  EXPECT_EQ(c["attention_bias"], false);
  EXPECT_FALSE(c.contains("rope_scaling"));
  ASSERT_EQ(cfg.notes.size(), 1u);
  EXPECT_NE(cfg.notes[0].find("rope_freqs.weight"), std::string::npos);
}

TEST(GgufNames, LlamaWithoutOutputTiesAndMixtralSplitsItsExperts) {
  Model m("llama");
  dense_keys(m, 8).u32("expert_count", 4).u32("expert_used_count", 2);
  dense_layer(m, /*output=*/false);
  m.t("blk.0.ffn_gate_inp.weight", {64, 4}, GgmlType::kF32);
  m.t("blk.0.ffn_gate_exps.weight", {64, 32, 4}, GgmlType::kQ8_0);
  m.t("blk.0.ffn_up_exps.weight", {64, 32, 4}, GgmlType::kQ8_0);
  m.t("blk.0.ffn_down_exps.weight", {32, 64, 4}, GgmlType::kQ8_0);
  const GgufHeader h = m.header();
  const GgufHfMap map = map_gguf_to_hf(h);
  const GgufHfTensor& gate = by_gguf(map, "blk.0.ffn_gate_exps.weight");
  EXPECT_EQ(gate.how, GgufToHf::kExperts);
  ASSERT_EQ(gate.pieces.size(), 4u);
  const GgufTensorInfo& info = *h.find_tensor("blk.0.ffn_gate_exps.weight");
  for (std::uint64_t e = 0; e < 4; ++e) {
    const GgufHfPiece& p = gate.pieces[e];
    EXPECT_EQ(p.hf_name,
              "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".w1.weight");
    EXPECT_EQ(p.nbytes, 32u * 68u);  // 32 rows of 64 Q8_0 elements
    EXPECT_EQ(p.offset, info.offset + e * p.nbytes);
    EXPECT_EQ(p.hf_shape, (std::vector<std::uint64_t>{32, 64}));
  }
  EXPECT_EQ(by_gguf(map, "blk.0.ffn_down_exps.weight").pieces[3].hf_name,
            "model.layers.0.block_sparse_moe.experts.3.w2.weight");
  EXPECT_EQ(by_gguf(map, "blk.0.ffn_up_exps.weight").pieces[0].hf_shape,
            (std::vector<std::uint64_t>{32, 64}));
  EXPECT_EQ(by_gguf(map, "blk.0.ffn_gate_inp.weight").pieces[0].hf_name,
            "model.layers.0.block_sparse_moe.gate.weight");
  const json c = gguf_hf_config(h).config;
  EXPECT_EQ(c["architectures"], json::array({"MixtralForCausalLM"}));
  EXPECT_EQ(c["num_local_experts"], 4);
  EXPECT_EQ(c["num_experts_per_tok"], 2);
  EXPECT_EQ(c["tie_word_embeddings"], true);
}

TEST(GgufNames, Qwen2KeepsItsBiasesUnpermuted) {
  Model m("qwen2");
  dense_keys(m, 2);
  dense_layer(m);
  m.t("blk.0.attn_q.bias", {64}, GgmlType::kF32)
      .t("blk.0.attn_k.bias", {16}, GgmlType::kF32)
      .t("blk.0.attn_v.bias", {16}, GgmlType::kF32);
  const GgufHeader h = m.header();
  const GgufHfMap map = map_gguf_to_hf(h);
  EXPECT_EQ(by_gguf(map, "blk.0.attn_q.weight").how, GgufToHf::kSame);
  EXPECT_EQ(by_gguf(map, "blk.0.attn_q.bias").pieces[0].hf_name,
            "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(by_gguf(map, "blk.0.attn_k.bias").how, GgufToHf::kSame);
  const json c = gguf_hf_config(h).config;
  EXPECT_EQ(c["architectures"], json::array({"Qwen2ForCausalLM"}));
  EXPECT_EQ(c["model_type"], "qwen2");
}

TEST(GgufNames, LlamaBiasesArePermutedToo) {
  Model m("llama");
  dense_keys(m, 2);
  dense_layer(m);
  m.t("blk.0.attn_q.bias", {64}, GgmlType::kF32).t("blk.0.attn_k.bias", {16}, GgmlType::kF32);
  const GgufHeader h = m.header();
  const GgufHfMap map = map_gguf_to_hf(h);
  const GgufHfTensor& b = by_gguf(map, "blk.0.attn_k.bias");
  EXPECT_EQ(b.how, GgufToHf::kUnpermuteRows);
  EXPECT_EQ(b.rows, 16u);
  EXPECT_EQ(b.row_bytes, 4u);
  EXPECT_EQ(gguf_hf_config(h).config["attention_bias"], true);
}

TEST(GgufNames, Qwen3HasQKNormsAndItsOwnHeadDim) {
  Model m("qwen3");
  dense_keys(m, 2).u32("attention.key_length", 16).u32("attention.value_length", 16);
  m.t("token_embd.weight", {64, 100}, GgmlType::kBF16)
      .t("output_norm.weight", {64}, GgmlType::kF32)
      .t("blk.0.attn_q.weight", {64, 128}, GgmlType::kBF16)
      .t("blk.0.attn_q_norm.weight", {16}, GgmlType::kF32)
      .t("blk.0.attn_k_norm.weight", {16}, GgmlType::kF32);
  const GgufHeader h = m.header();
  const GgufHfMap map = map_gguf_to_hf(h);
  EXPECT_EQ(by_gguf(map, "blk.0.attn_q_norm.weight").pieces[0].hf_name,
            "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(by_gguf(map, "blk.0.attn_k_norm.weight").pieces[0].hf_name,
            "model.layers.0.self_attn.k_norm.weight");
  EXPECT_EQ(by_gguf(map, "blk.0.attn_q.weight").how, GgufToHf::kSame);
  const json c = gguf_hf_config(h).config;
  EXPECT_EQ(c["architectures"], json::array({"Qwen3ForCausalLM"}));
  EXPECT_EQ(c["head_dim"], 16);
  EXPECT_EQ(c["torch_dtype"], "bfloat16");
  EXPECT_EQ(c["tie_word_embeddings"], true);
}

TEST(GgufNames, Qwen3MoeMapsRouterAndExperts) {
  Model m("qwen3moe");
  dense_keys(m, 2)
      .u32("expert_count", 8)
      .u32("expert_used_count", 2)
      .u32("expert_feed_forward_length", 32)
      .without("qwen3moe.feed_forward_length");
  m.t("token_embd.weight", {64, 100})
      .t("blk.0.ffn_gate_inp.weight", {64, 8}, GgmlType::kF32)
      .t("blk.0.ffn_gate_exps.weight", {64, 32, 8})
      .t("blk.0.ffn_down_exps.weight", {32, 64, 8});
  const GgufHeader h = m.header();
  const GgufHfMap map = map_gguf_to_hf(h);
  EXPECT_EQ(by_gguf(map, "blk.0.ffn_gate_inp.weight").pieces[0].hf_name,
            "model.layers.0.mlp.gate.weight");
  const GgufHfTensor& down = by_gguf(map, "blk.0.ffn_down_exps.weight");
  ASSERT_EQ(down.pieces.size(), 8u);
  EXPECT_EQ(down.pieces[7].hf_name, "model.layers.0.mlp.experts.7.down_proj.weight");
  EXPECT_EQ(down.pieces[7].hf_shape, (std::vector<std::uint64_t>{64, 32}));
  EXPECT_EQ(down.pieces[7].nbytes, 64u * 32u * 2u);
  const json c = gguf_hf_config(h).config;
  EXPECT_EQ(c["architectures"], json::array({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(c["num_experts"], 8);
  EXPECT_EQ(c["num_experts_per_tok"], 2);
  EXPECT_EQ(c["moe_intermediate_size"], 32);
  EXPECT_EQ(c["intermediate_size"], 32);  // no dense size in the file: the experts'
  EXPECT_EQ(c["norm_topk_prob"], true);
}

// DeepSeek-V3 as current llama.cpp converts it: 4 heads, q LoRA 24, kv LoRA 16,
// nope 8, rope 4, v 6; 2 layers, the first dense.
Model deepseek_v3() {
  Model m("deepseek2");
  m.u32("block_count", 2)
      .u32("context_length", 163840)
      .u32("embedding_length", 64)
      .u32("feed_forward_length", 96)
      .u32("attention.head_count", 4)
      .u32("attention.head_count_kv", 1)
      .f32("attention.layer_norm_rms_epsilon", 1e-6f)
      .f32("rope.freq_base", 10000.0f)
      .u32("leading_dense_block_count", 1)
      .u32("attention.q_lora_rank", 24)
      .u32("attention.kv_lora_rank", 16)
      .u32("attention.key_length", 16 + 4)
      .u32("attention.value_length", 16)
      .u32("attention.key_length_mla", 8 + 4)
      .u32("attention.value_length_mla", 6)
      .u32("expert_feed_forward_length", 32)
      .u32("expert_count", 8)
      .u32("expert_shared_count", 1)
      .u32("expert_used_count", 2)
      .f32("expert_weights_scale", 2.5f)
      .flag("expert_weights_norm", true)
      .u32("expert_gating_func", 2)
      .u32("expert_group_count", 4)
      .u32("expert_group_used_count", 2)
      .u32("rope.dimension_count", 4);
  m.meta.emplace_back("deepseek2.rope.scaling.type", GgufValue::of_string("yarn"));
  m.f32("rope.scaling.factor", 40.0f).u32("rope.scaling.original_context_length", 4096);
  m.f32("rope.scaling.yarn_log_multiplier", 0.1f);
  m.t("token_embd.weight", {64, 100}, GgmlType::kBF16)
      .t("output.weight", {64, 100}, GgmlType::kBF16)
      .t("blk.0.attn_q_a.weight", {64, 24})
      .t("blk.0.attn_q_a_norm.weight", {24}, GgmlType::kF32)
      .t("blk.0.attn_q_b.weight", {24, 4 * 12})
      .t("blk.0.attn_kv_a_mqa.weight", {64, 16 + 4})
      .t("blk.0.attn_kv_a_norm.weight", {16}, GgmlType::kF32)
      .t("blk.0.attn_k_b.weight", {8, 16, 4})
      .t("blk.0.attn_v_b.weight", {16, 6, 4})
      .t("blk.0.attn_output.weight", {4 * 6, 64})
      .t("blk.0.ffn_gate.weight", {64, 96})
      .t("blk.1.ffn_gate_inp.weight", {64, 8}, GgmlType::kF32)
      .t("blk.1.exp_probs_b.bias", {8}, GgmlType::kF32)
      .t("blk.1.ffn_up_exps.weight", {64, 32, 8})
      .t("blk.1.ffn_gate_shexp.weight", {64, 32});
  return m;
}

TEST(GgufNames, DeepseekV3MapsMlaTheSplitKvBAndTheRouterBias) {
  const GgufHeader h = deepseek_v3().header();
  const GgufHfMap map = map_gguf_to_hf(h);
  EXPECT_EQ(by_gguf(map, "blk.0.attn_q_a.weight").pieces[0].hf_name,
            "model.layers.0.self_attn.q_a_proj.weight");
  EXPECT_EQ(by_gguf(map, "blk.0.attn_q_a_norm.weight").pieces[0].hf_name,
            "model.layers.0.self_attn.q_a_layernorm.weight");
  EXPECT_EQ(by_gguf(map, "blk.0.attn_q_b.weight").pieces[0].hf_name,
            "model.layers.0.self_attn.q_b_proj.weight");
  EXPECT_EQ(by_gguf(map, "blk.0.attn_kv_a_mqa.weight").pieces[0].hf_name,
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
  EXPECT_EQ(by_gguf(map, "blk.0.attn_kv_a_norm.weight").pieces[0].hf_name,
            "model.layers.0.self_attn.kv_a_layernorm.weight");
  const GgufHfTensor& kb = by_gguf(map, "blk.0.attn_k_b.weight");
  const GgufHfTensor& vb = by_gguf(map, "blk.0.attn_v_b.weight");
  EXPECT_EQ(kb.how, GgufToHf::kMlaKB);
  EXPECT_EQ(vb.how, GgufToHf::kMlaVB);
  EXPECT_EQ(kb.pieces[0].hf_name, "model.layers.0.self_attn.kv_b_proj.weight");
  EXPECT_EQ(kb.pieces[0].hf_shape, (std::vector<std::uint64_t>{4 * (8 + 6), 16}));
  EXPECT_EQ(vb.pieces[0].hf_shape, kb.pieces[0].hf_shape);
  EXPECT_EQ(by_gguf(map, "blk.1.exp_probs_b.bias").pieces[0].hf_name,
            "model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(by_gguf(map, "blk.1.ffn_gate_shexp.weight").pieces[0].hf_name,
            "model.layers.1.mlp.shared_experts.gate_proj.weight");
  EXPECT_EQ(by_gguf(map, "blk.1.ffn_up_exps.weight").pieces[5].hf_name,
            "model.layers.1.mlp.experts.5.up_proj.weight");
  EXPECT_EQ(by_gguf(map, "blk.0.ffn_gate.weight").pieces[0].hf_name,
            "model.layers.0.mlp.gate_proj.weight");

  const GgufHfConfig cfg = gguf_hf_config(h);
  const json& c = cfg.config;
  EXPECT_EQ(c["architectures"], json::array({"DeepseekV3ForCausalLM"}));
  EXPECT_EQ(c["model_type"], "deepseek_v3");
  EXPECT_EQ(c["num_key_value_heads"], 4);  // MLA, not the MQA head count of 1
  EXPECT_EQ(c["attention_bias"], false);
  EXPECT_EQ(c["q_lora_rank"], 24);
  EXPECT_EQ(c["kv_lora_rank"], 16);
  EXPECT_EQ(c["qk_rope_head_dim"], 4);
  EXPECT_EQ(c["qk_nope_head_dim"], 8);
  EXPECT_EQ(c["v_head_dim"], 6);
  EXPECT_EQ(c["n_routed_experts"], 8);
  EXPECT_EQ(c["n_shared_experts"], 1);
  EXPECT_EQ(c["num_experts_per_tok"], 2);
  EXPECT_EQ(c["moe_intermediate_size"], 32);
  EXPECT_EQ(c["intermediate_size"], 96);
  EXPECT_EQ(c["first_k_dense_replace"], 1);
  EXPECT_EQ(c["routed_scaling_factor"].get<double>(), 2.5);
  EXPECT_EQ(c["norm_topk_prob"], true);
  EXPECT_EQ(c["n_group"], 4);
  EXPECT_EQ(c["topk_group"], 2);
  EXPECT_EQ(c["scoring_func"], "sigmoid");
  EXPECT_EQ(c["topk_method"], "noaux_tc");
  EXPECT_EQ(c["rms_norm_eps"].get<double>(), 1e-6);
  EXPECT_EQ(c["rope_scaling"]["type"], "yarn");
  EXPECT_EQ(c["rope_scaling"]["factor"].get<double>(), 40.0);
  EXPECT_EQ(c["rope_scaling"]["original_max_position_embeddings"], 4096);
  EXPECT_NEAR(c["rope_scaling"]["mscale_all_dim"].get<double>(), 1.0, 1e-12);
  EXPECT_EQ(c["torch_dtype"], "float16");
  EXPECT_TRUE(cfg.notes.empty());
}

TEST(GgufNames, DeepseekV3IsToldBySigmoidGatingOrTheRouterBias) {
  // Without the gating key, the exp_probs_b tensor still says V3.
  const GgufHeader bias_only = deepseek_v3().without("deepseek2.expert_gating_func").header();
  EXPECT_EQ(gguf_hf_config(bias_only).config["architectures"],
            json::array({"DeepseekV3ForCausalLM"}));
  // A V2 file from before the MLA change: attn_kv_b whole, softmax, no bias, the
  // per-head widths in key/value_length.
  Model v2 = deepseek_v3();
  v2.without("deepseek2.expert_gating_func")
      .without("deepseek2.attention.key_length_mla")
      .without("deepseek2.attention.value_length_mla")
      .without("deepseek2.attention.key_length")
      .without("deepseek2.attention.value_length")
      .without("deepseek2.expert_group_count")
      .without("deepseek2.expert_group_used_count")
      .u32("attention.key_length", 12)
      .u32("attention.value_length", 6)
      .u32("expert_gating_func", 1);
  std::erase_if(v2.tensors, [](const GgufWriterTensor& t) {
    return t.name == "blk.1.exp_probs_b.bias" || t.name.find("_b.weight") != std::string::npos;
  });
  v2.t("blk.0.attn_kv_b.weight", {16, 4 * 14});
  const GgufHeader h = v2.header();
  const GgufHfMap map = map_gguf_to_hf(h);
  EXPECT_EQ(by_gguf(map, "blk.0.attn_kv_b.weight").how, GgufToHf::kSame);
  EXPECT_EQ(by_gguf(map, "blk.0.attn_kv_b.weight").pieces[0].hf_shape,
            (std::vector<std::uint64_t>{56, 16}));
  const json c = gguf_hf_config(h).config;
  EXPECT_EQ(c["architectures"], json::array({"DeepseekV2ForCausalLM"}));
  EXPECT_EQ(c["scoring_func"], "softmax");
  EXPECT_EQ(c["topk_method"], "greedy");
  EXPECT_EQ(c["qk_nope_head_dim"], 8);
  EXPECT_EQ(c["v_head_dim"], 6);
  // A V3 file without group counts says so.
  const GgufHfConfig old = gguf_hf_config(deepseek_v3()
                                              .without("deepseek2.expert_group_count")
                                              .without("deepseek2.expert_group_used_count")
                                              .header());
  ASSERT_EQ(old.notes.size(), 1u);
  EXPECT_NE(old.notes[0].find("n_group"), std::string::npos);
}

TEST(GgufNames, RefusesWhatItCannotMapByName) {
  Model gemma("gemma");
  gemma.t("token_embd.weight", {64, 100});
  EXPECT_NE(error_of(Stage::kMapping, [&] { map_gguf_to_hf(gemma.header()); })
                .find("architecture 'gemma' is not mapped"),
            std::string::npos);
  EXPECT_NE(error_of(Stage::kConfig, [&] { gguf_hf_config(gemma.header()); })
                .find("architecture 'gemma' has no Hugging Face config mapping"),
            std::string::npos);
  Model odd("qwen3");
  odd.t("blk.0.attn_k_b.weight", {8, 16, 4}).t("blk.01.attn_q.weight", {8, 8});
  const std::string e = error_of(Stage::kMapping, [&] { map_gguf_to_hf(odd.header()); });
  EXPECT_NE(e.find("tensor 'blk.0.attn_k_b.weight': not a tensor name of llama.cpp's 'qwen3'"),
            std::string::npos)
      << e;
  EXPECT_EQ(match_gguf_name(GgufArch::kQwen3, "blk.01.attn_q.weight"), std::nullopt);
  EXPECT_EQ(match_gguf_name(GgufArch::kQwen3, "blk.x.attn_q.weight"), std::nullopt);
  EXPECT_EQ(match_gguf_name(GgufArch::kQwen3, "blk.7.attn_q.weight")->hf_name,
            "model.layers.7.self_attn.q_proj.weight");
  Model fused("qwen3moe");
  fused.t("blk.0.ffn_gate_up_exps.weight", {64, 64, 8});
  EXPECT_NE(error_of(Stage::kMapping, [&] { map_gguf_to_hf(fused.header()); })
                .find("fused gate/up experts"),
            std::string::npos);
  Model wrong("qwen3moe");
  wrong.u32("expert_count", 4).t("blk.0.ffn_up_exps.weight", {64, 32, 8});
  EXPECT_NE(error_of(Stage::kMapping, [&] { map_gguf_to_hf(wrong.header()); })
                .find("holds 8 experts, but qwen3moe.expert_count is 4"),
            std::string::npos);
  Model half("deepseek2");
  half.t("blk.0.attn_k_b.weight", {8, 16, 4});
  EXPECT_NE(error_of(Stage::kMapping, [&] { map_gguf_to_hf(half.header()); })
                .find("blk.0.attn_v_b.weight, is missing"),
            std::string::npos);
  Model no_heads("llama");
  no_heads.t("blk.0.attn_q.weight", {8, 8});
  EXPECT_NE(error_of(Stage::kMapping, [&] { map_gguf_to_hf(no_heads.header()); })
                .find("metadata key 'llama.attention.head_count' is missing"),
            std::string::npos);
}

// match_hf_name reads the same tables backwards: every name match_gguf_name gives
// maps back to its GGUF tensor (experts to their stack and place), but kv_b_proj,
// which the current converter writes as attn_k_b then attn_v_b only.
TEST(GgufNames, HfNamesMapForwardAsTheConverterNamesThem) {
  const std::vector<std::string> layer_names = {
      "attn_norm.weight",      "ffn_norm.weight",      "attn_output.weight",
      "attn_output.bias",      "ffn_gate.weight",      "ffn_up.weight",
      "ffn_down.weight",       "attn_q.weight",        "attn_k.weight",
      "attn_v.weight",         "attn_q.bias",          "attn_k.bias",
      "attn_v.bias",           "attn_q_norm.weight",   "attn_k_norm.weight",
      "ffn_gate_inp.weight",   "ffn_gate_exps.weight", "ffn_up_exps.weight",
      "ffn_down_exps.weight",  "attn_q_a.weight",      "attn_q_a_norm.weight",
      "attn_q_b.weight",       "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight",
      "attn_kv_b.weight",      "attn_k_b.weight",      "attn_v_b.weight",
      "ffn_gate_shexp.weight", "ffn_up_shexp.weight",  "ffn_down_shexp.weight",
      "exp_probs_b.bias",      "attn_rot_embd.weight"};
  std::size_t checked = 0;
  for (GgufArch arch : {GgufArch::kLlama, GgufArch::kQwen2, GgufArch::kQwen3, GgufArch::kQwen3Moe,
                        GgufArch::kDeepseek2}) {
    std::vector<std::string> names = {"token_embd.weight", "output_norm.weight", "output.weight"};
    for (const std::string& n : layer_names) {
      names.push_back("blk.12." + n);
    }
    for (const std::string& g : names) {
      SCOPED_TRACE(std::string(gguf_arch_name(arch)) + " " + g);
      const std::optional<GgufNameRule> rule = match_gguf_name(arch, g);
      if (!rule || rule->how == GgufToHf::kNone) {
        continue;
      }
      std::string hf = rule->hf_name;
      if (rule->how == GgufToHf::kExperts) {
        hf.replace(hf.find("{E}"), 3, "3");
      }
      const std::vector<HfGgufTarget> back = match_hf_name(arch, hf);
      if (g == "blk.12.attn_kv_b.weight" || g == "blk.12.attn_k_b.weight" ||
          g == "blk.12.attn_v_b.weight") {
        ASSERT_EQ(back.size(), 2u);
        EXPECT_EQ(back[0].gguf_name, "blk.12.attn_k_b.weight");
        EXPECT_EQ(back[0].how, GgufToHf::kMlaKB);
        EXPECT_EQ(back[1].gguf_name, "blk.12.attn_v_b.weight");
        EXPECT_EQ(back[1].how, GgufToHf::kMlaVB);
        ++checked;
        continue;
      }
      ASSERT_EQ(back.size(), 1u) << hf;
      EXPECT_EQ(back[0].gguf_name, g);
      EXPECT_EQ(back[0].how, rule->how);
      EXPECT_EQ(back[0].key, rule->key);
      EXPECT_EQ(back[0].expert, rule->how == GgufToHf::kExperts ? 3u : 0u);
      ++checked;
    }
  }
  EXPECT_GE(checked, 80u);
  // Names an architecture does not have, and malformed layer or expert numbers.
  EXPECT_TRUE(match_hf_name(GgufArch::kQwen2, "model.layers.0.self_attn.q_norm.weight").empty());
  EXPECT_TRUE(match_hf_name(GgufArch::kLlama, "model.layers.01.mlp.up_proj.weight").empty());
  EXPECT_TRUE(match_hf_name(GgufArch::kLlama, "model.layers.x.mlp.up_proj.weight").empty());
  EXPECT_TRUE(
      match_hf_name(GgufArch::kQwen3Moe, "model.layers.0.mlp.experts.07.up_proj.weight").empty());
  EXPECT_TRUE(
      match_hf_name(GgufArch::kQwen3Moe, "model.layers.0.mlp.experts..up_proj.weight").empty());
  EXPECT_TRUE(match_hf_name(GgufArch::kLlama, "model.rotary_emb.inv_freq").empty());
  // Mixtral's w1/w2/w3 are the llama architecture's stacks.
  const std::vector<HfGgufTarget> w2 =
      match_hf_name(GgufArch::kLlama, "model.layers.5.block_sparse_moe.experts.6.w2.weight");
  ASSERT_EQ(w2.size(), 1u);
  EXPECT_EQ(w2[0].gguf_name, "blk.5.ffn_down_exps.weight");
  EXPECT_EQ(w2[0].expert, 6u);
  const std::vector<HfGgufTarget> k =
      match_hf_name(GgufArch::kLlama, "model.layers.0.self_attn.k_proj.weight");
  ASSERT_EQ(k.size(), 1u);
  EXPECT_EQ(k[0].how, GgufToHf::kUnpermuteRows);
  EXPECT_TRUE(k[0].key);
}

TEST(GgufNames, ConfigNamesTheMissingKey) {
  for (const char* key : {"llama.block_count", "llama.embedding_length",
                          "llama.attention.head_count", "llama.context_length",
                          "llama.attention.layer_norm_rms_epsilon", "llama.feed_forward_length"}) {
    Model m("llama");
    dense_keys(m, 2);
    dense_layer(m);
    m.without(key);
    const std::string e = error_of(Stage::kConfig, [&] { gguf_hf_config(m.header()); });
    EXPECT_NE(e.find("metadata key '" + std::string(key) + "' is missing"), std::string::npos) << e;
    EXPECT_NE(e.find("m.gguf"), std::string::npos) << e;
  }
  for (const char* key : {"deepseek2.attention.kv_lora_rank", "deepseek2.rope.dimension_count",
                          "deepseek2.expert_count", "deepseek2.attention.value_length_mla"}) {
    const std::string e =
        error_of(Stage::kConfig, [&] { gguf_hf_config(deepseek_v3().without(key).header()); });
    EXPECT_NE(e.find("metadata key '" + std::string(key) + "' is missing"), std::string::npos) << e;
  }
  Model no_embed("llama");
  dense_keys(no_embed, 2);
  EXPECT_NE(error_of(Stage::kConfig, [&] { gguf_hf_config(no_embed.header()); })
                .find("token_embd.weight"),
            std::string::npos);
  Model zero("llama");
  dense_keys(zero, 2).without("llama.attention.head_count").u32("attention.head_count", 0);
  dense_layer(zero);
  EXPECT_NE(error_of(Stage::kConfig, [&] { gguf_hf_config(zero.header()); }).find("is 0"),
            std::string::npos);
}

// convert_hf_to_gguf.py's LlamaModel.permute on row ids, with numpy's reshape
// semantics spelled out: reshape(n_head, 2, d / 2).swapaxes(1, 2).reshape(-1).
std::vector<std::uint64_t> numpy_permute(const std::vector<std::uint64_t>& rows,
                                         std::uint64_t heads) {
  const std::uint64_t d = rows.size() / heads, half = d / 2;
  std::vector<std::uint64_t> out;
  for (std::uint64_t h = 0; h < heads; ++h) {  // the swapped array's (h, i, j) in C order
    for (std::uint64_t i = 0; i < half; ++i) {
      for (std::uint64_t j = 0; j < 2; ++j) {
        out.push_back(rows[h * d + j * half + i]);  // the original's (h, j, i)
      }
    }
  }
  return out;
}

TEST(GgufPermute, InvertsLlamaModelPermuteAtLlama3_8BSizes) {
  // Llama-3-8B: 32 heads of 128 for q (4096 rows), 8 KV heads for k (1024 rows).
  for (const auto& [rows, heads] : {std::pair{4096u, 32u}, std::pair{1024u, 8u}}) {
    std::vector<std::uint64_t> ids(rows);
    std::iota(ids.begin(), ids.end(), 0u);
    const std::vector<std::uint64_t> gguf = numpy_permute(ids, heads);
    EXPECT_EQ(gguf, llama_qk_permute_rows(rows, heads));
    const std::vector<std::uint64_t> back = llama_qk_hf_rows(rows, heads);
    for (std::uint64_t r = 0; r < rows; ++r) {
      ASSERT_EQ(gguf[back[r]], r) << rows << " rows, HF row " << r;
    }
  }
  // One head of 8 rows, by hand: GGUF holds HF rows 0 4 1 5 2 6 3 7.
  EXPECT_EQ(llama_qk_permute_rows(8, 1), (std::vector<std::uint64_t>{0, 4, 1, 5, 2, 6, 3, 7}));
  EXPECT_EQ(llama_qk_hf_rows(8, 1), (std::vector<std::uint64_t>{0, 2, 4, 6, 1, 3, 5, 7}));
  EXPECT_THROW(llama_qk_hf_rows(12, 4), std::invalid_argument);
}

TEST(GgufPermute, GatherRowsUndoesItOnQuantizedRows) {
  // k_proj of Llama-3-8B in Q8_0: 1024 rows of 4096 elements, 4352 bytes each.
  const std::uint64_t rows = 1024, heads = 8, row_bytes = 4096 / 32 * 34;
  std::vector<std::byte> hf(rows * row_bytes);
  std::mt19937 rng(5);
  for (std::byte& b : hf) {
    b = static_cast<std::byte>(rng() & 0xff);
  }
  std::vector<std::byte> gguf(hf.size()), back(hf.size());
  gather_rows(hf, gguf, row_bytes, llama_qk_permute_rows(rows, heads));
  EXPECT_NE(gguf, hf);
  gather_rows(gguf, back, row_bytes, llama_qk_hf_rows(rows, heads));
  EXPECT_EQ(back, hf);
  const std::vector<std::uint64_t> bad = {0, 2};
  std::vector<std::byte> two(8), out(8);
  EXPECT_THROW(gather_rows(two, out, 4, bad), std::invalid_argument);
}

TEST(GgufMla, SplitKvBComesBackTogether) {
  const std::uint64_t heads = 3, nope = 4, v = 5, rank = 6;
  for (std::size_t element : {std::size_t{2}, std::size_t{4}}) {
    std::vector<std::byte> kv_b(heads * (nope + v) * rank * element);
    for (std::size_t i = 0; i < kv_b.size(); ++i) {
      kv_b[i] = static_cast<std::byte>((i * 37 + 11) & 0xff);
    }
    const std::vector<std::byte> split = mla_split_kv_b(kv_b, element, heads, nope, v, rank);
    const std::size_t k_bytes = heads * rank * nope * element;
    // k_b[h][c][n] is kv_b row h (nope + v) + n, column c: the converter's transpose.
    const auto at = [&](const std::vector<std::byte>& a, std::size_t i) {
      return std::vector<std::byte>(a.begin() + static_cast<std::ptrdiff_t>(i * element),
                                    a.begin() + static_cast<std::ptrdiff_t>((i + 1) * element));
    };
    EXPECT_EQ(at(split, (1 * rank + 2) * nope + 3), at(kv_b, (1 * (nope + v) + 3) * rank + 2));
    const std::vector<std::byte> back =
        mla_kv_b_proj(std::span(split).first(k_bytes), std::span(split).subspan(k_bytes), element,
                      heads, nope, v, rank);
    EXPECT_EQ(back, kv_b);
  }
  std::vector<std::byte> small(4);
  EXPECT_THROW(mla_kv_b_proj(small, small, 2, 1, 1, 1, 1), std::invalid_argument);
}

}  // namespace
}  // namespace ferry::io
