#include "actors/fragment_copy.hpp"

#include <algorithm>
#include <array>
#include <string>

#include "common/enum_name.hpp"
#include "common/error.hpp"

namespace ferry::actors {
namespace {

// Bytes from the first source byte of row 0 to the last of the last row.
std::uint64_t source_span(std::uint64_t rows, std::uint64_t src_pitch, std::uint64_t row_bytes) {
  return rows == 0 ? 0 : (rows - 1) * src_pitch + row_bytes;
}

// The shape of a piece or fragment, as far as the path goes.
struct Shape {
  std::uint64_t rows = 0;
  std::uint64_t src_pitch = 0;
  std::uint64_t dst_pitch = 0;
  std::uint64_t src_row = 0;
  std::uint64_t dst_row = 0;
  bool cast = false;
};

Shape shape_of(const Fragment& f) {
  return {f.rows,
          f.src_pitch,
          f.dst_pitch,
          f.src_row_bytes(),
          f.dst_row_bytes(),
          f.src_dtype != f.dst_dtype || f.src_blocks != GgmlBlocks::kNone};
}

Shape shape_of(const models::Piece& p) {
  return {p.rows,
          p.src_pitch,
          p.dst_pitch,
          p.src_row_bytes(),
          p.width_elems * dtype_size(p.dst_dtype),
          p.src_dtype != p.dst_dtype || p.src_blocks != GgmlBlocks::kNone};
}

bool dense_source(const Shape& s) {
  return s.rows <= 1 || s.src_pitch == s.src_row;
}

// How a fragment of shape `s` is carried out: its path, where a cast's rows sit in
// scratch, and the scratch that takes. The one rule both the copy worker (per
// fragment) and rank_scratch_bytes (per piece, before streaming) apply, so that no
// fragment a window cuts from a piece needs more scratch than the piece was sized
// for: every input is the same for a piece and its fragments except the row count,
// and cutting rows off only turns a path into a plain copy or shrinks its span.
struct CopyStep {
  CopyPath path = CopyPath::kContiguous;
  bool span_to_scratch = false;  // a cast's source span copied whole into scratch
  std::uint64_t scratch = 0;
};

CopyStep copy_step(const Shape& s, std::size_t narrow_row_bytes) {
  // Narrow rows are gathered when their source pitch is at most kGatherMaxSpanRatio
  // rows: a ratio per row, not per span, because a span's ratio depends on the row
  // count (two rows of pitch 3w span 4w = 2 x 2w) and so would gather a two-row
  // fragment of a piece whose whole span was judged too sparse.
  const bool gatherable =
      s.rows > 1 && s.src_row < narrow_row_bytes && s.src_pitch <= kGatherMaxSpanRatio * s.src_row;
  const std::uint64_t span = source_span(s.rows, s.src_pitch, s.src_row);
  if (s.cast) {
    const bool whole = dense_source(s) || gatherable;
    return {CopyPath::kCast, whole, whole ? span : s.rows * s.src_row};
  }
  if (s.rows <= 1 || (s.src_pitch == s.src_row && s.dst_pitch == s.dst_row)) {
    return {CopyPath::kContiguous, false, 0};
  }
  if (gatherable) {
    return {CopyPath::kGather, false, span};
  }
  return {CopyPath::kPitched, false, 0};
}

}  // namespace

std::string_view to_string(CopyPath path) {
  static constexpr std::array<std::string_view, 4> kNames{"contiguous", "pitched", "gather",
                                                          "cast"};
  static_assert(kNames.size() == static_cast<std::size_t>(CopyPath::kCast) + 1);
  return enum_name(path, kNames, "cast");
}

CopyPath copy_path(const Fragment& f, std::size_t narrow_row_bytes) {
  return copy_step(shape_of(f), narrow_row_bytes).path;
}

std::uint64_t fragment_scratch_bytes(const Fragment& f, std::size_t narrow_row_bytes) {
  return copy_step(shape_of(f), narrow_row_bytes).scratch;
}

std::uint64_t rank_scratch_bytes(const Plan& plan, std::size_t rank, std::size_t narrow_row_bytes) {
  std::uint64_t need = 0;
  for (const PlannedRoute& route : plan.routes) {
    for (const models::Piece& p : route.pieces) {
      if (p.local_rank == rank && p.kind == models::Piece::Kind::kCopy) {
        need = std::max(need, copy_step(shape_of(p), narrow_row_bytes).scratch);
      }
    }
  }
  return std::min<std::uint64_t>(need, plan.options.chunk_bytes);
}

void copy_fragment(gpu::Stream& stream, const Fragment& f, std::byte* param,
                   const std::byte* staging, std::byte* scratch, std::size_t scratch_bytes,
                   std::size_t narrow_row_bytes) {
  std::byte* dst = param + f.dst_offset;
  const std::byte* src = staging + f.src_offset;
  const Shape s = shape_of(f);
  const CopyStep step = copy_step(s, narrow_row_bytes);
  const CopyPath path = step.path;
  const std::uint64_t need = step.scratch;
  if (need > scratch_bytes) {
    throw Error(Stage::kCopy, "", "",
                "internal: a fragment's " + std::string(to_string(path)) + " path needs " +
                    std::to_string(need) + " bytes of device scratch, " +
                    std::to_string(scratch_bytes) + " were allocated");
  }
  switch (path) {
    case CopyPath::kContiguous:
      stream.copy_h2d(dst, src, s.rows * s.src_row);
      return;
    case CopyPath::kPitched:
      stream.copy_h2d_2d(dst, f.dst_pitch, src, f.src_pitch, s.src_row, f.rows);
      return;
    case CopyPath::kGather:
      stream.copy_h2d(scratch, src, need);
      stream.copy_d2d_2d(dst, f.dst_pitch, scratch, f.src_pitch, s.src_row, f.rows);
      return;
    case CopyPath::kCast:
      break;
  }
  std::uint64_t scratch_pitch = s.src_row;
  if (step.span_to_scratch) {
    stream.copy_h2d(scratch, src, need);
    scratch_pitch = f.rows <= 1 ? s.src_row : f.src_pitch;
  } else {
    stream.copy_h2d_2d(scratch, s.src_row, src, f.src_pitch, s.src_row, f.rows);
  }
  const std::uint64_t dst_pitch = f.rows <= 1 ? s.dst_row : f.dst_pitch;
  if (f.src_blocks != GgmlBlocks::kNone) {
    stream.dequantize_ggml_2d(dst, dst_pitch, f.dst_dtype, scratch, scratch_pitch, f.src_blocks,
                              f.width_elems, f.rows);
    return;
  }
  stream.cast_2d(dst, dst_pitch, f.dst_dtype, scratch, scratch_pitch, f.src_dtype, f.width_elems,
                 f.rows);
}

}  // namespace ferry::actors
