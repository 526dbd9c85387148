// Phi3ForCausalLM (as Phi-3-mini-4k-instruct): head_dim = hidden / heads, and its
// checkpoints store qkv_proj and gate_up_proj fused.
#include "synth/families/llama.hpp"

namespace ferry::synth::families {

SynthFamily phi3() {
  return {
      .name = "phi3",
      .architectures = {"Phi3ForCausalLM"},
      .preset_dims = llama_preset_dims,
      .config_dims = unbiased_config_dims,
      .layer =
          [](ListBuilder& b, const Dims& d, std::uint64_t, const std::string& p) {
            b.add(p + "self_attn.qkv_proj.weight",
                  {(d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden});
            b.add(p + "self_attn.o_proj.weight", {d.hidden, d.heads * d.head_dim});
            b.add(p + "mlp.gate_up_proj.weight", {2 * d.intermediate, d.hidden});
            b.add(p + "mlp.down_proj.weight", {d.hidden, d.intermediate});
          },
      .config =
          [](nlohmann::json& c, const Dims&) {
            c["attention_bias"] = false;
            c["original_max_position_embeddings"] = 4096;
            c["rms_norm_eps"] = 1e-5;
            c["rope_scaling"] = nullptr;
            c["rope_theta"] = 10000.0;
            c["sliding_window"] = 2047;
          },
  };
}

}  // namespace ferry::synth::families
