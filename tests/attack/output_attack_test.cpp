// Attacks on ferry's output paths (hardening round two, items 1, 9 and 10), run
// through the `ferry` CLI in a child process bounded in time:
//   AttackOutputPaths  --trace, --report and --dump-dir aimed at a device node (a
//                      /dev/full or /dev/null twin made with mknod in a temporary
//                      folder), a FIFO with and without a reader, a symlink into
//                      another folder, /dev/stdout, a full file system (a 64 KiB tmpfs).
//                      Before: `--trace /dev/full` turned the device into a regular
//                      file, a symlink was replaced and its target never written, and
//                      a report on a full disk left a 0-byte file.
//   AttackNulPaths     a NUL inside a path key of a config file: refused naming the
//                      key (before: "rep.json\u0000.evil" wrote rep.json).
//   AttackOutputStages a dump that fails on a full disk is labelled "output", not
//                      "synth".
// The device nodes and the mount need root, as CI has; elsewhere those cases skip
// with the reason.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry {
namespace {

using ferry::testing::names_in;

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::read_file;
using testing::RunResult;
using testing::TempDir;

// `ferry ARGS...` bounded to 120 s (a hang shows as status 124).
RunResult run_ferry(std::vector<std::string> args) {
  args.insert(args.begin(), {"timeout", "120", FERRY_BINARY});
  return testing::run(args);
}

// `ferry load` of a tiny synthetic llama on one host device, plus `extra`.
RunResult load(const std::string& model, std::vector<std::string> extra) {
  std::vector<std::string> args = {"load", "--quiet", "--model", model};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_ferry(args);
}

mode_t lmode(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return 0;
  }
  return st.st_mode;
}

class AttackOutputPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::synth_checkpoint(dir_.file("ck"), "llama").dir;
  }
  // A character device twin (major, minor) at `name` in the test's folder; skips
  // the test when this process may not make one.
  std::string char_device(const std::string& name, unsigned major_no, unsigned minor_no) {
    const std::string path = dir_.file(name);
    if (::mknod(path.c_str(), S_IFCHR | 0666, makedev(major_no, minor_no)) != 0) {
      return {};
    }
    return path;
  }

  TempDir dir_;
  std::string model_;
};

#define FERRY_NEED_NODE(path)                                                          \
  if ((path).empty()) {                                                                \
    GTEST_SKIP() << "mknod is not permitted here; CI runs as root and makes the node"; \
  }

TEST_F(AttackOutputPaths, TraceAtADeviceNodeIsWrittenInPlaceNeverReplaced) {
  const std::string full = char_device("full", 1, 7);
  const std::string null = char_device("null", 1, 3);
  FERRY_NEED_NODE(full);
  FERRY_NEED_NODE(null);
  // A failed trace is a warning: the load itself succeeded.
  RunResult r = load(model_, {"--trace", full});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr(full + ": trace.path: cannot write: No space left on device"));
  EXPECT_TRUE(S_ISCHR(lmode(full))) << "the /dev/full twin was replaced";

  r = load(model_, {"--trace", null});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.err, Not(HasSubstr("trace")));
  EXPECT_TRUE(S_ISCHR(lmode(null))) << "the /dev/null twin was replaced";
  EXPECT_EQ(names_in(dir_.path()), (std::vector<std::string>{"ck", "full", "null"}));
}

TEST_F(AttackOutputPaths, TraceThroughASymlinkWritesItsTargetAndKeepsTheLink) {
  fs::create_directories(dir_.path() / "links");
  fs::create_directories(dir_.path() / "real");
  testing::write_file(dir_.file("real/old.json"), "old");
  fs::create_symlink("../real/old.json", dir_.path() / "links/existing");
  fs::create_symlink("../real/new.json", dir_.path() / "links/dangling");
  for (const char* link : {"existing", "dangling"}) {
    RunResult r = load(model_, {"--trace", dir_.file(std::string("links/") + link)});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_TRUE(S_ISLNK(lmode(dir_.file(std::string("links/") + link)))) << link;
  }
  for (const char* target : {"real/old.json", "real/new.json"}) {
    const nlohmann::json trace = nlohmann::json::parse(read_file(dir_.file(target)), nullptr,
                                                       /*allow_exceptions=*/false);
    ASSERT_TRUE(trace.is_object()) << target << " holds no trace";
    EXPECT_FALSE(trace["traceEvents"].empty()) << target;
  }
  EXPECT_EQ(names_in(dir_.path() / "links"), (std::vector<std::string>{"dangling", "existing"}));
  EXPECT_EQ(names_in(dir_.path() / "real"), (std::vector<std::string>{"new.json", "old.json"}));
}

