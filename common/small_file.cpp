// read_small_file: a metadata file read whole, regular and capped (see the header).
#include "common/small_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <string>

namespace ferry {
namespace {

// "a FIFO", "a character device": what stands at the path instead of a file.
std::string describe_kind(mode_t mode) {
  if (S_ISDIR(mode)) {
    return "a directory";
  }
  if (S_ISFIFO(mode)) {
    return "a FIFO";
  }
  if (S_ISCHR(mode)) {
    return "a character device";
  }
  if (S_ISBLK(mode)) {
    return "a block device";
  }
  if (S_ISSOCK(mode)) {
    return "a socket";
  }
  return "not a regular file";
}

[[noreturn]] void refuse_kind(Stage stage, const std::string& display, const std::string& what,
                              mode_t mode) {
  throw Error(stage, display, "",
              what + " is " + describe_kind(mode) +
                  ", not a regular file (symbolic links are followed); refused, since reading "
                  "it could block or never end");
}

[[noreturn]] void refuse_size(Stage stage, const std::string& display, const std::string& what,
                              const std::string& size, std::uint64_t max_bytes) {
  throw Error(stage, display, "",
              what + " is " + size + ", over the cap of " + std::to_string(max_bytes) +
                  " bytes for metadata files (io.max_metadata_bytes); refused");
}

struct Closer {
  int fd;
  ~Closer() { ::close(fd); }
};

}  // namespace

std::string read_small_file(const std::string& path, Stage stage, std::uint64_t max_bytes,
                            const std::string& what, const std::string& display_in) {
  const std::string& display = display_in.empty() ? path : display_in;
  struct stat st {};
  // Before the open: a device node is not opened at all (opening some has effects).
  if (::stat(path.c_str(), &st) != 0) {
    throw_errno(stage, display, "cannot open " + what, errno);
  }
  if (!S_ISREG(st.st_mode)) {
    refuse_kind(stage, display, what, st.st_mode);
  }
  // O_NONBLOCK: should a FIFO take the file's place since the stat, the open still
  // returns at once, and fstat below refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    throw_errno(stage, display, "cannot open " + what, errno);
  }
  const Closer closer{fd};
  if (::fstat(fd, &st) != 0) {
    throw_errno(stage, display, "cannot stat " + what, errno);
  }
  if (!S_ISREG(st.st_mode)) {
    refuse_kind(stage, display, what, st.st_mode);
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) {
    refuse_size(stage, display, what, std::to_string(size) + " bytes", max_bytes);
  }
  // Up to max_bytes + 1: one byte past the cap tells a file that grew since fstat.
  const std::uint64_t limit = max_bytes == UINT64_MAX ? max_bytes : max_bytes + 1;
  std::string text;
  text.resize(static_cast<std::size_t>(std::min<std::uint64_t>(size, max_bytes) + 1));
  std::uint64_t done = 0;
  while (done < limit) {
    if (done == text.size()) {
      text.resize(static_cast<std::size_t>(std::min<std::uint64_t>(limit, done * 2 + 4096)));
    }
    const std::size_t want = text.size() - static_cast<std::size_t>(done);
    const ssize_t n = ::read(fd, text.data() + done, want);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw_errno(stage, display, "cannot read " + what, errno);
    }
    if (n == 0) {
      break;
    }
    done += static_cast<std::uint64_t>(n);
  }
  if (done > max_bytes) {
    refuse_size(stage, display, what,
                "more than " + std::to_string(max_bytes) + " bytes (it grew while being read)",
                max_bytes);
  }
  text.resize(static_cast<std::size_t>(done));
  return text;
}

}  // namespace ferry
