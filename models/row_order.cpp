#include "models/row_order.hpp"

#include <string>

#include "common/error.hpp"

namespace ferry::models {
namespace {

[[noreturn]] void fail(const io::TensorInfo& tensor, const std::string& rule) {
  throw Error(Stage::kPlacement, tensor.file, tensor.name, rule);
}

// One source row's part that a piece reads, and where it goes.
struct Segment {
  std::uint64_t row = 0;     // Hugging Face row
  std::uint64_t column = 0;  // first source byte within the row
  std::uint64_t bytes = 0;   // source bytes
  std::uint64_t dst = 0;     // destination offset
};

}  // namespace

std::uint64_t llama_rope_source_row(std::uint64_t row, std::uint64_t rows, std::uint64_t heads) {
  const std::uint64_t d = rows / heads;
  const std::uint64_t half = d / 2;
  const std::uint64_t h = row / d;
  const std::uint64_t w = row % d;
  return h * d + 2 * (w % half) + w / half;
}

std::vector<Piece> unpermute_rows(const std::vector<Piece>& pieces, const io::TensorInfo& tensor) {
  const std::uint64_t heads = tensor.interleaved_heads;
  const std::uint64_t rows = tensor.shape.empty() ? 0 : tensor.shape[0];
  if (heads == 0 || rows == 0 || rows % (2 * heads) != 0 || tensor.elements() % rows != 0) {
    fail(tensor, std::to_string(rows) + " rows are not whole pairs of rows of " +
                     std::to_string(heads) + " heads (llama.cpp's rope order)");
  }
  // In elements of tensor.dtype, as placement laid the pieces out (a tensor of GGML
  // blocks is moved onto its blocks after: to_block_pieces).
  const std::uint64_t row_bytes = tensor.elements() / rows * dtype_size(tensor.dtype);
  const std::uint64_t half = rows / heads / 2;
  std::vector<Piece> out;
  for (const Piece& p : pieces) {
    if (p.kind == Piece::Kind::kZero) {
      out.push_back(p);
      continue;
    }
    const std::uint64_t ses = dtype_size(p.src_dtype);
    const std::uint64_t des = dtype_size(p.dst_dtype);
    const std::uint64_t width = p.width_elems * ses;
    // The piece's source, row by row of the tensor.
    std::vector<Segment> segs;
    for (std::uint64_t i = 0; i < p.rows; ++i) {
      std::uint64_t at = p.src_offset + i * p.src_pitch;
      std::uint64_t left = width;
      std::uint64_t dst = p.dst_offset + i * p.dst_pitch;
      while (left > 0) {
        const std::uint64_t row = at / row_bytes;
        const std::uint64_t column = at % row_bytes;
        const std::uint64_t take = std::min(left, row_bytes - column);
        if (take != left && column != 0) {
          fail(tensor, "internal: a piece reads part of a row across rows");
        }
        segs.push_back({row, column, take, dst});
        dst += take / ses * des;
        at += take;
        left -= take;
      }
    }
    // Runs of consecutive rows of one half of one head, with one column window and
    // evenly spaced destinations: one piece each, reading every second source row.
    for (std::size_t a = 0; a < segs.size();) {
      const std::uint64_t step = a + 1 < segs.size() ? segs[a + 1].dst - segs[a].dst : 0;
      std::size_t b = a + 1;
      while (b < segs.size() && segs[b].row == segs[b - 1].row + 1 &&
             segs[b].row / half == segs[a].row / half && segs[b].column == segs[a].column &&
             segs[b].bytes == segs[a].bytes && segs[b].dst - segs[b - 1].dst == step) {
        ++b;
      }
      Piece q = p;
      q.rows = b - a;
      q.width_elems = segs[a].bytes / ses;
      q.src_offset = llama_rope_source_row(segs[a].row, rows, heads) * row_bytes + segs[a].column;
      q.src_pitch = 2 * row_bytes;
      q.dst_offset = segs[a].dst;
      q.dst_pitch = q.rows > 1 ? step : q.width_elems * des;
      if (q.rows == 1) {
        q.src_pitch = segs[a].bytes;
      }
      out.push_back(q);
      a = b;
    }
  }
  return out;
}

std::vector<Piece> to_block_pieces(std::vector<Piece> pieces, const io::TensorInfo& tensor) {
  const GgmlBlockShape block = ggml_block_shape(tensor.blocks);
  const std::uint64_t es = dtype_size(tensor.dtype);
  const std::string format(ggml_blocks_name(tensor.blocks));
  // Source bytes as if elements of tensor.dtype, onto the blocks that hold them.
  auto onto_blocks = [&](std::uint64_t bytes, const char* what) {
    const std::uint64_t elems = bytes / es;
    if (bytes % es != 0 || elems % block.elems != 0) {
      fail(tensor, "a tp rank's slice " + std::string(what) + " " + std::to_string(elems) +
                       ", not a multiple of the " + format + " block's " +
                       std::to_string(block.elems) +
                       " elements: a quantized GGUF tensor is cut only between its blocks "
                       "(a tp size that gives each rank whole blocks, or tp 1)");
    }
    return elems / block.elems * block.bytes;
  };
  for (Piece& p : pieces) {
    if (p.kind != Piece::Kind::kCopy) {
      continue;
    }
    if (p.src_dtype != tensor.dtype) {
      fail(tensor, "internal: a piece of a GGML block tensor reads " +
                       std::string(dtype_name(p.src_dtype)));
    }
    p.src_offset = onto_blocks(p.src_offset, "starts at element");
    onto_blocks(p.width_elems * es, "is rows of");
    if (p.rows > 1) {
      p.src_pitch = onto_blocks(p.src_pitch, "steps by");
    }
    p.src_blocks = tensor.blocks;
  }
  return pieces;
}

}  // namespace ferry::models
