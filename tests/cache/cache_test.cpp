// The weight cache's mechanism (cache/): SHA-256 against FIPS 180-4's vectors, frames
// and descriptors over a real socket pair (caps, truncation, corrupt JSON, foreign
// descriptors), the fetch reply's validation row by row, process identity, and the
// registry's publish, list and refusals (its directory's mode and owner, a socket
// path that is not a socket).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "cache/protocol.hpp"
#include "cache/registry.hpp"
#include "cache/socket.hpp"
#include "common/error.hpp"
#include "common/sha256.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::cache {
namespace {

using testing::TempDir;

std::string rule_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kCache) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

TEST(Sha256, FipsVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // 55, 56 and 64 bytes: the padding's one- and two-block cases.
  EXPECT_EQ(sha256_hex(std::string(55, 'a')),
            "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(sha256_hex(std::string(56, 'a')),
            "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, Base64Url) {
  const std::uint8_t bytes[] = {0xfb, 0xff, 0x00, 0x10};
  EXPECT_EQ(base64url(bytes, 3), "-_8A");
  EXPECT_EQ(base64url(bytes, 4), "-_8AEA");
  EXPECT_EQ(registry_key("fp", "host:0").size(), 27U);
  EXPECT_NE(registry_key("fp", "host:0"), registry_key("fp", "host:1"));
}

// Two connected ends of a socket pair.
struct Pair {
  Connection a, b;
};
Pair socket_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fds), 0);
  Pair p{Connection(UniqueFd(fds[0]), "a"), Connection(UniqueFd(fds[1]), "b")};
  p.a.set_deadline(Clock::now() + std::chrono::seconds(5));
  p.b.set_deadline(Clock::now() + std::chrono::seconds(5));
  return p;
}

