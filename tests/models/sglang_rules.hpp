// SGLang's own rules, transliterated from its Python for the contract references and
// fixtures (never from ferry's models/ code), each citing the file and function of
// SGLang 0.5.23 (PyPI), the one version all parity work pins. Header-only: the models and
// runtime test executables both use it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace ferry::testing::sglang {

// python/sglang/srt/distributed/utils.py, get_pp_indices, in
// SGLang 0.5.23 (without SGLANG_PP_LAYER_PARTITION):
//   base_layers = num_hidden_layers // pp_size
//   remainder = num_hidden_layers % pp_size
//   if pp_rank >= pp_size - remainder:
//       start_layer = pp_rank * (base_layers + 1) - (pp_size - remainder)
//       end_layer = start_layer + (base_layers + 1)
//   else:
//       start_layer = pp_rank * base_layers
//       end_layer = start_layer + base_layers
// Returns [start_layer, end_layer).
inline std::pair<std::uint64_t, std::uint64_t> get_pp_indices(std::uint64_t num_hidden_layers,
                                                              std::uint64_t pp_rank,
                                                              std::uint64_t pp_size) {
  const std::uint64_t base_layers = num_hidden_layers / pp_size;
  const std::uint64_t remainder = num_hidden_layers % pp_size;
  if (pp_rank >= pp_size - remainder) {
    const std::uint64_t start = pp_rank * (base_layers + 1) - (pp_size - remainder);
    return {start, start + base_layers + 1};
  }
  return {pp_rank * base_layers, pp_rank * base_layers + base_layers};
}

// Shared-expert fusion on an NVIDIA GPU of compute capability >= 8.0 with default
// server options (no DeepEP, no W4AFP8):
// - DeepSeek: python/sglang/srt/models/deepseek_v2.py in SGLang 0.5.23,
//   DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason (before, the same
//   rule was determine_num_fused_shared_experts):
//     if (architectures[0] != "DeepseekV3ForCausalLM"
//         or n_routed_experts not in (256, 384) or n_shared_experts != 1
//         or (n_routed_experts == 384 and not a Quark checkpoint)): disable
//     elif moe_ep_size > 1 (on NVIDIA): disable
//   (ferry loads no Quark checkpoint, so 384 never fuses by default.)
// - GLM-4 MoE: python/sglang/srt/models/glm4_moe.py in
//   SGLang 0.5.23, Glm4MoeForCausalLM's
//   shared_experts_fusion_disable_reason: disabled by moe_ep_size > 1 (on NVIDIA); its
//   earlier version also required n_shared_experts == 1, which ferry keeps.
inline bool fuses_shared_experts(const std::string& architecture, std::uint64_t n_routed,
                                 std::uint64_t n_shared, int ep) {
  if (n_shared == 0 || ep > 1) {
    return false;
  }
  if (architecture == "Glm4MoeForCausalLM") {
    return n_shared == 1;
  }
  return architecture == "DeepseekV3ForCausalLM" && n_routed == 256 && n_shared == 1;
}

}  // namespace ferry::testing::sglang
