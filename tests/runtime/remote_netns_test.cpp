// remote_instance across two real hosts: a `ferry serve --remote` seed in one
// network namespace, `ferry load` targets in another, joined by a veth pair
// (tests/runtime/netns_util.hpp). UCX runs over TCP (remote.transports=tcp), so the
// bytes cross the link. What a target leaves is compared with a disk load's dump,
// byte for byte; the refusals and faults of docs/OPERATING.md ("Pulling from a
// seed") each end in a clean error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>

#include "runtime/netns_util.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using testing::NetnsPair;

constexpr const char* kSeedAddress = "10.231.7.1:7400";

// The tensors of a dump file, without the metadata (which names the device).
std::pair<nlohmann::json, std::string> tensors(const std::string& path) {
  const std::string bytes = testing::read_file(path);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  header.erase("__metadata__");
  return {header, bytes.substr(8 + n)};
}

class RemoteInstance : public ::testing::Test {
 protected:
  void SetUp() override {
    token = dir.file("token");
    {
      std::ofstream out(token);
      out << "a-shared-secret-of-the-fleet-0123456789\n";
    }
    ::chmod(token.c_str(), 0600);
    registry = dir.file("registry");
    ::mkdir(registry.c_str(), 0700);
  }
  void TearDown() override {
    if (seed_pid > 0) {
      ::kill(seed_pid, SIGTERM);
      testing::wait_exit(seed_pid);
    }
  }

