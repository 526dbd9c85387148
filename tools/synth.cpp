// Synthetic checkpoints: per-family tensor lists and config.json, the value
// function and its encoders, shard planning, and the write-to-temp-then-rename
// of a whole checkpoint folder.
#include "tools/synth.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <utility>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/fp8.hpp"
#include "common/hash.hpp"
#include "common/json_depth.hpp"
#include "common/log.hpp"
#include "common/small_file.hpp"
#include "io/safetensors_writer.hpp"
#include "models/quant.hpp"

namespace ferry::tools {

static_assert(std::endian::native == std::endian::little,
              "safetensors is little-endian; the encoders store host order");

namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail(const std::string& file, std::string rule) {
  throw Error(Stage::kSynth, file, "", std::move(rule));
}

// ---- values ----------------------------------------------------------------

// Encoded forms of the 255 possible values, so the hot loop is a hash and a load.
template <typename T>
struct ValueTable {
  std::array<T, 255> bits{};
};

float value_of(std::uint64_t k) {
  return (static_cast<float>(k) - 127.0f) / 128.0f;
}

const ValueTable<std::uint16_t>& bf16_table() {
  static const ValueTable<std::uint16_t> table = [] {
    ValueTable<std::uint16_t> t;
    for (std::uint64_t k = 0; k < 255; ++k) {
      t.bits[k] = float_to_bf16_bits(value_of(k));
    }
    return t;
  }();
  return table;
}

const ValueTable<std::uint16_t>& f16_table() {
  static const ValueTable<std::uint16_t> table = [] {
    ValueTable<std::uint16_t> t;
    for (std::uint64_t k = 0; k < 255; ++k) {
      t.bits[k] = float_to_f16_bits(value_of(k));
    }
    return t;
  }();
  return table;
}

const ValueTable<std::uint32_t>& f32_table() {
  static const ValueTable<std::uint32_t> table = [] {
    ValueTable<std::uint32_t> t;
    for (std::uint64_t k = 0; k < 255; ++k) {
      t.bits[k] = std::bit_cast<std::uint32_t>(value_of(k));
    }
    return t;
  }();
  return table;
}

const ValueTable<std::uint8_t>& e4m3_table() {
  static const ValueTable<std::uint8_t> table = [] {
    ValueTable<std::uint8_t> t;
    for (std::uint64_t k = 0; k < 255; ++k) {
      t.bits[k] = float_to_e4m3(value_of(k));
    }
    return t;
  }();
  return table;
}

template <typename T>
void encode_with(const ValueTable<T>& table, std::uint64_t base, std::span<std::byte> out) {
  std::byte* p = out.data();
  std::size_t n = out.size() / sizeof(T);
  for (std::size_t i = 0; i < n; ++i) {
    T bits = table.bits[splitmix64(base + i) % 255];
    std::memcpy(p + i * sizeof(T), &bits, sizeof(T));
  }
}

// ---- families and presets ----------------------------------------------------

// Same order as synth_families(), which indexes it.
enum class Family {
  kLlama,
  kQwen2,
  kMixtral,
  kQwen3Moe,
  kDeepseekV3,
  kMistral,
  kQwen2Moe,
  kDeepseekV2,
  kGlm4Moe,
  kDeepseekV32,
  kQwen3,
  kGemma,
  kGemma2,
  kGemma3,
  kPhi3,
};
enum class Preset { kTiny, kSmall, kMedium };

bool has_routed_experts(Family family) {
  switch (family) {
    case Family::kLlama:
    case Family::kQwen2:
    case Family::kMistral:
    case Family::kQwen3:
    case Family::kGemma:
    case Family::kGemma2:
    case Family::kGemma3:
    case Family::kPhi3:
      return false;
    case Family::kMixtral:
    case Family::kQwen3Moe:
    case Family::kDeepseekV3:
    case Family::kQwen2Moe:
    case Family::kDeepseekV2:
    case Family::kGlm4Moe:
    case Family::kDeepseekV32:
      return true;
  }
  return false;
}

// Gemma's output projection is always its embedding: no lm_head.weight is written,
// and its config says tied.
bool gemma_family(Family family) {
  return family == Family::kGemma || family == Family::kGemma2 || family == Family::kGemma3;
}

// DeepSeek-V3 and V3.2 (V3 with the sparse-attention indexer) share every rule but it.
bool deepseek_v3_like(Family family) {
  return family == Family::kDeepseekV3 || family == Family::kDeepseekV32;
}

std::vector<std::string> moe_family_names() {
  std::vector<std::string> out;
  const auto& names = synth_families();
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (has_routed_experts(static_cast<Family>(i))) {
      out.push_back(names[i]);
    }
  }
  return out;
}

Family parse_family(std::string_view text) {
  const auto& names = synth_families();
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == text) {
      return static_cast<Family>(i);
    }
  }
  fail("", "unknown family '" + std::string(text) + "' (expected one of " + join_list(names) + ")");
}

Preset parse_preset(std::string_view text) {
  const auto& names = synth_presets();
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == text) {
      return static_cast<Preset>(i);
    }
  }
  fail("", "unknown preset '" + std::string(text) + "' (expected one of " + join_list(names) + ")");
}

void check_dtype(DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32) {
    fail("", "synthetic weights are BF16, F16 or F32, not " + std::string(dtype_name(dtype)));
  }
}

// Sizes of one preset. Attention heads × head_dim equals hidden for the families
// whose configs imply head_dim = hidden / heads (Llama, Qwen2, Mixtral, Mistral,
// Qwen2-MoE); Qwen3-MoE medium and small and every GLM-4 MoE preset deliberately
// differ, as the real Qwen3 and GLM-4.5 models do.
struct Dims {
  std::uint64_t hidden = 0;
  std::uint64_t intermediate = 0;
  std::uint64_t layers = 0;
  std::uint64_t heads = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;
  std::uint64_t vocab = 0;
  std::uint64_t experts = 0;
  std::uint64_t experts_per_tok = 0;
  std::uint64_t moe_intermediate = 0;
  std::uint64_t shared_intermediate = 0;  // Qwen2-MoE's one shared expert
  // DeepSeek-V2/V3 (MLA and routing), GLM-4 MoE (routing only)
  std::uint64_t q_lora_rank = 0;  // 0: q_lora_rank null, a plain q_proj (DeepSeek-V2-Lite)
  std::uint64_t kv_lora_rank = 0;
  std::uint64_t qk_nope = 0;
  std::uint64_t qk_rope = 0;
  std::uint64_t v_head = 0;
  std::uint64_t shared_experts = 0;
  std::uint64_t first_k_dense = 0;
  std::uint64_t n_group = 0;
  std::uint64_t topk_group = 0;
  // DeepSeek-V3 and GLM-4 MoE: num_nextn_predict_layers, 0 or 1 (every preset has 1).
  std::uint64_t nextn_layers = 1;
  // DeepSeek-V3.2's indexer in every layer (the MTP layer's too): index_n_heads and
  // index_head_dim; 0 = none.
  std::uint64_t index_heads = 0;
  std::uint64_t index_head_dim = 0;
  bool qk_norm = false;  // GLM-4 MoE's use_qk_norm (GLM-4.5 has it, GLM-4.5-Air not)
};

