// Page-cache prefetch: block dispenser, worker threads, failure bookkeeping.
#include "io/prefetch.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <memory>
#include <system_error>
#include <utility>

#include "common/error.hpp"
#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "io/read_fully.hpp"

namespace ferry::io {

namespace {

const std::string& display_name(const PrefetchFile& file) {
  return file.name.empty() ? file.path : file.name;
}

// Owns one descriptor; a worker keeps the file of its last block open.
class Fd {
 public:
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) {
      ::close(fd_);
    }
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Opens `file` for sequential reading. Returns the failure rule, empty on success.
std::string open_file(const PrefetchFile& file, Fd& fd) {
  const std::string path =
      file.file ? "/proc/self/fd/" + std::to_string(file.file->fd()) : file.path;
  int raw = -1;
  do {
    raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (raw < 0 && errno == EINTR);
  if (raw < 0) {
    return "open: " + errno_text(errno);
  }
  fd.reset(raw);
  struct stat st {};
  if (::fstat(raw, &st) != 0) {
    return "fstat: " + errno_text(errno);
  }
  if (static_cast<std::uint64_t>(st.st_size) < file.size) {
    return "file is shorter than its planned size (" + std::to_string(st.st_size) +
           " bytes on disk, " + std::to_string(file.size) + " planned)";
  }
  // Best effort: a larger kernel readahead window for the sequential pass.
  (void)::posix_fadvise(raw, 0, 0, POSIX_FADV_SEQUENTIAL);
  return {};
}

// Reads [offset, offset + len) into `buf` (read_fully). Adds the bytes read to
// `got`. Returns the failure rule, empty on success.
std::string read_block(int fd, const PrefetchFile& file, std::uint64_t offset, std::size_t len,
                       std::byte* buf, std::uint64_t& got) {
  const ReadFullyResult r = read_fully(fd, {buf, len}, offset);
  got += r.bytes;
  if (r.error != 0) {
    return "read at offset " + std::to_string(offset + r.bytes) + ": " + errno_text(r.error);
  }
  if (r.bytes < len) {
    return "file is shorter than its planned size (end of file at offset " +
           std::to_string(offset + r.bytes) + ", " + std::to_string(file.size) + " planned)";
  }
  return {};
}

}  // namespace

Prefetcher::Prefetcher(std::vector<PrefetchFile> files, PrefetchOptions options)
    : options_(std::move(options)), started_(std::chrono::steady_clock::now()) {
  if (options_.threads == 0) {
    throw Error(Stage::kConfig, "", "", "prefetch threads must be >= 1 (got 0)");
  }
  if (options_.block_bytes == 0) {
    throw Error(Stage::kConfig, "", "", "prefetch block_bytes must be > 0 (got 0)");
  }
  files_.reserve(files.size());
  std::uint64_t blocks = 0;
  for (PrefetchFile& f : files) {
    if (!f.ranges) {
      f.ranges.emplace();
      if (f.size > 0) {
        f.ranges->emplace_back(0, f.size);
      }
    }
    std::uint64_t last_end = 0;
    for (const auto& [begin, end] : *f.ranges) {
      if (begin < last_end || end <= begin || end > f.size) {
        throw Error(Stage::kConfig, display_name(f), "",
                    "prefetch ranges must be sorted, disjoint, non-empty and inside the file");
      }
      last_end = end;
      blocks += (end - begin + options_.block_bytes - 1) / options_.block_bytes;
    }
    FileState state;
    state.plan_offset = total_bytes_;
    total_bytes_ += f.size;
    state.file = std::move(f);
    files_.push_back(std::move(state));
  }

  const std::uint64_t workers = std::min<std::uint64_t>(options_.threads, blocks);
  threads_.reserve(workers);
  for (std::uint64_t i = 0; i < workers; ++i) {
    {
      // Counted before the thread exists so that one finishing at once cannot make
      // done() true while others are still to start.
      std::lock_guard lock(mu_);
      ++running_;
    }
    try {
      threads_.push_back(
          start_thread("prefetch worker " + std::to_string(i), [this, sink = log::thread_sink()] {
            // the messages of whoever started it
            const log::ScopedSink scope(sink);
            run_worker();
          }));
    } catch (const Error& e) {
      // Prefetch is advice: it goes on with the workers it has (none: the reads
      // go on without it), and says so.
      {
        std::lock_guard lock(mu_);
        --running_;
      }
      done_cv_.notify_all();
      record_failure(format_error(Stage::kPrefetch, "", "", e.what()));
      break;
    }
  }
}

Prefetcher::~Prefetcher() {
  cancel();
  std::lock_guard join_lock(join_mu_);
  for (std::thread& t : threads_) {
    if (t.joinable()) {
      t.join();
    }
  }
}

void Prefetcher::advance(std::uint64_t consumer_position) {
  {
    std::lock_guard lock(mu_);
    if (consumer_position <= consumer_) {
      return;
    }
    consumer_ = consumer_position;
  }
  work_cv_.notify_all();
}

void Prefetcher::wait() {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return running_ == 0; });
}

