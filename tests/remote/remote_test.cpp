// remote/: the seed's control port (addresses, the shared secret, the first frame),
// a seed's table as a target checks it, and UCX gets between two workers of this
// process over TCP on loopback (the namespace tests run the same across a link).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <numeric>
#include <thread>

#include "cache/protocol.hpp"
#include "common/error.hpp"
#include "common/sha256.hpp"
#include "remote/control.hpp"
#include "remote/ucx.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::remote {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return std::string(to_string(e.stage())) + ": " + e.what();
  }
  return "";
}

TEST(HostPort, ReadsWhatAnOperatorWrites) {
  HostPort a = parse_host_port("10.0.0.1:7400", "remote.seed");
  EXPECT_EQ(a.host, "10.0.0.1");
  EXPECT_EQ(a.port, 7400);
  EXPECT_EQ(a.text(), "10.0.0.1:7400");
  HostPort b = parse_host_port("[fd00::1]:65535", "remote.seed");
  EXPECT_EQ(b.host, "fd00::1");
  EXPECT_EQ(b.text(), "[fd00::1]:65535");
  EXPECT_EQ(parse_host_port("seed-0.fleet.local:1", "remote.seed").host, "seed-0.fleet.local");
  for (const char* bad :
       {"", "10.0.0.1", "10.0.0.1:", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:x", ":7400",
        "fd00::1:7400", "[fd00::1]", "[zz::1]:1", "a b:1", "host;rm:1", "[fd00::1]7400"}) {
    const std::string e = error_of([&] { parse_host_port(bad, "remote.seed"); });
    EXPECT_THAT(e, HasSubstr("config: remote.seed '")) << bad;
  }
}

class Token : public ::testing::Test {
 protected:
  std::string write(const std::string& text, mode_t mode) {
    const std::string path = dir.file("t" + std::to_string(n++));
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
    return path;
  }
  testing::TempDir dir;
  int n = 0;
};

TEST_F(Token, ReadOnlyFromAPrivateFile) {
  EXPECT_EQ(read_token(write("0123456789abcdef-secret\n\n", 0600)), "0123456789abcdef-secret");
  EXPECT_EQ(read_token(write("0123456789abcdef", 0400)), "0123456789abcdef");
  EXPECT_THAT(error_of([&] { read_token(write("0123456789abcdef", 0644)); }),
              HasSubstr("readable or writable by others (mode 644): chmod 600 it"));
  EXPECT_THAT(error_of([&] { read_token(write("0123456789abcdef", 0620)); }),
              HasSubstr("by others"));
  EXPECT_THAT(error_of([&] { read_token(write("short\n", 0600)); }),
              HasSubstr("must be 16 to 4096 bytes (it is 5)"));
  EXPECT_THAT(error_of([&] { read_token(write(std::string(5000, 'x'), 0600)); }),
              HasSubstr("16 to 4096 bytes"));
  EXPECT_THAT(error_of([&] { read_token(write(std::string(9000, 'x'), 0600)); }),
              HasSubstr("larger than 8192 bytes"));
  EXPECT_THAT(error_of([&] { read_token(dir.file("none")); }), HasSubstr("cannot open"));
  EXPECT_THAT(error_of([&] { read_token(""); }), HasSubstr("remote.token_file: not set"));
  EXPECT_THAT(error_of([&] { read_token(dir.path()); }), HasSubstr("not a regular file"));
  const std::string target = write("0123456789abcdef", 0600);
  const std::string link = dir.file("link");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  EXPECT_THAT(error_of([&] { read_token(link); }), HasSubstr("cannot open"));
}

TEST(SameToken, ComparesEveryByte) {
  EXPECT_TRUE(same_token("0123456789abcdef", "0123456789abcdef"));
  EXPECT_FALSE(same_token("0123456789abcdef", "0123456789abcdeX"));
  EXPECT_FALSE(same_token("X123456789abcdef", "0123456789abcdef"));
  EXPECT_FALSE(same_token("0123456789abcdef", "0123456789abcdef0"));
  EXPECT_FALSE(same_token("", "0123456789abcdef"));
  EXPECT_FALSE(same_token(std::string_view("a\0b", 3), std::string_view("a\0c", 3)));
}

