// The load plan: every checkpoint tensor routed before any byte of it is read, and
// the reads it needs as spans, which a WindowCutter cuts, lazily and in read order,
// into staging-buffer-sized windows with the copy pieces clipped to them. Plain C++
// (no actors, no files, no devices), so that the arithmetic the pipeline depends on
// is unit-tested on its own; the actors only walk the plan.
//
// The plan costs tensors, not bytes: it keeps one span per contiguous read range of
// a placed tensor and the tensor's pieces, never the windows themselves. The reader
// cuts each window just before it reads it, so at most the windows in flight (one
// per staging buffer) exist at once, whatever the checkpoint's size.
//
// From routes to windows:
//  - a placed tensor contributes its read spans: the smallest contiguous byte ranges
//    of its data that cover every piece of every local rank (each piece's extent,
//    merged where they overlap or touch: a row slice is its own range, so ranks 0
//    and 3 of a row-split tensor read two ranges; a column slice of a row-major
//    tensor spans nearly the whole tensor). Dropped and unmapped tensors contribute
//    nothing; their bytes are "skipped".
//  - spans are walked in file order and coalesced while they are adjacent in the
//    file, up to `chunk_bytes` per window; a span longer than the room left is split
//    across windows at an element boundary of its tensor (so a cast never sees half
//    an element). With `direct`, a split is moved down to a 4096-byte file offset
//    when that is also an element boundary, so the next window reads in place.
//  - each piece is clipped to every window it overlaps: the rows that lie wholly
//    inside become one 2-D fragment, a row cut by a window edge becomes a 1-D
//    fragment for its part (a row larger than a window is split within the row).
//    Fragments never overlap, and together they write exactly what the pieces do.
//    A window finds its pieces by binary search over its tensors' pieces (sorted by
//    source offset), so cutting every window costs O(spans + windows + fragments),
//    up to a log factor, never pieces x windows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/dtype.hpp"
#include "io/prefetch.hpp"
#include "io/safetensors.hpp"
#include "models/model.hpp"

namespace ferry::actors {

// A piece clipped to one window. The source is relative to the window's first byte
// (that is, to the staging buffer the window is read into); the destination is
// relative to the param's storage, as in models::Piece.
struct Fragment {
  std::uint32_t local_rank = 0;
  std::uint32_t param = 0;
  std::uint32_t tensor = 0;  // index into CheckpointIndex::tensors (for messages)
  std::uint64_t dst_offset = 0;
  std::uint64_t dst_pitch = 0;
  std::uint64_t src_offset = 0;
  std::uint64_t src_pitch = 0;
  std::uint64_t rows = 0;
  std::uint64_t width_elems = 0;
  DType src_dtype = DType::kBF16;
  DType dst_dtype = DType::kBF16;
  GgmlBlocks src_blocks = GgmlBlocks::kNone;  // as models::Piece::src_blocks

  std::uint64_t src_row_bytes() const {
    return src_blocks != GgmlBlocks::kNone ? ggml_row_bytes(src_blocks, width_elems)
                                           : width_elems * dtype_size(src_dtype);
  }
  std::uint64_t dst_row_bytes() const { return width_elems * dtype_size(dst_dtype); }
  std::uint64_t dst_bytes() const { return rows * dst_row_bytes(); }
  // One past the last source byte, relative to the window.
  std::uint64_t src_end() const {
    return rows == 0 ? src_offset : src_offset + (rows - 1) * src_pitch + src_row_bytes();
  }
  bool operator==(const Fragment&) const = default;
};

// One read into one staging buffer: bytes [offset, offset + nbytes) of one file.
struct Window {
  std::uint32_t index = 0;     // position in read order (0, 1, 2, ...)
  std::uint32_t file = 0;      // index into CheckpointIndex::files
  std::uint64_t offset = 0;    // absolute file offset
  std::uint64_t nbytes = 0;    // <= chunk_bytes
  std::uint64_t plan_end = 0;  // plan-byte position after this window (for the prefetcher)
  // Set by the reader: read straight into its one fragment's param, no staging.
  bool direct = false;
  std::uint32_t first_tensor = 0;         // tensors whose bytes it holds: [first, first + count)
  std::uint32_t tensor_count = 0;         //   (indices into CheckpointIndex::tensors)
  std::vector<Fragment> fragments;        // sorted by local rank
  std::vector<std::uint32_t> rank_begin;  // fragments of rank r: [rank_begin[r], rank_begin[r+1])

