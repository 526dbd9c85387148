// From llama.cpp's tensor names back to a Hugging Face checkpoint's, for the
// architectures llama.cpp's convert_hf_to_gguf.py writes for Llama, Mistral and
// Mixtral ("llama"), Qwen2 ("qwen2"), Qwen3 ("qwen3"), Qwen3-MoE ("qwen3moe") and
// DeepSeek-V2/V3 ("deepseek2"): which HF tensor each GGUF tensor's bytes are, and
// the three places where the converter changed more than the name:
//
//  - stacked experts: blk.N.ffn_{gate,up,down}_exps (ggml dims [in, out, E]) hold
//    the E experts' [out, in] matrices one after the other (the converter's
//    torch.stack(datas, dim=0)), so expert e is the contiguous slice
//    [e * nbytes / E, (e + 1) * nbytes / E): one GGUF tensor, E HF tensors
//    model.layers.N.mlp.experts.e.gate_proj.weight (w1/w3/w2 for Mixtral), each a
//    byte range of the file, quantized or not (a slice is whole rows);
//  - the llama architecture's Q and K rows: LlamaModel.permute (convert_hf_to_gguf.py,
//    conversion/llama.py in current llama.cpp) reorders q_proj's rows with n_head
//    and k_proj's with n_head_kv (weights and biases), for llama.cpp's RoPE, which
//    pairs adjacent elements where Hugging Face's pairs the two halves of a head.
//    llama_qk_hf_rows() inverts it; whole rows move, so quantized rows too. Qwen2,
//    Qwen3 and DeepSeek are converted without it;
//  - DeepSeek's kv_b_proj: DeepseekV2Model.modify_tensors in current llama.cpp
//    (since the MLA change of April 2025) splits it per head into attn_k_b (the k
//    half, transposed: ggml dims [qk_nope, kv_lora_rank, n_head]) and attn_v_b (ggml
//    dims [kv_lora_rank, v_head_dim, n_head]); older files keep attn_kv_b as it was.
//    Both are mapped: attn_kv_b as itself, attn_k_b and attn_v_b to kv_b_proj
//    through mla_kv_b_proj() (elements move one by one, so quantized halves are
//    dequantized first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/gguf.hpp"

