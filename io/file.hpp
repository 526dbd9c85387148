// An open, read-only weight file: RAII over the descriptor, its size, and the
// path as the user should see it in errors.
#pragma once

#include <cstdint>
#include <string>

namespace ferry::io {

class File {
 public:
  // Opens `path` read-only (following symbolic links). With `direct`, also opens
  // with O_DIRECT; `display` is the name used in error messages (defaults to path).
  // Throws ferry::Error(Stage::kRead) naming the file when it cannot be opened.
  static File open(const std::string& path, bool direct = false, std::string display = {});
  // Takes ownership of an open descriptor of any kind (a pipe, a socket: what the
  // reader tests need to make a read that never completes), said to hold `size`
  // bytes. Closes it when the File dies.
  static File adopt(int fd, std::uint64_t size, std::string display);

  File() = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  int fd() const { return fd_; }
  std::uint64_t size() const { return size_; }
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }
  const std::string& display() const { return display_; }
  // O_DIRECT alignment of offsets, lengths and buffers (4096 when direct, else 1).
  std::uint32_t alignment() const { return direct_ ? 4096 : 1; }

 private:
  int fd_ = -1;
  std::uint64_t size_ = 0;
  bool direct_ = false;
  std::string path_;
  std::string display_;
};

// posix_fadvise(DONTNEED) over the whole file: drops its clean pages from the page
// cache. Best effort: returns false (and logs at debug) when the kernel refuses.
bool drop_page_cache(const File& file);

}  // namespace ferry::io
