// What a synthetic checkpoint holds: the families' tensor lists and config.json, at a
// preset's sizes or a real config's (scaled down or not).
#include <algorithm>
#include <filesystem>
#include <utility>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/json_depth.hpp"
#include "common/small_file.hpp"
#include "models/hf_config.hpp"
#include "synth/family.hpp"
#include "synth/synth.hpp"

namespace ferry::synth {

namespace fs = std::filesystem;

namespace {

Preset parse_preset(std::string_view text) {
  const auto& names = synth_presets();
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == text) {
      return static_cast<Preset>(i);
    }
  }
  fail("", "unknown preset '" + std::string(text) + "' (expected one of " + join_list(names) + ")");
}

std::vector<std::string> moe_family_names() {
  std::vector<std::string> out;
  for (const SynthFamily& f : synth_family_registry()) {
    if (f.routed_experts) {
      out.push_back(f.name);
    }
  }
  return out;
}

const SynthFamily& family_of_config(const nlohmann::json& config, const std::string& file) {
  auto arch = config.find("architectures");
  if (arch == config.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    fail(file, "field 'architectures' must be a non-empty list of names");
  }
  const std::string name = (*arch)[0].get<std::string>();
  std::string known;
  for (const SynthFamily& f : synth_family_registry()) {
    for (const std::string& a : f.architectures) {
      if (name == a) {
        return f;
      }
      known += (known.empty() ? "" : ", ") + a;
    }
  }
  fail(file, "architecture " + name +
                 " (architectures[0]) has no synthetic family (supported: " + known + ")");
}

// What `read` reads of a config.json through models/hf_config, whose errors
// (Stage::kConfig) become Stage::kSynth ones naming `file`.
template <class F>
auto read_config(const std::string& file, F&& read) -> decltype(read()) {
  try {
    return read();
  } catch (const Error& e) {
    if (e.stage() != Stage::kConfig) {
      throw;
    }
    fail(file, e.rule());
  }
}

// The sizes of the model `config` describes, refusing what the family's tensor list
// cannot express (see SynthSource).
Dims dims_from_config(const SynthFamily& family, const nlohmann::json& config,
                      const std::string& file) {
  return read_config(file, [&] {
    Dims d;
    d.hidden = models::config_positive(config, "hidden_size");
    d.layers = models::config_positive(config, "num_hidden_layers");
    d.heads = models::config_positive(config, "num_attention_heads");
    d.kv_heads = models::config_optional_positive(config, "num_key_value_heads").value_or(d.heads);
    d.vocab = models::config_positive(config, "vocab_size");
    models::config_bool(config, "tie_word_embeddings", false);  // checked here, read later
    family.config_dims(config, d);
    return d;
  });
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

// The sizes to write for `source`: its own, or scaled to hidden `scale_hidden`.
Dims source_dims(const SynthFamily& family, const SynthSource& source, std::uint64_t scale_hidden) {
  Dims d = dims_from_config(family, source.config, source.file);
  if (scale_hidden == 0) {
    return d;
  }
  return scaled_dims(d, scale_hidden_checked(d, scale_hidden, source.file));
}

// Every tensor of `family` at sizes `d`, in state-dict order: the embedding, the
// layers, the MTP layer, the norm and the lm_head.
std::vector<SynthTensor> build_tensor_list(const SynthFamily& family, const Dims& d, DType dtype,
                                           bool tie_embeddings, bool fused_experts) {
  check_dtype(dtype);
  if (fused_experts && !family.routed_experts) {
    fail("", "fused experts (--fused-experts) need a family with routed experts; '" + family.name +
                 "' is dense (MoE families: " + join_list(moe_family_names()) + ")");
  }
  ListBuilder b(dtype, d, fused_experts);
  b.add("model.embed_tokens.weight", {d.vocab, d.hidden});
  for (std::uint64_t i = 0; i < d.layers; ++i) {
    std::string p = layer_prefix(i);
    family.layer(b, d, i, p);
    b.layer_norms(p);
  }
  if (family.mtp != nullptr && d.nextn_layers > 0) {
    family.mtp(b, d);
  }
  b.add("model.norm.weight", {d.hidden});
  if (!tie_embeddings && family.lm_head) {
    b.add("lm_head.weight", {d.vocab, d.hidden});
  }
  return b.take();
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

}  // namespace

const std::vector<std::string>& synth_families() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const SynthFamily& f : synth_family_registry()) {
      out.push_back(f.name);
    }
    return out;
  }();
  return names;
}

bool synth_family_has_experts(std::string_view family) {
  return find_synth_family(family).routed_experts;
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

std::vector<SynthTensor> synth_tensor_list(std::string_view family_name,
                                           std::string_view preset_name, DType dtype,
                                           bool tie_embeddings, bool fused_experts) {
  const SynthFamily& family = find_synth_family(family_name);
  return build_tensor_list(family, family.preset_dims(parse_preset(preset_name)), dtype,
                           tie_embeddings, fused_experts);
}

SynthSource synth_source(nlohmann::json config, std::string file) {
  if (!config.is_object()) {
    fail(file, "a config.json must hold a JSON object, not " + std::string(config.type_name()));
  }
  SynthSource source;
  const SynthFamily& family = family_of_config(config, file);
  Dims d = dims_from_config(family, config, file);  // refuse early what cannot be written
  source.family = family.name;
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
  const SynthFamily& family = find_synth_family(source.family);
  const bool tied = read_config(source.file, [&] {
    return models::config_bool(source.config, "tie_word_embeddings", false);
  });
  return build_tensor_list(family, source_dims(family, source, scale_hidden), dtype, tied,
                           fused_experts);
}

nlohmann::json synth_config(const SynthSource& source, DType dtype, std::uint64_t scale_hidden) {
  check_dtype(dtype);
  const SynthFamily& family = find_synth_family(source.family);
  Dims d = source_dims(family, source, scale_hidden);
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
  if (!family.mla) {
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
  const SynthFamily& family = find_synth_family(family_name);
  Dims d = family.preset_dims(parse_preset(preset_name));
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
  c["architectures"] = {family.architectures[0]};
  family.config(c, d);
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

}  // namespace ferry::synth
