// metrics.listen's HTTP endpoint (see metrics_server.hpp for why ferry serves it
// itself): one thread polls the listening socket, a wake-up eventfd and every
// connection; each connection reads its request, is answered from a buffer as the
// client takes it, then drains until the client closes. Deadlines and the cap on
// connections keep idle and slow clients from holding anything a scraper needs.
#include "runtime/metrics_server.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "common/thread_start.hpp"
#include "ferry/error.hpp"

namespace ferry::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// After the answer: how long the client gets to close its end before ferry closes
// (closing with its bytes unread would reset the connection, and could cut the
// answer short at the client).
constexpr std::chrono::milliseconds kDrainTimeout{1000};
// While accept() finds no descriptor left and no connection can be closed for one.
constexpr std::chrono::milliseconds kAcceptPause{100};
constexpr std::size_t kReadChunk = 4096;

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

 private:
  int fd_ = -1;
};

enum class ConnState {
  kReading,    // waiting for the request's headers
  kAnswering,  // writing the answer
  kDraining,   // answer sent, write side shut: waiting for the client to close
};

struct Connection {
  Fd fd;
  ConnState state = ConnState::kReading;
  Clock::time_point deadline;
  std::string in;
  std::string out;
  std::size_t sent = 0;
};

std::string response(std::string_view status, std::string_view content_type,
                     const std::string& body, bool head, std::string_view extra_headers = {}) {
  std::string r = "HTTP/1.1 ";
  r += status;
  r += "\r\nContent-Type: ";
  r += content_type;
  r += "\r\nContent-Length: " + std::to_string(body.size());
  r += "\r\nConnection: close\r\n";
  r += extra_headers;
  r += "\r\n";
  if (!head) {
    r += body;
  }
  return r;
}

std::string plain(std::string_view status, std::string_view extra_headers = {}) {
  return response(status, "text/plain; charset=utf-8", std::string(status) + "\n", false,
                  extra_headers);
}

// Where the headers end ("\r\n\r\n", or "\n\n" from a lax client), or npos.
std::size_t headers_end(const std::string& in) {
  const std::size_t crlf = in.find("\r\n\r\n");
  const std::size_t lf = in.find("\n\n");
  return std::min(crlf, lf);
}

// HOST and PORT of "HOST:PORT" ("[v6]:PORT" too); a bare port listens on loopback,
// as load_config's metrics_bind_address reads one.
std::pair<std::string, std::string> split_address(const std::string& address) {
  const std::size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return {"127.0.0.1", address};
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return {host, address.substr(colon + 1)};
}

}  // namespace

struct MetricsServer::Impl {
  MetricsServerOptions options;
  Fd listener;
  Fd wake;  // eventfd: the destructor's stop
  int port = 0;
  mutable std::mutex mu;  // guards collectables
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables;
  std::atomic<bool> stopping{false};
  std::vector<Connection> connections;  // in the order accepted
  std::thread thread;

  void listen_on(const std::string& address);
  void serve();
  void accept_all(Clock::time_point now, Clock::time_point& accept_paused_until);
  bool make_room();
  // Reads what came; returns false when the connection is to be closed.
  bool on_readable(Connection& c, Clock::time_point now);
  bool on_writable(Connection& c, Clock::time_point now);
  std::string answer(const std::string& request);
  std::string render();
};

void MetricsServer::Impl::listen_on(const std::string& address) {
  const auto [host, service] = split_address(address);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    throw std::runtime_error("cannot resolve " + address + ": " + ::gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  int last_errno = 0;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last_errno = errno;
      continue;
    }
    const int one = 1;
    // A restarted engine rebinds while its old connections sit in TIME_WAIT; a port
    // another socket listens on is still refused.
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
      last_errno = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      last_errno = errno;
      continue;
    }
    port = bound.ss_family == AF_INET6
               ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
               : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    listener = std::move(fd);
    return;
  }
  throw std::runtime_error("cannot listen on " + address + ": " +
                           (last_errno != 0 ? errno_text(last_errno) : "no address"));
}

