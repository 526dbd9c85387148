// Attacks through configuration (hardening round two, items 2, 8 and 12), repeated
// so they stay fixed:
//   - AttackConfigFiles: config.json, hf_quant_config.json, the index and ferry's own
//     config file as a link to /dev/zero (memory grew past 8 GB), a FIFO (the load
//     hung forever), a character device, a 100 MiB sparse file; io.max_metadata_bytes.
//   - AttackMetricsListen: metrics.listen=999.1.1.1:19125 was accepted and bound
//     231.1.1.1.
//   - AttackThrottle: host.bandwidth_gbps=1e-300 made a load that never finished, and
//     at 1e-5 a cancel waited for the copies booked on the emulated link.
// The CLI runs in a child process bounded in time (`timeout`), so a regression
// shows as a failure (status 124), never as a stuck suite.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/load_config.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

struct Timed {
  testing::RunResult result;
  double seconds = 0;
};

// `ferry ARGS...` in a child bounded to `limit_s` seconds (status 124 past it).
Timed run_ferry(std::vector<std::string> args, int limit_s = 60) {
  args.insert(args.begin(), {"timeout", std::to_string(limit_s), FERRY_BINARY});
  const Clock::time_point t0 = Clock::now();
  Timed t;
  t.result = testing::run(args);
  t.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return t;
}

// Runs `fn`, expects a config-stage ferry::Error and returns its message.
std::string config_error(const std::function<void()>& fn) {
  return testing::error_of(Stage::kConfig, fn);
}

LoadConfig from_sets(const std::vector<std::string>& sets) {
  ConfigBuilder b;
  for (const auto& s : sets) {
    b.apply_set(s);
  }
  return b.build();
}

// What may stand at a metadata file's path instead of a file.
enum class Hostile { kDevZeroLink, kFifo, kHugeSparse };

std::string name_of(Hostile h) {
  switch (h) {
    case Hostile::kDevZeroLink:
      return "a link to /dev/zero";
    case Hostile::kFifo:
      return "a FIFO";
    case Hostile::kHugeSparse:
      return "a 100 MiB sparse file";
  }
  return "?";
}

// Replaces `path` with `h`; returns the words the error must contain.
std::string plant(const std::string& path, Hostile h) {
  std::filesystem::remove(path);
  switch (h) {
    case Hostile::kDevZeroLink:
      std::filesystem::create_symlink("/dev/zero", path);
      return "is a character device, not a regular file";
    case Hostile::kFifo:
      EXPECT_EQ(::mkfifo(path.c_str(), 0600), 0) << errno;
      return "is a FIFO, not a regular file";
    case Hostile::kHugeSparse:
      testing::write_file(path, "{");
      std::filesystem::resize_file(path, std::uint64_t{100} << 20);
      return "is 104857600 bytes, over the cap of 67108864 bytes";
  }
  return "?";
}

constexpr Hostile kAll[] = {Hostile::kDevZeroLink, Hostile::kFifo, Hostile::kHugeSparse};

class AttackConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override { ck_ = testing::synth_checkpoint(dir_.file("ck"), "llama"); }
  std::string file(const std::string& name) const { return ck_.dir + "/" + name; }
  // Loads the checkpoint through the CLI; expects a failure naming `name` with `words`,
  // quickly (before the fix a FIFO hung, /dev/zero grew memory until killed).
  void expect_refused(const std::string& name, const std::string& words,
                      std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"load", "--model", ck_.dir, "--quiet"};
    args.insert(args.end(), extra.begin(), extra.end());
    const Timed t = run_ferry(args, 30);
    EXPECT_EQ(t.result.status, 1) << t.result.err;  // not 124 (a hang), not a crash
    EXPECT_LT(t.seconds, 20.0);
    EXPECT_THAT(t.result.err, AllOf(HasSubstr(name), HasSubstr(words)));
  }

  testing::TempDir dir_;
  testing::Checkpoint ck_;
};

TEST_F(AttackConfigFiles, ConfigJsonAsADevZeroLinkAFifoOrHugeIsRefusedNamingIt) {
  const std::string original = testing::read_file(file("config.json"));
  for (Hostile h : kAll) {
    SCOPED_TRACE(name_of(h));
    const std::string words = plant(file("config.json"), h);
    expect_refused(file("config.json"), words);
    std::filesystem::remove(file("config.json"));
    testing::write_file(file("config.json"), original);
  }
  // Put back, it loads.
  EXPECT_EQ(run_ferry({"load", "--model", ck_.dir, "--quiet"}).result.status, 0);
}

TEST_F(AttackConfigFiles, HfQuantConfigAsADevZeroLinkAFifoOrHugeIsRefusedNamingIt) {
  for (Hostile h : kAll) {
    SCOPED_TRACE(name_of(h));
    const std::string words = plant(file("hf_quant_config.json"), h);
    expect_refused(file("hf_quant_config.json"), words);
    std::filesystem::remove(file("hf_quant_config.json"));
  }
}

