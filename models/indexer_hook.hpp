// DeepSeek-V3.2's sparse-attention indexer (DSA) after loading: the key projection
// `wk` [index_head_dim, hidden] and the head weights `weights_proj` [index_n_heads,
// hidden] are fused into one model-dtype param, `wk_weights_proj` [index_head_dim +
// index_n_heads, hidden]: wk's rows first, then weights_proj's (SGLang's
// _load_fused_indexer_wk, python/sglang/srt/models/deepseek_common/
// deepseek_weight_loader.py, and the Indexer's wk_weights_proj ReplicatedLinear). A
// quantized wk is dequantized first (QuantizedMatrix::at, rounded once to the model
// dtype), which is why the fusion waits for wk's scale: the hook's inputs are wk,
// its scales and weights_proj. The model has the fused param only where SGLang 0.5.23
// builds it (indexer_rope_interleave, models/deepseek.hpp), and then wk, its scales
// and weights_proj are transients, freed after the hook: one layout, never both.
//
// The copy of a model-dtype wk and of weights_proj runs on the device (one 2-D
// device copy each); an FP8 wk (block, channel or tensor scales) is dequantized on
// the device straight into the fused param (gpu::Stream::dequantize_fp8), with no
// host round trip. An NVFP4 wk is read back and dequantized on the host (the device
// has no E2M1 kernel), then written with one host-to-device copy.
#pragma once

#include <cstddef>
#include <string>

#include "models/model.hpp"

namespace ferry::models {

// The hook of the indexer at `indexer_prefix` ("model.layers.3.self_attn.indexer.")
// on local rank `local_rank` of `model`. Throws Error(Stage::kPostProcess) naming
// the param when one is missing or its shape or dtype does not fit.
PostLoadHook make_indexer_fuse_hook(const Model& model, std::size_t local_rank,
                                    const std::string& indexer_prefix, const QuantScheme& quant);

}  // namespace ferry::models
