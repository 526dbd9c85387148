// llama.cpp's tensor names to Hugging Face's: per-architecture tables of the names
// gguf-py's constants.py gives each tensor (TENSOR_NAMES, MODEL_TENSORS) against
// the HF names its tensor_mapping.py reads them from, plus the stacked experts, the
// Q/K row permutation and DeepSeek's split kv_b_proj (io/gguf_names.hpp).
#include "io/gguf_names.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <span>
#include <stdexcept>

#include "common/error.hpp"
#include "common/format.hpp"

namespace ferry::io {
namespace {

struct Entry {
  std::string_view gguf;  // after "blk.N." for a layer's tensors
  std::string_view hf;    // after "model.layers.N." for a layer's tensors
  GgufToHf how = GgufToHf::kSame;
  bool key = false;
};

// Every architecture's global tensors.
constexpr Entry kGlobal[] = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
    {"rope_freqs.weight", "", GgufToHf::kNone},  // Llama 3's rope factors (rope_scaling)
};

// A layer's tensors every architecture here shares.
constexpr Entry kLayerCommon[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
    {"attn_rot_embd.weight", "", GgufToHf::kNone},  // old files' rotary inv_freq
};

constexpr Entry kQkvPlain[] = {
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
};

// LlamaModel.modify_tensors permutes q_proj and k_proj, weights and biases.
constexpr Entry kLlama[] = {
    {"attn_q.weight", "self_attn.q_proj.weight", GgufToHf::kUnpermuteRows, false},
    {"attn_k.weight", "self_attn.k_proj.weight", GgufToHf::kUnpermuteRows, true},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias", GgufToHf::kUnpermuteRows, false},
    {"attn_k.bias", "self_attn.k_proj.bias", GgufToHf::kUnpermuteRows, true},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_output.bias", "self_attn.o_proj.bias"},
    // Mixtral (MixtralForCausalLM converts to "llama"): block_sparse_moe.
    {"ffn_gate_inp.weight", "block_sparse_moe.gate.weight"},
    {"ffn_gate_exps.weight", "block_sparse_moe.experts.{E}.w1.weight", GgufToHf::kExperts},
    {"ffn_down_exps.weight", "block_sparse_moe.experts.{E}.w2.weight", GgufToHf::kExperts},
    {"ffn_up_exps.weight", "block_sparse_moe.experts.{E}.w3.weight", GgufToHf::kExperts},
};

constexpr Entry kQwen2[] = {
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
};

constexpr Entry kQwen3[] = {
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
};

// Qwen3-MoE and DeepSeek: the router and the routed experts under mlp.
constexpr Entry kMlpExperts[] = {
    {"ffn_gate_inp.weight", "mlp.gate.weight"},
    {"ffn_gate_exps.weight", "mlp.experts.{E}.gate_proj.weight", GgufToHf::kExperts},
    {"ffn_up_exps.weight", "mlp.experts.{E}.up_proj.weight", GgufToHf::kExperts},
    {"ffn_down_exps.weight", "mlp.experts.{E}.down_proj.weight", GgufToHf::kExperts},
};

constexpr Entry kDeepseek2[] = {
    {"attn_q.weight", "self_attn.q_proj.weight"},  // V2-Lite: no q LoRA
    {"attn_q_a.weight", "self_attn.q_a_proj.weight"},
    {"attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"},
    {"attn_q_b.weight", "self_attn.q_b_proj.weight"},
    {"attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"},
    {"attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"},
    {"attn_kv_b.weight", "self_attn.kv_b_proj.weight"},
    {"attn_k_b.weight", "self_attn.kv_b_proj.weight", GgufToHf::kMlaKB},
    {"attn_v_b.weight", "self_attn.kv_b_proj.weight", GgufToHf::kMlaVB},
    {"ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight"},
    {"ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"},
    {"ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"},
    // The converter renames e_score_correction_bias to e_score_correction.bias so
    // that tensor_mapping.py's ".bias" suffix rule finds it.
    {"exp_probs_b.bias", "mlp.gate.e_score_correction_bias"},
};

template <std::size_t N>
const Entry* find_in(const Entry (&table)[N], std::string_view name) {
  for (const Entry& e : table) {
    if (e.gguf == name) {
      return &e;
    }
  }
  return nullptr;
}

using Table = std::span<const Entry>;

// The layer tables of `arch`, most specific first (kLayerCommon last).
std::vector<Table> layer_tables(GgufArch arch) {
  switch (arch) {
    case GgufArch::kLlama:
      return {kLlama, kLayerCommon};
    case GgufArch::kQwen2:
      return {kQwen2, kQkvPlain, kLayerCommon};
    case GgufArch::kQwen3:
      return {kQwen3, kQkvPlain, kLayerCommon};
    case GgufArch::kQwen3Moe:
      return {kQwen3, kMlpExperts, kQkvPlain, kLayerCommon};
    case GgufArch::kDeepseek2:
      return {kDeepseek2, kMlpExperts, kLayerCommon};
  }
  return {kLayerCommon};
}

const Entry* find_layer_entry(GgufArch arch, std::string_view rest) {
  for (Table table : layer_tables(arch)) {
    for (const Entry& e : table) {
      if (e.gguf == rest) {
        return &e;
      }
    }
  }
  return nullptr;
}

// A decimal without leading zeros (or "0"), as layer and expert numbers are written.
std::optional<std::uint64_t> parse_index(std::string_view text) {
  if (text.empty() || (text.size() > 1 && text[0] == '0')) {
    return std::nullopt;
  }
  std::uint64_t n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size()) {
    return std::nullopt;
  }
  return n;
}

