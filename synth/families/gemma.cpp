// GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (as gemma-7b, gemma-2-9b and
// gemma-3-1b): Llama's layout, head_dim given, GELU, no biases; Gemma 2 and 3 add
// pre/post feed-forward norms, Gemma 3 per-head q/k norms. The output projection is
// always the embedding: no lm_head.weight is written, and the config says tied.
#include "synth/families/llama.hpp"

namespace ferry::synth::families {
namespace {

enum class Version { k1, k2, k3 };

// Llama's sizes with head_dim 32 in tiny; Gemma has no lm_head, so medium's larger
// vocabulary (Gemma's is 256000) keeps it above 2 GiB.
Dims gemma_preset_dims(Preset preset) {
  Dims d = wide_head_preset_dims(preset);
  if (preset == Preset::kMedium) {
    d.vocab = 64000;
  }
  return d;
}

template <Version v>
void gemma_layer(ListBuilder& b, const Dims& d, std::uint64_t i, const std::string& p) {
  dense_layer<false, v == Version::k3>(b, d, i, p);
  if (v != Version::k1) {
    b.add(p + "pre_feedforward_layernorm.weight", {d.hidden});
    b.add(p + "post_feedforward_layernorm.weight", {d.hidden});
  }
}

template <Version v>
void gemma_config(nlohmann::json& c, const Dims& d) {
  c["attention_bias"] = false;
  c["head_dim"] = d.head_dim;
  c["hidden_act"] = "gelu_pytorch_tanh";
  c["tie_word_embeddings"] = true;
  c["model_type"] = v == Version::k1 ? "gemma" : v == Version::k2 ? "gemma2" : "gemma3_text";
  c["rms_norm_eps"] = 1e-6;
  c["rope_theta"] = 10000.0;
  if (v != Version::k1) {
    c["query_pre_attn_scalar"] = d.head_dim;
    c["sliding_window"] = 4096;
  }
}

template <Version v>
SynthFamily gemma_family(std::string name, std::string architecture) {
  return {
      .name = std::move(name),
      .architectures = {std::move(architecture)},
      .lm_head = false,
      .preset_dims = gemma_preset_dims,
      .config_dims = unbiased_config_dims,
      .layer = gemma_layer<v>,
      .config = gemma_config<v>,
  };
}

}  // namespace

SynthFamily gemma() {
  return gemma_family<Version::k1>("gemma", "GemmaForCausalLM");
}

SynthFamily gemma2() {
  return gemma_family<Version::k2>("gemma2", "Gemma2ForCausalLM");
}

SynthFamily gemma3() {
  return gemma_family<Version::k3>("gemma3", "Gemma3ForCausalLM");
}

}  // namespace ferry::synth::families
