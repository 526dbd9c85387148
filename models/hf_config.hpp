// Typed reads of Hugging Face config.json fields, with errors that name the field
// and what was found (Stage::kConfig, file "config.json").
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "common/dtype.hpp"

namespace ferry::models {

inline constexpr const char* kConfigFile = "config.json";

// Throws Error(Stage::kConfig, "config.json") with `rule`.
[[noreturn]] void config_error(const std::string& rule);

// A string, `fallback` when the key is absent or null.
std::string config_string(const nlohmann::json& config, std::string_view key,
                          std::string fallback);

// A required positive integer.
std::uint64_t config_positive(const nlohmann::json& config, std::string_view key);
// A positive integer, or nullopt when the key is absent or null.
std::optional<std::uint64_t> config_optional_positive(const nlohmann::json& config,
                                                      std::string_view key);
// A non-negative integer (counts such as first_k_dense_replace may be 0),
// `fallback` when the key is absent or null.
std::uint64_t config_count(const nlohmann::json& config, std::string_view key,
                           std::uint64_t fallback);
// head_dim when present, else hidden / heads; throws when that does not divide.
std::uint64_t config_head_dim(const nlohmann::json& config, std::uint64_t hidden,
                              std::uint64_t heads);
// A boolean, `fallback` when absent or null.
bool config_bool(const nlohmann::json& config, std::string_view key, bool fallback);

// A JSON integer >= 0, whichever way it was made (parsed text gives unsigned numbers,
// code that builds a document from ints gives signed ones); nullopt for anything else.
std::optional<std::uint64_t> json_non_negative(const nlohmann::json& v);

// The decoder fields the grouped-query families (dense and MoE) read alike.
struct GqaDecoderDims {
  std::uint64_t hidden = 0;
  std::uint64_t heads = 0;
  std::uint64_t kv_heads = 0;  // num_key_value_heads, default num_attention_heads
  std::uint64_t head_dim = 0;  // head_dim when present, else hidden / heads
  std::uint64_t layers = 0;
  std::uint64_t vocab = 0;
  bool tie_embeddings = false;  // tie_word_embeddings (default false)
};
GqaDecoderDims config_gqa_decoder_dims(const nlohmann::json& config);

// The param dtype: `requested` when set, else SGLang's rule for "auto" from
// config.json's dtype (or torch_dtype): bfloat16 and float16 as given; float32,
// missing or unknown as float16 (bfloat16 for a model_type starting with "gemma").
// Throws only when the field is not a string.
DType resolve_dtype(const nlohmann::json& config, const std::optional<DType>& requested);

// The dtype config.json declares (dtype, else torch_dtype: "bfloat16", "float16" /
// "half", "float32" / "float"); nullopt when missing or another name. Throws
// Error(Stage::kConfig) naming the field when it is not a string.
std::optional<DType> declared_dtype(const nlohmann::json& config);

}  // namespace ferry::models
