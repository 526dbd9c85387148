// The weight cache's test fixtures: a real `ferry serve` daemon forked and exec'd
// (stopped with SIGTERM when the fixture dies), a registry directory of the test's
// own, client configs, and the byte-for-byte comparison of a client's params with
// a disk load's.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "runtime/runtime_test_util.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::testing {

// `ferry serve --model DIR` with `args`, registered in `registry`; waits for its
// --ready-file. ready() is false when it exited first (its log says why).
class Daemon {
 public:
  Daemon(const std::string& model, const std::string& registry,
         std::vector<std::string> args = {}) {
    ready_ = dir_.file("ready.json");
    log_ = dir_.file("log");
    std::vector<std::string> argv = {FERRY_BINARY,   "serve", "--model",
                                     model,          "--set", "cache.dir=" + registry,
                                     "--ready-file", ready_};
    argv.insert(argv.end(), args.begin(), args.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> cargv;
      for (std::string& a : argv) {
        cargv.push_back(a.data());
      }
      cargv.push_back(nullptr);
      ::execv(FERRY_BINARY, cargv.data());
      ::_exit(127);
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < until) {
      if (std::filesystem::exists(ready_)) {
        ready_seen_ = true;
        return;
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        status_ = status;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  ~Daemon() {
    if (pid_ > 0) {
      stop(SIGTERM);
    }
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  bool ready() const { return ready_seen_; }
  pid_t pid() const { return pid_; }
  std::string log() const { return read_file(log_); }
  nlohmann::json ready_json() const { return nlohmann::json::parse(read_file(ready_)); }
  // Sends `sig` and waits; the wait status.
  int stop(int sig) {
    if (pid_ <= 0) {
      return status_;
    }
    ::kill(pid_, sig);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    status_ = status;
    return status;
  }

 private:
  TempDir dir_;
  std::string ready_, log_;
  pid_t pid_ = -1;
  int status_ = 0;
  bool ready_seen_ = false;
};

// A registry directory (0700) inside `dir`.
inline std::string registry_dir(const TempDir& dir) {
  const std::string path = dir.file("registry");
  ::mkdir(path.c_str(), 0700);
  return path;
}

// Every param of every local rank of `got` equals the same param of `want` (same
// tp rank), byte for byte; `got` has exactly `want`'s params for those ranks.
inline void expect_same_params(const runtime::LoadedModel& got, const runtime::LoadedModel& want) {
  for (std::size_t r = 0; r < got.ranks().size(); ++r) {
    const runtime::LoadedRank& gr = got.ranks()[r];
    std::size_t w = 0;
    while (w < want.ranks().size() && want.ranks()[w].tp_rank != gr.tp_rank) {
      ++w;
    }
    ASSERT_LT(w, want.ranks().size()) << "tp rank " << gr.tp_rank;
    const runtime::LoadedRank& wr = want.ranks()[w];
    ASSERT_EQ(gr.params.size(), wr.params.size()) << "tp rank " << gr.tp_rank;
    for (std::size_t i = 0; i < gr.params.size(); ++i) {
      const runtime::LoadedParam& p = gr.params[i];
      ASSERT_EQ(p.name, wr.params[i].name);
      EXPECT_EQ(p.dtype, wr.params[i].dtype) << p.name;
      EXPECT_EQ(p.shape, wr.params[i].shape) << p.name;
      EXPECT_EQ(p.strides, wr.params[i].strides) << p.name;
      EXPECT_TRUE(got.read_param(r, p.name) == want.read_param(w, p.name))
          << "tp rank " << gr.tp_rank << " " << p.name;
    }
  }
}

}  // namespace ferry::testing
