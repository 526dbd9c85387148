// Attacks on the weight files themselves (hardening round two, items 4 and 7).
//
// AttackFileChange: a shard rewritten in place (same inode, same size: what
// `dd conv=notrunc` of other weights over it does) while the load reads it. The
// open-time identity check cannot see a change that comes after it; a load that
// went on gave weights that were neither the old nor the new ones, with exit 0.
// Now each lane fstats a file again after its last read of it and fails the load
// naming the file. Staged and direct-into-parameter reads, one and four lanes, and
// the CLI under a bandwidth cap.
//
// AttackManyShards: a checkpoint of 5,000 shards. ferry keeps a descriptor per
// shard, so under the usual soft limit of 1024 open files such a load failed. It
// raises the soft limit toward the hard one now, fails early and clearly past the
// hard limit, and lets go of the shards its plan reads nothing of.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "io/reader.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "synth/synth.hpp"
#include "testing/process_census.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using testing::Checkpoint;
using testing::make_config;
using testing::read_file;
using testing::synth_checkpoint;
using testing::TempDir;

// ---- helpers ---------------------------------------------------------------------

std::vector<std::string> shards_of(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") {
      out.push_back(e.path().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Writes `bytes` over the start of `path` without truncating it (dd conv=notrunc):
// the same inode, and the same size when `bytes` is as long as the file.
void write_in_place(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path;
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd, bytes.data() + done, bytes.size() - done,
                               static_cast<off_t>(done));
    ASSERT_GT(n, 0) << path;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
}

// Sets every shard's mtime an hour back, so that a rewrite during the load moves it
// whatever the file system's timestamp granularity (a rewrite within the same
// clock tick as the synthesis would leave it as it was).
void age_shards(const std::string& dir) {
  for (const std::string& s : shards_of(dir)) {
    fs::last_write_time(s, fs::file_time_type::clock::now() - std::chrono::hours(1));
  }
}

// The first poll that returns a completion, in any lane, runs `action` once; every
// other lane's first completion waits for it to have run (bounded). So no lane
// hands over a second window before the action: each is still inside the file it
// started with.
class Gate {
 public:
  explicit Gate(std::function<void()> action) : action_(std::move(action)) {}
  void arrive() {
    std::unique_lock lock(mu_);
    if (!started_) {
      started_ = true;
      lock.unlock();
      action_();
      lock.lock();
      done_ = true;
      cv_.notify_all();
      return;
    }
    cv_.wait_for(lock, std::chrono::seconds(60), [this] { return done_; });
  }
  bool done() const {
    std::lock_guard lock(mu_);
    return done_;
  }

 private:
  std::function<void()> action_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool started_ = false;
  bool done_ = false;
};

// The paths of the files whose reads have started, in any lane.
struct Started {
  std::mutex mu;
  std::set<std::string> paths;
  std::set<std::string> names;
};

// A lane's reader, decorated: records the files it reads, and at its first
// completion arrives at the gate.
class GatedReader final : public io::Reader {
 public:
  GatedReader(std::unique_ptr<io::Reader> inner, std::shared_ptr<Gate> gate,
              std::shared_ptr<Started> started)
      : inner_(std::move(inner)), gate_(std::move(gate)), started_(std::move(started)) {}
  void submit(const io::ReadOp& op) override {
    {
      std::lock_guard lock(started_->mu);
      started_->paths.insert(op.file->path());
      started_->names.insert(op.file->display());
    }
    inner_->submit(op);
  }
  std::size_t poll(std::vector<io::Completion>& out, std::chrono::milliseconds wait) override {
    const std::size_t n = inner_->poll(out, wait);
    if (n > 0 && !arrived_) {
      arrived_ = true;
      gate_->arrive();
    }
    return n;
  }
  std::size_t outstanding() const override { return inner_->outstanding(); }
  const io::ReaderStats& stats() const override { return inner_->stats(); }
  std::string name() const override { return inner_->name(); }
  bool cancel(std::chrono::milliseconds bound) noexcept override { return inner_->cancel(bound); }

 private:
  std::unique_ptr<io::Reader> inner_;
  std::shared_ptr<Gate> gate_;
  std::shared_ptr<Started> started_;
  bool arrived_ = false;
};

bool accepts_direct(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd >= 0) {
    ::close(fd);
  }
  return fd >= 0;
}

