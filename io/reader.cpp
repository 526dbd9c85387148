// The reader factory, read_all, and the sub-read bookkeeping every engine shares
// (declared in io/reader_internal.hpp).
#include "io/reader.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>

#include "common/error.hpp"
#include "common/log.hpp"
#include "io/reader_internal.hpp"

namespace ferry::io {

namespace detail {

namespace {

// io_uring's largest submission queue; a larger depth is a configuration mistake.
constexpr unsigned kMaxQueueDepth = 32768;

}  // namespace

void check_options(const ReaderOptions& options) {
  if (options.chunk_bytes == 0) {
    throw Error(Stage::kConfig, "", "", "reader chunk_bytes must be at least 1");
  }
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth) {
    throw Error(Stage::kConfig, "", "",
                "reader queue_depth must be between 1 and " + std::to_string(kMaxQueueDepth) +
                    " (got " + std::to_string(options.queue_depth) + ")");
  }
}

std::exception_ptr check_op(const ReadOp& op) {
  if (op.file == nullptr) {
    return std::make_exception_ptr(Error(Stage::kRead, "", "", "read op has no file"));
  }
  const std::string& name = op.file->display();
  if (op.file->fd() < 0) {
    return std::make_exception_ptr(Error(Stage::kRead, name, "", "file is not open"));
  }
  if (op.nbytes > 0 && op.dst == nullptr) {
    return std::make_exception_ptr(Error(Stage::kRead, name, "", "read op has no destination"));
  }
  // Leave room for widening the end to the O_DIRECT alignment.
  constexpr std::uint64_t kLimit = std::numeric_limits<std::uint64_t>::max() - (1u << 16);
  if (op.offset > kLimit || op.nbytes > kLimit - op.offset) {
    return std::make_exception_ptr(Error(Stage::kRead, name, "",
                                         "read range overflows: " + std::to_string(op.nbytes) +
                                             " bytes at offset " + std::to_string(op.offset)));
  }
  return nullptr;
}

std::size_t OpPlan::max_length(std::size_t chunk_bytes, std::uint32_t alignment) {
  std::size_t length = std::min(chunk_bytes, kMaxSyscallBytes);
  length = static_cast<std::size_t>(align_down(length, alignment));
  return length == 0 ? alignment : length;
}

OpPlan::OpPlan(const ReadOp& op, std::size_t chunk_bytes)
    : op_(op),
      alignment_(op.file->alignment()),
      chunk_(max_length(chunk_bytes, op.file->alignment())) {
  if (op.nbytes == 0) {
    return;
  }
  cursor_ = align_down(op.offset, alignment_);
  end_ = align_up(op.offset + op.nbytes, alignment_);
}

SubRange OpPlan::next() {
  SubRange r;
  r.file_offset = cursor_;
  r.length = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_, end_ - cursor_));
  const std::uint64_t range_end = cursor_ + r.length;
  const std::uint64_t op_end = op_.offset + op_.nbytes;
  const std::uint64_t want_begin = std::max(cursor_, op_.offset);
  const std::uint64_t want_end = std::min(range_end, op_end);
  r.needed = static_cast<std::size_t>(want_end - cursor_);
  std::byte* dst = op_.dst + (want_begin - op_.offset);
  // Without O_DIRECT every range is read in place. With it, only a range that lies
  // inside the request (so it writes no byte the caller did not ask for) and whose
  // destination is aligned; the rest goes through bounce memory.
  if (alignment_ == 1 ||
      (cursor_ >= op_.offset && range_end <= op_end && is_aligned(dst, alignment_))) {
    r.in_place = dst;
  } else {
    r.copy_from = static_cast<std::size_t>(want_begin - cursor_);
    r.copy_length = static_cast<std::size_t>(want_end - want_begin);
    r.copy_to = dst;
  }
  cursor_ = range_end;
  return r;
}

std::uint64_t current_size(const File& file, std::uint64_t fallback) {
  struct stat st {};
  if (::fstat(file.fd(), &st) != 0) {
    return fallback;
  }
  return static_cast<std::uint64_t>(st.st_size);
}

