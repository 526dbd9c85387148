// models/row_order: pieces of a tensor stored in llama.cpp's rope order read back
// into the Hugging Face order. The reference is io/gguf_names' permutation (checked
// against numpy's reshape/swapaxes in interop.gguf): a tensor is permuted with it,
// the rewritten pieces are applied byte by byte, and the result must be the
// original rows, for whole-row pieces (a tp rank's rows of q_proj, into the middle
// of a fused qkv param) and column windows, at Llama-3-8B's sizes. Pieces of a tensor
// of GGML blocks (to_block_pieces) read whole blocks: applied by dequantizing each
// source row with io::dequantize, they give the reference's dequantized slice, and a
// cut inside a block is refused.
#include "models/row_order.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <span>
#include <vector>

#include "common/error.hpp"
#include "io/gguf_names.hpp"
#include "io/gguf_types.hpp"

namespace ferry::models {
namespace {

// Applies copy pieces from `src` into `dst` (same dtype).
void apply(const std::vector<Piece>& pieces, const std::vector<std::byte>& src,
           std::vector<std::byte>& dst) {
  for (const Piece& p : pieces) {
    const std::uint64_t width = p.width_elems * dtype_size(p.src_dtype);
    for (std::uint64_t r = 0; r < p.rows; ++r) {
      ASSERT_LE(p.src_offset + r * p.src_pitch + width, src.size());
      ASSERT_LE(p.dst_offset + r * p.dst_pitch + width, dst.size());
      std::memcpy(dst.data() + p.dst_offset + r * p.dst_pitch,
                  src.data() + p.src_offset + r * p.src_pitch, width);
    }
  }
}

struct Case {
  std::uint64_t rows;
  std::uint64_t cols;
  std::uint64_t heads;
};

// HF rows as bytes: row r, column c holds a value made of both (BF16-sized elements).
std::vector<std::byte> hf_matrix(const Case& c) {
  std::vector<std::byte> m(c.rows * c.cols * 2);
  for (std::uint64_t r = 0; r < c.rows; ++r) {
    for (std::uint64_t col = 0; col < c.cols; ++col) {
      const std::uint16_t v = static_cast<std::uint16_t>(r * 7919 + col * 31);
      std::memcpy(&m[(r * c.cols + col) * 2], &v, 2);
    }
  }
  return m;
}

std::vector<std::byte> gguf_order(const std::vector<std::byte>& hf, const Case& c) {
  const std::vector<std::uint64_t> holds = io::llama_qk_permute_rows(c.rows, c.heads);
  std::vector<std::byte> g(hf.size());
  const std::uint64_t rb = c.cols * 2;
  for (std::uint64_t row = 0; row < c.rows; ++row) {
    std::memcpy(&g[row * rb], &hf[holds[row] * rb], rb);
  }
  return g;
}

io::TensorInfo tensor(const Case& c) {
  io::TensorInfo t;
  t.name = "model.layers.0.self_attn.q_proj.weight";
  t.dtype = DType::kBF16;
  t.shape = {c.rows, c.cols};
  t.nbytes = c.rows * c.cols * 2;
  t.interleaved_heads = static_cast<std::uint32_t>(c.heads);
  return t;
}

Piece whole_rows(const Case& c, std::uint64_t first, std::uint64_t n, std::uint64_t dst_row) {
  Piece p;
  p.src_dtype = p.dst_dtype = DType::kBF16;
  p.rows = 1;
  p.width_elems = n * c.cols;
  p.src_offset = first * c.cols * 2;
  p.src_pitch = p.width_elems * 2;
  p.dst_offset = dst_row * c.cols * 2;
  p.dst_pitch = p.src_pitch;
  return p;
}

TEST(RowOrder, SourceRowIsTheInverseOfTheConvertersPermute) {
  const std::vector<std::uint64_t> hf = io::llama_qk_hf_rows(4096, 32);
  for (std::uint64_t r = 0; r < hf.size(); ++r) {
    ASSERT_EQ(llama_rope_source_row(r, 4096, 32), hf[r]) << r;
  }
}

TEST(RowOrder, EveryTpRanksRowsLandInHuggingFaceOrder) {
  // Llama-3-8B: q 4096 rows in 32 heads, k 1024 rows in 8 heads; short rows keep it quick.
  for (const Case c : {Case{4096, 8, 32}, Case{1024, 8, 8}, Case{64, 3, 2}}) {
    const std::vector<std::byte> hf = hf_matrix(c);
    const std::vector<std::byte> g = gguf_order(hf, c);
    for (std::uint64_t tp : {1, 2, 4, 8}) {
      if ((c.rows / tp) % (c.rows / c.heads) != 0) {
        continue;  // the rank's share is not whole heads
      }
      const std::uint64_t share = c.rows / tp;
      for (std::uint64_t rank = 0; rank < tp; ++rank) {
        // The rank's q rows go after 5 rows of something else in a fused param.
        std::vector<std::byte> dst((share + 5) * c.cols * 2, std::byte{0});
        const std::vector<Piece> pieces =
            unpermute_rows({whole_rows(c, rank * share, share, 5)}, tensor(c));
        EXPECT_LE(pieces.size(), 2 * c.heads);  // one run per half head
        apply(pieces, g, dst);
        ASSERT_EQ(std::memcmp(dst.data() + 5 * c.cols * 2, hf.data() + rank * share * c.cols * 2,
                              share * c.cols * 2),
                  0)
            << "rows " << c.rows << " tp " << tp << " rank " << rank;
      }
    }
  }
}

TEST(RowOrder, ColumnWindowsAndPiecesCrossingHeads) {
  const Case c{64, 6, 4};  // 16 rows a head
  const std::vector<std::byte> hf = hf_matrix(c);
  const std::vector<std::byte> g = gguf_order(hf, c);
  // Columns [2, 5) of rows [3, 40): one piece row per tensor row.
  Piece p;
  p.src_dtype = p.dst_dtype = DType::kBF16;
  p.rows = 37;
  p.width_elems = 3;
  p.src_offset = (3 * c.cols + 2) * 2;
  p.src_pitch = c.cols * 2;
  p.dst_offset = 0;
  p.dst_pitch = 3 * 2;
  std::vector<std::byte> dst(37 * 3 * 2);
  apply(unpermute_rows({p}, tensor(c)), g, dst);
  for (std::uint64_t r = 0; r < 37; ++r) {
    ASSERT_EQ(std::memcmp(&dst[r * 6], &hf[((3 + r) * c.cols + 2) * 2], 6), 0) << r;
  }
  // Whole rows [5, 50): starts and ends inside halves of heads.
  std::vector<std::byte> rows(45 * c.cols * 2);
  apply(unpermute_rows({whole_rows(c, 5, 45, 0)}, tensor(c)), g, rows);
  EXPECT_EQ(std::memcmp(rows.data(), &hf[5 * c.cols * 2], rows.size()), 0);
}

TEST(RowOrder, RowsThatAreNotWholeHeadPairsAreRefused) {
  io::TensorInfo t = tensor({60, 4, 8});
  try {
    unpermute_rows({whole_rows({60, 4, 8}, 0, 60, 0)}, t);
    ADD_FAILURE() << "60 rows in 8 heads were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kPlacement);
    EXPECT_NE(std::string(e.what()).find("not whole pairs of rows of 8 heads"), std::string::npos);
  }
}

// A Q8_0 tensor of `rows` x `cols` whose element (r, c) is about r - c / 7: its
// blocks as a GGUF stores them, and their float32 values (io::dequantize's).
struct Q8Tensor {
  std::vector<std::byte> blocks;
  std::vector<float> values;
};

Q8Tensor q8_tensor(std::uint64_t rows, std::uint64_t cols) {
  std::vector<float> x(rows * cols);
  for (std::uint64_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(i / cols) - static_cast<float>(i % cols) / 7.0f;
  }
  Q8Tensor t;
  t.blocks.resize(x.size() / 32 * 34);
  io::quantize_q8_0(x, t.blocks);
  t.values.resize(x.size());
  io::dequantize(io::GgmlType::kQ8_0, t.blocks, t.values);
  return t;
}

io::TensorInfo q8_info(std::uint64_t rows, std::uint64_t cols, std::uint32_t heads) {
  io::TensorInfo t;
  t.name = "model.layers.0.self_attn.q_proj.weight";
  t.dtype = DType::kF32;
  t.shape = {rows, cols};
  t.nbytes = rows * cols / 32 * 34;
  t.blocks = GgmlBlocks::kQ8_0;
  t.interleaved_heads = heads;
  return t;
}

// Applies block pieces: each source row's blocks dequantized into F32 `dst`.
void apply_blocks(const std::vector<Piece>& pieces, const std::vector<std::byte>& src,
                  std::vector<float>& dst) {
  for (const Piece& p : pieces) {
    ASSERT_EQ(p.src_blocks, GgmlBlocks::kQ8_0);
    ASSERT_EQ(p.src_row_bytes(), p.width_elems / 32 * 34);
    for (std::uint64_t r = 0; r < p.rows; ++r) {
      const std::uint64_t at = p.src_offset + r * p.src_pitch;
      ASSERT_LE(at + p.src_row_bytes(), src.size());
      ASSERT_EQ((p.dst_offset + r * p.dst_pitch) % 4, 0u);
      const std::uint64_t d = (p.dst_offset + r * p.dst_pitch) / 4;
      ASSERT_LE(d + p.width_elems, dst.size());
      io::dequantize(io::GgmlType::kQ8_0, std::span(src).subspan(at, p.src_row_bytes()),
                     std::span(dst).subspan(d, p.width_elems));
    }
  }
}

// A row-parallel share: columns [first, first + width) of every row, into a dense param.
Piece column_window(std::uint64_t rows, std::uint64_t cols, std::uint64_t first,
                    std::uint64_t width) {
  Piece p;
  p.src_dtype = p.dst_dtype = DType::kF32;
  p.rows = rows;
  p.width_elems = width;
  p.src_offset = first * 4;
  p.src_pitch = cols * 4;
  p.dst_pitch = width * 4;
  return p;
}

TEST(BlockPieces, ATpRanksColumnsAreItsWholeBlocks) {
  const std::uint64_t rows = 6, cols = 256;
  const Q8Tensor t = q8_tensor(rows, cols);
  for (std::uint64_t tp : {1, 2, 4, 8}) {
    const std::uint64_t share = cols / tp;
    for (std::uint64_t rank = 0; rank < tp; ++rank) {
      const std::vector<Piece> pieces =
          to_block_pieces({column_window(rows, cols, rank * share, share)}, q8_info(rows, cols, 0));
      ASSERT_EQ(pieces.size(), 1u);
      EXPECT_EQ(pieces[0].src_offset, rank * share / 32 * 34);
      EXPECT_EQ(pieces[0].src_pitch, cols / 32 * 34);
      std::vector<float> dst(rows * share, -1.0f);
      apply_blocks(pieces, t.blocks, dst);
      for (std::uint64_t r = 0; r < rows; ++r) {
        for (std::uint64_t c = 0; c < share; ++c) {
          ASSERT_EQ(dst[r * share + c], t.values[r * cols + rank * share + c])
              << "tp " << tp << " rank " << rank << " (" << r << ", " << c << ")";
        }
      }
    }
  }
}

TEST(BlockPieces, RopeOrderedRowsOfBlocksReadBackInOrder) {
  // q_proj of 4 heads of 16 rows, Q8_0, rows in llama.cpp's order: tp 2's rank 1.
  const std::uint64_t rows = 64, cols = 64, heads = 4;
  const Q8Tensor hf = q8_tensor(rows, cols);
  const std::vector<std::uint64_t> holds = io::llama_qk_permute_rows(rows, heads);
  std::vector<std::byte> g(hf.blocks.size());
  const std::uint64_t rb = cols / 32 * 34;
  for (std::uint64_t row = 0; row < rows; ++row) {
    std::memcpy(&g[row * rb], &hf.blocks[holds[row] * rb], rb);
  }
  const io::TensorInfo info = q8_info(rows, cols, heads);
  Piece p = column_window(32, cols, 32 * cols, cols);  // rows [32, 64), whole
  p.rows = 1;
  p.width_elems = 32 * cols;
  p.src_pitch = p.dst_pitch = p.width_elems * 4;
  const std::vector<Piece> pieces = to_block_pieces(unpermute_rows({p}, info), info);
  std::vector<float> dst(32 * cols);
  apply_blocks(pieces, g, dst);
  for (std::uint64_t i = 0; i < dst.size(); ++i) {
    ASSERT_EQ(dst[i], hf.values[32 * cols + i]) << i;
  }
}

TEST(BlockPieces, ACutInsideABlockIsRefusedByName) {
  const io::TensorInfo info = q8_info(4, 96, 0);
  // tp 2 of 96 columns: 48 each, and 48 is not whole blocks of 32.
  for (const Piece& p : {column_window(4, 96, 48, 48), column_window(4, 96, 0, 48)}) {
    try {
      to_block_pieces({p}, info);
      ADD_FAILURE() << "a cut at column 48 was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kPlacement);
      EXPECT_NE(std::string(e.what()).find("not a multiple of the Q8_0 block's 32 elements"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("q_proj"), std::string::npos);
    }
  }
}

}  // namespace
}  // namespace ferry::models
