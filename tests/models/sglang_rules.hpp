// SGLang's own rules, transliterated from its Python for the contract references and
// fixtures (never from ferry's models/ code), each citing the file, function and
// the commit of sgl-project/sglang it was read at. Header-only: the models and
// runtime test executables both use it.
#pragma once

#include <cstdint>
#include <utility>

namespace ferry::testing::sglang {

// python/sglang/srt/distributed/utils.py, get_pp_indices, at commit
// 1107be112815907371027e0ab2203cb57d91c10e (without SGLANG_PP_LAYER_PARTITION):
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

}  // namespace ferry::testing::sglang
