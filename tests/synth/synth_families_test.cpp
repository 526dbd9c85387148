// ferry synth's mistral, qwen2_moe, deepseek_v2 and glm4_moe families and the
// --fused-experts layout: config fields against the real models', every tensor name
// and shape against lists written here from the config's own fields, the files read
// back with ferry's safetensors parser and every element recomputed, GLM's unindexed
// mtp.safetensors seen by discovery, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/discover.hpp"
#include "io/safetensors.hpp"
#include "synth/cli_util.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::synth {
namespace {

namespace fs = std::filesystem;
using ferry::testing::read_file;
using ferry::testing::TempDir;
using nlohmann::json;
using Shape = std::vector<std::uint64_t>;

const std::vector<std::string> kNewFamilies{"mistral", "qwen2_moe", "deepseek_v2", "glm4_moe"};
const std::vector<std::string> kMoeFamilies{"mixtral",   "qwen3_moe",   "deepseek_v3",
                                            "qwen2_moe", "deepseek_v2", "glm4_moe"};

std::uint64_t u64(const json& c, const char* key) {
  return c.at(key).get<std::uint64_t>();
}

// ---- what each family must hold, from its config's fields -----------------------

struct Want {
  Shape shape;
  DType dtype = DType::kBF16;
  std::string file;  // "" = an indexed shard
};
using Wants = std::map<std::string, Want>;

// The tensors of a new family with per-expert tensors, written out from the
// architecture's module structure and the config's fields (not from synth.cpp).
Wants expected_tensors(const std::string& family, const json& c, DType dt) {
  const std::uint64_t H = u64(c, "hidden_size");
  const std::uint64_t V = u64(c, "vocab_size");
  const std::uint64_t L = u64(c, "num_hidden_layers");
  const std::uint64_t heads = u64(c, "num_attention_heads");
  Wants w;
  std::string file;
  auto add = [&](const std::string& name, Shape shape, DType dtype) {
    EXPECT_FALSE(w.count(name)) << "listed twice: " << name;
    w[name] = Want{std::move(shape), dtype, file};
  };
  auto add_w = [&](const std::string& name, Shape shape) { add(name, std::move(shape), dt); };
  auto mlp = [&](const std::string& p, std::uint64_t inter) {
    add_w(p + "gate_proj.weight", {inter, H});
    add_w(p + "up_proj.weight", {inter, H});
    add_w(p + "down_proj.weight", {H, inter});
  };
  auto gqa = [&](const std::string& p, bool qkv_bias) {
    // Qwen2-MoE writes no head_dim: hidden / heads, as its attention computes it.
    const std::uint64_t hd = c.contains("head_dim") ? u64(c, "head_dim") : H / heads;
    const std::uint64_t kv = u64(c, "num_key_value_heads");
    add_w(p + "self_attn.q_proj.weight", {heads * hd, H});
    add_w(p + "self_attn.k_proj.weight", {kv * hd, H});
    add_w(p + "self_attn.v_proj.weight", {kv * hd, H});
    add_w(p + "self_attn.o_proj.weight", {H, heads * hd});
    if (qkv_bias) {
      add_w(p + "self_attn.q_proj.bias", {heads * hd});
      add_w(p + "self_attn.k_proj.bias", {kv * hd});
      add_w(p + "self_attn.v_proj.bias", {kv * hd});
    }
  };
  auto norms = [&](const std::string& p) {
    add_w(p + "input_layernorm.weight", {H});
    add_w(p + "post_attention_layernorm.weight", {H});
  };
  // DeepSeek-V2 and GLM-4 MoE: routed experts, a router, n_shared_experts fused into
  // one wider MLP.
  auto deepseek_moe = [&](const std::string& p, bool bias) {
    const std::uint64_t E = u64(c, "n_routed_experts");
    const std::uint64_t I = u64(c, "moe_intermediate_size");
    for (std::uint64_t e = 0; e < E; ++e) {
      mlp(p + "mlp.experts." + std::to_string(e) + ".", I);
    }
    add_w(p + "mlp.gate.weight", {E, H});
    if (bias) {
      add(p + "mlp.gate.e_score_correction_bias", {E}, DType::kF32);
    }
    mlp(p + "mlp.shared_experts.", I * u64(c, "n_shared_experts"));
  };

  add_w("model.embed_tokens.weight", {V, H});
  add_w("model.norm.weight", {H});
  add_w("lm_head.weight", {V, H});
  for (std::uint64_t i = 0; i < L; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    norms(p);
    if (family == "mistral") {
      gqa(p, false);
      mlp(p + "mlp.", u64(c, "intermediate_size"));
    } else if (family == "qwen2_moe") {
      gqa(p, true);
      const std::uint64_t E = u64(c, "num_experts");
      add_w(p + "mlp.gate.weight", {E, H});
      for (std::uint64_t e = 0; e < E; ++e) {
        mlp(p + "mlp.experts." + std::to_string(e) + ".", u64(c, "moe_intermediate_size"));
      }
      mlp(p + "mlp.shared_expert.", u64(c, "shared_expert_intermediate_size"));
      add_w(p + "mlp.shared_expert_gate.weight", {1, H});
    } else if (family == "deepseek_v2") {
      const std::uint64_t nope = u64(c, "qk_nope_head_dim");
      const std::uint64_t rope = u64(c, "qk_rope_head_dim");
      const std::uint64_t vh = u64(c, "v_head_dim");
      const std::uint64_t kvl = u64(c, "kv_lora_rank");
      if (c.at("q_lora_rank").is_null()) {
        add_w(p + "self_attn.q_proj.weight", {heads * (nope + rope), H});
      } else {
        const std::uint64_t ql = u64(c, "q_lora_rank");
        add_w(p + "self_attn.q_a_proj.weight", {ql, H});
        add_w(p + "self_attn.q_a_layernorm.weight", {ql});
        add_w(p + "self_attn.q_b_proj.weight", {heads * (nope + rope), ql});
      }
      add_w(p + "self_attn.kv_a_proj_with_mqa.weight", {kvl + rope, H});
      add_w(p + "self_attn.kv_a_layernorm.weight", {kvl});
      add_w(p + "self_attn.kv_b_proj.weight", {heads * (nope + vh), kvl});
      add_w(p + "self_attn.o_proj.weight", {H, heads * vh});
      if (i < u64(c, "first_k_dense_replace")) {
        mlp(p + "mlp.", u64(c, "intermediate_size"));
      } else {
        deepseek_moe(p, false);
      }
    } else if (family == "glm4_moe") {
      gqa(p, true);
      if (i < u64(c, "first_k_dense_replace")) {
        mlp(p + "mlp.", u64(c, "intermediate_size"));
      } else {
        deepseek_moe(p, true);
      }
    } else {
      ADD_FAILURE() << "no expected list for " << family;
    }
  }
  if (family == "glm4_moe") {
    // The MTP layer: index num_hidden_layers, in the unindexed mtp.safetensors.
    const std::string p = "model.layers." + std::to_string(L) + ".";
    file = "mtp.safetensors";
    add_w(p + "enorm.weight", {H});
    add_w(p + "hnorm.weight", {H});
    add_w(p + "eh_proj.weight", {H, 2 * H});
    add_w(p + "shared_head.norm.weight", {H});
    add_w(p + "shared_head.head.weight", {V, H});
    gqa(p, true);
    deepseek_moe(p, true);
    norms(p);
  }
  return w;
}

Wants as_wants(const std::vector<SynthTensor>& list) {
  Wants w;
  for (const auto& t : list) {
    EXPECT_FALSE(w.count(t.name)) << "listed twice: " << t.name;
    w[t.name] = Want{t.shape, t.dtype, t.file};
  }
  return w;
}

void expect_same(const Wants& got, const Wants& want) {
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    if (it == got.end()) {
      ADD_FAILURE() << "missing " << name;
      continue;
    }
    EXPECT_EQ(it->second.shape, t.shape) << name;
    EXPECT_EQ(it->second.dtype, t.dtype) << name;
    EXPECT_EQ(it->second.file, t.file) << name;
  }
  for (const auto& [name, t] : got) {
    EXPECT_TRUE(want.count(name)) << "unexpected " << name;
  }
}

