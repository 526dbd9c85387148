// The load plan: windows, coalescing, splitting and clipped fragments. A naive
// executor applies a plan's fragments to host buffers and must produce exactly what
// the unsplit route pieces produce, each param byte written once.
#include "actors/plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/discover.hpp"
#include "io/safetensors.hpp"
#include "models/model.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::actors {
namespace {

using models::Piece;
using testing::TempDir;

// ---- naive executors ---------------------------------------------------------

float bf16_to_float(const std::byte* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  std::uint32_t f = static_cast<std::uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

// Writes one element: a byte copy, or BF16 -> F32 (the only cast these tests use).
void put(std::byte* dst, DType dd, const std::byte* src, DType sd) {
  if (dd == sd) {
    std::memcpy(dst, src, dtype_size(dd));
  } else {
    ASSERT_EQ(sd, DType::kBF16);
    ASSERT_EQ(dd, DType::kF32);
    float v = bf16_to_float(src);
    std::memcpy(dst, &v, 4);
  }
}

// Applies a fragment or piece element by element; counts writes per dst byte.
template <class P>
void apply(const P& p, const std::byte* src, std::vector<std::byte>& dst,
           std::vector<int>& writes) {
  const std::size_t ses = dtype_size(p.src_dtype);
  const std::size_t des = dtype_size(p.dst_dtype);
  const GgmlBlockShape block = ggml_block_shape(p.src_blocks);
  for (std::uint64_t r = 0; r < p.rows; ++r) {
    for (std::uint64_t e = 0; e < p.width_elems; ++e) {
      std::uint64_t d = p.dst_offset + r * p.dst_pitch + e * des;
      ASSERT_LE(d + des, dst.size());
      const std::byte* row = src + p.src_offset + r * p.src_pitch;
      if (p.src_blocks != GgmlBlocks::kNone) {  // GGML blocks, dequantized to F32
        ASSERT_EQ(p.dst_dtype, DType::kF32);
        const float v = ggml_block_element(
            p.src_blocks,
            reinterpret_cast<const unsigned char*>(row + e / block.elems * block.bytes),
            static_cast<unsigned>(e % block.elems));
        std::memcpy(dst.data() + d, &v, 4);
      } else {
        put(dst.data() + d, p.dst_dtype, row + e * ses, p.src_dtype);
      }
      for (std::size_t b = 0; b < des; ++b) {
        ++writes[d + b];
      }
    }
  }
}

// ---- clip_piece -------------------------------------------------------------------

// A [6, 10] BF16 tensor at file offset 100; the piece takes columns [6, 10) of
// every row into a [6, 4] param.
Piece column_piece() {
  Piece p;
  p.rows = 6;
  p.width_elems = 4;
  p.src_offset = 6 * 2;
  p.src_pitch = 10 * 2;
  p.dst_offset = 0;
  p.dst_pitch = 4 * 2;
  return p;
}

std::vector<std::byte> pattern(std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = static_cast<std::byte>((i * 7 + 3) & 0xff);
  }
  return v;
}

// Cuts [base, base + size) at `cuts` (file offsets) and checks the fragments
// reproduce the piece exactly.
void check_cuts(const Piece& piece, std::uint64_t base, std::uint64_t size,
                std::vector<std::uint64_t> cuts, std::size_t dst_bytes) {
  std::vector<std::byte> file = pattern(base + size);
  std::vector<std::byte> want(dst_bytes), got(dst_bytes);
  std::vector<int> want_w(dst_bytes), got_w(dst_bytes);
  apply(piece, file.data() + base, want, want_w);
  cuts.insert(cuts.begin(), base);
  cuts.push_back(base + size);
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
    std::vector<Fragment> frags;
    clip_piece(piece, base, cuts[i], cuts[i + 1] - cuts[i], 0, frags);
    for (const Fragment& f : frags) {
      EXPECT_LE(f.src_end(), cuts[i + 1] - cuts[i]);
      apply(f, file.data() + cuts[i], got, got_w);
    }
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(got_w, want_w);
}

TEST(ClipPiece, EveryTwoWaySplitOfAColumnSlice) {
  const Piece p = column_piece();
  for (std::uint64_t cut = 100; cut <= 220; cut += 2) {
    SCOPED_TRACE(cut);
    check_cuts(p, 100, 120, {cut}, 48);
  }
}

// Columns [64, 128) of a [6, 128] Q8_0 tensor (4 blocks of 34 bytes a row) into a
// [6, 64] F32 param: every window edge on a block boundary (where plan's windows
// cut a block tensor) gives fragments of whole blocks that rebuild the piece.
TEST(ClipPiece, EverySplitOfAGgmlBlockSliceOnBlockBoundaries) {
  Piece p;
  p.src_dtype = p.dst_dtype = DType::kF32;
  p.src_blocks = GgmlBlocks::kQ8_0;
  p.rows = 6;
  p.width_elems = 64;
  p.src_offset = 2 * 34;
  p.src_pitch = 4 * 34;
  p.dst_pitch = 64 * 4;
  for (std::uint64_t cut = 100; cut <= 100 + 6 * 136; cut += 34) {
    SCOPED_TRACE(cut);
    check_cuts(p, 100, 6 * 136, {cut}, 6 * 64 * 4);
  }
  check_cuts(p, 100, 6 * 136, {100 + 34, 100 + 3 * 34, 100 + 7 * 34, 100 + 20 * 34}, 6 * 64 * 4);
}

TEST(ClipPiece, RandomMultiWaySplits) {
  std::mt19937 rng(5);
  const Piece p = column_piece();
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::uint64_t> cuts;
    for (std::uint64_t c = 100; c < 220; c += 2) {
      if (rng() % 5 == 0) {
        cuts.push_back(c);
      }
    }
    check_cuts(p, 100, 120, cuts, 48);
  }
}