void Prefetcher::cancel() {
  {
    std::lock_guard lock(mu_);
    cancelled_ = true;
  }
  work_cv_.notify_all();
}

bool Prefetcher::stop(std::chrono::milliseconds timeout) {
  cancel();
  {
    std::unique_lock lock(mu_);
    if (!done_cv_.wait_for(lock, timeout, [&] { return running_ == 0; })) {
      return false;
    }
  }
  // Every worker has left its loop; joining only waits for it to return.
  std::lock_guard join_lock(join_mu_);
  for (std::thread& t : threads_) {
    if (t.joinable()) {
      t.join();
    }
  }
  return true;
}

bool Prefetcher::done() const {
  std::lock_guard lock(mu_);
  return running_ == 0;
}

bool Prefetcher::cancelled() const {
  std::lock_guard lock(mu_);
  return cancelled_;
}

std::vector<std::string> Prefetcher::failed() const {
  std::lock_guard lock(mu_);
  return failures_;
}

std::uint64_t Prefetcher::bytes_prefetched() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

std::uint64_t Prefetcher::position() const {
  std::lock_guard lock(mu_);
  return position_;
}

bool Prefetcher::next_block(std::unique_lock<std::mutex>& lock, Block& block) {
  for (;;) {
    if (cancelled_) {
      return false;
    }
    if (next_file_ == files_.size()) {
      return false;
    }
    const FileState& f = files_[next_file_];
    const auto& ranges = *f.file.ranges;
    // Past this file's last range: the rest of the file is not planned.
    if (next_range_ >= ranges.size()) {
      finish_range(f.plan_offset + next_offset_, f.plan_offset + f.file.size);
      ++next_file_;
      next_range_ = 0;
      next_offset_ = 0;
      continue;
    }
    const auto [range_begin, range_end] = ranges[next_range_];
    if (next_offset_ < range_begin) {  // a gap between ranges: nothing to read
      finish_range(f.plan_offset + next_offset_, f.plan_offset + range_begin);
      next_offset_ = range_begin;
    }
    if (next_offset_ >= range_end) {
      ++next_range_;
      continue;
    }
    // The reader has passed this point: skip forward to it.
    if (consumer_ > f.plan_offset + next_offset_) {
      const std::uint64_t to = std::min(consumer_ - f.plan_offset, range_end);
      finish_range(f.plan_offset + next_offset_, f.plan_offset + to);
      next_offset_ = to;
      continue;
    }
    const std::uint64_t start = f.plan_offset + next_offset_;
    // Written as a difference so a huge ahead_bytes cannot overflow.
    if (options_.ahead_bytes > 0 && start >= consumer_ &&
        start - consumer_ >= options_.ahead_bytes) {
      work_cv_.wait(lock);
      continue;
    }
    block.file = next_file_;
    block.offset = next_offset_;
    block.len = static_cast<std::size_t>(
        std::min<std::uint64_t>(options_.block_bytes, range_end - next_offset_));
    next_offset_ += block.len;
    return true;
  }
}