  bool has_rank(std::size_t rank) const { return rank_begin[rank] != rank_begin[rank + 1]; }
};

struct PlanOptions {
  std::size_t chunk_bytes = std::size_t{4} << 20;  // largest window (>= 4096)
  bool direct = false;  // O_DIRECT reads: prefer 4096-aligned window splits
};

// One contiguous read range of a placed tensor, absolute in its file.
struct Span {
  std::uint32_t file = 0;
  std::uint32_t tensor = 0;  // index into CheckpointIndex::tensors
  std::uint32_t route = 0;   // index into Plan::routes
  // Source element size (a GGML block's for a block tensor): windows split on its
  // multiples.
  std::uint32_t elem_bytes = 1;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t tensor_offset = 0;  // file offset of the tensor's first data byte
};

// A placed tensor's copy pieces (those with source bytes), sorted by source offset,
// with the running maximum of their source ends: the pieces that overlap a byte
// range are a contiguous run found by two binary searches.
// Unread bytes of placed tensors that only tp ranks outside the local ranks need: a
// key of Plan::bytes_skipped_by_reason beside the route reasons.
inline constexpr const char* kRemoteSlicesReason = "remote_slices";

struct PlannedRoute {
  std::vector<models::Piece> pieces;
  std::vector<std::uint64_t> end_max;  // end_max[i] = max(src_end of pieces[0..i])
};

struct Plan {
  std::size_t local_ranks = 0;
  PlanOptions options;
  // What the router decided, per checkpoint tensor.
  std::size_t placed = 0;
  std::size_t dropped = 0;
  std::size_t unmapped = 0;
  std::vector<std::string> unmapped_names;  // in checkpoint order
  std::uint64_t bytes_planned = 0;          // tensor bytes the windows read
  std::uint64_t bytes_skipped = 0;          // tensor bytes no window reads
  // bytes_skipped by why: the reason of each dropped or unmapped route
  // (models::Route::reason: all its bytes), and kRemoteSlicesReason. The values
  // add up to bytes_skipped (`ferry plan` prints them).
  std::map<std::string, std::uint64_t> bytes_skipped_by_reason;
  std::size_t pieces = 0;            // copy pieces of all routes (before clipping)
  std::vector<models::Piece> fills;  // zero pieces (models::Model::fill_pieces)
  std::vector<Span> spans;           // in read order: file order, then offset
  std::vector<PlannedRoute> routes;  // of the placed tensors
  std::size_t window_count = 0;      // windows a WindowCutter cuts from the spans
  // Plan-byte coordinate of each file's first byte (sizes of the earlier files).
  std::vector<std::uint64_t> file_plan_offset;
  std::uint64_t plan_bytes = 0;  // sum of the file sizes

  // Host memory this plan holds, counted from its containers (as
  // io::CheckpointIndex::bytes_owned): spans, routes and their pieces, fills.
  std::uint64_t bytes_owned() const;
};

// Cuts a plan's spans into windows, one at a time, in read order. The plan must
// outlive the cutter. Not thread-safe (the reader owns one).
class WindowCutter {
 public:
  explicit WindowCutter(const Plan& plan) : WindowCutter(plan, {0, plan.spans.size()}) {}
  // Only the spans [lane.first, lane.second): one read lane's share (lane_spans).
  WindowCutter(const Plan& plan, std::pair<std::size_t, std::size_t> lane)
      : plan_(plan), span_(lane.first), span_end_(lane.second) {}

