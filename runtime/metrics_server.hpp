// metrics.listen's HTTP endpoint: GET /metrics answered with the Prometheus text of
// the registered collectables, from one thread that multiplexes every connection
// (poll), instead of prometheus-cpp's Exposer (civetweb). civetweb gives each
// connection a worker thread until its request is complete or request_timeout_ms
// (30 s) passes, so as many idle connections as workers (2) stopped every scrape,
// and no option caps or evicts connections (hardening round two; docs/OPERATING.md,
// "The metrics endpoint"). Here an idle or slow client costs one descriptor and a
// small buffer, never the thread:
//   - a request must arrive whole within request_timeout (5 s), and the answer be
//     taken within write_timeout (5 s), else the connection is closed;
//   - at most max_connections are open; one more closes the connection that has
//     waited longest for its request, so a new scraper is always taken;
//   - a request is at most max_request_bytes (headers; no body is read);
//   - one answer per connection (Connection: close).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace prometheus {
class Collectable;
}  // namespace prometheus

namespace ferry::runtime {

struct MetricsServerOptions {
  // Open connections, the listening socket not counted (a descriptor each).
  std::size_t max_connections = 256;
  // From accept to the end of the request's headers.
  std::chrono::milliseconds request_timeout{5000};
  // From the request to the last byte of the answer taken by the client.
  std::chrono::milliseconds write_timeout{5000};
  // The request line and headers; more is answered 431 and closed.
  std::size_t max_request_bytes = 16 * 1024;
};

class MetricsServer {
 public:
  // Listens on `address` ("HOST:PORT", HOST an IPv4 or [IPv6] address or a name;
  // port 0 picks a free one) and serves from a thread of its own. Throws
  // std::runtime_error saying why when it cannot resolve, bind, listen or start
  // its thread (nothing is left open then).
  explicit MetricsServer(const std::string& address, MetricsServerOptions options = {});
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  // Stops serving and closes every connection (joins the thread).
  ~MetricsServer();

  // Adds a collectable to what GET /metrics answers (thread-safe); one that has
  // expired is skipped.
  void add(std::weak_ptr<prometheus::Collectable> collectable);
  // The port it listens on.
  std::vector<int> ports() const;

  struct Impl;  // metrics_server.cpp

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::runtime
