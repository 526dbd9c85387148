// What counts as a weight file changed under a descriptor (io::changed, the check a
// read lane runs after its last read of a file), and the open-file limit
// (io/fd_limit.hpp) a checkpoint of thousands of shards needs room under.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "common/error.hpp"
#include "io/fd_limit.hpp"
#include "io/file.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

namespace fs = std::filesystem;
using ferry::testing::TempDir;
using ferry::testing::write_file;

void pwrite_all(const std::string& path, const std::string& bytes, off_t at) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), at), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

// Waits (bounded) until the file system's clock has moved past `ctime_ns`: a
// change made within the same clock tick would leave the timestamps as they were.
void wait_for_clock_past(const TempDir& dir, std::int64_t ctime_ns) {
  const std::string probe = dir.file("clock-probe");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    write_file(probe, "x");
    struct stat st {};
    ASSERT_EQ(::stat(probe.c_str(), &st), 0);
    if (identity_of(&st).ctime_ns > ctime_ns) {
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  FAIL() << "the file system's clock did not move in 5 s";
}

// A file a minute old by its mtime, open, and its identity as of now.
struct Subject {
  explicit Subject(const TempDir& dir) : path(dir.file("w.safetensors")) {
    write_file(path, std::string(8192, 'a'));
    fs::last_write_time(path, fs::file_time_type::clock::now() - std::chrono::minutes(1));
    file = File::open(path, false, "w.safetensors");
    before = file.current_identity();
  }
  std::string path;
  File file;
  FileIdentity before;
};

TEST(FileChange, AnUntouchedFileIsUnchanged) {
  TempDir dir;
  Subject s(dir);
  std::string buf(100, '\0');
  ASSERT_EQ(::pread(s.file.fd(), buf.data(), buf.size(), 0), 100);  // reads change nothing
  EXPECT_FALSE(changed(s.before, s.file.current_identity()));
  EXPECT_EQ(describe_change(s.before, s.file.current_identity()), "unchanged");
}

TEST(FileChange, BytesWrittenInPlaceAreAChange) {
  TempDir dir;
  Subject s(dir);
  pwrite_all(s.path, std::string(4096, 'b'), 4096);  // dd conv=notrunc: same inode, same size
  const FileIdentity now = s.file.current_identity();
  EXPECT_EQ(now.inode, s.before.inode);
  EXPECT_EQ(now.size, s.before.size);
  EXPECT_TRUE(changed(s.before, now));
  EXPECT_NE(describe_change(s.before, now).find("mtime (ns) "), std::string::npos);
}

TEST(FileChange, AWriterThatRestoresTheMtimeIsCaughtByTheCtime) {
  TempDir dir;
  Subject s(dir);
  wait_for_clock_past(dir, s.before.ctime_ns);
  pwrite_all(s.path, std::string(4096, 'b'), 0);
  struct timespec times[2];
  times[0].tv_nsec = UTIME_OMIT;
  times[1].tv_sec = s.before.mtime_ns / 1'000'000'000;
  times[1].tv_nsec = s.before.mtime_ns % 1'000'000'000;
  ASSERT_EQ(::utimensat(AT_FDCWD, s.path.c_str(), times, 0), 0);
  const FileIdentity now = s.file.current_identity();
  ASSERT_EQ(now.mtime_ns, s.before.mtime_ns) << "the writer put the mtime back";
  EXPECT_TRUE(changed(s.before, now));
  EXPECT_NE(describe_change(s.before, now).find("ctime (ns) "), std::string::npos);
}

TEST(FileChange, GrowingOrTruncatingIsAChange) {
  TempDir dir;
  Subject s(dir);
  fs::resize_file(s.path, 4096);
  EXPECT_TRUE(changed(s.before, s.file.current_identity()));
  EXPECT_NE(describe_change(s.before, s.file.current_identity()).find("size 8192 -> 4096"),
            std::string::npos);
}

// The descriptor still reads the very bytes it read before: the old inode lost its
// link (and its ctime moved with the link count), nothing else.
TEST(FileChange, APathRenamedOverIsNoChangeOfTheOpenFile) {
  TempDir dir;
  Subject s(dir);
  wait_for_clock_past(dir, s.before.ctime_ns);
  write_file(s.path + ".new", std::string(8192, 'z'));
  fs::rename(s.path + ".new", s.path);
  const FileIdentity now = s.file.current_identity();
  EXPECT_EQ(now.links, 0u);
  EXPECT_FALSE(changed(s.before, now)) << describe_change(s.before, now);
  // The path, though, is another file now.
  struct stat st {};
  ASSERT_EQ(::stat(s.path.c_str(), &st), 0);
  EXPECT_TRUE(changed(s.before, identity_of(&st)));
}

// chmod moves only the ctime: it cannot be told from a write that restored the
// mtime, so it counts as a change (the safe side).
TEST(FileChange, AModeChangeCountsAsAChange) {
  TempDir dir;
  Subject s(dir);
  wait_for_clock_past(dir, s.before.ctime_ns);
  ASSERT_EQ(::chmod(s.path.c_str(), 0600), 0);
  EXPECT_TRUE(changed(s.before, s.file.current_identity()));
}

TEST(FileChange, UnknownIdentities) {
  TempDir dir;
  Subject s(dir);
  EXPECT_FALSE(changed(FileIdentity{}, s.before)) << "nothing known before: nothing to compare";
  EXPECT_TRUE(changed(s.before, FileIdentity{})) << "fstat failed now: no proof it is unchanged";
  EXPECT_EQ(describe_change(s.before, FileIdentity{}), "fstat failed");
}

// ---- the open-file limit -----------------------------------------------------------
//
// Each case sets the process's limits, so it runs in a child (a death test,
// re-executed: raise_open_file_limit's once-per-process state starts fresh).

void set_limit(rlim_t soft, rlim_t hard) {
  struct rlimit rl {};
  rl.rlim_cur = soft;
  rl.rlim_max = hard;
  if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    std::fprintf(stderr, "setrlimit failed\n");
    std::_Exit(2);
  }
}

