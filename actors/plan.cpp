#include "actors/plan.hpp"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/format.hpp"
#include "io/file.hpp"
#include "models/coverage.hpp"

namespace ferry::actors {
namespace {

constexpr std::size_t kMaxNamesListed = 50;

// The smallest whole unit of a source row: an element, or a GGML block.
struct SourceUnit {
  std::uint64_t bytes = 0;
  std::uint64_t elems = 1;
};

SourceUnit source_unit(DType dtype, GgmlBlocks blocks) {
  const GgmlBlockShape shape = ggml_block_shape(blocks);
  return blocks != GgmlBlocks::kNone ? SourceUnit{shape.bytes, shape.elems}
                                     : SourceUnit{dtype_size(dtype), 1};
}

[[noreturn]] void internal(const std::string& rule) {
  throw Error(Stage::kPlacement, "", "", "internal: plan: " + rule);
}

// The smallest contiguous ranges of a tensor (relative to its data) that cover
// every piece: each piece's extent, merged where they overlap or touch. Ranks 0 and
// 3 of a row-split tensor give two ranges; a column slice (a pitched piece) spans
// from its first row's first byte to its last row's last byte.
std::vector<std::pair<std::uint64_t, std::uint64_t>> read_ranges(const models::Route& route) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> extents;
  for (const models::Piece& p : route.pieces) {
    if (p.kind == models::Piece::Kind::kCopy && p.src_end() > p.src_offset) {
      extents.emplace_back(p.src_offset, p.src_end());
    }
  }
  std::sort(extents.begin(), extents.end());
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const auto& e : extents) {
    if (!out.empty() && e.first <= out.back().second) {
      out.back().second = std::max(out.back().second, e.second);
    } else {
      out.push_back(e);
    }
  }
  return out;
}

}  // namespace