// Whether `hf` (a table's HF name, "{E}" standing for an expert's number) names
// `rest`; the expert's number goes to `expert`.
bool hf_matches(std::string_view hf, std::string_view rest, std::uint64_t& expert) {
  const std::size_t at = hf.find("{E}");
  if (at == std::string_view::npos) {
    return hf == rest;
  }
  const std::string_view head = hf.substr(0, at), tail = hf.substr(at + 3);
  if (rest.size() <= head.size() + tail.size() || !rest.starts_with(head) ||
      !rest.ends_with(tail)) {
    return false;
  }
  const auto e = parse_index(rest.substr(head.size(), rest.size() - head.size() - tail.size()));
  if (!e) {
    return false;
  }
  expert = *e;
  return true;
}

// "<prefix>N.rest" -> (N, rest); nullopt for other names and N with leading zeros.
std::optional<std::pair<std::uint64_t, std::string_view>> split_layer(
    std::string_view name, std::string_view prefix = "blk.") {
  if (!name.starts_with(prefix)) {
    return std::nullopt;
  }
  name.remove_prefix(prefix.size());
  const std::size_t dot = name.find('.');
  if (dot == std::string_view::npos) {
    return std::nullopt;
  }
  const std::optional<std::uint64_t> layer = parse_index(name.substr(0, dot));
  if (!layer) {
    return std::nullopt;
  }
  return std::pair{*layer, name.substr(dot + 1)};
}

[[noreturn]] void mapping_error(const std::string& file, const std::string& tensor,
                                const std::string& rule) {
  throw Error(Stage::kMapping, file, tensor, rule);
}

std::uint64_t head_count(const GgufHeader& h, const std::string& key,
                         std::optional<std::uint64_t> fallback, const std::string& tensor) {
  const GgufValue* v = h.find(key);
  if (v == nullptr) {
    if (fallback) {
      return *fallback;
    }
    mapping_error(h.file, tensor, "metadata key '" + key + "' is missing (needed to unpermute)");
  }
  const std::optional<std::uint64_t> n = v->as_uint();
  if (!n || *n == 0) {
    mapping_error(h.file, tensor,
                  "metadata key '" + key + "' must be a positive integer, not " + v->describe());
  }
  return *n;
}

// kv_b_proj's HF shape [heads * (nope + v), rank] from attn_k_b (ggml dims [nope,
// rank, heads]) and attn_v_b ([rank, v, heads]): each half needs the other.
std::vector<std::uint64_t> kv_b_shape(const GgufHeader& h, const GgufTensorInfo& t, bool k) {
  std::string other_name = t.name;
  const std::string_view mine = k ? "attn_k_b" : "attn_v_b";
  other_name.replace(other_name.find(mine), mine.size(), k ? "attn_v_b" : "attn_k_b");
  const GgufTensorInfo* other = h.find_tensor(other_name);
  if (other == nullptr) {
    mapping_error(h.file, t.name, "the other half of kv_b_proj, " + other_name + ", is missing");
  }
  const GgufTensorInfo& kb = k ? t : *other;
  const GgufTensorInfo& vb = k ? *other : t;
  if (kb.dims.size() != 3 || vb.dims.size() != 3 || vb.dims[0] != kb.dims[1] ||
      vb.dims[2] != kb.dims[2]) {
    mapping_error(h.file, t.name,
                  "attn_k_b " + format_dims(kb.dims) + " and attn_v_b " + format_dims(vb.dims) +
                      " are not [nope, rank, heads] and [rank, v, heads]");
  }
  return {kb.dims[2] * (kb.dims[0] + vb.dims[1]), kb.dims[1]};
}