TEST(ClipPiece, OneRowLargerThanAWindowAndCasts) {
  Piece p;
  p.rows = 1;
  p.width_elems = 40;
  p.src_offset = 4;
  p.src_pitch = 80;
  p.dst_offset = 8;
  p.dst_pitch = 160;
  p.src_dtype = DType::kBF16;
  p.dst_dtype = DType::kF32;
  check_cuts(p, 0, 84, {10, 20, 22, 60}, 168);
}

TEST(ClipPiece, WindowInAGapBetweenRowsHasNoFragment) {
  const Piece p = column_piece();
  std::vector<Fragment> frags;
  // Row 0 covers file [112, 120), row 1 [132, 140): [120, 132) holds no piece byte.
  clip_piece(p, 100, 120, 12, 0, frags);
  EXPECT_TRUE(frags.empty());
  clip_piece(p, 100, 0, 100, 0, frags);   // before the tensor
  clip_piece(p, 100, 220, 50, 0, frags);  // after it
  EXPECT_TRUE(frags.empty());
  clip_piece(p, 100, 100, 120, 7, frags);  // the whole tensor: one 2-D fragment
  ASSERT_EQ(frags.size(), 1u);
  EXPECT_EQ(frags[0].rows, 6u);
  EXPECT_EQ(frags[0].src_offset, 12u);
  EXPECT_EQ(frags[0].tensor, 7u);
}

// ---- make_plan over a real checkpoint ----------------------------------------------

struct Loaded {
  io::CheckpointIndex index;
  std::unique_ptr<models::Model> model;
};

Loaded open(const std::string& dir, int tp, std::vector<int> ranks,
            std::optional<DType> dtype = std::nullopt, bool strict = false) {
  Loaded l;
  l.index = io::build_checkpoint_index(io::resolve_source(dir));
  nlohmann::json config = nlohmann::json::parse(testing::read_file(dir + "/config.json"));
  models::ParallelLayout layout;
  layout.tp = tp;
  layout.local_ranks = std::move(ranks);
  l.model = models::make_model(config, layout, {.dtype = dtype, .strict = strict});
  return l;
}

