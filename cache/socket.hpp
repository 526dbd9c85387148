// The weight cache's wire: AF_UNIX stream sockets carrying frames (a 4-byte
// big-endian length, then that many bytes of JSON text, capped in size and nesting
// depth) and open descriptors (SCM_RIGHTS). Every read and write has a deadline:
// a peer that stalls costs its connection at most that long. Every failure throws
// ferry::Error(Stage::kCache) naming the socket's path and what failed.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::cache {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// A frame's largest body: the parameter table of a 1,000,000-param model fits.
inline constexpr std::size_t kMaxFrameBytes = std::size_t{256} << 20;
// JSON nesting a frame may have (the protocol's messages nest 4 levels).
inline constexpr std::size_t kMaxFrameDepth = 16;
// Descriptors one message carries (the kernel's SCM_MAX_FD is 253).
inline constexpr std::size_t kFdsPerMessage = 250;

// An owned descriptor, closed when it dies.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset(o.release());
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// The text of a frame's body, parsed: a JSON object no deeper than kMaxFrameDepth.
// `where` names the peer in the error. What fuzz/fuzz_frame.cpp feeds.
nlohmann::json parse_frame(std::string_view body, const std::string& where);

// A connected socket with its path (for messages) and the deadline every operation
// on it keeps.
class Connection {
 public:
  Connection(UniqueFd fd, std::string where) : fd_(std::move(fd)), where_(std::move(where)) {}
  int fd() const { return fd_.get(); }
  const std::string& where() const { return where_; }
  void set_deadline(Deadline d) { deadline_ = d; }
  // A descriptor that, once readable, ends every wait at once (a stopping daemon's
  // wake-up pipe): the operation fails saying so. -1: none.
  void set_cancel_fd(int fd) { cancel_fd_ = fd; }
  Deadline deadline() const { return deadline_; }

  void write_frame(const nlohmann::json& doc);
  // The next frame; a body over `max_bytes` is refused before it is read.
  nlohmann::json read_frame(std::size_t max_bytes = kMaxFrameBytes);
  // The same, or nullopt when the peer closed the connection before the frame's
  // first byte (the end of a conversation, not an error).
  std::optional<nlohmann::json> next_frame(std::size_t max_bytes = kMaxFrameBytes);
  // Sends `fds` (in messages of at most kFdsPerMessage), each with one byte.
  void send_fds(std::span<const int> fds);
  // Receives exactly `count` descriptors (close-on-exec), refusing anything else.
  std::vector<UniqueFd> receive_fds(std::size_t count);

  // The peer's pid, uid and gid (SO_PEERCRED).
  struct Peer {
    pid_t pid = 0;
    uid_t uid = 0;
    gid_t gid = 0;
  };
  Peer peer() const;

 private:
  void write_all(const void* data, std::size_t bytes);
  // Reads `bytes`; with `eof_ok`, false when the peer closed before the first byte.
  bool read_all(void* data, std::size_t bytes, bool eof_ok = false);
  void wait(short events);  // poll until ready or the deadline passes (throws)

  UniqueFd fd_;
  std::string where_;
  Deadline deadline_ = Deadline::max();
  int cancel_fd_ = -1;
};

// A listening socket at `path` (which must not exist), mode 0600, non-blocking.
UniqueFd listen_unix(const std::string& path, int backlog = 64);
// Connects to `path` before `deadline`. ECONNREFUSED and ENOENT are reported with
// their errno in the error's rule ("connection refused", "no such socket").
Connection connect_unix(const std::string& path, Deadline deadline);
// A connection accepted from `listener`, or none when nothing is waiting.
std::optional<Connection> accept_one(int listener, const std::string& where);

// Longest path a sockaddr_un holds (107 bytes and the terminator).
inline constexpr std::size_t kMaxSocketPath = 107;

}  // namespace ferry::cache