  // The next window with its fragments, sorted by local rank; false after the last.
  bool next(Window& out);
  // The next window's extent only (file, offset, nbytes, tensors, plan_end), with
  // no fragments: how make_plan counts and checks the windows without keeping them.
  bool next_extent(Window& out);
  // (piece, window) pairs clipped so far: the cutting work, for tests.
  std::size_t clip_calls() const { return clip_calls_; }

 private:
  struct Segment {
    std::size_t span = 0;
    std::uint64_t begin = 0;
    std::uint64_t end = 0;
  };
  bool cut(Window& out, std::vector<Segment>* segments);

  const Plan& plan_;
  std::size_t span_ = 0;      // the span the next window starts in
  std::size_t span_end_ = 0;  // one past the last span this cutter cuts
  std::uint64_t pos_ = 0;     // and where in it (0 before the span is entered)
  bool entered_ = false;
  std::uint32_t cut_ = 0;  // windows cut so far
  std::size_t clip_calls_ = 0;
  std::vector<Segment> segments_;
};

// Routes every tensor of `index` with `model` and cuts the reads into windows.
// Throws what Model::route throws (Stage::kPlacement for a shape or dtype that does
// not fit its param, Stage::kMapping for an unknown name in strict mode), and
// Error(Stage::kMapping) naming the checkpoint folder and listing every param that
// neither a tensor, a fill nor a post-load hook would fill, before anything is read.
// Error(Stage::kConfig) for chunk_bytes < 4096.
Plan make_plan(const io::CheckpointIndex& index, const models::Model& model,
               const PlanOptions& options, const std::string& folder = {});

// Clips `piece` (of a tensor whose data starts at file offset `tensor_offset`) to
// the window [window_offset, window_offset + window_nbytes) and appends the
// fragments to `out`. Window edges inside the piece's rows must be element
// boundaries of the source dtype relative to the tensor start. Exposed for tests.
void clip_piece(const models::Piece& piece, std::uint64_t tensor_offset,
                std::uint64_t window_offset, std::uint64_t window_nbytes, std::uint32_t tensor,
                std::vector<Fragment>& out);

// Where a window is one contiguous run of bytes of one local rank's param: its
// fragments, in order, all of that param, with no cast, each contiguous in source
// and destination, following each other in both, from the window's first byte to
// its last. Then the window's bytes land unchanged at `dst_offset` of the param,
// and a read may go straight there (single-copy reads). A window cut inside rows
// has up to three such fragments (a row's tail, whole rows, a row's head).
struct ParamRun {
  std::uint32_t local_rank = 0;
  std::uint32_t param = 0;
  std::uint64_t dst_offset = 0;
};
std::optional<ParamRun> single_param_run(const Window& w);

// What a page-cache prefetch of `plan` reads: every file of the index, in order (so
// that plan byte positions agree with the reader's), each with its planned spans
// merged into ranges (adjacent ones joined); a file the plan does not read has none.
// With `lane`, only the spans [lane.first, lane.second) (one read lane's share).
std::vector<io::PrefetchFile> planned_prefetch_files(const Plan& plan,
                                                     const io::CheckpointIndex& index);
std::vector<io::PrefetchFile> planned_prefetch_files(const Plan& plan,
                                                     const io::CheckpointIndex& index,
                                                     std::pair<std::size_t, std::size_t> lane);

// Files the plan reads (those with at least one span).
std::size_t files_read(const Plan& plan);

// How the plan's spans are shared among at most `lanes` read lanes (each its own
// reader thread, ring and staging): contiguous runs of spans [first, second), in
// read order, of about equal bytes. When the plan reads at least `lanes` files, runs
// end at file boundaries (each lane takes whole files); otherwise at span
// boundaries (large spans of one file). No run is empty, so fewer than `lanes` come
// back when the plan has fewer spans (none for a plan with no spans). lanes >= 1.
std::vector<std::pair<std::size_t, std::size_t>> lane_spans(const Plan& plan, unsigned lanes);

// The plan-byte position where spans [lane.first, ...) start: a lane's prefetch
// begins there.
std::uint64_t lane_plan_begin(const Plan& plan, std::pair<std::size_t, std::size_t> lane);

}  // namespace ferry::actors