// Tiny vocabularies are 1000 (not a multiple of 64) so vocab padding gets tested;
// medium sizes put every family between 2 and 3 GiB in BF16 (untied).
// Kept compact: each preset reads as one row of a table.
// clang-format off
Dims dims_for(Family family, Preset preset) {
  switch (family) {
    case Family::kDeepseekV32: {
      // DeepSeek-V3's sizes with the indexer (V3.2: 64 heads of 128).
      Dims d = dims_for(Family::kDeepseekV3, preset);
      d.index_heads = preset == Preset::kMedium ? 16 : 4;
      d.index_head_dim = preset == Preset::kTiny ? 32 : 64;
      return d;
    }
    case Family::kQwen3:
    case Family::kGemma:
    case Family::kGemma2:
    case Family::kGemma3: {
      // Llama's sizes with head_dim 32 in tiny: the q width (8 x 32) is not hidden, as
      // in Qwen3-8B and Gemma-7B, so the config's head_dim is what counts.
      Dims d = dims_for(Family::kLlama, preset);
      if (preset == Preset::kTiny) {
        d.head_dim = 32;
      }
      if (preset == Preset::kMedium && family != Family::kQwen3) {
        // Gemma has no lm_head; a larger vocabulary (Gemma's is 256000) keeps medium
        // above 2 GiB.
        d.vocab = 64000;
      }
      return d;
    }
    case Family::kPhi3:
      return dims_for(Family::kLlama, preset);
    case Family::kLlama:
    case Family::kQwen2:
      switch (preset) {
        case Preset::kTiny:
          return {.hidden = 128, .intermediate = 256, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 16, .vocab = 1000};
        case Preset::kSmall:
          return {.hidden = 512, .intermediate = 1408, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 64, .vocab = 8000};
        case Preset::kMedium:  // TinyLlama-1.1B's shape
          return {.hidden = 2048, .intermediate = 5632, .layers = 22, .heads = 32, .kv_heads = 4,
                  .head_dim = 64, .vocab = 32000};
      }
      break;
    case Family::kMixtral:
      switch (preset) {
        case Preset::kTiny:
          return {.hidden = 128, .intermediate = 128, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 16, .vocab = 1000, .experts = 8, .experts_per_tok = 2};
        case Preset::kSmall:
          return {.hidden = 256, .intermediate = 512, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 32, .vocab = 8000, .experts = 8, .experts_per_tok = 2};
        case Preset::kMedium:
          return {.hidden = 1024, .intermediate = 2560, .layers = 16, .heads = 16, .kv_heads = 4,
                  .head_dim = 64, .vocab = 32000, .experts = 8, .experts_per_tok = 2};
      }
      break;
    case Family::kQwen3Moe:
      switch (preset) {
        case Preset::kTiny:
          return {.hidden = 128, .intermediate = 256, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 16, .vocab = 1000, .experts = 8, .experts_per_tok = 2,
                  .moe_intermediate = 64};
        case Preset::kSmall:
          return {.hidden = 256, .intermediate = 768, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 64, .vocab = 8000, .experts = 16, .experts_per_tok = 4,
                  .moe_intermediate = 128};
        case Preset::kMedium:
          return {.hidden = 1024, .intermediate = 2816, .layers = 19, .heads = 16, .kv_heads = 4,
                  .head_dim = 128, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
                  .moe_intermediate = 512};
      }
      break;
    case Family::kDeepseekV3:
      // MLA keeps one key/value head per query head: num_key_value_heads = heads.
      switch (preset) {
        case Preset::kTiny:
          return {.hidden = 128, .intermediate = 256, .layers = 2, .heads = 8, .kv_heads = 8,
                  .vocab = 1000, .experts = 8, .experts_per_tok = 2, .moe_intermediate = 32,
                  .q_lora_rank = 64, .kv_lora_rank = 32, .qk_nope = 16, .qk_rope = 8,
                  .v_head = 16, .shared_experts = 1, .first_k_dense = 1, .n_group = 4,
                  .topk_group = 2};
        case Preset::kSmall:
          return {.hidden = 256, .intermediate = 768, .layers = 4, .heads = 8, .kv_heads = 8,
                  .vocab = 8000, .experts = 16, .experts_per_tok = 4, .moe_intermediate = 128,
                  .q_lora_rank = 128, .kv_lora_rank = 64, .qk_nope = 32, .qk_rope = 16,
                  .v_head = 32, .shared_experts = 1, .first_k_dense = 1, .n_group = 4,
                  .topk_group = 2};
        case Preset::kMedium:
          return {.hidden = 1024, .intermediate = 2816, .layers = 18, .heads = 16,
                  .kv_heads = 16, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
                  .moe_intermediate = 512, .q_lora_rank = 384, .kv_lora_rank = 256,
                  .qk_nope = 64, .qk_rope = 32, .v_head = 64, .shared_experts = 1,
                  .first_k_dense = 1, .n_group = 8, .topk_group = 4};
      }
      break;
    case Family::kMistral:
      // Llama's layout with Mistral's 4:1 grouped-query ratio and 32768 vocabulary.
      switch (preset) {
        case Preset::kTiny:
          return {.hidden = 128, .intermediate = 256, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 16, .vocab = 1000};
        case Preset::kSmall:
          return {.hidden = 512, .intermediate = 1408, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 64, .vocab = 8000};
        case Preset::kMedium:
          return {.hidden = 2048, .intermediate = 5632, .layers = 22, .heads = 32, .kv_heads = 8,
                  .head_dim = 64, .vocab = 32768};
      }
      break;
    case Family::kQwen2Moe:
      // Tiny's shared expert is exactly as wide as a routed one, so a loader may fuse
      // it in as one more expert; small and medium keep the real models' 4x ratio
      // (Qwen1.5-MoE-A2.7B: 1408 and 5632).
      switch (preset) {
        case Preset::kTiny:
          return {.hidden = 128, .intermediate = 256, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 16, .vocab = 1000, .experts = 8, .experts_per_tok = 2,
                  .moe_intermediate = 64, .shared_intermediate = 64};
        case Preset::kSmall:
          return {.hidden = 256, .intermediate = 1024, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 32, .vocab = 8000, .experts = 16, .experts_per_tok = 4,
                  .moe_intermediate = 128, .shared_intermediate = 512};
        case Preset::kMedium:
          return {.hidden = 1024, .intermediate = 2816, .layers = 18, .heads = 16, .kv_heads = 4,
                  .head_dim = 64, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
                  .moe_intermediate = 512, .shared_intermediate = 2048};
      }
      break;
    case Family::kDeepseekV2:
      // Tiny and medium are DeepSeek-V2-Lite-shaped (q_lora_rank null, greedy top-k, one
      // group); small is DeepSeek-V2-shaped (q_lora_rank set, group-limited top-k). The
      // real models have 2 shared experts, as small and medium do; tiny has 1 so that a
      // loader can fuse it in as one more routed expert.
      switch (preset) {
        case Preset::kTiny:
          return {.hidden = 128, .intermediate = 256, .layers = 3, .heads = 8, .kv_heads = 8,
                  .vocab = 1000, .experts = 8, .experts_per_tok = 2, .moe_intermediate = 32,
                  .q_lora_rank = 0, .kv_lora_rank = 32, .qk_nope = 16, .qk_rope = 8,
                  .v_head = 16, .shared_experts = 1, .first_k_dense = 1, .n_group = 1,
                  .topk_group = 1};
        case Preset::kSmall:
          return {.hidden = 256, .intermediate = 768, .layers = 4, .heads = 8, .kv_heads = 8,
                  .vocab = 8000, .experts = 16, .experts_per_tok = 4, .moe_intermediate = 128,
                  .q_lora_rank = 128, .kv_lora_rank = 64, .qk_nope = 32, .qk_rope = 16,
                  .v_head = 32, .shared_experts = 2, .first_k_dense = 1, .n_group = 4,
                  .topk_group = 2};
        case Preset::kMedium:
          return {.hidden = 1024, .intermediate = 2816, .layers = 20, .heads = 16,
                  .kv_heads = 16, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
                  .moe_intermediate = 512, .q_lora_rank = 0, .kv_lora_rank = 256,
                  .qk_nope = 64, .qk_rope = 32, .v_head = 64, .shared_experts = 2,
                  .first_k_dense = 1, .n_group = 1, .topk_group = 1};
      }
      break;
    case Family::kGlm4Moe:
      // GLM-4.5-Air-shaped: heads x head_dim is twice hidden, one shared expert, one
      // dense layer first, one group.
      switch (preset) {
        case Preset::kTiny:
          return {.hidden = 128, .intermediate = 256, .layers = 2, .heads = 8, .kv_heads = 2,
                  .head_dim = 32, .vocab = 1000, .experts = 8, .experts_per_tok = 2,
                  .moe_intermediate = 64, .shared_experts = 1, .first_k_dense = 1,
                  .n_group = 1, .topk_group = 1};
        case Preset::kSmall:
          return {.hidden = 256, .intermediate = 768, .layers = 4, .heads = 8, .kv_heads = 2,
                  .head_dim = 64, .vocab = 8000, .experts = 16, .experts_per_tok = 4,
                  .moe_intermediate = 128, .shared_experts = 1, .first_k_dense = 1,
                  .n_group = 1, .topk_group = 1};
        case Preset::kMedium:
          return {.hidden = 1024, .intermediate = 2816, .layers = 18, .heads = 16, .kv_heads = 4,
                  .head_dim = 128, .vocab = 32000, .experts = 32, .experts_per_tok = 4,
                  .moe_intermediate = 512, .shared_experts = 1, .first_k_dense = 1,
                  .n_group = 1, .topk_group = 1};
      }
      break;
  }
  fail("", "no sizes for this family and preset");
}
// clang-format on

// ---- a real model's config.json ------------------------------------------------

// Typed reads of one config field; errors name the file and the field.
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& config, const std::string& file) : c_(config), file_(file) {}

  [[noreturn]] void refuse(std::string_view key, const std::string& why) const {
    fail(file_, "field '" + std::string(key) + "' " + why);
  }

  // Present and not null.
  const nlohmann::json* find(std::string_view key) const {
    auto it = c_.find(key);
    return it == c_.end() || it->is_null() ? nullptr : &*it;
  }

  // A non-negative integer; `fallback` when absent or null, an error when required.
  std::uint64_t count(std::string_view key, std::optional<std::uint64_t> fallback) const {
    const nlohmann::json* v = find(key);
    if (v == nullptr) {
      if (!fallback) {
        refuse(key, "is missing (a whole number is needed)");
      }
      return *fallback;
    }
    if (!v->is_number_unsigned() && !(v->is_number_integer() && v->get<std::int64_t>() >= 0)) {
      refuse(key, "must be a whole number, not " + v->dump());
    }
    return v->get<std::uint64_t>();
  }

  // A positive integer; `fallback` when absent or null, an error when required.
  std::uint64_t positive(std::string_view key,
                         std::optional<std::uint64_t> fallback = std::nullopt) const {
    std::uint64_t n = count(key, fallback);
    if (n == 0 && find(key) != nullptr) {
      refuse(key, "must be positive, not 0");
    }
    return n;
  }

  bool boolean(std::string_view key, bool fallback) const {
    const nlohmann::json* v = find(key);
    if (v == nullptr) {
      return fallback;
    }
    if (!v->is_boolean()) {
      refuse(key, "must be true or false, not " + v->dump());
    }
    return v->get<bool>();
  }

  std::string text(std::string_view key, std::string fallback) const {
    const nlohmann::json* v = find(key);
    if (v == nullptr) {
      return fallback;
    }
    if (!v->is_string()) {
      refuse(key, "must be a string, not " + v->dump());
    }
    return v->get<std::string>();
  }

  // Fields the family's tensor list has no way to honour: refuse anything else.
  void require_count(std::string_view key, std::uint64_t fallback, std::uint64_t want,
                     const std::string& why) const {
    if (std::uint64_t n = count(key, fallback); n != want) {
      refuse(key, "is " + std::to_string(n) + "; only " + std::to_string(want) + " is supported (" +
                      why + ")");
    }
  }
  void require_bool(std::string_view key, bool fallback, bool want, const std::string& why) const {
    if (boolean(key, fallback) != want) {
      refuse(key, std::string("is ") + (want ? "false" : "true") + (find(key) ? "" : " (absent)") +
                      "; only " + (want ? "true" : "false") + " is supported (" + why + ")");
    }
  }
  // Qwen-MoE: the list must be empty (absent or null counts as empty).
  void require_empty_list(std::string_view key, const std::string& why) const {
    const nlohmann::json* v = find(key);
    if (v != nullptr && !(v->is_array() && v->empty())) {
      refuse(key, "is " + v->dump() + "; only an empty list is supported (" + why + ")");
    }
  }

  std::uint64_t head_dim(std::uint64_t hidden, std::uint64_t heads) const {
    if (find("head_dim") != nullptr) {
      return positive("head_dim");
    }
    if (hidden % heads != 0) {
      refuse("head_dim", "is absent and hidden_size " + std::to_string(hidden) +
                             " is not a multiple of num_attention_heads " + std::to_string(heads));
    }
    return hidden / heads;
  }

 private:
  const nlohmann::json& c_;
  const std::string& file_;
};

struct Architecture {
  const char* name;
  Family family;
};
// One per line, in the order of the message that lists them.
// clang-format off
constexpr Architecture kArchitectures[] = {
    {"LlamaForCausalLM", Family::kLlama},
    {"Qwen2ForCausalLM", Family::kQwen2},
    {"MistralForCausalLM", Family::kMistral},
    {"MixtralForCausalLM", Family::kMixtral},
    {"Qwen3MoeForCausalLM", Family::kQwen3Moe},
    {"Qwen2MoeForCausalLM", Family::kQwen2Moe},
    {"DeepseekV2ForCausalLM", Family::kDeepseekV2},
    {"DeepseekV3ForCausalLM", Family::kDeepseekV3},
    {"DeepseekV32ForCausalLM", Family::kDeepseekV32},
    {"Glm4MoeForCausalLM", Family::kGlm4Moe},
    {"Qwen3ForCausalLM", Family::kQwen3},
    {"GemmaForCausalLM", Family::kGemma},
    {"Gemma2ForCausalLM", Family::kGemma2},
    {"Gemma3ForCausalLM", Family::kGemma3},
    {"Phi3ForCausalLM", Family::kPhi3},
};
// clang-format on

Family family_of_config(const nlohmann::json& config, const std::string& file) {
  auto arch = config.find("architectures");
  if (arch == config.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    fail(file, "field 'architectures' must be a non-empty list of names");
  }
  const std::string name = (*arch)[0].get<std::string>();
  std::string known;
  for (const Architecture& a : kArchitectures) {
    if (name == a.name) {
      return a.family;
    }
    known += (known.empty() ? "" : ", ") + std::string(a.name);
  }
  fail(file, "architecture " + name +
                 " (architectures[0]) has no synthetic family (supported: " + known + ")");
}