// "model-00001-of-00004.safetensors": five digits, "-of-", five digits. (Plain
// code, not <regex>: GCC 12's <regex> warns under -O2 with the sanitizers.)
bool is_shard_name(const std::string& file) {
  auto digits = [&](std::size_t at) {
    return std::all_of(file.begin() + static_cast<std::ptrdiff_t>(at),
                       file.begin() + static_cast<std::ptrdiff_t>(at + 5),
                       [](char c) { return c >= '0' && c <= '9'; });
  };
  return file.size() == 32 && file.compare(0, 6, "model-") == 0 && digits(6) &&
         file.compare(11, 4, "-of-") == 0 && digits(15) &&
         file.compare(20, 12, ".safetensors") == 0;
}

// "<prefix>experts.<e>.<proj>.weight" with proj one of a routed expert's.
struct ExpertName {
  std::string prefix;
  std::uint64_t expert = 0;
  std::string proj;
};
std::optional<ExpertName> parse_expert_name(const std::string& name) {
  const std::string suffix = ".weight";
  const std::size_t at = name.rfind("experts.");
  if (at == std::string::npos || name.size() < suffix.size() ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  const std::size_t e0 = at + 8;
  std::size_t e1 = e0;
  while (e1 < name.size() && name[e1] >= '0' && name[e1] <= '9') {
    ++e1;
  }
  if (e1 == e0 || e1 - e0 > 9 || e1 >= name.size() || name[e1] != '.') {
    return std::nullopt;
  }
  const std::string proj = name.substr(e1 + 1, name.size() - suffix.size() - e1 - 1);
  for (const char* p : {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}) {
    if (proj == p) {
      return ExpertName{name.substr(0, at), std::stoull(name.substr(e0, e1 - e0)), proj};
    }
  }
  return std::nullopt;
}

TEST(SynthFamilies, TensorListsMatchTheArchitectureInEveryPreset) {
  for (const auto& family : kNewFamilies) {
    for (const auto& preset : synth_presets()) {
      SCOPED_TRACE(family + "/" + preset);
      json c = synth_config(family, preset, DType::kF16, false);
      auto list = synth_tensor_list(family, preset, DType::kF16, false);
      expect_same(as_wants(list), expected_tensors(family, c, DType::kF16));
      ASSERT_FALSE(list.empty());
      EXPECT_EQ(list.front().name, "model.embed_tokens.weight");
      EXPECT_EQ(list.back().name, "lm_head.weight");
      // The MTP layer's tensors sit together, after the decoder layers.
      const std::string mtp = "model.layers." + std::to_string(u64(c, "num_hidden_layers")) + ".";
      bool seen_mtp = false;
      for (const auto& t : list) {
        if (t.name.rfind(mtp, 0) == 0) {
          seen_mtp = true;
        } else if (seen_mtp) {
          EXPECT_TRUE(t.name == "model.norm.weight" || t.name == "lm_head.weight") << t.name;
        }
      }
      EXPECT_EQ(seen_mtp, family == "glm4_moe");
    }
  }
}

// ---- config.json ------------------------------------------------------------------

// Field names of the published configs (values differ at toy sizes): Qwen1.5-MoE-A2.7B
// (plus mlp_only_layers, which Qwen2MoeConfig writes), DeepSeek-V2-Lite-Chat as
// transformers 4.49 saves it, and zai-org/GLM-4.5-Air. auto_map and
// transformers_version are left out on purpose.
// clang-format off
const std::map<std::string, std::set<std::string>> kRealFields{
    {"qwen2_moe",
     {"architectures", "attention_dropout", "bos_token_id", "decoder_sparse_step",
      "eos_token_id", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
      "max_position_embeddings", "max_window_layers", "mlp_only_layers", "model_type",
      "moe_intermediate_size", "norm_topk_prob", "num_attention_heads", "num_experts",
      "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "output_router_logits",
      "rms_norm_eps", "rope_theta", "router_aux_loss_coef", "shared_expert_intermediate_size",
      "sliding_window", "tie_word_embeddings", "torch_dtype", "use_cache", "use_sliding_window",
      "vocab_size"}},
    {"deepseek_v2",
     {"architectures", "attention_bias", "attention_dropout", "aux_loss_alpha", "bos_token_id",
      "eos_token_id", "ep_size", "first_k_dense_replace", "hidden_act", "hidden_size",
      "initializer_range", "intermediate_size", "kv_lora_rank", "max_position_embeddings",
      "model_type", "moe_intermediate_size", "moe_layer_freq", "n_group", "n_routed_experts",
      "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
      "num_hidden_layers", "num_key_value_heads", "pretraining_tp", "q_lora_rank",
      "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_scaling", "rope_theta",
      "routed_scaling_factor", "scoring_func", "seq_aux", "tie_word_embeddings", "topk_group",
      "topk_method", "torch_dtype", "use_cache", "v_head_dim", "vocab_size"}},
    {"glm4_moe",
     {"architectures", "attention_bias", "attention_dropout", "eos_token_id",
      "first_k_dense_replace", "head_dim", "hidden_act", "hidden_size", "initializer_range",
      "intermediate_size", "max_position_embeddings", "model_type", "moe_intermediate_size",
      "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
      "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
      "num_nextn_predict_layers", "pad_token_id", "partial_rotary_factor", "rms_norm_eps",
      "rope_scaling", "rope_theta", "routed_scaling_factor", "tie_word_embeddings", "topk_group",
      "torch_dtype", "use_cache", "use_qk_norm", "vocab_size"}},
};
// clang-format on

std::set<std::string> keys(const json& c) {
  std::set<std::string> out;
  for (const auto& [key, value] : c.items()) {
    out.insert(key);
  }
  return out;
}

TEST(SynthFamilies, ConfigFieldsAreTheRealModelsFields) {
  for (const auto& [family, fields] : kRealFields) {
    for (const auto& preset : synth_presets()) {
      SCOPED_TRACE(family + "/" + preset);
      EXPECT_EQ(keys(synth_config(family, preset, DType::kBF16, false)), fields);
    }
  }
  // Mistral: Mistral-7B-v0.3's own config, plus head_dim (written by newer Mistral
  // configs and by save_pretrained of current transformers).
  FERRY_NEED_TEST_DATA();
  std::string path =
      ::ferry::testing::test_data_path("models/mistral-7b-instruct-v0.3/config.json");
  json real = json::parse(read_file(path));
  std::set<std::string> want = keys(real);
  want.erase("transformers_version");
  want.insert("head_dim");
  json got = synth_config("mistral", "tiny", DType::kBF16, false);
  EXPECT_EQ(keys(got), want);
  EXPECT_EQ(got["architectures"], real["architectures"]);
  EXPECT_EQ(got["model_type"], real["model_type"]);
  EXPECT_EQ(got["sliding_window"], real["sliding_window"]);  // present, null
}

TEST(SynthFamilies, ConfigValuesAreConsistent) {
  for (const auto& family : kNewFamilies) {
    for (const auto& preset : synth_presets()) {
      SCOPED_TRACE(family + "/" + preset);
      json c = synth_config(family, preset, DType::kBF16, false);
      EXPECT_EQ(c["model_type"], family);
      EXPECT_EQ(c["tie_word_embeddings"], false);
      EXPECT_EQ(c["torch_dtype"], "bfloat16");
      EXPECT_EQ(synth_config(family, preset, DType::kBF16, true)["tie_word_embeddings"], true);
      std::uint64_t experts = 0;
      std::uint64_t top_k = c.value("num_experts_per_tok", std::uint64_t{0});
      if (family == "qwen2_moe") {
        experts = u64(c, "num_experts");
        EXPECT_EQ(c["decoder_sparse_step"], 1);
        EXPECT_EQ(c["mlp_only_layers"], json::array());
      } else if (family == "deepseek_v2" || family == "glm4_moe") {
        experts = u64(c, "n_routed_experts");
        EXPECT_LT(u64(c, "first_k_dense_replace"), u64(c, "num_hidden_layers"));
        EXPECT_EQ(experts % u64(c, "n_group"), 0u);
        EXPECT_LE(u64(c, "topk_group"), u64(c, "n_group"));
      }
      if (family != "mistral") {
        EXPECT_GE(experts, 8u);  // so that ep=8 gives every rank an expert
        EXPECT_GE(top_k, 2u);
        EXPECT_LT(top_k, experts);
      }
      if (family == "mistral" || family == "qwen2_moe") {
        EXPECT_EQ(u64(c, "num_attention_heads") % u64(c, "num_key_value_heads"), 0u);
      }
    }
  }
  json mistral = synth_config("mistral", "tiny", DType::kBF16, false);
  EXPECT_EQ(u64(mistral, "head_dim") * u64(mistral, "num_attention_heads"),
            u64(mistral, "hidden_size"));
  EXPECT_EQ(synth_config("mistral", "medium", DType::kBF16, false)["vocab_size"], 32768);

  // Tiny Qwen2-MoE's shared expert is as wide as a routed one (fusable); the others
  // keep the real 4x ratio.
  json q = synth_config("qwen2_moe", "tiny", DType::kBF16, false);
  EXPECT_EQ(q["shared_expert_intermediate_size"], q["moe_intermediate_size"]);
  EXPECT_EQ(q["norm_topk_prob"], false);
  json qs = synth_config("qwen2_moe", "small", DType::kBF16, false);
  EXPECT_EQ(u64(qs, "shared_expert_intermediate_size"), 4 * u64(qs, "moe_intermediate_size"));

  // DeepSeek-V2: tiny is V2-Lite-like (no query LoRA, greedy, one shared expert so it
  // can be fused), small is V2-like (query LoRA, group-limited, two shared experts).
  json t = synth_config("deepseek_v2", "tiny", DType::kBF16, false);
  EXPECT_TRUE(t["q_lora_rank"].is_null());
  EXPECT_EQ(t["topk_method"], "greedy");
  EXPECT_EQ(t["n_shared_experts"], 1);
  EXPECT_EQ(t["n_group"], 1);
  EXPECT_EQ(t["scoring_func"], "softmax");
  EXPECT_FALSE(t.contains("num_nextn_predict_layers"));
  EXPECT_EQ(t["num_key_value_heads"], t["num_attention_heads"]);
  json s = synth_config("deepseek_v2", "small", DType::kBF16, false);
  EXPECT_TRUE(s["q_lora_rank"].is_number_unsigned());
  EXPECT_EQ(s["topk_method"], "group_limited_greedy");
  EXPECT_EQ(s["n_shared_experts"], 2);
  EXPECT_GT(u64(s, "n_group"), 1u);
  EXPECT_TRUE(synth_config("deepseek_v2", "medium", DType::kBF16, false)["q_lora_rank"].is_null());

  // GLM-4.5-Air's attention and MoE choices.
  json g = synth_config("glm4_moe", "tiny", DType::kBF16, false);
  EXPECT_EQ(g["architectures"], json::array({"Glm4MoeForCausalLM"}));
  EXPECT_EQ(g["attention_bias"], true);
  EXPECT_EQ(g["use_qk_norm"], false);
  EXPECT_EQ(g["num_nextn_predict_layers"], 1);
  EXPECT_EQ(g["n_shared_experts"], 1);
  EXPECT_EQ(g["first_k_dense_replace"], 1);
  EXPECT_EQ(g["partial_rotary_factor"], 0.5);
  EXPECT_NE(u64(g, "head_dim") * u64(g, "num_attention_heads"), u64(g, "hidden_size"));
}

TEST(SynthFamilies, DeepseekV3MediumHasEnoughExpertsForEightWayExpertParallelism) {
  json c = synth_config("deepseek_v3", "medium", DType::kBF16, false);
  EXPECT_GE(u64(c, "n_routed_experts"), 8u);
  EXPECT_EQ(u64(c, "n_routed_experts") % 8, 0u);
  auto names = as_wants(synth_tensor_list("deepseek_v3", "medium", DType::kBF16, false));
  const std::string last = "model.layers." + std::to_string(u64(c, "num_hidden_layers") - 1) +
                           ".mlp.experts." + std::to_string(u64(c, "n_routed_experts") - 1) +
                           ".down_proj.weight";
  EXPECT_TRUE(names.count(last)) << last;
}

// ---- the files, read with ferry's own parser ----------------------------------------

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

float f16_to_float(std::uint16_t h) {
  int exp = (h >> 10) & 0x1f;
  int mant = h & 0x3ff;
  double v = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return static_cast<float>((h & 0x8000) != 0 ? -v : v);
}

struct ReadBack {
  io::WeightIndex index;
  std::map<std::string, io::TensorInfo> tensors;  // every file's, by name
  std::map<std::string, std::string> bytes;       // file name -> contents
  std::set<std::string> files;                    // safetensors files in the folder
};

ReadBack read_back(const fs::path& dir) {
  ReadBack r;
  r.index = io::read_weight_index((dir / "model.safetensors.index.json").string(), "index");
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (e.path().extension() != ".safetensors") {
      continue;
    }
    r.files.insert(name);
    io::SafetensorsHeader h = io::read_safetensors_header(e.path().string(), name);
    for (const auto& t : h.tensors) {
      EXPECT_TRUE(r.tensors.emplace(t.name, t).second) << "in two files: " << t.name;
    }
    r.bytes[name] = read_file(e.path().string());
  }
  return r;
}