void send_raw(Connection& c, const std::string& bytes) {
  ASSERT_EQ(::send(c.fd(), bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
}

std::string length_prefix(std::uint32_t n) {
  return std::string{static_cast<char>(n >> 24), static_cast<char>(n >> 16),
                     static_cast<char>(n >> 8), static_cast<char>(n)};
}

TEST(CacheFrame, RoundTripAndEnd) {
  Pair p = socket_pair();
  p.a.write_frame({{"type", "ping"}, {"n", 3}});
  EXPECT_EQ(p.b.read_frame()["n"], 3);
  ::shutdown(p.a.fd(), SHUT_WR);
  EXPECT_FALSE(p.b.next_frame().has_value());  // closed between frames: the end, no error
}

TEST(CacheFrame, RefusesOversizedTruncatedCorruptDeepAndNonObjects) {
  {
    Pair p = socket_pair();
    send_raw(p.a, length_prefix(1u << 30));
    EXPECT_NE(rule_of([&] { p.b.read_frame(1 << 20); }).find("over the cap"), std::string::npos);
  }
  {
    Pair p = socket_pair();
    send_raw(p.a, length_prefix(100) + "{\"type\":");
    ::shutdown(p.a.fd(), SHUT_WR);
    EXPECT_NE(rule_of([&] { p.b.read_frame(); }).find("closed the connection in the middle"),
              std::string::npos);
  }
  {
    Pair p = socket_pair();
    send_raw(p.a, length_prefix(2) + "{\"");
    EXPECT_NE(rule_of([&] { p.b.read_frame(); }).find("not valid JSON"), std::string::npos);
  }
  {
    Pair p = socket_pair();
    const std::string deep = std::string(100, '[') + std::string(100, ']');
    send_raw(p.a, length_prefix(deep.size()) + deep);
    EXPECT_NE(rule_of([&] { p.b.read_frame(); }).find("nests deeper"), std::string::npos);
  }
  {
    Pair p = socket_pair();
    send_raw(p.a, length_prefix(2) + "[]");
    EXPECT_NE(rule_of([&] { p.b.read_frame(); }).find("must hold a JSON object"),
              std::string::npos);
  }
  {
    // A peer that sends half a length and stalls costs the deadline, no more.
    Pair p = socket_pair();
    send_raw(p.a, std::string(2, '\0'));
    p.b.set_deadline(Clock::now() + std::chrono::milliseconds(100));
    EXPECT_NE(rule_of([&] { p.b.read_frame(); }).find("timed out"), std::string::npos);
  }
}

TEST(CacheFrame, PassesDescriptorsInBatches) {
  Pair p = socket_pair();
  std::vector<UniqueFd> owned;
  std::vector<int> fds;
  for (int i = 0; i < 300; ++i) {  // more than one message's worth
    owned.emplace_back(::memfd_create("t", MFD_CLOEXEC));
    ASSERT_TRUE(owned.back());
    ASSERT_EQ(::ftruncate(owned.back().get(), i + 1), 0);
    fds.push_back(owned.back().get());
  }
  std::thread sender([&] { p.a.send_fds(fds); });
  std::vector<UniqueFd> got = p.b.receive_fds(fds.size());
  sender.join();
  ASSERT_EQ(got.size(), 300U);
  for (int i = 0; i < 300; ++i) {
    struct stat st {};
    ASSERT_EQ(::fstat(got[i].get(), &st), 0);
    EXPECT_EQ(st.st_size, i + 1);  // in order
  }
}

TEST(CacheFrame, RefusesTheWrongNumberOfDescriptors) {
  Pair p = socket_pair();
  UniqueFd one(::memfd_create("t", MFD_CLOEXEC));
  const int fds[] = {one.get(), one.get()};
  p.a.send_fds(std::span<const int>(fds, 2));
  EXPECT_NE(rule_of([&] { p.b.receive_fds(3); }).find("expected a message with 3"),
            std::string::npos);
}

TEST(CacheFrame, PeerCredentials) {
  Pair p = socket_pair();
  const Connection::Peer peer = p.b.peer();
  EXPECT_EQ(peer.pid, ::getpid());
  EXPECT_EQ(peer.uid, ::geteuid());
}

// A valid reply of two storages, two params.
nlohmann::json good_reply() {
  FetchReply r;
  r.storages.push_back({"memfd", 4096, "host:0", "", ""});
  r.storages.push_back({"cuda_ipc", 1 << 20, "cuda:0", "GPU-1", std::string(128, 'a')});
  TableRank rank;
  rank.tp_rank = 1;
  rank.device = "host:0";
  rank.params.push_back({"a", DType::kBF16, {4, 8}, {8, 1}, 0, 256, 64});
  rank.params.push_back({"b", DType::kF32, {2}, {1}, 1, 0, 8});
  r.ranks.push_back(rank);
  return to_json(r);
}

TEST(CacheProtocol, FetchReplyRoundTrips) {
  const FetchReply r = parse_fetch_reply(good_reply(), "w");
  ASSERT_EQ(r.ranks.size(), 1U);
  EXPECT_EQ(r.ranks[0].params[0].offset, 256U);
  EXPECT_EQ(r.ranks[0].params[1].dtype, DType::kF32);
  EXPECT_EQ(r.descriptors(), 1U);
}

TEST(CacheProtocol, FetchReplyRefusesWhatDoesNotHold) {
  struct Row {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    const char* expect;
  };
  const std::vector<Row> rows = {
      {"outside", [](nlohmann::json& j) { j["ranks"][0]["params"][0]["offset"] = 4090; },
       "lie outside storage 0"},
      {"huge offset",
       [](nlohmann::json& j) {
         j["ranks"][0]["params"][0]["offset"] = std::numeric_limits<std::uint64_t>::max();
       },
       "lie outside"},
      {"storage", [](nlohmann::json& j) { j["ranks"][0]["params"][1]["storage"] = 7; },
       "storage 7 is not in the reply"},
      {"twice", [](nlohmann::json& j) { j["ranks"][0]["params"][1]["name"] = "a"; },
       "listed twice"},
      {"dtype", [](nlohmann::json& j) { j["ranks"][0]["params"][0]["dtype"] = "Q4"; },
       "unknown dtype"},
      {"negative", [](nlohmann::json& j) { j["ranks"][0]["params"][0]["bytes"] = -1; },
       "non-negative"},
      {"strides", [](nlohmann::json& j) { j["ranks"][0]["params"][0]["strides"] = {1}; },
       "differ in length"},
      {"dims",
       [](nlohmann::json& j) { j["ranks"][0]["params"][0]["shape"] = std::vector<int>(17, 1); },
       "at most 16"},
      {"descriptors", [](nlohmann::json& j) { j["descriptors"] = 5; }, "announces 5"},
      {"kind", [](nlohmann::json& j) { j["storages"][0]["kind"] = "shm"; }, "unknown storage"},
      {"handle", [](nlohmann::json& j) { j["storages"][1]["handle"] = "ab"; }, "128 hex"},
      {"error", [](nlohmann::json& j) { j = error_reply("no such rank"); }, "no such rank"},
      {"type", [](nlohmann::json& j) { j["type"] = "query"; }, "expected a 'fetch' reply"},
      {"missing", [](nlohmann::json& j) { j.erase("ranks"); }, "lacks 'ranks'"},
      {"params", [](nlohmann::json& j) { j["ranks"][0]["params"] = 3; }, "must be an array"},
  };
  for (const Row& row : rows) {
    nlohmann::json j = good_reply();
    row.edit(j);
    const std::string rule = rule_of([&] { parse_fetch_reply(j, "w"); });
    EXPECT_NE(rule.find(row.expect), std::string::npos) << row.what << ": " << rule;
  }
}

TEST(CacheProtocol, RequestTypes) {
  EXPECT_EQ(request_type({{"type", "fetch"}}, "w"), "fetch");
  EXPECT_NE(rule_of([] {
              request_type({{"type", "exec"}}, "w");
            }).find("unknown request"),
            std::string::npos);
  EXPECT_NE(rule_of([] {
              request_type({{"kind", "ping"}}, "w");
            }).find("lacks 'type'"),
            std::string::npos);
}

TEST(CacheProcess, StartTimeNamesOneProcess) {
  const ProcessIdentity self = self_identity();
  EXPECT_GT(self.start_time, 0U);
  EXPECT_TRUE(alive(self));
  EXPECT_FALSE(alive({self.pid, self.start_time + 1}));  // the same pid, another process
  const pid_t child = ::fork();
  if (child == 0) {
    ::_exit(0);
  }
  ASSERT_GT(child, 0);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_FALSE(process_start_time(child).has_value());
  EXPECT_FALSE(process_start_time(-1).has_value());
}

TEST(CacheRegistry, PublishesListsFindsAndRemoves) {
  TempDir t;
  const std::string dir = t.file("reg");
  Registry reg(dir);  // made 0700
  struct stat st {};
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700U);
  {
    Registry::Lock lock = reg.lock();
    reg.publish("k1", {{"pid", 1}, {"start_time", 2}, {"socket", "/s"}, {"fingerprint", "f"}});
  }
  testing::write_file(dir + "/broken.json", "{");
  testing::write_file(dir + "/notes.txt", "x");
  const std::vector<Registration> all = reg.list();
  ASSERT_EQ(all.size(), 2U);  // broken, k1 (sorted); notes.txt ignored
  EXPECT_EQ(all[0].key, "broken");
  EXPECT_FALSE(all[0].problem.empty());
  EXPECT_EQ(all[1].key, "k1");
  EXPECT_TRUE(all[1].problem.empty()) << all[1].problem;
  EXPECT_EQ(all[1].daemon.pid, 1);
  EXPECT_EQ(all[1].fingerprint, "f");
  ASSERT_TRUE(reg.find("k1").has_value());
  reg.remove("k1");
  EXPECT_FALSE(reg.find("k1").has_value());
  // No temporary file is left behind by publish.
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_NE(e.path().filename().string()[0], '.') << e.path();
  }
}

