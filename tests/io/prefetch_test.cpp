// Tests for the page-cache prefetcher: coverage of the plan, the ahead bound,
// cancellation, failures that warn without throwing, and shutdown.
#include "io/prefetch.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

using namespace std::chrono_literals;
using ferry::testing::TempDir;
using ferry::testing::write_file;

constexpr std::size_t kBlock = 4096;

// Polls `pred` until it holds; the generous deadline only stops a broken test
// from hanging, it is not a performance assertion.
bool eventually(const std::function<bool()>& pred) {
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return false;
    }
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// Writes `size` bytes under `dir` and returns its plan entry.
PrefetchFile make_file(const TempDir& dir, const std::string& name, std::uint64_t size) {
  write_file(dir.file(name), std::string(size, static_cast<char>('a' + name.size() % 26)));
  return PrefetchFile{dir.file(name), name, size, std::nullopt, nullptr};
}

// Records every on_block call; thread-safe.
struct BlockLog {
  std::mutex mu;
  std::vector<std::pair<std::string, std::uint64_t>> calls;  // (name, offset)
  std::uint64_t bytes = 0;

  void add(const PrefetchFile& f, std::uint64_t offset, std::size_t len) {
    std::lock_guard lock(mu);
    calls.emplace_back(f.name, offset);
    bytes += len;
  }
  std::size_t count() {
    std::lock_guard lock(mu);
    return calls.size();
  }
};

// Options that read kBlock blocks on `threads` threads and record each in `log`.
PrefetchOptions logged(BlockLog& log, unsigned threads) {
  PrefetchOptions o;
  o.threads = threads;
  o.block_bytes = kBlock;
  o.on_block = [&log](const PrefetchFile& f, std::uint64_t off, std::size_t len) {
    log.add(f, off, len);
  };
  return o;
}