void clip_piece(const models::Piece& piece, std::uint64_t tensor_offset,
                std::uint64_t window_offset, std::uint64_t window_nbytes, std::uint32_t tensor,
                std::vector<Fragment>& out) {
  if (piece.kind != models::Piece::Kind::kCopy || piece.rows == 0 || piece.width_elems == 0 ||
      window_nbytes == 0) {
    return;
  }
  // A row is cut in whole source units: elements, or GGML blocks of `unit` elements.
  const SourceUnit source = source_unit(piece.src_dtype, piece.src_blocks);
  const std::uint64_t ses = source.bytes;
  const std::uint64_t unit = source.elems;
  const std::uint64_t des = dtype_size(piece.dst_dtype);
  const std::uint64_t rb = piece.src_row_bytes();
  const std::uint64_t pitch = piece.rows > 1 ? piece.src_pitch : rb;
  if (piece.rows > 1 && pitch < rb) {
    internal("piece source pitch " + std::to_string(pitch) + " is below its row bytes " +
             std::to_string(rb));
  }
  const std::uint64_t base = tensor_offset + piece.src_offset;  // absolute start of row 0
  const std::uint64_t w0 = window_offset;
  const std::uint64_t w1 = window_offset + window_nbytes;
  const std::uint64_t end = base + (piece.rows - 1) * pitch + rb;
  if (end <= w0 || base >= w1) {
    return;
  }
  std::uint64_t r_first = 0;
  if (w0 > base) {
    r_first = (w0 - base) / pitch;
    if (base + r_first * pitch + rb <= w0) {
      ++r_first;  // w0 falls in the gap after that row
    }
  }
  std::uint64_t r_last = std::min<std::uint64_t>(piece.rows - 1, (w1 - 1 - base) / pitch);
  if (r_first > r_last) {
    return;  // the window lies in a gap between two rows
  }
  auto row_start = [&](std::uint64_t r) { return base + r * pitch; };
  auto full = [&](std::uint64_t r) { return row_start(r) >= w0 && row_start(r) + rb <= w1; };
  auto fragment = [&](std::uint64_t src_abs, std::uint64_t dst, std::uint64_t rows,
                      std::uint64_t width, std::uint64_t src_pitch, std::uint64_t dst_pitch) {
    Fragment f;
    f.local_rank = static_cast<std::uint32_t>(piece.local_rank);
    f.param = static_cast<std::uint32_t>(piece.param);
    f.tensor = tensor;
    f.src_offset = src_abs - w0;
    f.dst_offset = dst;
    f.rows = rows;
    f.width_elems = width;
    f.src_pitch = src_pitch;
    f.dst_pitch = dst_pitch;
    f.src_dtype = piece.src_dtype;
    f.dst_dtype = piece.dst_dtype;
    f.src_blocks = piece.src_blocks;
    out.push_back(f);
  };
  // The part of row r inside the window, as a one-row fragment.
  auto partial = [&](std::uint64_t r) {
    const std::uint64_t a = row_start(r);
    const std::uint64_t lo = std::max(a, w0);
    const std::uint64_t hi = std::min(a + rb, w1);
    if ((lo - a) % ses != 0 || (hi - lo) % ses != 0) {
      internal("a window edge cuts an element of tensor #" + std::to_string(tensor));
    }
    const std::uint64_t width = (hi - lo) / ses * unit;
    fragment(lo, piece.dst_offset + r * piece.dst_pitch + (lo - a) / ses * unit * des, 1, width,
             hi - lo, width * des);
  };
  // Whole rows [m0, m1) as one (possibly 2-D) fragment.
  auto block = [&](std::uint64_t m0, std::uint64_t m1) {
    const std::uint64_t rows = m1 - m0;
    fragment(row_start(m0), piece.dst_offset + m0 * piece.dst_pitch, rows, piece.width_elems,
             rows > 1 ? pitch : rb, rows > 1 ? piece.dst_pitch : piece.width_elems * des);
  };
  if (r_first == r_last) {
    if (full(r_first)) {
      block(r_first, r_first + 1);
    } else {
      partial(r_first);
    }
    return;
  }
  std::uint64_t m0 = r_first;
  if (!full(r_first)) {
    partial(r_first);
    ++m0;
  }
  const bool tail_partial = !full(r_last);
  const std::uint64_t m1 = tail_partial ? r_last : r_last + 1;
  if (m1 > m0) {
    block(m0, m1);
  }
  if (tail_partial) {
    partial(r_last);
  }
}

bool WindowCutter::next(Window& out) {
  if (!cut(out, &segments_)) {
    return false;
  }
  // Every piece of each span's tensor that overlaps the window's part of the span.
  // A piece's source bytes lie inside one of its tensor's spans, so clipping it to
  // the whole window is clipping it to that part; and a window holds at most one
  // span of a tensor (a tensor's spans never touch, and a window is contiguous).
  for (const Segment& seg : segments_) {
    const Span& s = plan_.spans[seg.span];
    const PlannedRoute& route = plan_.routes[s.route];
    const std::uint64_t lo = seg.begin - s.tensor_offset;
    const std::uint64_t hi = seg.end - s.tensor_offset;
    auto first = std::partition_point(route.end_max.begin(), route.end_max.end(),
                                      [&](std::uint64_t e) { return e <= lo; });
    for (std::size_t i = static_cast<std::size_t>(first - route.end_max.begin());
         i < route.pieces.size() && route.pieces[i].src_offset < hi; ++i) {
      const models::Piece& p = route.pieces[i];
      if (p.src_end() <= lo) {
        continue;
      }
      clip_piece(p, s.tensor_offset, out.offset, out.nbytes, s.tensor, out.fragments);
      ++clip_calls_;
    }
  }
  std::stable_sort(
      out.fragments.begin(), out.fragments.end(),
      [](const Fragment& a, const Fragment& b) { return a.local_rank < b.local_rank; });
  out.rank_begin.assign(plan_.local_ranks + 1, 0);
  std::size_t f = 0;
  for (std::size_t r = 0; r < plan_.local_ranks; ++r) {
    while (f < out.fragments.size() && out.fragments[f].local_rank < r) {
      ++f;
    }
    out.rank_begin[r] = static_cast<std::uint32_t>(f);
  }
  out.rank_begin[plan_.local_ranks] = static_cast<std::uint32_t>(out.fragments.size());
  return true;
}

