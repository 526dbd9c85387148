// The mmap reader: maps each file once (lazily, whole file, read-only) and copies
// requested ranges out with memcpy, synchronously inside submit().
//
// Touching a mapped page past the end of a file raises SIGBUS, so every op checks
// its range against the file's current size (fstat) before copying and fails with
// "file truncated" instead. A file truncated by another process between that check
// and the copy can still fault: the window is one memcpy, and weight files are not
// expected to shrink while loading (pread and io_uring have no such window).
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <string>
#include <unordered_map>

#include "io/reader.hpp"
#include "io/reader_internal.hpp"

namespace ferry::io {

namespace {

class MmapReader final : public detail::InlineReader {
 public:
  explicit MmapReader(const ReaderOptions& options)
      : chunk_bytes_(options.chunk_bytes), faults_(options.faults) {}

  ~MmapReader() override {
    for (auto& [fd, map] : maps_) {
      ::munmap(map.addr, map.length);
    }
  }

  MmapReader(const MmapReader&) = delete;
  MmapReader& operator=(const MmapReader&) = delete;

  std::string name() const override { return "mmap"; }

 private:
  struct Mapping {
    dev_t dev = 0;
    ino_t ino = 0;
    std::byte* addr = nullptr;
    std::size_t length = 0;
  };

  std::exception_ptr read(const ReadOp& op) override {
    if (std::exception_ptr bad = detail::check_op(op)) {
      return bad;
    }
    if (op.nbytes == 0) {
      return nullptr;
    }
    const File& file = *op.file;
    struct stat st {};
    if (::fstat(file.fd(), &st) != 0) {
      return detail::errno_error(file, "fstat", errno);
    }
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (op.offset + op.nbytes > size) {
      return detail::truncated_error(op, size);
    }
    const Mapping* map = nullptr;
    if (std::exception_ptr error = mapping(file, st, &map)) {
      return error;
    }
    return copy(op, *map);
  }

  // The mapping of `file`, (re)made when the descriptor now names another file or
  // the file grew past what was mapped.
  std::exception_ptr mapping(const File& file, const struct stat& st, const Mapping** out) {
    const auto size = static_cast<std::size_t>(st.st_size);
    auto it = maps_.find(file.fd());
    if (it != maps_.end()) {
      const Mapping& m = it->second;
      if (m.dev == st.st_dev && m.ino == st.st_ino && m.length >= size) {
        *out = &m;
        return nullptr;
      }
      ::munmap(m.addr, m.length);
      maps_.erase(it);
    }
    void* addr = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, file.fd(), 0);
    if (addr == MAP_FAILED) {
      return detail::errno_error(file, "mmap", errno);
    }
    Mapping m;
    m.dev = st.st_dev;
    m.ino = st.st_ino;
    m.addr = static_cast<std::byte*>(addr);
    m.length = size;
    *out = &maps_.emplace(file.fd(), m).first->second;
    return nullptr;
  }

  // Copies in chunk-sized pieces; each piece counts as one "system read" so the
  // fault injector perturbs mmap the same way as the other engines.
  std::exception_ptr copy(const ReadOp& op, const Mapping& map) {
    std::size_t pos = 0;
    unsigned stalls = 0;
    while (pos < op.nbytes) {
      const std::size_t asked = std::min(chunk_bytes_, op.nbytes - pos);
      const std::uint64_t at = op.offset + pos;
      ++stats_.reads_issued;
      stats_.bytes_requested += asked;
      long long got = static_cast<long long>(asked);
      if (faults_) {
        got = faults_->apply(got, asked);
      }
      if (got < 0) {
        const int err = static_cast<int>(-got);
        if (!detail::is_retryable(err)) {
          return detail::errno_error(*op.file, "mmap read at offset " + std::to_string(at), err);
        }
        if (++stalls > detail::kMaxRetries) {
          return detail::retries_error(*op.file, at, err);
        }
        ++stats_.retries;
        continue;
      }
      auto n = static_cast<std::size_t>(std::min<long long>(got, static_cast<long long>(asked)));
      if (n < asked) {
        ++stats_.short_reads;
      }
      if (n == 0) {
        if (++stalls > detail::kMaxRetries) {
          return detail::retries_error(*op.file, at, 0);
        }
        continue;
      }
      std::memcpy(op.dst + pos, map.addr + at, n);
      pos += n;
      stalls = 0;
    }
    return nullptr;
  }

  std::size_t chunk_bytes_;
  std::shared_ptr<FaultInjector> faults_;
  std::unordered_map<int, Mapping> maps_;  // by descriptor; checked against dev/inode
};

}  // namespace

std::unique_ptr<Reader> make_mmap_reader(const ReaderOptions& options) {
  detail::check_options(options);
  return std::make_unique<MmapReader>(options);
}

}  // namespace ferry::io
