// Synthetic Hugging Face checkpoints for tests, demos and benchmarks: a family's
// real config.json field names and tensor names at toy sizes, sharded like
// save_pretrained does, with values that are a pure function of (seed, tensor
// name, element index) so any reader can recompute any element it loaded.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.hpp"

namespace ferry::tools {

// ---- values ----------------------------------------------------------------

std::uint64_t splitmix64(std::uint64_t x);
std::uint64_t fnv1a64(std::string_view text);

// (k - 127) / 128 with k = splitmix64((seed ^ fnv1a64(name)) + index) % 255: a
// multiple of 1/128 in [-127/128, 127/128], exact in BF16, F16 and F32, so the
// value does not depend on the dtype the checkpoint was written in.
float synth_value(std::uint64_t seed, std::string_view tensor_name, std::uint64_t index);

// Round-to-nearest-even conversions (NaN stays NaN, overflow becomes infinity).
std::uint16_t float_to_bf16_bits(float value);
std::uint16_t float_to_f16_bits(float value);

// Fills `out` with elements first_index, first_index + 1, ... of tensor `name`,
// encoded little-endian as `dtype` (BF16, F16 or F32). Throws ferry::Error
// (Stage::kSynth) for another dtype or a size that is not a whole number of elements.
void synth_encode(DType dtype, std::uint64_t seed, std::string_view name, std::uint64_t first_index,
                  std::span<std::byte> out);

// ---- what a checkpoint holds -------------------------------------------------

// "llama", "qwen2", "mixtral", "qwen3_moe", "deepseek_v3".
const std::vector<std::string>& synth_families();
// "tiny" (about 1-4 MiB), "small" (tens of MiB), "medium" (2-3 GiB in BF16, untied).
const std::vector<std::string>& synth_presets();
// "bf16" | "f16" | "f32" (also the safetensors spellings "BF16", "F16", "F32").
std::optional<DType> parse_synth_dtype(std::string_view text);

struct SynthTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<std::uint64_t> shape;

  std::uint64_t elements() const;
  std::uint64_t nbytes() const;
};

// Every tensor in Hugging Face state-dict order (embed, layers 0..L-1, the
// DeepSeek MTP layer, norm, lm_head). `dtype` is the weights' dtype; DeepSeek's
// e_score_correction_bias is F32 whatever it is, as in the real checkpoints.
// `tie_embeddings` leaves out lm_head.weight. Throws ferry::Error(Stage::kSynth)
// for an unknown family or preset, or a dtype other than BF16, F16, F32.
std::vector<SynthTensor> synth_tensor_list(std::string_view family, std::string_view preset,
                                           DType dtype, bool tie_embeddings);

// config.json: the family's Hugging Face field names with the preset's sizes.
nlohmann::json synth_config(std::string_view family, std::string_view preset, DType dtype,
                            bool tie_embeddings);

// Shard size used when SynthOptions::shard_bytes is 0: tiny 512 KiB (so every
// tiny checkpoint has several shards), small 16 MiB, medium 512 MiB.
std::uint64_t synth_default_shard_bytes(std::string_view preset);

struct SynthShard {
  std::string file;                  // model-00001-of-00003.safetensors
  std::vector<std::size_t> tensors;  // positions in the tensor list, in file order
  std::uint64_t data_bytes = 0;
};

// Greedy packing in list order: a tensor never spans shards, a shard is closed
// when the next tensor would take it past `shard_bytes`, and a tensor larger than
// `shard_bytes` gets a shard of its own.
std::vector<SynthShard> synth_shard_plan(const std::vector<SynthTensor>& tensors,
                                         std::uint64_t shard_bytes);

// ---- writing -----------------------------------------------------------------

struct SynthOptions {
  std::string family;             // one of synth_families()
  std::string preset;             // one of synth_presets()
  std::string out;                // the checkpoint folder to create
  std::uint64_t seed = 1;         // input of synth_value
  DType dtype = DType::kBF16;     // BF16, F16 or F32
  std::uint64_t shard_bytes = 0;  // 0 = synth_default_shard_bytes(preset)
  bool tie_embeddings = false;    // no lm_head.weight; config says tied
  bool force = false;             // replace an existing non-empty `out`
  bool fsync = true;              // durable before the rename makes it visible
  // Called after each shard with (data bytes written so far, total data bytes).
  std::function<void(std::uint64_t, std::uint64_t)> progress;
};

struct SynthResult {
  std::vector<std::string> files;  // paths under `out`: shards, index, config.json
  std::uint64_t total_bytes = 0;   // tensor data bytes (index metadata.total_size)
  std::size_t tensors = 0;
  std::size_t shards = 0;
};

// Writes config.json, model.safetensors.index.json and the shards into a
// temporary sibling folder, then renames it to `out`, so a crash never leaves a
// checkpoint that looks complete. An existing empty `out` is replaced; a
// non-empty one only with `force`, and only when it holds nothing but regular
// files named *.safetensors or *.json, so a mistyped --out cannot wipe an
// unrelated folder. Errors are ferry::Error(Stage::kSynth).
SynthResult synthesize(const SynthOptions& options);

}  // namespace ferry::tools