bool WindowCutter::next_extent(Window& out) {
  return cut(out, nullptr);
}

bool WindowCutter::cut(Window& out, std::vector<Segment>* segments) {
  out = Window{};
  if (segments != nullptr) {
    segments->clear();
  }
  const std::uint64_t chunk = plan_.options.chunk_bytes;
  bool open = false;
  while (span_ < span_end_) {
    const Span& s = plan_.spans[span_];
    if (!entered_) {
      pos_ = s.begin;
      entered_ = true;
    }
    if (open && (out.file != s.file || out.offset + out.nbytes != pos_ || out.nbytes >= chunk)) {
      break;  // not adjacent, or full: the next window starts here
    }
    if (!open) {
      out.file = s.file;
      out.offset = pos_;
      out.first_tensor = s.tensor;
      open = true;
    }
    std::uint64_t take = std::min(s.end, pos_ + (chunk - out.nbytes));
    if (take < s.end) {
      // Split inside this tensor: at an element boundary, 4096-aligned if direct.
      const std::uint64_t es = s.elem_bytes;
      take = s.tensor_offset + (take - s.tensor_offset) / es * es;
      if (plan_.options.direct) {
        const std::uint64_t aligned = take / io::kDirectAlignment * io::kDirectAlignment;
        if (aligned > pos_ && (aligned - s.tensor_offset) % es == 0) {
          take = aligned;
        }
      }
      if (take <= pos_) {
        if (out.nbytes == 0) {
          internal("a window of " + std::to_string(chunk) + " bytes cannot hold one element");
        }
        break;  // no room for one element here: the next window starts with it
      }
    }
    if (segments != nullptr) {
      segments->push_back({span_, pos_, take});
    }
    out.nbytes += take - pos_;
    out.tensor_count = s.tensor - out.first_tensor + 1;
    pos_ = take;
    if (take < s.end) {
      break;  // split: this window is full
    }
    ++span_;
    entered_ = false;
  }
  if (!open) {
    return false;
  }
  out.index = cut_++;
  out.plan_end = plan_.file_plan_offset[out.file] + out.offset + out.nbytes;
  return true;
}