// A gate hooks wait at until the test opens it.
class Gate {
 public:
  void pass() {
    std::unique_lock lock(mu_);
    ++waiting_;
    cv_.wait(lock, [&] { return open_; });
  }
  void open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  int waiting() {
    std::lock_guard lock(mu_);
    return waiting_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int waiting_ = 0;
};

// Captures warnings for the life of the object.
class WarnCapture {
 public:
  WarnCapture() {
    previous_ = log::set_sink([this](log::Level level, std::string_view m) {
      if (level == log::Level::kWarn) {
        std::lock_guard lock(mu_);
        warnings_.emplace_back(m);
      }
    });
  }
  ~WarnCapture() { log::set_sink(previous_); }
  WarnCapture(const WarnCapture&) = delete;
  WarnCapture& operator=(const WarnCapture&) = delete;
  std::vector<std::string> warnings() {
    std::lock_guard lock(mu_);
    return warnings_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> warnings_;
  log::Sink previous_;
};

class PrefetchThreadsTest : public ::testing::TestWithParam<unsigned> {};

TEST_P(PrefetchThreadsTest, ReadsEveryBlockOfEveryFileOnce) {
  TempDir dir;
  std::vector<PrefetchFile> files = {
      make_file(dir, "a.safetensors", 10000),
      make_file(dir, "empty.safetensors", 0),
      make_file(dir, "b.safetensors", 3 * kBlock + 1),
      make_file(dir, "c.safetensors", kBlock),
  };
  BlockLog log;
  const PrefetchOptions options = logged(log, GetParam());
  const std::uint64_t total = 10000 + 3 * kBlock + 1 + kBlock;
  Prefetcher p(files, options);
  EXPECT_EQ(p.total_bytes(), total);
  p.wait();
  EXPECT_TRUE(p.done());
  EXPECT_FALSE(p.cancelled());
  EXPECT_EQ(p.bytes_prefetched(), total);
  EXPECT_EQ(p.position(), total);
  EXPECT_TRUE(p.failed().empty());
  EXPECT_EQ(log.bytes, total);

  std::set<std::pair<std::string, std::uint64_t>> seen(log.calls.begin(), log.calls.end());
  EXPECT_EQ(seen.size(), log.calls.size()) << "a block was read twice";
  std::set<std::pair<std::string, std::uint64_t>> expected = {
      {"a.safetensors", 0},     {"a.safetensors", 4096}, {"a.safetensors", 8192},
      {"b.safetensors", 0},     {"b.safetensors", 4096}, {"b.safetensors", 8192},
      {"b.safetensors", 12288}, {"c.safetensors", 0},
  };
  EXPECT_EQ(seen, expected);
}

INSTANTIATE_TEST_SUITE_P(Prefetch, PrefetchThreadsTest, ::testing::Values(1u, 2u, 4u));

TEST(PrefetchTest, OneThreadReadsInPlanOrder) {
  TempDir dir;
  // Plan order is the list order, not name order.
  std::vector<PrefetchFile> files = {make_file(dir, "z.safetensors", 2 * kBlock),
                                     make_file(dir, "m.safetensors", kBlock + 7)};
  BlockLog log;
  Prefetcher p(files, logged(log, 1));
  p.wait();
  std::vector<std::pair<std::string, std::uint64_t>> expected = {{"z.safetensors", 0},
                                                                 {"z.safetensors", kBlock},
                                                                 {"m.safetensors", 0},
                                                                 {"m.safetensors", kBlock}};
  EXPECT_EQ(log.calls, expected);
}

TEST(PrefetchTest, DefaultOptionsReadAFileInOneBlock) {
  TempDir dir;
  Prefetcher p({make_file(dir, "a.safetensors", 100000)});
  p.wait();
  EXPECT_EQ(p.bytes_prefetched(), 100000u);
  EXPECT_TRUE(p.failed().empty());
}

TEST(PrefetchTest, NeverReadsFurtherAheadOfTheConsumerThanAllowed) {
  TempDir dir;
  // 10 blocks in plan bytes across two files (6 + 4).
  std::vector<PrefetchFile> files = {make_file(dir, "a.safetensors", 6 * kBlock),
                                     make_file(dir, "b.safetensors", 4 * kBlock)};
  std::map<std::string, std::uint64_t> plan_offset = {{"a.safetensors", 0},
                                                      {"b.safetensors", 6 * kBlock}};
  // The test raises `limit` before each advance(): a block starting at or past it
  // is a violation, whenever it happens.
  std::atomic<std::uint64_t> limit{2 * kBlock};
  std::atomic<int> violations{0};
  std::atomic<std::uint64_t> max_start{0};
  BlockLog log;
  PrefetchOptions options;
  options.threads = 4;
  options.block_bytes = kBlock;
  options.ahead_bytes = 2 * kBlock;
  options.on_block = [&](const PrefetchFile& f, std::uint64_t off, std::size_t len) {
    std::uint64_t start = plan_offset.at(f.name) + off;
    if (start >= limit.load()) {
      ++violations;
    }
    std::uint64_t seen = max_start.load();
    while (start > seen && !max_start.compare_exchange_weak(seen, start)) {
    }
    log.add(f, off, len);
  };
  Prefetcher p(files, options);

  ASSERT_TRUE(eventually([&] { return p.position() == 2 * kBlock; }));
  // Let the other workers run: they must stay parked.
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(log.count(), 2u);
  EXPECT_EQ(max_start.load(), kBlock);
  EXPECT_FALSE(p.done());

  limit = 7 * kBlock;
  p.advance(5 * kBlock);  // allows blocks starting below 7 blocks (into b.safetensors)
  p.advance(1 * kBlock);  // going back is ignored
  ASSERT_TRUE(eventually([&] { return p.position() == 7 * kBlock; }));
  std::this_thread::sleep_for(30ms);
  // Blocks 2-4 are behind the reader: skipped, not read. Blocks 5 and 6 are read.
  EXPECT_EQ(log.count(), 4u);
  EXPECT_EQ(max_start.load(), 6 * kBlock);

  limit = 12 * kBlock;
  p.advance(10 * kBlock);  // the reader is at the end: nothing is left to warm
  p.wait();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_EQ(p.bytes_prefetched(), 4 * kBlock);
  EXPECT_EQ(log.count(), 4u);
  EXPECT_EQ(p.position(), p.total_bytes());
  EXPECT_TRUE(p.failed().empty());
}

TEST(PrefetchTest, CancelStopsAtTheNextBlockBoundary) {
  TempDir dir;
  std::vector<PrefetchFile> files = {make_file(dir, "a.safetensors", 20 * kBlock)};
  Gate gate;
  BlockLog log;
  PrefetchOptions options;
  options.threads = 2;
  options.block_bytes = kBlock;
  options.on_block = [&](const PrefetchFile& f, std::uint64_t off, std::size_t len) {
    log.add(f, off, len);
    gate.pass();
  };
  Prefetcher p(files, options);
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 2; }));
  EXPECT_FALSE(p.done());
  p.cancel();  // returns at once although both workers are stuck in a read
  EXPECT_TRUE(p.cancelled());
  gate.open();
  p.wait();
  EXPECT_TRUE(p.done());
  EXPECT_EQ(log.count(), 2u);  // the two in-flight blocks, nothing after
  EXPECT_EQ(p.bytes_prefetched(), 2 * kBlock);
  EXPECT_LT(p.position(), 20 * kBlock);
  EXPECT_TRUE(p.failed().empty());
}