TEST_F(AttackOutputPaths, TraceIntoAFifoReachesItsReaderAndTheFifoStays) {
  const std::string fifo = dir_.file("trace.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // The reader, and a writer of our own so that it sees no end of file before
  // ferry has run (a trace can be larger than the pipe's buffer: it is drained).
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);
  ASSERT_EQ(::fcntl(reader, F_SETFL, 0), 0);
  const int keep_open = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(keep_open, 0);
  std::string received;
  std::thread drain([&] {
    char buf[65536];
    ssize_t n;
    while ((n = ::read(reader, buf, sizeof buf)) > 0) {
      received.append(buf, static_cast<std::size_t>(n));
    }
  });
  RunResult r = load(model_, {"--trace", fifo});
  ::close(keep_open);
  drain.join();
  ::close(reader);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(S_ISFIFO(lmode(fifo))) << "the FIFO was replaced";
  const nlohmann::json trace = nlohmann::json::parse(received, nullptr, false);
  ASSERT_TRUE(trace.is_object()) << "the reader got: " << received.substr(0, 200);
  EXPECT_FALSE(trace["traceEvents"].empty());
}

TEST_F(AttackOutputPaths, TraceIntoAFifoWithNoReaderWarnsAndDoesNotHang) {
  const std::string fifo = dir_.file("trace.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  RunResult r = load(model_, {"--trace", fifo});
  EXPECT_EQ(r.status, 0) << r.err;  // not 124: the open did not wait for a reader
  EXPECT_THAT(r.err, HasSubstr("trace.path: cannot write: the FIFO has no reader"));
  EXPECT_TRUE(S_ISFIFO(lmode(fifo))) << "the FIFO was replaced";
  EXPECT_EQ(names_in(dir_.path()), (std::vector<std::string>{"ck", "trace.fifo"}));
}

TEST_F(AttackOutputPaths, ReportAtADeviceNodeFailsNamingTheKeyAndTheNodeStays) {
  const std::string full = char_device("full", 1, 7);
  FERRY_NEED_NODE(full);
  RunResult r = load(model_, {"--report", full});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_THAT(r.err,
              HasSubstr("output: " + full + ": load.report: cannot write: No space left on device"));
  EXPECT_TRUE(S_ISCHR(lmode(full))) << "the /dev/full twin was replaced";
}

TEST_F(AttackOutputPaths, ReportToDevStdoutFollowsTheSummaryInTheSameStream) {
  // testing::run sends stdout to a regular file: the report is added to it, after
  // the summary, instead of replacing the file the descriptor's link leads to.
  RunResult r = load(model_, {"--report", "/dev/stdout"});
  ASSERT_EQ(r.status, 0) << r.err;
  const std::size_t json = r.out.find("{\n");
  ASSERT_NE(json, std::string::npos) << r.out;
  EXPECT_THAT(r.out.substr(0, json), HasSubstr("tp rank 0 on host:0"));
  const nlohmann::json report = nlohmann::json::parse(r.out.substr(json), nullptr, false);
  ASSERT_TRUE(report.is_object()) << r.out;
  EXPECT_TRUE(report.contains("bytes_read"));
}

// A 64 KiB tmpfs in a temporary folder, filled to the last byte; unmounted at exit.
class FullTmpfs {
 public:
  FullTmpfs() {
    fs::create_directories(dir_.path() / "fs");
    mounted_ = ::mount("tmpfs", mount_point().c_str(), "tmpfs", 0, "size=64k") == 0;
    if (!mounted_) {
      why_ = errno_text(errno);
      return;
    }
    std::ofstream filler(mount_point() + "/filler", std::ios::binary);
    const std::string block(4096, 'f');
    for (int i = 0; i < 64 && filler; ++i) {
      filler.write(block.data(), static_cast<std::streamsize>(block.size()));
      filler.flush();
    }
  }
  ~FullTmpfs() {
    if (mounted_) {
      ::umount2(mount_point().c_str(), MNT_DETACH);
    }
  }
  FullTmpfs(const FullTmpfs&) = delete;
  FullTmpfs& operator=(const FullTmpfs&) = delete;

  bool mounted() const { return mounted_; }
  const std::string& why() const { return why_; }
  std::string mount_point() const { return dir_.file("fs"); }

 private:
  TempDir dir_;
  bool mounted_ = false;
  std::string why_;
};

TEST_F(AttackOutputPaths, ReportOnAFullFileSystemLeavesNoEmptyFile) {
  FullTmpfs full;
  if (!full.mounted()) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << full.why() << "); CI runs as root and can";
  }
  const std::string report = full.mount_point() + "/r.json";
  RunResult r = load(model_, {"--report", report});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("output: " + report +
                               ": load.report: cannot write: No space left on device"));
  EXPECT_EQ(names_in(full.mount_point()), std::vector<std::string>{"filler"})
      << "a 0-byte report or a temporary was left";
}

