// Qwen3ForCausalLM (as Qwen3-8B): Llama's layout with per-head q/k norms and a
// head_dim independent of hidden / heads.
#include "synth/families/llama.hpp"

namespace ferry::synth::families {

SynthFamily qwen3() {
  return {
      .name = "qwen3",
      .architectures = {"Qwen3ForCausalLM"},
      .preset_dims = wide_head_preset_dims,
      .config_dims = unbiased_config_dims,
      .layer = dense_layer<false, true>,
      .config =
          [](nlohmann::json& c, const Dims& d) {
            // As Qwen3-8B: head_dim given, no biases.
            c["attention_bias"] = false;
            c["head_dim"] = d.head_dim;
            c["max_window_layers"] = d.layers;
            c["rms_norm_eps"] = 1e-6;
            c["rope_scaling"] = nullptr;
            c["rope_theta"] = 1000000.0;
            c["sliding_window"] = nullptr;
            c["use_sliding_window"] = false;
          },
  };
}

}  // namespace ferry::synth::families