// Every window of `plan`, cut in read order (the reader cuts them one at a time).
std::vector<Window> cut_all(const Plan& plan, std::size_t* clip_calls = nullptr) {
  WindowCutter cutter(plan);
  std::vector<Window> out;
  Window w;
  while (cutter.next(w)) {
    EXPECT_EQ(w.index, out.size());
    out.push_back(std::move(w));
  }
  EXPECT_EQ(out.size(), plan.window_count);
  if (clip_calls != nullptr) {
    *clip_calls = cutter.clip_calls();
  }
  return out;
}

// Executes the plan's windows and, separately, the unsplit pieces of every route,
// straight from the files' bytes; both must agree and write each byte once.
void check_plan(const Loaded& l, const PlanOptions& options) {
  const Plan plan = make_plan(l.index, *l.model, options);
  const auto& shells = l.model->shells();
  std::vector<std::string> files;
  for (const io::CheckpointFile& f : l.index.files) {
    files.push_back(testing::read_file(f.path));
  }
  auto fresh = [&] {
    std::vector<std::vector<std::vector<std::byte>>> out;
    for (const auto& s : shells) {
      out.emplace_back();
      for (const auto& p : s.params) {
        out.back().emplace_back(p.nbytes);
      }
    }
    return out;
  };
  auto fresh_counts = [&] {
    std::vector<std::vector<std::vector<int>>> out;
    for (const auto& s : shells) {
      out.emplace_back();
      for (const auto& p : s.params) {
        out.back().emplace_back(p.nbytes, 0);
      }
    }
    return out;
  };
  auto want = fresh(), got = fresh();
  auto want_w = fresh_counts(), got_w = fresh_counts();
  for (const io::TensorInfo& t : l.index.tensors) {
    models::Route route = l.model->route(t);
    const auto* src = reinterpret_cast<const std::byte*>(files[t.file_index].data()) + t.offset;
    for (const Piece& p : route.pieces) {
      apply(p, src, want[p.local_rank][p.param], want_w[p.local_rank][p.param]);
    }
  }
  std::uint64_t read = 0;
  std::vector<std::uint64_t> last_end(files.size(), 0);
  for (const Window& w : cut_all(plan)) {
    EXPECT_EQ(w.plan_end, plan.file_plan_offset[w.file] + w.offset + w.nbytes);
    EXPECT_LE(w.nbytes, options.chunk_bytes);
    EXPECT_GT(w.nbytes, 0u);
    EXPECT_GE(w.offset, last_end[w.file]) << "windows overlap or go backwards";
    last_end[w.file] = w.offset + w.nbytes;
    read += w.nbytes;
    ASSERT_EQ(w.rank_begin.size(), shells.size() + 1);
    EXPECT_FALSE(w.fragments.empty());
    const auto* src = reinterpret_cast<const std::byte*>(files[w.file].data()) + w.offset;
    for (std::size_t r = 0; r < shells.size(); ++r) {
      for (std::uint32_t i = w.rank_begin[r]; i < w.rank_begin[r + 1]; ++i) {
        const Fragment& f = w.fragments[i];
        EXPECT_EQ(f.local_rank, r);
        EXPECT_LE(f.src_end(), w.nbytes);
        apply(f, src, got[r][f.param], got_w[r][f.param]);
      }
    }
  }
  EXPECT_EQ(read, plan.bytes_planned);
  EXPECT_EQ(plan.bytes_planned + plan.bytes_skipped, l.index.total_bytes);
  for (const Piece& p : plan.fills) {
    std::vector<std::byte> zeros(p.src_end() + p.dst_bytes() + 1, std::byte{0});
    apply(p, zeros.data(), want[p.local_rank][p.param], want_w[p.local_rank][p.param]);
  }
  for (std::size_t r = 0; r < shells.size(); ++r) {
    for (std::size_t i = 0; i < shells[r].params.size(); ++i) {
      const std::string& name = shells[r].params[i].name;
      EXPECT_EQ(got[r][i], want[r][i]) << name;
      // Fragments + fills write every byte exactly once.
      std::vector<int> total = got_w[r][i];
      for (const Piece& p : plan.fills) {
        if (p.local_rank == r && p.param == i) {
          for (std::uint64_t b = p.dst_offset; b < p.dst_offset + p.dst_bytes(); ++b) {
            ++total[b];
          }
        }
      }
      EXPECT_EQ(total, std::vector<int>(total.size(), 1)) << name;
    }
  }
}

class PlanTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    for (const char* family : {"llama", "qwen2"}) {
      testing::synth_checkpoint(dir_->file(family), family);
    }
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string ck(const char* family) { return dir_->file(family); }
  static TempDir* dir_;
};
TempDir* PlanTest::dir_ = nullptr;

TEST_F(PlanTest, WindowsReproduceThePiecesForEveryChunkSize) {
  Loaded l = open(ck("llama"), 4, {});
  for (std::size_t chunk :
       {std::size_t{4096}, std::size_t{4100}, std::size_t{65536}, std::size_t{1} << 22}) {
    SCOPED_TRACE(chunk);
    check_plan(l, {chunk, false});
    check_plan(l, {chunk, true});
  }
}

TEST_F(PlanTest, ClippingVisitsOnlyTheWindowsEachPieceOverlaps) {
  // With every rank local and 4 KiB windows, a row-split tensor (embed_tokens,
  // q/k/v, gate/up) spans many windows and is cut into tp pieces that each overlap
  // only a few of them. Clipping every piece against every window of its tensor
  // cost pieces x windows; visiting only the windows a piece overlaps makes every
  // visit produce a fragment, so the work is bounded by the plan's own size.
  for (int tp : {2, 8}) {
    SCOPED_TRACE(tp);
    Loaded l = open(ck("llama"), tp, {});
    const Plan plan = make_plan(l.index, *l.model, {4096, false});
    std::size_t clip_calls = 0;
    std::size_t fragments = 0;
    for (const Window& w : cut_all(plan, &clip_calls)) {
      fragments += w.fragments.size();
    }
    EXPECT_GT(clip_calls, 0u);
    EXPECT_LE(clip_calls, fragments);
    check_plan(l, {4096, false});
  }
}

TEST_F(PlanTest, ThePlanHoldsSpansAndPiecesWhateverTheChunkSize) {
  // The plan is the same size for 4 KiB and 4 MiB windows: spans and pieces, one
  // set per tensor; only the count of windows the reader will cut differs.
  Loaded l = open(ck("llama"), 4, {});
  const Plan small = make_plan(l.index, *l.model, {4096, false});
  const Plan large = make_plan(l.index, *l.model, {std::size_t{4} << 20, false});
  EXPECT_EQ(small.spans.size(), large.spans.size());
  EXPECT_EQ(small.routes.size(), large.routes.size());
  EXPECT_EQ(small.routes.size(), l.index.tensors.size());
  // All ranks local: each tensor is read whole, in one span.
  EXPECT_EQ(small.spans.size(), l.index.tensors.size());
  EXPECT_EQ(large.window_count, l.index.files.size());
  EXPECT_GT(small.window_count, 20 * large.window_count);
  std::size_t route_pieces = 0;
  for (const PlannedRoute& r : small.routes) {
    route_pieces += r.pieces.size();
    EXPECT_EQ(r.end_max.size(), r.pieces.size());
    EXPECT_TRUE(std::is_sorted(r.end_max.begin(), r.end_max.end()));
  }
  EXPECT_EQ(route_pieces, small.pieces);
}

TEST_F(PlanTest, SubsetsCastsAndBiases) {
  check_plan(open(ck("qwen2"), 8, {6}), {4096, false});
  check_plan(open(ck("qwen2"), 8, {}, DType::kF32), {8192, false});
  check_plan(open(ck("llama"), 2, {1}, DType::kF32), {4096, true});
}

