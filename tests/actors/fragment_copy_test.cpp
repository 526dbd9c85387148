// actors::copy_fragment: which path a fragment takes (by row width, source span,
// dtype and the device's narrow-row limit), the scratch it needs, and that every
// path writes exactly the bytes a plain row-by-row copy and cast would, on the host
// backend (whose narrow_row_bytes option makes it take the CUDA device's paths).
#include "actors/fragment_copy.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "gpu/device_wrapper.hpp"
#include "gpu/host_device.hpp"
#include "gpu/kernels_host.hpp"

namespace ferry::actors {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kNarrow = std::size_t{64} << 10;  // the CUDA device's limit

// Forwards to a host stream and writes down the copies' and casts' names.
class RecordingStream final : public gpu::StreamWrapper {
 public:
  explicit RecordingStream(std::unique_ptr<gpu::Stream> inner) : StreamWrapper(std::move(inner)) {}
  std::vector<std::string> ops;

  void copy_h2d(std::byte* d, const std::byte* s, std::size_t n) override {
    ops.push_back("copy_h2d");
    StreamWrapper::copy_h2d(d, s, n);
  }
  void copy_h2d_2d(std::byte* d, std::size_t dp, const std::byte* s, std::size_t sp, std::size_t w,
                   std::size_t r) override {
    ops.push_back("copy_h2d_2d");
    StreamWrapper::copy_h2d_2d(d, dp, s, sp, w, r);
  }
  void cast(std::byte* d, DType dt, const std::byte* s, DType st, std::size_t c) override {
    ops.push_back("cast");
    StreamWrapper::cast(d, dt, s, st, c);
  }
  void cast_2d(std::byte* d, std::size_t dp, DType dt, const std::byte* s, std::size_t sp, DType st,
               std::size_t w, std::size_t r) override {
    ops.push_back("cast_2d");
    StreamWrapper::cast_2d(d, dp, dt, s, sp, st, w, r);
  }
  void copy_d2d_2d(std::byte* d, std::size_t dp, const std::byte* s, std::size_t sp, std::size_t w,
                   std::size_t r) override {
    ops.push_back("copy_d2d_2d");
    StreamWrapper::copy_d2d_2d(d, dp, s, sp, w, r);
  }
};

Fragment fragment(std::uint64_t rows, std::uint64_t width, DType src, DType dst,
                  std::uint64_t src_pitch, std::uint64_t dst_pitch) {
  Fragment f;
  f.rows = rows;
  f.width_elems = width;
  f.src_dtype = src;
  f.dst_dtype = dst;
  f.src_pitch = src_pitch;
  f.dst_pitch = dst_pitch;
  return f;
}

TEST(FragmentCopy, PathsFollowTheRowWidthTheSpanAndTheDtype) {
  const DType bf = DType::kBF16;
  // o_proj of a 7168-wide model at tp 2: rows of 3584 BF16 (7 KiB), every other.
  const Fragment tp2 = fragment(100, 3584, bf, bf, 14336, 7168);
  EXPECT_EQ(copy_path(tp2, kNarrow), CopyPath::kGather);
  EXPECT_EQ(fragment_scratch_bytes(tp2, kNarrow), 99u * 14336 + 7168);
  EXPECT_EQ(copy_path(tp2, 0), CopyPath::kPitched);  // host memory: no limit
  EXPECT_EQ(fragment_scratch_bytes(tp2, 0), 0u);
  // tp 4: the span would carry 4x the rank's bytes over the link.
  const Fragment tp4 = fragment(100, 1792, bf, bf, 14336, 3584);
  EXPECT_EQ(copy_path(tp4, kNarrow), CopyPath::kPitched);
  EXPECT_EQ(fragment_scratch_bytes(tp4, kNarrow), 0u);
  // Rows from 64 KiB up go as one pitched copy.
  const Fragment wide = fragment(4, 32768, bf, bf, 131072, 65536);
  EXPECT_EQ(copy_path(wide, kNarrow), CopyPath::kPitched);
  // One row, or rows dense on both sides: one plain copy.
  EXPECT_EQ(copy_path(fragment(1, 100, bf, bf, 0, 0), kNarrow), CopyPath::kContiguous);
  EXPECT_EQ(copy_path(fragment(9, 100, bf, bf, 200, 200), kNarrow), CopyPath::kContiguous);
  // Dense source, pitched destination (a slot of a fused param): gathered.
  EXPECT_EQ(copy_path(fragment(9, 100, bf, bf, 200, 600), kNarrow), CopyPath::kGather);
  // Casts always go through scratch: the span when it is dense or gatherable...
  const Fragment cast = fragment(8, 100, DType::kF32, bf, 400, 200);
  EXPECT_EQ(copy_path(cast, 0), CopyPath::kCast);
  EXPECT_EQ(fragment_scratch_bytes(cast, 0), 3200u);
  // ...else the packed rows of one pitched copy.
  const Fragment sparse_cast = fragment(8, 100, DType::kF32, bf, 1600, 200);
  EXPECT_EQ(fragment_scratch_bytes(sparse_cast, kNarrow), 3200u);
  EXPECT_EQ(fragment_scratch_bytes(sparse_cast, 0), 3200u);
  EXPECT_EQ(to_string(CopyPath::kGather), "gather");
}

struct Case {
  const char* name;
  Fragment f;
  std::size_t narrow;
  std::vector<std::string> ops;  // what the stream is asked to do
};

// Runs `c` on a host device and compares the whole param with the reference: the
// rows copied, or cast, one by one on the host.
void expect_same_bytes_as_row_by_row(const Case& c) {
  SCOPED_TRACE(c.name);
  const Fragment& f = c.f;
  gpu::HostDeviceOptions options;
  options.narrow_row_bytes = c.narrow;
  options.poison_allocations = true;
  auto device = gpu::make_host_device(0, options);
  ASSERT_EQ(device->narrow_row_bytes(), c.narrow);
  RecordingStream stream(device->create_stream());

  const std::size_t dst_bytes = f.dst_offset + (f.rows - 1) * f.dst_pitch + f.dst_row_bytes() + 5;
  std::vector<std::byte> staging(f.src_offset + f.src_end() + 3);
  std::mt19937 rng(5);
  for (std::byte& b : staging) {
    b = static_cast<std::byte>(rng() % 251);
  }
  gpu::DeviceAllocation param = device->allocate(dst_bytes);
  std::vector<std::byte> want(dst_bytes, gpu::kPoisonByte);
  const std::uint64_t need = fragment_scratch_bytes(f, c.narrow);
  gpu::DeviceAllocation scratch = device->allocate(need);

  copy_fragment(stream, f, param.data(), staging.data(), scratch.data(), scratch.size(), c.narrow);
  if (f.src_dtype == f.dst_dtype) {
    gpu::host::copy_2d(want.data() + f.dst_offset, f.dst_pitch, staging.data() + f.src_offset,
                       f.src_pitch, f.src_row_bytes(), f.rows);
  } else {
    gpu::host::cast_2d(want.data() + f.dst_offset, f.dst_pitch, f.dst_dtype,
                       staging.data() + f.src_offset, f.src_pitch, f.src_dtype, f.width_elems,
                       f.rows);
  }
  std::vector<std::byte> got(dst_bytes);
  stream.copy_d2h(got.data(), param.data(), dst_bytes);
  stream.synchronize();
  EXPECT_EQ(got, want);
  EXPECT_EQ(stream.ops, c.ops);
}

TEST(FragmentCopy, EveryPathWritesWhatARowByRowCopyWould) {
  const DType bf = DType::kBF16;
  const DType f32 = DType::kF32;
  Fragment gather = fragment(37, 896, bf, bf, 3584, 1792);  // tp 2 of a 1792-wide row
  gather.src_offset = 1792;                                 // rank 1's half
  gather.dst_offset = 512;
  Fragment sparse = fragment(20, 448, bf, bf, 3584, 896);  // tp 4
  sparse.src_offset = 2 * 896;
  Fragment slot = fragment(12, 64, bf, bf, 128, 512);  // dense rows into a fused slot
  slot.dst_offset = 128;
  Fragment cast_gather = fragment(15, 300, f32, bf, 2400, 600);  // tp 2, F32 -> BF16
  cast_gather.src_offset = 1200;
  Fragment cast_sparse = fragment(15, 150, f32, bf, 2400, 300);  // tp 4
  cast_sparse.src_offset = 600;
  Fragment cast_dense = fragment(6, 77, DType::kF16, f32, 154, 400);
  Fragment one_row = fragment(1, 1000, bf, bf, 0, 0);
  one_row.src_offset = 3;
  one_row.dst_offset = 7;
  const std::vector<Case> cases = {
      {"gather", gather, kNarrow, {"copy_h2d", "copy_d2d_2d"}},
      {"gather off", gather, 0, {"copy_h2d_2d"}},
      {"too sparse to gather", sparse, kNarrow, {"copy_h2d_2d"}},
      {"dense rows into a slot", slot, kNarrow, {"copy_h2d", "copy_d2d_2d"}},
      {"cast of gatherable rows", cast_gather, kNarrow, {"copy_h2d", "cast_2d"}},
      {"cast of sparse rows", cast_sparse, kNarrow, {"copy_h2d_2d", "cast_2d"}},
      {"cast, no limit", cast_gather, 0, {"copy_h2d_2d", "cast_2d"}},
      {"cast of dense rows into pitched ones", cast_dense, kNarrow, {"copy_h2d", "cast_2d"}},
      {"one row", one_row, kNarrow, {"copy_h2d"}},
  };
  for (const Case& c : cases) {
    expect_same_bytes_as_row_by_row(c);
  }
}

TEST(FragmentCopy, TooLittleScratchIsAnInternalError) {
  auto device = gpu::make_host_device(0);
  auto stream = device->create_stream();
  const Fragment f = fragment(10, 100, DType::kBF16, DType::kBF16, 400, 200);
  gpu::DeviceAllocation param = device->allocate(4096);
  gpu::DeviceAllocation scratch = device->allocate(100);
  std::vector<std::byte> staging(4096);
  EXPECT_THAT(
      [&] {
        copy_fragment(*stream, f, param.data(), staging.data(), scratch.data(), scratch.size(),
                      kNarrow);
      },
      ::testing::ThrowsMessage<Error>(
          HasSubstr("gather path needs 3800 bytes of device scratch, 100 were allocated")));
}

TEST(FragmentCopy, ARanksScratchIsItsLargestPieceCappedByTheChunk) {
  Plan plan;
  plan.options.chunk_bytes = 1 << 20;
  models::Piece narrow;  // rank 0: tp 2 rows, 2 x 1000 x 1 KiB
  narrow.local_rank = 0;
  narrow.rows = 1000;
  narrow.width_elems = 512;
  narrow.src_pitch = 2048;
  narrow.dst_pitch = 1024;
  models::Piece cast = narrow;  // rank 1: a small cast
  cast.local_rank = 1;
  cast.rows = 4;
  cast.src_dtype = DType::kF32;
  cast.src_pitch = 2048;
  models::Piece dense = narrow;  // rank 2: needs nothing
  dense.local_rank = 2;
  dense.src_pitch = 1024;
  plan.routes.push_back({{narrow, cast, dense}, {}});
  EXPECT_EQ(rank_scratch_bytes(plan, 0, kNarrow), std::uint64_t{1} << 20);  // 2 MB: capped
  EXPECT_EQ(rank_scratch_bytes(plan, 0, 0), 0u);
  EXPECT_EQ(rank_scratch_bytes(plan, 1, 0), 3u * 2048 + 2048);
  EXPECT_EQ(rank_scratch_bytes(plan, 2, kNarrow), 0u);
  EXPECT_EQ(rank_scratch_bytes(plan, 3, kNarrow), 0u);
}

// The review's case: a tp 3 row-parallel piece (pitch 3x its 2 KiB row) is too
// sparse to gather, so its rank was given no scratch; a window that cut it into a
// two-row fragment (span 4 rows = 2x the two rows' bytes) used to send that fragment
// down the gather path, and the load failed for want of scratch. Every fragment a
// window cuts now takes its piece's path, within the piece's scratch.
TEST(FragmentCopy, AFragmentCutFromATp3PieceNeedsNoScratchItsPieceWasNotGiven) {
  Plan plan;
  plan.options.chunk_bytes = 1 << 20;
  models::Piece tp3;
  tp3.rows = 64;
  tp3.width_elems = 1024;  // 2 KiB of BF16 a row: narrow
  tp3.src_pitch = 3 * 2048;
  tp3.dst_pitch = 2048;
  tp3.src_offset = 2048;  // rank 1's third
  plan.routes.push_back({{tp3}, {}});
  EXPECT_EQ(rank_scratch_bytes(plan, 0, kNarrow), 0u);
  // A window from the start of row 10 to the end of row 11's slice: two whole rows.
  std::vector<Fragment> cut;
  clip_piece(tp3, 0, 2048 + 10 * 6144, 6144 + 2048, 0, cut);
  ASSERT_EQ(cut.size(), 1u);
  EXPECT_EQ(cut[0].rows, 2u);
  EXPECT_EQ(copy_path(cut[0], kNarrow), CopyPath::kPitched);
  EXPECT_EQ(fragment_scratch_bytes(cut[0], kNarrow), 0u);
}

// The property behind it, over random pieces and windows: every fragment a window
// cuts from a piece needs no more scratch than rank_scratch_bytes gave the piece's
// rank, and copies with exactly that scratch, on the host backend taking the CUDA
// device's paths, to the bytes a row-by-row copy (and cast) writes.
TEST(FragmentCopy, EveryFragmentOfEveryWindowFitsItsRanksScratch) {
  std::mt19937_64 rng(30);
  auto device = gpu::make_host_device(0);
  auto stream = device->create_stream();
  const DType dtypes[] = {DType::kBF16, DType::kF32, DType::kF16};
  std::size_t gathered = 0;
  std::size_t cast = 0;
  for (int trial = 0; trial < 300; ++trial) {
    models::Piece p;
    p.src_dtype = dtypes[rng() % 3];
    p.dst_dtype = rng() % 4 == 0 ? dtypes[rng() % 3] : p.src_dtype;
    const std::uint64_t ses = dtype_size(p.src_dtype);
    const std::uint64_t des = dtype_size(p.dst_dtype);
    p.rows = 1 + rng() % 40;
    p.width_elems = 1 + rng() % 300;
    const std::uint64_t tp = 1 + rng() % 5;  // source pitch: 1 to 5 rows
    p.src_pitch = p.width_elems * ses * tp;
    p.src_offset = p.width_elems * ses * (rng() % tp);
    p.dst_pitch = p.width_elems * des * (1 + rng() % 2);
    Plan plan;
    plan.options.chunk_bytes = 4096 + rng() % 8192;
    plan.routes.push_back({{p}, {}});
    const std::size_t narrow = p.width_elems * ses + 1;  // every row narrow
    const std::uint64_t rank_scratch = rank_scratch_bytes(plan, 0, narrow);
    gpu::DeviceAllocation scratch = device->allocate(rank_scratch);
    const std::uint64_t tensor_bytes = p.src_offset + p.src_end();
    std::vector<std::byte> file(tensor_bytes + 16);
    for (auto& b : file) {
      b = static_cast<std::byte>(rng() % 63);  // small bytes: finite in every dtype
    }
    const std::uint64_t param_bytes = (p.rows - 1) * p.dst_pitch + p.width_elems * des;
    gpu::DeviceAllocation param = device->allocate(param_bytes);
    std::vector<std::byte> want(param_bytes, std::byte{0});
    std::memset(param.data(), 0, param_bytes);
    for (std::uint64_t r = 0; r < p.rows; ++r) {
      gpu::host::cast(want.data() + r * p.dst_pitch, p.dst_dtype,
                      file.data() + p.src_offset + r * p.src_pitch, p.src_dtype, p.width_elems);
    }
    // Windows of random length (element boundaries), walked over the whole tensor.
    for (std::uint64_t w0 = 0; w0 < tensor_bytes;) {
      std::uint64_t n = std::min<std::uint64_t>(plan.options.chunk_bytes, tensor_bytes - w0);
      n = std::max<std::uint64_t>(ses, (1 + rng() % n) / ses * ses);
      std::vector<Fragment> fragments;
      clip_piece(p, 0, w0, n, 0, fragments);
      for (const Fragment& f : fragments) {
        ASSERT_LE(fragment_scratch_bytes(f, narrow), rank_scratch)
            << "trial " << trial << ": a " << f.rows << "-row fragment, pitch " << f.src_pitch
            << ", row " << f.src_row_bytes();
        gathered += copy_path(f, narrow) == CopyPath::kGather ? 1 : 0;
        cast += copy_path(f, narrow) == CopyPath::kCast ? 1 : 0;
        copy_fragment(*stream, f, param.data(), file.data() + w0, scratch.data(), scratch.size(),
                      narrow);
      }
      w0 += n;
    }
    stream->synchronize();
    ASSERT_EQ(std::memcmp(param.data(), want.data(), param_bytes), 0) << "trial " << trial;
  }
  EXPECT_GT(gathered, 0u);  // the paths the property is about were taken
  EXPECT_GT(cast, 0u);
}

}  // namespace
}  // namespace ferry::actors