Step advance(SubRead& sub, long long got, std::size_t asked, const File& file, ReaderStats& stats,
             std::uint64_t* eof_at) {
  if (got == 0) {
    if (sub.done >= sub.range.needed) {
      return Step::kDone;
    }
    *eof_at = current_size(file, sub.next_offset());
    return Step::kEof;
  }
  std::size_t n = static_cast<std::size_t>(got);
  if (n < asked) {
    ++stats.short_reads;
  } else {
    n = asked;  // never trust more than was asked for
  }
  const std::size_t before = sub.done;
  sub.done += n;
  if (sub.done >= sub.range.needed) {
    return Step::kDone;
  }
  const std::uint64_t alignment = file.alignment();
  if (alignment > 1 && sub.next_offset() % alignment != 0) {
    // O_DIRECT cannot resume mid-block. A short read ending mid-block is EOF when
    // the file really ends there; otherwise redo the partial block.
    const std::uint64_t size = current_size(file, std::numeric_limits<std::uint64_t>::max());
    if (size <= sub.next_offset()) {
      *eof_at = size;
      return Step::kEof;
    }
    sub.done = static_cast<std::size_t>(align_down(sub.done, alignment));
  }
  if (sub.done > before) {
    sub.stalls = 0;
  } else if (++sub.stalls > kMaxRetries) {
    return Step::kStuck;
  }
  return Step::kAgain;
}

std::exception_ptr truncated_error(const ReadOp& op, std::uint64_t file_ends_at) {
  return std::make_exception_ptr(Error(Stage::kRead, op.file->display(), "",
                                       "file truncated: wanted " + std::to_string(op.nbytes) +
                                           " bytes at offset " + std::to_string(op.offset) +
                                           ", file ends at " + std::to_string(file_ends_at)));
}

std::exception_ptr errno_error(const File& file, const std::string& what, int err) {
  try {
    throw_errno(Stage::kRead, file.display(), what, err);
  } catch (...) {
    return std::current_exception();
  }
}

std::exception_ptr retries_error(const File& file, std::uint64_t offset, int last_err) {
  std::string what = "read at offset " + std::to_string(offset) + ": gave up after " +
                     std::to_string(kMaxRetries) + " retries without progress";
  if (last_err == 0) {
    return std::make_exception_ptr(Error(Stage::kRead, file.display(), "", what));
  }
  return errno_error(file, what + ", last error", last_err);
}

AlignedBuffer make_aligned_buffer(std::size_t bytes, std::size_t alignment) {
  const std::size_t rounded =
      static_cast<std::size_t>(align_up(std::max<std::size_t>(bytes, 1), alignment));
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) {
    throw std::bad_alloc();
  }
  return AlignedBuffer(static_cast<std::byte*>(p));
}

}  // namespace detail

bool Reader::cancel(std::chrono::milliseconds bound) noexcept {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  try {
    std::vector<Completion> discarded;
    while (outstanding() > 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        return false;
      }
      discarded.clear();
      poll(discarded, std::min(left, std::chrono::milliseconds(50)));
    }
    return true;
  } catch (...) {
    return false;  // a reader that cannot poll cannot prove its reads are over
  }
}

std::unique_ptr<Reader> make_reader(const ReaderOptions& options) {
  detail::check_options(options);
  switch (options.engine) {
    case Engine::kPread:
      return make_pread_reader(options);
    case Engine::kUring:
      break;
  }
  std::string why;
  if (auto reader = make_uring_reader(options, &why)) {
    return reader;
  }
  log::warn("io_uring unavailable (" + why + "); reading with pread");
  return make_pread_reader(options);
}

void read_all(Reader& reader, std::span<const ReadOp> ops) {
  if (reader.outstanding() != 0) {
    // Completions of someone else's ops would be indistinguishable from ours.
    throw std::logic_error("read_all needs a reader with no outstanding ops");
  }
  // Tags become op indices, so "first error" means the first op that failed.
  std::exception_ptr first_error;
  std::size_t first_index = ops.size();
  std::vector<Completion> done;
  auto drain = [&] {
    while (reader.outstanding() > 0) {
      done.clear();
      reader.poll(done, std::chrono::milliseconds(1000));
      for (const Completion& c : done) {
        if (c.error && c.tag < first_index) {
          first_index = static_cast<std::size_t>(c.tag);
          first_error = c.error;
        }
      }
    }
  };
  try {
    for (std::size_t i = 0; i < ops.size(); ++i) {
      ReadOp op = ops[i];
      op.tag = i;
      reader.submit(op);
    }
  } catch (...) {
    drain();  // never return while the kernel may still write into the callers' memory
    throw;
  }
  drain();
  if (first_error) {
    std::rethrow_exception(first_error);
  }
}

}  // namespace ferry::io