TEST(PrefetchTest, StopJoinsWorkersOrReportsThoseStillBusy) {
  TempDir dir;
  std::vector<PrefetchFile> files = {make_file(dir, "a.safetensors", 8 * kBlock)};
  Gate gate;
  PrefetchOptions options;
  options.threads = 3;
  options.block_bytes = kBlock;
  options.on_block = [&](const PrefetchFile&, std::uint64_t, std::size_t) { gate.pass(); };
  Prefetcher p(files, options);
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 3; }));
  // Workers are held inside the hook: they cannot have exited.
  EXPECT_FALSE(p.stop(1ms));
  EXPECT_FALSE(p.done());
  gate.open();
  EXPECT_TRUE(p.stop(std::chrono::minutes(1)));
  EXPECT_TRUE(p.done());
  EXPECT_TRUE(p.stop(0ms));  // again: nothing left to join
  EXPECT_EQ(p.bytes_prefetched(), 3 * kBlock);
}

TEST(PrefetchTest, StopAfterCompletionReturnsTrue) {
  TempDir dir;
  PrefetchOptions options;
  options.block_bytes = kBlock;
  Prefetcher p({make_file(dir, "a.safetensors", 5 * kBlock)}, options);
  p.wait();
  EXPECT_TRUE(p.stop(0ms));
  EXPECT_EQ(p.bytes_prefetched(), 5 * kBlock);
}