TEST_F(AttackConfigFiles, TheIndexAsADevZeroLinkAFifoOrHugeIsRefusedNamingIt) {
  const std::string index = "model.safetensors.index.json";
  const std::string original = testing::read_file(file(index));
  for (Hostile h : kAll) {
    SCOPED_TRACE(name_of(h));
    // Discovery's probe names a link to a device or a FIFO before the read does.
    const std::string words = plant(file(index), h);
    expect_refused(index, h == Hostile::kHugeSparse ? words : "not a readable file");
    std::filesystem::remove(file(index));
    testing::write_file(file(index), original);
  }
}

TEST_F(AttackConfigFiles, AnOwnCharacterDeviceAsConfigJsonIsRefusedAndLeftAlone) {
  std::filesystem::remove(file("config.json"));
  // A node of our own with /dev/zero's numbers (1, 5); never the real one.
  if (::mknod(file("config.json").c_str(), S_IFCHR | 0600, makedev(1, 5)) != 0) {
    GTEST_SKIP() << "mknod refused (errno " << errno << "): no CAP_MKNOD here";
  }
  expect_refused(file("config.json"), "is a character device, not a regular file");
  struct stat st {};
  ASSERT_EQ(::stat(file("config.json").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST_F(AttackConfigFiles, TheFerryConfigFileIsReadWithTheDefaultCap) {
  for (Hostile h : kAll) {
    SCOPED_TRACE(name_of(h));
    const std::string path = dir_.file("ferry.json");
    const std::string words = plant(path, h);
    const Timed t = run_ferry({"load", "--model", ck_.dir, "--config", path, "--quiet"}, 30);
    EXPECT_EQ(t.result.status, 2) << t.result.err;  // a usage error, as every bad config is
    EXPECT_LT(t.seconds, 20.0);
    EXPECT_THAT(t.result.err, AllOf(HasSubstr(path), HasSubstr("the config file " + words)));
    std::filesystem::remove(path);
  }
}

TEST_F(AttackConfigFiles, MaxMetadataBytesIsAKeyWithARangeThatCapsEveryMetadataFile) {
  EXPECT_EQ(LoadConfig{}.io.max_metadata_bytes, std::uint64_t{64} << 20);
  EXPECT_EQ(from_sets({"io.max_metadata_bytes=1MiB"}).io.max_metadata_bytes, 1u << 20);
  EXPECT_THAT(config_error([] { from_sets({"io.max_metadata_bytes=1000"}); }),
              HasSubstr("io.max_metadata_bytes: expected 65536 to 4294967296 bytes"));
  EXPECT_THAT(config_error([] { from_sets({"io.max_metadata_bytes=5GiB"}); }),
              HasSubstr("io.max_metadata_bytes: expected 65536 to 4294967296 bytes"));
  // A real config.json padded to 100 KiB with spaces: over a 64 KiB cap, under the
  // default.
  std::string text = testing::read_file(file("config.json"));
  text.resize(100 << 10, ' ');
  testing::write_file(file("config.json"), text);
  expect_refused(file("config.json"), "is 102400 bytes, over the cap of 65536 bytes",
                 {"--set", "io.max_metadata_bytes=64KiB"});
  EXPECT_EQ(run_ferry({"load", "--model", ck_.dir, "--quiet"}).result.status, 0);
}

// ---- metrics.listen -------------------------------------------------------------

TEST(AttackMetricsListen, AnAddressOutOfRangeIsRefusedNotWrapped) {
  testing::TempDir dir;
  const testing::Checkpoint ck = testing::synth_checkpoint(dir.file("ck"), "llama");
  const Timed bad = run_ferry(
      {"load", "--model", ck.dir, "--set", "metrics.listen=999.1.1.1:19125", "--quiet"});
  EXPECT_EQ(bad.result.status, 2) << bad.result.err;
  EXPECT_THAT(bad.result.err, AllOf(HasSubstr("metrics.listen"), HasSubstr("\"999.1.1.1\""),
                                    HasSubstr("neither an IPv4 address")));
  for (const std::string value : {"1.2.3.256:9400", "[::1:9400", "::1:9400", "[zz::1]:9400",
                                  "bad_host:9400", "-x.example:1", "1.2.3.4"}) {
    SCOPED_TRACE(value);
    EXPECT_THAT(config_error([&] { from_sets({"metrics.listen=" + value}); }),
                HasSubstr("metrics.listen: "));
  }
  EXPECT_EQ(from_sets({"metrics.listen=[::1]:0"}).metrics.listen, "[::1]:0");
  EXPECT_EQ(from_sets({"metrics.listen=localhost:0"}).metrics.listen, "localhost:0");
  // A good address still serves (loopback; port 0 picks a free one).
  const Timed good =
      run_ferry({"load", "--model", ck.dir, "--set", "metrics.listen=127.0.0.1:0", "--quiet"});
  EXPECT_EQ(good.result.status, 0) << good.result.err;
}

// ---- host.bandwidth_gbps ----------------------------------------------------------

TEST(AttackThrottle, ABandwidthOutsideItsRangeIsRefusedNamingTheKey) {
  for (const std::string value : {"1e-300", "1e-5", "0.009", "10001", "1e300", "-1"}) {
    SCOPED_TRACE(value);
    EXPECT_THAT(config_error([&] { from_sets({"host.bandwidth_gbps=" + value}); }),
                HasSubstr("host.bandwidth_gbps: expected"));
  }
  EXPECT_THAT(config_error([] { from_sets({"host.bandwidth_gbps=1e-5"}); }),
              HasSubstr("expected 0 (no cap) or a number from 0.01 to 10000 GB/s"));
  EXPECT_EQ(from_sets({"host.bandwidth_gbps=0"}).host.bandwidth_gbps, 0);
  EXPECT_EQ(from_sets({"host.bandwidth_gbps=0.01"}).host.bandwidth_gbps, 0.01);
  EXPECT_EQ(from_sets({"host.bandwidth_gbps=10000"}).host.bandwidth_gbps, 10000);
  testing::TempDir dir;
  const testing::Checkpoint ck = testing::synth_checkpoint(dir.file("ck"), "llama");
  const Timed t =
      run_ferry({"load", "--model", ck.dir, "--set", "host.bandwidth_gbps=1e-300", "--quiet"});
  EXPECT_EQ(t.result.status, 2) << t.result.err;
  EXPECT_THAT(t.result.err, HasSubstr("host.bandwidth_gbps"));
}

// A load at the lowest bandwidth allowed (10 MB/s) of a checkpoint that takes
// about half a minute at it, in 64 MiB chunks (6.7 s each on the emulated link): a
// cancel while the copy worker sleeps on the link ends the load at once. Before,
// the worker slept until its oldest chunk had crossed the link, then its stream's
// synchronize slept until the link had carried every chunk booked on it: about
// 12 s after the cancel.
TEST(AttackThrottle, ACancelAtTheLowestBandwidthIsHonouredAtOnce) {
  testing::TempDir dir;
  // Llama "small" (hidden 512) with 40 layers instead of 4: about 240 MB, sparse.
  {
    synth::SynthOptions o;
    o.family = "llama";
    o.preset = "small";
    o.out = dir.file("small");
    o.sparse = true;
    o.fsync = false;
    synth::synthesize(o);
  }
  nlohmann::json config = nlohmann::json::parse(testing::read_file(dir.file("small/config.json")));
  config["num_hidden_layers"] = 40;
  testing::write_file(dir.file("config.json"), config.dump(2));
  synth::SynthOptions o;
  o.from_config = dir.file("config.json");
  o.out = dir.file("ck");
  o.sparse = true;
  o.fsync = false;
  const synth::SynthResult synth = synth::synthesize(o);
  ASSERT_GT(synth.total_bytes, std::uint64_t{200} << 20);

  ConfigBuilder b;
  b.apply_set("model.path=" + dir.file("ck"));
  b.apply_set("host.bandwidth_gbps=0.01");
  b.apply_set("io.chunk_bytes=64MiB");
  b.apply_set("io.staging_bytes=128MiB");
  b.apply_set("io.cancel_timeout_ms=1000");
  Runtime rt(to_config(b.build()));
  LoadHandle handle = rt.start();
  // Wait (bounded) until chunks are on the emulated link and the copy worker sleeps
  // on it: bytes copied, and no more for half a second (a cancel that came while the
  // worker still queued a chunk's fragments would stop it between two of them).
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(120);
  std::uint64_t last = 0;
  Clock::time_point last_change = Clock::now();
  while (!handle.done() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const std::uint64_t now = handle.progress().bytes_copied;
    if (now != last) {
      last = now;
      last_change = Clock::now();
    } else if (now != 0 && Clock::now() - last_change > std::chrono::milliseconds(500)) {
      break;
    }
  }
  ASSERT_GT(handle.progress().bytes_copied, 0u) << "no copy started within 120 s";
  ASSERT_FALSE(handle.done()) << "the load ended before it could be cancelled";
  const Clock::time_point cancelled_at = Clock::now();
  handle.cancel();
  const std::optional<LoadResult> r = handle.wait_for(std::chrono::seconds(60));
  const double seconds = std::chrono::duration<double>(Clock::now() - cancelled_at).count();
  ASSERT_TRUE(r.has_value()) << "the cancelled load did not end within 60 s";
  ASSERT_FALSE(*r);
  EXPECT_EQ(r->error->stage, Stage::kCancelled) << r->error->message;
  // io.cancel_timeout_ms is 1 s; the link alone would hold it for 6.7 s or more.
  EXPECT_LT(seconds, 4.0) << "the cancel waited for the emulated link";
}

}  // namespace
}  // namespace ferry::runtime