MetricsServer::MetricsServer(const std::string& address, MetricsServerOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = options;
  impl_->listen_on(address);
  impl_->wake = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (impl_->wake.get() < 0) {
    throw std::runtime_error("cannot make an eventfd: " + errno_text(errno));
  }
  // A refused thread is Error(Stage::kResources), "could not start thread metrics
  // server" (common/thread_start.hpp).
  impl_->thread = start_thread("metrics server", [impl = impl_.get()] { impl->serve(); });
}

MetricsServer::~MetricsServer() {
  impl_->stopping.store(true);
  const std::uint64_t one = 1;
  // Cannot fail short of a full counter; the thread also checks `stopping` on wake.
  [[maybe_unused]] const ssize_t n = ::write(impl_->wake.get(), &one, sizeof one);
  if (impl_->thread.joinable()) {
    impl_->thread.join();
  }
}

void MetricsServer::add(std::weak_ptr<prometheus::Collectable> collectable) {
  std::lock_guard lock(impl_->mu);
  impl_->collectables.push_back(std::move(collectable));
}

std::vector<int> MetricsServer::ports() const {
  return {impl_->port};
}

std::string MetricsServer::Impl::render() {
  std::vector<std::shared_ptr<prometheus::Collectable>> live;
  {
    std::lock_guard lock(mu);
    for (const auto& weak : collectables) {
      if (auto c = weak.lock()) {
        live.push_back(std::move(c));
      }
    }
  }
  std::vector<prometheus::MetricFamily> families;
  for (const auto& c : live) {
    std::vector<prometheus::MetricFamily> some = c->Collect();
    families.insert(families.end(), std::make_move_iterator(some.begin()),
                    std::make_move_iterator(some.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

std::string MetricsServer::Impl::answer(const std::string& request) {
  const std::size_t line_end = request.find_first_of("\r\n");
  const std::string_view line = std::string_view(request).substr(0, line_end);
  const std::size_t sp1 = line.find(' ');
  const std::size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.substr(sp2 + 1).substr(0, 7) != "HTTP/1.") {
    return plain("400 Bad Request");
  }
  const std::string_view method = line.substr(0, sp1);
  std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  target = target.substr(0, target.find('?'));
  if (target != "/metrics") {
    return plain("404 Not Found");
  }
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    return plain("405 Method Not Allowed", "Allow: GET, HEAD\r\n");
  }
  try {
    return response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render(), head);
  } catch (const std::exception& e) {
    // An engine's collectable that throws: the scraper is told, the server goes on.
    return response("500 Internal Server Error", "text/plain; charset=utf-8",
                    std::string("collecting the metrics failed: ") + e.what() + "\n", head);
  }
}

bool MetricsServer::Impl::on_readable(Connection& c, Clock::time_point now) {
  char buf[kReadChunk];
  while (true) {
    const ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, 0);
    if (n == 0) {
      return false;  // the client closed (or gave up before its request was whole)
    }
    if (n < 0) {
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    }
    if (c.state != ConnState::kReading) {
      continue;  // draining: what a client sends after its request is dropped
    }
    c.in.append(buf, static_cast<std::size_t>(n));
    if (const std::size_t end = headers_end(c.in); end != std::string::npos) {
      c.out = answer(c.in.substr(0, end));
    } else if (c.in.size() > options.max_request_bytes) {
      c.out = plain("431 Request Header Fields Too Large");
    } else {
      continue;
    }
    c.in.clear();
    c.in.shrink_to_fit();
    c.state = ConnState::kAnswering;
    now = Clock::now();  // collecting took its time: the client's starts now
    c.deadline = now + options.write_timeout;
    return on_writable(c, now);
  }
}