TEST_F(PlanTest, CoalescesAdjacentTensorsAndReadsEachByteOnce) {
  Loaded l = open(ck("llama"), 4, {});
  Plan plan = make_plan(l.index, *l.model, {std::size_t{4} << 20, false});
  // All ranks local: every tensor byte is read, once, one window per file.
  EXPECT_EQ(plan.bytes_skipped, 0u);
  EXPECT_EQ(plan.bytes_planned, l.index.total_bytes);
  const std::vector<Window> windows = cut_all(plan);
  EXPECT_EQ(windows.size(), l.index.files.size());
  EXPECT_EQ(plan.placed, l.index.tensors.size());
  EXPECT_EQ(windows[0].first_tensor, 0u);
  EXPECT_EQ(windows[0].tensor_count, l.index.files[0].tensor_count);
}

TEST_F(PlanTest, OneRankReadsRowSlicesButWholeColumnSlicedTensors) {
  Loaded l = open(ck("llama"), 4, {2});
  Plan plan = make_plan(l.index, *l.model, {std::size_t{4} << 20, false});
  EXPECT_GT(plan.bytes_skipped, 0u);
  const io::TensorInfo* embed = l.index.find("model.embed_tokens.weight");
  const io::TensorInfo* o_proj = l.index.find("model.layers.0.self_attn.o_proj.weight");
  ASSERT_NE(embed, nullptr);
  ASSERT_NE(o_proj, nullptr);
  std::uint64_t embed_read = 0;
  std::uint64_t o_read = 0;
  for (const Window& w : cut_all(plan)) {
    auto overlap = [&](const io::TensorInfo& t) {
      if (w.file != t.file_index) {
        return std::uint64_t{0};
      }
      std::uint64_t a = std::max(w.offset, t.offset);
      std::uint64_t b = std::min(w.offset + w.nbytes, t.offset + t.nbytes);
      return b > a ? b - a : 0;
    };
    embed_read += overlap(*embed);
    o_read += overlap(*o_proj);
  }
  // Rank 2 of 4 keeps vocabulary rows [512, 768) of 1000 (padded 1024): 256 rows.
  EXPECT_EQ(embed_read, 256u * 128 * 2);
  // o_proj [128, 128] is split by columns (rank 2: columns [64, 96)): the range
  // from row 0 column 64 to row 127 column 96 is read, all but the ends.
  EXPECT_EQ(o_read, (127u * 128 + 32) * 2);
}

TEST_F(PlanTest, RanksZeroAndThreeReadTwoRangesOfARowSplitTensor) {
  Loaded l = open(ck("llama"), 4, {0, 3});
  check_plan(l, {4096, false});
  Plan plan = make_plan(l.index, *l.model, {std::size_t{4} << 20, false});
  const io::TensorInfo* embed = l.index.find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;  // tensor-relative
  for (const Window& w : cut_all(plan)) {
    if (w.file != embed->file_index) {
      continue;
    }
    std::uint64_t a = std::max(w.offset, embed->offset);
    std::uint64_t b = std::min(w.offset + w.nbytes, embed->offset + embed->nbytes);
    if (b > a) {
      ranges.emplace_back(a - embed->offset, b - embed->offset);
    }
  }
  // Rank 0 keeps rows [0, 256), rank 3 rows [768, 1000) (padded to 1024): rows
  // [256, 768) are never read.
  const std::uint64_t row = 128 * 2;
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0], std::make_pair(std::uint64_t{0}, 256 * row));
  EXPECT_EQ(ranges[1], std::make_pair(768 * row, 1000 * row));
}

TEST_F(PlanTest, DirectSplitsInsideTensorsAre4096Aligned) {
  Loaded l = open(ck("llama"), 2, {});
  Plan plan = make_plan(l.index, *l.model, {8192, true});
  std::size_t inside = 0;
  for (const Window& w : cut_all(plan)) {
    for (const io::TensorInfo& t : l.index.tensors) {
      if (t.file_index == w.file && w.offset > t.offset && w.offset < t.offset + t.nbytes) {
        EXPECT_EQ(w.offset % 4096, 0u) << "window at " << w.offset << " inside " << t.name;
        ++inside;
      }
    }
  }
  EXPECT_GT(inside, 10u);
}