TEST(PrefetchTest, MissingAndShortFilesAreReportedAndTheRestIsRead) {
  TempDir dir;
  WarnCapture warns;
  PrefetchFile a = make_file(dir, "a.safetensors", 3 * kBlock);
  PrefetchFile missing{dir.file("missing.safetensors"), "missing.safetensors", 2 * kBlock,
                       std::nullopt, nullptr};
  PrefetchFile short_file = make_file(dir, "short.safetensors", kBlock + 10);
  short_file.size = 3 * kBlock;  // claims more than is on disk
  PrefetchFile c = make_file(dir, "c.safetensors", 2 * kBlock + 5);
  PrefetchOptions options;
  options.threads = 2;
  options.block_bytes = kBlock;
  Prefetcher p({a, missing, short_file, c}, options);
  p.wait();  // no exception reaches the caller
  EXPECT_TRUE(p.done());

  std::vector<std::string> failed = p.failed();
  ASSERT_EQ(failed.size(), 2u);
  std::sort(failed.begin(), failed.end());
  EXPECT_EQ(failed[0], "prefetch: missing.safetensors: open: No such file or directory");
  EXPECT_NE(failed[1].find("prefetch: short.safetensors: "), std::string::npos) << failed[1];
  EXPECT_NE(failed[1].find("shorter than its planned size"), std::string::npos) << failed[1];
  // The good files were read whole; given-up blocks still let position reach the end.
  EXPECT_GE(p.bytes_prefetched(), a.size + c.size);
  EXPECT_LE(p.bytes_prefetched(), a.size + c.size + kBlock + 10);
  EXPECT_EQ(p.position(), p.total_bytes());

  std::vector<std::string> w = warns.warnings();
  ASSERT_EQ(w.size(), 2u);
  std::sort(w.begin(), w.end());
  EXPECT_NE(w[0].find("missing.safetensors: open"), std::string::npos) << w[0];
  EXPECT_NE(w[1].find("short.safetensors"), std::string::npos) << w[1];
}

TEST(PrefetchTest, FileTruncatedWhileReadingFailsAtEndOfFile) {
  TempDir dir;
  WarnCapture warns;
  PrefetchFile a = make_file(dir, "a.safetensors", 4 * kBlock);
  PrefetchFile b = make_file(dir, "b.safetensors", kBlock);
  BlockLog log;
  PrefetchOptions options;
  options.threads = 1;  // deterministic: the truncation happens before block 1 is read
  options.block_bytes = kBlock;
  options.on_block = [&](const PrefetchFile& f, std::uint64_t off, std::size_t len) {
    log.add(f, off, len);
    if (f.name == "a.safetensors" && off == kBlock) {
      ASSERT_EQ(::truncate(f.path.c_str(), kBlock + 100), 0);
    }
  };
  Prefetcher p({a, b}, options);
  p.wait();
  std::vector<std::string> failed = p.failed();
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0],
            "prefetch: a.safetensors: file is shorter than its planned size (end of file at "
            "offset 4196, 16384 planned)");
  // Block 0 and the 100 bytes left of block 1, then the file was given up: b was read.
  EXPECT_EQ(p.bytes_prefetched(), kBlock + 100 + kBlock);
  std::vector<std::pair<std::string, std::uint64_t>> expected = {
      {"a.safetensors", 0}, {"a.safetensors", kBlock}, {"b.safetensors", 0}};
  EXPECT_EQ(log.calls, expected);
  EXPECT_EQ(p.position(), p.total_bytes());
  EXPECT_EQ(warns.warnings().size(), 1u);
}

TEST(PrefetchTest, HookThrowingFailsThatFileOnly) {
  TempDir dir;
  WarnCapture warns;
  std::vector<PrefetchFile> files = {make_file(dir, "a.safetensors", 2 * kBlock),
                                     make_file(dir, "b.safetensors", 4 * kBlock),
                                     make_file(dir, "c.safetensors", 2 * kBlock)};
  files[1].name = "";  // displayed by path
  BlockLog log;
  PrefetchOptions options;
  options.threads = 1;
  options.block_bytes = kBlock;
  options.on_block = [&](const PrefetchFile& f, std::uint64_t off, std::size_t len) {
    log.add(f, off, len);
    if (f.path == files[1].path && off == kBlock) {
      throw std::runtime_error("injected EIO");
    }
  };
  Prefetcher p(files, options);
  p.wait();
  ASSERT_EQ(p.failed().size(), 1u);
  EXPECT_EQ(p.failed()[0], "prefetch: " + files[1].path + ": injected EIO");
  EXPECT_EQ(log.count(), 2u + 2u + 2u);  // b stops after its failing block
  EXPECT_EQ(p.bytes_prefetched(), 2 * kBlock + kBlock + 2 * kBlock);
  EXPECT_EQ(p.position(), p.total_bytes());
}