void Prefetcher::finish_range(std::uint64_t begin, std::uint64_t end) {
  if (begin == end) {
    return;
  }
  if (begin != position_) {
    finished_.emplace(begin, end);
    return;
  }
  position_ = end;
  // Ranges are disjoint and together cover the plan, so they join up exactly.
  while (!finished_.empty() && finished_.begin()->first == position_) {
    position_ = finished_.begin()->second;
    finished_.erase(finished_.begin());
  }
}

void Prefetcher::fail_file(std::size_t index, const std::string& rule) {
  std::string message;
  {
    std::lock_guard lock(mu_);
    FileState& f = files_[index];
    if (f.failed) {
      return;  // another worker already reported this file
    }
    f.failed = true;
    message = format_error(Stage::kPrefetch, display_name(f.file), "", rule);
    failures_.push_back(message);
    if (next_file_ == index) {
      // Give up on the blocks not yet handed out.
      finish_range(f.plan_offset + next_offset_, f.plan_offset + f.file.size);
      ++next_file_;
      next_range_ = 0;
      next_offset_ = 0;
    }
  }
  log::warn(message + " (continuing without it)");
}

void Prefetcher::record_failure(std::string message) {
  {
    std::lock_guard lock(mu_);
    failures_.push_back(message);
  }
  log::warn(message);
}

void Prefetcher::run_worker() {
  try {
    // Uninitialized: the bytes are never looked at.
    auto buffer = std::make_unique_for_overwrite<std::byte[]>(options_.block_bytes);
    Fd fd;
    std::size_t open_file_index = files_.size();  // none
    std::string open_error;
    Block block;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        if (!next_block(lock, block)) {
          break;
        }
      }
      // files_[i].file is immutable after construction: safe to read unlocked.
      const PrefetchFile& file = files_[block.file].file;
      std::string error;
      std::uint64_t got = 0;
      if (open_file_index != block.file) {
        fd.reset();
        open_file_index = block.file;
        open_error = open_file(file, fd);
      }
      if (!open_error.empty()) {
        error = open_error;
      } else {
        try {
          if (options_.on_block) {
            options_.on_block(file, block.offset, block.len);
          }
          const auto began = std::chrono::steady_clock::now();
          error = read_block(fd.get(), file, block.offset, block.len, buffer.get(), got);
          if (error.empty() && options_.on_block_read) {
            options_.on_block_read(file, block.offset, got, began,
                                   std::chrono::steady_clock::now());
          }
        } catch (const std::exception& e) {
          error = e.what();
        } catch (...) {
          error = "on_block hook threw";
        }
      }
      {
        std::lock_guard lock(mu_);
        bytes_ += got;
        const std::uint64_t begin = files_[block.file].plan_offset + block.offset;
        finish_range(begin, begin + block.len);
      }
      if (!error.empty()) {
        fail_file(block.file, error);
      }
    }
  } catch (const std::exception& e) {
    record_failure(
        format_error(Stage::kPrefetch, "", "", std::string("worker stopped: ") + e.what()));
  }

  std::string summary;
  {
    std::lock_guard lock(mu_);
    if (--running_ == 0) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
      summary = std::string(cancelled_ ? "prefetch cancelled after " : "prefetch finished: ") +
                std::to_string(bytes_) + " of " + std::to_string(total_bytes_) + " bytes in " +
                std::to_string(files_.size()) + " files, " + std::to_string(seconds) + " s, " +
                std::to_string(failures_.size()) + " failed";
    }
  }
  done_cv_.notify_all();
  if (!summary.empty()) {
    log::info(summary);
  }
}

}  // namespace ferry::io
