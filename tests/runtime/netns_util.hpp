// Two hosts for remote_instance's tests: network namespaces joined by a veth pair,
// made by `ip` (iproute2) and removed when the fixture dies. The seed's namespace
// holds 10.231.7.1/30, the target's 10.231.7.2/30; each pair lives in namespaces
// of its own, so concurrent tests never share an address. Nothing else is
// contacted. Where namespaces cannot be made (not root, no `ip`), why() says so and
// the tests skip, unless FERRY_REQUIRE_NETNS=1 (CI) makes that a failure.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "testing/temp_dir.hpp"

namespace ferry::testing {

// Runs argv (argv[0] a path) with stdout and stderr to `log`; its pid.
inline pid_t spawn(std::vector<std::string> argv, const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> cargv;
    for (std::string& a : argv) {
      cargv.push_back(a.data());
    }
    cargv.push_back(nullptr);
    ::execv(cargv[0], cargv.data());
    ::_exit(127);
  }
  return pid;
}

// The exit status of `pid` (-1 when it did not end as asked: killed, or a signal).
inline int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// `ip ARGS...` quietly; true when it succeeded.
inline bool ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"/usr/sbin/ip"};
  argv.insert(argv.end(), args.begin(), args.end());
  if (!std::filesystem::exists(argv[0])) {
    argv[0] = "/sbin/ip";
  }
  return wait_exit(spawn(argv, "/dev/null")) == 0;
}

class NetnsPair {
 public:
  static constexpr const char* kSeedIp = "10.231.7.1";
  static constexpr const char* kTargetIp = "10.231.7.2";

  NetnsPair() {
    static std::atomic<int> counter{0};
    const std::string tag = std::to_string(::getpid()) + "x" + std::to_string(counter++);
    seed_ns_ = "ferry-" + tag + "-s";
    target_ns_ = "ferry-" + tag + "-t";
    seed_if_ = "fs" + tag;  // at most 15 characters: IFNAMSIZ
    target_if_ = "ft" + tag;
    if (::geteuid() != 0) {
      why_ = "not root: network namespaces need CAP_SYS_ADMIN";
      return;
    }
    if (!ip({"netns", "add", seed_ns_}) || !(made_ = 1, ip({"netns", "add", target_ns_}))) {
      why_ = "`ip netns add` failed (no iproute2, or namespaces are not allowed here)";
      return;
    }
    made_ = 2;
    const bool ok =
        ip({"link", "add", seed_if_, "type", "veth", "peer", "name", target_if_}) &&
        ip({"link", "set", seed_if_, "netns", seed_ns_}) &&
        ip({"link", "set", target_if_, "netns", target_ns_}) &&
        ip({"-n", seed_ns_, "addr", "add", std::string(kSeedIp) + "/30", "dev", seed_if_}) &&
        ip({"-n", target_ns_, "addr", "add", std::string(kTargetIp) + "/30", "dev", target_if_}) &&
        ip({"-n", seed_ns_, "link", "set", seed_if_, "up"}) &&
        ip({"-n", target_ns_, "link", "set", target_if_, "up"}) &&
        ip({"-n", seed_ns_, "link", "set", "lo", "up"}) &&
        ip({"-n", target_ns_, "link", "set", "lo", "up"});
    if (!ok) {
      why_ = "the veth pair could not be made";
    }
  }
  ~NetnsPair() {
    if (made_ >= 1) {
      ip({"netns", "del", seed_ns_});  // takes the veth pair with it
    }
    if (made_ >= 2) {
      ip({"netns", "del", target_ns_});
    }
  }
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  // Why the pair could not be made; "" when it was.
  const std::string& why() const { return why_; }
  const std::string& seed_ns() const { return seed_ns_; }
  const std::string& target_ns() const { return target_ns_; }
  const std::string& seed_if() const { return seed_if_; }
  // The seed's end of the link, down or up (a cable pulled).
  bool set_seed_link(bool up) {
    return ip({"-n", seed_ns_, "link", "set", seed_if_, up ? "up" : "down"});
  }
  // argv run in `ns`: `ip netns exec NS argv...` (ip execs it: the pid is argv's).
  static std::vector<std::string> in(const std::string& ns, std::vector<std::string> argv) {
    std::vector<std::string> out = {
        std::filesystem::exists("/usr/sbin/ip") ? "/usr/sbin/ip" : "/sbin/ip", "netns", "exec", ns};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

 private:
  std::string seed_ns_, target_ns_, seed_if_, target_if_;
  std::string why_;
  int made_ = 0;
};

// Skips the test (or fails it under FERRY_REQUIRE_NETNS=1) when `pair` was not made.
#define FERRY_REQUIRE_PAIR(pair)                                               \
  do {                                                                         \
    if (!(pair).why().empty()) {                                               \
      const char* req = std::getenv("FERRY_REQUIRE_NETNS");                    \
      if (req != nullptr && std::string(req) == "1") {                         \
        FAIL() << "FERRY_REQUIRE_NETNS=1 and no namespaces: " << (pair).why(); \
      }                                                                        \
      GTEST_SKIP() << "network namespaces unavailable: " << (pair).why();      \
    }                                                                          \
  } while (0)

}  // namespace ferry::testing