TEST(PrefetchTest, NothingToReadIsDoneAtOnce) {
  Prefetcher none({});
  EXPECT_TRUE(none.done());
  none.wait();
  EXPECT_EQ(none.bytes_prefetched(), 0u);
  EXPECT_EQ(none.position(), 0u);
  EXPECT_EQ(none.total_bytes(), 0u);
  EXPECT_TRUE(none.stop(0ms));

  // Empty files are not even opened, so a missing one is not an error.
  Prefetcher empty(
      {PrefetchFile{"/nonexistent/ferry/x.safetensors", "x", 0, std::nullopt, nullptr}});
  EXPECT_TRUE(empty.done());
  EXPECT_TRUE(empty.failed().empty());
}

TEST(PrefetchTest, InvalidOptionsAreConfigErrors) {
  PrefetchOptions zero_threads;
  zero_threads.threads = 0;
  try {
    Prefetcher p({}, zero_threads);
    FAIL() << "threads = 0 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kConfig);
    EXPECT_NE(std::string(e.what()).find("threads must be >= 1"), std::string::npos);
  }
  PrefetchOptions zero_block;
  zero_block.block_bytes = 0;
  EXPECT_THROW(Prefetcher({}, zero_block), Error);
}

TEST(PrefetchTest, DestructorWhileWorkersWaitForTheConsumerDoesNotHang) {
  TempDir dir;
  PrefetchOptions options;
  options.threads = 4;
  options.block_bytes = kBlock;
  options.ahead_bytes = kBlock;
  std::atomic<int> calls{0};
  options.on_block = [&](const PrefetchFile&, std::uint64_t, std::size_t) { ++calls; };
  {
    Prefetcher p({make_file(dir, "a.safetensors", 16 * kBlock)}, options);
    ASSERT_TRUE(eventually([&] { return p.position() == kBlock; }));
    EXPECT_FALSE(p.done());  // parked on the ahead bound
  }
  EXPECT_EQ(calls.load(), 1);
}

TEST(PrefetchTest, DestructorWhileBlocksAreInFlightDoesNotHang) {
  TempDir dir;
  Gate gate;
  PrefetchOptions options;
  options.threads = 2;
  options.block_bytes = kBlock;
  options.on_block = [&](const PrefetchFile&, std::uint64_t, std::size_t) { gate.pass(); };
  std::thread opener;
  {
    Prefetcher p({make_file(dir, "a.safetensors", 16 * kBlock)}, options);
    ASSERT_TRUE(eventually([&] { return gate.waiting() == 2; }));
    // Open the gate a little after the destructor has started waiting.
    opener = std::thread([&] {
      std::this_thread::sleep_for(10ms);
      gate.open();
    });
  }
  opener.join();
  // Reaching here is the test (a hang fails it by the CTest timeout). How many blocks
  // ran depends on when the destructor's cancel() landed, so it is not asserted.
  EXPECT_GE(gate.waiting(), 2);
}

TEST(PrefetchTest, ConcurrentCallersFromManyThreads) {
  TempDir dir;
  std::vector<PrefetchFile> files;
  for (int i = 0; i < 6; ++i) {
    files.push_back(make_file(dir, "f" + std::to_string(i) + ".safetensors", 3 * kBlock + i));
  }
  PrefetchOptions options;
  options.threads = 4;
  options.block_bytes = kBlock;
  options.ahead_bytes = 2 * kBlock;
  Prefetcher p(files, options);
  const std::uint64_t total = p.total_bytes();
  std::vector<std::thread> consumers;
  for (int t = 0; t < 3; ++t) {
    consumers.emplace_back([&, t] {
      for (std::uint64_t pos = static_cast<std::uint64_t>(t); pos <= total + kBlock;
           pos += kBlock / 2) {
        p.advance(pos);
        (void)p.position();
        (void)p.bytes_prefetched();
        (void)p.done();
      }
    });
  }
  for (std::thread& t : consumers) {
    t.join();
  }
  p.wait();
  // Consumers that race past the prefetch make it skip what they read.
  EXPECT_LE(p.bytes_prefetched(), total);
  EXPECT_EQ(p.position(), total);
}