bool MetricsServer::Impl::on_writable(Connection& c, Clock::time_point now) {
  while (c.sent < c.out.size()) {
    const ssize_t n =
        ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0) {
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    }
    c.sent += static_cast<std::size_t>(n);
  }
  c.out.clear();
  c.out.shrink_to_fit();
  ::shutdown(c.fd.get(), SHUT_WR);
  c.state = ConnState::kDraining;
  c.deadline = now + kDrainTimeout;
  return true;
}

// Closes the connection that has waited longest for its request (else the oldest
// draining one) to make room for a new one; false when every connection is being
// answered.
bool MetricsServer::Impl::make_room() {
  for (const ConnState victim : {ConnState::kReading, ConnState::kDraining}) {
    auto it = std::find_if(connections.begin(), connections.end(),
                           [victim](const Connection& c) { return c.state == victim; });
    if (it != connections.end()) {
      connections.erase(it);
      return true;
    }
  }
  return false;
}

void MetricsServer::Impl::accept_all(Clock::time_point now,
                                     Clock::time_point& accept_paused_until) {
  while (true) {
    Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (fd.get() < 0) {
      if (errno == EINTR || errno == ECONNABORTED) {
        continue;
      }
      if ((errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) &&
          make_room()) {
        continue;  // a descriptor freed by closing an idle connection
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        // Out of descriptors with nothing to close: the pending connection waits
        // in the backlog; poll would report it at once, so look again a bit later.
        accept_paused_until = now + kAcceptPause;
      }
      return;
    }
    if (connections.size() >= options.max_connections && !make_room()) {
      continue;  // every slot is busy answering: this one is closed (fd's destructor)
    }
    Connection c;
    c.fd = std::move(fd);
    c.deadline = now + options.request_timeout;
    connections.push_back(std::move(c));
  }
}

void MetricsServer::Impl::serve() {
  std::vector<pollfd> fds;
  Clock::time_point accept_paused_until{};
  while (!stopping.load()) {
    const Clock::time_point now = Clock::now();
    const bool accepting = now >= accept_paused_until;
    fds.clear();
    fds.push_back({wake.get(), POLLIN, 0});
    fds.push_back({accepting ? listener.get() : -1, POLLIN, 0});  // -1: not polled
    Clock::time_point next = accepting ? Clock::time_point::max() : accept_paused_until;
    for (const Connection& c : connections) {
      fds.push_back(
          {c.fd.get(), static_cast<short>(c.state == ConnState::kAnswering ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    int timeout_ms = -1;
    if (next != Clock::time_point::max()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
      timeout_ms = static_cast<int>(std::clamp<std::int64_t>(left, 0, 60'000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      // Only EFAULT/EINVAL/ENOMEM: nothing a retry at once would change.
      std::this_thread::sleep_for(kAcceptPause);
      continue;
    }
    if (fds[0].revents != 0) {
      continue;  // woken to stop (the loop's condition)
    }
    const Clock::time_point after = Clock::now();
    // Connections first (their indices match `fds` from 2), then the new ones.
    std::size_t kept = 0;
    for (std::size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      const short revents = fds[i + 2].revents;
      bool keep = true;
      if ((revents & POLLNVAL) != 0) {
        keep = false;
      } else if (c.state == ConnState::kAnswering &&
                 (revents & (POLLOUT | POLLERR | POLLHUP)) != 0) {
        keep = on_writable(c, after);
      } else if (c.state != ConnState::kAnswering &&
                 (revents & (POLLIN | POLLERR | POLLHUP)) != 0) {
        keep = on_readable(c, after);
      }
      if (keep && after >= c.deadline) {
        keep = false;  // too slow to ask, to take the answer, or to close
      }
      if (keep) {
        if (kept != i) {
          connections[kept] = std::move(c);
        }
        ++kept;
      }
    }
    connections.resize(kept);
    if (accepting && (fds[1].revents & POLLIN) != 0) {
      accept_all(after, accept_paused_until);
    }
  }
  connections.clear();
}

}  // namespace ferry::runtime
