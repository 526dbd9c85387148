// What a process holds that a load must give back: open file descriptors
// (/proc/self/fd) and threads (/proc/self/task). Linux only, like ferry.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace ferry::testing {

inline std::size_t count_entries(const char* dir) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) {
    ++n;
  }
  return n;
}

// Open descriptors, less the one the directory listing itself holds while it counts.
inline std::size_t open_fds() {
  return count_entries("/proc/self/fd") - 1;
}
// The process's own threads. io_uring's kernel workers (iou-wrk-*, iou-sqp-*)
// are tasks of the process too, but the kernel owns them: an idle one exits on
// its own timeout (seconds), so it can be counted before a load and be gone
// after it. They are left out; a ring that was not closed shows as a descriptor.
inline std::size_t live_threads() {
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(e.path() / "comm");
    std::string name;
    if (!comm || !std::getline(comm, name)) {
      continue;  // it left while being counted
    }
    if (name.rfind("iou-", 0) != 0) {
      ++n;
    }
  }
  return n;
}

// The thread count once it has stopped falling: a thread that was just joined
// can stay in /proc/self/task for a moment after pthread_join returned (the
// kernel clears the joiner's futex before the task is reaped), so a count taken
// right after a join may include a thread that is already gone. Waits (bounded)
// until two readings `gap` apart agree.
inline std::size_t settled_threads(std::chrono::milliseconds bound = std::chrono::milliseconds(1000),
                                   std::chrono::milliseconds gap = std::chrono::milliseconds(20)) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  std::size_t n = live_threads();
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(gap);
    const std::size_t next = live_threads();
    if (next == n) {
      break;
    }
    n = next;
  }
  return n;
}

// Waits (bounded) until at most `expected` threads are left: a thread that was
// asked to stop (an io_uring worker, a scheduler thread being joined) may take a
// moment to leave /proc/self/task. Returns the count at the end, which a test
// compares with `expected` as "no more than": a thread of the test's own (one
// counted in a baseline while it was leaving) may be gone by then.
inline std::size_t threads_settle_to(std::size_t expected, std::chrono::milliseconds bound) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  std::size_t n = live_threads();
  while (n > expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    n = live_threads();
  }
  return n;
}

}  // namespace ferry::testing
