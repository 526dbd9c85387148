// A seed's control port (remote/control.hpp).
#include "remote/control.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <optional>

#include "common/error.hpp"
#include "common/sha256.hpp"
#include "remote/ucx.hpp"

namespace ferry::remote {

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& rule) {
  throw Error(Stage::kRemote, where, "", rule);
}

std::string errno_text(int e) {
  return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")";
}

// getaddrinfo of an address: every candidate, numeric port.
struct Resolved {
  addrinfo* list = nullptr;
  ~Resolved() {
    if (list != nullptr) {
      ::freeaddrinfo(list);
    }
  }
};

void resolve(const HostPort& a, bool passive, Resolved& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  const std::string port = std::to_string(a.port);
  const int rc = ::getaddrinfo(a.host.c_str(), port.c_str(), &hints, &out.list);
  if (rc != 0 || out.list == nullptr) {
    fail(a.text(), std::string("cannot resolve the host: ") + ::gai_strerror(rc));
  }
}

}  // namespace

std::string HostPort::text() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

HostPort parse_host_port(const std::string& text, const std::string& key, bool any_port) {
  auto bad = [&](const std::string& why) {
    throw Error(Stage::kConfig, "", "",
                key + " '" + text + "': " + why + " (expected HOST:PORT, [IPv6]:PORT)");
  };
  if (text.empty() || text.size() > 300) {
    bad(text.empty() ? "empty" : "too long");
  }
  HostPort out;
  std::string port;
  if (text.front() == '[') {
    const std::size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      bad("an IPv6 address needs brackets and a port");
    }
    out.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    in6_addr a6{};
    if (::inet_pton(AF_INET6, out.host.c_str(), &a6) != 1) {
      bad("not an IPv6 address");
    }
  } else {
    const std::size_t colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      bad("no port");
    }
    out.host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (out.host.find(':') != std::string::npos) {
      bad("an IPv6 address needs brackets");
    }
    for (char c : out.host) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-')) {
        bad("not a host name or an IPv4 address");
      }
    }
  }
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || end != port.data() + port.size() || (value == 0 && !any_port) ||
      value > 65535) {
    bad(any_port ? "the port must be 0..65535" : "the port must be 1..65535");
  }
  out.port = static_cast<std::uint16_t>(value);
  return out;
}

cache::UniqueFd listen_tcp(const HostPort& address) {
  Resolved r;
  resolve(address, true, r);
  std::string last = "no address";
  for (addrinfo* a = r.list; a != nullptr; a = a->ai_next) {
    cache::UniqueFd fd(::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
      last = "socket: " + errno_text(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      last = "bind: " + errno_text(errno);
      continue;
    }
    if (::listen(fd.get(), 64) != 0) {
      last = "listen: " + errno_text(errno);
      continue;
    }
    return fd;
  }
  fail(address.text(), "cannot listen: " + last);
}

namespace {

// The address getsockname (`peer` false) or getpeername gives for `fd`; nullopt
// when neither IPv4 nor IPv6.
std::optional<HostPort> socket_address(int fd, bool peer) {
  sockaddr_storage s{};
  socklen_t len = sizeof(s);
  auto* sa = reinterpret_cast<sockaddr*>(&s);
  if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0) {
    return std::nullopt;
  }
  char text[INET6_ADDRSTRLEN] = {};
  if (s.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<sockaddr_in*>(&s);
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    return HostPort{text, ntohs(a->sin_port)};
  }
  if (s.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<sockaddr_in6*>(&s);
    ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    return HostPort{text, ntohs(a->sin6_port)};
  }
  return std::nullopt;
}

}  // namespace

std::uint16_t bound_port(int fd) {
  const std::optional<HostPort> a = socket_address(fd, false);
  return a ? a->port : 0;
}

cache::Connection connect_tcp(const HostPort& address, cache::Deadline deadline) {
  Resolved r;
  resolve(address, false, r);
  std::string last = "no address";
  for (addrinfo* a = r.list; a != nullptr; a = a->ai_next) {
    cache::UniqueFd fd(::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
      last = "socket: " + errno_text(errno);
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = "connect: " + errno_text(errno);
        continue;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - cache::Clock::now());
      pollfd p{fd.get(), POLLOUT, 0};
      const int n = left.count() > 0 ? ::poll(&p, 1, static_cast<int>(left.count())) : 0;
      if (n <= 0) {
        last = "connect: no answer before the timeout (remote.timeout_ms)";
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last = "connect: " + errno_text(err);
        continue;
      }
    }
    const int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    cache::Connection c(std::move(fd), address.text());
    c.set_deadline(deadline);
    return c;
  }
  fail(address.text(), "cannot reach the seed: " + last);
}

std::string peer_address(int fd) {
  const std::optional<HostPort> a = socket_address(fd, true);
  return a ? a->text() : "?";
}

