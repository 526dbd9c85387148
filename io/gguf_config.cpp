// config.json from GGUF metadata: each {arch}.* key back to the Hugging Face field
// convert_hf_to_gguf.py wrote it from (TextModel.set_gguf_parameters and the
// architectures' own, e.g. DeepseekV2Model's MLA lengths).
#include "io/gguf_config.hpp"

#include <charconv>
#include <cstdlib>
#include <map>

#include "common/error.hpp"

namespace ferry::io {
namespace {

using nlohmann::json;

class Meta {
 public:
  Meta(const GgufHeader& h, std::string arch) : h_(h), prefix_(std::move(arch) + ".") {}

  [[noreturn]] void fail(const std::string& rule) const {
    throw Error(Stage::kConfig, h_.file, "", rule);
  }

  const GgufValue* find(std::string_view key) const { return h_.find(prefix_ + std::string(key)); }

  std::optional<std::uint64_t> uint(std::string_view key, std::string_view field) const {
    const GgufValue* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    const std::optional<std::uint64_t> n = v->as_uint();
    if (!n) {
      fail("metadata key '" + prefix_ + std::string(key) + "' (config.json's " +
           std::string(field) + ") must be a non-negative integer, not " + v->describe());
    }
    return n;
  }
  // Every size config.json requires is positive.
  std::uint64_t need_uint(std::string_view key, std::string_view field) const {
    const std::optional<std::uint64_t> n = uint(key, field);
    if (!n) {
      fail("metadata key '" + prefix_ + std::string(key) + "' is missing (config.json's " +
           std::string(field) + ")");
    }
    if (*n == 0) {
      fail("metadata key '" + prefix_ + std::string(key) + "' (config.json's " +
           std::string(field) + ") is 0");
    }
    return *n;
  }

  // A float as config.json would hold it: an f32 as its shortest decimal (1e-05,
  // not 9.999999747378752e-06), which is what the original config said.
  std::optional<double> number(std::string_view key, std::string_view field) const {
    const GgufValue* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    if (v->type == GgufValueType::kF32) {
      char text[32];
      const auto r = std::to_chars(text, text + sizeof(text), static_cast<float>(v->f));
      *r.ptr = '\0';
      return std::strtod(text, nullptr);
    }
    const std::optional<double> d = v->as_double();
    if (!d) {
      fail("metadata key '" + prefix_ + std::string(key) + "' (config.json's " +
           std::string(field) + ") must be a number, not " + v->describe());
    }
    return d;
  }
  double need_number(std::string_view key, std::string_view field) const {
    const std::optional<double> d = number(key, field);
    if (!d) {
      fail("metadata key '" + prefix_ + std::string(key) + "' is missing (config.json's " +
           std::string(field) + ")");
    }
    return *d;
  }

  std::optional<bool> boolean(std::string_view key) const {
    const GgufValue* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    const std::optional<bool> b = v->as_bool();
    if (!b) {
      fail("metadata key '" + prefix_ + std::string(key) + "' must be a bool, not " +
           v->describe());
    }
    return b;
  }

  std::optional<std::string> text(std::string_view key) const {
    const GgufValue* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    const std::optional<std::string_view> s = v->as_string();
    if (!s) {
      fail("metadata key '" + prefix_ + std::string(key) + "' must be a string, not " +
           v->describe());
    }
    return std::string(*s);
  }

