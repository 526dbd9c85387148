// The weight cache end to end, with a real `ferry serve` daemon forked per test:
// clients attach (C++ API and `ferry load`), their params equal a disk load's byte
// for byte, they cannot write the shared memory, and every row of the fail-fast
// table (docs/OPERATING.md) is an error, or the logged fallback of client mode.
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "cache/protocol.hpp"
#include "cache/registry.hpp"
#include "cache/socket.hpp"
#include "runtime/cache.hpp"
#include "runtime/cache_util.hpp"
#include "testing/run.hpp"
#include "testing/tcp_client.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::Daemon;
using testing::Sets;
using testing::synth_checkpoint;
using testing::TempDir;

struct WeightCache : ::testing::Test {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  std::string registry = testing::registry_dir(dir);

  Sets client(const std::string& mode, Sets more = {}) const {
    return testing::with({"parallel.tp=2", "cache.mode=" + mode, "cache.dir=" + registry}, more);
  }
  LoadResult load(const Sets& sets, LoadCallbacks callbacks = {}) const {
    Runtime rt(to_config(testing::make_config(ck.dir, sets)));
    return rt.start(std::move(callbacks)).wait();
  }
  std::string error(const Sets& sets) const {
    LoadResult r = load(sets);
    if (r) {
      ADD_FAILURE() << "the load succeeded";
      return {};
    }
    EXPECT_EQ(r.error->stage, Stage::kCache) << r.error->message;
    return r.error->message;
  }
};

TEST_F(WeightCache, ClientsMapTheDaemonsBytes) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  LoadResult disk = testing::load_with(ck.dir, {"parallel.tp=2"});
  ASSERT_TRUE(disk) << disk.error->message;
  for (const char* mode : {"daemon", "client"}) {
    for (const char* ranks : {"[0]", "[1]", "[0,1]"}) {
      LoadResult r = load(client(mode, {std::string("parallel.ranks=") + ranks}));
      ASSERT_TRUE(r) << r.error->message;
      const LoadReport& report = r.model->report();
      EXPECT_EQ(report.load_format, "ipc_cache");
      EXPECT_TRUE(report.cache.attached);
      EXPECT_EQ(report.cache.mode, mode);
      EXPECT_EQ(report.cache.daemon_pid, d.pid());
      EXPECT_EQ(report.bytes_read, 0U);
      EXPECT_GT(report.cache.bytes_mapped, 0U);
      testing::expect_same_params(*r.model, *disk.model);
      const nlohmann::json j = nlohmann::json::parse(report.json());
      EXPECT_EQ(j["cache"]["attached"], true);
    }
  }
  // model.load_format ipc_cache alone asks for a daemon (cache.mode daemon).
  LoadResult r = load({"parallel.tp=2", "model.load_format=ipc_cache", "cache.dir=" + registry});
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_EQ(r.model->report().cache.mode, "daemon");
}