std::string with_expert(std::string_view pattern, std::uint64_t e) {
  std::string out(pattern);
  out.replace(out.find("{E}"), 3, std::to_string(e));
  return out;
}

}  // namespace

std::optional<GgufArch> parse_gguf_arch(std::string_view name) {
  if (name == "llama") {
    return GgufArch::kLlama;
  }
  if (name == "qwen2") {
    return GgufArch::kQwen2;
  }
  if (name == "qwen3") {
    return GgufArch::kQwen3;
  }
  if (name == "qwen3moe") {
    return GgufArch::kQwen3Moe;
  }
  if (name == "deepseek2") {
    return GgufArch::kDeepseek2;
  }
  return std::nullopt;
}

std::string_view gguf_arch_name(GgufArch arch) {
  switch (arch) {
    case GgufArch::kLlama:
      return "llama";
    case GgufArch::kQwen2:
      return "qwen2";
    case GgufArch::kQwen3:
      return "qwen3";
    case GgufArch::kQwen3Moe:
      return "qwen3moe";
    case GgufArch::kDeepseek2:
      return "deepseek2";
  }
  return "unknown";
}

std::optional<GgufNameRule> match_gguf_name(GgufArch arch, std::string_view gguf_name) {
  if (const Entry* e = find_in(kGlobal, gguf_name)) {
    return GgufNameRule{e->how, std::string(e->hf), e->key};
  }
  const auto layer = split_layer(gguf_name);
  if (!layer) {
    return std::nullopt;
  }
  const Entry* e = find_layer_entry(arch, layer->second);
  if (e == nullptr) {
    return std::nullopt;
  }
  GgufNameRule rule{e->how, {}, e->key};
  if (e->how != GgufToHf::kNone) {
    rule.hf_name = "model.layers." + std::to_string(layer->first) + "." + std::string(e->hf);
  }
  return rule;
}

std::vector<HfGgufTarget> match_hf_name(GgufArch arch, std::string_view hf_name) {
  for (const Entry& e : kGlobal) {
    if (e.how != GgufToHf::kNone && e.hf == hf_name) {
      return {{std::string(e.gguf), e.how, e.key, 0}};
    }
  }
  const auto layer = split_layer(hf_name, "model.layers.");
  if (!layer) {
    return {};
  }
  const std::string blk = "blk." + std::to_string(layer->first) + ".";
  // The first table naming it decides, as in find_layer_entry; kv_b_proj is in one
  // table three times (attn_kv_b, attn_k_b, attn_v_b).
  for (Table table : layer_tables(arch)) {
    std::vector<HfGgufTarget> out;
    for (const Entry& e : table) {
      std::uint64_t expert = 0;
      if (e.how != GgufToHf::kNone && hf_matches(e.hf, layer->second, expert)) {
        out.push_back({blk + std::string(e.gguf), e.how, e.key, expert});
      }
    }
    if (std::any_of(out.begin(), out.end(), [](const HfGgufTarget& t) {
          return t.how == GgufToHf::kMlaKB || t.how == GgufToHf::kMlaVB;
        })) {
      // The current converter writes the split halves only.
      std::erase_if(out, [](const HfGgufTarget& t) { return t.how == GgufToHf::kSame; });
    }
    if (!out.empty()) {
      return out;
    }
  }
  return {};
}