// The sizes of the model `config` describes, refusing what the family's tensor list
// cannot express (see SynthSource).
Dims dims_from_config(Family family, const nlohmann::json& config, const std::string& file) {
  ConfigReader r(config, file);
  Dims d;
  d.hidden = r.positive("hidden_size");
  d.layers = r.positive("num_hidden_layers");
  d.heads = r.positive("num_attention_heads");
  d.kv_heads = r.positive("num_key_value_heads", d.heads);
  d.vocab = r.positive("vocab_size");
  r.boolean("tie_word_embeddings", false);  // checked here, read by the caller
  const std::string every_layer_sparse = "every layer is an MoE layer here";
  switch (family) {
    case Family::kLlama:
    case Family::kQwen2:
    case Family::kMistral:
      d.intermediate = r.positive("intermediate_size");
      d.head_dim = r.head_dim(d.hidden, d.heads);
      if (family == Family::kLlama) {
        r.require_bool("attention_bias", false, false, "Llama's projections have no biases here");
        r.require_bool("mlp_bias", false, false, "Llama's MLP has no biases here");
      }
      break;
    case Family::kQwen3:
    case Family::kGemma:
    case Family::kGemma2:
    case Family::kGemma3:
    case Family::kPhi3:
      d.intermediate = r.positive("intermediate_size");
      d.head_dim = r.head_dim(d.hidden, d.heads);
      r.require_bool("attention_bias", false, false, "the projections have no biases here");
      break;
    case Family::kMixtral:
      d.intermediate = r.positive("intermediate_size");
      d.head_dim = r.head_dim(d.hidden, d.heads);
      d.experts = r.positive("num_local_experts");
      d.experts_per_tok = r.positive("num_experts_per_tok", 2);
      break;
    case Family::kQwen3Moe:
    case Family::kQwen2Moe:
      d.intermediate = r.count("intermediate_size", 0);
      d.head_dim = r.head_dim(d.hidden, d.heads);
      d.experts = r.positive("num_experts");
      d.experts_per_tok = r.positive("num_experts_per_tok", 1);
      d.moe_intermediate = r.positive("moe_intermediate_size");
      r.require_count("decoder_sparse_step", 1, 1, every_layer_sparse);
      r.require_empty_list("mlp_only_layers", every_layer_sparse);
      if (family == Family::kQwen3Moe) {
        r.require_bool("attention_bias", false, false,
                       "Qwen3-MoE's projections have no biases here");
      } else {
        d.shared_intermediate = r.positive("shared_expert_intermediate_size");
      }
      break;
    case Family::kDeepseekV2:
    case Family::kDeepseekV3:
    case Family::kDeepseekV32:
    case Family::kGlm4Moe: {
      d.intermediate = r.positive("intermediate_size");
      d.experts = r.positive("n_routed_experts");
      d.experts_per_tok = r.positive("num_experts_per_tok", 1);
      d.moe_intermediate = r.positive("moe_intermediate_size");
      d.shared_experts = r.positive("n_shared_experts");
      d.first_k_dense = r.count("first_k_dense_replace", 0);
      d.n_group = r.positive("n_group", 1);
      d.topk_group = r.positive("topk_group", 1);
      d.nextn_layers = r.count("num_nextn_predict_layers", 0);
      if (family == Family::kGlm4Moe) {
        d.head_dim = r.head_dim(d.hidden, d.heads);
        d.qk_norm = r.boolean("use_qk_norm", false);
        r.require_bool("attention_bias", false, true,
                       "GLM-4 MoE's q/k/v projections have biases here");
        if (d.nextn_layers > 1) {
          r.refuse("num_nextn_predict_layers",
                   "is " + std::to_string(d.nextn_layers) + "; only 0 or 1 MTP layer is supported");
        }
        break;
      }
      d.q_lora_rank = r.positive("q_lora_rank", 0);  // null: a plain q_proj
      d.kv_lora_rank = r.positive("kv_lora_rank");
      d.qk_nope = r.positive("qk_nope_head_dim");
      d.qk_rope = r.positive("qk_rope_head_dim");
      d.v_head = r.positive("v_head_dim");
      r.require_count("moe_layer_freq", 1, 1, "every layer from first_k_dense_replace on is MoE");
      r.require_bool("attention_bias", false, false, "MLA's projections have no biases here");
      // The router has e_score_correction_bias exactly for noaux_tc routing, which the
      // family fixes: always for V3, never for V2 (the defaults of ferry's models).
      const bool v3 = deepseek_v3_like(family);
      const std::string topk = r.text("topk_method", v3 ? "noaux_tc" : "greedy");
      if ((topk == "noaux_tc") != v3) {
        r.refuse("topk_method", "is \"" + topk + "\"; " +
                                    (v3 ? "DeepSeek-V3 is synthesized with noaux_tc routing "
                                          "(a gate with e_score_correction_bias)"
                                        : "DeepSeek-V2 is synthesized without noaux_tc routing "
                                          "(a gate without e_score_correction_bias)"));
      }
      if (v3 && d.nextn_layers > 1) {
        r.refuse("num_nextn_predict_layers",
                 "is " + std::to_string(d.nextn_layers) + "; only 0 or 1 MTP layer is supported");
      }
      if (v3 && config.contains("index_topk") && !config["index_topk"].is_null()) {
        d.index_heads = r.positive("index_n_heads");
        d.index_head_dim = r.positive("index_head_dim");
        r.require_count("index_topk_freq", 1, 1, "an indexer is synthesized in every layer");
        for (const char* key : {"indexer_types", "index_topk_pattern"}) {
          if (config.contains(key) && !config[key].is_null()) {
            r.refuse(key, "is set; an indexer is synthesized in every layer");
          }
        }
      }
      if (!v3 && d.nextn_layers != 0) {
        r.refuse("num_nextn_predict_layers",
                 "is " + std::to_string(d.nextn_layers) +
                     "; DeepSeek-V2 is synthesized without an MTP layer");
      }
      break;
    }
  }
  return d;
}

std::uint64_t scale_hidden_checked(const Dims& d, std::uint64_t scale_hidden,
                                   const std::string& file) {
  if (scale_hidden % 8 != 0 || scale_hidden >= d.hidden) {
    fail(file, "--scale-dims " + std::to_string(scale_hidden) +
                   " must be a positive multiple of 8 below hidden_size " +
                   std::to_string(d.hidden));
  }
  return scale_hidden;
}

// Every width scaled to hidden `scale_hidden`; counts (layers, experts, heads, vocab)
// stay.
Dims scaled_dims(Dims d, std::uint64_t scale_hidden) {
  const std::uint64_t h = d.hidden;
  for (std::uint64_t* w :
       {&d.intermediate, &d.moe_intermediate, &d.shared_intermediate, &d.q_lora_rank,
        &d.kv_lora_rank, &d.qk_nope, &d.qk_rope, &d.v_head, &d.head_dim, &d.index_head_dim}) {
    *w = synth_scaled_width(*w, h, scale_hidden);
  }
  d.hidden = scale_hidden;
  return d;
}

// ---- tensor lists --------------------------------------------------------------

class ListBuilder {
 public:
  ListBuilder(DType dtype, const Dims& d, bool fused_experts)
      : dtype_(dtype), d_(d), fused_experts_(fused_experts) {}

  void add(std::string name, std::vector<std::uint64_t> shape) {
    add_typed(std::move(name), dtype_, std::move(shape));
  }
  void add_typed(std::string name, DType dtype, std::vector<std::uint64_t> shape) {
    out_.push_back({std::move(name), dtype, std::move(shape), file_});
  }
  // Tensors added from now on go to the unindexed file `file` ("" = the indexed shards).
  void set_file(std::string file) { file_ = std::move(file); }

  // Llama-style attention; Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k norms.
  void attention(const std::string& p, bool bias, bool qk_norm) {
    std::uint64_t q = d_.heads * d_.head_dim;
    std::uint64_t kv = d_.kv_heads * d_.head_dim;
    add(p + "self_attn.q_proj.weight", {q, d_.hidden});
    if (bias) {
      add(p + "self_attn.q_proj.bias", {q});
    }
    add(p + "self_attn.k_proj.weight", {kv, d_.hidden});
    if (bias) {
      add(p + "self_attn.k_proj.bias", {kv});
    }
    add(p + "self_attn.v_proj.weight", {kv, d_.hidden});
    if (bias) {
      add(p + "self_attn.v_proj.bias", {kv});
    }
    add(p + "self_attn.o_proj.weight", {d_.hidden, q});
    if (qk_norm) {
      add(p + "self_attn.q_norm.weight", {d_.head_dim});
      add(p + "self_attn.k_norm.weight", {d_.head_dim});
    }
  }

  // DeepSeek multi-head latent attention. Without a query LoRA (q_lora_rank null, as
  // DeepSeek-V2-Lite) the query is one plain projection.
  void mla(const std::string& p) {
    std::uint64_t qk_head = d_.qk_nope + d_.qk_rope;
    if (d_.q_lora_rank == 0) {
      add(p + "self_attn.q_proj.weight", {d_.heads * qk_head, d_.hidden});
    } else {
      add(p + "self_attn.q_a_proj.weight", {d_.q_lora_rank, d_.hidden});
      add(p + "self_attn.q_a_layernorm.weight", {d_.q_lora_rank});
      add(p + "self_attn.q_b_proj.weight", {d_.heads * qk_head, d_.q_lora_rank});
    }
    add(p + "self_attn.kv_a_proj_with_mqa.weight", {d_.kv_lora_rank + d_.qk_rope, d_.hidden});
    add(p + "self_attn.kv_a_layernorm.weight", {d_.kv_lora_rank});
    add(p + "self_attn.kv_b_proj.weight", {d_.heads * (d_.qk_nope + d_.v_head), d_.kv_lora_rank});
    add(p + "self_attn.o_proj.weight", {d_.hidden, d_.heads * d_.v_head});
    if (d_.index_heads != 0) {
      // DeepSeek-V3.2's indexer (the reference model's Indexer): wq_b from the query
      // latent, wk and weights_proj from the hidden state, a LayerNorm on the keys.
      const std::string i = p + "self_attn.indexer.";
      add(i + "wq_b.weight", {d_.index_heads * d_.index_head_dim, d_.q_lora_rank});
      add(i + "wk.weight", {d_.index_head_dim, d_.hidden});
      add(i + "k_norm.weight", {d_.index_head_dim});
      add(i + "k_norm.bias", {d_.index_head_dim});
      add(i + "weights_proj.weight", {d_.index_heads, d_.hidden});
    }
  }

  void gated_mlp(const std::string& p, std::uint64_t inter) {
    add(p + "gate_proj.weight", {inter, d_.hidden});
    add(p + "up_proj.weight", {inter, d_.hidden});
    add(p + "down_proj.weight", {d_.hidden, inter});
  }

