// Byte readers: the narrow interface between weight files and staging memory.
//
// A Reader moves exact byte ranges of open files into caller-owned memory. It is
// asynchronous by shape (submit, then poll for completions) so that a pipeline can
// keep many reads in flight; `read_all` is the synchronous convenience on top.
//
// Contract for every implementation:
//  - A submitted op completes exactly once, reported by poll() with its tag.
//  - Success means all `nbytes` were read. Short reads are resubmitted for the
//    remainder; EINTR/EAGAIN are retried. A read that meets end-of-file before
//    `nbytes` is an error ("file truncated"), never a silent short result.
//  - Ops larger than ReaderOptions::chunk_bytes are split into chunk-sized reads.
//  - At most ReaderOptions::queue_depth reads are in flight; more are queued.
//  - O_DIRECT files (File::direct()) take any offset, length and destination:
//    the reader widens unaligned ranges to the file's alignment, reads into its own
//    aligned bounce memory and copies the requested bytes out. Aligned ranges into
//    aligned destinations are read in place.
//  - A Reader is used from one thread at a time (not thread-safe). Files passed to
//    submit() must outlive the op.
//  - Errors are ferry::Error(Stage::kRead) naming the file, carried in Completion.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/fault_injection.hpp"
#include "io/file.hpp"

namespace ferry::io {

struct ReadOp {
  const File* file = nullptr;
  std::uint64_t offset = 0;  // absolute byte offset in the file
  std::size_t nbytes = 0;
  std::byte* dst = nullptr;  // at least nbytes writable
  std::uint64_t tag = 0;     // returned in the Completion
};

struct Completion {
  std::uint64_t tag = 0;
  std::exception_ptr error;  // null on success
};

// Counters every reader keeps; readers only add to them.
struct ReaderStats {
  // Bytes asked of the kernel, summed over system reads: O_DIRECT widening is
  // included, and a resubmitted remainder (after a short read, EAGAIN or EINTR)
  // counts again at its own length, so retries make this exceed the bytes delivered.
  std::uint64_t bytes_requested = 0;
  std::uint64_t reads_issued = 0;     // system reads / SQEs submitted
  std::uint64_t short_reads = 0;      // reads that returned fewer bytes than asked
  std::uint64_t retries = 0;          // EINTR / EAGAIN retries
};

// (An mmap engine existed: a file truncated during its copy killed the process with
// SIGBUS, and it could not be chosen from the config, so it was removed.)
enum class Engine { kUring, kPread };

// Whether a read may land in its final memory (a parameter) instead of a staging
// buffer, where the layer above finds that possible: kAuto where possible, kOn
// likewise but insisting (the layer fails when nothing can), kOff never.
enum class DirectToDevice { kAuto, kOn, kOff };

struct ReaderOptions {
  Engine engine = Engine::kUring;               // io_uring, falling back to pread
  unsigned queue_depth = 16;                    // reads in flight (uring)
  std::size_t chunk_bytes = 4u << 20;           // largest single read (O_DIRECT: whole blocks)
  bool register_buffers = false;                // io_uring fixed buffers for bounce memory
  std::shared_ptr<FaultInjector> faults;        // tests only: perturbs system read results
  // How long teardown waits for reads it asked the kernel to cancel (io.cancel_timeout_ms).
  std::chrono::milliseconds cancel_timeout{5000};
};

class Reader {
 public:
  virtual ~Reader() = default;

  // Queues one read. May perform it at once (pread does); never blocks on the
  // completion of other ops beyond what queue depth requires.
  virtual void submit(const ReadOp& op) = 0;
  // Appends completed ops to `out`. Waits up to `wait` for at least one when none
  // is ready and some are outstanding. Returns how many were appended.
  virtual std::size_t poll(std::vector<Completion>& out, std::chrono::milliseconds wait) = 0;
  // Ops submitted and not yet returned by poll().
  virtual std::size_t outstanding() const = 0;
  virtual const ReaderStats& stats() const = 0;
  // "uring", "pread", or a decorator's name.
  virtual std::string name() const = 0;

  // Gives up on every outstanding op, for teardown: nothing more is issued, reads
  // in the kernel are asked to stop (io_uring: IORING_OP_ASYNC_CANCEL), and it waits
  // up to `bound` for them to end. Their completions are discarded. True when no
  // read is left in flight, so their destination memory may be reused; false when
  // one still is after `bound` (a read stuck in the kernel: its memory must then
  // never be freed). Never throws. This default polls until nothing is
  // outstanding or `bound` passes.
  virtual bool cancel(std::chrono::milliseconds bound) noexcept;
};

// Creates the reader `options.engine` asks for. kUring probes io_uring once per
// process; when unavailable it logs the reason and returns a pread reader. Every
// factory throws ferry::Error(Stage::kConfig) when chunk_bytes is 0 or queue_depth
// is outside 1..32768.
std::unique_ptr<Reader> make_reader(const ReaderOptions& options);
std::unique_ptr<Reader> make_pread_reader(const ReaderOptions& options);
// Returns nullptr (and the reason) when io_uring cannot be set up here.
std::unique_ptr<Reader> make_uring_reader(const ReaderOptions& options, std::string* why = nullptr);

// Whether io_uring works in this process (probed once, cached); `why` gets the reason.
// FERRY_DISABLE_URING=1 in the environment makes it report unavailable, so the
// pread fallback can be exercised on machines that have io_uring.
bool uring_available(std::string* why = nullptr);

// Submits every op, waits for all, and rethrows the first error (after draining).
// "First" is by position in `ops`; tags are ignored. The reader must have no other
// outstanding ops (std::logic_error otherwise).
void read_all(Reader& reader, std::span<const ReadOp> ops);

}  // namespace ferry::io
