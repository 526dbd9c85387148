// ferry_read_bench: reads whole files through one of ferry's byte readers the way
// the load pipeline will (a ring of `queue_depth` staging buffers of `chunk` bytes,
// refilled as reads complete) and prints the throughput. bench/read_bench.sh drives
// it over a checkpoint and compares with `cat` and `dd`.
//
//   ferry_read_bench --engine uring|pread [--qd N] [--chunk BYTES] [--direct] FILE...
//   ferry_read_bench --evict FILE...     drop the files' pages from the page cache
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "io/file.hpp"
#include "io/reader.hpp"

namespace {

using namespace ferry::io;

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};

int usage() {
  std::fputs(
      "usage: ferry_read_bench --engine uring|pread [--qd N] [--chunk BYTES] [--direct] "
      "FILE...\n       ferry_read_bench --evict FILE...\n",
      stderr);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  ReaderOptions options;
  bool direct = false;
  bool evict = false;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--engine") {
      std::string e = next();
      if (e == "uring") {
        options.engine = Engine::kUring;
      } else if (e == "pread") {
        options.engine = Engine::kPread;
      } else {
        return usage();
      }
    } else if (a == "--qd") {
      options.queue_depth = static_cast<unsigned>(std::stoul(next()));
    } else if (a == "--chunk") {
      options.chunk_bytes = std::stoull(next());
    } else if (a == "--direct") {
      direct = true;
    } else if (a == "--evict") {
      evict = true;
    } else if (!a.empty() && a[0] == '-') {
      return usage();
    } else {
      paths.push_back(a);
    }
  }
  if (paths.empty()) {
    return usage();
  }
  try {
    std::vector<File> files;
    for (const auto& p : paths) {
      files.push_back(File::open(p, direct && !evict));
    }
    if (evict) {
      for (const auto& f : files) {
        drop_page_cache(f);
      }
      return 0;
    }
    auto reader = make_reader(options);
    const std::size_t chunk = options.chunk_bytes;
    const unsigned slots = options.queue_depth;
    std::vector<std::unique_ptr<std::byte, FreeDeleter>> buffers;
    std::deque<unsigned> free_slots;
    for (unsigned s = 0; s < slots; ++s) {
      buffers.emplace_back(static_cast<std::byte*>(std::aligned_alloc(4096, chunk)));
      free_slots.push_back(s);
    }
    std::uint64_t total = 0;
    auto start = std::chrono::steady_clock::now();
    std::size_t file = 0;
    std::uint64_t offset = 0;
    std::vector<Completion> done;
    for (;;) {
      while (!free_slots.empty() && file < files.size()) {
        if (offset >= files[file].size()) {
          ++file;
          offset = 0;
          continue;
        }
        unsigned s = free_slots.front();
        free_slots.pop_front();
        std::size_t n = static_cast<std::size_t>(
            std::min<std::uint64_t>(chunk, files[file].size() - offset));
        reader->submit({&files[file], offset, n, buffers[s].get(), s});
        offset += n;
        total += n;
      }
      if (reader->outstanding() == 0) {
        break;
      }
      done.clear();
      reader->poll(done, std::chrono::milliseconds(1000));
      for (const auto& c : done) {
        if (c.error) {
          std::rethrow_exception(c.error);
        }
        free_slots.push_back(static_cast<unsigned>(c.tag));
      }
    }
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("engine=%s qd=%u chunk=%zu direct=%d bytes=%llu requested=%llu seconds=%.4f gbps=%.3f\n",
                reader->name().c_str(), slots, chunk, direct ? 1 : 0,
                static_cast<unsigned long long>(total),
                static_cast<unsigned long long>(reader->stats().bytes_requested), seconds,
                static_cast<double>(total) / seconds / 1e9);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry_read_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
