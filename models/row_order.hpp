// Reading rows stored in another order: GGUF's llama attn_q / attn_k keep their rows
// in llama.cpp's rope order (convert_hf_to_gguf.py LlamaModel.permute), and the
// engine's parameters want the Hugging Face order. Placement cuts each piece of such
// a tensor (io::TensorInfo::interleaved_heads) into pieces that read every second
// source row, so the bytes land in order with no extra pass: within head h of d rows,
// Hugging Face row h*d + k*d/2 + j is GGUF row h*d + 2j + k. And reading elements
// stored in another format: a quantized GGUF tensor's pieces read its GGML blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "io/safetensors.hpp"
#include "models/model.hpp"

namespace ferry::models {

// The Hugging Face row `row` of a tensor of `rows` rows in `heads` heads, as a GGUF
// row (rows a multiple of 2 * heads).
std::uint64_t llama_rope_source_row(std::uint64_t row, std::uint64_t rows, std::uint64_t heads);

// `pieces` (of `tensor`, placed as if its rows were in the Hugging Face order), cut
// so that each reads the rows where they are stored. Each piece must read whole
// rows or column windows of rows; zero pieces pass unchanged. Throws
// ferry::Error(Stage::kPlacement) naming the tensor when its rows are not whole
// pairs of rows of its heads, or a piece reads a row in part across rows.
std::vector<Piece> unpermute_rows(const std::vector<Piece>& pieces, const io::TensorInfo& tensor);

// `pieces` of a tensor stored as GGML blocks (io::TensorInfo::blocks), placed as if
// its elements were tensor.dtype, moved onto the blocks that hold them: offsets and
// pitches become block bytes and each piece is marked to dequantize. Throws
// ferry::Error(Stage::kPlacement) naming the tensor and the block format when a
// piece starts, ends or steps inside a block (a tp cut through a block).
std::vector<Piece> to_block_pieces(std::vector<Piece> pieces, const io::TensorInfo& tensor);

}  // namespace ferry::models
