// OutputFile and write_file_replacing by the kind of thing that stands at the path:
// nothing, a regular file, a symlink (chained, dangling, looping), a FIFO with and
// without a reader, a character device (twins of /dev/null and /dev/full made with
// mknod in a temporary folder, as root), a folder; a full file system (a small
// tmpfs); a planted PATH.tmp. Every failure leaves no temporary behind.
#include "common/output_file.hpp"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "common/format.hpp"
#include "testing/temp_dir.hpp"

namespace ferry {
namespace {

using ferry::testing::names_in;

namespace fs = std::filesystem;
using testing::read_file;
using testing::TempDir;
using testing::write_file;

// The rule of the Error `f` throws; fails the test when it throws none.
template <typename F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error";
  return Error(Stage::kConfig, "", "", "no error");
}

mode_t lmode(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode;
}

// A character device node twin (major, minor) at `path`; false when this process
// may not make one (not root, or a container without CAP_MKNOD).
bool make_char_device(const std::string& path, unsigned major_no, unsigned minor_no) {
  return ::mknod(path.c_str(), S_IFCHR | 0666, makedev(major_no, minor_no)) == 0;
}

TEST(OutputFile, AnAbsentOrRegularFileIsReplacedWholeAndKeepsItsMode) {
  TempDir dir;
  const std::string path = dir.file("r.json");
  write_file_replacing(path, "one\n", "load.report");
  EXPECT_EQ(read_file(path), "one\n");
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  write_file_replacing(path, "two\n", "load.report");
  EXPECT_EQ(read_file(path), "two\n");
  EXPECT_TRUE(S_ISREG(lmode(path)));
  EXPECT_EQ(lmode(path) & 07777, 0600u);  // a private report stays private
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"r.json"});
}

TEST(OutputFile, ASymlinkIsFollowedAndItsTargetReplacedBesideIt) {
  TempDir dir;
  fs::create_directories(dir.path() / "real");
  fs::create_directories(dir.path() / "links");
  write_file(dir.file("real/t.json"), "old\n");
  // A relative link, then a link to that link: every hop is followed.
  fs::create_symlink("../real/t.json", dir.path() / "links/one");
  fs::create_symlink(dir.file("links/one"), dir.path() / "links/two");
  OutputFile out(dir.file("links/two"), Stage::kOutput, "trace.path");
  EXPECT_EQ(fs::path(out.target()).lexically_normal(), (dir.path() / "real/t.json"));
  EXPECT_FALSE(out.in_place());
  out.write("new\n");
  out.commit();
  EXPECT_EQ(read_file(dir.file("real/t.json")), "new\n");
  EXPECT_TRUE(S_ISLNK(lmode(dir.file("links/one"))));
  EXPECT_TRUE(S_ISLNK(lmode(dir.file("links/two"))));
  EXPECT_EQ(names_in(dir.path() / "real"), std::vector<std::string>{"t.json"});
  EXPECT_EQ(names_in(dir.path() / "links"), (std::vector<std::string>{"one", "two"}));

  // A dangling link: its target is created, the link stays a link.
  fs::create_symlink("../real/fresh.json", dir.path() / "links/dangling");
  write_file_replacing(dir.file("links/dangling"), "made\n", "trace.path");
  EXPECT_EQ(read_file(dir.file("real/fresh.json")), "made\n");
  EXPECT_TRUE(S_ISLNK(lmode(dir.file("links/dangling"))));
}

TEST(OutputFile, ASymlinkLoopIsAClearErrorLeavingNothing) {
  TempDir dir;
  fs::create_symlink(dir.file("b"), dir.path() / "a");
  fs::create_symlink(dir.file("a"), dir.path() / "b");
  Error e = error_of([&] { write_file_replacing(dir.file("a"), "x", "metrics.textfile"); });
  EXPECT_EQ(e.stage(), Stage::kOutput);
  EXPECT_NE(e.rule().find("metrics.textfile: cannot write"), std::string::npos) << e.what();
  EXPECT_NE(e.rule().find("too many levels of symlinks"), std::string::npos) << e.what();
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"a", "b"}));
}

TEST(OutputFile, AFifoWithAReaderIsWrittenInPlace) {
  TempDir dir;
  const std::string fifo = dir.file("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);
  write_file_replacing(fifo, "through the pipe\n", "trace.path");  // < the pipe's buffer
  char buf[64] = {};
  const ssize_t n = ::read(reader, buf, sizeof buf);
  ::close(reader);
  EXPECT_EQ(std::string(buf, n > 0 ? static_cast<std::size_t>(n) : 0), "through the pipe\n");
  EXPECT_TRUE(S_ISFIFO(lmode(fifo)));
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"pipe"});
}

