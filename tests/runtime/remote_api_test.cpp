// remote_instance through the C++ API, against a real `ferry serve --remote` seed on
// loopback (the namespace tests, remote_netns_test.cpp, cross a link): devices UCX
// cannot register (pulled through a host buffer), the engine's Allocator,
// prepare()/commit(), updates, and targets that fail the handshake.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <fstream>

#include "cache/protocol.hpp"
#include "gpu/device_wrapper.hpp"
#include "gpu/host_device.hpp"
#include "remote/control.hpp"
#include "runtime/cache_util.hpp"
#include "runtime/engine_memory.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"

namespace ferry::runtime {
namespace {

using testing::Daemon;
using ::testing::HasSubstr;

// A host device that says UCX cannot reach its memory, as a CUDA device with
// Debian's UCX: the target pulls through a registered host buffer and copies.
class UnreachableDevice final : public gpu::DeviceWrapper {
 public:
  explicit UnreachableDevice(int index) : gpu::DeviceWrapper(gpu::make_host_device(index, {})) {}
  bool host_addressable() const override { return false; }
};

class RemoteApi : public ::testing::Test {
 protected:
  void SetUp() override {
    ck = testing::synth_checkpoint(dir.file("ck"), "llama").dir;
    token = dir.file("token");
    std::ofstream(token) << "loopback-secret-0123456789abcdef\n";
    ::chmod(token.c_str(), 0600);
    registry = testing::registry_dir(dir);
    seed = std::make_unique<Daemon>(
        ck, registry,
        std::vector<std::string>{"--tp", "2", "--remote", "127.0.0.1:0", "--set",
                                 "remote.token_file=" + token, "--set", "remote.transports=tcp"});
    ASSERT_TRUE(seed->ready()) << seed->log();
    address = seed->ready_json()["remote"].get<std::string>();
    ASSERT_THAT(address, HasSubstr("127.0.0.1:"));
  }

  testing::Sets target(testing::Sets more = {}) const {
    testing::Sets s = {"parallel.tp=2", "model.load_format=remote_instance",
                       "remote.seed=" + address, "remote.token_file=" + token,
                       "remote.transports=tcp"};
    s.insert(s.end(), more.begin(), more.end());
    return s;
  }