float element(const ReadBack& r, const io::TensorInfo& t, std::uint64_t i) {
  const std::string& b = r.bytes.at(t.file);
  if (t.dtype == DType::kF32) {
    std::uint32_t bits;
    std::memcpy(&bits, b.data() + t.offset + i * 4, 4);
    return std::bit_cast<float>(bits);
  }
  std::uint16_t bits;
  std::memcpy(&bits, b.data() + t.offset + i * 2, 2);
  return t.dtype == DType::kBF16 ? bf16_to_float(bits) : f16_to_float(bits);
}

// Every tensor of `want` is in the folder with its shape and dtype, in the file the
// index names (or, for want.file, in that unindexed file), and every element is
// synth_value(seed, name, index).
void check_folder(const fs::path& dir, const Wants& want, std::uint64_t seed) {
  ReadBack r = read_back(dir);
  std::uint64_t indexed_bytes = 0;
  std::set<std::string> indexed_files;
  for (const auto& [name, w] : want) {
    SCOPED_TRACE(name);
    auto t = r.tensors.find(name);
    ASSERT_NE(t, r.tensors.end());
    EXPECT_EQ(t->second.shape, w.shape);
    EXPECT_EQ(t->second.dtype, w.dtype);
    EXPECT_EQ(t->second.nbytes, t->second.elements() * dtype_size(w.dtype));
    if (w.file.empty()) {
      ASSERT_TRUE(r.index.weight_map.count(name));
      EXPECT_EQ(r.index.weight_map.at(name), t->second.file);
      indexed_bytes += t->second.nbytes;
      indexed_files.insert(t->second.file);
    } else {
      EXPECT_FALSE(r.index.weight_map.count(name));
      EXPECT_EQ(t->second.file, w.file);
    }
    for (std::uint64_t i = 0; i < t->second.elements(); ++i) {
      float got = element(r, t->second, i);
      if (got != synth_value(seed, name, i)) {
        ADD_FAILURE() << "element " << i << " is " << got << ", not " << synth_value(seed, name, i);
        break;
      }
    }
  }
  EXPECT_EQ(r.tensors.size(), want.size());
  EXPECT_EQ(
      r.index.weight_map.size(), want.size() - [&] {
        std::size_t n = 0;
        for (const auto& [name, w] : want) {
          n += !w.file.empty();
        }
        return n;
      }());
  ASSERT_TRUE(r.index.total_size.has_value());
  EXPECT_EQ(*r.index.total_size, indexed_bytes);
  EXPECT_GE(indexed_files.size(), 2u);  // tiny checkpoints always have several shards
  for (const auto& file : indexed_files) {
    EXPECT_TRUE(is_shard_name(file)) << file;
    EXPECT_EQ(file.substr(15, 5), std::to_string(100000 + indexed_files.size()).substr(1));
  }
}