  // The routed experts of the MoE block at `p` (which ends in "mlp." or
  // "block_sparse_moe."): per expert, or with --fused-experts the two 3-D tensors
  // described at synth_fused_expert_element.
  void routed_experts(const std::string& p, std::uint64_t inter, bool mixtral_names) {
    if (fused_experts_) {
      add(p + "experts.gate_up_proj", {d_.experts, 2 * inter, d_.hidden});
      add(p + "experts.down_proj", {d_.experts, d_.hidden, inter});
      return;
    }
    for (std::uint64_t e = 0; e < d_.experts; ++e) {
      std::string x = p + "experts." + std::to_string(e) + ".";
      if (mixtral_names) {  // w1 = gate, w2 = down, w3 = up
        add(x + "w1.weight", {inter, d_.hidden});
        add(x + "w2.weight", {d_.hidden, inter});
        add(x + "w3.weight", {inter, d_.hidden});
      } else {
        gated_mlp(x, inter);
      }
    }
  }

  void mixtral_moe(const std::string& p) {
    add(p + "block_sparse_moe.gate.weight", {d_.experts, d_.hidden});
    routed_experts(p + "block_sparse_moe.", d_.intermediate, true);
  }

  void qwen3_moe(const std::string& p) {
    add(p + "mlp.gate.weight", {d_.experts, d_.hidden});
    routed_experts(p + "mlp.", d_.moe_intermediate, false);
  }

  // Qwen2MoeSparseMoeBlock registers the router, the experts, one shared expert and
  // the shared expert's one-row sigmoid gate, in that order.
  void qwen2_moe(const std::string& p) {
    add(p + "mlp.gate.weight", {d_.experts, d_.hidden});
    routed_experts(p + "mlp.", d_.moe_intermediate, false);
    gated_mlp(p + "mlp.shared_expert.", d_.shared_intermediate);
    add(p + "mlp.shared_expert_gate.weight", {1, d_.hidden});
  }

  // DeepseekV3MoE (and GLM-4 MoE, derived from it) registers experts, then the gate,
  // then the shared experts. DeepSeek-V2's gate has no correction bias.
  void deepseek_moe(const std::string& p, bool score_bias) {
    routed_experts(p + "mlp.", d_.moe_intermediate, false);
    add(p + "mlp.gate.weight", {d_.experts, d_.hidden});
    if (score_bias) {
      add_typed(p + "mlp.gate.e_score_correction_bias", DType::kF32, {d_.experts});
    }
    gated_mlp(p + "mlp.shared_experts.", d_.moe_intermediate * d_.shared_experts);
  }

  void layer_norms(const std::string& p) {
    add(p + "input_layernorm.weight", {d_.hidden});
    add(p + "post_attention_layernorm.weight", {d_.hidden});
  }

  std::vector<SynthTensor> take() { return std::move(out_); }

 private:
  DType dtype_;
  const Dims& d_;
  bool fused_experts_;
  std::string file_;
  std::vector<SynthTensor> out_;
};

std::string layer_prefix(std::uint64_t i) {
  return "model.layers." + std::to_string(i) + ".";
}

std::string_view torch_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return "float16";
    case DType::kF32:
      return "float32";
    default:
      return "bfloat16";
  }
}

// ---- files ---------------------------------------------------------------------

// Writes all of `text` to `fd`, closing it on failure.
void write_all(int fd, const std::string& path, std::string_view text) {
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      ::close(fd);
      throw_errno(Stage::kSynth, path, "write failed", err);
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// Optionally fsyncs, then closes `fd`.
void sync_and_close(int fd, const std::string& path, bool sync) {
  if (sync && ::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    throw_errno(Stage::kSynth, path, "fsync failed", err);
  }
  if (::close(fd) != 0) {
    throw_errno(Stage::kSynth, path, "close failed", errno);
  }
}

void write_text_file(const std::string& path, const std::string& text, bool sync) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw_errno(Stage::kSynth, path, "cannot create the file", errno);
  }
  write_all(fd, path, text);
  sync_and_close(fd, path, sync);
}

// A safetensors file whose data region is a hole: the 8-byte length and the header
// exactly as io::SafetensorsWriter lays them out, then ftruncate to the full size,
// so the data reads as zeros and takes no disk.
void write_sparse_safetensors(const std::string& path,
                              const std::vector<io::SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata,
                              std::uint64_t data_bytes, bool sync) {
  std::string header = io::safetensors_header_text(entries, metadata, path);
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) {
    bytes[static_cast<std::size_t>(i)] =
        static_cast<char>((static_cast<std::uint64_t>(header.size()) >> (8 * i)) & 0xff);
  }
  bytes += header;
  std::uint64_t size = bytes.size() + data_bytes;
  if (size > static_cast<std::uint64_t>(std::numeric_limits<off_t>::max())) {
    fail(path, "a file of " + std::to_string(size) + " bytes is too large for this system");
  }
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw_errno(Stage::kSynth, path, "cannot create the file", errno);
  }
  write_all(fd, path, bytes);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    ::close(fd);
    throw_errno(Stage::kSynth, path, "cannot extend the file to " + std::to_string(size) + " bytes",
                err);
  }
  sync_and_close(fd, path, sync);
}

// Makes renames inside `dir` durable. Best effort: some file systems refuse
// fsync on a directory, which is no reason to fail a synth.
void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    if (::fsync(fd) != 0) {
      log::debug("synth: fsync of folder " + dir.string() + " failed: " + errno_text(errno));
    }
    ::close(fd);
  }
}

bool is_checkpoint_file_name(const std::string& name) {
  auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends_with(".safetensors") || ends_with(".json");
}

enum class Target { kAbsent, kEmpty, kReplace };

// What is at `out` now, and whether this synth may take its place.
Target inspect_target(const fs::path& out, bool force) {
  std::error_code ec;
  fs::file_status st = fs::symlink_status(out, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    fail(out.string(), "cannot inspect the output folder: " + ec.message());
  }
  if (!fs::exists(st)) {
    return Target::kAbsent;
  }
  if (fs::is_symlink(st)) {
    fail(out.string(), "the output is a symbolic link; give the folder it points to");
  }
  if (!fs::is_directory(st)) {
    fail(out.string(), "the output exists and is not a folder");
  }
  fs::directory_iterator it(out, ec);
  if (ec) {
    fail(out.string(), "cannot list the output folder: " + ec.message());
  }
  bool empty = true;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) {
      fail(out.string(), "cannot list the output folder: " + ec.message());
    }
    empty = false;
    if (!force) {
      break;
    }
    std::string name = it->path().filename().string();
    if (!it->is_regular_file(ec) || it->is_symlink(ec) || !is_checkpoint_file_name(name)) {
      fail(out.string(), "refusing to replace the folder: it holds '" + name +
                             "', which is not a checkpoint file (*.safetensors, *.json)");
    }
  }
  if (ec) {
    fail(out.string(), "cannot list the output folder: " + ec.message());
  }
  if (empty) {
    return Target::kEmpty;
  }
  if (!force) {
    fail(out.string(), "the output folder exists and is not empty (pass --force to replace it)");
  }
  return Target::kReplace;
}

// A sibling folder made by mkdtemp, removed at scope exit unless released.
class TempFolder {
 public:
  TempFolder(const fs::path& out, std::string_view tag) {
    std::string tmpl = out.string() + std::string(tag) + "XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      throw_errno(Stage::kSynth, tmpl, "cannot create a temporary folder", errno);
    }
    path_ = tmpl;
    // mkdtemp makes it 0700; the checkpoint folder should read like one mkdir made.
    ::chmod(tmpl.c_str(), 0755);
  }
  ~TempFolder() {
    if (!path_.empty()) {
      std::error_code ec;
      fs::remove_all(path_, ec);
      if (ec) {
        log::write_built(
            log::Level::kWarn,
            [&] { return "synth: cannot remove " + path_.string() + ": " + ec.message(); },
            "synth: cannot remove its temporary folder");
      }
    }
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;

  const fs::path& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  fs::path path_;
};

// Puts the finished temporary folder at `out`. rename(2) replaces an empty folder
// atomically; a non-empty one is swapped with RENAME_EXCHANGE so `out` is never
// missing, and the old contents (now in the temporary folder) are removed.
void install(TempFolder& tmp, const fs::path& out, Target target) {
  if (target != Target::kReplace) {
    if (::rename(tmp.path().c_str(), out.c_str()) != 0) {
      int err = errno;
      if (err == ENOTEMPTY || err == EEXIST) {
        fail(out.string(), "the output folder was filled by someone else while synth ran");
      }
      throw_errno(Stage::kSynth, out.string(), "cannot rename the finished checkpoint into place",
                  err);
    }
    tmp.release();
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.path().c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) == 0) {
    return;  // `tmp` now holds the old checkpoint; its destructor removes it
  }
  if (errno != EINVAL && errno != ENOSYS) {
    throw_errno(Stage::kSynth, out.string(), "cannot swap the finished checkpoint into place",
                errno);
  }
  // No RENAME_EXCHANGE on this file system: move the old folder aside first.
  TempFolder old(out, ".old-");
  if (::rename(out.c_str(), old.path().c_str()) != 0) {
    throw_errno(Stage::kSynth, out.string(), "cannot move the old checkpoint aside", errno);
  }
  if (::rename(tmp.path().c_str(), out.c_str()) != 0) {
    int err = errno;
    ::rename(old.path().c_str(), out.c_str());
    throw_errno(Stage::kSynth, out.string(), "cannot rename the finished checkpoint into place",
                err);
  }
  tmp.release();
}

// Absolute, without a trailing separator, so the sibling temporary folder is
// really a sibling.
fs::path normalize_out(const std::string& out) {
  if (out.empty()) {
    fail("", "no output folder given (--out DIR)");
  }
  fs::path p = fs::absolute(fs::path(out)).lexically_normal();
  if (!p.has_filename() && p.has_relative_path()) {
    p = p.parent_path();
  }
  std::string name = p.filename().string();
  if (name.empty() || name == "." || name == "..") {
    fail(out, "the output must name a folder (not '/', '.' or '..')");
  }
  return p;
}

}  // namespace

// ---- values (public) -------------------------------------------------------------

float synth_value(std::uint64_t seed, std::string_view tensor_name, std::uint64_t index) {
  return value_of(splitmix64((seed ^ fnv1a64(tensor_name)) + index) % 255);
}

std::uint16_t float_to_bf16_bits(float value) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  if ((x & 0x7fffffffU) > 0x7f800000U) {
    return static_cast<std::uint16_t>((x >> 16) | 0x0040U);  // quiet NaN, sign kept
  }
  std::uint32_t rounding = 0x7fffU + ((x >> 16) & 1U);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

