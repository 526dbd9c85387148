#include "common/thread_start.hpp"

#include <atomic>
#include <cerrno>
#include <exception>
#include <mutex>
#include <optional>

#include "common/log.hpp"

namespace ferry {
namespace {

struct Seam {
  std::mutex mu;
  std::optional<std::string> prefix;  // set: a failure is injected
  std::size_t left = 0;               // matching starts until it (1: the next one)
  bool recording = false;
  std::vector<std::string> seen;
};

// The fast path (no test armed anything) takes no lock.
std::atomic<bool> g_armed{false};

Seam& seam() {
  // Never destroyed: a thread may start during static destruction.
  static Seam* s = new Seam;
  return *s;
}

void update_armed(const Seam& s) {
  g_armed.store(s.prefix.has_value() || s.recording);
}

}  // namespace

Error thread_start_failed(std::string_view name, const std::system_error& e) {
  return Error(Stage::kResources, "", "",
               "could not start thread " + std::string(name) + ": " + e.code().message() +
                   " (the process's thread, memory or process limits: ulimit -u, ulimit -v, "
                   "kernel.threads-max)");
}

void check_thread_start(std::string_view name) {
  if (!g_armed.load()) {
    return;
  }
  Seam& s = seam();
  std::lock_guard lock(s.mu);
  if (s.recording) {
    s.seen.emplace_back(name);
  }
  if (s.prefix && name.substr(0, s.prefix->size()) == *s.prefix && --s.left == 0) {
    s.prefix.reset();
    update_armed(s);
    throw std::system_error(EAGAIN, std::generic_category(), "injected thread start failure");
  }
}

void join_all(std::vector<std::thread>& threads) noexcept {
  for (std::thread& t : threads) {
    if (t.joinable()) {
      t.join();
    }
  }
}

void run_each(std::string_view name, std::size_t count,
              const std::function<void(std::size_t)>& fn) {
  std::vector<std::exception_ptr> errors(count);
  auto run = [&](std::size_t i) {
    try {
      fn(i);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  if (count == 1) {
    run(0);
  } else {
    std::vector<std::thread> threads;
    try {
      for (std::size_t i = 0; i < count; ++i) {
        threads.push_back(start_thread(std::string(name) + " " + std::to_string(i),
                                       [&run, i, sink = log::thread_sink()] {
                                         const log::ScopedSink scope(sink);
                                         run(i);
                                       }));
      }
    } catch (...) {
      join_all(threads);
      throw;
    }
    join_all(threads);
  }
  for (const std::exception_ptr& e : errors) {
    if (e) {
      std::rethrow_exception(e);
    }
  }
}

void inject_thread_start_failure(std::string name_prefix, std::size_t nth) {
  Seam& s = seam();
  std::lock_guard lock(s.mu);
  s.prefix = std::move(name_prefix);
  s.left = nth == 0 ? 1 : nth;
  update_armed(s);
}

bool thread_start_failure_pending() {
  Seam& s = seam();
  std::lock_guard lock(s.mu);
  return s.prefix.has_value();
}

void clear_thread_start_failure() {
  Seam& s = seam();
  std::lock_guard lock(s.mu);
  s.prefix.reset();
  update_armed(s);
}

void record_thread_starts() {
  Seam& s = seam();
  std::lock_guard lock(s.mu);
  s.recording = true;
  s.seen.clear();
  update_armed(s);
}

std::vector<std::string> stop_recording_thread_starts() {
  Seam& s = seam();
  std::lock_guard lock(s.mu);
  s.recording = false;
  update_armed(s);
  return std::exchange(s.seen, {});
}

}  // namespace ferry