SynthOptions tiny_options(const std::string& family, const fs::path& out, std::uint64_t seed) {
  SynthOptions o;
  o.family = family;
  o.preset = "tiny";
  o.out = out.string();
  o.seed = seed;
  o.fsync = false;
  return o;
}

TEST(SynthFamilies, TinyCheckpointsReadBackElementByElement) {
  TempDir dir;
  for (const auto& family : kNewFamilies) {
    SCOPED_TRACE(family);
    const fs::path out = dir.path() / family;
    SynthResult result = synthesize(tiny_options(family, out, 11));
    json c = json::parse(read_file((out / "config.json").string()));
    EXPECT_EQ(c, synth_config(family, "tiny", DType::kBF16, false));
    Wants want = expected_tensors(family, c, DType::kBF16);
    check_folder(out, want, 11);
    EXPECT_EQ(result.tensors, want.size());
    std::uint64_t all = 0;
    for (const auto& [name, w] : want) {
      all += [&] {
        std::uint64_t n = dtype_size(w.dtype);
        for (auto d : w.shape) {
          n *= d;
        }
        return n;
      }();
    }
    EXPECT_EQ(result.total_bytes, all);
    EXPECT_EQ(fs::exists(out / "mtp.safetensors"), family == "glm4_moe");
    EXPECT_EQ(result.files.size(), result.shards + 2);
  }
}