  // Starts the seed in its namespace; false (and the log in `seed_log()`) when it
  // exited before it was ready.
  bool start_seed(const std::string& model, std::vector<std::string> args = {}) {
    const std::string ready = dir.file("seed-ready");
    std::vector<std::string> argv = {FERRY_BINARY,   "serve",
                                     "--model",      model,
                                     "--set",        "cache.dir=" + registry,
                                     "--ready-file", ready,
                                     "--remote",     kSeedAddress,
                                     "--set",        "remote.token_file=" + token,
                                     "--set",        "remote.transports=tcp"};
    argv.insert(argv.end(), args.begin(), args.end());
    seed_pid = testing::spawn(NetnsPair::in(net.seed_ns(), argv), dir.file("seed-log"));
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (std::chrono::steady_clock::now() < until) {
      if (std::filesystem::exists(ready)) {
        return true;
      }
      int status = 0;
      if (::waitpid(seed_pid, &status, WNOHANG) == seed_pid) {
        seed_pid = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  std::string seed_log() const { return testing::read_file(dir.file("seed-log")); }

  // `ferry load` of `model` in the target's namespace, pulling from the seed; its
  // pid (log in dir/<name>.log, dump in dir/<name>, report dir/<name>.json).
  pid_t start_target(const std::string& name, const std::string& model,
                     const std::vector<std::string>& sets, const std::string& token_file = {}) {
    std::vector<std::string> argv = {
        FERRY_BINARY, "load",
        "--model",    model,
        "--set",      "model.load_format=remote_instance",
        "--set",      std::string("remote.seed=") + kSeedAddress,
        "--set",      "remote.token_file=" + (token_file.empty() ? token : token_file),
        "--set",      "remote.transports=tcp",
        "--dump-dir", dir.file(name),
        "--report",   dir.file(name + ".json")};
    for (const std::string& s : sets) {
      argv.insert(argv.end(), {"--set", s});
    }
    return testing::spawn(NetnsPair::in(net.target_ns(), argv), dir.file(name + ".log"));
  }
  int run_target(const std::string& name, const std::string& model,
                 const std::vector<std::string>& sets, const std::string& token_file = {}) {
    return testing::wait_exit(start_target(name, model, sets, token_file));
  }
  std::string log(const std::string& name) const {
    return testing::read_file(dir.file(name + ".log"));
  }
  nlohmann::json report(const std::string& name) const {
    return nlohmann::json::parse(testing::read_file(dir.file(name + ".json")));
  }
  // Waits until the target's log says the pull started.
  bool wait_pulling(const std::string& name) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < until) {
      if (log(name).find("remote_instance: pulling") != std::string::npos) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  // Target `name`'s dump equals a disk load's of `model` with `sets`, byte for byte.
  void expect_same_as_disk(const std::string& name, const std::string& model,
                           const std::vector<std::string>& sets) {
    LoadResult disk = testing::load_with(model, sets);
    ASSERT_TRUE(disk) << disk.error->message;
    const std::string want = dir.file(name + "-disk");
    disk.model->dump(want);
    for (const LoadedRank& r : disk.model->ranks()) {
      const std::string file = "rank-" + std::to_string(r.tp_rank) + ".safetensors";
      ASSERT_TRUE(std::filesystem::exists(dir.file(name) + "/" + file)) << file;
      const auto got = tensors(dir.file(name) + "/" + file);
      const auto expected = tensors(want + "/" + file);
      EXPECT_EQ(got.first, expected.first) << file;
      EXPECT_TRUE(got.second == expected.second) << file << ": the tensor bytes differ";
    }
  }

  // Slows the seed's side of the link, so that a pull lasts seconds (tc's token
  // bucket filter); false when tc is missing.
  bool slow_link(const std::string& rate) {
    const std::string tc = std::filesystem::exists("/usr/sbin/tc") ? "/usr/sbin/tc" : "/sbin/tc";
    std::vector<std::string> argv =
        NetnsPair::in(net.seed_ns(), {tc, "qdisc", "add", "dev", net.seed_if(), "root", "tbf",
                                      "rate", rate, "burst", "64kb", "latency", "400ms"});
    return testing::wait_exit(testing::spawn(argv, dir.file("tc.log"))) == 0;
  }

  testing::TempDir dir;
  NetnsPair net;
  std::string token, registry;
  pid_t seed_pid = -1;
};

struct Case {
  const char* name;
  const char* family;  // layout_checkpoint's
  std::vector<std::string> sets;
};

class RemoteRoundTrip : public RemoteInstance, public ::testing::WithParamInterface<Case> {};

TEST_P(RemoteRoundTrip, TargetEqualsDiskLoadByteForByte) {
  FERRY_REQUIRE_PAIR(net);
  const Case& c = GetParam();
  const std::string ck = testing::layout_checkpoint(dir.file("ck"), c.family);
  std::vector<std::string> seed_args;
  for (const std::string& s : c.sets) {
    seed_args.insert(seed_args.end(), {"--set", s});
  }
  ASSERT_TRUE(start_seed(ck, seed_args)) << seed_log();
  ASSERT_EQ(run_target("t", ck, c.sets), 0) << log("t") << seed_log();
  expect_same_as_disk("t", ck, c.sets);
  const nlohmann::json r = report("t");
  EXPECT_EQ(r["load_format"], "remote_instance");
  EXPECT_EQ(r["remote"]["pulled"], true);
  EXPECT_EQ(r["remote"]["seed"], kSeedAddress);
  EXPECT_EQ(r["remote"]["transports"], "tcp");
  EXPECT_GT(r["remote"]["bytes"].get<std::uint64_t>(), 0U);
  EXPECT_EQ(r["bytes_read"], 0);  // nothing came from the target's disk
  EXPECT_THAT(seed_log(), HasSubstr("fetched the table"));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, RemoteRoundTrip,
    ::testing::Values(Case{"llama_tp1", "llama", {"parallel.tp=1"}},
                      Case{"llama_tp2", "llama", {"parallel.tp=2"}},
                      Case{"deepseek_v3_ep2", "deepseek_v3", {"parallel.tp=2", "parallel.ep=2"}},
                      Case{"deepseek_v3_fp8_block", "deepseek_v3_fp8", {"parallel.tp=2"}}),
    [](const ::testing::TestParamInfo<Case>& p) { return std::string(p.param.name); });

TEST_F(RemoteInstance, WrongTokenGetsNothing) {
  FERRY_REQUIRE_PAIR(net);
  const std::string ck = testing::layout_checkpoint(dir.file("ck"), "llama");
  ASSERT_TRUE(start_seed(ck)) << seed_log();
  const std::string wrong = dir.file("wrong");
  {
    std::ofstream out(wrong);
    out << "not-the-secret-of-this-fleet-0123456789\n";
  }
  ::chmod(wrong.c_str(), 0600);
  // The seed proves the token first: the target finds the seed's proof wrong and
  // sends none of its own.
  EXPECT_EQ(run_target("t", ck, {}, wrong), 1);
  EXPECT_THAT(log("t"), HasSubstr("remote: 10.231.7.1:7400: authentication failed: the seed's "
                                  "proof does not match"));
  EXPECT_THAT(seed_log(), HasSubstr("remote: target 10.231.7.2:"));
  EXPECT_THAT(seed_log(), HasSubstr("left before proving the token"));
  EXPECT_THAT(seed_log(), ::testing::Not(HasSubstr("fetched the table")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("t")));  // nothing dumped
  // A token file others can read is refused before anything is sent.
  ::chmod(wrong.c_str(), 0644);
  EXPECT_EQ(run_target("t2", ck, {}, wrong), 1);
  EXPECT_THAT(log("t2"), HasSubstr("readable or writable by others"));
}

TEST_F(RemoteInstance, LayoutMismatchNamesTheField) {
  FERRY_REQUIRE_PAIR(net);
  const std::string ck = testing::layout_checkpoint(dir.file("ck"), "llama");
  ASSERT_TRUE(start_seed(ck, {"--set", "parallel.tp=2"})) << seed_log();
  EXPECT_EQ(run_target("t", ck, {"parallel.tp=1"}), 1);
  EXPECT_THAT(log("t"), HasSubstr("the seed serves another layout: parallel.tp: the seed's 2, "
                                  "this load's 1"));
  EXPECT_EQ(run_target("t2", ck, {"parallel.tp=2", "model.dtype=f16"}), 1);
  EXPECT_THAT(log("t2"), HasSubstr("model.dtype"));
}

TEST_F(RemoteInstance, UnreachableSeedIsAnErrorOrAFallback) {
  FERRY_REQUIRE_PAIR(net);
  const std::string ck = testing::layout_checkpoint(dir.file("ck"), "llama");
  // No seed listens: refused at once.
  EXPECT_EQ(run_target("t", ck, {"parallel.tp=1"}), 1);
  EXPECT_THAT(log("t"), HasSubstr("remote: 10.231.7.1:7400: cannot reach the seed: connect: "
                                  "Connection refused"));
  EXPECT_THAT(log("t"), HasSubstr("remote.fallback_format is none"));
  // With a fallback: read from disk, and the report says why.
  ASSERT_EQ(run_target("f", ck, {"parallel.tp=1", "remote.fallback_format=safetensors"}), 0)
      << log("f");
  expect_same_as_disk("f", ck, {"parallel.tp=1"});
  const nlohmann::json r = report("f");
  EXPECT_EQ(r["remote"]["pulled"], false);
  EXPECT_THAT(r["remote"]["fallback"].get<std::string>(), HasSubstr("cannot be reached"));
  EXPECT_GT(r["bytes_read"].get<std::uint64_t>(), 0U);
  // A link that is down: no answer before remote.timeout_ms, then the same.
  ASSERT_TRUE(net.set_seed_link(false));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(run_target("d", ck, {"parallel.tp=1", "remote.timeout_ms=500"}), 1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  EXPECT_THAT(log("d"), HasSubstr("cannot reach the seed"));
}

TEST_F(RemoteInstance, SeedKilledMidPullIsACleanError) {
  FERRY_REQUIRE_PAIR(net);
  const std::string ck = testing::synth_checkpoint(dir.file("ck"), "llama").dir;
  ASSERT_TRUE(start_seed(ck)) << seed_log();
  ASSERT_TRUE(slow_link("40mbit"));
  const pid_t t = start_target("t", ck, {"remote.timeout_ms=3000"});
  ASSERT_TRUE(wait_pulling("t")) << log("t");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ::kill(seed_pid, SIGKILL);
  testing::wait_exit(seed_pid);
  seed_pid = -1;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(testing::wait_exit(t), 1) << log("t");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  // The seed and the parameter that was being pulled are named; nothing is dumped.
  EXPECT_THAT(log("t"), HasSubstr("ferry load: error: remote: 10.231.7.1:7400: tensor '"));
  EXPECT_FALSE(std::filesystem::exists(dir.file("t")));
}

TEST_F(RemoteInstance, LinkDownMidPullIsACleanError) {
  FERRY_REQUIRE_PAIR(net);
  const std::string ck = testing::synth_checkpoint(dir.file("ck"), "llama").dir;
  ASSERT_TRUE(start_seed(ck)) << seed_log();
  ASSERT_TRUE(slow_link("40mbit"));
  const pid_t t = start_target("t", ck, {"remote.timeout_ms=1000"});
  ASSERT_TRUE(wait_pulling("t")) << log("t");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(net.set_seed_link(false));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(testing::wait_exit(t), 1) << log("t");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  EXPECT_THAT(log("t"), HasSubstr("ferry load: error: remote: 10.231.7.1:7400: tensor '"));
  EXPECT_FALSE(std::filesystem::exists(dir.file("t")));
  // The seed lives on: with the link back, the next target pulls.
  ASSERT_TRUE(net.set_seed_link(true));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_EQ(run_target("again", ck, {"parallel.tp=2"}), 0) << log("again") << seed_log();
  expect_same_as_disk("again", ck, {"parallel.tp=2"});
}

TEST_F(RemoteInstance, TwoTargetsPullAtOnce) {
  FERRY_REQUIRE_PAIR(net);
  const std::string ck = testing::layout_checkpoint(dir.file("ck"), "deepseek_v3");
  ASSERT_TRUE(start_seed(ck, {"--set", "parallel.tp=2"})) << seed_log();
  const pid_t a = start_target("a", ck, {"parallel.tp=2", "parallel.ranks=[0]"});
  const pid_t b = start_target("b", ck, {"parallel.tp=2", "parallel.ranks=[1]"});
  EXPECT_EQ(testing::wait_exit(a), 0) << log("a");
  EXPECT_EQ(testing::wait_exit(b), 0) << log("b");
  LoadResult disk = testing::load_with(ck, {"parallel.tp=2"});
  ASSERT_TRUE(disk) << disk.error->message;
  disk.model->dump(dir.file("disk"));
  for (const auto& [name, rank] : {std::pair<std::string, int>{"a", 0}, {"b", 1}}) {
    const std::string file = "rank-" + std::to_string(rank) + ".safetensors";
    const auto got = tensors(dir.file(name) + "/" + file);
    const auto want = tensors(dir.file("disk") + "/" + file);
    EXPECT_EQ(got.first, want.first) << file;
    EXPECT_TRUE(got.second == want.second) << file;
  }
}

}  // namespace
}  // namespace ferry::runtime