// ---- AttackFileChange ------------------------------------------------------------

struct ChangeCase {
  const char* name;
  std::vector<std::string> sets;
};

class AttackFileChange : public ::testing::TestWithParam<ChangeCase> {};

// Other weights (seed 2: the same names, shapes and offsets, other values) written
// over every shard whose reads have started, at the first completed read: the
// classic torn load. Each lane is then inside its first file, so the load must fail
// with the post-read check, naming one of those files.
TEST_P(AttackFileChange, AShardRewrittenInPlaceWhileItIsReadFailsTheLoad) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  Checkpoint other = synth_checkpoint(dir.file("other"), "llama", false, 2);
  const std::vector<std::string>& sets = GetParam().sets;
  if (std::find(sets.begin(), sets.end(), "io.direct=true") != sets.end() &&
      !accepts_direct(shards_of(ck.dir).front())) {
    GTEST_SKIP() << "no O_DIRECT on this file system";
  }
  age_shards(ck.dir);
  auto started = std::make_shared<Started>();
  std::set<std::string> rewritten;
  auto gate = std::make_shared<Gate>([&] {
    std::lock_guard lock(started->mu);
    for (const std::string& path : started->paths) {
      const std::string name = fs::path(path).filename().string();
      const std::string bytes = read_file(other.dir + "/" + name);
      ASSERT_EQ(bytes.size(), fs::file_size(path)) << "seed 2 must have the same layout";
      write_in_place(path, bytes);
      rewritten.insert(name);
    }
  });
  RuntimeTestSeams hooks;
  hooks.wrap_reader = [&](std::unique_ptr<io::Reader> inner) -> std::unique_ptr<io::Reader> {
    return std::make_unique<GatedReader>(std::move(inner), gate, started);
  };
  std::vector<std::string> all = {"io.chunk_bytes=4096"};
  all.insert(all.end(), sets.begin(), sets.end());
  Runtime rt = make_runtime(to_config(make_config(ck.dir, all)), hooks);
  LoadResult r = rt.load();
  ASSERT_TRUE(gate->done()) << "no read completed";
  ASSERT_FALSE(rewritten.empty());
  ASSERT_FALSE(r) << "a shard rewritten mid-read loaded (torn weights)";
  EXPECT_EQ(r.error->stage, Stage::kRead) << r.error->message;
  EXPECT_EQ(rewritten.count(r.error->file), 1u) << r.error->message;
  EXPECT_NE(r.error->message.find("changed while it was being read (mtime (ns) "),
            std::string::npos)
      << r.error->message;
}

INSTANTIATE_TEST_SUITE_P(
    Paths, AttackFileChange,
    ::testing::Values(
        ChangeCase{"staged_one_lane", {"io.read_lanes=1", "io.direct_to_device=off"}},
        ChangeCase{"staged_four_lanes", {"io.read_lanes=4", "io.direct_to_device=off"}},
        ChangeCase{"into_params_one_lane", {"io.read_lanes=1", "io.direct_to_device=on"}},
        ChangeCase{"into_params_four_lanes", {"io.read_lanes=4", "io.direct_to_device=on"}},
        ChangeCase{"o_direct_four_lanes",
                   {"io.read_lanes=4", "io.direct=true", "io.direct_to_device=off"}},
        ChangeCase{"pread_one_lane", {"io.read_lanes=1", "io.engine=pread"}}),
    [](const ::testing::TestParamInfo<ChangeCase>& param) { return std::string(param.param.name); });

// A shard renamed over mid-load is not a change of the file being read (its
// descriptor still reads the original): the load goes on, with the original
// weights, although the old inode's ctime moved (it lost its link).
TEST(AttackFileChangeRename, AShardRenamedOverWhileItIsReadStillLoadsTheOriginal) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  auto started = std::make_shared<Started>();
  auto gate = std::make_shared<Gate>([&] {
    std::lock_guard lock(started->mu);
    for (const std::string& path : started->paths) {
      const std::string tmp = path + ".new";
      testing::write_file(tmp, std::string(fs::file_size(path), '\x5a'));
      fs::rename(tmp, path);
    }
  });
  RuntimeTestSeams hooks;
  hooks.wrap_reader = [&](std::unique_ptr<io::Reader> inner) -> std::unique_ptr<io::Reader> {
    return std::make_unique<GatedReader>(std::move(inner), gate, started);
  };
  Runtime rt = make_runtime(
      to_config(make_config(ck.dir, {"io.chunk_bytes=4096", "io.read_lanes=1"})), hooks);
  LoadResult r = rt.load();
  ASSERT_TRUE(gate->done());
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_EQ(testing::expect_matches_reference(*r.model, ck, 1, DType::kBF16), 27u);
}

