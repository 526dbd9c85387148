#include "cache/socket.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.hpp"
#include "common/json_depth.hpp"

namespace ferry::cache {

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& rule) {
  throw Error(Stage::kCache, where, "", rule);
}

std::string errno_text(int err) {
  return std::strerror(err);
}

sockaddr_un address_of(const std::string& path) {
  if (path.empty() || path.size() > kMaxSocketPath) {
    fail(path, "a socket path must have 1 to " + std::to_string(kMaxSocketPath) +
                   " bytes, this one has " + std::to_string(path.size()));
  }
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.data(), path.size());
  return a;
}

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) {
    ::close(fd_);
  }
  fd_ = fd;
}

nlohmann::json parse_frame(std::string_view body, const std::string& where) {
  if (json_depth(body, kMaxFrameDepth) > kMaxFrameDepth) {
    fail(where, "a frame's JSON nests deeper than " + std::to_string(kMaxFrameDepth) + " levels");
  }
  nlohmann::json doc = nlohmann::json::parse(body, nullptr, false);
  if (doc.is_discarded()) {
    fail(where, "a frame is not valid JSON");
  }
  if (!doc.is_object()) {
    fail(where, "a frame must hold a JSON object, got " + std::string(doc.type_name()));
  }
  return doc;
}

void Connection::wait(short events) {
  for (;;) {
    const auto now = Clock::now();
    if (now >= deadline_) {
      fail(where_, "timed out");
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - now).count() + 1;
    pollfd fds[2] = {{fd_.get(), events, 0}, {cancel_fd_, POLLIN, 0}};
    const int n =
        ::poll(fds, cancel_fd_ >= 0 ? 2 : 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
    const pollfd& p = fds[0];
    if (n > 0 && cancel_fd_ >= 0 && (fds[1].revents & POLLIN) != 0) {
      fail(where_, "the daemon is stopping");
    }
    if (n > 0) {
      if ((p.revents & (POLLERR | POLLNVAL)) != 0) {
        fail(where_, "the socket failed");
      }
      return;  // readable, writable or hung up: the read or write says which
    }
    if (n < 0 && errno != EINTR) {
      fail(where_, "poll: " + errno_text(errno));
    }
  }
}

void Connection::write_all(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    wait(POLLOUT);
    const ssize_t n = ::send(fd_.get(), p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) {
        continue;
      }
      fail(where_, "send: " + errno_text(errno));
    }
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

bool Connection::read_all(void* data, std::size_t bytes, bool eof_ok) {
  auto* p = static_cast<char*>(data);
  const std::size_t total = bytes;
  while (bytes > 0) {
    wait(POLLIN);
    const ssize_t n = ::recv(fd_.get(), p, bytes, MSG_DONTWAIT);
    if (n == 0 && eof_ok && bytes == total) {
      return false;
    }
    if (n == 0) {
      fail(where_, "the peer closed the connection in the middle of a frame");
    }
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) {
        continue;
      }
      fail(where_, "recv: " + errno_text(errno));
    }
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

void Connection::write_frame(const nlohmann::json& doc) {
  const std::string body = doc.dump();
  if (body.size() > kMaxFrameBytes) {
    fail(where_, "a frame of " + std::to_string(body.size()) + " bytes is over the cap of " +
                     std::to_string(kMaxFrameBytes));
  }
  const auto n = static_cast<std::uint32_t>(body.size());
  const unsigned char length[4] = {
      static_cast<unsigned char>(n >> 24), static_cast<unsigned char>(n >> 16),
      static_cast<unsigned char>(n >> 8), static_cast<unsigned char>(n)};
  write_all(length, 4);
  write_all(body.data(), body.size());
}

nlohmann::json Connection::read_frame(std::size_t max_bytes) {
  std::optional<nlohmann::json> frame = next_frame(max_bytes);
  if (!frame) {
    fail(where_, "the peer closed the connection");
  }
  return std::move(*frame);
}

std::optional<nlohmann::json> Connection::next_frame(std::size_t max_bytes) {
  unsigned char length[4];
  if (!read_all(length, 4, true)) {
    return std::nullopt;
  }
  const std::size_t n = (std::size_t{length[0]} << 24) | (std::size_t{length[1]} << 16) |
                        (std::size_t{length[2]} << 8) | std::size_t{length[3]};
  if (n > max_bytes) {
    fail(where_, "a frame announces " + std::to_string(n) + " bytes, over the cap of " +
                     std::to_string(max_bytes));
  }
  std::string body(n, '\0');
  read_all(body.data(), n);
  return parse_frame(body, where_);
}

void Connection::send_fds(std::span<const int> fds) {
  while (!fds.empty()) {
    const std::size_t k = std::min(fds.size(), kFdsPerMessage);
    char byte = 'F';
    iovec iov{&byte, 1};
    std::vector<char> control(CMSG_SPACE(sizeof(int) * k), 0);
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * k);
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * k);
    for (;;) {
      wait(POLLOUT);
      const ssize_t n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n == 1) {
        break;
      }
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
        continue;
      }
      fail(where_, "sendmsg (descriptors): " + errno_text(n < 0 ? errno : EIO));
    }
    fds = fds.subspan(k);
  }
}

