// Inside synth/: a synthetic checkpoint as the GGUF file llama.cpp's
// convert_hf_to_gguf.py would write for it (SynthFormat::kGguf; the rules are in
// synth/synth.hpp, "GGUF"). Planned before any byte is written, so what the format
// cannot hold is refused before the output folder is touched.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "io/gguf_writer.hpp"
#include "synth/synth.hpp"

namespace ferry::synth {

// Where a GGUF tensor's rows come from in the Hugging Face tensor list.
enum class GgufSource {
  kRows,      // HF tensor as it is: GGUF row r is HF row r
  kPermuted,  // llama's q_proj / k_proj: GGUF row g is HF row row_map[g]
  kExperts,   // stacked experts: expert e's rows are rows e * out ... of the stack
  kKb,        // DeepSeek's attn_k_b: head h's k half of kv_b_proj, transposed
  kVb,        // DeepSeek's attn_v_b: head h's v half of kv_b_proj
};

struct GgufPlanned {
  std::string name;
  io::GgmlType type = io::GgmlType::kF32;
  std::vector<std::uint64_t> dims;  // ggml order: dims[0] is the row length
  GgufSource source = GgufSource::kRows;
  std::vector<std::size_t> hf;         // positions in the tensor list: one, or E (kExperts)
  std::vector<std::uint64_t> row_map;  // kPermuted: over HF's first dimension
  // kKb / kVb: kv_b_proj's [heads * (nope + v_dim), rank]
  std::uint64_t heads = 0, nope = 0, v_dim = 0, rank = 0;
};

struct GgufPlan {
  io::GgufArch arch = io::GgufArch::kLlama;
  io::GgufMetadata metadata;
  std::vector<GgufPlanned> tensors;  // in the order they are written
};

// Plans `tensors` (a family's list, its config.json `config`) as `family`'s GGUF of
// type `type`, named `what` in general.name. Throws ferry::Error(Stage::kSynth,
// `where`, tensor, rule) for a family, tensor or config value the converter's output
// cannot be made of.
GgufPlan plan_synth_gguf(const std::vector<SynthTensor>& tensors, const nlohmann::json& config,
                         std::string_view family, std::string_view what, io::GgmlType type,
                         const std::string& where);

// Writes `plan` to `path` with the synth values of `tensors` (seed `seed`), calling
// `progress` after each tensor with the data bytes so far and in all; returns the
// tensors' data bytes (padding left out).
std::uint64_t write_synth_gguf(const std::string& path, const GgufPlan& plan,
                               const std::vector<SynthTensor>& tensors, std::uint64_t seed,
                               bool fsync,
                               const std::function<void(std::uint64_t, std::uint64_t)>& progress);

}  // namespace ferry::synth