std::string read_token(const std::string& path) {
  auto bad = [&](const std::string& why) {
    throw Error(Stage::kConfig, path, "", "remote.token_file: " + why);
  };
  if (path.empty()) {
    bad("not set: a seed and its targets share a secret (a file of 16 to 4096 bytes, mode 0600)");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    bad("cannot open: " + errno_text(errno));
  }
  cache::UniqueFd owned(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    bad("not a regular file");
  }
  if ((st.st_mode & 077) != 0) {
    bad("readable or writable by others (mode " + std::to_string((st.st_mode >> 6) & 7) +
        std::to_string((st.st_mode >> 3) & 7) + std::to_string(st.st_mode & 7) + "): chmod 600 it");
  }
  if (st.st_uid != ::geteuid()) {
    bad("owned by uid " + std::to_string(st.st_uid) + ", not by this uid " +
        std::to_string(::geteuid()));
  }
  if (st.st_size > 8192) {
    bad("larger than 8192 bytes");
  }
  std::string token(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < token.size()) {
    const ssize_t n = ::read(fd, token.data() + got, token.size() - got);
    if (n <= 0) {
      bad("cannot read");
    }
    got += static_cast<std::size_t>(n);
  }
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) {
    token.pop_back();
  }
  if (token.size() < 16 || token.size() > 4096) {
    bad("the token must be 16 to 4096 bytes (it is " + std::to_string(token.size()) + ")");
  }
  return token;
}

bool same_token(std::string_view a, std::string_view b) {
  // Every byte of the longer one is looked at, whatever the contents.
  const std::size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  return diff == 0;
}

std::string random_nonce() {
  std::array<unsigned char, 32> bytes{};
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::getrandom(bytes.data() + got, bytes.size() - got, 0);
    if (n < 0 && errno != EINTR) {
      throw Error(Stage::kResources, "", "", "getrandom: " + errno_text(errno));
    }
    got += n > 0 ? static_cast<std::size_t>(n) : 0;
  }
  return hex(bytes.data(), bytes.size());
}

std::string proof(std::string_view token, std::string_view label, std::string_view first,
                  std::string_view second) {
  std::string message(label);
  message += '|';
  message += first;
  message += '|';
  message += second;
  const Sha256Digest d = hmac_sha256(token, message);
  return hex(d.data(), d.size());
}

namespace {

bool is_nonce(const nlohmann::json& v) {
  if (!v.is_string()) {
    return false;
  }
  const std::string& s = v.get_ref<const std::string&>();
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

std::string type_of(const nlohmann::json& frame) {
  if (!frame.is_object()) {
    return {};
  }
  const auto t = frame.find("type");
  return t != frame.end() && t->is_string() ? t->get<std::string>() : std::string();
}

}  // namespace

std::string check_hello(const nlohmann::json& frame, int protocol, std::string& nonce) {
  if (!frame.is_object()) {
    return "the first frame is not an object";
  }
  if (type_of(frame) != "hello") {
    return "the first frame is not a hello";
  }
  const auto p = frame.find("protocol");
  if (p == frame.end() || !p->is_number_integer() ||
      p->get_ref<const nlohmann::json::number_integer_t&>() != protocol) {
    return "protocol version mismatch (this seed speaks " + std::to_string(protocol) + ")";
  }
  const auto n = frame.find("nonce");
  if (n == frame.end() || !is_nonce(*n)) {
    return "no nonce (64 lowercase hex digits)";
  }
  nonce = n->get<std::string>();
  return {};
}

std::string check_auth(const nlohmann::json& frame, std::string_view token,
                       std::string_view seed_nonce, std::string_view target_nonce) {
  if (type_of(frame) != "auth") {
    return "the second frame is not an auth";
  }
  const auto p = frame.find("proof");
  if (p == frame.end() || !p->is_string()) {
    return "no proof";
  }
  if (!same_token(p->get_ref<const std::string&>(),
                  proof(token, kTargetLabel, seed_nonce, target_nonce))) {
    return "wrong token (the target's proof does not match)";
  }
  return {};
}

std::string check_challenge(const nlohmann::json& frame, std::string_view token,
                            std::string_view target_nonce, std::string& seed_nonce) {
  if (type_of(frame) != "challenge") {
    return "expected a challenge, got '" + type_of(frame) + "'";
  }
  const auto n = frame.find("nonce");
  const auto p = frame.find("proof");
  if (n == frame.end() || !is_nonce(*n) || p == frame.end() || !p->is_string()) {
    return "the challenge lacks a nonce or a proof";
  }
  if (n->get_ref<const std::string&>() == target_nonce) {
    return "the challenge repeats this target's nonce (a reflection)";
  }
  if (!same_token(p->get_ref<const std::string&>(),
                  proof(token, kSeedLabel, target_nonce, n->get_ref<const std::string&>()))) {
    return "the seed's proof does not match: it does not hold remote.token_file's secret";
  }
  seed_nonce = n->get<std::string>();
  return {};
}

}  // namespace ferry::remote