TEST(CacheRegistry, RefusesADirectoryThatIsNotOurs) {
  TempDir t;
  const std::string open_dir = t.file("open");
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0755), 0);
  EXPECT_NE(rule_of([&] { Registry r(open_dir); }).find("mode 0755"), std::string::npos);
  const std::string link = t.file("link");
  const std::string real = t.file("real");
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  EXPECT_NE(rule_of([&] { Registry r(link); }).find("not a directory"), std::string::npos);
  testing::write_file(t.file("file"), "x");
  EXPECT_NE(rule_of([&] { Registry r(t.file("file")); }).find("not a directory"),
            std::string::npos);
  if (::geteuid() == 0) {
    const std::string theirs = t.file("theirs");
    ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
    ASSERT_EQ(::chown(theirs.c_str(), 65534, 65534), 0);
    EXPECT_NE(rule_of([&] { Registry r(theirs); }).find("owned by uid 65534"), std::string::npos);
  }
  const std::string deep = t.file(std::string(100, 'd'));
  EXPECT_NE(rule_of([&] { Registry r(deep); }).find("too long"), std::string::npos);
}

TEST(CacheRegistry, ChecksTheSocketNode) {
  TempDir t;
  EXPECT_FALSE(check_socket(t.file("none.sock")));
  testing::write_file(t.file("file.sock"), "x");
  EXPECT_NE(
      rule_of([&] { check_socket(t.file("file.sock")); }).find("not a socket (a regular file)"),
      std::string::npos);
  {
    UniqueFd l = listen_unix(t.file("s.sock"));
    EXPECT_TRUE(check_socket(t.file("s.sock")));
    struct stat st {};
    ASSERT_EQ(::stat(t.file("s.sock").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600U);  // bound under umask 0177
    if (::geteuid() == 0) {
      ASSERT_EQ(::chown(t.file("s.sock").c_str(), 65534, 65534), 0);
      EXPECT_NE(rule_of([&] { check_socket(t.file("s.sock")); }).find("owned by uid 65534"),
                std::string::npos);
    }
  }
  EXPECT_NE(rule_of([&] {
              connect_unix(t.file("s.sock"), Clock::now() + std::chrono::seconds(1));
            }).find("connection refused"),
            std::string::npos);
  EXPECT_NE(rule_of([&] {
              connect_unix(t.file("x.sock"), Clock::now() + std::chrono::seconds(1));
            }).find("no such socket"),
            std::string::npos);
}

}  // namespace
}  // namespace ferry::cache
