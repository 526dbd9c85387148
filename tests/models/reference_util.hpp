// An independent, deliberately naive account of what each tensor-parallel rank of
// a Llama-like model must hold, and a naive executor of ferry's pieces. Nothing here
// uses models/ code: the reference reads config.json itself and computes every
// element of every local param by explicit index arithmetic (Megatron definitions),
// so a placement test compares two separate derivations element by element.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "io/safetensors.hpp"
#include "models/model.hpp"
#include "testing/dtype_codec.hpp"

namespace ferry::testing {

struct RefConfig {
  std::uint64_t hidden = 0;
  std::uint64_t heads = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;
  std::uint64_t inter = 0;
  std::uint64_t layers = 0;
  std::uint64_t vocab = 0;
  bool tied = false;
  bool qkv_bias = false;
  bool o_bias = false;
  bool pad = false;  // model.unaligned_tp=pad (not from config.json: the test sets it)
  bool qk_norm = false;                  // self_attn.q_norm / k_norm [head_dim] (Qwen3, Gemma 3)
  std::vector<std::string> extra_norms;  // layer norms past input / post_attention (Gemma 2, 3)
  bool replicated_embedding = false;     // the whole, unpadded embedding on every rank (Gemma 3)
  bool norm_plus_one = false;  // Gemma 1: every norm weight is the checkpoint's + 1 (the
                               // caller applies it, in the param dtype)
  // Attention data parallelism (not from config.json: the test sets them): the sizes
  // of the groups qkv_proj / o_proj, embed_tokens and lm_head split over, 0 meaning
  // all tp ranks; rank r is rank r % size of its group (SGLang 0.5.23,
  // runtime_context.py, derive_attention_ranks).
  std::uint64_t attn_group = 0;
  std::uint64_t embed_group = 0;
  std::uint64_t head_group = 0;
};

// Reads the fields the reference needs (Qwen2: q/k/v biases; Llama/Mistral/Phi-3:
// attention_bias or bias; an MLP has no biases, whatever mlp_bias says; Qwen3:
// q_norm / k_norm, biases with attention_bias; Gemma: always tied, Gemma 2 / 3 the
// pre- and post-feedforward norms and biases with attention_bias, Gemma 3 q_norm /
// k_norm and an embedding every rank holds whole).
RefConfig ref_config(const nlohmann::json& config);

struct HostTensor {
  std::vector<std::uint64_t> shape;
  std::vector<float> values;  // row-major
};
using TensorMap = std::map<std::string, HostTensor>;

// Full checkpoint tensors of `shapes` with values synth::synth_value(seed, name, i).
TensorMap make_checkpoint(const std::map<std::string, std::vector<std::uint64_t>>& shapes,
                          std::uint64_t seed);

// What tp rank `rank` of `tp` must hold: SGLang param name -> local shape and values.
// A checkpoint that stores self_attn.qkv_proj / mlp.gate_up_proj fused (Phi-3) is
// read as its q, k, v rows (by the head counts) and its gate, up halves.
TensorMap reference_params(const RefConfig& c, const TensorMap& checkpoint, int rank, int tp);

// A tiny synthetic checkpoint (synth/synth.hpp's "tiny" preset) of "llama", "qwen2"
// or "mistral" (Llama's tensors under a Mistral config: no head_dim, no bias keys).
// `llama_biases` turns on attention_bias and mlp_bias and adds those tensors.
struct SynthCase {
  nlohmann::json config;
  std::vector<std::string> names;  // checkpoint order
  std::map<std::string, std::vector<std::uint64_t>> shapes;
  DType dtype = DType::kBF16;
};
SynthCase tiny_case(const std::string& family, DType dtype, bool tied, bool llama_biases = false);

// A TensorInfo as a validated header would give it (offset 0, nbytes from shape).
io::TensorInfo tensor_info(const std::string& name, DType dtype,
                           const std::vector<std::uint64_t>& shape);

// (encode, encode_one and decode_one: testing/dtype_codec.hpp.)

// Steps a row-major logical index through `shape` (the last dim fastest); false once
// every index has been visited.
inline bool next_index(std::vector<std::uint64_t>& idx, const std::vector<std::uint64_t>& shape) {
  for (std::size_t a = idx.size(); a-- > 0;) {
    if (++idx[a] < shape[a]) {
      return true;
    }
    idx[a] = 0;
  }
  return false;
}

// The storage offset (elements) of logical index `idx` under `strides`.
inline std::uint64_t storage_offset(const std::vector<std::uint64_t>& idx,
                                    const std::vector<std::uint64_t>& strides) {
  std::uint64_t off = 0;
  for (std::size_t a = 0; a < idx.size(); ++a) {
    off += idx[a] * strides[a];
  }
  return off;
}

// Param storage of every local rank, plus how often each byte was written.
struct ParamBuffers {
  std::vector<std::vector<std::vector<std::byte>>> bytes;      // [local rank][param]
  std::vector<std::vector<std::vector<std::uint8_t>>> writes;  // same shape, per byte
};
ParamBuffers make_buffers(const models::Model& model);

// Applies one piece the way a copy worker must: row i copies width_elems elements
// from src_offset + i*src_pitch to dst_offset + i*dst_pitch, converting each element
// from src_dtype to dst_dtype; a zero piece writes zeros. `window` holds the tensor's
// bytes [window_begin, window_begin + window.size()): a piece that reads outside it
// (or writes outside its param) throws std::runtime_error.
void apply_piece(const models::Piece& piece, std::span<const std::byte> window,
                 std::uint64_t window_begin, ParamBuffers& buffers);

// Runs the model's hooks of every local rank on a host device (poisoned memory),
// over the params' bytes in `buffers`: hook outputs are marked written once (a piece
// that wrote one fails the test), rewritten params get the hook's bytes.
void run_hooks(const models::Model& model, ParamBuffers& buffers);

// The parallel layout a contract case names: any case with tp, ep, pp, pp_rank,
// local (the local ranks), attn_dp and dp_lm_head.
template <class Case>
models::ParallelLayout case_layout(const Case& c) {
  models::ParallelLayout layout;
  layout.tp = c.tp;
  layout.ep = c.ep;
  layout.pp = c.pp;
  layout.pp_rank = c.pp_rank;
  layout.local_ranks = c.local;
  layout.attn_dp = c.attn_dp;
  layout.dp_lm_head = c.dp_lm_head;
  return layout;
}

}  // namespace ferry::testing
