// The io_uring reader: one ring per reader, at most queue_depth reads in flight.
//
// Each op is cut into sub-reads (io/reader_internal.hpp's OpPlan). A sub-read owns
// one of queue_depth slots while in flight; the slot index is the SQE's user data
// and also picks the slot's O_DIRECT bounce buffer, so bounce memory is never
// shared between reads in flight. A CQE either finishes its sub-read, resubmits the
// remainder (short read, EAGAIN, EINTR) from the same slot, or fails the op. A failed
// op issues nothing more and completes once its last in-flight sub-read is reaped:
// memory the kernel may still write into is never handed back or freed early.
//
//   submit() ─► pending_ ─► pump(): slot + SQE ─► poll(): io_uring_submit, reap CQEs
//                                  ▲                       │ short / EAGAIN: same slot
//                                  └───────────────────────┘ done: copy out, free slot
#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <list>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "common/error.hpp"
#include "common/log.hpp"
#include "io/reader.hpp"
#include "io/reader_internal.hpp"

namespace ferry::io {

namespace {

struct ProbeResult {
  bool ok = false;
  std::string why;
  bool lasting = true;  // false: a shortage of the moment (memory, descriptors)
};

bool disabled_by_environment() {
  // Read once (the probe is cached); ferry never sets the environment.
  const char* v = std::getenv("FERRY_DISABLE_URING");  // NOLINT(concurrency-mt-unsafe)
  return v != nullptr && *v != '\0' && std::string_view(v) != "0";
}

ProbeResult probe_uring() {
  if (disabled_by_environment()) {
    return {false, "disabled by FERRY_DISABLE_URING"};
  }
  io_uring ring{};
  const int r = io_uring_queue_init(4, &ring, 0);
  if (r < 0) {
    // ENOSYS: kernel without io_uring; EPERM: disabled by sysctl or a seccomp filter.
    // ENOMEM and the like say nothing about the kernel: the next reader tries again.
    const bool shortage = r == -ENOMEM || r == -EAGAIN || r == -EMFILE || r == -ENFILE;
    return {false, std::string("io_uring_queue_init: ") + errno_text(-r), !shortage};
  }
  ProbeResult result{true, "io_uring available"};
  io_uring_probe* probe = io_uring_get_probe_ring(&ring);
  if (probe == nullptr) {
    result = {false, "cannot probe io_uring opcodes (kernel older than 5.6)"};
  } else if (!io_uring_opcode_supported(probe, IORING_OP_READ)) {
    result = {false, "io_uring lacks IORING_OP_READ (kernel older than 5.6)"};
  }
  if (probe != nullptr) {
    io_uring_free_probe(probe);
  }
  io_uring_queue_exit(&ring);
  return result;
}

// The first lasting answer, kept for the process. Not std::call_once: an exception
// (std::bad_alloc) out of its callback unwinds through glibc's pthread_once, which
// loads libgcc_s with dlopen to do so and aborts the process where that fails, as
// it does under ulimit -v.
ProbeResult probe_cached() {
  static std::mutex mu;
  static std::optional<ProbeResult> kept;
  std::lock_guard lock(mu);
  if (kept) {
    return *kept;
  }
  ProbeResult result = probe_uring();
  if (result.lasting) {
    kept = result;
  }
  return result;
}

class UringReader final : public Reader {
 public:
  explicit UringReader(const ReaderOptions& options)
      : cancel_timeout_(options.cancel_timeout),
        depth_(options.queue_depth),
        chunk_bytes_(options.chunk_bytes),
        bounce_bytes_(detail::OpPlan::max_length(options.chunk_bytes, kDirectAlignment)),
        faults_(options.faults) {
    const int r = io_uring_queue_init(depth_, &ring_, 0);
    if (r < 0) {
      throw_errno(Stage::kRead, "", "io_uring_queue_init(" + std::to_string(depth_) + ")", -r);
    }
    try {
      slots_.resize(depth_);
      bounce_.resize(depth_);
      for (unsigned i = depth_; i > 0; --i) {
        free_slots_.push_back(i - 1);
      }
      if (options.register_buffers) {
        register_bounce_buffers();
      }
    } catch (...) {
      io_uring_queue_exit(&ring_);
      throw;
    }
  }