TEST(PrefetcherRanges, OnlyTheRangesAreReadAndGapsStillCompleteThePosition) {
  TempDir dir;
  PrefetchFile a = make_file(dir, "a.safetensors", 10 * kBlock);
  a.ranges = std::vector<std::pair<std::uint64_t, std::uint64_t>>{{kBlock, 3 * kBlock + 100},
                                                                  {6 * kBlock, 7 * kBlock}};
  PrefetchFile skipped = make_file(dir, "bb.safetensors", 4 * kBlock);
  skipped.ranges = std::vector<std::pair<std::uint64_t, std::uint64_t>>{};  // nothing planned
  PrefetchFile whole = make_file(dir, "c.safetensors", 2 * kBlock);         // unset: all of it
  BlockLog log;
  Prefetcher p({a, skipped, whole}, logged(log, 1));
  p.wait();
  EXPECT_EQ(p.bytes_prefetched(), (2 * kBlock + 100) + kBlock + 2 * kBlock);
  EXPECT_EQ(log.bytes, p.bytes_prefetched());
  std::set<std::pair<std::string, std::uint64_t>> calls(log.calls.begin(), log.calls.end());
  EXPECT_EQ(calls, (std::set<std::pair<std::string, std::uint64_t>>{
                       {"a.safetensors", kBlock},
                       {"a.safetensors", 2 * kBlock},
                       {"a.safetensors", 3 * kBlock},  // 100 bytes: a block stops at its range
                       {"a.safetensors", 6 * kBlock},
                       {"c.safetensors", 0},
                       {"c.safetensors", kBlock}}));
  EXPECT_EQ(p.position(), p.total_bytes());  // gaps and unplanned files count as done
  EXPECT_TRUE(p.failed().empty());
}

TEST(PrefetcherRanges, ItSkipsForwardWhenTheReaderHasPassedIt) {
  TempDir dir;
  PrefetchFile a = make_file(dir, "a.safetensors", 16 * kBlock);
  BlockLog log;
  Gate gate;
  PrefetchOptions o;
  o.threads = 1;
  o.block_bytes = kBlock;
  o.on_block = [&](const PrefetchFile& f, std::uint64_t offset, std::size_t len) {
    if (offset == 0) {
      gate.pass();  // hold the first block until the reader has moved on
    }
    log.add(f, offset, len);
  };
  Prefetcher p({a}, o);
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 1; }));
  p.advance(10 * kBlock);  // the reader is already at block 10
  gate.open();
  p.wait();
  // Block 0 was in flight; blocks 1-9 are behind the reader and never read.
  std::set<std::uint64_t> offsets;
  for (const auto& [name, offset] : log.calls) {
    offsets.insert(offset);
  }
  EXPECT_EQ(offsets, (std::set<std::uint64_t>{0, 10 * kBlock, 11 * kBlock, 12 * kBlock, 13 * kBlock,
                                              14 * kBlock, 15 * kBlock}));
  EXPECT_EQ(p.position(), p.total_bytes());
}

TEST(PrefetcherRanges, BadRangesAreRefused) {
  TempDir dir;
  for (const auto& ranges : std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>>{
           {{0, 10}, {5, 20}}, {{10, 10}}, {{0, 5 * kBlock}}, {{20, 30}, {0, 10}}}) {
    PrefetchFile f = make_file(dir, "a.safetensors", 4 * kBlock);
    f.ranges = ranges;
    EXPECT_THROW(Prefetcher({f}), Error);
  }
}

}  // namespace
}  // namespace ferry::io