  testing::TempDir dir;
  std::string ck, token, registry, address;
  std::unique_ptr<Daemon> seed;
};

TEST_F(RemoteApi, DevicesUcxCannotReachArePulledThroughHostMemory) {
  RuntimeTestSeams seams;
  seams.devices = {std::make_shared<UnreachableDevice>(0), std::make_shared<UnreachableDevice>(1)};
  // 64 KiB in flight: params larger than it are pulled in pieces, waves of several.
  Runtime rt = make_runtime(
      to_config(testing::make_config(ck, target({"remote.inflight_bytes=64KiB"}))), seams);
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message << seed->log();
  const LoadReport& report = r.model->report();
  EXPECT_EQ(report.load_format, "remote_instance");
  EXPECT_TRUE(report.remote.pulled);
  EXPECT_TRUE(report.remote.staged);
  EXPECT_EQ(report.bytes_read, 0U);
  LoadResult disk = testing::load_with(ck, {"parallel.tp=2"});
  ASSERT_TRUE(disk) << disk.error->message;
  testing::expect_same_params(*r.model, *disk.model);
  std::uint64_t bytes = 0;
  for (const LoadedRank& rank : disk.model->ranks()) {
    for (const LoadedParam& p : rank.params) {
      bytes += p.nbytes;
    }
  }
  EXPECT_EQ(report.remote.bytes, bytes);
  const nlohmann::json j = nlohmann::json::parse(report.json());
  EXPECT_EQ(j["remote"]["staged"], true);
  EXPECT_THAT(report.summary(), HasSubstr("staged through host memory"));
}

TEST_F(RemoteApi, TheEnginesAllocatorHoldsThePulledParams) {
  auto engine = std::make_shared<testing::EngineMemory>();
  {
    Runtime rt = make_runtime(to_config(testing::make_config(ck, target())), {}, engine);
    LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
    EXPECT_FALSE(r.model->report().remote.staged);
    for (const LoadedRank& rank : r.model->ranks()) {
      for (const LoadedParam& p : rank.params) {
        if (p.nbytes != 0) {
          EXPECT_TRUE(engine->holds(rank.device, p.data, p.nbytes)) << p.name;
        }
      }
    }
    LoadResult disk = testing::load_with(ck, {"parallel.tp=2"});
    ASSERT_TRUE(disk);
    testing::expect_same_params(*r.model, *disk.model);
    EXPECT_GT(engine->calls(), 0);
  }
  EXPECT_EQ(engine->live(), 0U);  // all given back with the model
  EXPECT_EQ(engine->bad_releases(), 0);
}

TEST_F(RemoteApi, PrepareAndCommitPull) {
  Runtime rt(to_config(testing::make_config(ck, target({"startup.mode=auto"}))));
  LoadResult prepared = rt.prepare().wait();
  ASSERT_TRUE(prepared) << prepared.error->message;
  LoadResult committed = rt.commit().wait();
  ASSERT_TRUE(committed) << committed.error->message;
  const LoadReport& report = committed.model->report();
  EXPECT_EQ(report.load_format, "remote_instance");
  ASSERT_EQ(report.startup_refusals.size(), 1U);
  EXPECT_EQ(report.startup_refusals[0].code, "remote_instance");
  LoadResult disk = testing::load_with(ck, {"parallel.tp=2"});
  testing::expect_same_params(*committed.model, *disk.model);
}

TEST_F(RemoteApi, ConfigsThatCannotPullAreRefused) {
  auto refused = [&](const testing::Sets& sets) {
    try {
      Runtime rt(to_config(testing::make_config(ck, sets)));
      LoadResult r = rt.load();
      return r ? std::string("loaded") : r.error->message;
    } catch (const Error& e) {
      return std::string(e.what());
    }
  };
  EXPECT_THAT(refused({"model.load_format=remote_instance"}), HasSubstr("set remote.seed"));
  EXPECT_THAT(refused({"model.load_format=remote_instance", "remote.seed=127.0.0.1:1"}),
              HasSubstr("set remote.token_file"));
  EXPECT_THAT(refused({"remote.seed=127.0.0.1"}), HasSubstr("remote.seed '127.0.0.1': no port"));
  EXPECT_THAT(refused({"remote.listen=[::1]"}), HasSubstr("remote.listen"));
  EXPECT_THAT(refused(target({"devices=null"})), HasSubstr("they keep no data"));
  EXPECT_THAT(refused(target({"cache.mode=client"})), HasSubstr("not both"));
  EXPECT_THAT(refused(target({"load.save_presharded=" + dir.file("p")})),
              HasSubstr("save from the seed"));
  // A token file others may read never leaves the process.
  const std::string loose = dir.file("loose");
  std::ofstream(loose) << "loopback-secret-0123456789abcdef\n";
  ::chmod(loose.c_str(), 0644);
  EXPECT_THAT(refused(target({"remote.token_file=" + loose})), HasSubstr("chmod 600"));
  EXPECT_THAT(
      refused(target({"parallel.tp=1"})),
      HasSubstr("the seed serves another layout: parallel.tp: the seed's 2, this load's 1"));
}

// Speaks the control protocol by hand, as a hostile target would.
class RawTarget {
 public:
  explicit RawTarget(const std::string& address)
      : conn_(remote::connect_tcp(remote::parse_host_port(address, "seed"),
                                  cache::Clock::now() + std::chrono::seconds(10))) {}
  cache::Connection& conn() { return conn_; }
  // The seed's answer, or "closed".
  std::string answer() {
    try {
      std::optional<nlohmann::json> f = conn_.next_frame();
      return f ? f->dump() : "closed";
    } catch (const Error& e) {
      return std::string("closed: ") + e.what();
    }
  }