TEST(SynthFamilies, F32GlmKeepsItsRouterBiasF32AndEverythingElseF32Too) {
  TempDir dir;
  SynthOptions o = tiny_options("glm4_moe", dir.path() / "g", 5);
  o.dtype = DType::kF32;
  synthesize(o);
  json c = synth_config("glm4_moe", "tiny", DType::kF32, false);
  EXPECT_EQ(c["torch_dtype"], "float32");
  check_folder(dir.path() / "g", expected_tensors("glm4_moe", c, DType::kF32), 5);
}

TEST(SynthFamilies, GlmMtpFileIsFoundByDiscoveryAndLoadsIntoTheIndex) {
  TempDir dir;
  const fs::path out = dir.path() / "glm";
  SynthOptions o = tiny_options("glm4_moe", out, 1);
  o.tie_embeddings = true;
  synthesize(o);
  json c = synth_config("glm4_moe", "tiny", DType::kBF16, true);
  io::ResolvedSource source = io::resolve_source(out.string());
  std::set<std::string> chosen;
  for (const auto& f : source.files) {
    chosen.insert(f.name);
  }
  EXPECT_TRUE(chosen.count("mtp.safetensors"));
  bool warned = false;
  for (const auto& w : source.warnings) {
    warned |= w.find("mtp.safetensors") != std::string::npos;
  }
  EXPECT_TRUE(warned);
  io::CheckpointIndex index = io::build_checkpoint_index(source);
  const std::string mtp = "model.layers." + std::to_string(u64(c, "num_hidden_layers")) + ".";
  std::size_t in_mtp = 0;
  for (const auto& t : synth_tensor_list("glm4_moe", "tiny", DType::kBF16, true)) {
    const io::TensorInfo* found = index.find(t.name);
    ASSERT_NE(found, nullptr) << t.name;
    EXPECT_EQ(found->shape, t.shape) << t.name;
    EXPECT_EQ(found->file == "mtp.safetensors", t.name.rfind(mtp, 0) == 0) << t.name;
    in_mtp += found->file == "mtp.safetensors";
  }
  EXPECT_GT(in_mtp, 10u);
  EXPECT_EQ(index.find("lm_head.weight"), nullptr);  // tied
}