TEST_F(WeightCache, EightClientProcessesAttachAtOnce) {
  // tp 8 as SGLang runs it: one process per rank, each its own `ferry load`.
  Checkpoint ds = synth_checkpoint(dir.file("ds"), "deepseek_v3");
  Daemon d(ds.dir, registry, {"--tp", "8"});
  ASSERT_TRUE(d.ready()) << d.log();
  std::vector<pid_t> children;
  for (int r = 0; r < 8; ++r) {
    const std::string dump = dir.file("dump" + std::to_string(r));
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string ranks = std::to_string(r);
      const std::string set = "cache.dir=" + registry;
      const int fd = ::open(dir.file("log" + ranks).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execl(FERRY_BINARY, FERRY_BINARY, "load", "--model", ds.dir.c_str(), "--tp", "8", "--ranks",
              ranks.c_str(), "--set", "cache.mode=daemon", "--set", set.c_str(), "--dump-dir",
              dump.c_str(), "--quiet", nullptr);
      ::_exit(127);
    }
    children.push_back(pid);
  }
  for (int r = 0; r < 8; ++r) {
    int status = 0;
    ::waitpid(children[r], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << testing::read_file(dir.file("log" + std::to_string(r)));
  }
  LoadResult disk = testing::load_with(ds.dir, {"parallel.tp=8"});
  ASSERT_TRUE(disk) << disk.error->message;
  disk.model->dump(dir.file("disk"));
  // The dumps differ only in the device their metadata names (host:0 in every
  // client, host:<r> in the one disk load).
  auto tensors = [](const std::string& path) {
    const std::string bytes = testing::read_file(path);
    std::uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
    header.erase("__metadata__");
    return std::make_pair(header, bytes.substr(8 + n));
  };
  for (int r = 0; r < 8; ++r) {
    const std::string name = "rank-" + std::to_string(r) + ".safetensors";
    const auto got = tensors(dir.file("dump" + std::to_string(r)) + "/" + name);
    const auto want = tensors(dir.file("disk") + "/" + name);
    EXPECT_EQ(got.first, want.first) << name;
    EXPECT_TRUE(got.second == want.second) << name << ": the tensor bytes differ";
  }
  // The daemon answered each of them.
  EXPECT_EQ(d.stop(SIGTERM), 0);
  EXPECT_NE(d.log().find("8 client(s) served"), std::string::npos) << d.log();
}

TEST_F(WeightCache, AClientCannotWriteTheSharedMemory) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  const pid_t child = ::fork();
  if (child == 0) {
    LoadResult r = load(client("daemon", {"parallel.ranks=[0]"}));
    if (!r) {
      ::_exit(2);
    }
    std::byte* p = r.model->ranks()[0].params[0].data;
    // The default actions, not a sanitizer's handler (which would exit instead).
    ::signal(SIGSEGV, SIG_DFL);
    ::signal(SIGBUS, SIG_DFL);
    *static_cast<volatile std::byte*>(p) = std::byte{1};  // PROT_READ: SIGSEGV
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << WEXITSTATUS(status);
  EXPECT_TRUE(WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGBUS) << WTERMSIG(status);
  // Nor through the descriptor: the daemon sealed it against new writable mappings
  // and write(2).
  cache::Registry reg(registry);
  const std::vector<cache::Registration> all = reg.list();
  ASSERT_EQ(all.size(), 1U);
  cache::Connection c =
      cache::connect_unix(all[0].socket, cache::Clock::now() + std::chrono::seconds(10));
  const CacheIdentity id =
      cache_identity(disk_config(testing::make_config(ck.dir, client("daemon"))));
  c.write_frame({{"type", "fetch"}, {"fingerprint", id.fingerprint}, {"ranks", {0}}});
  const cache::FetchReply table = cache::parse_fetch_reply(c.read_frame(), "test");
  std::vector<cache::UniqueFd> fds = c.receive_fds(table.descriptors());
  ASSERT_FALSE(fds.empty());
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(), 0), MAP_FAILED);
  EXPECT_EQ(errno, EPERM);
  const char byte = 1;
  EXPECT_EQ(::pwrite(fds[0].get(), &byte, 1, 0), -1);
  EXPECT_EQ(::ftruncate(fds[0].get(), 1), -1);
}

// ---- the fail-fast table, one test per row -----------------------------------------

TEST_F(WeightCache, RowSocketMissing) {
  // No daemon: an error in daemon mode, a logged fallback to disk in client mode.
  EXPECT_NE(error(client("daemon")).find("no daemon is registered"), std::string::npos);
  LoadResult r = load(client("client"));
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_EQ(r.model->report().load_format, "checkpoint");
  EXPECT_FALSE(r.model->report().cache.attached);
  EXPECT_NE(r.model->report().cache.fallback.find("no daemon is registered"), std::string::npos);
  EXPECT_FALSE(r.model->report().warnings.empty());
}

TEST_F(WeightCache, RowConnectionRefused) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  d.stop(SIGKILL);  // its registration and socket stay; nothing listens
  for (const char* mode : {"daemon", "client"}) {
    const std::string e = error(client(mode));
    EXPECT_NE(e.find("connection refused"), std::string::npos) << e;
    EXPECT_NE(e.find("is gone"), std::string::npos) << e;
  }
  // A restart replaces the stale registration, and clients attach again.
  Daemon again(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(again.ready()) << again.log();
  EXPECT_NE(again.log().find("replacing the stale registration"), std::string::npos);
  LoadResult r = load(client("client"));
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_EQ(r.model->report().cache.daemon_pid, again.pid());
}

