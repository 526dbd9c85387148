// File (open, errors, moves, page-cache drop) and the seeded FaultInjector that the
// reader tests rely on.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/fault_injection.hpp"
#include "io/file.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

using ferry::testing::TempDir;
using ferry::testing::write_file;

TEST(FileTest, OpensAndReportsSizeAndNames) {
  TempDir dir;
  write_file(dir.file("a.bin"), std::string(12345, 'x'));
  const File f = File::open(dir.file("a.bin"));
  EXPECT_GE(f.fd(), 0);
  EXPECT_EQ(f.size(), 12345u);
  EXPECT_FALSE(f.direct());
  EXPECT_EQ(f.alignment(), 1u);
  EXPECT_EQ(f.path(), dir.file("a.bin"));
  EXPECT_EQ(f.display(), dir.file("a.bin"));  // display defaults to the path
  EXPECT_NE(::fcntl(f.fd(), F_GETFD) & FD_CLOEXEC, 0);
  const File g = File::open(dir.file("a.bin"), false, "a.safetensors");
  EXPECT_EQ(g.display(), "a.safetensors");
}

TEST(FileTest, MissingFileErrorNamesTheDisplayPath) {
  TempDir dir;
  try {
    File::open(dir.file("nope.safetensors"), false, "shard.safetensors");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "read: shard.safetensors: open: No such file or directory");
    EXPECT_EQ(e.stage(), Stage::kRead);
    EXPECT_EQ(e.file(), "shard.safetensors");
  }
  try {
    File::open(dir.file("nope.safetensors"));
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.file(), dir.file("nope.safetensors"));
  }
}

TEST(FileTest, DirectoryIsRejected) {
  TempDir dir;
  try {
    File::open(dir.str(), false, "folder");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "read: folder: open: is a directory, not a file");
  }
}

TEST(FileTest, FollowsSymbolicLinks) {
  TempDir dir;
  write_file(dir.file("real.bin"), std::string(777, 'y'));
  std::filesystem::create_symlink(dir.file("real.bin"), dir.file("link.bin"));
  const File f = File::open(dir.file("link.bin"));
  EXPECT_EQ(f.size(), 777u);
  std::filesystem::create_symlink(dir.file("gone.bin"), dir.file("dangling.bin"));
  EXPECT_THROW(File::open(dir.file("dangling.bin")), Error);
}

TEST(FileTest, DirectOpenSetsAlignment) {
  TempDir dir;
  write_file(dir.file("d.bin"), std::string(8192, 'z'));
  try {
    const File f = File::open(dir.file("d.bin"), true);
    EXPECT_TRUE(f.direct());
    EXPECT_EQ(f.alignment(), 4096u);
    EXPECT_EQ(f.size(), 8192u);
  } catch (const Error& e) {
    // Only a file system that refuses O_DIRECT may fail, and it must say so.
    EXPECT_NE(std::string(e.what()).find("O_DIRECT refused"), std::string::npos) << e.what();
  }
}

TEST(FileTest, MovesTransferTheDescriptor) {
  TempDir dir;
  write_file(dir.file("a.bin"), std::string(10, 'a'));
  write_file(dir.file("b.bin"), std::string(20, 'b'));
  File a = File::open(dir.file("a.bin"), false, "a");
  const int fd_a = a.fd();
  File moved(std::move(a));
  EXPECT_EQ(moved.fd(), fd_a);
  EXPECT_EQ(moved.size(), 10u);
  EXPECT_EQ(moved.display(), "a");
  EXPECT_EQ(a.fd(), -1);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  EXPECT_EQ(a.size(), 0u);

  File b = File::open(dir.file("b.bin"));
  const int fd_b = b.fd();
  moved = std::move(b);  // closes a's descriptor
  EXPECT_EQ(moved.fd(), fd_b);
  EXPECT_EQ(moved.size(), 20u);
  errno = 0;
  EXPECT_EQ(::fcntl(fd_a, F_GETFD), -1);
  EXPECT_EQ(errno, EBADF);
}

TEST(FileTest, DropPageCache) {
  TempDir dir;
  write_file(dir.file("a.bin"), std::string(1 << 16, 'a'));
  const File f = File::open(dir.file("a.bin"));
  EXPECT_TRUE(drop_page_cache(f));
  const File closed;
  EXPECT_FALSE(drop_page_cache(closed));  // EBADF: best effort, no throw
}

std::vector<long long> verdicts(FaultPlan plan, int n, long long result) {
  FaultInjector injector(plan);
  std::vector<long long> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(injector.apply(result, static_cast<std::size_t>(result)));
  }
  return out;
}

TEST(FaultInjectorTest, SameSeedSameVerdicts) {
  FaultPlan plan;
  plan.seed = 5;
  plan.short_read_probability = 0.3;
  plan.eagain_probability = 0.1;
  plan.eintr_probability = 0.1;
  const auto first = verdicts(plan, 500, 4096);
  EXPECT_EQ(first, verdicts(plan, 500, 4096));
  plan.seed = 6;
  EXPECT_NE(first, verdicts(plan, 500, 4096));
  int eagain = 0, eintr = 0, cut = 0, full = 0;
  for (long long v : first) {
    if (v == -EAGAIN) {
      ++eagain;
    } else if (v == -EINTR) {
      ++eintr;
    } else if (v == 4096) {
      ++full;
    } else {
      ASSERT_GE(v, 1);
      ASSERT_LE(v, 4095);
      ++cut;
    }
  }
  // Every kind occurs (500 draws at these probabilities; the seed fixes the counts).
  EXPECT_GT(eagain, 0);
  EXPECT_GT(eintr, 0);
  EXPECT_GT(cut, 0);
  EXPECT_GT(full, 0);
}

TEST(FaultInjectorTest, FailsExactlyTheNthRead) {
  FaultPlan plan;
  plan.fail_read_number = 4;
  FaultInjector injector(plan);
  for (int i = 1; i <= 10; ++i) {
    EXPECT_EQ(injector.apply(100, 100), i == 4 ? -EIO : 100) << "read " << i;
  }
  EXPECT_EQ(injector.reads_seen(), 10u);
  EXPECT_EQ(injector.faults_injected(), 1u);
}

TEST(FaultInjectorTest, ShortReadsKeepAtLeastOneByte) {
  FaultPlan plan;
  plan.short_read_probability = 1.0;
  FaultInjector injector(plan);
  for (int i = 0; i < 200; ++i) {
    const long long v = injector.apply(10, 10);
    EXPECT_GE(v, 1);
    EXPECT_LE(v, 9);
  }
  EXPECT_EQ(injector.apply(1, 1), 1);  // nothing shorter than one byte
  EXPECT_EQ(injector.apply(0, 8), 0);  // EOF stays EOF
  EXPECT_EQ(injector.faults_injected(), 200u);
}

TEST(FaultInjectorTest, RealErrorsPassThrough) {
  FaultPlan plan;
  plan.eagain_probability = 1.0;
  FaultInjector injector(plan);
  EXPECT_EQ(injector.apply(-EBADF, 10), -EBADF);
  EXPECT_EQ(injector.apply(10, 10), -EAGAIN);
  EXPECT_EQ(injector.reads_seen(), 2u);
  EXPECT_EQ(injector.faults_injected(), 1u);
}

}  // namespace
}  // namespace ferry::io