Plan make_plan(const io::CheckpointIndex& index, const models::Model& model,
               const PlanOptions& options, const std::string& folder) {
  if (options.chunk_bytes < io::kDirectAlignment) {
    throw Error(Stage::kConfig, "", "",
                "io.chunk_bytes must be at least " + std::to_string(io::kDirectAlignment) +
                    ", got " + std::to_string(options.chunk_bytes));
  }
  Plan plan;
  plan.local_ranks = model.shells().size();
  plan.options = options;
  for (const io::CheckpointFile& f : index.files) {
    plan.file_plan_offset.push_back(plan.plan_bytes);
    plan.plan_bytes += f.size;
  }

  // Route every tensor before reading anything.
  std::uint64_t remote_slices = 0;  // unread bytes of placed tensors
  std::vector<models::Route> routes;
  std::vector<std::uint32_t> route_tensor;  // each route's tensor, for error messages
  for (std::size_t i = 0; i < index.tensors.size(); ++i) {
    const io::TensorInfo& t = index.tensors[i];
    models::Route route = model.route(t);
    switch (route.kind) {
      case models::RouteKind::kPlaced: {
        ++plan.placed;
        plan.pieces += route.pieces.size();
        std::uint64_t read = 0;
        for (const auto& [begin, end] : read_ranges(route)) {
          read += end - begin;
          Span s;
          s.file = t.file_index;
          s.tensor = static_cast<std::uint32_t>(i);
          s.route = static_cast<std::uint32_t>(routes.size());
          s.elem_bytes = static_cast<std::uint32_t>(source_unit(t.dtype, t.blocks).bytes);
          s.begin = t.offset + begin;
          s.end = t.offset + end;
          s.tensor_offset = t.offset;
          plan.bytes_planned += end - begin;
          plan.spans.push_back(s);
        }
        remote_slices += t.nbytes - read;
        routes.push_back(std::move(route));
        route_tensor.push_back(static_cast<std::uint32_t>(i));
        break;
      }
      case models::RouteKind::kDropped:
        ++plan.dropped;
        plan.bytes_skipped_by_reason[route.reason] += t.nbytes;
        break;
      case models::RouteKind::kUnmapped:
        ++plan.unmapped;
        plan.unmapped_names.push_back(t.name);
        plan.bytes_skipped_by_reason[route.reason] += t.nbytes;
        break;
    }
  }
  plan.bytes_skipped =
      index.total_bytes >= plan.bytes_planned ? index.total_bytes - plan.bytes_planned : 0;
  if (remote_slices > 0) {
    plan.bytes_skipped_by_reason[kRemoteSlicesReason] = remote_slices;
  }

  // An unfillable param fails now, before a byte of tensor data is read; so does a
  // byte written twice or outside its param (a family's bug).
  std::vector<models::CoverageGap> gaps = models::check_coverage(
      model, routes, [&](std::size_t route) { return index.tensors[route_tensor[route]].name; });
  if (!gaps.empty()) {
    std::vector<std::string> names = models::gap_names(gaps);
    throw Error(Stage::kMapping, folder, "",
                std::to_string(names.size()) +
                    " parameter(s) that neither the checkpoint nor a post-load hook fills: " +
                    join_first(names, kMaxNamesListed));
  }
  plan.fills = model.fill_pieces();

  // Keep each route's copy pieces, sorted by source offset for the cutter's search.
  plan.routes.reserve(routes.size());
  for (models::Route& route : routes) {
    PlannedRoute& pr = plan.routes.emplace_back();
    for (const models::Piece& p : route.pieces) {
      if (p.kind == models::Piece::Kind::kCopy && p.src_end() > p.src_offset) {
        pr.pieces.push_back(p);  // trivially copyable
      }
    }
    std::stable_sort(
        pr.pieces.begin(), pr.pieces.end(),
        [](const models::Piece& a, const models::Piece& b) { return a.src_offset < b.src_offset; });
    std::uint64_t running = 0;
    for (const models::Piece& p : pr.pieces) {
      running = std::max(running, p.src_end());
      pr.end_max.push_back(running);
    }
  }
  routes.clear();
  std::sort(plan.spans.begin(), plan.spans.end(), [](const Span& a, const Span& b) {
    return a.file != b.file ? a.file < b.file : a.begin < b.begin;
  });
  // Count the windows (and meet a window too small for one element now, not in the
  // reader): their extents only, O(windows) time and no memory.
  WindowCutter counter(plan);
  Window w;
  while (counter.next_extent(w)) {
    ++plan.window_count;
  }
  return plan;
}

std::vector<io::PrefetchFile> planned_prefetch_files(const Plan& plan,
                                                     const io::CheckpointIndex& index) {
  return planned_prefetch_files(plan, index, {0, plan.spans.size()});
}

std::vector<io::PrefetchFile> planned_prefetch_files(const Plan& plan,
                                                     const io::CheckpointIndex& index,
                                                     std::pair<std::size_t, std::size_t> lane) {
  std::vector<io::PrefetchFile> out;
  for (const io::CheckpointFile& f : index.files) {
    out.push_back(io::PrefetchFile{f.path, f.name, f.size,
                                   std::vector<std::pair<std::uint64_t, std::uint64_t>>{}, f.file});
  }
  for (std::size_t i = lane.first; i < lane.second && i < plan.spans.size(); ++i) {
    const Span& span = plan.spans[i];  // sorted by file, then begin
    auto& ranges = *out.at(span.file).ranges;
    if (!ranges.empty() && span.begin <= ranges.back().second) {
      ranges.back().second = std::max(ranges.back().second, span.end);
    } else if (span.end > span.begin) {
      ranges.emplace_back(span.begin, span.end);
    }
  }
  return out;
}

}  // namespace ferry::actors