TEST_F(PlanTest, ReadLanesShareTheSpansInOrderAndCutTheSameBytes) {
  TempDir sharded;
  testing::synth_checkpoint(sharded.file("ck"), "llama", false, 1, 96 * 1024);  // several files
  for (const std::string& dir : {ck("llama"), sharded.file("ck")}) {
    for (int tp : {1, 2}) {
      Loaded l = open(dir, tp, {});
      const Plan plan = make_plan(l.index, *l.model, {16384, false});
      std::size_t files = 0;
      std::uint64_t biggest_span = 0;
      for (std::size_t i = 0; i < plan.spans.size(); ++i) {
        files += (i == 0 || plan.spans[i].file != plan.spans[i - 1].file) ? 1 : 0;
        biggest_span = std::max(biggest_span, plan.spans[i].end - plan.spans[i].begin);
      }
      std::uint64_t all_fragment_bytes = 0;
      for (const Window& w : cut_all(plan)) {
        for (const Fragment& f : w.fragments) {
          all_fragment_bytes += f.dst_bytes();
        }
      }
      for (unsigned lanes = 1; lanes <= 6; ++lanes) {
        SCOPED_TRACE(dir + " tp " + std::to_string(tp) + " lanes " + std::to_string(lanes));
        const auto runs = lane_spans(plan, lanes);
        ASSERT_FALSE(runs.empty());
        EXPECT_LE(runs.size(), lanes);
        EXPECT_EQ(runs.size(), std::min<std::size_t>(lanes, files >= lanes ? lanes : runs.size()));
        EXPECT_EQ(runs.front().first, 0u);
        EXPECT_EQ(runs.back().second, plan.spans.size());
        std::uint64_t read = 0, fragment_bytes = 0, prefetched = 0, largest = 0;
        for (std::size_t k = 0; k < runs.size(); ++k) {
          const auto [begin, end] = runs[k];
          EXPECT_LT(begin, end) << "an empty lane";
          if (k > 0) {
            EXPECT_EQ(begin, runs[k - 1].second) << "lanes must be contiguous";
            if (files >= lanes) {
              EXPECT_NE(plan.spans[begin].file, plan.spans[begin - 1].file)
                  << "with enough files each lane takes whole files";
            }
          }
          EXPECT_EQ(lane_plan_begin(plan, runs[k]),
                    plan.file_plan_offset[plan.spans[begin].file] + plan.spans[begin].begin);
          std::uint64_t lane_bytes = 0;
          for (std::size_t i = begin; i < end; ++i) {
            lane_bytes += plan.spans[i].end - plan.spans[i].begin;
          }
          largest = std::max(largest, lane_bytes);
          WindowCutter cutter(plan, runs[k]);
          Window w;
          std::uint64_t last = 0;
          while (cutter.next(w)) {
            EXPECT_GE(w.plan_end, last);  // in read order within the lane
            last = w.plan_end;
            read += w.nbytes;
            for (const Fragment& f : w.fragments) {
              fragment_bytes += f.dst_bytes();
            }
          }
          for (const io::PrefetchFile& f : planned_prefetch_files(plan, l.index, runs[k])) {
            for (const auto& [b, e] : *f.ranges) {
              prefetched += e - b;
            }
          }
        }
        EXPECT_EQ(read, plan.bytes_planned);
        EXPECT_EQ(fragment_bytes, all_fragment_bytes);
        EXPECT_EQ(prefetched, plan.bytes_planned);
        if (files < lanes) {
          // Cut at span boundaries: no lane exceeds its share by more than a span.
          EXPECT_LE(largest, plan.bytes_planned / runs.size() + biggest_span);
        }
      }
    }
  }
  Plan empty;
  EXPECT_TRUE(lane_spans(empty, 4).empty());
}