std::uint16_t float_to_f16_bits(float value) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  std::uint32_t sign = (x >> 16) & 0x8000U;
  std::uint32_t exp = (x >> 23) & 0xffU;
  std::uint32_t mant = x & 0x7fffffU;
  if (exp == 0xff) {  // infinity or NaN (kept quiet, top payload bits kept)
    return static_cast<std::uint16_t>(sign | 0x7c00U | (mant != 0 ? 0x0200U | (mant >> 13) : 0));
  }
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) {
    return static_cast<std::uint16_t>(sign | 0x7c00U);
  }
  if (e <= 0) {
    // Half subnormal: value / 2^-24, rounded to nearest even. Below 2^-25 it is 0.
    if (e < -10) {
      return static_cast<std::uint16_t>(sign);
    }
    std::uint32_t m = mant | 0x800000U;
    int shift = 14 - e;
    std::uint32_t half = m >> shift;
    std::uint32_t rem = m & ((1U << shift) - 1U);
    std::uint32_t halfway = 1U << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1U) != 0)) {
      ++half;  // may carry into the smallest normal, which is the right answer
    }
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t half = sign | (static_cast<std::uint32_t>(e) << 10) | (mant >> 13);
  std::uint32_t rem = mant & 0x1fffU;
  if (rem > 0x1000U || (rem == 0x1000U && (half & 1U) != 0)) {
    ++half;  // a carry out of the mantissa bumps the exponent, up to infinity
  }
  return static_cast<std::uint16_t>(half);
}

void synth_encode(DType dtype, std::uint64_t seed, std::string_view name, std::uint64_t first_index,
                  std::span<std::byte> out) {
  if (dtype == DType::kF8E4M3) {
    encode_with(e4m3_table(), (seed ^ fnv1a64(name)) + first_index, out);
    return;
  }
  if (dtype == DType::kU8) {  // packed NVFP4 weights: any byte
    const std::uint64_t base = (seed ^ fnv1a64(name)) + first_index;
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = static_cast<std::byte>(splitmix64(base + i) & 0xFF);
    }
    return;
  }
  check_dtype(dtype);
  if (out.size() % dtype_size(dtype) != 0) {
    throw Error(Stage::kSynth, "", std::string(name),
                "encode buffer of " + std::to_string(out.size()) +
                    " bytes is not a whole number of " + std::string(dtype_name(dtype)) +
                    " elements");
  }
  std::uint64_t base = (seed ^ fnv1a64(name)) + first_index;
  switch (dtype) {
    case DType::kBF16:
      encode_with(bf16_table(), base, out);
      break;
    case DType::kF16:
      encode_with(f16_table(), base, out);
      break;
    default:
      encode_with(f32_table(), base, out);
      break;
  }
}

// ---- what a checkpoint holds (public) ------------------------------------------------

const std::vector<std::string>& synth_families() {
  // Same order as the Family enum; new families are appended, never inserted.
  static const std::vector<std::string> names{
      "llama",   "qwen2",     "mixtral",     "qwen3_moe", "deepseek_v3",
      "mistral", "qwen2_moe", "deepseek_v2", "glm4_moe",  "deepseek_v32",
      "qwen3",   "gemma",     "gemma2",      "gemma3",    "phi3"};
  return names;
}

bool synth_family_has_experts(std::string_view family) {
  return has_routed_experts(parse_family(family));
}

SynthElement synth_fused_expert_element(std::string_view moe_prefix, ExpertProj proj,
                                        std::uint64_t expert, std::uint64_t row, std::uint64_t col,
                                        std::uint64_t hidden, std::uint64_t inter) {
  std::string prefix(moe_prefix);
  switch (proj) {
    case ExpertProj::kGate:
      return {prefix + "experts.gate_up_proj", (expert * 2 * inter + row) * hidden + col};
    case ExpertProj::kUp:
      return {prefix + "experts.gate_up_proj", (expert * 2 * inter + inter + row) * hidden + col};
    case ExpertProj::kDown:
      return {prefix + "experts.down_proj", (expert * hidden + row) * inter + col};
  }
  fail("", "unknown expert projection");
}

const std::vector<std::string>& synth_presets() {
  static const std::vector<std::string> names{"tiny", "small", "medium"};
  return names;
}

std::optional<DType> parse_synth_dtype(std::string_view text) {
  if (text == "bf16" || text == "BF16") {
    return DType::kBF16;
  }
  if (text == "f16" || text == "F16") {
    return DType::kF16;
  }
  if (text == "f32" || text == "F32") {
    return DType::kF32;
  }
  return std::nullopt;
}

std::uint64_t SynthTensor::elements() const {
  std::uint64_t n = 1;
  for (std::uint64_t dim : shape) {
    n *= dim;
  }
  return n;
}

std::uint64_t SynthTensor::nbytes() const {
  return elements() * dtype_size(dtype);
}

namespace {

// Every tensor of `family` at sizes `d`, in state-dict order.
std::vector<SynthTensor> build_tensor_list(Family family, const Dims& d, DType dtype,
                                           bool tie_embeddings, bool fused_experts) {
  check_dtype(dtype);
  if (fused_experts && !has_routed_experts(family)) {
    fail("", "fused experts (--fused-experts) need a family with routed experts; '" +
                 synth_families()[static_cast<std::size_t>(family)] +
                 "' is dense (MoE families: " + join_list(moe_family_names()) + ")");
  }
  ListBuilder b(dtype, d, fused_experts);
  b.add("model.embed_tokens.weight", {d.vocab, d.hidden});
  for (std::uint64_t i = 0; i < d.layers; ++i) {
    std::string p = layer_prefix(i);
    switch (family) {
      case Family::kLlama:
      case Family::kQwen2:
      case Family::kMistral:
        b.attention(p, family == Family::kQwen2, false);
        b.gated_mlp(p + "mlp.", d.intermediate);
        break;
      case Family::kQwen3:
      case Family::kGemma:
      case Family::kGemma2:
      case Family::kGemma3:
        // Qwen3 and Gemma 3: per-head q_norm / k_norm.
        b.attention(p, false, family == Family::kQwen3 || family == Family::kGemma3);
        b.gated_mlp(p + "mlp.", d.intermediate);
        if (family == Family::kGemma2 || family == Family::kGemma3) {
          b.add(p + "pre_feedforward_layernorm.weight", {d.hidden});
          b.add(p + "post_feedforward_layernorm.weight", {d.hidden});
        }
        break;
      case Family::kPhi3:
        // Phi-3's checkpoints store qkv_proj and gate_up_proj fused.
        b.add(p + "self_attn.qkv_proj.weight",
              {(d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden});
        b.add(p + "self_attn.o_proj.weight", {d.hidden, d.heads * d.head_dim});
        b.add(p + "mlp.gate_up_proj.weight", {2 * d.intermediate, d.hidden});
        b.add(p + "mlp.down_proj.weight", {d.hidden, d.intermediate});
        break;
      case Family::kMixtral:
        b.attention(p, false, false);
        b.mixtral_moe(p);
        break;
      case Family::kQwen3Moe:
        // decoder_sparse_step 1 and no mlp_only_layers: every layer is sparse.
        b.attention(p, false, true);
        b.qwen3_moe(p);
        break;
      case Family::kQwen2Moe:
        // Same: decoder_sparse_step 1 and no mlp_only_layers, as the real checkpoints.
        b.attention(p, true, false);
        b.qwen2_moe(p);
        break;
      case Family::kDeepseekV3:
      case Family::kDeepseekV32:
      case Family::kDeepseekV2:
        b.mla(p);
        if (i < d.first_k_dense) {
          b.gated_mlp(p + "mlp.", d.intermediate);
        } else {
          b.deepseek_moe(p, deepseek_v3_like(family));
        }
        break;
      case Family::kGlm4Moe:
        // attention_bias true: q/k/v biases, none on o_proj; use_qk_norm as configured.
        b.attention(p, true, d.qk_norm);
        if (i < d.first_k_dense) {
          b.gated_mlp(p + "mlp.", d.intermediate);
        } else {
          b.deepseek_moe(p, true);
        }
        break;
    }
    b.layer_norms(p);
  }
  if (deepseek_v3_like(family) && d.nextn_layers > 0) {
    // The multi-token-prediction layer (num_nextn_predict_layers = 1) is stored as
    // layer num_hidden_layers: its own embedding, norms and projection, a full MoE
    // decoder layer and its own head.
    std::string p = layer_prefix(d.layers);
    b.add(p + "embed_tokens.weight", {d.vocab, d.hidden});
    b.add(p + "enorm.weight", {d.hidden});
    b.add(p + "hnorm.weight", {d.hidden});
    b.add(p + "eh_proj.weight", {d.hidden, 2 * d.hidden});
    b.mla(p);
    b.deepseek_moe(p, true);
    b.layer_norms(p);
    b.add(p + "shared_head.norm.weight", {d.hidden});
    b.add(p + "shared_head.head.weight", {d.vocab, d.hidden});
  }
  if (family == Family::kGlm4Moe && d.nextn_layers > 0) {
    // GLM-4.5's MTP layer, also layer num_hidden_layers, ships in an mtp.safetensors
    // that the index does not list. It has no embedding of its own.
    std::string p = layer_prefix(d.layers);
    b.set_file(kSynthMtpFile);
    b.add(p + "enorm.weight", {d.hidden});
    b.add(p + "hnorm.weight", {d.hidden});
    b.add(p + "eh_proj.weight", {d.hidden, 2 * d.hidden});
    b.attention(p, true, d.qk_norm);
    b.deepseek_moe(p, true);
    b.layer_norms(p);
    b.add(p + "shared_head.norm.weight", {d.hidden});
    b.add(p + "shared_head.head.weight", {d.vocab, d.hidden});
    b.set_file("");
  }
  b.add("model.norm.weight", {d.hidden});
  if (!tie_embeddings && !gemma_family(family)) {
    b.add("lm_head.weight", {d.vocab, d.hidden});
  }
  return b.take();
}

// The sizes to write for `source`: its own, or scaled to hidden `scale_hidden`.
Dims source_dims(const SynthSource& source, std::uint64_t scale_hidden) {
  Family family = parse_family(source.family);
  Dims d = dims_from_config(family, source.config, source.file);
  if (scale_hidden == 0) {
    return d;
  }
  return scaled_dims(d, scale_hidden_checked(d, scale_hidden, source.file));
}

}  // namespace

std::vector<SynthTensor> synth_tensor_list(std::string_view family_name,
                                           std::string_view preset_name, DType dtype,
                                           bool tie_embeddings, bool fused_experts) {
  Family family = parse_family(family_name);
  return build_tensor_list(family, dims_for(family, parse_preset(preset_name)), dtype,
                           tie_embeddings, fused_experts);
}

SynthSource synth_source(nlohmann::json config, std::string file) {
  if (!config.is_object()) {
    fail(file, "a config.json must hold a JSON object, not " + std::string(config.type_name()));
  }
  SynthSource source;
  Family family = family_of_config(config, file);
  Dims d = dims_from_config(family, config, file);  // refuse early what cannot be written
  source.family = synth_families()[static_cast<std::size_t>(family)];
  source.hidden_size = d.hidden;
  source.config = std::move(config);
  source.file = std::move(file);
  return source;
}

SynthSource read_synth_source(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    fail(path, "the model config does not exist");
  }
  // A regular file, at most the default io.max_metadata_bytes (synth reads no LoadConfig).
  const std::string text =
      read_small_file(path, Stage::kSynth, kDefaultMaxMetadataBytes, "the model config");
  if (json_depth(text) > kMaxJsonDepth) {
    fail(path, "the model config: " + json_too_deep_rule());
  }
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // out_of_range too: "1e400"
    fail(path, std::string("the model config is not valid JSON: ") + e.what());
  }
  return synth_source(std::move(config), path);
}

