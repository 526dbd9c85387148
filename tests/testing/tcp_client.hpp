// A TCP client for tests of ferry's metrics endpoint (runtime/metrics_server.hpp):
// one connection to 127.0.0.1:PORT, closed with the object, that sends bytes, reads
// until the server closes (bounded in time) and tells whether the server closed it.
// It asserts nothing itself: a test checks connected() and send()'s result.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace ferry::testing {

class TcpClient {
 public:
  // `receive_buffer` > 0: SO_RCVBUF, set before connecting (it bounds the window, so
  // that a client that never reads stalls the server's writes).
  explicit TcpClient(int port, int receive_buffer = 0)
      : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    if (fd_ >= 0 && receive_buffer > 0 &&
        ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer) != 0) {
      close_fd();
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      close_fd();
    }
  }
  TcpClient(TcpClient&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  TcpClient(const TcpClient&) = delete;
  TcpClient& operator=(const TcpClient&) = delete;
  TcpClient& operator=(TcpClient&&) = delete;
  ~TcpClient() { close_fd(); }

  bool connected() const { return fd_ >= 0; }
  // Whether every byte was sent (never SIGPIPE).
  bool send(const std::string& bytes) const {
    return fd_ >= 0 && ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
                           static_cast<ssize_t>(bytes.size());
  }
  // Everything until the server closes, or what came when `limit` ran out.
  std::string read_all(std::chrono::milliseconds limit = std::chrono::seconds(10)) const {
    using Clock = std::chrono::steady_clock;
    std::string out;
    const Clock::time_point end = Clock::now() + limit;
    char buf[4096];
    while (fd_ >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
      pollfd p{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
        return out;
      }
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        return out;
      }
      out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
  }
  // True when the server closed this connection within `limit`.
  bool closed_within(std::chrono::milliseconds limit) const {
    pollfd p{fd_, POLLIN, 0};
    if (fd_ < 0 || ::poll(&p, 1, static_cast<int>(limit.count())) <= 0) {
      return false;
    }
    char c;
    return ::recv(fd_, &c, 1, MSG_DONTWAIT) <= 0;
  }

 private:
  void close_fd() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  int fd_;
};

}  // namespace ferry::testing
