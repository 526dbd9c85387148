// What a process holds that a load must give back: open file descriptors
// (/proc/self/fd) and threads (/proc/self/task). Linux only, like ferry.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
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
inline std::size_t live_threads() {
  return count_entries("/proc/self/task");
}

// Waits (bounded) until at most `expected` threads are left: a thread that was
// asked to stop (an io_uring worker, a scheduler thread being joined) may take a
// moment to leave /proc/self/task. Returns the count at the end.
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
