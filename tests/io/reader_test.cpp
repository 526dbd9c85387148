// The byte readers (pread, io_uring, mmap) return exactly the file's bytes for
// many ranges, queue depths and chunk sizes, with and without O_DIRECT, and keep
// the Reader contract: each op completes once with its tag, nothing outside the
// destination is written, truncation and ranges past EOF are errors naming the file.
#include "io/reader.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/error.hpp"
#include "reader_test_util.hpp"

namespace ferry::io {
namespace {

using test::DataFile;
using test::error_text;
using test::GuardedBuffer;

// 3 MiB and an odd tail, so the file does not end on a block boundary.
constexpr std::size_t kFileSize = (3u << 20) + 4321;

struct Range {
  std::uint64_t offset;
  std::size_t nbytes;
  std::size_t misalign;  // destination offset from a 4096-byte boundary
};

// Edge cases around chunk and block boundaries, then seeded random ranges.
std::vector<Range> ranges_for(std::size_t file_size, std::size_t chunk, std::uint64_t seed) {
  std::vector<Range> r = {
      {0, 0, 0},
      {file_size, 0, 3},
      {0, 1, 0},
      {file_size - 1, 1, 1},
      {0, file_size, 0},
      {1, file_size - 1, 5},
      {chunk - 1, 2, 7},
      {chunk - 1, chunk + 2, 64},
      {chunk, 2 * chunk, 0},
      {4095, 4098, 4095},
      {4096, 8192, 0},
      {8192, 3 * chunk + 4096, 0},
      {file_size - 5000, 5000, 16},
      {file_size - 4321, 4321, 0},
  };
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 40; ++i) {
    const std::uint64_t offset = rng() % file_size;
    const std::size_t cap = std::min<std::size_t>(file_size - offset, 4 * chunk + 5000);
    const std::size_t nbytes = static_cast<std::size_t>(rng() % (cap + 1));
    r.push_back({offset, nbytes, static_cast<std::size_t>(rng() % 3 == 0 ? 0 : rng() % 4096)});
  }
  return r;
}

// Reads every range in one batch (more ops than any queue depth) and checks bytes,
// guards and that each op completed once without error.
void expect_reads_match(Reader& reader, const File& file, const std::string& bytes,
                        const std::vector<Range>& ranges) {
  std::vector<std::unique_ptr<GuardedBuffer>> buffers;
  std::vector<ReadOp> ops;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    buffers.push_back(std::make_unique<GuardedBuffer>(ranges[i].nbytes, ranges[i].misalign));
    ops.push_back({&file, ranges[i].offset, ranges[i].nbytes, buffers.back()->data(), 1000 + i});
  }
  auto done = test::run_ops(reader, ops);
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    SCOPED_TRACE("range " + std::to_string(i) + ": " + std::to_string(r.nbytes) + " bytes at " +
                 std::to_string(r.offset) + ", dst +" + std::to_string(r.misalign));
    auto it = done.find(1000 + i);
    ASSERT_NE(it, done.end());
    EXPECT_FALSE(it->second.error) << error_text(it->second.error);
    EXPECT_TRUE(buffers[i]->view() == std::string_view(bytes).substr(r.offset, r.nbytes));
    EXPECT_TRUE(buffers[i]->guards_intact());
  }
}

using EngineParams = std::tuple<Engine, unsigned, std::size_t>;

class ReaderEngineTest : public ::testing::TestWithParam<EngineParams> {
 protected:
  ReaderOptions options() const {
    ReaderOptions o;
    o.engine = std::get<0>(GetParam());
    o.queue_depth = std::get<1>(GetParam());
    o.chunk_bytes = std::get<2>(GetParam());
    return o;
  }
  // The engine under test, or null after GTEST_SKIP when io_uring is unavailable.
  std::unique_ptr<Reader> reader(ReaderOptions o) {
    std::string why;
    auto r = test::make_engine(o, &why);
    if (r != nullptr) {
      EXPECT_EQ(r->name(), test::engine_name(o.engine));
    }
    return r;
  }
};

#define FERRY_READER_OR_SKIP(var, opts)                    \
  auto var = reader(opts);                                 \
  if (var == nullptr) {                                    \
    std::string why_;                                      \
    uring_available(&why_);                                \
    GTEST_SKIP() << "io_uring unavailable here: " << why_; \
  }

