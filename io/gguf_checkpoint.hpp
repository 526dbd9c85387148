// A GGUF file (llama.cpp's format, model.load_format=gguf) as the index every other
// format becomes: its tensors under their Hugging Face names (io/gguf_names.hpp),
// each a byte range of the file (stacked experts one range per expert), llama's
// rope-permuted attn_q / attn_k marked for placement to read back in order, and the
// metadata as a config.json (io/gguf_config.hpp) for a folder without one, as SGLang
// gets it through transformers.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/file.hpp"
#include "io/safetensors.hpp"

namespace ferry::io {

struct GgufCheckpoint {
  SafetensorsHeader header;          // tensors by HF name, sorted by offset
  nlohmann::json config;             // the metadata as config.json
  std::vector<std::string> notes;    // what the config could not say exactly
  std::vector<std::string> skipped;  // GGUF tensors with no HF twin (rope_freqs)
};

// Reads `file`'s GGUF header (metadata capped at `max_metadata_bytes`) and maps it.
// A quantized tensor of a type the device dequantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q2_K to Q6_K) is indexed as F32 elements stored in GGML blocks
// (TensorInfo::blocks) when `dequantize` (gguf.dequantize) is on. Throws
// ferry::Error naming the file and tensor for everything io/gguf.hpp,
// io/gguf_names.hpp and io/gguf_config.hpp refuse, and (Stage::kHeader) for any
// other quantized type, for every quantized type with `dequantize` off (keeping GGML
// blocks for GGUF kernels is not built), and for DeepSeek's split attn_k_b /
// attn_v_b (kv_b_proj put back together element by element).
GgufCheckpoint read_gguf_checkpoint(const File& file, std::uint64_t max_metadata_bytes,
                                    bool dequantize = true);

}  // namespace ferry::io
