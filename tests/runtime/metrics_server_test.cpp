// MetricsServer (metrics.listen's endpoint), with small limits so that each rule
// shows quickly: GET and HEAD of /metrics, 404/405/400/431 for the rest, the
// request and write timeouts, the cap on connections that closes the longest-idle
// one, a registry added while serving, an expired one skipped, a bind refused.
#include "runtime/metrics_server.hpp"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_start.hpp"
#include "ferry/error.hpp"
#include "testing/tcp_client.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using Clock = std::chrono::steady_clock;

using Client = testing::TcpClient;

std::string request(int port, const std::string& text) {
  Client c(port);
  EXPECT_TRUE(c.connected()) << "127.0.0.1:" << port;
  EXPECT_TRUE(c.send(text));
  return c.read_all();
}

std::shared_ptr<prometheus::Registry> registry_with(const std::string& counter) {
  auto r = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name(counter).Help("x").Register(*r).Add({}).Increment(3);
  return r;
}

TEST(MetricsServer, ServesTheRegistriesAndRefusesTheRest) {
  MetricsServer server("127.0.0.1:0");
  ASSERT_EQ(server.ports().size(), 1u);
  const int port = server.ports()[0];
  ASSERT_GT(port, 0);
  auto first = registry_with("first_total");
  server.add(first);
  std::string r = request(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(r, HasSubstr("\r\n\r\n# HELP first_total x\n"));
  EXPECT_THAT(r, HasSubstr("first_total 3"));
  // Added while serving; a query string is ignored; an expired registry is skipped.
  {
    auto second = registry_with("second_total");
    server.add(second);
    r = request(port, "GET /metrics?x=1 HTTP/1.0\r\n\r\n");
    EXPECT_THAT(r, HasSubstr("first_total 3"));
    EXPECT_THAT(r, HasSubstr("second_total 3"));
  }
  r = request(port, "GET /metrics HTTP/1.0\n\n");  // bare newlines
  EXPECT_THAT(r, HasSubstr("first_total 3"));
  EXPECT_THAT(r, Not(HasSubstr("second_total")));
  // HEAD: the headers, with the length, and no body.
  r = request(port, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, Not(HasSubstr("first_total")));
  EXPECT_THAT(r, HasSubstr("Content-Length: "));
  EXPECT_THAT(request(port, "GET / HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404 "));
  EXPECT_THAT(request(port, "POST /metrics HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 405 "));
  EXPECT_THAT(request(port, "hello\r\n\r\n"), StartsWith("HTTP/1.1 400 "));
  EXPECT_THAT(request(port, "GET /metrics SMTP\r\n\r\n"), StartsWith("HTTP/1.1 400 "));
}

TEST(MetricsServer, ARequestTooLargeIsRefused) {
  MetricsServerOptions options;
  options.max_request_bytes = 1024;
  MetricsServer server("127.0.0.1:0", options);
  Client c(server.ports()[0]);
  EXPECT_TRUE(c.send("GET /metrics HTTP/1.1\r\nX-Long: " + std::string(4096, 'a')));
  EXPECT_THAT(c.read_all(), StartsWith("HTTP/1.1 431 "));
}

TEST(MetricsServer, AClientTooSlowToAskIsClosedAtTheRequestTimeout) {
  MetricsServerOptions options;
  options.request_timeout = std::chrono::milliseconds(300);
  MetricsServer server("127.0.0.1:0", options);
  const auto registry = registry_with("c_total");  // the server keeps a weak reference
  server.add(registry);
  const Clock::time_point began = Clock::now();
  Client idle(server.ports()[0]);
  Client partial(server.ports()[0]);
  ASSERT_TRUE(idle.connected());
  EXPECT_TRUE(partial.send("GET /metrics HTTP/1.1\r\n"));
  EXPECT_TRUE(idle.closed_within(std::chrono::seconds(10)));
  EXPECT_TRUE(partial.closed_within(std::chrono::seconds(10)));
  EXPECT_GE(Clock::now() - began, std::chrono::milliseconds(250));
  // A scraper that asks in time is answered.
  EXPECT_THAT(request(server.ports()[0], "GET /metrics HTTP/1.1\r\n\r\n"), HasSubstr("c_total 3"));
}

TEST(MetricsServer, TheCapClosesTheLongestIdleConnectionForANewOne) {
  MetricsServerOptions options;
  options.max_connections = 4;
  MetricsServer server("127.0.0.1:0", options);
  const auto registry = registry_with("c_total");  // the server keeps a weak reference
  server.add(registry);
  const int port = server.ports()[0];
  std::vector<Client> idle;
  for (int i = 0; i < 4; ++i) {
    idle.emplace_back(port);
    ASSERT_TRUE(idle.back().connected()) << i;
  }
  // The kernel queues connections in the order made: the server accepts them so.
  EXPECT_THAT(request(port, "GET /metrics HTTP/1.1\r\n\r\n"), HasSubstr("c_total 3"));
  EXPECT_TRUE(idle[0].closed_within(std::chrono::seconds(5)));
  for (int i = 1; i < 4; ++i) {
    EXPECT_FALSE(idle[static_cast<std::size_t>(i)].closed_within(std::chrono::milliseconds(0)))
        << i;
  }
}

TEST(MetricsServer, AClientThatNeverReadsItsAnswerIsClosedAtTheWriteTimeout) {
  MetricsServerOptions options;
  options.write_timeout = std::chrono::milliseconds(2000);
  MetricsServer server("127.0.0.1:0", options);
  // About 8 MB of metrics: more than the socket buffers hold (a sender's grows
  // to 4 MiB by default; the stuck receiver's is kept small).
  auto big = std::make_shared<prometheus::Registry>();
  auto& family = prometheus::BuildCounter().Name("big_total").Help("x").Register(*big);
  for (int i = 0; i < 8'000; ++i) {
    family.Add({{"label", std::string(1000, 'x') + std::to_string(i)}});
  }
  server.add(big);
  const int port = server.ports()[0];
  Client stuck(port, 4096);
  EXPECT_TRUE(stuck.send("GET /metrics HTTP/1.1\r\n\r\n"));
  // Meanwhile another scrape is answered whole.
  const std::string whole = request(port, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_THAT(whole, HasSubstr("big_total{label=\"" + std::string(1000, 'x') + "7999\"} 0"));
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  // Past the write timeout: what was sent, then the end, short of the whole answer.
  const std::string got = stuck.read_all(std::chrono::seconds(10));
  EXPECT_LT(got.size(), whole.size());
}

TEST(MetricsServer, APortInUseIsRefusedSaying) {
  MetricsServer first("127.0.0.1:0");
  const std::string taken = "127.0.0.1:" + std::to_string(first.ports()[0]);
  try {
    MetricsServer second(taken);
    ADD_FAILURE() << "a second server on " << taken;
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot listen on " + taken + ": Address already in use"));
  }
  // A port that is not a number is refused before any lookup.
  EXPECT_THROW(MetricsServer("127.0.0.1:http"), std::runtime_error);
}

TEST(MetricsServer, AThreadTheSystemRefusesIsAResourcesErrorAndLeavesNothingListening) {
  inject_thread_start_failure("metrics server");
  std::uint16_t port = 0;
  try {
    MetricsServer server("127.0.0.1:0");
    port = server.ports()[0];
    ADD_FAILURE() << "served on " << port << " without its thread";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kResources) << e.what();
    EXPECT_THAT(e.what(), HasSubstr("could not start thread metrics server"));
  }
  clear_thread_start_failure();
  // The next server starts as usual.
  MetricsServer server("127.0.0.1:0");
  EXPECT_FALSE(server.ports().empty());
}

TEST(MetricsServer, ServesOnIpv6Loopback) {
  std::unique_ptr<MetricsServer> server;
  try {
    server = std::make_unique<MetricsServer>("[::1]:0");
  } catch (const std::runtime_error& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
  const auto registry = registry_with("c_total");
  server->add(registry);
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in6 addr{};
  addr.sin6_family = AF_INET6;
  addr.sin6_port = htons(static_cast<std::uint16_t>(server->ports()[0]));
  addr.sin6_addr = in6addr_loopback;
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string req = "GET /metrics HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) {
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  EXPECT_THAT(out, HasSubstr("c_total 3"));
}

}  // namespace
}  // namespace ferry::runtime