namespace ferry::actors {

std::optional<ParamRun> single_param_run(const Window& w) {
  if (w.fragments.empty()) {
    return std::nullopt;
  }
  const Fragment& first = w.fragments.front();
  std::uint64_t src = 0;
  std::uint64_t dst = first.dst_offset;
  for (const Fragment& f : w.fragments) {
    const bool contiguous =
        f.rows == 1 || (f.src_pitch == f.src_row_bytes() && f.dst_pitch == f.dst_row_bytes());
    if (f.local_rank != first.local_rank || f.param != first.param || f.src_dtype != f.dst_dtype ||
        f.src_blocks != GgmlBlocks::kNone || !contiguous || f.src_offset != src ||
        f.dst_offset != dst) {
      return std::nullopt;
    }
    src += f.rows * f.src_row_bytes();
    dst += f.dst_bytes();
  }
  if (src != w.nbytes) {
    return std::nullopt;
  }
  return ParamRun{first.local_rank, first.param, first.dst_offset};
}

std::size_t files_read(const Plan& plan) {
  std::size_t files = 0;  // spans are sorted by file
  for (std::size_t i = 0; i < plan.spans.size(); ++i) {
    files += (i == 0 || plan.spans[i].file != plan.spans[i - 1].file) ? 1 : 0;
  }
  return files;
}

std::vector<std::pair<std::size_t, std::size_t>> lane_spans(const Plan& plan, unsigned lanes) {
  const std::size_t n = plan.spans.size();
  std::vector<std::pair<std::size_t, std::size_t>> out;
  if (n == 0) {
    return out;
  }
  lanes = std::max(1u, lanes);
  // Cumulative bytes before each span.
  std::vector<std::uint64_t> before(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) {
    before[i + 1] = before[i] + (plan.spans[i].end - plan.spans[i].begin);
  }
  const bool whole_files = files_read(plan) >= lanes;
  auto is_cut = [&](std::size_t i) {
    return i > 0 && i < n && (!whole_files || plan.spans[i].file != plan.spans[i - 1].file);
  };
  std::size_t begin = 0;
  for (unsigned k = 1; k < lanes && begin < n; ++k) {
    // The allowed boundary after `begin` nearest to k/lanes of the bytes.
    const std::uint64_t target = before[n] / lanes * k;
    std::size_t best = n;
    std::uint64_t best_distance = ~std::uint64_t{0};
    for (std::size_t i = begin + 1; i < n; ++i) {
      if (!is_cut(i)) {
        continue;
      }
      const std::uint64_t d = before[i] > target ? before[i] - target : target - before[i];
      if (d < best_distance) {
        best = i;
        best_distance = d;
      }
      if (before[i] >= target) {
        break;  // later boundaries are only farther
      }
    }
    if (best == n) {
      break;
    }
    out.emplace_back(begin, best);
    begin = best;
  }
  out.emplace_back(begin, n);
  return out;
}

std::uint64_t lane_plan_begin(const Plan& plan, std::pair<std::size_t, std::size_t> lane) {
  if (lane.first >= plan.spans.size()) {
    return plan.plan_bytes;
  }
  const Span& s = plan.spans[lane.first];
  return plan.file_plan_offset.at(s.file) + s.begin;
}

std::uint64_t Plan::bytes_owned() const {
  std::uint64_t n = spans.capacity() * sizeof(Span) + routes.capacity() * sizeof(PlannedRoute) +
                    fills.capacity() * sizeof(models::Piece) +
                    file_plan_offset.capacity() * sizeof(std::uint64_t);
  for (const PlannedRoute& r : routes) {
    n += r.pieces.capacity() * sizeof(models::Piece) + r.end_max.capacity() * sizeof(std::uint64_t);
  }
  for (const std::string& name : unmapped_names) {
    n += sizeof(std::string) + (name.capacity() > 15 ? name.capacity() + 1 : 0);
  }
  for (const auto& [reason, bytes] : bytes_skipped_by_reason) {
    n += 64 + reason.capacity();
  }
  return n;
}

}  // namespace ferry::actors