std::uint64_t synth_scaled_width(std::uint64_t width, std::uint64_t hidden,
                                 std::uint64_t scale_hidden) {
  if (width == 0) {
    return 0;
  }
  if (hidden == 0) {
    fail("", "cannot scale widths of a model with hidden_size 0");
  }
  // Real widths are below 2^20 and scale_hidden below hidden, so this cannot overflow.
  std::uint64_t scaled = (width * scale_hidden + hidden - 1) / hidden;
  return std::max<std::uint64_t>(8, (scaled + 7) / 8 * 8);
}

std::vector<SynthTensor> synth_tensor_list(const SynthSource& source, DType dtype,
                                           std::uint64_t scale_hidden, bool fused_experts) {
  Family family = parse_family(source.family);
  bool tied = ConfigReader(source.config, source.file).boolean("tie_word_embeddings", false);
  return build_tensor_list(family, source_dims(source, scale_hidden), dtype, tied, fused_experts);
}

nlohmann::json synth_config(const SynthSource& source, DType dtype, std::uint64_t scale_hidden) {
  check_dtype(dtype);
  Family family = parse_family(source.family);
  Dims d = source_dims(source, scale_hidden);
  nlohmann::json c = source.config;
  c.erase("quantization_config");
  c["torch_dtype"] = std::string(torch_dtype(dtype));
  if (c.contains("dtype")) {  // the newer spelling of torch_dtype
    c["dtype"] = std::string(torch_dtype(dtype));
  }
  if (scale_hidden == 0) {
    return c;
  }
  // Only fields the config has are replaced (an absent one keeps its default meaning),
  // and head_dim, which no longer equals hidden / heads.
  auto replace = [&](const char* key, std::uint64_t value) {
    if (auto it = c.find(key); it != c.end() && !it->is_null()) {
      *it = value;
    }
  };
  replace("hidden_size", d.hidden);
  replace("intermediate_size", d.intermediate);
  replace("moe_intermediate_size", d.moe_intermediate);
  replace("shared_expert_intermediate_size", d.shared_intermediate);
  replace("q_lora_rank", d.q_lora_rank);
  replace("kv_lora_rank", d.kv_lora_rank);
  replace("qk_nope_head_dim", d.qk_nope);
  replace("qk_rope_head_dim", d.qk_rope);
  replace("v_head_dim", d.v_head);
  replace("index_head_dim", d.index_head_dim);
  if (family != Family::kDeepseekV2 && !deepseek_v3_like(family)) {
    c["head_dim"] = d.head_dim;
  } else {
    // transformers' DeepSeek configs, when saved, also hold these derived fields.
    replace("head_dim", d.qk_rope);
    replace("qk_head_dim", d.qk_nope + d.qk_rope);
  }
  return c;
}

nlohmann::json synth_config(std::string_view family_name, std::string_view preset_name, DType dtype,
                            bool tie_embeddings) {
  Family family = parse_family(family_name);
  Dims d = dims_for(family, parse_preset(preset_name));
  check_dtype(dtype);
  // nlohmann::json keeps keys sorted, as save_pretrained writes them.
  nlohmann::json c = {
      {"attention_dropout", 0.0},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"hidden_act", "silu"},
      {"hidden_size", d.hidden},
      {"initializer_range", 0.02},
      {"intermediate_size", d.intermediate},
      {"max_position_embeddings", 4096},
      {"model_type", std::string(family_name)},
      {"num_attention_heads", d.heads},
      {"num_hidden_layers", d.layers},
      {"num_key_value_heads", d.kv_heads},
      {"tie_word_embeddings", tie_embeddings},
      {"torch_dtype", std::string(torch_dtype(dtype))},
      {"use_cache", true},
      {"vocab_size", d.vocab},
  };
  switch (family) {
    case Family::kLlama:
      c["architectures"] = {"LlamaForCausalLM"};
      c["attention_bias"] = false;
      c["head_dim"] = d.head_dim;
      c["mlp_bias"] = false;
      c["pretraining_tp"] = 1;
      c["rms_norm_eps"] = 1e-5;
      c["rope_scaling"] = nullptr;
      c["rope_theta"] = 500000.0;
      break;
    case Family::kQwen3:
      // As Qwen3-8B: head_dim given, no biases.
      c["architectures"] = {"Qwen3ForCausalLM"};
      c["attention_bias"] = false;
      c["head_dim"] = d.head_dim;
      c["max_window_layers"] = d.layers;
      c["rms_norm_eps"] = 1e-6;
      c["rope_scaling"] = nullptr;
      c["rope_theta"] = 1000000.0;
      c["sliding_window"] = nullptr;
      c["use_sliding_window"] = false;
      break;
    case Family::kGemma:
    case Family::kGemma2:
    case Family::kGemma3:
      // As gemma-7b, gemma-2-9b and gemma-3-1b: head_dim given, GELU, no biases; the
      // output projection is always the embedding (ferry drops an lm_head.weight).
      c["architectures"] = {family == Family::kGemma    ? "GemmaForCausalLM"
                            : family == Family::kGemma2 ? "Gemma2ForCausalLM"
                                                        : "Gemma3ForCausalLM"};
      c["attention_bias"] = false;
      c["head_dim"] = d.head_dim;
      c["hidden_act"] = "gelu_pytorch_tanh";
      c["tie_word_embeddings"] = true;
      c["model_type"] = family == Family::kGemma    ? "gemma"
                        : family == Family::kGemma2 ? "gemma2"
                                                    : "gemma3_text";
      c["rms_norm_eps"] = 1e-6;
      c["rope_theta"] = 10000.0;
      if (family != Family::kGemma) {
        c["query_pre_attn_scalar"] = d.head_dim;
        c["sliding_window"] = 4096;
      }
      break;
    case Family::kPhi3:
      // As Phi-3-mini-4k-instruct: head_dim = hidden / heads, fused projections.
      c["architectures"] = {"Phi3ForCausalLM"};
      c["attention_bias"] = false;
      c["original_max_position_embeddings"] = 4096;
      c["rms_norm_eps"] = 1e-5;
      c["rope_scaling"] = nullptr;
      c["rope_theta"] = 10000.0;
      c["sliding_window"] = 2047;
      break;
    case Family::kQwen2:
      // Qwen2 has q/k/v biases by construction: no attention_bias field.
      c["architectures"] = {"Qwen2ForCausalLM"};
      c["max_window_layers"] = d.layers;
      c["rms_norm_eps"] = 1e-6;
      c["rope_theta"] = 1000000.0;
      c["sliding_window"] = 4096;
      c["use_mrope"] = false;
      c["use_sliding_window"] = false;
      break;
    case Family::kMixtral:
      c["architectures"] = {"MixtralForCausalLM"};
      c["num_experts_per_tok"] = d.experts_per_tok;
      c["num_local_experts"] = d.experts;
      c["output_router_logits"] = false;
      c["rms_norm_eps"] = 1e-5;
      c["rope_theta"] = 1000000.0;
      c["router_aux_loss_coef"] = 0.02;
      c["sliding_window"] = nullptr;
      break;
    case Family::kQwen3Moe:
      c["architectures"] = {"Qwen3MoeForCausalLM"};
      c["attention_bias"] = false;
      c["decoder_sparse_step"] = 1;
      c["head_dim"] = d.head_dim;
      c["max_window_layers"] = d.layers;
      c["mlp_only_layers"] = nlohmann::json::array();
      c["moe_intermediate_size"] = d.moe_intermediate;
      c["norm_topk_prob"] = true;
      c["num_experts"] = d.experts;
      c["num_experts_per_tok"] = d.experts_per_tok;
      c["output_router_logits"] = false;
      c["rms_norm_eps"] = 1e-6;
      c["rope_scaling"] = nullptr;
      c["rope_theta"] = 1000000.0;
      c["router_aux_loss_coef"] = 0.001;
      c["sliding_window"] = nullptr;
      c["use_sliding_window"] = false;
      break;
    case Family::kDeepseekV3:
    case Family::kDeepseekV32:
      // As the real config, less quantization_config (these weights are not FP8)
      // and auto_map (no remote code ships with a synthetic checkpoint).
      c["architectures"] = {family == Family::kDeepseekV32 ? "DeepseekV32ForCausalLM"
                                                           : "DeepseekV3ForCausalLM"};
      if (family == Family::kDeepseekV32) {
        c["index_head_dim"] = d.index_head_dim;
        c["index_n_heads"] = d.index_heads;
        c["index_topk"] = 16;
      }
      c["attention_bias"] = false;
      c["ep_size"] = 1;
      c["first_k_dense_replace"] = d.first_k_dense;
      c["kv_lora_rank"] = d.kv_lora_rank;
      c["moe_intermediate_size"] = d.moe_intermediate;
      c["moe_layer_freq"] = 1;
      c["n_group"] = d.n_group;
      c["n_routed_experts"] = d.experts;
      c["n_shared_experts"] = d.shared_experts;
      c["norm_topk_prob"] = true;
      c["num_experts_per_tok"] = d.experts_per_tok;
      c["num_nextn_predict_layers"] = 1;
      c["q_lora_rank"] = d.q_lora_rank;
      c["qk_nope_head_dim"] = d.qk_nope;
      c["qk_rope_head_dim"] = d.qk_rope;
      c["rms_norm_eps"] = 1e-6;
      c["rope_scaling"] = nullptr;  // the real one is YaRN to 160K; 4096 positions need none
      c["rope_theta"] = 10000;
      c["routed_scaling_factor"] = 2.5;
      c["scoring_func"] = "sigmoid";
      c["topk_group"] = d.topk_group;
      c["topk_method"] = "noaux_tc";
      c["v_head_dim"] = d.v_head;
      break;
    case Family::kMistral:
      // Mistral-7B-v0.3's fields, plus the head_dim that newer Mistral configs (and
      // save_pretrained of current transformers) write; it equals hidden / heads here.
      c["architectures"] = {"MistralForCausalLM"};
      c["head_dim"] = d.head_dim;
      c["rms_norm_eps"] = 1e-5;
      c["rope_theta"] = 1000000.0;
      c["sliding_window"] = nullptr;
      break;
    case Family::kQwen2Moe:
      // As Qwen1.5-MoE-A2.7B: q/k/v biases by construction (no attention_bias field),
      // every layer sparse, no top-k renormalization.
      c["architectures"] = {"Qwen2MoeForCausalLM"};
      c["decoder_sparse_step"] = 1;
      c["max_window_layers"] = d.layers;
      c["mlp_only_layers"] = nlohmann::json::array();
      c["moe_intermediate_size"] = d.moe_intermediate;
      c["norm_topk_prob"] = false;
      c["num_experts"] = d.experts;
      c["num_experts_per_tok"] = d.experts_per_tok;
      c["output_router_logits"] = false;
      c["rms_norm_eps"] = 1e-6;
      c["rope_theta"] = 1000000.0;
      c["router_aux_loss_coef"] = 0.001;
      c["shared_expert_intermediate_size"] = d.shared_intermediate;
      c["sliding_window"] = 4096;
      c["use_sliding_window"] = false;
      break;
    case Family::kDeepseekV2:
      // As DeepSeek-V2(-Lite), less auto_map. One group means greedy top-k with
      // routed_scaling_factor 1 (V2-Lite); several mean group-limited top-k with
      // V2's factor 16.
      c["architectures"] = {"DeepseekV2ForCausalLM"};
      c["attention_bias"] = false;
      c["aux_loss_alpha"] = 0.001;
      c["ep_size"] = 1;
      c["first_k_dense_replace"] = d.first_k_dense;
      c["kv_lora_rank"] = d.kv_lora_rank;
      c["moe_intermediate_size"] = d.moe_intermediate;
      c["moe_layer_freq"] = 1;
      c["n_group"] = d.n_group;
      c["n_routed_experts"] = d.experts;
      c["n_shared_experts"] = d.shared_experts;
      c["norm_topk_prob"] = false;
      c["num_experts_per_tok"] = d.experts_per_tok;
      c["pretraining_tp"] = 1;
      c["q_lora_rank"] =
          d.q_lora_rank == 0 ? nlohmann::json(nullptr) : nlohmann::json(d.q_lora_rank);
      c["qk_nope_head_dim"] = d.qk_nope;
      c["qk_rope_head_dim"] = d.qk_rope;
      c["rms_norm_eps"] = 1e-6;
      c["rope_scaling"] = nullptr;  // the real one is YaRN to 160K; 4096 positions need none
      c["rope_theta"] = 10000;
      c["routed_scaling_factor"] = d.n_group > 1 ? 16.0 : 1.0;
      c["scoring_func"] = "softmax";
      c["seq_aux"] = true;
      c["topk_group"] = d.topk_group;
      c["topk_method"] = d.n_group > 1 ? "group_limited_greedy" : "greedy";
      c["v_head_dim"] = d.v_head;
      break;
    case Family::kGlm4Moe:
      // As GLM-4.5-Air: no bos_token_id, a pad_token_id, half-rotary heads.
      c.erase("bos_token_id");
      c["architectures"] = {"Glm4MoeForCausalLM"};
      c["attention_bias"] = true;
      c["first_k_dense_replace"] = d.first_k_dense;
      c["head_dim"] = d.head_dim;
      c["moe_intermediate_size"] = d.moe_intermediate;
      c["n_group"] = d.n_group;
      c["n_routed_experts"] = d.experts;
      c["n_shared_experts"] = d.shared_experts;
      c["norm_topk_prob"] = true;
      c["num_experts_per_tok"] = d.experts_per_tok;
      c["num_nextn_predict_layers"] = 1;
      c["pad_token_id"] = 0;
      c["partial_rotary_factor"] = 0.5;
      c["rms_norm_eps"] = 1e-5;
      c["rope_scaling"] = nullptr;
      c["rope_theta"] = 1000000;
      c["routed_scaling_factor"] = 1.0;
      c["topk_group"] = d.topk_group;
      c["use_qk_norm"] = false;
      break;
  }
  return c;
}

