#include "io/read_fully.hpp"

#include <unistd.h>

#include <cerrno>

namespace ferry::io {

ReadFullyResult read_fully(int fd, std::span<std::byte> into, std::uint64_t offset) noexcept {
  ReadFullyResult r;
  unsigned retries = 0;
  while (r.bytes < into.size()) {
    const ssize_t n = ::pread(fd, into.data() + r.bytes, into.size() - r.bytes,
                              static_cast<off_t>(offset + r.bytes));
    if (n < 0) {
      const int err = errno;
      if ((err == EINTR || err == EAGAIN) && ++retries <= kMaxRetriesInARow) {
        continue;
      }
      r.error = err;
      return r;
    }
    if (n == 0) {
      return r;  // end of file
    }
    retries = 0;
    r.bytes += static_cast<std::size_t>(n);
  }
  return r;
}

std::string read_failure(const ReadFullyResult& result, std::size_t asked, std::uint64_t offset,
                         std::string_view what) {
  if (result.complete(asked)) {
    return {};
  }
  const std::uint64_t stopped = offset + result.bytes;
  if (result.error != 0) {
    return std::string(what) + ": pread at offset " + std::to_string(stopped) + ": " +
           errno_text(result.error);
  }
  return std::string(what) + ": the file ends at offset " + std::to_string(stopped) +
         ", inside bytes [" + std::to_string(offset) + ", " + std::to_string(offset + asked) + ")";
}

void read_exactly(int fd, std::span<std::byte> into, std::uint64_t offset, Stage stage,
                  const std::string& file, const std::string& tensor, std::string_view what) {
  const ReadFullyResult r = read_fully(fd, into, offset);
  if (!r.complete(into.size())) {
    throw Error(stage, file, tensor, read_failure(r, into.size(), offset, what));
  }
}

}  // namespace ferry::io