 private:
  cache::Connection conn_;
};

TEST_F(RemoteApi, TargetsThatFailTheHandshakeGetNothing) {
  const std::string secret = "loopback-secret-0123456789abcdef";
  {  // A query before any hello.
    RawTarget t(address);
    t.conn().write_frame({{"type", "query"}, {"fingerprint", "x"}});
    EXPECT_THAT(t.answer(), HasSubstr("authentication failed"));
    EXPECT_THAT(t.answer(), HasSubstr("closed"));
  }
  {  // The token itself, as a naive client would send it.
    RawTarget t(address);
    t.conn().write_frame({{"type", "hello"}, {"protocol", 1}, {"token", secret}});
    EXPECT_THAT(t.answer(), HasSubstr("authentication failed"));
  }
  {  // A proof made with another secret.
    RawTarget t(address);
    const std::string nonce = remote::random_nonce();
    t.conn().write_frame({{"type", "hello"}, {"protocol", 1}, {"nonce", nonce}});
    const nlohmann::json challenge = nlohmann::json::parse(t.answer());
    ASSERT_EQ(challenge["type"], "challenge");
    EXPECT_EQ(challenge.dump().find(secret), std::string::npos);
    t.conn().write_frame({{"type", "auth"},
                          {"proof", remote::proof("another-secret-0123456789", remote::kTargetLabel,
                                                  challenge["nonce"].get<std::string>(), nonce)}});
    EXPECT_THAT(t.answer(), HasSubstr("authentication failed"));
    EXPECT_THAT(t.answer(), HasSubstr("closed"));
  }
  {  // The seed's own proof sent back.
    RawTarget t(address);
    const std::string nonce = remote::random_nonce();
    t.conn().write_frame({{"type", "hello"}, {"protocol", 1}, {"nonce", nonce}});
    const nlohmann::json challenge = nlohmann::json::parse(t.answer());
    t.conn().write_frame({{"type", "auth"}, {"proof", challenge["proof"]}});
    EXPECT_THAT(t.answer(), HasSubstr("authentication failed"));
  }
  {  // Not JSON at all.
    RawTarget t(address);
    const char junk[] = "\x00\x00\x00\x04{{{{";
    ASSERT_EQ(::send(t.conn().fd(), junk, 8, MSG_NOSIGNAL), 8);
    EXPECT_THAT(t.answer(), HasSubstr("not valid JSON"));
    EXPECT_THAT(t.answer(), HasSubstr("closed"));
  }
  {  // The right proof: a table, and the fingerprint is checked before it is sent.
    RawTarget t(address);
    const std::string nonce = remote::random_nonce();
    t.conn().write_frame({{"type", "hello"}, {"protocol", 1}, {"nonce", nonce}});
    const nlohmann::json challenge = nlohmann::json::parse(t.answer());
    const std::string seed_nonce = challenge["nonce"].get<std::string>();
    std::string checked;
    ASSERT_EQ(remote::check_challenge(challenge, secret, nonce, checked), "");
    t.conn().write_frame(
        {{"type", "auth"},
         {"proof", remote::proof(secret, remote::kTargetLabel, seed_nonce, nonce)}});
    EXPECT_THAT(t.answer(), HasSubstr("\"type\":\"hello\""));
    t.conn().write_frame({{"type", "fetch"}, {"fingerprint", "not-the-layout"}, {"ranks", {0}}});
    EXPECT_THAT(t.answer(), HasSubstr("fingerprint mismatch"));
  }
  const std::string log = seed->log();
  EXPECT_THAT(log, HasSubstr("refused target 127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("the first frame is not a hello"));
  EXPECT_THAT(log, HasSubstr("no nonce"));
  EXPECT_THAT(log, HasSubstr("wrong token (the target's proof does not match)"));
  EXPECT_EQ(log.find("fetched the table"), std::string::npos);
  // The seed still serves a real target.
  Runtime rt(to_config(testing::make_config(ck, target())));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
}

}  // namespace
}  // namespace ferry::runtime

namespace ferry::runtime {
namespace {

TEST_F(RemoteApi, UpdatesWriteAPulledModel) {
  const std::string next = testing::synth_checkpoint(dir.file("next"), "llama", false, 7).dir;
  Runtime rt(to_config(testing::make_config(ck, target())));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  LoadResult u = rt.update(UpdateSource::from_folder(next));
  ASSERT_TRUE(u) << u.error->message;
  LoadResult disk = testing::load_with(next, {"parallel.tp=2"});
  ASSERT_TRUE(disk) << disk.error->message;
  testing::expect_same_params(*r.model, *disk.model);
}

TEST_F(RemoteApi, ATargetSeedsTheNextWave) {
  // A daemon whose own load pulls from the first seed serves the next targets.
  testing::TempDir other;
  Daemon second(ck, testing::registry_dir(other),
                {"--tp", "2", "--remote", "127.0.0.1:0", "--set",
                 "model.load_format=remote_instance", "--set", "remote.seed=" + address, "--set",
                 "remote.token_file=" + token, "--set", "remote.transports=tcp"});
  ASSERT_TRUE(second.ready()) << second.log();
  const std::string next = second.ready_json()["remote"].get<std::string>();
  ASSERT_NE(next, address);
  testing::Sets sets = target();
  sets.push_back("remote.seed=" + next);
  Runtime rt(to_config(testing::make_config(ck, sets)));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message << second.log();
  EXPECT_EQ(r.model->report().remote.seed, next);
  LoadResult disk = testing::load_with(ck, {"parallel.tp=2"});
  testing::expect_same_params(*r.model, *disk.model);
  EXPECT_THAT(second.log(), HasSubstr("pulled 54 param(s)"));
}

}  // namespace
}  // namespace ferry::runtime

namespace ferry::runtime {
namespace {

TEST_F(RemoteApi, GetsInDoubtKeepTheirMemoryForever) {
  // The seed stops answering once the pull has started, and (as on RDMA) some gets'
  // completion stays unknown: the error says so, and the engine's memory they were
  // landing in is never given back (a late write would land in freed memory).
  auto engine = std::make_shared<testing::EngineMemory>();
  RuntimeTestSeams seams;
  seams.before_pull = [&] { ::kill(seed->pid(), SIGSTOP); };
  seams.after_failed_pull = [](std::size_t& gets, std::uint64_t& bytes) {
    gets = 3;
    bytes = 12345;
  };
  Runtime rt = make_runtime(to_config(testing::make_config(ck, target({"remote.timeout_ms=300"}))),
                            seams, engine);
  LoadResult r = rt.load();
  ::kill(seed->pid(), SIGCONT);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kRemote);
  EXPECT_THAT(r.error->message, HasSubstr("no data from the seed for 300 ms"));
  EXPECT_THAT(r.error->message,
              HasSubstr("3 get(s) of 12345 bytes never completed: their memory is quarantined"));
  EXPECT_GT(engine->live(), 0U);  // kept, not released
  EXPECT_EQ(engine->bad_releases(), 0);
}

}  // namespace
}  // namespace ferry::runtime