TEST_F(WeightCache, RowPathIsNotASocket) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  const std::string socket = d.ready_json()["socket"];
  ASSERT_EQ(::unlink(socket.c_str()), 0);
  testing::write_file(socket, "planted");
  for (const char* mode : {"daemon", "client"}) {
    EXPECT_NE(error(client(mode)).find("not a socket (a regular file)"), std::string::npos);
  }
  ASSERT_EQ(::unlink(socket.c_str()), 0);  // gone while its daemon lives
  for (const char* mode : {"daemon", "client"}) {
    EXPECT_NE(error(client(mode)).find("socket is missing while its daemon"), std::string::npos);
  }
}

TEST_F(WeightCache, RowSocketOfAnotherUid) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "chown to another uid needs root";
  }
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  const std::string socket = d.ready_json()["socket"];
  ASSERT_EQ(::chown(socket.c_str(), 65534, 65534), 0);
  for (const char* mode : {"daemon", "client"}) {
    EXPECT_NE(error(client(mode)).find("owned by uid 65534"), std::string::npos);
  }
  // A client of another uid is refused by the daemon too (its socket is 0600, and
  // SO_PEERCRED is checked on every connection).
  ASSERT_EQ(::chown(socket.c_str(), 0, 0), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setuid(65534) != 0) {
      ::_exit(3);
    }
    try {
      cache::Connection c =
          cache::connect_unix(socket, cache::Clock::now() + std::chrono::seconds(5));
      c.write_frame({{"type", "ping"}});
      const nlohmann::json reply = c.read_frame();
      ::_exit(reply.value("type", "") == "error" ? 0 : 1);
    } catch (const Error&) {
      ::_exit(0);  // refused at connect (EACCES)
    }
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_F(WeightCache, RowFingerprintMismatch) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  // Another layout of the same model: never a second copy beside the daemon's.
  for (const char* mode : {"daemon", "client"}) {
    const std::string e = error(testing::with(client(mode), {"parallel.tp=4"}));
    EXPECT_NE(e.find("fingerprint mismatch"), std::string::npos) << e;
    EXPECT_NE(e.find("parallel.tp: the daemon's 2, this load's 4"), std::string::npos) << e;
    EXPECT_NE(error(testing::with(client(mode), {"model.dtype=f32"})).find("model.dtype"),
              std::string::npos);
  }
  // A weight file touched since the daemon read it changes its identity.
  const std::string shard = ck.dir + "/model-00001-of-00004.safetensors";
  ASSERT_TRUE(std::filesystem::exists(shard));
  std::filesystem::last_write_time(
      shard, std::filesystem::last_write_time(shard) + std::chrono::seconds(5));
  EXPECT_NE(error(client("client")).find("files["), std::string::npos);
}

TEST_F(WeightCache, RowDaemonIdentityMismatch) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  // The registration names another start time: the process on the socket is not
  // the one that registered (a pid reused).
  const std::string path = d.ready_json()["registration"];
  nlohmann::json record = nlohmann::json::parse(testing::read_file(path));
  record["start_time"] = record["start_time"].get<std::uint64_t>() + 1;
  testing::write_file(path, record.dump());
  for (const char* mode : {"daemon", "client"}) {
    EXPECT_NE(error(client(mode)).find("is not the registered daemon"), std::string::npos);
  }
  // A registration that cannot be read is an error too, never skipped.
  testing::write_file(path, "{");
  EXPECT_NE(error(client("client")).find("cannot be read"), std::string::npos);
}

