// Attack: the metrics slowloris (hardening round two, 6). Two idle TCP connections
// used to take metrics.listen down for 30 s each (civetweb's two workers waited
// for their requests). Here 200 idle connections, some of them halfway through a
// request, are held open while 50 scrapes must each be answered within a second;
// an idle connection is closed by the server within its request timeout; more idle
// connections than the cap evict the oldest and still leave room for a scraper.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "ferry/metrics.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/tcp_client.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using testing::make_config;
using ::testing::StartsWith;
using testing::TempDir;
using Clock = std::chrono::steady_clock;

using Client = testing::TcpClient;

struct Scrape {
  std::string response;
  std::chrono::milliseconds took{};
};

// GET /metrics on a connection of its own, bounded by `limit` in all.
Scrape scrape(int port, std::chrono::milliseconds limit) {
  const Clock::time_point began = Clock::now();
  Scrape s;
  Client c(port);
  if (c.connected() && c.send("GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")) {
    s.response = c.read_all(limit);
  }
  s.took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began);
  return s;
}

// The bound of one scrape. A scrape takes a few milliseconds; the second is for a
// busy 2-core machine under the sanitizers. Before the fix a scrape waited for the
// idle connections' 30 s timeouts, so each one of these ran out.
constexpr std::chrono::milliseconds kScrapeBound{1000};

class AttackMetricsSlowloris : public ::testing::Test {
 protected:
  AttackMetricsSlowloris()
      : rt_(to_config(make_config(dir_.file("no-model"), {"metrics.listen=127.0.0.1:0"}))) {}
  int port() const { return metrics_ports(rt_).at(0); }

  TempDir dir_;
  Runtime rt_;
};

TEST_F(AttackMetricsSlowloris, TwoHundredIdleConnectionsDoNotStarveFiftyScrapes) {
  ASSERT_EQ(metrics_ports(rt_).size(), 1u);
  const int port = this->port();
  std::vector<Client> idle;
  for (int i = 0; i < 200; ++i) {
    idle.emplace_back(port);
    ASSERT_TRUE(idle.back().connected()) << "idle connection " << i;
    if (i % 2 == 1) {
      // Half of them stop halfway through their request, as a slowloris does.
      ASSERT_TRUE(idle.back().send("GET /metrics HTTP/1.1\r\nHost: x\r\n"));
    }
  }
  // Five scrapers at once, ten scrapes each, the idle ones still open throughout.
  std::vector<std::future<std::vector<Scrape>>> scrapers;
  for (int t = 0; t < 5; ++t) {
    scrapers.push_back(std::async(std::launch::async, [port] {
      std::vector<Scrape> done;
      for (int i = 0; i < 10; ++i) {
        done.push_back(scrape(port, std::chrono::seconds(10)));
        if (done.back().took > kScrapeBound) {
          break;  // failed: no need to wait out the other nine
        }
      }
      return done;
    }));
  }
  int answered = 0;
  for (auto& f : scrapers) {
    for (const Scrape& s : f.get()) {
      EXPECT_THAT(s.response, StartsWith("HTTP/1.1 200 OK"));
      EXPECT_THAT(s.response, HasSubstr("ferry_reader_inflight"));
      EXPECT_LE(s.took.count(), kScrapeBound.count()) << "a scrape waited for the idle ones";
      answered += s.took <= kScrapeBound ? 1 : 0;
    }
  }
  EXPECT_EQ(answered, 50);
}

TEST_F(AttackMetricsSlowloris, AnIdleConnectionIsClosedWithinTheRequestTimeout) {
  const Client idle(port());
  ASSERT_TRUE(idle.connected());
  const Client slow(port());
  ASSERT_TRUE(slow.connected());
  const Clock::time_point began = Clock::now();
  // One byte a second never completes a request: the timeout counts from accept.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(slow.send("G"));
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  // The timeout is 5 s; 20 s leaves the sanitizers room and is still far below
  // civetweb's 30 s of before.
  EXPECT_TRUE(idle.closed_within(std::chrono::seconds(20)));
  EXPECT_TRUE(slow.closed_within(std::chrono::seconds(20)));
  const auto took = Clock::now() - began;
  EXPECT_GE(took, std::chrono::milliseconds(4500)) << "closed before its 5 s";
  EXPECT_LT(took, std::chrono::seconds(20));
}

TEST_F(AttackMetricsSlowloris, MoreIdleConnectionsThanTheCapEvictTheOldest) {
  const int port = this->port();
  // 300 > the cap of 256: the oldest idle ones are closed to make room.
  std::vector<Client> idle;
  for (int i = 0; i < 300; ++i) {
    idle.emplace_back(port);
    ASSERT_TRUE(idle.back().connected()) << "idle connection " << i;
  }
  for (int i = 0; i < 10; ++i) {
    const Scrape s = scrape(port, std::chrono::seconds(10));
    EXPECT_THAT(s.response, StartsWith("HTTP/1.1 200 OK"));
    EXPECT_LE(s.took.count(), kScrapeBound.count());
  }
  EXPECT_TRUE(idle.front().closed_within(std::chrono::seconds(2)));       // the oldest went first
  EXPECT_FALSE(idle.back().closed_within(std::chrono::milliseconds(0)));  // the newest stays
}

}  // namespace
}  // namespace ferry::runtime