TEST_F(PlanTest, ASingleParamRunLandsTheWindowUnchangedWhereItsFragmentsWould) {
  for (int tp : {1, 2}) {
    for (const char* family : {"llama", "qwen2"}) {
      for (std::size_t chunk : {std::size_t{4096}, std::size_t{16384}, std::size_t{1} << 20}) {
        SCOPED_TRACE(std::string(family) + " tp " + std::to_string(tp) + " chunk " +
                     std::to_string(chunk));
        Loaded l = open(ck(family), tp, {});
        const Plan plan = make_plan(l.index, *l.model, {chunk, false});
        std::vector<std::string> files;
        for (const io::CheckpointFile& f : l.index.files) {
          files.push_back(testing::read_file(f.path));
        }
        std::size_t runs = 0, windows = 0;
        for (const Window& w : cut_all(plan)) {
          ++windows;
          const std::optional<ParamRun> run = single_param_run(w);
          if (!run) {
            continue;
          }
          ++runs;
          const auto& param = l.model->shells()[run->local_rank].params[run->param];
          const auto* src = reinterpret_cast<const std::byte*>(files[w.file].data()) + w.offset;
          std::vector<std::byte> by_fragments(param.nbytes, std::byte{0});
          std::vector<int> writes(param.nbytes, 0);
          for (const Fragment& f : w.fragments) {
            EXPECT_EQ(f.local_rank, run->local_rank);
            EXPECT_EQ(f.param, run->param);
            apply(f, src, by_fragments, writes);
          }
          // The fragments write exactly [dst_offset, dst_offset + nbytes), each byte
          // once, with the window's bytes in order.
          ASSERT_LE(run->dst_offset + w.nbytes, param.nbytes);
          std::vector<std::byte> straight(param.nbytes, std::byte{0});
          std::memcpy(straight.data() + run->dst_offset, src, w.nbytes);
          EXPECT_EQ(by_fragments, straight);
          for (std::uint64_t b = 0; b < param.nbytes; ++b) {
            const bool inside = b >= run->dst_offset && b < run->dst_offset + w.nbytes;
            ASSERT_EQ(writes[b], inside ? 1 : 0) << b;
          }
        }
        // tp 1 with windows smaller than the tensors: nearly every window is one run
        // (those that join two tensors are not); tp 2 still has the column slices.
        if (chunk == 4096 && tp == 1) {
          EXPECT_GT(runs * 10, windows * 8) << runs << " of " << windows;
        }
        if (chunk == 4096 && tp == 2) {
          EXPECT_GT(runs, 0u);
          EXPECT_LT(runs, windows);
        }
        if (std::string(family) == "qwen2" && tp == 1) {
          // A cast never reads straight through: f32 params from bf16 files.
          Loaded lf = open(ck(family), 1, {}, DType::kF32);
          const Plan f32 = make_plan(lf.index, *lf.model, {chunk, false});
          for (const Window& w : cut_all(f32)) {
            EXPECT_FALSE(single_param_run(w).has_value());
          }
        }
      }
    }
  }
}

TEST_F(PlanTest, Errors) {
  Loaded l = open(ck("llama"), 2, {});
  try {
    make_plan(l.index, *l.model, {1000, false});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kConfig);
  }
  // A checkpoint without one tensor: the param it fills is listed, up front.
  io::CheckpointIndex partial = l.index;
  const std::string gone = "model.layers.3.mlp.up_proj.weight";
  std::erase_if(partial.tensors, [&](const io::TensorInfo& t) { return t.name == gone; });
  try {
    make_plan(partial, *l.model, {4096, false}, "the-folder");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kMapping);
    EXPECT_EQ(e.file(), "the-folder");
    EXPECT_NE(e.rule().find("model.layers.3.mlp.gate_up_proj.weight"), std::string::npos)
        << e.what();
  }
  // Strict: an unknown name fails; otherwise it is unmapped and skipped.
  io::CheckpointIndex extra = l.index;
  io::TensorInfo t = extra.tensors.back();
  t.name = "model.unknown.weight";
  extra.tensors.push_back(t);
  extra.total_bytes += t.nbytes;
  Plan plan = make_plan(extra, *l.model, {4096, false});
  EXPECT_EQ(plan.unmapped, 1u);
  EXPECT_EQ(plan.unmapped_names, std::vector<std::string>{"model.unknown.weight"});
  Loaded strict = open(ck("llama"), 2, {}, std::nullopt, true);
  EXPECT_THROW(make_plan(extra, *strict.model, {4096, false}), Error);
}

}  // namespace
}  // namespace ferry::actors
