// Page-cache prefetch: reads weight files ahead of the real reader so that its reads
// hit the page cache (the win is on network and cold disks; on local NVMe it does
// little). The bytes read are thrown away; only the kernel's cache matters.
//
// Files are read in plan order (the order given), sequentially, in blocks of
// PrefetchOptions::block_bytes handed out in order to `threads` worker threads, each
// pread()ing into its own reusable buffer. Positions use one "plan byte" coordinate:
// file i occupies [sum of the sizes of files 0..i-1, + size). When ahead_bytes > 0
// no block starting at or beyond (consumer position + ahead_bytes) is read until the
// consumer, via advance(), moves on, so the prefetch does not evict what the reader
// is about to use.
//
// A prefetch never fails a load: a file that cannot be opened or read, or that is
// shorter than its planned size, is recorded in failed(), logged with
// ferry::log::warn, and the prefetch moves on to the next file.
//
// Threads start in the constructor. Every method is thread-safe. The destructor
// cancels and joins; it waits for in-flight block reads (and on_block hooks) to
// return, so it is as prompt as one block read.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "io/file.hpp"

namespace ferry::io {

struct PrefetchFile {
  std::string path;
  std::string name;        // shown in messages; the path when empty
  std::uint64_t size = 0;  // the file's size in plan bytes
  // The byte ranges [begin, end) to prefetch, sorted, disjoint, inside [0, size):
  // a load's planned reads (empty: nothing of this file). Unset: the whole file.
  std::optional<std::vector<std::pair<std::uint64_t, std::uint64_t>>> ranges;
  // The descriptor a load keeps open since it read the header (so the pages warmed
  // are those of the file the load reads, even after a rename over `path`); the
  // prefetcher opens a descriptor of its own to it. Null: `path` is opened.
  std::shared_ptr<const File> file;
};

struct PrefetchOptions {
  unsigned threads = 4;  // blocks read in parallel (SGLang's default); must be >= 1
  std::size_t block_bytes = std::size_t{16} << 20;  // one pread per block; must be > 0
  std::uint64_t ahead_bytes = 0;  // how far past the consumer to read; 0 = no bound
  // Tests only: called on a worker thread before each block is read, concurrently
  // from several workers. It may block (a slow disk) or throw (the file fails with
  // the exception's message).
  std::function<void(const PrefetchFile& file, std::uint64_t offset, std::size_t len)> on_block;
  // Observers (the runtime's trace): after each block read that succeeded, on its
  // worker thread, with when the read began and ended. It must not throw.
  std::function<void(const PrefetchFile& file, std::uint64_t offset, std::uint64_t bytes,
                     std::chrono::steady_clock::time_point begin,
                     std::chrono::steady_clock::time_point end)>
      on_block_read;
};

class Prefetcher {
 public:
  // Only the files' ranges are read (the whole file when it has none); a block never
  // crosses a range's end. When the consumer (advance()) has passed the next block,
  // the prefetch skips forward to it: what the reader already read is not warmed.
  // Starts min(threads, blocks to read) workers at once; with nothing to read
  // (no files, or all empty) none start and done() is true immediately. Files of
  // size 0 are skipped without being opened. Throws ferry::Error(Stage::kConfig)
  // only for invalid options (threads == 0, block_bytes == 0). A worker thread that
  // cannot be started is recorded in failed() and logged, not thrown.
  Prefetcher(std::vector<PrefetchFile> files, PrefetchOptions options = {});
  // cancel() then joins every worker (see the file comment on promptness).
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The consumer has used plan bytes [0, consumer_position). Smaller values than a
  // previous call are ignored.
  void advance(std::uint64_t consumer_position);

  // Blocks until every worker has exited: all blocks read (or given up on for
  // failed files), or cancelled. With ahead_bytes set, someone must keep calling
  // advance() (or cancel()) or this waits forever.
  void wait();
  // Asks workers to stop at the next block boundary; returns at once.
  void cancel();
  // cancel(), then waits up to `timeout` for the workers to exit and joins them.
  // Returns false if some are still inside a block read or hook at the deadline;
  // those are joined later by the destructor.
  bool stop(std::chrono::milliseconds timeout);

  // True once every worker has exited (everything read, or stopped).
  bool done() const;
  bool cancelled() const;
  // One message per failed file, in the order failures happened, e.g.
  // "prefetch: x.safetensors: open: No such file or directory".
  std::vector<std::string> failed() const;
  // Bytes actually read so far (a failed file counts what was read before it failed).
  std::uint64_t bytes_prefetched() const;
  // The plan offset below which every block has been read or given up on (a failed
  // file's blocks count as given up); it only grows, and equals total_bytes() when a
  // prefetch ran to completion.
  std::uint64_t position() const;
  // Sum of the planned file sizes.
  std::uint64_t total_bytes() const { return total_bytes_; }

 private:
  struct FileState {
    PrefetchFile file;              // ranges always set: [0, size) when they were not
    std::uint64_t plan_offset = 0;  // where the file starts in plan bytes
    bool failed = false;
  };
  struct Block {
    std::size_t file = 0;
    std::uint64_t offset = 0;  // within the file
    std::size_t len = 0;
  };

  void run_worker();
  // Under `mu_`: waits for and returns the next block; false when the worker should exit.
  bool next_block(std::unique_lock<std::mutex>& lock, Block& block);
  // Under `mu_`: plan range [begin, end) is finished; moves position_ on.
  void finish_range(std::uint64_t begin, std::uint64_t end);
  // Records the first failure of file `index`, logs it, and skips its unread blocks.
  void fail_file(std::size_t index, const std::string& rule);
  void record_failure(std::string message);

  const PrefetchOptions options_;
  std::vector<FileState> files_;
  std::uint64_t total_bytes_ = 0;
  std::chrono::steady_clock::time_point started_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // workers: consumer advanced or cancelled
  std::condition_variable done_cv_;  // waiters: a worker exited
  std::size_t next_file_ = 0;        // the next block to hand out: file index ...
  std::size_t next_range_ = 0;       // ... range of that file ...
  std::uint64_t next_offset_ = 0;    // ... and offset within the file
  std::uint64_t consumer_ = 0;
  bool cancelled_ = false;
  unsigned running_ = 0;  // workers not yet exited
  std::uint64_t bytes_ = 0;
  std::uint64_t position_ = 0;
  std::map<std::uint64_t, std::uint64_t> finished_;  // finished ranges beyond position_
  std::vector<std::string> failures_;

  std::mutex join_mu_;  // one joiner at a time (stop() and the destructor)
  std::vector<std::thread> threads_;
};

}  // namespace ferry::io
