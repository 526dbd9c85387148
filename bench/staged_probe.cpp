// ferry_staged_probe: the smallest staged read-and-copy pipeline there is, as a
// ceiling for `ferry load` on host devices. One thread preads each file into a ring
// of `buffers` staging buffers of `chunk` bytes; a second thread copies each
// filled buffer into a pre-touched destination arena as large as the files (what a
// host device holds) with the host device's own copy routine (non-temporal stores)
// and hands the buffer back. No actors, no plan, no checks:
// whatever `ferry load` loses against this is the runtime's own overhead; whatever
// this loses against `cat` is the price of staging (every byte is copied twice) on
// this machine.
//
//   ferry_staged_probe [--chunk BYTES] [--buffers N] FILE...
//
// Prints `seconds=S gbps=G` for the streaming part (the arena is allocated and
// touched before the clock starts).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpu/kernels_host.hpp"

namespace {

struct Filled {
  std::size_t buffer;
  std::size_t bytes;
  std::size_t dst_offset;
};

// A bounded handoff between the two threads.
template <typename T>
class Channel {
 public:
  void push(T v) {
    {
      std::lock_guard lock(mu_);
      items_.push_back(v);
    }
    cv_.notify_one();
  }
  T pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !items_.empty(); });
    T v = items_.front();
    items_.pop_front();
    return v;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> items_;
};

int usage() {
  std::fputs("usage: ferry_staged_probe [--chunk BYTES] [--buffers N] FILE...\n", stderr);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t chunk = std::size_t{1} << 20;
  std::size_t count = 8;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--chunk" && i + 1 < argc) {
      chunk = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--buffers" && i + 1 < argc) {
      count = std::strtoull(argv[++i], nullptr, 10);
    } else if (!a.empty() && a[0] == '-') {
      return usage();
    } else {
      files.push_back(a);
    }
  }
  if (files.empty() || chunk == 0 || count == 0) {
    return usage();
  }
  std::size_t total = 0;
  for (const std::string& f : files) {
    struct stat st {};
    if (::stat(f.c_str(), &st) != 0) {
      std::perror(f.c_str());
      return 1;
    }
    total += static_cast<std::size_t>(st.st_size);
  }
  auto* arena = static_cast<std::byte*>(std::malloc(total));
  auto* staging = static_cast<std::byte*>(std::aligned_alloc(4096, chunk * count));
  if (arena == nullptr || staging == nullptr) {
    std::fputs("out of memory\n", stderr);
    return 1;
  }
  std::memset(arena, 1, total);  // not 0: malloc+memset(0) may become calloc, leaving pages untouched
  std::memset(staging, 0, chunk * count);

  Channel<Filled> filled;
  Channel<std::size_t> free_buffers;
  for (std::size_t b = 0; b < count; ++b) {
    free_buffers.push(b);
  }
  auto t0 = std::chrono::steady_clock::now();
  std::thread copier([&] {
    while (true) {
      Filled f = filled.pop();
      if (f.bytes == 0) {
        return;
      }
      ferry::gpu::host::copy_around_caches(arena + f.dst_offset, staging + f.buffer * chunk,
                                           f.bytes);
      free_buffers.push(f.buffer);
    }
  });
  std::size_t dst = 0;
  bool ok = true;
  for (const std::string& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      std::perror(f.c_str());
      ok = false;
      break;
    }
    while (true) {
      std::size_t b = free_buffers.pop();
      ssize_t n = ::read(fd, staging + b * chunk, chunk);
      if (n <= 0) {
        free_buffers.push(b);
        ok = n == 0;
        break;
      }
      filled.push({b, static_cast<std::size_t>(n), dst});
      dst += static_cast<std::size_t>(n);
    }
    ::close(fd);
    if (!ok) {
      break;
    }
  }
  filled.push({0, 0, 0});
  copier.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::free(arena);
  std::free(staging);
  if (!ok || dst != total) {
    std::fputs("read failed\n", stderr);
    return 1;
  }
  std::printf("seconds=%.6f gbps=%.4f\n", s, static_cast<double>(total) / s / 1e9);
  return 0;
}