TEST_P(ReaderEngineTest, RandomRangesMatchTheFile) {
  DataFile data(kFileSize, 7);
  const File file = File::open(data.path());
  FERRY_READER_OR_SKIP(r, options());
  expect_reads_match(*r, file, data.bytes(), ranges_for(kFileSize, options().chunk_bytes, 11));
  EXPECT_GT(r->stats().reads_issued, 0u);
  EXPECT_EQ(r->stats().short_reads, 0u);
  EXPECT_EQ(r->stats().retries, 0u);
}

TEST_P(ReaderEngineTest, DirectRandomRangesMatchTheFile) {
  DataFile data(kFileSize, 8, /*need_direct=*/true);
  if (!data.direct_ok()) {
    GTEST_SKIP() << "no folder here accepts O_DIRECT";
  }
  const File file = File::open(data.path(), /*direct=*/true);
  ASSERT_TRUE(file.direct());
  FERRY_READER_OR_SKIP(r, options());
  expect_reads_match(*r, file, data.bytes(), ranges_for(kFileSize, options().chunk_bytes, 12));
}

TEST_P(ReaderEngineTest, FaultsAreRecoveredFrom) {
  for (bool direct : {false, true}) {
    SCOPED_TRACE(direct ? "O_DIRECT" : "buffered");
    DataFile data(kFileSize, 9, direct);
    if (direct && !data.direct_ok()) {
      continue;
    }
    const File file = File::open(data.path(), direct);
    FaultPlan plan;
    plan.seed = 42;
    plan.short_read_probability = 0.3;
    plan.eagain_probability = 0.15;
    plan.eintr_probability = 0.15;
    ReaderOptions o = options();
    o.faults = std::make_shared<FaultInjector>(plan);
    FERRY_READER_OR_SKIP(r, o);
    expect_reads_match(*r, file, data.bytes(), ranges_for(kFileSize, o.chunk_bytes, 13));
    EXPECT_GT(r->stats().short_reads, 0u);
    EXPECT_GT(r->stats().retries, 0u);
    EXPECT_GT(o.faults->faults_injected(), 0u);
    // The injector sees every system read exactly once.
    EXPECT_EQ(o.faults->reads_seen(), r->stats().reads_issued);
  }
}