  // Bounded: reads still in the kernel are cancelled and waited for at most
  // cancel_timeout (io.cancel_timeout_ms). One that outlives it (a read stuck in
  // the kernel) is reported and its bounce buffers are leaked, rather than freed
  // under the kernel or waited for forever; the caller's destinations likewise
  // must stay allocated (the load pipeline leaks its staging buffers then).
  ~UringReader() override {
    if (!gave_up_) {
      cancel(cancel_timeout_);  // sets gave_up_ when a read outlives it
    }
    if (gave_up_) {
      log::write_built(
          log::Level::kError,
          [&] {
            return "io_uring reader: " + std::to_string(in_flight_) +
                   " read(s) still in the kernel after " + std::to_string(cancel_timeout_.count()) +
                   " ms; leaking their buffers";
          },
          "io_uring reader: reads still in the kernel after io.cancel_timeout_ms; leaking "
          "their buffers");
      for (auto& b : bounce_) {
        static_cast<void>(b.release());
      }
    }
    io_uring_queue_exit(&ring_);
  }

  UringReader(const UringReader&) = delete;
  UringReader& operator=(const UringReader&) = delete;

  void submit(const ReadOp& op) override {
    ++outstanding_;
    if (std::exception_ptr bad = detail::check_op(op)) {
      ready_.push_back(Completion{op.tag, bad});
      return;
    }
    if (op.nbytes == 0) {
      ready_.push_back(Completion{op.tag, nullptr});
      return;
    }
    OpState& state = ops_.emplace_back();
    state.self = std::prev(ops_.end());
    state.op = op;
    state.plan = detail::OpPlan(op, chunk_bytes_);
    state.queued = true;
    pending_.push_back(&state);
    pump();
  }

  std::size_t poll(std::vector<Completion>& out, std::chrono::milliseconds wait) override {
    const auto deadline = std::chrono::steady_clock::now() + wait;
    for (;;) {
      pump();
      submit_prepared();
      const bool reaped = reap();
      if (reaped) {
        // Handling CQEs freed slots and prepared resubmissions: keep the kernel busy
        // while the caller works on what completed.
        pump();
        submit_prepared();
      }
      if (!ready_.empty() || in_flight_ == 0) {
        break;
      }
      if (reaped) {
        continue;
      }
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) {
        break;
      }
      if (in_flight_ <= io_uring_sq_ready(&ring_)) {
        continue;  // nothing in the kernel yet (submission was refused for now): retry
      }
      if (const int r = wait_for_cqe(left); r < 0) {
        throw_errno(Stage::kRead, "", "io_uring_wait_cqe_timeout", -r);
      }
    }
    return detail::hand_over(ready_, out, outstanding_);
  }

  std::size_t outstanding() const override { return outstanding_; }
  const ReaderStats& stats() const override { return stats_; }
  std::string name() const override { return "uring"; }

  bool cancel(std::chrono::milliseconds bound) noexcept override {
    gave_up_ = !cancel_within(bound);
    return !gave_up_;
  }

 private:
  bool cancel_within(std::chrono::milliseconds bound) noexcept {
    const auto deadline = std::chrono::steady_clock::now() + bound;
    try {
      cancelling_ = true;
      // Nothing more is issued: queued ops fail now, and complete unless a read
      // of theirs is in the kernel.
      for (OpState* op : std::vector<OpState*>(pending_.begin(), pending_.end())) {
        fail(*op, cancelled());
        if (op->in_flight == 0) {
          ops_.erase(op->self);
        }
      }
      submit_prepared();  // prepared SQEs first, so that each read can be cancelled
      for (unsigned idx = 0; idx < depth_; ++idx) {
        if (slots_[idx].op == nullptr) {
          continue;
        }
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr) {
          submit_prepared();
          sqe = io_uring_get_sqe(&ring_);
        }
        if (sqe == nullptr) {
          break;  // the reads left run to their end, waited for below
        }
        io_uring_prep_cancel64(sqe, idx, 0);
        io_uring_sqe_set_data64(sqe, kCancelTag);
      }
      submit_prepared();
      while (in_flight_ > 0) {
        reap();
        if (in_flight_ == 0) {
          break;
        }
        const auto left = deadline - std::chrono::steady_clock::now();
        if (left <= std::chrono::steady_clock::duration::zero()) {
          return false;
        }
        if (wait_for_cqe(left) < 0) {
          return false;
        }
      }
      ready_.clear();
      ops_.clear();
      outstanding_ = 0;
      return true;
    } catch (...) {
      return false;
    }
  }

