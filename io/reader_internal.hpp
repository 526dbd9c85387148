// Pieces shared by the reader implementations (not part of ferry_io's interface):
// how an op is split into sub-reads (chunking and O_DIRECT widening), how one
// sub-read advances on a read result, aligned bounce memory, and error builders.
// Keeping this in one place means pread, io_uring and mmap agree on what a short
// read, end-of-file and a truncated file mean.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "io/file.hpp"
#include "io/reader.hpp"

namespace ferry::io::detail {

// Consecutive EAGAIN/EINTR results (or reads that made no progress) one sub-read
// tolerates before its op fails: a device that keeps saying EAGAIN must not spin
// the reader forever.
inline constexpr unsigned kMaxRetries = 1000;

// The most one system read asks for. read(2) transfers at most 0x7ffff000 bytes and
// io_uring's length field is 32 bits; 1 GiB keeps O_DIRECT alignment.
inline constexpr std::size_t kMaxSyscallBytes = std::size_t{1} << 30;

inline std::uint64_t align_down(std::uint64_t v, std::uint64_t a) {
  return v - v % a;
}
inline std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  return align_down(v + a - 1, a);
}
inline bool is_aligned(const void* p, std::uint64_t a) {
  return reinterpret_cast<std::uintptr_t>(p) % a == 0;
}

// Rejects options no reader can work with. Throws ferry::Error(Stage::kConfig).
void check_options(const ReaderOptions& options);

// Rejects ops that cannot be read at all (no file, no destination, range that
// overflows). Returns null when the op is acceptable, else the error to report.
std::exception_ptr check_op(const ReadOp& op);

// One system-sized read of an op: [file_offset, file_offset + length) of the file.
struct SubRange {
  std::uint64_t file_offset = 0;  // aligned for O_DIRECT files
  std::size_t length = 0;         // bytes asked of the kernel (aligned for O_DIRECT)
  // Bytes at the start of the range the op needs. Less than `length` only when an
  // O_DIRECT range was widened past the op's end: a read may then stop at EOF early.
  std::size_t needed = 0;
  std::byte* in_place = nullptr;  // read straight here; null: read into bounce memory
  // For bounce reads: bounce[copy_from, copy_from + copy_length) goes to copy_to.
  std::size_t copy_from = 0;
  std::size_t copy_length = 0;
  std::byte* copy_to = nullptr;
};

// Walks an op as a sequence of SubRanges. Without O_DIRECT, each chunk is read in
// place. With O_DIRECT, the op's range is widened to the file's alignment and cut
// into aligned chunks; a chunk is read in place when it lies inside the requested
// range and its destination is aligned, otherwise through bounce memory.
class OpPlan {
 public:
  OpPlan() = default;
  OpPlan(const ReadOp& op, std::size_t chunk_bytes);

  bool done() const { return cursor_ >= end_; }
  SubRange next();
  // Largest SubRange::length this plan produces (bounce buffers must hold it).
  static std::size_t max_length(std::size_t chunk_bytes, std::uint32_t alignment);

 private:
  ReadOp op_;
  std::uint64_t alignment_ = 1;
  std::size_t chunk_ = 0;
  std::uint64_t cursor_ = 0;  // next file offset to plan
  std::uint64_t end_ = 0;     // widened end
};

// Progress of one SubRange across system reads.
struct SubRead {
  SubRange range;
  std::size_t done = 0;  // bytes of range landed
  unsigned stalls = 0;   // consecutive retries / reads without progress

  std::uint64_t next_offset() const { return range.file_offset + done; }
  // Bytes the next system read asks for.
  std::size_t next_length() const {
    std::size_t left = range.length - done;
    return left < kMaxSyscallBytes ? left : kMaxSyscallBytes;
  }
};

enum class Step {
  kDone,   // the sub-read has every byte the op needs
  kAgain,  // ask again from next_offset()
  kEof,    // end of file before the op's bytes: the file is truncated
  kStuck,  // kMaxRetries reads in a row made no progress
};

// Applies a non-negative read result `got` (of a read that asked `asked` bytes) to
// `sub` and says what to do next. Counts short reads; a read that moves nothing
// forward counts as a stall. On kEof, `*eof_at` is where the file ends. O_DIRECT
// reads can only restart at an aligned offset, so a short read that ends mid-block
// is either end-of-file (checked with fstat) or redone from the block's start.
Step advance(SubRead& sub, long long got, std::size_t asked, const File& file, ReaderStats& stats,
             std::uint64_t* eof_at);

// Errors, as exception_ptrs (completions carry them; nothing is thrown).
std::exception_ptr truncated_error(const ReadOp& op, std::uint64_t file_ends_at);
std::exception_ptr errno_error(const File& file, const std::string& what, int err);
std::exception_ptr retries_error(const File& file, std::uint64_t offset, int last_err);

// Whether `err` (positive errno) means "try the same read again".
inline bool is_retryable(int err) {
  return err == EAGAIN || err == EINTR;
}

// fstat size of `file`, or `fallback` when fstat fails.
std::uint64_t current_size(const File& file, std::uint64_t fallback);

// Page-aligned heap memory for O_DIRECT bounce reads.
struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte[], FreeDeleter>;
AlignedBuffer make_aligned_buffer(std::size_t bytes, std::size_t alignment = kDirectAlignment);

// Moves every finished completion to `out` and lowers `outstanding` by as many;
// the common tail of every engine's poll().
inline std::size_t hand_over(std::deque<Completion>& ready, std::vector<Completion>& out,
                             std::size_t& outstanding) {
  const std::size_t n = ready.size();
  for (Completion& c : ready) {
    out.push_back(std::move(c));
  }
  ready.clear();
  outstanding -= n;
  return n;
}

// Base of the readers that finish every op inside submit() (pread, mmap): they
// only implement read(); queuing completions for poll() is shared here.
class InlineReader : public Reader {
 public:
  void submit(const ReadOp& op) override {
    ++outstanding_;
    ready_.push_back(Completion{op.tag, read(op)});
  }
  // Every op finished inside submit(): there is never anything to wait for.
  std::size_t poll(std::vector<Completion>& out, std::chrono::milliseconds /*wait*/) override {
    return hand_over(ready_, out, outstanding_);
  }
  std::size_t outstanding() const override { return outstanding_; }
  const ReaderStats& stats() const override { return stats_; }

 protected:
  // Reads the whole op; returns its error (null on success).
  virtual std::exception_ptr read(const ReadOp& op) = 0;
  ReaderStats stats_;

 private:
  std::deque<Completion> ready_;
  std::size_t outstanding_ = 0;
};

}  // namespace ferry::io::detail
