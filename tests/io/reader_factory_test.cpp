// make_reader (engine choice, option checks, the io_uring fallback), read_all,
// the byte accounting of O_DIRECT widening, io_uring registered buffers, and
// tearing a reader down with reads still in the kernel.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/reader.hpp"
#include "reader_test_util.hpp"

extern char** environ;

namespace ferry::io {
namespace {

using test::DataFile;
using test::error_text;
using test::GuardedBuffer;

TEST(ReaderFactoryTest, MakesTheEngineAskedFor) {
  ReaderOptions o;
  o.engine = Engine::kPread;
  EXPECT_EQ(make_reader(o)->name(), "pread");
  o.engine = Engine::kUring;
  std::string why;
  const bool have = uring_available(&why);
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(make_reader(o)->name(), have ? "uring" : "pread") << why;
  EXPECT_EQ(make_uring_reader(o) != nullptr, have);
}

TEST(ReaderFactoryTest, RejectsUnusableOptions) {
  for (Engine e : {Engine::kPread, Engine::kUring}) {
    SCOPED_TRACE(test::engine_name(e));
    ReaderOptions o;
    o.engine = e;
    o.chunk_bytes = 0;
    try {
      make_reader(o);
      FAIL() << "no throw";
    } catch (const Error& err) {
      EXPECT_EQ(err.stage(), Stage::kConfig);
      EXPECT_NE(std::string(err.what()).find("chunk_bytes"), std::string::npos);
    }
    o.chunk_bytes = 4096;
    o.queue_depth = 0;
    EXPECT_THROW(make_reader(o), Error);
    o.queue_depth = 40000;
    EXPECT_THROW(make_reader(o), Error);
  }
  ReaderOptions o;
  o.chunk_bytes = 0;
  EXPECT_THROW(make_pread_reader(o), Error);
  EXPECT_THROW(make_uring_reader(o), Error);
}

TEST(ReaderFactoryTest, ChunkSmallerThanDirectAlignmentStillWorks) {
  DataFile data(50000, 21, true);
  if (!data.direct_ok()) {
    GTEST_SKIP() << "no folder here accepts O_DIRECT";
  }
  const File file = File::open(data.path(), true);
  for (Engine e : {Engine::kPread, Engine::kUring}) {
    SCOPED_TRACE(test::engine_name(e));
    ReaderOptions o;
    o.engine = e;
    o.chunk_bytes = 1000;  // O_DIRECT reads are at least one 4096-byte block
    o.queue_depth = 3;
    auto r = make_reader(o);
    GuardedBuffer out(30001, 9);
    read_all(*r, std::vector<ReadOp>{{&file, 777, 30001, out.data(), 0}});
    EXPECT_TRUE(out.view() == std::string_view(data.bytes()).substr(777, 30001));
    EXPECT_TRUE(out.guards_intact());
  }
}

TEST(ReadAllTest, ReadsEverythingAndRethrowsTheFirstFailedOp) {
  DataFile data(200000, 22);
  const File file = File::open(data.path(), false, "ra.safetensors");
  for (Engine e : {Engine::kPread, Engine::kUring}) {
    SCOPED_TRACE(test::engine_name(e));
    ReaderOptions o;
    o.engine = e;
    o.chunk_bytes = 8192;
    o.queue_depth = 4;
    auto r = make_reader(o);
    std::string a(50000, '\0'), b(70000, '\0');
    std::vector<ReadOp> ok = {
        {&file, 0, a.size(), reinterpret_cast<std::byte*>(a.data()), 77},
        {&file, 130000, b.size(), reinterpret_cast<std::byte*>(b.data()), 77}};
    read_all(*r, ok);  // duplicate tags are fine: read_all keeps its own
    EXPECT_EQ(a, data.bytes().substr(0, a.size()));
    EXPECT_EQ(b, data.bytes().substr(130000, b.size()));

    std::vector<ReadOp> bad = ok;
    std::string c(20, '\0'), d(20, '\0');
    bad.push_back({&file, 199990, 20, reinterpret_cast<std::byte*>(c.data()), 0});
    bad.push_back({&file, 300000, 20, reinterpret_cast<std::byte*>(d.data()), 0});
    try {
      read_all(*r, bad);
      FAIL() << "no throw";
    } catch (const Error& err) {
      // The third op is the first that failed, whatever order completions came in.
      EXPECT_EQ(err.file(), "ra.safetensors");
      EXPECT_NE(err.rule().find("wanted 20 bytes at offset 199990, file ends at 200000"),
                std::string::npos)
          << err.what();
    }
    EXPECT_EQ(r->outstanding(), 0u);  // drained before the throw
    read_all(*r, std::vector<ReadOp>{});

    std::string other(10, '\0');
    r->submit({&file, 0, 10, reinterpret_cast<std::byte*>(other.data()), 1});
    EXPECT_THROW(read_all(*r, ok), std::logic_error);  // someone else's op is outstanding
    std::vector<Completion> out;
    while (r->outstanding() > 0) {
      r->poll(out, std::chrono::milliseconds(100));
    }
  }
}

// Without faults, every system read is one planned sub-read: bytes_requested is
// the sum of the widened (O_DIRECT) ranges, chunk by chunk.
TEST(ReaderStatsTest, DirectWideningIsCounted) {
  DataFile data(100000, 23, true);
  if (!data.direct_ok()) {
    GTEST_SKIP() << "no folder here accepts O_DIRECT";
  }
  const File file = File::open(data.path(), true);
  for (Engine e : {Engine::kPread, Engine::kUring}) {
    SCOPED_TRACE(test::engine_name(e));
    ReaderOptions o;
    o.engine = e;
    o.chunk_bytes = 16384;
    auto r = make_reader(o);
    GuardedBuffer one(1, 1), aligned(32768, 0), tail(100000 - 90000, 0);
    read_all(*r, std::vector<ReadOp>{{&file, 5000, 1, one.data(), 0}});
    EXPECT_EQ(r->stats().bytes_requested, 4096u);  // one byte costs one block
    EXPECT_EQ(r->stats().reads_issued, 1u);
    read_all(*r, std::vector<ReadOp>{{&file, 8192, 32768, aligned.data(), 0}});
    EXPECT_EQ(r->stats().bytes_requested, 4096u + 32768u);  // two in-place chunks
    EXPECT_EQ(r->stats().reads_issued, 3u);
    // [90000, 100000) widens to [86016, 102400): 16384 bytes asked, EOF ends it early.
    read_all(*r, std::vector<ReadOp>{{&file, 90000, 10000, tail.data(), 0}});
    EXPECT_EQ(r->stats().bytes_requested, 4096u + 32768u + 16384u);
    EXPECT_EQ(r->stats().reads_issued, 4u);
    EXPECT_EQ(r->stats().short_reads, 1u);
    EXPECT_TRUE(one.view() == std::string_view(data.bytes()).substr(5000, 1));
    EXPECT_TRUE(aligned.view() == std::string_view(data.bytes()).substr(8192, 32768));
    EXPECT_TRUE(tail.view() == std::string_view(data.bytes()).substr(90000, 10000));
    EXPECT_TRUE(one.guards_intact() && aligned.guards_intact() && tail.guards_intact());
  }
}

TEST(UringReaderTest, RegisteredBounceBuffers) {
  std::string why;
  if (!uring_available(&why)) {
    GTEST_SKIP() << "io_uring unavailable here: " << why;
  }
  DataFile data(1u << 20, 24, true);
  if (!data.direct_ok()) {
    GTEST_SKIP() << "no folder here accepts O_DIRECT";
  }
  const File file = File::open(data.path(), true);
  FaultPlan plan;
  plan.seed = 3;
  plan.short_read_probability = 0.3;
  ReaderOptions o;
  o.engine = Engine::kUring;
  o.queue_depth = 4;
  o.chunk_bytes = 64 << 10;
  o.register_buffers = true;
  o.faults = std::make_shared<FaultInjector>(plan);
  test::LogCapture logs;
  auto r = make_uring_reader(o);
  ASSERT_NE(r, nullptr);
  // Registration either worked or was logged as refused (RLIMIT_MEMLOCK); both read.
  const bool registered =
      logs.text().find("io_uring: registered 4 bounce buffers of 65536 bytes") != std::string::npos;
  const bool refused = logs.text().find("io_uring: cannot register") != std::string::npos;
  EXPECT_TRUE(registered != refused) << logs.text();
  std::vector<std::unique_ptr<GuardedBuffer>> bufs;
  std::vector<ReadOp> ops;
  for (std::uint64_t i = 0; i < 12; ++i) {
    const std::uint64_t off = i * 80001 + 17;
    bufs.push_back(std::make_unique<GuardedBuffer>(70000 + i, i % 2 == 0 ? 3 : 0));
    ops.push_back({&file, off, 70000 + i, bufs.back()->data(), i});
  }
  read_all(*r, ops);
  for (std::uint64_t i = 0; i < 12; ++i) {
    EXPECT_TRUE(bufs[i]->view() ==
                std::string_view(data.bytes()).substr(i * 80001 + 17, 70000 + i));
    EXPECT_TRUE(bufs[i]->guards_intact());
  }
  EXPECT_GT(r->stats().short_reads, 0u);
}

// Destroying a reader with reads in the kernel must wait for them (bounce buffers
// and destinations stay valid until then). Cold reads make them really in flight.
TEST(UringReaderTest, DestroyWithReadsInFlight) {
  std::string why;
  if (!uring_available(&why)) {
    GTEST_SKIP() << "io_uring unavailable here: " << why;
  }
  for (bool direct : {false, true}) {
    DataFile data(4u << 20, 25, direct);
    if (direct && !data.direct_ok()) {
      continue;
    }
    const File file = File::open(data.path(), direct);
    drop_page_cache(file);
    ReaderOptions o;
    o.engine = Engine::kUring;
    o.queue_depth = 8;
    o.chunk_bytes = 64 << 10;
    std::vector<std::unique_ptr<GuardedBuffer>> bufs;
    {
      auto r = make_uring_reader(o);
      ASSERT_NE(r, nullptr);
      for (std::uint64_t i = 0; i < 16; ++i) {
        bufs.push_back(std::make_unique<GuardedBuffer>(200000, 5));
        r->submit({&file, i * 250000 + 3, 200000, bufs.back()->data(), i});
      }
      std::vector<Completion> out;
      r->poll(out, std::chrono::milliseconds(0));  // starts reads, returns at once
      EXPECT_LE(out.size(), 16u);
    }  // destroyed here, possibly with reads in the kernel
    for (auto& b : bufs) {
      EXPECT_TRUE(b->guards_intact());
    }
  }
}

// The subprocess half of FallsBackToPreadWhenUringDisabled (skipped otherwise).
TEST(ReaderFallbackChild, UringDisabledByEnvironment) {
  if (std::getenv("FERRY_READER_FALLBACK_CHILD") == nullptr) {
    GTEST_SKIP() << "runs only as the subprocess of ReaderFallback.DisabledUringFallsBackToPread";
  }
  std::string why;
  EXPECT_FALSE(uring_available(&why));
  EXPECT_EQ(why, "disabled by FERRY_DISABLE_URING");
  ReaderOptions o;
  o.engine = Engine::kUring;
  EXPECT_EQ(make_uring_reader(o, &why), nullptr);
  EXPECT_EQ(why, "disabled by FERRY_DISABLE_URING");
  test::LogCapture logs(log::Level::kWarn);
  auto r = make_reader(o);
  EXPECT_EQ(r->name(), "pread");
  EXPECT_NE(logs.text().find("io_uring unavailable (disabled by FERRY_DISABLE_URING)"),
            std::string::npos)
      << logs.text();
  DataFile data(10000, 26);
  const File file = File::open(data.path());
  std::string out(9000, '\0');
  read_all(*r,
           std::vector<ReadOp>{{&file, 1000, 9000, reinterpret_cast<std::byte*>(out.data()), 0}});
  EXPECT_EQ(out, data.bytes().substr(1000));
}

// The io_uring probe is cached per process, so the disabled case runs in a child
// process of this test binary with FERRY_DISABLE_URING=1.
TEST(ReaderFallback, DisabledUringFallsBackToPread) {
  ferry::testing::TempDir dir;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string log_path = dir.file("child.log");
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view kv(*e);
    if (kv.rfind("FERRY_DISABLE_URING=", 0) != 0 && kv.rfind("GTEST_", 0) != 0) {
      env_strings.emplace_back(kv);
    }
  }
  env_strings.emplace_back("FERRY_DISABLE_URING=1");
  env_strings.emplace_back("FERRY_READER_FALLBACK_CHILD=1");
  std::vector<char*> envp;
  for (auto& s : env_strings) {
    envp.push_back(s.data());
  }
  envp.push_back(nullptr);
  std::string filter = "--gtest_filter=ReaderFallbackChild.UringDisabledByEnvironment";
  std::vector<char*> argv = {const_cast<char*>(self.c_str()), filter.data(), nullptr};

  posix_spawn_file_actions_t actions;
  ASSERT_EQ(posix_spawn_file_actions_init(&actions), 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ASSERT_EQ(rc, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const std::string output = ferry::testing::read_file(log_path);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 0) << output;
  EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
  EXPECT_EQ(output.find("SKIPPED"), std::string::npos) << output;
}

}  // namespace
}  // namespace ferry::io