// ---- fused experts ----------------------------------------------------------------

// The per-expert list with each MoE block's experts.<e>.* replaced by the two fused
// tensors, derived from the per-expert shapes.
Wants fused_from_per_expert(const std::vector<SynthTensor>& list) {
  struct Block {
    std::set<std::uint64_t> experts;
    std::uint64_t inter = 0;
    std::uint64_t hidden = 0;
    DType dtype = DType::kBF16;
    std::string file;
  };
  std::map<std::string, Block> blocks;
  Wants out;
  for (const auto& t : list) {
    const std::optional<ExpertName> m = parse_expert_name(t.name);
    if (!m) {
      out[t.name] = Want{t.shape, t.dtype, t.file};
      continue;
    }
    Block& b = blocks[m->prefix];
    b.experts.insert(m->expert);
    b.dtype = t.dtype;
    b.file = t.file;
    const bool down = m->proj == "down_proj" || m->proj == "w2";
    b.inter = down ? t.shape[1] : t.shape[0];
    b.hidden = down ? t.shape[0] : t.shape[1];
  }
  for (const auto& [prefix, b] : blocks) {
    const std::uint64_t E = b.experts.size();
    EXPECT_EQ(*b.experts.rbegin() + 1, E) << prefix;
    out[prefix + "experts.gate_up_proj"] = Want{{E, 2 * b.inter, b.hidden}, b.dtype, b.file};
    out[prefix + "experts.down_proj"] = Want{{E, b.hidden, b.inter}, b.dtype, b.file};
  }
  return out;
}