TEST(OutputFile, AFifoWithNoReaderIsRefusedAtOnceNotWaitedFor) {
  TempDir dir;
  const std::string fifo = dir.file("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Should the open block (the defect this guards against), a reader appears after
  // 20 s so the test ends, and fails on the time it took.
  std::atomic<bool> done{false};
  std::thread rescue([&] {
    for (int i = 0; i < 200 && !done.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!done.load()) {
      const int fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
      std::this_thread::sleep_for(std::chrono::seconds(1));
      ::close(fd);
    }
  });
  const auto started = std::chrono::steady_clock::now();
  Error e = error_of([&] { write_file_replacing(fifo, "x", "trace.path"); });
  const auto took = std::chrono::steady_clock::now() - started;
  done = true;
  rescue.join();
  EXPECT_LT(took, std::chrono::seconds(10));
  EXPECT_EQ(e.file(), fifo);
  EXPECT_NE(e.rule().find("trace.path: cannot write: the FIFO has no reader"), std::string::npos)
      << e.what();
  EXPECT_TRUE(S_ISFIFO(lmode(fifo)));
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"pipe"});
}

TEST(OutputFile, AFifoWhoseReaderLeftIsAnErrorNotSigpipe) {
  TempDir dir;
  const std::string fifo = dir.file("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);
  OutputFile out(fifo, Stage::kOutput, "load.report");
  EXPECT_TRUE(out.in_place());
  ::close(reader);
  // Unhandled, SIGPIPE would end this test binary here.
  Error e = error_of([&] { out.write("nobody reads this\n"); });
  EXPECT_NE(e.rule().find(errno_text(EPIPE)), std::string::npos) << e.what();
  sigset_t pending;
  sigemptyset(&pending);
  sigpending(&pending);
  EXPECT_EQ(sigismember(&pending, SIGPIPE), 0);  // taken off, not left to fire later
  EXPECT_TRUE(S_ISFIFO(lmode(fifo)));
}

TEST(OutputFile, ACharacterDeviceIsWrittenInPlaceAndStaysADevice) {
  TempDir dir;
  const std::string null = dir.file("null");
  const std::string full = dir.file("full");
  if (!make_char_device(null, 1, 3) || !make_char_device(full, 1, 7)) {
    GTEST_SKIP() << "mknod is not permitted here (" << errno_text(errno)
                 << "); CI runs as root and makes the nodes";
  }
  write_file_replacing(null, "discarded\n", "trace.path");
  EXPECT_TRUE(S_ISCHR(lmode(null)));
  // The /dev/full twin: every write fails with ENOSPC; the node stays a node.
  Error e = error_of([&] { write_file_replacing(full, "x", "trace.path"); });
  EXPECT_EQ(e.stage(), Stage::kOutput);
  EXPECT_EQ(e.file(), full);
  EXPECT_NE(e.rule().find("trace.path: cannot write: " + errno_text(ENOSPC)), std::string::npos)
      << e.what();
  EXPECT_TRUE(S_ISCHR(lmode(full)));
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"full", "null"}));
}

TEST(OutputFile, ThisProcesssOwnDescriptorsAreWrittenWhereTheyStand) {
  TempDir dir;
  // A regular file open on a descriptor, as stdout redirected to a file is: the
  // output follows what was written before, in the same file (not a replacement).
  const std::string log = dir.file("stdout.txt");
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "summary\n", 8), 8);
  struct stat before {};
  ASSERT_EQ(::fstat(fd, &before), 0);
  write_file_replacing("/dev/fd/" + std::to_string(fd), "report\n", "load.report");
  write_file_replacing("/proc/self/fd/" + std::to_string(fd), "trace\n", "trace.path");
  ::close(fd);
  EXPECT_EQ(read_file(log), "summary\nreport\ntrace\n");
  struct stat after {};
  ASSERT_EQ(::stat(log.c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino);
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"stdout.txt"});

  // A pipe, whose /proc link leads to no path: found through the link, in place.
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  write_file_replacing("/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(p[1]),
                       "piped\n", "trace.path");
  ::close(p[1]);
  char buf[16] = {};
  const ssize_t n = ::read(p[0], buf, sizeof buf);
  ::close(p[0]);
  EXPECT_EQ(std::string(buf, n > 0 ? static_cast<std::size_t>(n) : 0), "piped\n");
}