std::uint64_t synth_default_shard_bytes(std::string_view preset_name) {
  switch (parse_preset(preset_name)) {
    case Preset::kTiny:
      return std::uint64_t{512} << 10;
    case Preset::kSmall:
      return std::uint64_t{16} << 20;
    case Preset::kMedium:
      return std::uint64_t{512} << 20;
  }
  return 0;
}

std::vector<SynthShard> synth_shard_plan(const std::vector<SynthTensor>& tensors,
                                         std::uint64_t shard_bytes) {
  if (shard_bytes == 0) {
    fail("", "the shard size must be at least 1 byte");
  }
  std::vector<SynthShard> shards;
  std::vector<std::string> extra_files;  // unindexed files, in order of first use
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].file.empty()) {
      if (std::find(extra_files.begin(), extra_files.end(), tensors[i].file) == extra_files.end()) {
        extra_files.push_back(tensors[i].file);
      }
      continue;
    }
    std::uint64_t n = tensors[i].nbytes();
    if (shards.empty() || (!shards.back().tensors.empty() &&
                           n > shard_bytes - std::min(shard_bytes, shards.back().data_bytes))) {
      shards.emplace_back();
    }
    shards.back().tensors.push_back(i);
    shards.back().data_bytes += n;
  }
  if (shards.size() > 99999) {
    fail("", "the shard size gives " + std::to_string(shards.size()) +
                 " shards; file names have room for 99999");
  }
  char name[64];
  for (std::size_t s = 0; s < shards.size(); ++s) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    shards[s].file = name;
  }
  for (const std::string& file : extra_files) {
    SynthShard& shard = shards.emplace_back();
    shard.file = file;
    shard.indexed = false;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].file == file) {
        shard.tensors.push_back(i);
        shard.data_bytes += tensors[i].nbytes();
      }
    }
  }
  return shards;
}

// ---- writing (public) ----------------------------------------------------------------

std::optional<SynthQuant> parse_synth_quant(std::string_view text) {
  static const std::array<std::pair<std::string_view, SynthQuant>, 6> kNames{{
      {"none", SynthQuant::kNone},
      {"fp8-block", SynthQuant::kFp8Block},
      {"fp8-channel", SynthQuant::kFp8Channel},
      {"fp8-tensor", SynthQuant::kFp8Tensor},
      {"modelopt-fp8", SynthQuant::kModelOptFp8},
      {"nvfp4", SynthQuant::kNvfp4},
  }};
  for (const auto& [name, quant] : kNames) {
    if (name == text) {
      return quant;
    }
  }
  return std::nullopt;
}

std::string_view to_string(SynthQuant quant) {
  switch (quant) {
    case SynthQuant::kNone:
      return "none";
    case SynthQuant::kFp8Block:
      return "fp8-block";
    case SynthQuant::kFp8Channel:
      return "fp8-channel";
    case SynthQuant::kFp8Tensor:
      return "fp8-tensor";
    case SynthQuant::kModelOptFp8:
      return "modelopt-fp8";
    case SynthQuant::kNvfp4:
      return "nvfp4";
  }
  return "?";
}

std::string synth_value_name(SynthQuant quant, std::string_view name) {
  std::string out(name);
  if (quant != SynthQuant::kFp8Tensor || out.find(".experts.") == std::string::npos) {
    return out;
  }
  for (const auto& [up, gate] : {std::pair<std::string_view, std::string_view>{
                                     ".up_proj.input_scale", ".gate_proj.input_scale"},
                                 {".w3.input_scale", ".w1.input_scale"}}) {
    if (out.ends_with(up)) {
      return out.substr(0, out.size() - up.size()) + std::string(gate);
    }
  }
  return out;
}

void synth_quantize(std::vector<SynthTensor>& tensors, SynthQuant quant, std::uint64_t block) {
  if (quant == SynthQuant::kNone) {
    return;
  }
  if (quant == SynthQuant::kFp8Block && block == 0) {
    fail("", "the FP8 block size must be positive");
  }
  const bool per_tensor = quant == SynthQuant::kFp8Tensor || quant == SynthQuant::kModelOptFp8 ||
                          quant == SynthQuant::kNvfp4;
  const bool input_scales = per_tensor;
  std::vector<SynthTensor> out;
  out.reserve(tensors.size() * 3);
  for (SynthTensor& t : tensors) {
    if (!models::quantized_linear_tensor(t.name)) {
      out.push_back(std::move(t));
      continue;
    }
    if (t.name.ends_with("self_attn.qkv_proj.weight") ||
        t.name.ends_with("mlp.gate_up_proj.weight")) {
      throw Error(Stage::kSynth, "", t.name,
                  "no quantized layout of a checkpoint that stores qkv_proj / gate_up_proj "
                  "fused (Phi-3) is written");
    }
    if (t.shape.size() != 2) {
      throw Error(Stage::kSynth, "", t.name,
                  "quantized weights are written for 2-D weights only; this one is " +
                      std::to_string(t.shape.size()) + "-D (fused experts are not quantized)");
    }
    const std::uint64_t n = t.shape[0];
    const std::uint64_t k = t.shape[1];
    const std::string name = t.name;
    const std::string file = t.file;
    auto companion = [&](std::string_view suffix) { return models::companion_name(name, suffix); };
    std::vector<SynthTensor> extra;
    switch (quant) {
      case SynthQuant::kFp8Block:
        t.dtype = DType::kF8E4M3;
        extra.emplace_back(
            companion("weight_scale_inv"), DType::kF32,
            std::vector<std::uint64_t>{(n + block - 1) / block, (k + block - 1) / block}, file);
        break;
      case SynthQuant::kFp8Channel:
        t.dtype = DType::kF8E4M3;
        extra.emplace_back(companion("weight_scale"), DType::kF32, std::vector<std::uint64_t>{n, 1},
                           file);
        break;
      case SynthQuant::kFp8Tensor:
      case SynthQuant::kModelOptFp8:
        t.dtype = DType::kF8E4M3;
        extra.emplace_back(companion("weight_scale"), DType::kF32, std::vector<std::uint64_t>{},
                           file);
        break;
      case SynthQuant::kNvfp4:
        if (k % kSynthNvfp4Group != 0) {
          throw Error(Stage::kSynth, "", name,
                      "NVFP4 needs input features in whole groups of " +
                          std::to_string(kSynthNvfp4Group) + "; this weight has " +
                          std::to_string(k));
        }
        t.dtype = DType::kU8;
        t.shape = {n, k / 2};
        extra.emplace_back(companion("weight_scale"), DType::kF8E4M3,
                           std::vector<std::uint64_t>{n, k / kSynthNvfp4Group}, file);
        extra.emplace_back(companion("weight_scale_2"), DType::kF32, std::vector<std::uint64_t>{},
                           file);
        break;
      case SynthQuant::kNone:
        break;
    }
    if (input_scales) {
      extra.emplace_back(companion("input_scale"), DType::kF32, std::vector<std::uint64_t>{}, file);
      const std::string source = synth_value_name(quant, extra.back().name);
      if (source != extra.back().name) {
        extra.back().value_name = source;
      }
    }
    // ModelOpt's FP8 KV cache: the attention's k / v scales, self_attn.k_proj.k_scale
    // and v_proj.v_scale, under those names even for MLA, which has no k_proj (SGLang
    // 0.5.23's DeepSeek loader renames k_proj to attn_mqa for them).
    if (quant == SynthQuant::kModelOptFp8) {
      const std::size_t at = name.find("self_attn.");
      if (at != std::string::npos) {
        const std::string attn = name.substr(0, at + 10);
        const std::string leaf = name.substr(at + 10);
        if (leaf == "k_proj.weight" || leaf == "v_proj.weight") {
          const std::string s(1, leaf[0]);
          extra.emplace_back(attn + s + "_proj." + s + "_scale", DType::kF32,
                             std::vector<std::uint64_t>{}, file);
        } else if (leaf == "kv_b_proj.weight") {
          for (const char* s : {"k_proj.k_scale", "v_proj.v_scale"}) {
            extra.emplace_back(attn + s, DType::kF32, std::vector<std::uint64_t>{}, file);
          }
        }
      }
    }
    out.push_back(std::move(t));
    for (SynthTensor& e : extra) {
      out.push_back(std::move(e));
    }
  }
  tensors = std::move(out);
}