TEST(SynthFusedExperts, ListsReplaceEveryExpertSetWithTwo3DTensors) {
  for (const auto& family : kMoeFamilies) {
    for (const auto& preset : synth_presets()) {
      SCOPED_TRACE(family + "/" + preset);
      auto per_expert = synth_tensor_list(family, preset, DType::kBF16, false);
      auto fused = synth_tensor_list(family, preset, DType::kBF16, false, true);
      Wants want = fused_from_per_expert(per_expert);
      expect_same(as_wants(fused), want);
      std::size_t blocks = 0;
      for (const auto& t : fused) {
        EXPECT_EQ(t.name.find("experts.0."), std::string::npos) << t.name;
        blocks += t.name.ends_with("experts.gate_up_proj");
      }
      EXPECT_GE(blocks, 1u);
      // The fused tensor's shapes follow the config: E experts, moe width (mixtral:
      // intermediate_size), hidden.
      json c = synth_config(family, preset, DType::kBF16, false);
      const std::uint64_t E = c.contains("n_routed_experts") ? u64(c, "n_routed_experts")
                              : c.contains("num_experts")    ? u64(c, "num_experts")
                                                             : u64(c, "num_local_experts");
      const std::uint64_t I =
          family == "mixtral" ? u64(c, "intermediate_size") : u64(c, "moe_intermediate_size");
      const std::uint64_t H = u64(c, "hidden_size");
      const std::string last = "model.layers." + std::to_string(u64(c, "num_hidden_layers") - 1) +
                               (family == "mixtral" ? ".block_sparse_moe." : ".mlp.");
      auto w = as_wants(fused);
      ASSERT_TRUE(w.count(last + "experts.gate_up_proj"));
      EXPECT_EQ(w.at(last + "experts.gate_up_proj").shape, (Shape{E, 2 * I, H}));
      EXPECT_EQ(w.at(last + "experts.down_proj").shape, (Shape{E, H, I}));
    }
  }
}

TEST(SynthFusedExperts, ElementFormula) {
  // Expert 2, I = 3, H = 5: gate rows 0..2 then up rows 3..5 of a 6x5 block per expert.
  SynthElement g = synth_fused_expert_element("p.", ExpertProj::kGate, 2, 1, 4, 5, 3);
  EXPECT_EQ(g.tensor, "p.experts.gate_up_proj");
  EXPECT_EQ(g.index, 2u * 6 * 5 + 1 * 5 + 4);
  SynthElement u = synth_fused_expert_element("p.", ExpertProj::kUp, 2, 1, 4, 5, 3);
  EXPECT_EQ(u.tensor, "p.experts.gate_up_proj");
  EXPECT_EQ(u.index, 2u * 6 * 5 + (3 + 1) * 5 + 4);
  SynthElement d = synth_fused_expert_element("p.", ExpertProj::kDown, 2, 4, 1, 5, 3);
  EXPECT_EQ(d.tensor, "p.experts.down_proj");
  EXPECT_EQ(d.index, 2u * 5 * 3 + 4 * 3 + 1);
  // The last element of each tensor.
  EXPECT_EQ(synth_fused_expert_element("", ExpertProj::kUp, 7, 2, 4, 5, 3).index, 8u * 6 * 5 - 1);
  EXPECT_EQ(synth_fused_expert_element("", ExpertProj::kDown, 7, 4, 2, 5, 3).index, 8u * 5 * 3 - 1);
}