namespace ferry::io {

enum class GgufArch { kLlama, kQwen2, kQwen3, kQwen3Moe, kDeepseek2 };

// general.architecture's spelling ("llama", "qwen3moe", "deepseek2"); nullopt for
// the rest.
std::optional<GgufArch> parse_gguf_arch(std::string_view name);
std::string_view gguf_arch_name(GgufArch arch);

// How a GGUF tensor's bytes become Hugging Face tensors.
enum class GgufToHf {
  kSame,           // the bytes are the HF tensor's (in the GGUF's type)
  kUnpermuteRows,  // llama attn_q / attn_k: HF row r is GGUF row llama_qk_hf_rows()[r]
  kExperts,        // E stacked experts: one HF tensor per contiguous slice
  kMlaKB,          // attn_k_b: with attn_v_b, kv_b_proj (mla_kv_b_proj)
  kMlaVB,          // attn_v_b
  kNone,           // no HF twin: rope_freqs and attn_rot_embd, computed from the config
};

// The name rule for one GGUF name, before shapes are known.
struct GgufNameRule {
  GgufToHf how = GgufToHf::kSame;
  // The HF name; for kExperts with "{E}" where the expert's number goes.
  std::string hf_name;
  // kUnpermuteRows: true for attn_k (permuted with head_count_kv), false for attn_q.
  bool key = false;
};

// The rule for `gguf_name` in `arch`; nullopt for a name the architecture does not
// have (or a form ferry does not read, such as ffn_gate_up_exps).
std::optional<GgufNameRule> match_gguf_name(GgufArch arch, std::string_view gguf_name);

// One GGUF tensor a Hugging Face tensor is written into (match_hf_name).
struct HfGgufTarget {
  std::string gguf_name;  // kExperts: the stacked tensor, blk.N.ffn_*_exps.weight
  GgufToHf how = GgufToHf::kSame;
  bool key = false;          // kUnpermuteRows: permuted with head_count_kv (attn_k)
  std::uint64_t expert = 0;  // kExperts: the expert's place in the stack
};

// The other direction, as current llama.cpp's converter names them: the GGUF tensors
// Hugging Face tensor `hf_name` is written into in `arch` (match_gguf_name's tables
// read backwards, so match_gguf_name of each gives `hf_name` back). One, except for
// DeepSeek's kv_b_proj, which the converter splits into attn_k_b then attn_v_b
// (kMlaKB, kMlaVB; not the attn_kv_b of files converted before April 2025). An
// expert's weight (kExperts) names its stack and its place in it. Empty for a name
// the architecture does not have, which the converter would stop at.
std::vector<HfGgufTarget> match_hf_name(GgufArch arch, std::string_view hf_name);

struct GgufHfPiece {
  std::string hf_name;
  std::uint64_t offset = 0;  // absolute file offset of the piece's bytes
  std::uint64_t nbytes = 0;
  std::vector<std::uint64_t> hf_shape;  // row-major, as torch and safetensors say it
};

struct GgufHfTensor {
  std::string gguf_name;
  GgmlType type = GgmlType::kF32;
  GgufToHf how = GgufToHf::kSame;
  // One piece, or one per expert (kExperts). kMlaKB / kMlaVB: one piece naming
  // kv_b_proj with its whole HF shape and this GGUF tensor's own bytes.
  std::vector<GgufHfPiece> pieces;
  // kUnpermuteRows: the heads the converter permuted with, and the rows it moved
  // (HF's first dimension: a weight's rows, a bias's elements) of row_bytes each.
  std::uint64_t heads = 0;
  std::uint64_t rows = 0;
  std::uint64_t row_bytes = 0;
};

struct GgufHfMap {
  GgufArch arch = GgufArch::kLlama;
  std::vector<GgufHfTensor> tensors;  // the header's order (by offset)
  std::vector<std::string> skipped;   // GGUF tensors with no HF twin (kNone)
};

// Maps every tensor of `header`. Throws ferry::Error(Stage::kMapping, header.file,
// tensor, rule) for an architecture it does not map (by name), a tensor name the
// architecture does not have (by name), stacked experts that are not 3-D or whose
// count disagrees with {arch}.expert_count, Q/K rows that are not whole pairs of
// heads, a quantized 1-D tensor to unpermute, and missing head counts (by key).
GgufHfMap map_gguf_to_hf(const GgufHeader& header);

// The inverse of LlamaModel.permute(w, heads, heads) (the converter passes n_head
// for q_proj and n_head_kv for k_proj) over `rows` rows: HF row r is GGUF row
// out[r]. Within each head of d = rows / heads rows, HF row h d + j (d / 2) + i
// (j in {0, 1}, i < d / 2) was written to GGUF row h d + 2 i + j. Throws
// std::invalid_argument unless rows is a multiple of 2 * heads.
std::vector<std::uint64_t> llama_qk_hf_rows(std::uint64_t rows, std::uint64_t heads);
// The converter's own direction, for tests: GGUF row g holds HF row out[g].
std::vector<std::uint64_t> llama_qk_permute_rows(std::uint64_t rows, std::uint64_t heads);

// out row r = in row map[r], rows of `row_bytes` bytes (any type: a quantized row
// is whole blocks). Throws std::invalid_argument when the sizes do not match or an
// index is out of range.
void gather_rows(std::span<const std::byte> in, std::span<std::byte> out, std::uint64_t row_bytes,
                 std::span<const std::uint64_t> map);

// DeepSeek's kv_b_proj, HF shape [n_head * (nope + v_dim), rank], from the attn_k_b
// (HF shape [n_head, rank, nope]) and attn_v_b ([n_head, v_dim, rank]) the converter
// split it into: head h's rows are k_b[h] transposed, then v_b[h]. Elements of
// `element_bytes` bytes (a plain type's, or 4 after dequantize()). Throws
// std::invalid_argument when the sizes do not match.
std::vector<std::byte> mla_kv_b_proj(std::span<const std::byte> k_b, std::span<const std::byte> v_b,
                                     std::size_t element_bytes, std::uint64_t n_head,
                                     std::uint64_t nope, std::uint64_t v_dim, std::uint64_t rank);
// The converter's split, for tests: kv_b_proj into k_b then v_b, concatenated.
std::vector<std::byte> mla_split_kv_b(std::span<const std::byte> kv_b, std::size_t element_bytes,
                                      std::uint64_t n_head, std::uint64_t nope, std::uint64_t v_dim,
                                      std::uint64_t rank);

}  // namespace ferry::io