 private:
  struct OpState {
    ReadOp op;
    detail::OpPlan plan;
    unsigned in_flight = 0;    // sub-reads holding a slot
    bool queued = false;       // in pending_: sub-reads left to issue
    std::exception_ptr error;  // first failure; nothing more is issued once set
    std::list<OpState>::iterator self;
  };

  struct Slot {
    detail::SubRead sub;
    OpState* op = nullptr;
    std::size_t asked = 0;  // length of the read now in the kernel
  };

  void register_bounce_buffers() {
    std::vector<iovec> iov(depth_);
    for (unsigned i = 0; i < depth_; ++i) {
      bounce_[i] = detail::make_aligned_buffer(bounce_bytes_);
      iov[i].iov_base = bounce_[i].get();
      iov[i].iov_len = bounce_bytes_;
    }
    const std::string what =
        std::to_string(depth_) + " bounce buffers of " + std::to_string(bounce_bytes_) + " bytes";
    const int r = io_uring_register_buffers(&ring_, iov.data(), depth_);
    if (r < 0) {
      // Typically ENOMEM: pinned memory is capped by RLIMIT_MEMLOCK for non-root.
      log::info("io_uring: cannot register " + what + " (" + errno_text(-r) +
                "); using unregistered buffers");
      return;
    }
    fixed_buffers_ = true;
    log::debug("io_uring: registered " + what);
  }

  // Gives free slots to pending ops, preparing one SQE per slot.
  void pump() {
    while (!pending_.empty() && !free_slots_.empty()) {
      OpState* op = pending_.front();
      const unsigned idx = free_slots_.back();
      if (op->op.file->direct() && !bounce_[idx]) {
        bounce_[idx] = detail::make_aligned_buffer(bounce_bytes_);  // before any state changes
      }
      free_slots_.pop_back();
      ++in_flight_;
      Slot& slot = slots_[idx];
      slot = Slot{};
      slot.op = op;
      slot.sub.range = op->plan.next();
      ++op->in_flight;
      if (op->plan.done()) {
        pending_.pop_front();
        op->queued = false;
      }
      issue(idx);
    }
  }

  // Prepares the SQE for the rest of slot `idx`'s sub-read.
  void issue(unsigned idx) {
    Slot& slot = slots_[idx];
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    if (sqe == nullptr) {
      // Each slot holds at most one SQE and the ring has >= depth entries.
      throw std::logic_error("io_uring reader: submission queue unexpectedly full");
    }
    const detail::SubRange& range = slot.sub.range;
    const bool bounce = range.in_place == nullptr;
    std::byte* buf = (bounce ? bounce_[idx].get() : range.in_place) + slot.sub.done;
    slot.asked = slot.sub.next_length();
    const int fd = slot.op->op.file->fd();
    const auto len = static_cast<unsigned>(slot.asked);
    const std::uint64_t at = slot.sub.next_offset();
    if (bounce && fixed_buffers_) {
      io_uring_prep_read_fixed(sqe, fd, buf, len, at, static_cast<int>(idx));
    } else {
      io_uring_prep_read(sqe, fd, buf, len, at);
    }
    io_uring_sqe_set_data64(sqe, idx);
    ++stats_.reads_issued;
    stats_.bytes_requested += slot.asked;
  }