TEST(Hmac, Rfc4231Vectors) {
  auto hexed = [](const Sha256Digest& d) { return hex(d.data(), d.size()); };
  EXPECT_EQ(hexed(hmac_sha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hexed(hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hexed(hmac_sha256(std::string(131, '\xaa'),
                              "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(Handshake, BothSidesProveTheTokenWithoutSendingIt) {
  const std::string token = "0123456789abcdef-the-fleet";
  const std::string tn = random_nonce();
  const std::string sn = random_nonce();
  EXPECT_EQ(tn.size(), 64U);
  EXPECT_NE(tn, sn);
  // The seed's side of a hello.
  std::string got;
  EXPECT_EQ(check_hello({{"type", "hello"}, {"protocol", 1}, {"nonce", tn}}, 1, got), "");
  EXPECT_EQ(got, tn);
  EXPECT_EQ(check_hello({{"type", "hello"}, {"protocol", 1}, {"nonce", tn}}, 2, got),
            "protocol version mismatch (this seed speaks 2)");
  EXPECT_EQ(check_hello({{"type", "hello"}, {"protocol", "1"}, {"nonce", tn}}, 1, got),
            "protocol version mismatch (this seed speaks 1)");
  EXPECT_EQ(check_hello({{"type", "hello"}, {"protocol", 1}}, 1, got),
            "no nonce (64 lowercase hex digits)");
  EXPECT_EQ(check_hello({{"type", "hello"}, {"protocol", 1}, {"nonce", "abc"}}, 1, got),
            "no nonce (64 lowercase hex digits)");
  EXPECT_EQ(check_hello({{"type", "hello"}, {"protocol", 1}, {"token", token}}, 1, got),
            "no nonce (64 lowercase hex digits)");
  EXPECT_EQ(check_hello({{"type", "fetch"}}, 1, got), "the first frame is not a hello");
  EXPECT_EQ(check_hello(nlohmann::json::array(), 1, got), "the first frame is not an object");
  // The target checks the seed's proof...
  const nlohmann::json challenge = {
      {"type", "challenge"}, {"nonce", sn}, {"proof", proof(token, kSeedLabel, tn, sn)}};
  std::string seed_nonce;
  EXPECT_EQ(check_challenge(challenge, token, tn, seed_nonce), "");
  EXPECT_EQ(seed_nonce, sn);
  EXPECT_THAT(check_challenge(challenge, "another-token-0123456789", tn, seed_nonce),
              HasSubstr("the seed's proof does not match"));
  EXPECT_THAT(check_challenge(challenge, token, random_nonce(), seed_nonce),
              HasSubstr("does not match"));  // a proof made for another target's nonce
  nlohmann::json reflected = {
      {"type", "challenge"}, {"nonce", tn}, {"proof", proof(token, kSeedLabel, tn, tn)}};
  EXPECT_THAT(check_challenge(reflected, token, tn, seed_nonce), HasSubstr("reflection"));
  EXPECT_THAT(check_challenge({{"type", "hello"}}, token, tn, seed_nonce),
              HasSubstr("expected a challenge"));
  EXPECT_THAT(check_challenge({{"type", "challenge"}, {"nonce", sn}}, token, tn, seed_nonce),
              HasSubstr("lacks a nonce or a proof"));
  // ...and the seed the target's, which is not the seed's proof sent back.
  EXPECT_EQ(
      check_auth({{"type", "auth"}, {"proof", proof(token, kTargetLabel, sn, tn)}}, token, sn, tn),
      "");
  EXPECT_THAT(
      check_auth({{"type", "auth"}, {"proof", proof(token, kSeedLabel, tn, sn)}}, token, sn, tn),
      HasSubstr("wrong token"));
  EXPECT_THAT(
      check_auth({{"type", "auth"}, {"proof", proof("x", kTargetLabel, sn, tn)}}, token, sn, tn),
      HasSubstr("wrong token"));
  EXPECT_EQ(check_auth({{"type", "auth"}}, token, sn, tn), "no proof");
  EXPECT_EQ(check_auth({{"type", "query"}}, token, sn, tn), "the second frame is not an auth");
  // The proof never holds the token.
  EXPECT_EQ(proof(token, kTargetLabel, sn, tn).find(token), std::string::npos);
}

TEST(Tcp, ListensOnTheAddressGivenAndConnects) {
  cache::UniqueFd l = listen_tcp(HostPort{"127.0.0.1", 0});
  const std::uint16_t port = bound_port(l.get());
  ASSERT_NE(port, 0);
  const auto deadline = cache::Clock::now() + std::chrono::seconds(5);
  cache::Connection c = connect_tcp({"127.0.0.1", port}, deadline);
  std::optional<cache::Connection> s;
  for (int i = 0; i < 500 && !s; ++i) {
    s = cache::accept_one(l.get(), "test");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(s);
  s->set_deadline(deadline);
  c.write_frame({{"type", "ping"}});
  EXPECT_EQ(s->read_frame()["type"], "ping");
  EXPECT_THAT(peer_address(s->fd()), HasSubstr("127.0.0.1:"));
  // Nobody listens on the port once the listener is gone.
  l.reset();
  EXPECT_THAT(error_of([&] {
                connect_tcp({"127.0.0.1", port}, deadline);
              }),
              HasSubstr("remote: 127.0.0.1:" + std::to_string(port) +
                        ": cannot reach the seed: connect: Connection refused"));
  EXPECT_THAT(error_of([&] {
                listen_tcp({"192.0.2.1", 7400});
              }),  // not this host's
              HasSubstr("cannot listen: bind: Cannot assign requested address"));
}

TEST(Hex, RoundTripsAndRefusesWhatIsNot) {
  const std::string bytes("\x00\x01\xfe\xff", 4);
  EXPECT_EQ(hex(bytes.data(), bytes.size()), "0001feff");
  EXPECT_EQ(unhex("0001feff", "w", "x"), bytes);
  EXPECT_THAT(error_of([] { unhex("abc", "w", "a key"); }), HasSubstr("a key is not hex"));
  EXPECT_THAT(error_of([] { unhex("zz", "w", "a key"); }), HasSubstr("a key is not hex"));
}

nlohmann::json seed_reply() {
  cache::FetchReply r;
  r.worker = "00ff";
  cache::StorageEntry e;
  e.kind = "ucx";
  e.bytes = 4096;
  e.device = "host:0";
  e.address = 0x7f0000000000;
  e.rkey = "abcd";
  r.storages.push_back(e);
  cache::TableRank rank;
  rank.device = "host:0";
  rank.params.push_back(cache::TableParam{"w", DType::kBF16, {64}, {1}, 0, 128, 128});
  r.ranks.push_back(rank);
  return cache::to_json(r);
}

TEST(SeedTable, ATargetAcceptsUcxStoragesOnly) {
  const cache::FetchReply r = cache::parse_fetch_reply(seed_reply(), "seed", true);
  EXPECT_EQ(r.worker, "00ff");
  ASSERT_EQ(r.storages.size(), 1U);
  EXPECT_EQ(r.storages[0].address, 0x7f0000000000U);
  EXPECT_EQ(r.storages[0].rkey, "abcd");
  EXPECT_EQ(r.descriptors(), 0U);
  // A local client never takes a seed's table, nor a seed a local daemon's.
  EXPECT_THAT(error_of([] { cache::parse_fetch_reply(seed_reply(), "d", false); }),
              HasSubstr("unknown storage kind 'ucx' (memfd or cuda_ipc)"));
  auto broken = [](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = seed_reply();
    edit(j);
    return error_of([&] { cache::parse_fetch_reply(j, "seed", true); });
  };
  EXPECT_THAT(broken([](nlohmann::json& j) { j.erase("worker"); }), HasSubstr("lacks 'worker'"));
  EXPECT_THAT(broken([](nlohmann::json& j) { j["worker"] = ""; }), HasSubstr("'worker' must be"));
  EXPECT_THAT(broken([](nlohmann::json& j) { j["worker"] = "0G"; }), HasSubstr("'worker' must be"));
  EXPECT_THAT(
      broken([](nlohmann::json& j) { j["worker"] = std::string(cache::kMaxWorkerHex + 2, 'a'); }),
      HasSubstr("'worker' must be"));
  EXPECT_THAT(broken([](nlohmann::json& j) { j["storages"][0]["rkey"] = "abc"; }),
              HasSubstr("packed remote key"));
  EXPECT_THAT(broken([](nlohmann::json& j) { j["storages"][0].erase("address"); }),
              HasSubstr("lacks 'address'"));
  EXPECT_THAT(
      broken([](nlohmann::json& j) { j["storages"][0]["address"] = ~std::uint64_t{0} - 100; }),
      HasSubstr("address and size overflow"));
  EXPECT_THAT(broken([](nlohmann::json& j) { j["storages"][0]["kind"] = "memfd"; }),
              HasSubstr("unknown storage kind 'memfd' (a seed sends ucx)"));
  EXPECT_THAT(broken([](nlohmann::json& j) { j["ranks"][0]["params"][0]["offset"] = 4000; }),
              HasSubstr("lie outside storage 0"));
}

// A seed's worker serving on a thread; a target's pulling on the test's.
class Loopback : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_memory.resize(kBytes);
    std::iota(seed_memory.begin(), seed_memory.end(), 0);
    seed = std::make_unique<Ucx>(UcxOptions{"tcp", "seed"});
    rkey = seed->packed_rkey(seed->register_memory(seed_memory.data(), kBytes));
    address = seed->worker_address();
    ASSERT_EQ(::pipe(stop), 0);
    progress = std::thread([this] { seed->serve(stop[0]); });
  }
  void TearDown() override {
    stop_seed();
    target.reset();
    seed.reset();
    ::close(stop[0]);
    ::close(stop[1]);
  }
  void stop_seed() {
    if (progress.joinable()) {
      ASSERT_EQ(::write(stop[1], "x", 1), 1);
      progress.join();
    }
  }

  // A target connected to the seed, with the seed's memory's key in `key`.
  void connect_target(std::chrono::milliseconds drain = std::chrono::seconds(2)) {
    target = std::make_unique<Ucx>(UcxOptions{"tcp", "seed", drain});
    target->connect(address);
    key = target->add_rkey(rkey);
  }

  static constexpr std::size_t kBytes = std::size_t{24} << 20;
  std::vector<std::uint8_t> seed_memory;
  std::unique_ptr<Ucx> seed, target;
  std::string rkey, address;
  std::size_t key = 0;
  int stop[2] = {-1, -1};
  std::thread progress;
};

TEST_F(Loopback, GetsLandEveryByte) {
  connect_target();
  std::vector<std::uint8_t> dst(kBytes, 0);
  const std::size_t region = target->register_memory(dst.data(), kBytes);
  const auto base = reinterpret_cast<std::uintptr_t>(seed_memory.data());
  // A large get (split in pieces), small ones, and one of a single byte.
  std::vector<Get> gets = {
      {reinterpret_cast<std::byte*>(dst.data()), base, key, std::size_t{20} << 20, region, 0},
      {reinterpret_cast<std::byte*>(dst.data()) + (20 << 20), base + (20 << 20), key, 4096,
       Get::kNoRegion, 1},
      {reinterpret_cast<std::byte*>(dst.data()) + (20 << 20) + 4096, base + (20 << 20) + 4096, key,
       1, region, 2}};
  const PullResult r = target->pull(gets, std::size_t{1} << 20, std::chrono::seconds(10), nullptr);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.bytes, (std::size_t{20} << 20) + 4097);
  EXPECT_TRUE(std::equal(dst.begin(), dst.begin() + (20 << 20) + 4097, seed_memory.begin()));
  EXPECT_EQ(dst[(20 << 20) + 4097], 0);  // nothing beyond
  target->disconnect(std::chrono::seconds(2));
}

TEST_F(Loopback, ASeedThatStopsAnsweringEndsThePullInBoundedTime) {
  connect_target();
  std::vector<std::uint8_t> dst(kBytes, 0);
  const auto base = reinterpret_cast<std::uintptr_t>(seed_memory.data());
  // Warm up the connection, then stop the seed's progress: over TCP nothing more
  // is answered.
  std::vector<Get> one = {
      {reinterpret_cast<std::byte*>(dst.data()), base, key, 4096, Get::kNoRegion, 0}};
  ASSERT_TRUE(target->pull(one, 1 << 20, std::chrono::seconds(10), nullptr).ok);
  stop_seed();
  std::vector<Get> gets;
  for (std::size_t i = 0; i < 8; ++i) {
    gets.push_back({reinterpret_cast<std::byte*>(dst.data()) + i * (1 << 20), base + i * (1 << 20),
                    key, std::size_t{1} << 20, Get::kNoRegion, 100 + i});
  }
  const auto t0 = std::chrono::steady_clock::now();
  const PullResult r = target->pull(gets, 2 << 20, std::chrono::milliseconds(300), nullptr);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("no data from the seed for 300 ms"));
  EXPECT_GE(r.failed_tag, 100U);
  // A forced close cancels what was in flight; nothing was left unknown.
  EXPECT_EQ(r.in_doubt_gets, 0U) << r.in_doubt_bytes;
}

TEST_F(Loopback, GetsNotWaitedForAreInDoubt) {
  // With no drain, a pull that gives up does not wait for the cancellations: every
  // get still in flight is in doubt (what the runtime quarantines).
  connect_target(std::chrono::milliseconds(0));
  std::vector<std::uint8_t> dst(kBytes, 0);
  const auto base = reinterpret_cast<std::uintptr_t>(seed_memory.data());
  std::vector<Get> one = {
      {reinterpret_cast<std::byte*>(dst.data()), base, key, 4096, Get::kNoRegion, 0}};
  ASSERT_TRUE(target->pull(one, 1 << 20, std::chrono::seconds(10), nullptr).ok);
  stop_seed();
  std::vector<Get> gets = {{reinterpret_cast<std::byte*>(dst.data()), base, key,
                            std::size_t{4} << 20, Get::kNoRegion, 9}};
  const PullResult r = target->pull(gets, 8 << 20, std::chrono::milliseconds(200), nullptr);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.failed_tag, 9U);
  EXPECT_GT(r.in_doubt_gets, 0U);
  EXPECT_GT(r.in_doubt_bytes, 0U);
  EXPECT_LE(r.in_doubt_bytes, std::size_t{4} << 20);
  // What may still be written must outlive this test: the target is kept, as the
  // runtime's quarantine keeps it.
  static std::vector<std::unique_ptr<Ucx>> kept;
  static std::vector<std::vector<std::uint8_t>> memory;
  kept.push_back(std::move(target));
  memory.push_back(std::move(dst));
}

TEST_F(Loopback, BadKeysAndAddressesAreRefused) {
  target = std::make_unique<Ucx>(UcxOptions{"tcp", "seed"});
  EXPECT_THAT(error_of([&] { target->connect("zz"); }), HasSubstr("worker address is not hex"));
  target->connect(address);
  // What a packed key holds is UCX's to parse, and it trusts it: a target takes keys
  // only from a seed that proved it holds the token (remote/control.hpp).
  EXPECT_THAT(error_of([&] { target->add_rkey("0g"); }), HasSubstr("a remote key is not hex"));
  std::vector<std::uint8_t> dst(16);
  std::vector<Get> gets = {{reinterpret_cast<std::byte*>(dst.data()), 0, 7, 16, Get::kNoRegion, 0}};
  EXPECT_THAT(error_of([&] { target->pull(gets, 1 << 20, std::chrono::seconds(1), nullptr); }),
              HasSubstr("names a key or region that does not exist"));
  EXPECT_THAT(error_of([] {
                Ucx u(UcxOptions{"no_such_transport", "seed"});
              }),
              HasSubstr("remote: seed: UCX"));
}

}  // namespace
}  // namespace ferry::remote