// A daemon of the test's own, in this process, that answers as `answer` says.
class FakeDaemon {
 public:
  using Answer = std::function<void(cache::Connection&)>;
  FakeDaemon(const std::string& registry, const CacheIdentity& id, Answer answer)
      : reg_(registry), answer_(std::move(answer)) {
    key_ = "fake";
    socket_ = reg_.socket_path(key_);
    listener_ = cache::listen_unix(socket_);
    const cache::ProcessIdentity self = cache::self_identity();
    reg_.publish(key_, {{"pid", self.pid},
                        {"start_time", self.start_time},
                        {"socket", socket_},
                        {"fingerprint", id.fingerprint},
                        {"model", id.model},
                        {"identity", id.identity},
                        {"ranks", {{{"tp_rank", 0}}, {{"tp_rank", 1}}}}});
    thread_ = std::thread([this] {
      pollfd p{listener_.get(), POLLIN, 0};
      if (::poll(&p, 1, 20000) == 1) {
        if (std::optional<cache::Connection> c = cache::accept_one(listener_.get(), "fake")) {
          c->set_deadline(cache::Clock::now() + std::chrono::seconds(10));
          try {
            answer_(*c);
          } catch (const std::exception&) {
          }
        }
      }
    });
  }
  ~FakeDaemon() {
    thread_.join();
    reg_.remove(key_);
  }

 private:
  cache::Registry reg_;
  Answer answer_;
  std::string key_, socket_;
  cache::UniqueFd listener_;
  std::thread thread_;
};

nlohmann::json hello_reply() {
  const cache::ProcessIdentity self = cache::self_identity();
  return {{"type", "hello"}, {"protocol", 1}, {"pid", self.pid}, {"start_time", self.start_time}};
}