// Every path key read from a config file, with a NUL inside its value.
TEST(AttackNulPaths, ANulInAnyPathKeyOfAConfigFileIsRefusedNamingTheKey) {
  TempDir dir;
  const std::string model = testing::synth_checkpoint(dir.file("ck"), "llama").dir;
  const std::string evil = dir.file("rep.json") + std::string(1, '\0') + ".evil";
  struct Case {
    const char* key;
    nlohmann::json config;
  };
  const std::vector<Case> cases = {
      {"model.path", {{"model", {{"path", model + std::string(1, '\0') + "x"}}}}},
      {"model.eplb_map", {{"model", {{"eplb_map", evil}}}}},
      {"load.report", {{"load", {{"report", evil}}}}},
      {"load.dump_dir", {{"load", {{"dump_dir", evil}}}}},
      {"metrics.textfile", {{"metrics", {{"textfile", evil}}}}},
      {"trace.path", {{"trace", {{"path", evil}}}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    const std::string config = dir.file("config.json");
    testing::write_file(config, c.config.dump());  // the NUL as \u0000
    ASSERT_NE(read_file(config).find("\\u0000"), std::string::npos);
    std::vector<std::string> args = {"load", "--quiet", "--config", config};
    if (std::string(c.key) != "model.path") {
      args.insert(args.end(), {"--model", model});
    }
    RunResult r = run_ferry(args);
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(std::string(c.key) + ": contains a NUL byte"));
    EXPECT_THAT(r.err, HasSubstr("\\u0000"));  // the whole value is shown
    EXPECT_FALSE(fs::exists(dir.file("rep.json"))) << "the truncated path was written";
  }
}

TEST_F(AttackOutputPaths, ADumpOnAFullDiskIsStageOutputAndLeavesNothing) {
  // The dump's first file is a /dev/full twin: written in place, every write ENOSPC.
  fs::create_directories(dir_.path() / "dump");
  const std::string full = char_device("dump/rank-0.safetensors", 1, 7);
  FERRY_NEED_NODE(full);
  RunResult r = load(model_, {"--dump-dir", dir_.file("dump")});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("ferry load: error: output: " + full +
                               ": dump: cannot write: No space left on device"));
  EXPECT_THAT(r.err, Not(HasSubstr("synth")));
  EXPECT_TRUE(S_ISCHR(lmode(full))) << "the device node was replaced or removed";
}

TEST(AttackOutputStages, ADumpIntoAFullFileSystemIsStageOutputAndLeavesNoFile) {
  FullTmpfs full;
  if (!full.mounted()) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << full.why() << "); CI runs as root and can";
  }
  TempDir dir;
  const std::string model = testing::synth_checkpoint(dir.file("ck"), "llama").dir;
  const std::string dump = full.mount_point() + "/dump";
  RunResult r = run_ferry({"load", "--quiet", "--model", model, "--dump-dir", dump});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("ferry load: error: output: " + dump +
                               "/rank-0.safetensors: dump: cannot write: No space left on device"));
  ASSERT_TRUE(fs::is_directory(dump));
  EXPECT_TRUE(fs::is_empty(dump)) << "a partial dump file or a temporary was left";
}

}  // namespace
}  // namespace ferry
