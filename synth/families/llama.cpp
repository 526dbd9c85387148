// LlamaForCausalLM, and MistralForCausalLM (Llama's tensors; config as
// Mistral-7B-v0.3 plus head_dim, sliding_window null).
#include "synth/families/llama.hpp"

#include "models/hf_config.hpp"

namespace ferry::synth::families {

// Tiny vocabularies are 1000 (not a multiple of 64) so vocab padding gets tested;
// medium sizes put every family between 2 and 3 GiB in BF16 (untied).
// Kept compact: each preset reads as one row of a table.
// clang-format off
Dims llama_preset_dims(Preset preset) {
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
  fail("", "no sizes for this family and preset");
}
// clang-format on

void dense_config_dims(const nlohmann::json& config, Dims& d) {
  d.intermediate = models::config_positive(config, "intermediate_size");
  d.head_dim = models::config_head_dim(config, d.hidden, d.heads);
}

// Llama's sizes with head_dim 32 in tiny: the q width (8 x 32) is not hidden, as in
// Qwen3-8B and Gemma-7B, so the config's head_dim is what counts.
Dims wide_head_preset_dims(Preset preset) {
  Dims d = llama_preset_dims(preset);
  if (preset == Preset::kTiny) {
    d.head_dim = 32;
  }
  return d;
}

void unbiased_config_dims(const nlohmann::json& config, Dims& d) {
  dense_config_dims(config, d);
  require_bool(config, "attention_bias", false, false, "the projections have no biases here");
}

SynthFamily llama() {
  return {
      .name = "llama",
      .architectures = {"LlamaForCausalLM"},
      .preset_dims = llama_preset_dims,
      .config_dims =
          [](const nlohmann::json& config, Dims& d) {
            dense_config_dims(config, d);
            require_bool(config, "attention_bias", false, false,
                         "Llama's projections have no biases here");
            require_bool(config, "mlp_bias", false, false, "Llama's MLP has no biases here");
          },
      .layer = dense_layer<false, false>,
      .config =
          [](nlohmann::json& c, const Dims& d) {
            c["attention_bias"] = false;
            c["head_dim"] = d.head_dim;
            c["mlp_bias"] = false;
            c["pretraining_tp"] = 1;
            c["rms_norm_eps"] = 1e-5;
            c["rope_scaling"] = nullptr;
            c["rope_theta"] = 500000.0;
          },
  };
}

namespace {

// Llama's sizes with Mistral's 4:1 grouped-query ratio and 32768 vocabulary in medium.
Dims mistral_preset_dims(Preset preset) {
  Dims d = llama_preset_dims(preset);
  if (preset == Preset::kMedium) {
    d.kv_heads = 8;
    d.vocab = 32768;
  }
  return d;
}

}  // namespace

SynthFamily mistral() {
  return {
      .name = "mistral",
      .architectures = {"MistralForCausalLM"},
      .preset_dims = mistral_preset_dims,
      .config_dims = dense_config_dims,
      .layer = dense_layer<false, false>,
      .config =
          [](nlohmann::json& c, const Dims& d) {
            // Mistral-7B-v0.3's fields, plus the head_dim that newer Mistral configs
            // (and save_pretrained of current transformers) write; it equals hidden /
            // heads here.
            c["head_dim"] = d.head_dim;
            c["rms_norm_eps"] = 1e-5;
            c["rope_theta"] = 1000000.0;
            c["sliding_window"] = nullptr;
          },
  };
}

}  // namespace ferry::synth::families