TEST_F(WeightCache, RowProtocolErrors) {
  const CacheIdentity id =
      cache_identity(disk_config(testing::make_config(ck.dir, client("client"))));
  const nlohmann::json ok_query = [&] {
    nlohmann::json q = hello_reply();
    q["type"] = "query";
    q["status"] = "ok";
    q["fingerprint"] = id.fingerprint;
    q["identity"] = id.identity;
    q["compat"] = id.compat;
    return q;
  }();
  struct Row {
    const char* what;
    FakeDaemon::Answer answer;
    const char* expect;
  };
  auto send = [](cache::Connection& c, const std::string& bytes) {
    ::send(c.fd(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
  };
  // Answers hello and query as a good daemon would, then reads the fetch.
  auto up_to_fetch = [&](cache::Connection& c) {
    c.read_frame();
    c.write_frame(hello_reply());
    c.read_frame();
    c.write_frame(ok_query);
    c.read_frame();
  };
  const std::vector<Row> rows = {
      {"closes", [](cache::Connection& c) { c.read_frame(); }, "closed the connection"},
      {"truncated frame",
       [&](cache::Connection& c) {
         c.read_frame();
         send(c, std::string("\0\0\0\x40{\"type\":", 12));
       },
       "in the middle of a frame"},
      {"corrupt JSON",
       [&](cache::Connection& c) {
         c.read_frame();
         send(c, std::string("\0\0\0\x05{{{{{", 9));
       },
       "not valid JSON"},
      {"oversized",
       [&](cache::Connection& c) {
         c.read_frame();
         send(c, std::string("\x7f\xff\xff\xff", 4));
       },
       "over the cap"},
      {"error frame",
       [](cache::Connection& c) {
         c.read_frame();
         c.write_frame(cache::error_reply("no"));
       },
       "answered with an error: no"},
      {"another pid",
       [](cache::Connection& c) {
         c.read_frame();
         nlohmann::json h = hello_reply();
         h["pid"] = 1;
         c.write_frame(h);
       },
       "is not the one registered"},
      {"mismatch",
       [&](cache::Connection& c) {
         c.read_frame();
         c.write_frame(hello_reply());
         c.read_frame();
         nlohmann::json q = ok_query;
         q["status"] = "mismatch";
         c.write_frame(q);
       },
       "fingerprint mismatch"},
      {"other release",
       [&](cache::Connection& c) {
         c.read_frame();
         c.write_frame(hello_reply());
         c.read_frame();
         nlohmann::json q = ok_query;
         q["compat"]["ferry"] = "0.0.1";
         c.write_frame(q);
       },
       "another ferry"},
      {"table outside its storage",
       [&](cache::Connection& c) {
         up_to_fetch(c);
         cache::FetchReply f;
         f.storages.push_back({"memfd", 64, "host:0", "", ""});
         cache::TableRank r;
         r.params.push_back({"x", DType::kBF16, {64}, {1}, 0, 0, 128});
         f.ranks.push_back(r);
         c.write_frame(cache::to_json(f));
       },
       "lie outside storage 0"},
      {"a table missing params",
       [&](cache::Connection& c) {
         up_to_fetch(c);
         cache::FetchReply f;
         cache::TableRank r;
         f.ranks.push_back(r);
         c.write_frame(cache::to_json(f));
       },
       "does not fit"},
      {"descriptors withheld",
       [&](cache::Connection& c) {
         up_to_fetch(c);
         cache::FetchReply f;
         f.storages.push_back({"memfd", 4096, "host:0", "", ""});
         f.ranks.emplace_back();
         c.write_frame(cache::to_json(f));
       },
       "before sending its descriptors"},
  };
  for (const Row& row : rows) {
    for (const char* mode : {"daemon", "client"}) {
      std::string e;
      {
        FakeDaemon fake(registry, id, row.answer);
        e = error(client(mode, {"parallel.ranks=[0]", "cache.timeout_ms=5000"}));
      }
      EXPECT_NE(e.find(row.expect), std::string::npos) << row.what << " (" << mode << "): " << e;
    }
  }
}

TEST_F(WeightCache, AHostileClientCannotCrashTheDaemon) {
  Daemon d(ck.dir, registry, {"--tp", "2", "--set", "cache.timeout_ms=500"});
  ASSERT_TRUE(d.ready()) << d.log();
  const std::string socket = d.ready_json()["socket"];
  const std::vector<std::string> garbage = {
      std::string("\xff\xff\xff\xff", 4),                // a 4 GiB frame
      std::string("\0\0\0\x10{\"type\":\"hello\"", 20),  // cut short
      std::string("\0\0\0\x03[1]", 7),                   // not an object
      std::string("\0\0\0\x0e{\"type\":\"exec\"}", 18),
      std::string("\0\0\0\x1a{\"type\":\"fetch\",\"ranks\":9}", 30),
      std::string("\0\0\0\x2a{\"type\":\"fetch\",\"fingerprint\":\"x\",\"ranks\":[0]}", 46),
      std::string("\0\0\0\x04{\"a\"", 8),
      std::string(1000, '['),
      std::string(),  // connect and say nothing (the timeout ends it)
  };
  for (const std::string& g : garbage) {
    cache::Connection c =
        cache::connect_unix(socket, cache::Clock::now() + std::chrono::seconds(5));
    if (!g.empty()) {
      ::send(c.fd(), g.data(), g.size(), MSG_NOSIGNAL);
    }
  }
  const std::string deep = "{\"type\":" + std::string(200, '[') + std::string(200, ']') + "}";
  {
    cache::Connection c =
        cache::connect_unix(socket, cache::Clock::now() + std::chrono::seconds(5));
    const std::uint32_t n = static_cast<std::uint32_t>(deep.size());
    const std::string frame = std::string{static_cast<char>(n >> 24), static_cast<char>(n >> 16),
                                          static_cast<char>(n >> 8), static_cast<char>(n)} +
                              deep;
    ::send(c.fd(), frame.data(), frame.size(), MSG_NOSIGNAL);
    EXPECT_EQ(c.read_frame()["type"], "error");
  }
  LoadResult r = load(client("daemon"));
  ASSERT_TRUE(r) << r.error->message << "\n" << d.log();
  EXPECT_EQ(::kill(d.pid(), 0), 0);
  EXPECT_EQ(d.stop(SIGTERM), 0) << d.log();
}

// ---- lifetime -----------------------------------------------------------------------

TEST_F(WeightCache, TheWatchdogSeesTheDaemonDieWithinTwoPeriods) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  std::mutex mu;
  std::condition_variable cv;
  std::optional<std::string> lost;
  LoadCallbacks cb;
  cb.on_cache_lost = [&](const std::string& why) {
    std::lock_guard lock(mu);
    lost = why;
    cv.notify_all();
  };
  constexpr int kPeriodMs = 500;
  LoadResult r = load(client("daemon", {"cache.watch_ms=" + std::to_string(kPeriodMs)}), cb);
  ASSERT_TRUE(r) << r.error->message;
  std::this_thread::sleep_for(std::chrono::milliseconds(2 * kPeriodMs));
  {
    std::lock_guard lock(mu);
    EXPECT_FALSE(lost.has_value());  // alive: nothing said
  }
  const auto killed = std::chrono::steady_clock::now();
  d.stop(SIGKILL);
  std::unique_lock lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return lost.has_value(); }));
  const auto seen = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - killed)
                        .count();
  EXPECT_LE(seen, 2 * kPeriodMs) << "the daemon's death was seen after " << seen << " ms";
  EXPECT_NE(lost->find("is gone"), std::string::npos) << *lost;
}