TEST(OpenFileLimitDeathTest, TheSoftLimitIsRaisedToTheHardOneOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        set_limit(256, 4096);
        raise_open_file_limit();
        const bool raised = open_file_limit().soft == 4096;
        set_limit(256, 4096);
        raise_open_file_limit();  // once per process: this one does nothing
        std::_Exit(raised && open_file_limit().soft == 256 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "soft limit raised from 256 to 4096 \\(hard limit 4096\\)");
}

TEST(OpenFileLimitDeathTest, RoomIsMadeUnderTheHardLimit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        set_limit(256, 8192);
        reserve_descriptors(5000, "/ck");
        std::_Exit(open_file_limit().soft >= 5000 + kLoadDescriptorReserve ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "5000 weight files need about [0-9]+ open file descriptors");
}

TEST(OpenFileLimitDeathTest, PastTheHardLimitTheErrorNamesTheLimitAndTheCount) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        set_limit(1024, 2048);
        try {
          reserve_descriptors(5000, "/ck");
        } catch (const Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          std::_Exit(e.stage() == Stage::kResources && e.file() == "/ck" ? 3 : 4);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(3),
      "resources: /ck: 5000 weight files need about [0-9]+ open file descriptors at once "
      "\\(5000 files, [0-9]+ open now, 64 for the load\\), more than the open-file limit "
      "allows: RLIMIT_NOFILE hard limit 2048 \\(soft 1024\\)");
}

TEST(OpenFileLimit, FewFilesNeedNothing) {
  const OpenFileLimit before = open_file_limit();
  EXPECT_NO_THROW(reserve_descriptors(1, "/ck"));
  EXPECT_EQ(open_file_limit().soft, before.soft);
  EXPECT_GT(open_descriptors(), 2u);  // standard input, output and error at least
}

}  // namespace
}  // namespace ferry::io
