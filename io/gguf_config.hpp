// A Hugging Face config.json built from a GGUF file's metadata, for the
// architectures io/gguf_names.hpp maps: what the model code that reads config.json
// needs to load the mapped tensors (sizes, heads, experts, MLA ranks, norms, RoPE),
// not a byte-identical copy of the original (which GGUF does not keep).
//
// DeepSeek-V2 or V3: both convert to "deepseek2". V3's router is a sigmoid with the
// e_score_correction_bias (topk_method noaux_tc), V2's a softmax without it, and
// the converter writes the first as {arch}.expert_gating_func = 2 (sigmoid) and the
// bias as blk.N.exp_probs_b.bias. Either says V3. The group counts cannot tell them
// apart: DeepSeek-V2 routes with 8 groups too (group_limited_greedy), and
// expert_weights_norm is only a default of each model, not a mark of it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/gguf.hpp"
#include "io/gguf_names.hpp"

namespace ferry::io {

struct GgufHfConfig {
  nlohmann::json config;  // config.json's content
  // What the config could not say exactly, for a log line: Llama 3's rope_scaling
  // (only its factors tensor is in the file), a quantized file's torch_dtype.
  std::vector<std::string> notes;
};

// Builds config.json for `header`'s architecture. Throws
// ferry::Error(Stage::kConfig, header.file, "", rule) naming the metadata key that
// is missing or of the wrong type ({arch}.block_count, embedding_length,
// feed_forward_length, attention.head_count, attention.layer_norm_rms_epsilon,
// context_length; the expert keys of an MoE; DeepSeek's kv_lora_rank,
// rope.dimension_count and key/value lengths), a missing token_embd.weight (the
// vocabulary size is its dims[1]), or an architecture it does not map (by name).
GgufHfConfig gguf_hf_config(const GgufHeader& header);

}  // namespace ferry::io
