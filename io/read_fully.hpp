// One loop for reading a range of an open file (O_DIRECT's alignment has its one
// spelling next to File: io/file.hpp's kDirectAlignment). Every place outside the
// reader engines that reads a byte range of a file (a header, a prefetch block, a
// benchmark peer's tensor) calls read_fully, so a short read, an interrupted read
// and a file that ends early mean the same thing everywhere. The engines
// (reader_pread.cpp, reader_uring.cpp) keep their own loops: they count every system
// call, inject faults per call and share one short-read rule between pread and
// io_uring (reader_internal.hpp's advance()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/error.hpp"

namespace ferry::io {

struct ReadFullyResult {
  std::size_t bytes = 0;  // read into the front of the range
  int error = 0;          // errno of the pread that failed; 0 when none did
  // The whole range arrived.
  bool complete(std::size_t asked) const { return error == 0 && bytes == asked; }
};

// preads `into.size()` bytes at `offset` of `fd` until the range is full, the file
// ends (bytes < size, error 0), or a pread fails with an error that retrying does
// not clear (EINTR and EAGAIN are retried, at most kMaxRetriesInARow times in a row).
ReadFullyResult read_fully(int fd, std::span<std::byte> into, std::uint64_t offset) noexcept;

inline constexpr unsigned kMaxRetriesInARow = 1000;

// The range in full, or Error(stage, file, tensor, ...) saying `what` was read and
// where it stopped: a failed pread ("WHAT: pread at offset N: <errno text>"), or a
// file that ends inside the range ("WHAT: the file ends at offset N, inside bytes
// [A, B)"). A range the file cannot hold any byte of is the second case, never a
// silent 0-byte read.
void read_exactly(int fd, std::span<std::byte> into, std::uint64_t offset, Stage stage,
                  const std::string& file, const std::string& tensor, std::string_view what);

// The rule read_exactly reports for `result` (empty when the range is complete).
std::string read_failure(const ReadFullyResult& result, std::size_t asked, std::uint64_t offset,
                         std::string_view what);

}  // namespace ferry::io