TEST_F(WeightCache, TheDefaultOnCacheLostAborts) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  const pid_t child = ::fork();
  if (child == 0) {
    LoadResult r = load(client("daemon", {"cache.watch_ms=20"}));
    if (!r) {
      ::_exit(2);
    }
    std::this_thread::sleep_for(std::chrono::seconds(30));
    ::_exit(0);  // not reached: the watchdog aborts first
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  d.stop(SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << WEXITSTATUS(status);
  EXPECT_EQ(WTERMSIG(status), SIGABRT);
}

TEST_F(WeightCache, SigtermWithClientsAttached) {
  auto d = std::make_unique<Daemon>(ck.dir, registry, std::vector<std::string>{"--tp", "2"});
  ASSERT_TRUE(d->ready()) << d->log();
  const std::string registration = d->ready_json()["registration"];
  LoadCallbacks cb;
  std::atomic<bool> lost{false};
  cb.on_cache_lost = [&](const std::string&) { lost = true; };
  LoadResult r = load(client("daemon"), cb);
  ASSERT_TRUE(r) << r.error->message;
  const std::vector<std::byte> before = r.model->read_param(0, r.model->ranks()[0].params[0].name);
  EXPECT_EQ(d->stop(SIGTERM), 0) << d->log();
  EXPECT_NE(d->log().find("1 client(s) served"), std::string::npos) << d->log();
  EXPECT_FALSE(std::filesystem::exists(registration));  // cleaned: no new clients
  // The memfd mapping outlives the daemon: the bytes are still there.
  EXPECT_EQ(r.model->read_param(0, r.model->ranks()[0].params[0].name), before);
  EXPECT_NE(error(client("daemon")).find("no daemon is registered"), std::string::npos);
}

TEST_F(WeightCache, OneDaemonPerFingerprintAndDevices) {
  Daemon a(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(a.ready()) << a.log();
  Daemon b(ck.dir, registry, {"--tp", "2"});
  EXPECT_FALSE(b.ready());
  EXPECT_NE(b.log().find("a daemon already serves this fingerprint"), std::string::npos) << b.log();
  // Other ranks of the same layout on other devices: a daemon of their own. A
  // client finds the one that holds its ranks.
  Daemon c(ck.dir, registry, {"--tp", "2", "--ranks", "1"});
  ASSERT_TRUE(c.ready()) << c.log();
  LoadResult r = load(client("daemon", {"parallel.ranks=[1]"}));
  ASSERT_TRUE(r) << r.error->message;
}

TEST_F(WeightCache, TheDaemonServesItsMetrics) {
  // A free port: bound, read, closed (the daemon binds it a moment later).
  int port = 0;
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port = ntohs(addr.sin_port);
    ::close(fd);
  }
  // Metrics wrap the daemon's devices (metered): sharing must see through them.
  Daemon d(ck.dir, registry,
           {"--tp", "2", "--set", "metrics.listen=127.0.0.1:" + std::to_string(port)});
  ASSERT_TRUE(d.ready()) << d.log();
  LoadResult r = load(client("daemon"));
  ASSERT_TRUE(r) << r.error->message;
  testing::TcpClient http(port);
  ASSERT_TRUE(http.send("GET /metrics HTTP/1.0\r\n\r\n"));
  const std::string page = http.read_all();
  EXPECT_NE(page.find("ferry_cache_clients_served_total 1"), std::string::npos) << page;
  EXPECT_NE(page.find("ferry_cache_bytes_shared " +
                      std::to_string(d.ready_json()["bytes_shared"].get<std::uint64_t>())),
            std::string::npos)
      << page;
  EXPECT_NE(page.find("ferry_cache_uptime_seconds"), std::string::npos);
  EXPECT_NE(page.find("ferry_load_seconds"), std::string::npos);  // the daemon's own load
}

TEST_F(WeightCache, UpdatesAreRefusedOnACachedModel) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  Runtime rt(to_config(testing::make_config(ck.dir, client("daemon"))));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  LoadResult u = rt.update(UpdateSource::from_folder(ck.dir));
  ASSERT_FALSE(u);
  EXPECT_NE(u.error->message.find("update refused: ipc_cache"), std::string::npos)
      << u.error->message;
}

