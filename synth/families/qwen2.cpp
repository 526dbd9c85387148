// Qwen2ForCausalLM: Llama's layout with q/k/v biases.
#include "synth/families/llama.hpp"

namespace ferry::synth::families {

SynthFamily qwen2() {
  return {
      .name = "qwen2",
      .architectures = {"Qwen2ForCausalLM"},
      .preset_dims = llama_preset_dims,
      .config_dims = dense_config_dims,
      .layer = dense_layer<true, false>,
      .config =
          [](nlohmann::json& c, const Dims& d) {
            // Qwen2 has q/k/v biases by construction: no attention_bias field.
            c["max_window_layers"] = d.layers;
            c["rms_norm_eps"] = 1e-6;
            c["rope_theta"] = 1000000.0;
            c["sliding_window"] = 4096;
            c["use_mrope"] = false;
            c["use_sliding_window"] = false;
          },
  };
}

}  // namespace ferry::synth::families
