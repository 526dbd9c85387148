#include "models/hf_config.hpp"

#include <map>

#include "common/error.hpp"

namespace ferry::models {
namespace {

[[noreturn]] void bad(const std::string& rule) {
  config_error(rule);
}

const nlohmann::json* find(const nlohmann::json& config, std::string_view key) {
  if (!config.is_object()) {
    bad("config must be a JSON object");
  }
  auto it = config.find(std::string(key));
  if (it == config.end() || it->is_null()) {
    return nullptr;
  }
  return &*it;
}

}  // namespace

void config_error(const std::string& rule) {
  throw Error(Stage::kConfig, kConfigFile, "", rule);
}

std::string config_string(const nlohmann::json& config, std::string_view key,
                          std::string fallback) {
  const nlohmann::json* v = find(config, key);
  if (v == nullptr) {
    return fallback;
  }
  if (!v->is_string()) {
    bad("field '" + std::string(key) + "' must be a string (got " + v->dump() + ")");
  }
  return v->get<std::string>();
}

std::optional<std::uint64_t> config_optional_positive(const nlohmann::json& config,
                                                      std::string_view key) {
  const nlohmann::json* v = find(config, key);
  if (v == nullptr) {
    return std::nullopt;
  }
  const std::optional<std::uint64_t> n = json_non_negative(*v);
  if (!n || *n == 0) {
    bad("field '" + std::string(key) + "' must be a positive integer (got " + v->dump() + ")");
  }
  return *n;
}

std::uint64_t config_count(const nlohmann::json& config, std::string_view key,
                           std::uint64_t fallback) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) {
    return fallback;
  }
  if (const std::optional<std::uint64_t> n = json_non_negative(*it)) {
    return *n;
  }
  bad("field '" + std::string(key) + "' must be a non-negative integer (got " + it->dump() + ")");
}

std::uint64_t config_head_dim(const nlohmann::json& config, std::uint64_t hidden,
                              std::uint64_t heads) {
  if (auto hd = config_optional_positive(config, "head_dim")) {
    return *hd;
  }
  if (hidden % heads != 0) {
    bad("hidden_size (" + std::to_string(hidden) + ") is not divisible by num_attention_heads (" +
        std::to_string(heads) + ") and there is no head_dim field");
  }
  return hidden / heads;
}

std::uint64_t config_positive(const nlohmann::json& config, std::string_view key) {
  std::optional<std::uint64_t> n = config_optional_positive(config, key);
  if (!n) {
    bad("missing field '" + std::string(key) + "'");
  }
  return *n;
}

GqaDecoderDims config_gqa_decoder_dims(const nlohmann::json& config) {
  GqaDecoderDims d;
  d.hidden = config_positive(config, "hidden_size");
  d.heads = config_positive(config, "num_attention_heads");
  d.kv_heads = config_optional_positive(config, "num_key_value_heads").value_or(d.heads);
  d.head_dim = config_head_dim(config, d.hidden, d.heads);
  d.layers = config_positive(config, "num_hidden_layers");
  d.vocab = config_positive(config, "vocab_size");
  d.tie_embeddings = config_bool(config, "tie_word_embeddings", false);
  return d;
}

bool config_bool(const nlohmann::json& config, std::string_view key, bool fallback) {
  const nlohmann::json* v = find(config, key);
  if (v == nullptr) {
    return fallback;
  }
  if (!v->is_boolean()) {
    bad("field '" + std::string(key) + "' must be true or false (got " + v->dump() + ")");
  }
  return v->get<bool>();
}

std::optional<DType> declared_dtype(const nlohmann::json& config) {
  const char* key = "dtype";
  const nlohmann::json* v = find(config, key);
  if (v == nullptr || v->is_null()) {
    key = "torch_dtype";
    v = find(config, key);
  }
  if (v == nullptr || v->is_null()) {
    return std::nullopt;
  }
  if (!v->is_string()) {
    bad("field '" + std::string(key) + "' must be a string (got " + v->dump() + ")");
  }
  static const std::map<std::string, DType> kTorchNames{{"half", DType::kF16},
                                                        {"float16", DType::kF16},
                                                        {"float", DType::kF32},
                                                        {"float32", DType::kF32},
                                                        {"bfloat16", DType::kBF16}};
  auto it = kTorchNames.find(v->get<std::string>());
  return it == kTorchNames.end() ? std::nullopt : std::optional<DType>(it->second);
}

DType resolve_dtype(const nlohmann::json& config, const std::optional<DType>& requested) {
  if (requested) {
    return *requested;
  }
  // SGLang's _get_and_verify_dtype (python/sglang/srt/configs/model_config.py in
  // SGLang 0.5.23) for "auto": config.dtype, else config.torch_dtype; a
  // missing or unknown value counts as float32, and float32 loads as float16, or
  // bfloat16 when model_type starts with "gemma"; bfloat16 and float16 load as given.
  const std::optional<DType> dtype = declared_dtype(config);
  if (dtype && *dtype != DType::kF32) {
    return *dtype;
  }
  const nlohmann::json* type = find(config, "model_type");
  const bool gemma =
      type != nullptr && type->is_string() && type->get<std::string>().rfind("gemma", 0) == 0;
  return gemma ? DType::kBF16 : DType::kF16;
}

std::optional<std::uint64_t> json_non_negative(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    return v.get<std::uint64_t>();
  }
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  }
  return std::nullopt;
}

}  // namespace ferry::models