std::vector<UniqueFd> Connection::receive_fds(std::size_t count) {
  std::vector<UniqueFd> out;
  while (out.size() < count) {
    const std::size_t want = std::min(count - out.size(), kFdsPerMessage);
    char byte = 0;
    iovec iov{&byte, 1};
    std::vector<char> control(CMSG_SPACE(sizeof(int) * kFdsPerMessage), 0);
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    ssize_t n = -1;
    for (;;) {
      wait(POLLIN);
      n = ::recvmsg(fd_.get(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
        continue;
      }
      break;
    }
    if (n < 0) {
      fail(where_, "recvmsg (descriptors): " + errno_text(errno));
    }
    // Whatever arrived is owned now, so that a refusal below closes it.
    std::vector<UniqueFd> got;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < k; ++i) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          got.emplace_back(fd);
        }
      }
    }
    if (n == 0) {
      fail(where_, "the peer closed the connection before sending its descriptors");
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) {
      fail(where_, "more descriptors were sent than announced (truncated)");
    }
    if (got.size() != want || byte != 'F') {
      fail(where_, "expected a message with " + std::to_string(want) + " descriptor(s), got " +
                       std::to_string(got.size()));
    }
    for (UniqueFd& fd : got) {
      out.push_back(std::move(fd));
    }
  }
  return out;
}

Connection::Peer Connection::peer() const {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd_.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    fail(where_, "SO_PEERCRED: " + errno_text(errno));
  }
  return Peer{cred.pid, cred.uid, cred.gid};
}

UniqueFd listen_unix(const std::string& path, int backlog) {
  const sockaddr_un a = address_of(path);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    fail(path, "socket: " + errno_text(errno));
  }
  // 0600 from the start: no moment in which another user may connect.
  const mode_t old = ::umask(0177);
  const int rc = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  const int err = errno;
  ::umask(old);
  if (rc != 0) {
    fail(path, "bind: " + errno_text(err));
  }
  if (::listen(fd.get(), backlog) != 0) {
    fail(path, "listen: " + errno_text(errno));
  }
  return fd;
}

Connection connect_unix(const std::string& path, Deadline deadline) {
  const sockaddr_un a = address_of(path);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    fail(path, "socket: " + errno_text(errno));
  }
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
    if (errno == EAGAIN) {
      fail(path, "the daemon's backlog is full (connect: EAGAIN)");
    }
    if (errno == ECONNREFUSED) {
      fail(path, "connection refused: no process listens on the socket");
    }
    if (errno == ENOENT) {
      fail(path, "no such socket");
    }
    fail(path, "connect: " + errno_text(errno));
  }
  Connection c(std::move(fd), path);
  c.set_deadline(deadline);
  return c;
}

std::optional<Connection> accept_one(int listener, const std::string& where) {
  const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) {
      return std::nullopt;
    }
    fail(where, "accept: " + errno_text(errno));
  }
  return Connection(UniqueFd(fd), where);
}

}  // namespace ferry::cache