 private:
  const GgufHeader& h_;
  std::string prefix_;
};

bool has_tensor_ending(const GgufHeader& h, std::string_view suffix) {
  for (const GgufTensorInfo& t : h.tensors) {
    if (t.name.size() >= suffix.size() &&
        std::string_view(t.name).substr(t.name.size() - suffix.size()) == suffix) {
      return true;
    }
  }
  return false;
}

// The type most matrices are stored in, among the plain float types; bfloat16 with
// a note when every matrix is quantized.
std::string torch_dtype(const GgufHeader& h, std::vector<std::string>& notes) {
  std::map<GgmlType, std::size_t> counts;
  for (const GgufTensorInfo& t : h.tensors) {
    if (t.dims.size() >= 2) {
      ++counts[t.type];
    }
  }
  std::string best;
  std::size_t most = 0;
  for (const auto& [type, name] :
       {std::pair{GgmlType::kBF16, "bfloat16"}, std::pair{GgmlType::kF16, "float16"},
        std::pair{GgmlType::kF32, "float32"}}) {
    if (counts[type] > most) {
      most = counts[type];
      best = name;
    }
  }
  if (best.empty()) {
    notes.push_back("every matrix is quantized: torch_dtype says bfloat16");
    return "bfloat16";
  }
  return best;
}

void rope_scaling(const Meta& m, const GgufHeader& h, json& c, bool deepseek,
                  std::vector<std::string>& notes) {
  const std::optional<std::string> type = m.text("rope.scaling.type");
  if (type == "linear" || type == "yarn") {
    json r = {{"type", *type}, {"rope_type", *type}};
    r["factor"] = m.need_number("rope.scaling.factor", "rope_scaling.factor");
    if (const auto orig = m.uint("rope.scaling.original_context_length",
                                 "rope_scaling.original_max_position_embeddings")) {
      r["original_max_position_embeddings"] = *orig;
    }
    if (const auto fast = m.number("rope.scaling.yarn_beta_fast", "rope_scaling.beta_fast")) {
      r["beta_fast"] = *fast;
    }
    if (const auto slow = m.number("rope.scaling.yarn_beta_slow", "rope_scaling.beta_slow")) {
      r["beta_slow"] = *slow;
    }
    if (deepseek) {
      // DeepseekV2Model writes 0.1 * mscale_all_dim; DeepSeek's configs set mscale
      // equal to it (1.0 for V3, 0.707 for V2), so both come back from it.
      if (const auto mul =
              m.number("rope.scaling.yarn_log_multiplier", "rope_scaling.mscale_all_dim")) {
        r["mscale_all_dim"] = *mul / 0.1;
        r["mscale"] = *mul / 0.1;
      }
    }
    c["rope_scaling"] = std::move(r);
  } else if (type && *type != "none") {
    notes.push_back("rope.scaling.type '" + *type + "' is not carried into rope_scaling");
  }
  if (h.find_tensor("rope_freqs.weight") != nullptr) {
    notes.push_back(
        "rope_freqs.weight holds Llama 3's RoPE factors, computed from a rope_scaling "
        "(llama3) that the file does not keep: rope_scaling is left out");
  }
}

const char* hf_arch_of(GgufArch arch, bool moe, bool v3) {
  switch (arch) {
    case GgufArch::kLlama:
      return moe ? "MixtralForCausalLM" : "LlamaForCausalLM";
    case GgufArch::kQwen2:
      return "Qwen2ForCausalLM";
    case GgufArch::kQwen3:
      return "Qwen3ForCausalLM";
    case GgufArch::kQwen3Moe:
      return "Qwen3MoeForCausalLM";
    case GgufArch::kDeepseek2:
      return v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM";
  }
  return "";
}

const char* model_type_of(GgufArch arch, bool moe, bool v3) {
  switch (arch) {
    case GgufArch::kLlama:
      return moe ? "mixtral" : "llama";
    case GgufArch::kQwen2:
      return "qwen2";
    case GgufArch::kQwen3:
      return "qwen3";
    case GgufArch::kQwen3Moe:
      return "qwen3_moe";
    case GgufArch::kDeepseek2:
      return v3 ? "deepseek_v3" : "deepseek_v2";
  }
  return "";
}

void deepseek_fields(const Meta& m, json& c, bool v3, std::vector<std::string>& notes) {
  // MLA: converted to MQA (head_count_kv 1); HF keeps one KV head per query head.
  c["num_key_value_heads"] = c["num_attention_heads"];
  c["attention_bias"] = false;  // llama.cpp's deepseek2 has no attention biases
  if (const auto q = m.uint("attention.q_lora_rank", "q_lora_rank")) {
    c["q_lora_rank"] = *q;
  } else {
    c["q_lora_rank"] = nullptr;  // V2-Lite: q_proj, no q LoRA
  }
  const std::uint64_t rank = m.need_uint("attention.kv_lora_rank", "kv_lora_rank");
  const std::uint64_t rope = m.need_uint("rope.dimension_count", "qk_rope_head_dim");
  // Since the MLA change the converter writes key/value_length for the absorbed
  // form (rank + rope, rank) and the per-head widths as *_mla; before it,
  // key/value_length were the per-head widths.
  const bool mla = m.find("attention.key_length_mla") != nullptr;
  const std::uint64_t k = m.need_uint(mla ? "attention.key_length_mla" : "attention.key_length",
                                      "qk_nope_head_dim + qk_rope_head_dim");
  const std::uint64_t v =
      m.need_uint(mla ? "attention.value_length_mla" : "attention.value_length", "v_head_dim");
  if (k <= rope) {
    m.fail("the key length " + std::to_string(k) + " is not above the RoPE dimension " +
           std::to_string(rope) + " (qk_nope_head_dim would be " + std::to_string(k - rope) + ")");
  }
  c["kv_lora_rank"] = rank;
  c["qk_rope_head_dim"] = rope;
  c["qk_nope_head_dim"] = k - rope;
  c["v_head_dim"] = v;

  c["n_routed_experts"] = m.need_uint("expert_count", "n_routed_experts");
  c["num_experts_per_tok"] = m.need_uint("expert_used_count", "num_experts_per_tok");
  c["moe_intermediate_size"] = m.need_uint("expert_feed_forward_length", "moe_intermediate_size");
  c["n_shared_experts"] = m.uint("expert_shared_count", "n_shared_experts").value_or(0);
  c["first_k_dense_replace"] =
      m.uint("leading_dense_block_count", "first_k_dense_replace").value_or(0);
  c["routed_scaling_factor"] =
      m.number("expert_weights_scale", "routed_scaling_factor").value_or(1.0);
  c["norm_topk_prob"] = m.boolean("expert_weights_norm").value_or(false);
  const std::optional<std::uint64_t> groups = m.uint("expert_group_count", "n_group");
  const std::uint64_t n_group = groups.value_or(1);
  c["n_group"] = n_group;
  c["topk_group"] = m.uint("expert_group_used_count", "topk_group").value_or(1);
  if (!groups && v3) {
    notes.push_back(
        "no expert_group_count in the file (converted before it was written): "
        "n_group and topk_group say 1, DeepSeek-V3 routes with 8 and 4");
  }
  c["scoring_func"] = v3 ? "sigmoid" : "softmax";
  c["topk_method"] = v3 ? "noaux_tc" : (n_group > 1 ? "group_limited_greedy" : "greedy");
  c["moe_layer_freq"] = 1;
  if (v3) {
    c["num_nextn_predict_layers"] = 0;  // the converter skips the MTP layers
  }
}

}  // namespace

GgufHfConfig gguf_hf_config(const GgufHeader& header) {
  const std::string arch_name = header.architecture();
  const std::optional<GgufArch> arch = parse_gguf_arch(arch_name);
  if (!arch) {
    throw Error(Stage::kConfig, header.file, "",
                arch_name.empty() ? std::string("metadata key 'general.architecture' is missing")
                                  : "architecture '" + arch_name +
                                        "' has no Hugging Face config mapping (ferry maps "
                                        "llama, qwen2, qwen3, qwen3moe and deepseek2)");
  }
  const Meta m(header, arch_name);
  GgufHfConfig out;
  json& c = out.config;

  const GgufTensorInfo* embed = header.find_tensor("token_embd.weight");
  if (embed == nullptr || embed->dims.size() != 2) {
    m.fail(
        "token_embd.weight (2-D: [hidden, vocab]) is missing: config.json's vocab_size "
        "is its dims[1]");
  }
  const std::uint64_t experts = m.uint("expert_count", "num_experts").value_or(0);
  const bool moe = experts > 0;
  bool v3 = false;
  if (*arch == GgufArch::kDeepseek2) {
    const std::optional<std::uint64_t> gating = m.uint("expert_gating_func", "scoring_func");
    if (gating && *gating != 1 && *gating != 2) {
      m.fail("metadata key '" + arch_name + ".expert_gating_func' is " + std::to_string(*gating) +
             ": DeepSeek-V2 and V3 use 1 (softmax) or 2 (sigmoid)");
    }
    v3 = gating == 2 || has_tensor_ending(header, ".exp_probs_b.bias");
  }

  c["architectures"] = json::array({hf_arch_of(*arch, moe, v3)});
  c["model_type"] = model_type_of(*arch, moe, v3);
  c["vocab_size"] = embed->dims[1];
  c["hidden_size"] = m.need_uint("embedding_length", "hidden_size");
  c["num_hidden_layers"] = m.need_uint("block_count", "num_hidden_layers");
  const std::uint64_t heads = m.need_uint("attention.head_count", "num_attention_heads");
  c["num_attention_heads"] = heads;
  c["num_key_value_heads"] =
      m.uint("attention.head_count_kv", "num_key_value_heads").value_or(heads);
  if (*arch == GgufArch::kQwen3Moe) {
    // Unused by an all-MoE model, but HF's config has it: the dense size when the
    // converter wrote one, else the experts'.
    c["moe_intermediate_size"] = m.need_uint("expert_feed_forward_length", "moe_intermediate_size");
    c["intermediate_size"] = m.uint("feed_forward_length", "intermediate_size")
                                 .value_or(c["moe_intermediate_size"].get<std::uint64_t>());
  } else {
    c["intermediate_size"] = m.need_uint("feed_forward_length", "intermediate_size");
  }
  c["max_position_embeddings"] = m.need_uint("context_length", "max_position_embeddings");
  c["rms_norm_eps"] = m.need_number("attention.layer_norm_rms_epsilon", "rms_norm_eps");
  c["rope_theta"] = m.number("rope.freq_base", "rope_theta").value_or(10000.0);
  c["hidden_act"] = "silu";
  c["tie_word_embeddings"] = header.find_tensor("output.weight") == nullptr;
  c["torch_dtype"] = torch_dtype(header, out.notes);
  for (const auto& [key, field] : {std::pair{"tokenizer.ggml.bos_token_id", "bos_token_id"},
                                   std::pair{"tokenizer.ggml.eos_token_id", "eos_token_id"}}) {
    const GgufValue* v = header.find(key);
    if (v != nullptr && v->as_uint()) {
      c[field] = *v->as_uint();
    }
  }
  const std::uint64_t hidden = c["hidden_size"].get<std::uint64_t>();
  if (*arch != GgufArch::kDeepseek2) {
    // The converter writes head_dim as key_length when config.json had one.
    c["head_dim"] = m.uint("attention.key_length", "head_dim").value_or(hidden / heads);
  }

  switch (*arch) {
    case GgufArch::kLlama:
      c["attention_bias"] = has_tensor_ending(header, ".attn_q.bias");
      c["mlp_bias"] = false;
      if (moe) {
        c["num_local_experts"] = experts;
        c["num_experts_per_tok"] = m.need_uint("expert_used_count", "num_experts_per_tok");
      }
      break;
    case GgufArch::kQwen2:
      c["use_sliding_window"] = false;
      break;
    case GgufArch::kQwen3:
      c["attention_bias"] = false;
      break;
    case GgufArch::kQwen3Moe:
      c["attention_bias"] = false;
      c["num_experts"] = m.need_uint("expert_count", "num_experts");
      c["num_experts_per_tok"] = m.need_uint("expert_used_count", "num_experts_per_tok");
      c["norm_topk_prob"] = m.boolean("expert_weights_norm").value_or(true);
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = json::array();
      break;
    case GgufArch::kDeepseek2:
      deepseek_fields(m, c, v3, out.notes);
      break;
  }
  rope_scaling(m, header, c, *arch == GgufArch::kDeepseek2, out.notes);
  return out;
}

}  // namespace ferry::io