TEST_P(ReaderEngineTest, NthReadFailureSurfacesAsErrorNamingTheFile) {
  DataFile data(1u << 20, 10);
  const File file = File::open(data.path(), false, "shard-3.safetensors");
  FaultPlan plan;
  plan.fail_read_number = 5;
  ReaderOptions o = options();
  o.faults = std::make_shared<FaultInjector>(plan);
  FERRY_READER_OR_SKIP(r, o);
  // Four ops of several chunks each, so the failing op has other sub-reads in flight.
  const std::size_t n = 4 * o.chunk_bytes + 100;
  std::vector<std::unique_ptr<GuardedBuffer>> buffers;
  std::vector<ReadOp> ops;
  for (std::uint64_t i = 0; i < 4; ++i) {
    buffers.push_back(std::make_unique<GuardedBuffer>(n, 0));
    ops.push_back({&file, i * 1000, n, buffers.back()->data(), i});
  }
  auto done = test::run_ops(*r, ops);
  int failed = 0;
  for (std::uint64_t i = 0; i < 4; ++i) {
    const Completion& c = done.at(i);
    EXPECT_TRUE(buffers[i]->guards_intact());
    if (!c.error) {
      EXPECT_TRUE(buffers[i]->view() == std::string_view(data.bytes()).substr(i * 1000, n));
      continue;
    }
    ++failed;
    try {
      std::rethrow_exception(c.error);
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kRead);
      EXPECT_EQ(e.file(), "shard-3.safetensors");
      EXPECT_NE(std::string(e.what()).find("Input/output error"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(o.faults->faults_injected(), 1u);
}

TEST_P(ReaderEngineTest, PersistentEagainGivesUpInsteadOfSpinning) {
  DataFile data(20000, 18);
  const File file = File::open(data.path(), false, "busy.safetensors");
  FaultPlan plan;
  plan.eagain_probability = 1.0;
  ReaderOptions o = options();
  o.faults = std::make_shared<FaultInjector>(plan);
  FERRY_READER_OR_SKIP(r, o);
  GuardedBuffer out(3000, 0);  // one sub-read on every engine: the counts are exact
  auto done = test::run_ops(*r, {ReadOp{&file, 100, 3000, out.data(), 1}});
  const std::string err = error_text(done.at(1).error);
  EXPECT_NE(err.find("read: busy.safetensors: "), std::string::npos) << err;
  EXPECT_NE(err.find("gave up after 1000 retries"), std::string::npos) << err;
  EXPECT_NE(err.find("Resource temporarily unavailable"), std::string::npos) << err;
  EXPECT_EQ(r->stats().retries, 1000u);
  EXPECT_EQ(r->stats().reads_issued, 1001u);
  EXPECT_TRUE(out.guards_intact());
}

TEST_P(ReaderEngineTest, TruncatedFileIsAnErrorNotAShortResult) {
  for (bool direct : {false, true}) {
    SCOPED_TRACE(direct ? "O_DIRECT" : "buffered");
    DataFile data(1u << 20, 14, direct);
    if (direct && !data.direct_ok()) {
      continue;
    }
    const File file = File::open(data.path(), direct, "model-00002.safetensors");
    FERRY_READER_OR_SKIP(r, options());
    {
      // mmap: map the whole file before it shrinks, so a stale mapping is in place.
      GuardedBuffer warm(4096, 0);
      ReadOp op{&file, (1u << 20) - 4096, 4096, warm.data(), 1};
      auto done = test::run_ops(*r, {op});
      ASSERT_FALSE(done.at(1).error) << error_text(done.at(1).error);
    }
    {
      const int wfd = ::open(data.path().c_str(), O_WRONLY);
      ASSERT_GE(wfd, 0);
      ASSERT_EQ(::ftruncate(wfd, 300000), 0);
      ::close(wfd);
    }
    ASSERT_EQ(file.size(), 1u << 20);  // the File's size is stale; readers must not trust it
    GuardedBuffer across(200000, 3);
    GuardedBuffer before_end(100000, 0);
    GuardedBuffer beyond(4096, 0);
    std::vector<ReadOp> ops = {
        {&file, 200000, 200000, across.data(), 1},
        {&file, 200000, 100000, before_end.data(), 2},
        {&file, 500000, 4096, beyond.data(), 3},
    };
    auto done = test::run_ops(*r, ops);
    const std::string err1 = error_text(done.at(1).error);
    EXPECT_NE(err1.find("read: model-00002.safetensors: file truncated: wanted 200000 bytes at "
                        "offset 200000, file ends at 300000"),
              std::string::npos)
        << err1;
    EXPECT_FALSE(done.at(2).error) << error_text(done.at(2).error);
    EXPECT_TRUE(before_end.view() == std::string_view(data.bytes()).substr(200000, 100000));
    const std::string err3 = error_text(done.at(3).error);
    EXPECT_NE(err3.find("file truncated"), std::string::npos) << err3;
    EXPECT_NE(err3.find("model-00002.safetensors"), std::string::npos) << err3;
    EXPECT_TRUE(across.guards_intact());
    EXPECT_TRUE(beyond.guards_intact());
  }
}

TEST_P(ReaderEngineTest, RangesPastEndOfFileAreErrors) {
  DataFile data(100000, 15);
  const File file = File::open(data.path(), false, "tiny.safetensors");
  FERRY_READER_OR_SKIP(r, options());
  GuardedBuffer a(20, 0), b(100, 0), c(0, 0), d(10, 0);
  std::vector<ReadOp> ops = {
      {&file, 100000 - 10, 20, a.data(), 1},
      {&file, 100100, 100, b.data(), 2},
      {&file, 100000, 0, c.data(), 3},  // empty range at EOF: nothing to read, success
      {&file, std::numeric_limits<std::uint64_t>::max() - 4, 10, d.data(), 4},
  };
  auto done = test::run_ops(*r, ops);
  const std::string e1 = error_text(done.at(1).error);
  EXPECT_NE(e1.find("read: tiny.safetensors: file truncated: wanted 20 bytes at offset 99990, "
                    "file ends at 100000"),
            std::string::npos)
      << e1;
  const std::string e2 = error_text(done.at(2).error);
  EXPECT_NE(e2.find("wanted 100 bytes at offset 100100, file ends at 100000"), std::string::npos)
      << e2;
  EXPECT_FALSE(done.at(3).error);
  const std::string e4 = error_text(done.at(4).error);
  EXPECT_NE(e4.find("tiny.safetensors: read range overflows"), std::string::npos) << e4;
  EXPECT_TRUE(a.guards_intact() && b.guards_intact() && d.guards_intact());
}

TEST_P(ReaderEngineTest, BadOpsFailWithoutReading) {
  DataFile data(8192, 16);
  const File file = File::open(data.path(), false, "x.safetensors");
  const File closed;
  FERRY_READER_OR_SKIP(r, options());
  std::vector<ReadOp> ops = {
      {nullptr, 0, 10, nullptr, 1},
      {&file, 0, 10, nullptr, 2},
      {&closed, 0, 10, nullptr, 3},
  };
  auto done = test::run_ops(*r, ops);
  EXPECT_NE(error_text(done.at(1).error).find("read op has no file"), std::string::npos);
  EXPECT_NE(error_text(done.at(2).error).find("x.safetensors: read op has no destination"),
            std::string::npos);
  EXPECT_NE(error_text(done.at(3).error).find("file is not open"), std::string::npos);
  EXPECT_EQ(r->stats().reads_issued, 0u);
}

TEST_P(ReaderEngineTest, OutstandingCountsSubmittedOpsUntilPolled) {
  DataFile data(1u << 20, 17);
  const File file = File::open(data.path());
  FERRY_READER_OR_SKIP(r, options());
  std::vector<Completion> out;
  EXPECT_EQ(r->poll(out, std::chrono::milliseconds(0)), 0u);  // idle: nothing, no wait
  EXPECT_EQ(r->outstanding(), 0u);
  const std::size_t n = 3 * options().queue_depth + 5;
  std::vector<std::string> dst(n, std::string(5000, '\0'));
  for (std::size_t i = 0; i < n; ++i) {
    r->submit({&file, i * 7919, 5000, reinterpret_cast<std::byte*>(dst[i].data()), i});
    EXPECT_EQ(r->outstanding(), i + 1);
  }
  std::vector<int> seen(n, 0);
  std::size_t returned = 0;
  for (int idle = 0; returned < n && idle < 200;) {
    out.clear();
    const std::size_t got = r->poll(out, std::chrono::milliseconds(100));
    EXPECT_EQ(got, out.size());
    idle += got == 0 ? 1 : 0;
    returned += got;
    EXPECT_EQ(r->outstanding(), n - returned);
    for (const Completion& c : out) {
      ASSERT_LT(c.tag, n);
      ++seen[c.tag];
      EXPECT_FALSE(c.error) << error_text(c.error);
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_EQ(seen[i], 1) << "tag " << i;
    EXPECT_EQ(dst[i], data.bytes().substr(i * 7919, 5000));
  }
}

std::string param_name(const ::testing::TestParamInfo<EngineParams>& info) {
  return test::engine_name(std::get<0>(info.param)) + "_qd" +
         std::to_string(std::get<1>(info.param)) + "_chunk" +
         std::to_string(std::get<2>(info.param) / 1024) + "k";
}

// Queue depth only matters to io_uring (pread finishes each op in submit()).
INSTANTIATE_TEST_SUITE_P(Engines, ReaderEngineTest,
                         ::testing::Values(EngineParams{Engine::kPread, 1, 4096},
                                           EngineParams{Engine::kPread, 4, 64 << 10},
                                           EngineParams{Engine::kUring, 1, 4096},
                                           EngineParams{Engine::kUring, 1, 64 << 10},
                                           EngineParams{Engine::kUring, 4, 4096},
                                           EngineParams{Engine::kUring, 4, 64 << 10},
                                           EngineParams{Engine::kUring, 16, 4096},
                                           EngineParams{Engine::kUring, 16, 64 << 10}),
                         param_name);

}  // namespace
}  // namespace ferry::io