TEST(OutputFile, AFolderIsRefusedNamingItsKind) {
  TempDir dir;
  fs::create_directories(dir.path() / "out");
  Error e = error_of([&] { write_file_replacing(dir.file("out"), "x", "load.report"); });
  EXPECT_NE(e.rule().find("load.report: cannot write: it is a folder"), std::string::npos)
      << e.what();
  EXPECT_TRUE(fs::is_directory(dir.path() / "out"));
  EXPECT_TRUE(fs::is_empty(dir.path() / "out"));
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"out"});
}

TEST(OutputFile, APathWithANulIsRefusedBeforeAnythingIsCreated) {
  TempDir dir;
  const std::string path = dir.file("rep.json") + std::string(1, '\0') + ".evil";
  Error e = error_of([&] { write_file_replacing(path, "x", "load.report"); });
  EXPECT_NE(e.rule().find("the path contains a NUL byte"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("rep.json\\0.evil"), std::string::npos) << e.what();
  EXPECT_TRUE(names_in(dir.path()).empty());
}

TEST(OutputFile, APlantedTemporaryIsNeitherFollowedNorRemoved) {
  TempDir dir;
  write_file(dir.file("victim"), "keep me\n");
  // The old writer opened PATH.tmp by name, following this link into the victim.
  fs::create_symlink(dir.file("victim"), dir.path() / "r.json.tmp");
  write_file_replacing(dir.file("r.json"), "report\n", "load.report");
  EXPECT_EQ(read_file(dir.file("r.json")), "report\n");
  EXPECT_EQ(read_file(dir.file("victim")), "keep me\n");
  EXPECT_TRUE(S_ISLNK(lmode(dir.file("r.json.tmp"))));
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"r.json", "r.json.tmp", "victim"}));
}

// A 64 KiB tmpfs mounted in a temporary folder (root only), unmounted at scope exit.
class SmallTmpfs {
 public:
  SmallTmpfs() {
    fs::create_directories(dir_.path() / "fs");
    mounted_ = ::mount("tmpfs", dir_.file("fs").c_str(), "tmpfs", 0, "size=64k") == 0;
    err_ = errno;
  }
  ~SmallTmpfs() {
    if (mounted_) {
      ::umount2(dir_.file("fs").c_str(), MNT_DETACH);
    }
  }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;
  bool mounted() const { return mounted_; }
  int err() const { return err_; }
  std::string file(const std::string& name) const { return dir_.file("fs/" + name); }
  fs::path path() const { return dir_.path() / "fs"; }

 private:
  TempDir dir_;
  bool mounted_ = false;
  int err_ = 0;
};

TEST(OutputFile, AFullFileSystemLeavesNoEmptyFileNoTemporaryAndTheOldFileIntact) {
  SmallTmpfs small;
  if (!small.mounted()) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << errno_text(small.err())
                 << "); CI runs as root and can";
  }
  const std::string big(std::size_t{1} << 20, 'x');  // 1 MiB into 64 KiB
  Error e = error_of([&] { write_file_replacing(small.file("r.json"), big, "load.report"); });
  EXPECT_EQ(e.stage(), Stage::kOutput);
  EXPECT_NE(e.rule().find("load.report: cannot write: " + errno_text(ENOSPC)), std::string::npos)
      << e.what();
  EXPECT_TRUE(names_in(small.path()).empty());  // no 0-byte report, no temporary

  write_file_replacing(small.file("r.json"), "old\n", "load.report");
  EXPECT_THROW(write_file_replacing(small.file("r.json"), big, "load.report"), Error);
  EXPECT_EQ(read_file(small.file("r.json")), "old\n");
  EXPECT_EQ(names_in(small.path()), std::vector<std::string>{"r.json"});
}

TEST(OutputFile, AnUncommittedFileLeavesNoTemporary) {
  TempDir dir;
  write_file(dir.file("r.json"), "old\n");
  {
    OutputFile out(dir.file("r.json"), Stage::kOutput, "load.report");
    out.write("half");
    EXPECT_EQ(names_in(dir.path()).size(), 2u);  // the temporary, beside it
  }
  EXPECT_EQ(read_file(dir.file("r.json")), "old\n");
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"r.json"});
}

// sync_folder: a folder is synced; anything else is an error naming it, the stage and
// what was being written.
TEST(SyncFolder, SyncsAFolderAndNamesWhatItCannotSync) {
  TempDir dir;
  EXPECT_NO_THROW(sync_folder(dir.path(), Stage::kOutput, "presharded"));
  write_file(dir.file("plain"), "x");
  for (const std::string& bad : {dir.file("missing"), dir.file("plain")}) {
    try {
      sync_folder(bad, Stage::kOutput, "presharded save");
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kOutput);
      EXPECT_EQ(e.file(), bad);
      EXPECT_NE(std::string(e.what()).find("presharded save: cannot sync the folder"),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace ferry