  void submit_prepared() {
    if (io_uring_sq_ready(&ring_) == 0) {
      return;
    }
    const int r = io_uring_submit(&ring_);
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
      throw_errno(Stage::kRead, "", "io_uring_submit", -r);
    }
  }

  // Handles every CQE available now; returns whether there was any.
  bool reap() {
    bool any = false;
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(&ring_, &cqe) == 0) {
      const std::uint64_t data = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (data != kCancelTag) {  // a cancel request's own completion says nothing
        handle(static_cast<unsigned>(data), res);
      }
      any = true;
    }
    return any;
  }

  // Waits up to `left` for a CQE (left in the ring for reap()). Returns 0, or a
  // -errno other than the timeout's and interruptions'.
  int wait_for_cqe(std::chrono::steady_clock::duration left) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    __kernel_timespec ts{};
    ts.tv_sec = ns / 1'000'000'000;
    ts.tv_nsec = ns % 1'000'000'000;
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
    return r < 0 && r != -ETIME && r != -EINTR && r != -EAGAIN ? r : 0;
  }

  static std::exception_ptr cancelled() {
    return std::make_exception_ptr(
        Error(Stage::kCancelled, "", "", "io_uring reader: the read was cancelled"));
  }

  void handle(unsigned idx, int res) {
    Slot& slot = slots_[idx];
    OpState& op = *slot.op;
    if (cancelling_) {  // whatever it says, the read is over: never reissued
      fail(op, cancelled());
      finish(idx);
      return;
    }
    long long got = res;
    if (faults_) {
      got = faults_->apply(got, slot.asked);
    }
    if (op.error) {
      finish(idx);  // the op already failed: this read only had to land
      return;
    }
    const File& file = *op.op.file;
    const std::uint64_t at = slot.sub.next_offset();
    if (got < 0) {
      const int err = static_cast<int>(-got);
      if (!detail::is_retryable(err)) {
        fail(op, detail::errno_error(file, "read at offset " + std::to_string(at), err));
        finish(idx);
        return;
      }
      if (++slot.sub.stalls > detail::kMaxRetries) {
        fail(op, detail::retries_error(file, at, err));
        finish(idx);
        return;
      }
      ++stats_.retries;
      issue(idx);
      return;
    }
    std::uint64_t eof_at = 0;
    switch (detail::advance(slot.sub, got, slot.asked, file, stats_, &eof_at)) {
      case detail::Step::kDone:
        if (slot.sub.range.in_place == nullptr) {
          const detail::SubRange& r = slot.sub.range;
          std::memcpy(r.copy_to, bounce_[idx].get() + r.copy_from, r.copy_length);
        }
        finish(idx);
        return;
      case detail::Step::kAgain:
        issue(idx);
        return;
      case detail::Step::kEof:
        fail(op, detail::truncated_error(op.op, eof_at));
        finish(idx);
        return;
      case detail::Step::kStuck:
        fail(op, detail::retries_error(file, slot.sub.next_offset(), 0));
        finish(idx);
        return;
    }
  }

  void fail(OpState& op, std::exception_ptr error) {
    if (!op.error) {
      op.error = std::move(error);
    }
    if (op.queued) {
      pending_.erase(std::find(pending_.begin(), pending_.end(), &op));
      op.queued = false;
    }
  }

  // Slot `idx`'s sub-read is over; completes its op when it was the last one.
  void finish(unsigned idx) {
    OpState* op = slots_[idx].op;
    release_slot(idx);
    --op->in_flight;
    if (op->in_flight == 0 && !op->queued) {
      ready_.push_back(Completion{op->op.tag, op->error});
      ops_.erase(op->self);
    }
  }

  void release_slot(unsigned idx) {
    slots_[idx].op = nullptr;
    free_slots_.push_back(idx);
    --in_flight_;
  }

  // The user data of IORING_OP_ASYNC_CANCEL requests (slot indices are below depth).
  static constexpr std::uint64_t kCancelTag = ~std::uint64_t{0};

  std::chrono::milliseconds cancel_timeout_;
  bool cancelling_ = false;  // cancel() ran: completions end their reads
  bool gave_up_ = false;     // a read outlived cancel(): its memory is never freed
  io_uring ring_{};
  unsigned depth_;
  std::size_t chunk_bytes_;
  std::size_t bounce_bytes_;  // every slot's bounce buffer holds one aligned chunk
  std::shared_ptr<FaultInjector> faults_;
  std::vector<Slot> slots_;
  std::vector<unsigned> free_slots_;
  std::vector<detail::AlignedBuffer> bounce_;  // per slot, allocated on first O_DIRECT use
  bool fixed_buffers_ = false;                 // bounce_ registered with the ring
  std::list<OpState> ops_;                     // submitted, not yet complete
  std::deque<OpState*> pending_;               // ops with sub-reads left to issue
  std::deque<Completion> ready_;
  std::size_t in_flight_ = 0;  // slots in use (SQEs prepared or in the kernel)
  std::size_t outstanding_ = 0;
  ReaderStats stats_;
};

}  // namespace

bool uring_available(std::string* why) {
  const ProbeResult probe = probe_cached();
  if (why != nullptr) {
    *why = probe.why;
  }
  return probe.ok;
}

std::unique_ptr<Reader> make_uring_reader(const ReaderOptions& options, std::string* why) {
  detail::check_options(options);
  if (!uring_available(why)) {
    return nullptr;
  }
  try {
    return std::make_unique<UringReader>(options);
  } catch (const Error& e) {
    if (why != nullptr) {
      *why = e.what();
    }
    return nullptr;
  }
}

}  // namespace ferry::io