TEST(SynthFusedExperts, TinyCheckpointsReadBackAndPerExpertMatricesAreRecomputable) {
  TempDir dir;
  for (const auto& family : {"qwen2_moe", "deepseek_v2", "glm4_moe", "mixtral"}) {
    SCOPED_TRACE(family);
    const fs::path out = dir.path() / family;
    SynthOptions o = tiny_options(family, out, 3);
    o.fused_experts = true;
    SynthResult result = synthesize(o);
    Wants want = fused_from_per_expert(synth_tensor_list(family, "tiny", DType::kBF16, false));
    EXPECT_EQ(result.tensors, want.size());
    check_folder(out, want, 3);

    // Expert e's gate/up/down matrices, read from the fused tensors at the documented
    // positions, are the fused names' values there (first and last expert; every
    // element of the fused tensors was checked above).
    ReadBack r = read_back(out);
    json c = synth_config(family, "tiny", DType::kBF16, false);
    const std::string p = std::string("model.layers.1.") +
                          (std::string(family) == "mixtral" ? "block_sparse_moe." : "mlp.");
    const io::TensorInfo& gu = r.tensors.at(p + "experts.gate_up_proj");
    const io::TensorInfo& dn = r.tensors.at(p + "experts.down_proj");
    const std::uint64_t E = gu.shape[0];
    const std::uint64_t I = gu.shape[1] / 2;
    const std::uint64_t H = gu.shape[2];
    EXPECT_EQ(H, u64(c, "hidden_size"));
    for (std::uint64_t e : {std::uint64_t{0}, E - 1}) {
      for (std::uint64_t row = 0; row < I; ++row) {
        for (std::uint64_t col = 0; col < H; ++col) {
          ASSERT_EQ(element(r, gu, (e * 2 * I + row) * H + col),
                    synth_value(3, gu.name, (e * 2 * I + row) * H + col));
          std::uint64_t up = ((e * 2 + 1) * I + row) * H + col;
          SynthElement s = synth_fused_expert_element(p, ExpertProj::kUp, e, row, col, H, I);
          ASSERT_EQ(s.index, up);
          ASSERT_EQ(element(r, gu, up), synth_value(3, s.tensor, s.index));
        }
      }
      for (std::uint64_t row = 0; row < H; ++row) {
        for (std::uint64_t col = 0; col < I; ++col) {
          SynthElement s = synth_fused_expert_element(p, ExpertProj::kDown, e, row, col, H, I);
          ASSERT_EQ(s.tensor, dn.name);
          ASSERT_EQ(element(r, dn, (e * H + row) * I + col), synth_value(3, s.tensor, s.index));
        }
      }
    }
  }
}

// ---- errors -------------------------------------------------------------------------

TEST(SynthFamilies, FusedExpertsOnADenseFamilyIsRefusedAndWritesNothing) {
  TempDir dir;
  for (const auto& family : {"llama", "qwen2", "mistral"}) {
    SCOPED_TRACE(family);
    try {
      synth_tensor_list(family, "tiny", DType::kBF16, false, true);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kSynth);
      EXPECT_NE(e.rule().find("--fused-experts"), std::string::npos) << e.what();
      EXPECT_NE(e.rule().find(std::string("'") + family + "' is dense"), std::string::npos)
          << e.what();
      EXPECT_NE(e.rule().find("glm4_moe"), std::string::npos) << e.what();
    }
    SynthOptions o = tiny_options(family, dir.path() / family, 1);
    o.fused_experts = true;
    EXPECT_THROW(synthesize(o), Error);
    EXPECT_FALSE(synth_family_has_experts(family));
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
  for (const auto& family : kMoeFamilies) {
    EXPECT_TRUE(synth_family_has_experts(family)) << family;
  }
  EXPECT_THROW(synth_family_has_experts("gpt2"), Error);
}

TEST(SynthFamilies, UnknownFamilyListsEveryKnownOne) {
  EXPECT_EQ(synth_families(),
            (std::vector<std::string>{"llama", "qwen2", "mixtral", "qwen3_moe", "deepseek_v3",
                                      "mistral", "qwen2_moe", "deepseek_v2", "glm4_moe",
                                      "deepseek_v32", "qwen3", "gemma", "gemma2", "gemma3",
                                      "phi3"}));
  try {
    synth_config("glm4", "tiny", DType::kBF16, false);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    for (const auto& family : synth_families()) {
      EXPECT_NE(e.rule().find(family), std::string::npos) << family << ": " << e.what();
    }
  }
}

// ---- command line -------------------------------------------------------------------

TEST(SynthFamilies, CommandLineFusedExperts) {
  TempDir dir;
  std::string out;
  std::string err;
  EXPECT_EQ(run_cli({"--help"}, &out, &err), 0);
  for (const char* word :
       {"--fused-experts", "qwen2_moe", "deepseek_v2", "glm4_moe", "mistral", "mtp.safetensors"}) {
    EXPECT_NE(out.find(word), std::string::npos) << word;
  }
  const std::string o = dir.file("ck");
  EXPECT_EQ(run_cli({"--family", "mistral", "--preset", "tiny", "--out", o, "--fused-experts"},
                    &out, &err),
            2);
  EXPECT_NE(err.find("--fused-experts needs a family with routed experts; 'mistral' is dense"),
            std::string::npos)
      << err;
  EXPECT_FALSE(fs::exists(o));
  EXPECT_EQ(run_cli({"--family", "mistral", "--preset", "tiny", "--out", o, "--fused-experts=1"},
                    &out, &err),
            2);
  EXPECT_NE(err.find("fused-experts was given a disallowed flag override"), std::string::npos)
      << err;

  ASSERT_EQ(run_cli({"--family=deepseek_v2", "--preset=tiny", "--out=" + o, "--fused-experts",
                     "--seed=8", "--no-fsync"},
                    &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("deepseek_v2/tiny fused-experts seed 8"), std::string::npos) << out;
  check_folder(
      o, fused_from_per_expert(synth_tensor_list("deepseek_v2", "tiny", DType::kBF16, false)), 8);
}

}  // namespace
}  // namespace ferry::synth