GgufHfMap map_gguf_to_hf(const GgufHeader& header) {
  const std::string arch_name = header.architecture();
  const std::optional<GgufArch> arch = parse_gguf_arch(arch_name);
  if (!arch) {
    mapping_error(header.file, "",
                  arch_name.empty()
                      ? std::string("no general.architecture string in the metadata")
                      : "architecture '" + arch_name +
                            "' is not mapped to Hugging Face names (ferry maps llama, qwen2, "
                            "qwen3, qwen3moe and deepseek2)");
  }
  GgufHfMap map;
  map.arch = *arch;
  const std::string prefix = arch_name + ".";
  const GgufValue* experts_value = header.find(prefix + "expert_count");
  // 0 when absent (GCC 12 warns about an optional here, wrongly).
  const std::uint64_t expert_count =
      experts_value != nullptr ? experts_value->as_uint().value_or(0) : 0;

  for (const GgufTensorInfo& t : header.tensors) {
    const std::optional<GgufNameRule> rule = match_gguf_name(*arch, t.name);
    if (!rule) {
      mapping_error(header.file, t.name,
                    t.name.find("ffn_gate_up_exps") != std::string::npos
                        ? "fused gate/up experts (--fuse-gate-up-exps) are not mapped"
                        : "not a tensor name of llama.cpp's '" + arch_name +
                              "' architecture that ferry maps");
    }
    if (rule->how == GgufToHf::kNone) {
      map.skipped.push_back(t.name);
      continue;
    }
    GgufHfTensor out;
    out.gguf_name = t.name;
    out.type = t.type;
    out.how = rule->how;
    if (rule->how == GgufToHf::kExperts) {
      if (t.dims.size() != 3) {
        mapping_error(
            header.file, t.name,
            "stacked experts must have 3 dims [in, out, experts], not " + format_dims(t.dims));
      }
      const std::uint64_t n = t.dims[2];
      if (expert_count != 0 && expert_count != n) {
        mapping_error(header.file, t.name,
                      "holds " + std::to_string(n) + " experts, but " + prefix +
                          "expert_count is " + std::to_string(expert_count));
      }
      const std::uint64_t each = t.nbytes / n;  // whole rows: dims[1] of them per expert
      for (std::uint64_t e = 0; e < n; ++e) {
        out.pieces.push_back(
            {with_expert(rule->hf_name, e), t.offset + e * each, each, {t.dims[1], t.dims[0]}});
      }
    } else if (rule->how == GgufToHf::kMlaKB || rule->how == GgufToHf::kMlaVB) {
      out.pieces.push_back({rule->hf_name, t.offset, t.nbytes,
                            kv_b_shape(header, t, rule->how == GgufToHf::kMlaKB)});
    } else {
      out.pieces.push_back({rule->hf_name, t.offset, t.nbytes, t.shape()});
    }
    if (rule->how == GgufToHf::kUnpermuteRows) {
      const std::uint64_t heads =
          rule->key
              ? head_count(header, prefix + "attention.head_count_kv",
                           head_count(header, prefix + "attention.head_count", {}, t.name), t.name)
              : head_count(header, prefix + "attention.head_count", {}, t.name);
      const std::uint64_t rows = t.shape()[0];
      if (rows % (2 * heads) != 0) {
        mapping_error(header.file, t.name,
                      std::to_string(rows) + " rows are not whole pairs of rows of " +
                          std::to_string(heads) + " heads (LlamaModel.permute's layout)");
      }
      if (t.dims.size() == 1 && ggml_traits(t.type).block_size != 1) {
        mapping_error(header.file, t.name,
                      "a quantized vector cannot be unpermuted (its elements share blocks)");
      }
      out.heads = heads;
      out.rows = rows;
      out.row_bytes = t.nbytes / rows;
    }
    map.tensors.push_back(std::move(out));
  }
  return map;
}

std::vector<std::uint64_t> llama_qk_permute_rows(std::uint64_t rows, std::uint64_t heads) {
  if (heads == 0 || rows % (2 * heads) != 0) {
    throw std::invalid_argument("llama_qk_permute_rows: " + std::to_string(rows) +
                                " rows are not whole pairs of " + std::to_string(heads) + " heads");
  }
  // permute: reshape(heads, 2, d / 2, ...).swapaxes(1, 2): GGUF row (h, i, j) is HF
  // row (h, j, i).
  const std::uint64_t d = rows / heads, half = d / 2;
  std::vector<std::uint64_t> out(rows);
  for (std::uint64_t h = 0; h < heads; ++h) {
    for (std::uint64_t i = 0; i < half; ++i) {
      for (std::uint64_t j = 0; j < 2; ++j) {
        out[h * d + 2 * i + j] = h * d + j * half + i;
      }
    }
  }
  return out;
}