TEST_F(WeightCache, PrepareAndCommitAttach) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  Runtime rt(to_config(testing::make_config(ck.dir, client("daemon", {"startup.mode=auto"}))));
  LoadResult prepared = rt.prepare().wait();
  ASSERT_TRUE(prepared) << prepared.error->message;
  LoadResult committed = rt.commit().wait();
  ASSERT_TRUE(committed) << committed.error->message;
  const LoadReport& report = committed.model->report();
  EXPECT_EQ(report.load_format, "ipc_cache");
  ASSERT_EQ(report.startup_refusals.size(), 1U);
  EXPECT_EQ(report.startup_refusals[0].code, "ipc_cache");
  LoadResult disk = testing::load_with(ck.dir, {"parallel.tp=2"});
  testing::expect_same_params(*committed.model, *disk.model);
}

TEST_F(WeightCache, CachedLoadsRefuseWhatCannotHold) {
  auto refused = [&](const Sets& sets) {
    try {
      testing::make_config(ck.dir, sets);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(
      refused(client("client", {"model.load_format=presharded"})).find("cache.fallback_format"),
      std::string::npos);
  EXPECT_NE(refused(client("client", {"devices=null"})).find("nothing to map"), std::string::npos);
  LoadResult saving = load(client("daemon", {"load.save_presharded=" + dir.file("p")}));
  ASSERT_FALSE(saving);
  EXPECT_NE(saving.error->message.find("saves nothing"), std::string::npos);
  EXPECT_NE(refused(client("client", {"cache.fallback_format=ipc_cache"})).find("expected"),
            std::string::npos);
  EXPECT_NE(refused(client("client", {"cache.watch_ms=0"})).find("cache.watch_ms"),
            std::string::npos);
}

TEST_F(WeightCache, ServeRefusesWhatItCannotShare) {
  Daemon nul(ck.dir, registry, {"--tp", "2", "--devices", "null:2"});
  EXPECT_FALSE(nul.ready());
  EXPECT_NE(nul.log().find("not in memory this device can share"), std::string::npos) << nul.log();
  const std::string open_dir = dir.file("open");
  ::mkdir(open_dir.c_str(), 0755);
  Daemon bad(ck.dir, open_dir);
  EXPECT_FALSE(bad.ready());
  EXPECT_NE(bad.log().find("mode 0755"), std::string::npos) << bad.log();
}

TEST_F(WeightCache, LoadCliHoldsAndExitsWhenTheDaemonDies) {
  Daemon d(ck.dir, registry, {"--tp", "2"});
  ASSERT_TRUE(d.ready()) << d.log();
  const pid_t child = ::fork();
  if (child == 0) {
    const int fd = ::open(dir.file("hold.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    const std::string set = "cache.dir=" + registry;
    ::execl(FERRY_BINARY, FERRY_BINARY, "load", "--model", ck.dir.c_str(), "--tp", "2", "--set",
            "cache.mode=daemon", "--set", set.c_str(), "--set", "cache.watch_ms=50", "--hold", "60",
            "--quiet", nullptr);
    ::_exit(127);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (testing::read_file(dir.file("hold.log")).find("holding") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  d.stop(SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3)
      << testing::read_file(dir.file("hold.log"));
  EXPECT_NE(testing::read_file(dir.file("hold.log")).find("is gone"), std::string::npos);
}

}  // namespace
}  // namespace ferry::runtime