// Runs `argv` with its standard output and error in files; kills it after `bound`.
struct Child {
  pid_t pid = -1;
  std::string out_path;
  std::string err_path;
};

Child spawn(const std::vector<std::string>& argv, const TempDir& dir, rlim_t soft = 0,
            rlim_t hard = 0) {
  Child c;
  c.out_path = dir.file("child.out");
  c.err_path = dir.file("child.err");
  std::vector<char*> args;
  for (const std::string& a : argv) {
    args.push_back(const_cast<char*>(a.c_str()));
  }
  args.push_back(nullptr);
  const int out = ::open(c.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const int err = ::open(c.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  c.pid = ::fork();
  if (c.pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    ::dup2(out, 1);
    ::dup2(err, 2);
    if (soft != 0) {
      struct rlimit rl {};
      rl.rlim_cur = soft;
      rl.rlim_max = hard;
      if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) {
        ::_exit(125);
      }
    }
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out);
  ::close(err);
  return c;
}

// The child's exit status, or -1 when it had to be killed after `bound`.
int wait_child(const Child& c, std::chrono::seconds bound) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  int status = 0;
  while (::waitpid(c.pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The attack as it was made: `ferry load` slowed by a bandwidth cap, and other
// weights dd'ed over the last shard (read last, by the one lane) once the load
// streams. The load must fail naming that shard, not exit 0.
TEST(AttackFileChangeCli, DdOverAShardDuringASlowedLoadFailsIt) {
  TempDir dir;
  synth::SynthOptions o;
  o.family = "llama";
  o.preset = "small";
  o.fsync = false;
  o.shard_bytes = 4u << 20;
  o.out = dir.file("ck");
  synth::synthesize(o);
  o.out = dir.file("other");
  o.seed = 2;
  synth::synthesize(o);
  age_shards(dir.file("ck"));
  const std::vector<std::string> shards = shards_of(dir.file("ck"));
  ASSERT_GE(shards.size(), 3u);
  const std::string last = shards.back();
  const std::string name = fs::path(last).filename().string();
  const std::string bytes = read_file(dir.file("other") + "/" + name);
  ASSERT_EQ(bytes.size(), fs::file_size(last));
  // 10 MB/s (the lowest cap the config takes) over tens of MB: seconds of stream.
  Child c = spawn({FERRY_BINARY, "load", "--model", dir.file("ck"), "--set",
                   "host.bandwidth_gbps=0.01", "--set", "io.read_lanes=1", "--set",
                   "io.chunk_bytes=1MiB"},
                  dir);
  ASSERT_GT(c.pid, 0);
  // Wait for the stream phase on the progress lines (bounded).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool streaming = false;
  while (!streaming && std::chrono::steady_clock::now() < deadline) {
    streaming = read_file(c.err_path).find("progress: stream") != std::string::npos;
    if (!streaming) {
      int status = 0;
      if (::waitpid(c.pid, &status, WNOHANG) != 0) {
        FAIL() << "ferry ended before streaming: " << read_file(c.err_path);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ASSERT_TRUE(streaming) << read_file(c.err_path);
  write_in_place(last, bytes);
  const int status = wait_child(c, std::chrono::seconds(300));
  const std::string err = read_file(c.err_path);
  ASSERT_EQ(status, 1) << err;
  EXPECT_NE(err.find("read: " + name + ": changed "), std::string::npos) << err;
}

// ---- AttackManyShards ------------------------------------------------------------

// A llama of `layers` tiny layers with every tensor in a shard of its own (9 per
// layer, plus the embedding, the final norm and lm_head), written sparse: headers
// only, so thousands of shards take a second.
std::size_t synth_many_shards(const std::string& out, const TempDir& dir, std::uint64_t layers) {
  nlohmann::json config =
      synth::synth_config("llama", "tiny", DType::kBF16, /*tie_embeddings=*/false);
  config["num_hidden_layers"] = layers;
  const std::string config_path = dir.file("many-config.json");
  testing::write_file(config_path, config.dump());
  synth::SynthOptions o;
  o.from_config = config_path;
  o.out = out;
  o.shard_bytes = 1;  // one tensor per shard
  o.sparse = true;
  o.fsync = false;
  return synth::synthesize(o).shards;
}

class AttackManyShards : public ::testing::Test {
 protected:
  // 556 layers: 5,007 shards, built once for the suite.
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    shards_ = synth_many_shards(dir_->file("ck"), *dir_, 556);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string ck() { return dir_->file("ck"); }
  static TempDir* dir_;
  static std::size_t shards_;
};
TempDir* AttackManyShards::dir_ = nullptr;
std::size_t AttackManyShards::shards_ = 0;

rlim_t hard_limit() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return RLIM_INFINITY;  // unknown: the tests below then run as if unbounded
  }
  return rl.rlim_max;
}

TEST_F(AttackManyShards, FiveThousandShardsLoadUnderASoftLimitOf1024) {
  ASSERT_GE(shards_, 5000u);
  const rlim_t hard = hard_limit();
  if (hard != RLIM_INFINITY && hard < shards_ + 200) {
    GTEST_SKIP() << "the hard open-file limit here (" << hard << ") is below the shard count";
  }
  TempDir out;
  Child c = spawn({FERRY_BINARY, "load", "--model", ck(), "--quiet"}, out, 1024, hard);
  ASSERT_GT(c.pid, 0);
  const int status = wait_child(c, std::chrono::seconds(280));
  const std::string err = read_file(c.err_path);
  ASSERT_EQ(status, 0) << err;
  EXPECT_NE(read_file(c.out_path).find("loaded " + std::to_string(shards_) + " tensors"),
            std::string::npos)
      << read_file(c.out_path);
  EXPECT_NE(err.find("soft limit raised from 1024 to "), std::string::npos) << err;
}

TEST_F(AttackManyShards, PastTheHardLimitTheLoadFailsEarlyNamingTheLimitAndTheCount) {
  TempDir out;
  // As root the child may lower its hard limit; anyone may.
  Child c = spawn({FERRY_BINARY, "load", "--model", ck(), "--quiet"}, out, 2048, 2048);
  ASSERT_GT(c.pid, 0);
  const int status = wait_child(c, std::chrono::seconds(120));
  const std::string err = read_file(c.err_path);
  ASSERT_EQ(status, 1) << err;
  EXPECT_NE(err.find("resources: " + ck() + ": " + std::to_string(shards_) +
                     " weight files need about "),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("RLIMIT_NOFILE hard limit 2048"), std::string::npos) << err;
  EXPECT_EQ(err.find("Too many open files"), std::string::npos) << err;
}

// A pipeline rank reads a few dozen of the 5,007 shards: the others' descriptors
// are let go once planned, so the stream holds few.
TEST_F(AttackManyShards, APlanThatReadsFewShardsKeepsFewDescriptors) {
  const rlim_t hard = hard_limit();
  if (hard != RLIM_INFINITY && hard < shards_ + 200) {
    GTEST_SKIP() << "the hard open-file limit here (" << hard << ") is below the shard count";
  }
  const std::size_t before = testing::open_fds();
  std::atomic<std::size_t> most{0};
  RuntimeTestSeams hooks;
  hooks.before_copy = [&](std::size_t, const std::string&) {
    const std::size_t now = testing::open_fds();
    std::size_t seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
  };
  // 556 layers over 64 stages: 8 or 9 layers, 9 shards each, for rank 1.
  Runtime rt =
      make_runtime(to_config(make_config(ck(), {"parallel.pp=64", "parallel.pp_rank=1"})), hooks);
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  ASSERT_GT(most.load(), 0u) << "no copy ran";
  EXPECT_LT(most.load(), before + 200) << "descriptors held while streaming";
  r.model.reset();
  EXPECT_EQ(testing::open_fds(), before);
}

}  // namespace
}  // namespace ferry::runtime