std::vector<std::uint64_t> llama_qk_hf_rows(std::uint64_t rows, std::uint64_t heads) {
  const std::vector<std::uint64_t> permuted = llama_qk_permute_rows(rows, heads);
  std::vector<std::uint64_t> out(rows);
  for (std::uint64_t g = 0; g < rows; ++g) {
    out[permuted[g]] = g;
  }
  return out;
}

void gather_rows(std::span<const std::byte> in, std::span<std::byte> out, std::uint64_t row_bytes,
                 std::span<const std::uint64_t> map) {
  const std::uint64_t rows = map.size();
  if (row_bytes == 0 || in.size() != rows * row_bytes || out.size() != in.size()) {
    throw std::invalid_argument("gather_rows: " + std::to_string(rows) + " rows of " +
                                std::to_string(row_bytes) + " bytes do not match buffers of " +
                                std::to_string(in.size()) + " and " + std::to_string(out.size()) +
                                " bytes");
  }
  for (std::uint64_t r = 0; r < rows; ++r) {
    if (map[r] >= rows) {
      throw std::invalid_argument("gather_rows: row " + std::to_string(map[r]) + " out of range");
    }
    std::memcpy(out.data() + r * row_bytes, in.data() + map[r] * row_bytes, row_bytes);
  }
}

namespace {

void check_mla(std::size_t k_bytes, std::size_t v_bytes, std::size_t element_bytes,
               std::uint64_t n_head, std::uint64_t nope, std::uint64_t v_dim, std::uint64_t rank,
               const char* who) {
  if (element_bytes == 0 || k_bytes != n_head * rank * nope * element_bytes ||
      v_bytes != n_head * v_dim * rank * element_bytes) {
    throw std::invalid_argument(std::string(who) + ": " + std::to_string(k_bytes) + " and " +
                                std::to_string(v_bytes) + " bytes are not " +
                                std::to_string(n_head) + " heads of [" + std::to_string(rank) +
                                " x " + std::to_string(nope) + "] and [" + std::to_string(v_dim) +
                                " x " + std::to_string(rank) + "]");
  }
}

}  // namespace

std::vector<std::byte> mla_kv_b_proj(std::span<const std::byte> k_b, std::span<const std::byte> v_b,
                                     std::size_t element_bytes, std::uint64_t n_head,
                                     std::uint64_t nope, std::uint64_t v_dim, std::uint64_t rank) {
  check_mla(k_b.size(), v_b.size(), element_bytes, n_head, nope, v_dim, rank, "mla_kv_b_proj");
  const std::size_t e = element_bytes;
  std::vector<std::byte> out(k_b.size() + v_b.size());
  for (std::uint64_t h = 0; h < n_head; ++h) {
    std::byte* head = out.data() + h * (nope + v_dim) * rank * e;
    // k_b[h] is [rank, nope]: kv_b row (h, n) column c is k_b[h][c][n].
    for (std::uint64_t n = 0; n < nope; ++n) {
      for (std::uint64_t c = 0; c < rank; ++c) {
        std::memcpy(head + (n * rank + c) * e, k_b.data() + ((h * rank + c) * nope + n) * e, e);
      }
    }
    std::memcpy(head + nope * rank * e, v_b.data() + h * v_dim * rank * e, v_dim * rank * e);
  }
  return out;
}

std::vector<std::byte> mla_split_kv_b(std::span<const std::byte> kv_b, std::size_t element_bytes,
                                      std::uint64_t n_head, std::uint64_t nope, std::uint64_t v_dim,
                                      std::uint64_t rank) {
  const std::size_t e = element_bytes;
  const std::size_t k_bytes = n_head * rank * nope * e;
  const std::size_t v_bytes = n_head * v_dim * rank * e;
  if (kv_b.size() != k_bytes + v_bytes) {
    throw std::invalid_argument("mla_split_kv_b: sizes do not match");
  }
  std::vector<std::byte> out(kv_b.size());
  for (std::uint64_t h = 0; h < n_head; ++h) {
    const std::byte* head = kv_b.data() + h * (nope + v_dim) * rank * e;
    for (std::uint64_t n = 0; n < nope; ++n) {
      for (std::uint64_t c = 0; c < rank; ++c) {
        std::memcpy(out.data() + ((h * rank + c) * nope + n) * e, head + (n * rank + c) * e, e);
      }
    }
    std::memcpy(out.data() + k_bytes + h * v_dim * rank * e, head + nope * rank * e,
                v_dim * rank * e);
  }
  return out;
}

}  // namespace ferry::io