nlohmann::json synth_quant_config(SynthQuant quant, std::uint64_t block) {
  auto ct = [](const std::string& strategy, bool static_input) {
    nlohmann::json input = {{"dynamic", !static_input},
                            {"num_bits", 8},
                            {"strategy", static_input ? "tensor" : "token"},
                            {"symmetric", true},
                            {"type", "float"}};
    return nlohmann::json{{"quant_method", "compressed-tensors"},
                          {"format", "float-quantized"},
                          {"quantization_status", "compressed"},
                          {"ignore", {"lm_head"}},
                          {"config_groups",
                           {{"group_0",
                             {{"targets", {"Linear"}},
                              {"weights",
                               {{"dynamic", false},
                                {"num_bits", 8},
                                {"strategy", strategy},
                                {"symmetric", true},
                                {"type", "float"}}},
                              {"input_activations", input}}}}}};
  };
  switch (quant) {
    case SynthQuant::kFp8Block:
      return {{"activation_scheme", "dynamic"},
              {"fmt", "e4m3"},
              {"quant_method", "fp8"},
              {"weight_block_size", {block, block}}};
    case SynthQuant::kFp8Channel:
      return ct("channel", false);
    case SynthQuant::kFp8Tensor:
      return ct("tensor", true);
    case SynthQuant::kNone:
    case SynthQuant::kModelOptFp8:
    case SynthQuant::kNvfp4:
      break;
  }
  return nullptr;
}

nlohmann::json synth_hf_quant_config(SynthQuant quant) {
  if (quant != SynthQuant::kModelOptFp8 && quant != SynthQuant::kNvfp4) {
    return nullptr;
  }
  nlohmann::json q = {{"quant_algo", quant == SynthQuant::kNvfp4 ? "NVFP4" : "FP8"},
                      {"kv_cache_quant_algo",
                       quant == SynthQuant::kNvfp4 ? nlohmann::json() : nlohmann::json("FP8")},
                      {"exclude_modules", {"lm_head"}}};
  if (quant == SynthQuant::kNvfp4) {
    q["group_size"] = kSynthNvfp4Group;
  }
  return {{"producer", {{"name", "modelopt"}, {"version", "0.29.0"}}}, {"quantization", q}};
}

SynthResult synthesize(const SynthOptions& options) {
  std::vector<SynthTensor> tensors;
  nlohmann::json config;
  std::uint64_t shard_bytes = options.shard_bytes;
  std::string family = options.family;
  std::string what;  // the "ferry_synth" metadata: how the checkpoint was made
  SynthQuant quant = options.quant;
  std::uint64_t quant_block = options.quant_block;
  if (!options.from_config.empty()) {
    if (!options.family.empty() || !options.preset.empty()) {
      fail(options.from_config,
           "a model config replaces the family and preset; give one or the other");
    }
    if (options.tie_embeddings) {
      fail(options.from_config, "with a model config, its tie_word_embeddings decides the lm_head");
    }
    SynthSource source = read_synth_source(options.from_config);
    tensors = synth_tensor_list(source, options.dtype, options.scale_hidden, options.fused_experts);
    config = synth_config(source, options.dtype, options.scale_hidden);
    if (options.quant_from_config) {
      quant = SynthQuant::kNone;
      if (auto q = source.config.find("quantization_config"); q != source.config.end()) {
        const nlohmann::json block =
            q->is_object() ? q->value("weight_block_size", nlohmann::json()) : nlohmann::json();
        if (q->value("quant_method", std::string()) == "fp8" && block.is_array() &&
            block.size() == 2 && block[0].is_number_integer() && block[0].get<std::int64_t>() > 0 &&
            block[0] == block[1]) {
          quant = SynthQuant::kFp8Block;
          quant_block = quant_block != 0 ? quant_block : block[0].get<std::uint64_t>();
        }
      }
    }
    if (quant == SynthQuant::kFp8Block && options.quant_from_config) {
      config["quantization_config"] = source.config.at("quantization_config");
    }
    shard_bytes = shard_bytes != 0 ? shard_bytes : kSynthSourceShardBytes;
    family = source.family;
    what = family + " from " + fs::path(options.from_config).filename().string();
    if (options.scale_hidden != 0) {
      what += " scaled to hidden " + std::to_string(options.scale_hidden);
    }
  } else {
    if (options.scale_hidden != 0) {
      fail("", "scaling the dimensions (--scale-dims) needs a model config (--from-config)");
    }
    tensors = synth_tensor_list(options.family, options.preset, options.dtype,
                                options.tie_embeddings, options.fused_experts);
    config = synth_config(options.family, options.preset, options.dtype, options.tie_embeddings);
    shard_bytes = shard_bytes != 0 ? shard_bytes : synth_default_shard_bytes(options.preset);
    what = options.family + "/" + options.preset;
  }
  if (quant != SynthQuant::kNone) {
    quant_block = quant_block != 0 ? quant_block : 128;
    if (options.fused_experts) {
      fail(options.out, "quantized weights are not written for fused 3-D experts");
    }
    synth_quantize(tensors, quant, quant_block);
    if (quant == SynthQuant::kFp8Block) {
      if (!options.quant_from_config || !config.contains("quantization_config")) {
        config["quantization_config"] = synth_quant_config(quant, quant_block);
      }
      config["quantization_config"]["weight_block_size"] = {quant_block, quant_block};
      what += " fp8-block " + std::to_string(quant_block);
    } else {
      if (nlohmann::json q = synth_quant_config(quant, quant_block); !q.is_null()) {
        config["quantization_config"] = q;
      }
      what += " " + std::string(to_string(quant));
    }
  }
  what += " seed " + std::to_string(options.seed);
  what += options.fused_experts ? " fused-experts" : "";
  what += options.sparse ? " sparse (all zeros)" : "";
  std::vector<SynthShard> plan = synth_shard_plan(tensors, shard_bytes);

  fs::path out = normalize_out(options.out);
  inspect_target(out, options.force);  // refuse early, before any byte is written
  std::error_code ec;
  fs::create_directories(out.parent_path(), ec);
  if (ec) {
    fail(out.parent_path().string(), "cannot create the parent folder: " + ec.message());
  }

  std::uint64_t total = 0;
  std::uint64_t indexed_total = 0;  // metadata.total_size counts the indexed shards only
  for (const auto& shard : plan) {
    total += shard.data_bytes;
    indexed_total += shard.indexed ? shard.data_bytes : 0;
  }

  TempFolder tmp(out, ".tmp-");
  constexpr std::size_t kBlockBytes = std::size_t{4} << 20;
  std::vector<std::byte> block(options.sparse ? 0 : kBlockBytes);
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"ferry_synth", what}};
  nlohmann::json weight_map = nlohmann::json::object();
  std::uint64_t done = 0;
  for (const auto& shard : plan) {
    if (options.sparse) {
      std::vector<io::SafetensorsEntry> entries;
      entries.reserve(shard.tensors.size());
      for (std::size_t i : shard.tensors) {
        entries.push_back({tensors[i].name, tensors[i].dtype, tensors[i].shape});
        if (shard.indexed) {
          weight_map[tensors[i].name] = shard.file;
        }
      }
      write_sparse_safetensors((tmp.path() / shard.file).string(), entries, metadata,
                               shard.data_bytes, options.fsync);
      done += shard.data_bytes;
      if (options.progress) {
        options.progress(done, total);
      }
      continue;
    }
    io::SafetensorsWriter writer((tmp.path() / shard.file).string());
    for (std::size_t i : shard.tensors) {
      writer.add(tensors[i].name, tensors[i].dtype, tensors[i].shape);
      if (shard.indexed) {
        weight_map[tensors[i].name] = shard.file;
      }
    }
    writer.set_metadata(metadata);
    writer.begin();
    for (std::size_t i : shard.tensors) {
      const SynthTensor& t = tensors[i];
      std::uint64_t esize = dtype_size(t.dtype);
      std::uint64_t per_block = kBlockBytes / esize;
      std::uint64_t n = t.elements();
      for (std::uint64_t first = 0; first < n; first += per_block) {
        std::size_t count = static_cast<std::size_t>(std::min(per_block, n - first));
        std::span<std::byte> bytes(block.data(), count * esize);
        synth_encode(t.dtype, options.seed, t.value_name.empty() ? t.name : t.value_name, first,
                     bytes);
        writer.write(bytes);
      }
    }
    writer.finish(options.fsync ? io::SafetensorsWriter::Sync::kFsync
                                : io::SafetensorsWriter::Sync::kNone);
    done += shard.data_bytes;
    if (options.progress) {
      options.progress(done, total);
    }
  }

  nlohmann::json index = {{"metadata", {{"total_size", indexed_total}}},
                          {"weight_map", weight_map}};
  write_text_file((tmp.path() / "model.safetensors.index.json").string(), index.dump(2) + "\n",
                  options.fsync);
  write_text_file((tmp.path() / "config.json").string(), config.dump(2) + "\n", options.fsync);
  const nlohmann::json hf_quant = synth_hf_quant_config(quant);
  if (!hf_quant.is_null()) {
    write_text_file((tmp.path() / "hf_quant_config.json").string(), hf_quant.dump(2) + "\n",
                    options.fsync);
  }
  if (options.fsync) {
    fsync_dir(tmp.path());
  }

  // Look again: the folder may have changed while the shards were written.
  install(tmp, out, inspect_target(out, options.force));
  if (options.fsync) {
    fsync_dir(out.parent_path());
  }

  SynthResult result;
  for (const auto& shard : plan) {
    result.files.push_back((out / shard.file).string());
  }
  result.files.push_back((out / "model.safetensors.index.json").string());
  result.files.push_back((out / "config.json").string());
  if (!hf_quant.is_null()) {
    result.files.push_back((out / "hf_quant_config.json").string());
  }
  result.total_bytes = total;
  result.tensors = tensors.size();
  result.shards = plan.size();
  result.family = family;
  return result;
}

}  // namespace ferry::tools
