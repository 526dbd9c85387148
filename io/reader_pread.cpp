// The pread reader: each op is read synchronously inside submit(), one chunk-sized
// pread(2) at a time; poll() hands back what submit() finished. The fallback when
// io_uring is unavailable, and the reference the other engines are tested against.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <string>

#include "io/reader.hpp"
#include "io/reader_internal.hpp"

namespace ferry::io {

namespace {

using detail::SubRead;

class PreadReader final : public detail::InlineReader {
 public:
  explicit PreadReader(const ReaderOptions& options)
      : chunk_bytes_(options.chunk_bytes), faults_(options.faults) {}

  std::string name() const override { return "pread"; }

 private:
  std::exception_ptr read(const ReadOp& op) override {
    if (std::exception_ptr bad = detail::check_op(op)) {
      return bad;
    }
    if (op.nbytes == 0) {
      return nullptr;
    }
    detail::OpPlan plan(op, chunk_bytes_);
    while (!plan.done()) {
      SubRead sub;
      sub.range = plan.next();
      std::byte* target = sub.range.in_place;
      if (target == nullptr) {
        target = bounce(op.file->alignment());
      }
      if (std::exception_ptr error = read_range(op, sub, target)) {
        return error;
      }
      if (sub.range.in_place == nullptr) {
        std::memcpy(sub.range.copy_to, target + sub.range.copy_from, sub.range.copy_length);
      }
    }
    return nullptr;
  }

  // Fills sub.range into `target`, looping over short reads and retrying EINTR/EAGAIN.
  std::exception_ptr read_range(const ReadOp& op, SubRead& sub, std::byte* target) {
    const File& file = *op.file;
    for (;;) {
      const std::size_t asked = sub.next_length();
      const std::uint64_t at = sub.next_offset();
      ++stats_.reads_issued;
      stats_.bytes_requested += asked;
      long long got = ::pread(file.fd(), target + sub.done, asked, static_cast<off_t>(at));
      if (got < 0) {
        got = -errno;
      }
      if (faults_) {
        got = faults_->apply(got, asked);
      }
      if (got < 0) {
        const int err = static_cast<int>(-got);
        if (!detail::is_retryable(err)) {
          return detail::errno_error(file, "pread at offset " + std::to_string(at), err);
        }
        if (++sub.stalls > detail::kMaxRetries) {
          return detail::retries_error(file, at, err);
        }
        ++stats_.retries;
        continue;
      }
      std::uint64_t eof_at = 0;
      switch (detail::advance(sub, got, asked, file, stats_, &eof_at)) {
        case detail::Step::kDone:
          return nullptr;
        case detail::Step::kAgain:
          break;
        case detail::Step::kEof:
          return detail::truncated_error(op, eof_at);
        case detail::Step::kStuck:
          return detail::retries_error(file, sub.next_offset(), 0);
      }
    }
  }

  // One bounce buffer suffices: reads are synchronous.
  std::byte* bounce(std::uint32_t alignment) {
    const std::size_t need = detail::OpPlan::max_length(chunk_bytes_, alignment);
    if (bounce_bytes_ < need) {
      bounce_ = detail::make_aligned_buffer(need);
      bounce_bytes_ = need;
    }
    return bounce_.get();
  }

  std::size_t chunk_bytes_;
  std::shared_ptr<FaultInjector> faults_;
  detail::AlignedBuffer bounce_;
  std::size_t bounce_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Reader> make_pread_reader(const ReaderOptions& options) {
  detail::check_options(options);
  return std::make_unique<PreadReader>(options);
}

}  // namespace ferry::io
