// A read lane's reader: cuts its share of the plan's windows in order
// (actors::WindowCutter over the lane's spans, one window just before it is read, so
// only the windows in flight exist), reads each into a staging buffer of the lane's
// own pool and hands the buffer, with the window, to every copy worker that has
// fragments in it. Lanes run side by side, each on its own thread and ring.
//
// Single-copy reads: a window that is one contiguous run of one local rank's param
// (actors::single_param_run), on a device whose memory is host memory, is read
// straight into the param (no buffer; PipelineOptions::direct_to_device) and
// announced to that rank's worker with a null buffer once the read completed.
//
//   reader ── ChunkMsg{lease, window} ──► copy workers (then EndOfStreamMsg)
//   reader ── AdvanceMsg{lane} ──► prefetcher    reader ── ReaderDoneMsg ──► coordinator
//
// The bridge between the mailbox and io_uring: the reader is a blocking actor on
// its own thread that owns the io::Reader (ring) outright, and loops: drain the
// mailbox without blocking (an exit message stops it), issue reads while a staging
// buffer is free (handing over, after each, whatever has completed), then wait for
// completions for at most kPollWait. One thread owns
// the ring, so a SINGLE_ISSUER ring would work and no lock guards the Reader (it is
// not thread-safe); the cost is that a message waits up to kPollWait, which only
// delays cancellation by milliseconds. (The alternative, an I/O thread posting
// completions to an event-based actor, needs a second thread and a handoff for the
// same result.)
//
// Credits: a staged read is issued only into a leased buffer of the lane's pool, so
// its staged reads in flight plus chunks queued at or held by the copy workers
// never exceed the pool's buffer count (and direct reads in flight never exceed
// io.queue_depth); when none is free the reader waits on the pool (bounded, so it still sees
// its mailbox). The lease travels as shared_ptr and returns when the last worker
// that used the chunk has finished copying from it.
//
// On any exit the reader first waits for its in-flight reads: the kernel must not
// write into a buffer that went back to the pool.
//
// Files: a lane takes a file's descriptor before its first read of it (checking
// that the file is still the one its header was read from) and, once its last
// read of it has completed, fstats it again and lets it go: a file rewritten in
// place while it was being read (same inode, new mtime, ctime or size) fails the
// load, since some of its windows may hold old bytes and others new ones.
#include "io/reader.hpp"

#include <algorithm>
#include <caf/after.hpp>
#include <caf/blocking_actor.hpp>
#include <caf/local_actor.hpp>
#include <caf/system_messages.hpp>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "actors/messages_internal.hpp"
#include "actors/threads_internal.hpp"
#include "common/log.hpp"
#include "io/file.hpp"

namespace ferry::actors {
namespace {

constexpr std::chrono::milliseconds kPollWait{2};
constexpr std::uintptr_t kDirectAlign = io::kDirectAlignment;  // offsets, lengths, memory

class ReadLoop {
 public:
  ReadLoop(caf::blocking_actor* self, std::shared_ptr<Shared> shared, std::size_t lane,
           std::vector<CopyWorkerActor> workers, PrefetcherActor prefetcher)
      : self_(self),
        shared_(std::move(shared)),
        lane_(lane),
        pool_(*shared_->lanes.at(lane).pool),
        workers_(std::move(workers)),
        prefetcher_(std::move(prefetcher)) {}

  ReadLoop(const ReadLoop&) = delete;
  ReadLoop& operator=(const ReadLoop&) = delete;

  // Waits for reads still in flight before the buffers and files go away.
  // Never throws (a throw here would be std::terminate inside the engine): when the
  // reads in flight cannot be reaped, their staging buffers are deliberately leaked
  // (each lease keeps its pool's memory alive) rather than handed back while the
  // kernel may still write into them.
  ~ReadLoop() {
    if (reader_) {
      // Reads still in flight when the load stopped early are cancelled and waited
      // for, bounded by io.cancel_timeout_ms (io::Reader::cancel never throws).
      const auto bound = std::chrono::milliseconds(shared_->input().options.io.cancel_timeout_ms);
      if (reader_->outstanding() > 0 && !reader_->cancel(bound)) {
        log::write_built(
            log::Level::kError,
            [&] {
              return "reader lane " + std::to_string(lane_) + ": " +
                     std::to_string(in_flight_.size()) + " read(s) still in flight after " +
                     std::to_string(bound.count()) + " ms; leaking their staging buffers";
            },
            "reader lane: reads still in flight after io.cancel_timeout_ms; leaking their "
            "staging buffers");
        leak_in_flight();
      }
      shared_->bytes_read.fetch_add(reader_->stats().bytes_requested);
    }
    in_flight_.clear();
  }

  // The file a lane reads: the descriptor its header was read from at resolve
  // (kept open since, so a rename over the path changes nothing), a second
  // descriptor of that very file for O_DIRECT, or, for an index made without
  // descriptors, the path opened now. The plan's offsets come from that header: a
  // file truncated or rewritten since is refused before a byte of it is read.
  static std::shared_ptr<const io::File> open_file(const io::CheckpointFile& f, bool direct) {
    std::shared_ptr<const io::File> file;
    if (f.file && !direct) {
      file = f.file;
    } else if (f.file) {
      file = std::make_shared<const io::File>(io::File::reopen(*f.file, true));
    } else {
      file = std::make_shared<const io::File>(io::File::open(f.path, direct, f.name));
    }
    const io::FileIdentity now = f.file ? file->current_identity() : file->identity();
    if (io::changed(f.identity, now)) {
      throw Error(Stage::kRead, f.name, "",
                  "changed since its header was read (" + io::describe_change(f.identity, now) +
                      "): the load plan no longer fits it");
    }
    return file;
  }

  // The lane's descriptor of file `index`, opened (and checked) before its first
  // read: a lane holds only the files it is reading, not every file of its share.
  const io::File* file_for(std::uint32_t index) {
    std::shared_ptr<const io::File>& file = files_[index];
    if (!file) {
      file = open_file(shared_->index().files[index], shared_->input().options.io.direct);
    }
    return file.get();
  }

  // After the lane's last read of file `index` has completed: fstat the descriptor
  // again. The bytes just read came from the file as it was at some moment of the
  // read; a file rewritten in place meanwhile (the same inode, so the open-time
  // check saw nothing) may have given some windows old bytes and others new ones.
  // Any change since the header was read fails the load. Then the lane lets go of
  // the descriptor (an O_DIRECT second descriptor closes here).
  void finish_file(std::uint32_t index) {
    std::shared_ptr<const io::File>& file = files_[index];
    const io::CheckpointFile& f = shared_->index().files[index];
    const io::FileIdentity before = f.identity.known() ? f.identity : file->identity();
    const io::FileIdentity now = file->current_identity();
    if (io::changed(before, now)) {
      throw Error(Stage::kRead, f.name, "",
                  "changed while it was being read (" + io::describe_change(before, now) +
                      "): the bytes loaded may mix its old and new contents");
    }
    file.reset();
  }

  // True when every window was read and dispatched; false when stopped early.
  bool run() {
    const PipelineInput& input = shared_->input();
    const PipelineOptions& o = input.options;
    const auto spans = shared_->lanes[lane_].spans;
    files_.resize(shared_->index().files.size());
    depth_ = std::max(1u, o.io.queue_depth);
    io::ReaderOptions ro;
    ro.engine = o.io.engine;
    ro.queue_depth = depth_;
    ro.chunk_bytes = o.io.chunk_bytes;
    ro.faults = input.faults;
    ro.cancel_timeout = std::chrono::milliseconds(o.io.cancel_timeout_ms);
    reader_ = io::make_reader(ro);
    if (input.wrap_reader) {
      reader_ = input.wrap_reader(std::move(reader_));
    }

    WindowCutter cutter(shared_->plan(), spans);
    next_ = cut(cutter);
    std::vector<io::Completion> done;
    while (true) {
      if (!drain_mailbox() || shared_->aborted()) {
        return false;
      }
      shared_->check_cancel();
      while (next_ && in_flight_.size() < depth_) {
        // No new read once the load has failed or been cancelled, not even to fill
        // the queue: the dispatches just above may have seen the end.
        if (shared_->aborted()) {
          return false;
        }
        shared_->check_cancel();
        Window& w = *next_;
        std::byte* dst = direct_destination(w);
        std::shared_ptr<io::StagingBuffer> buf;
        if (dst == nullptr) {
          std::optional<io::StagingBuffer> lease = take_buffer();
          if (!lease) {
            break;
          }
          buf = std::make_shared<io::StagingBuffer>(std::move(*lease));
          dst = buf->data();
        }
        w.direct = !buf;
        reader_->submit(
            {file_for(w.file), w.offset, static_cast<std::size_t>(w.nbytes), dst, w.index});
        ++reads_of_[w.file];
        in_flight_.emplace(w.index, InFlight{std::move(buf), std::move(next_)});
        next_ = cut(cutter);
        // Hand over whatever is done before the next read: from the page cache a
        // read completes inside the submit, and batching several of them before
        // the first dispatch left the copy workers idle meanwhile (a convoy).
        // Reads still in the kernel stay there, so the queue depth is kept.
        done.clear();
        reader_->poll(done, std::chrono::milliseconds(0));
        for (const io::Completion& c : done) {
          dispatch(c);
        }
      }
      if (!next_ && in_flight_.empty()) {
        break;
      }
      if (!in_flight_.empty()) {
        done.clear();
        reader_->poll(done, kPollWait);
        for (const io::Completion& c : done) {
          dispatch(c);
        }
      } else {
        // Every buffer is with the copy workers: wait (bounded) for one to return.
        spare_ = pool_.acquire_for(kPollWait);
      }
    }
    for (const CopyWorkerActor& w : workers_) {
      self_->send(w, EndOfStreamMsg{});
    }
    return true;
  }

 private:
  struct InFlight {
    std::shared_ptr<io::StagingBuffer> buf;
    std::shared_ptr<const Window> window;
  };

  // Keeps every in-flight read's staging buffer alive for the rest of the process
  // (counted in Shared::staging_leaked, which the load's error reports).
  void leak_in_flight() noexcept {
    for (auto& [id, read] : in_flight_) {
      if (!read.buf) {
        continue;  // read straight into a param: no staging buffer to leave
      }
      shared_->staging_leaked.fetch_add(1);
      try {
        static std::mutex mu;
        // Never destroyed, and reachable: kept, not lost (no leak checker reports it).
        static auto* kept = new std::vector<std::shared_ptr<io::StagingBuffer>>();
        const std::lock_guard lock(mu);
        kept->push_back(std::move(read.buf));
      } catch (const std::bad_alloc&) {
        log::error("reader: out of memory while keeping a staging buffer alive; it goes back");
      }
    }
  }

  // The next window, or null after the last.
  static std::shared_ptr<Window> cut(WindowCutter& cutter) {
    auto w = std::make_shared<Window>();
    return cutter.next(*w) ? w : nullptr;
  }

  // Handles what is in the mailbox now; false when an exit message arrived.
  bool drain_mailbox() {
    bool more = true;
    bool stop = false;
    while (more && !stop) {
      self_->receive([&](caf::exit_msg&) { stop = true; },
                     caf::after(std::chrono::seconds(0)) >> [&] { more = false; });
    }
    return !stop;
  }

  std::optional<io::StagingBuffer> take_buffer() {
    if (spare_) {
      std::optional<io::StagingBuffer> out = std::move(spare_);
      spare_.reset();
      return out;
    }
    return pool_.try_acquire();
  }

  // Where window `w` may be read with no staging (see the file comment), or null.
  std::byte* direct_destination(const Window& w) const {
    const PipelineOptions& o = shared_->input().options;
    if (!shared_->single_copy) {
      return nullptr;
    }
    const std::optional<ParamRun> run = single_param_run(w);
    if (!run) {
      return nullptr;
    }
    const RankTarget& target = shared_->input().ranks[run->local_rank];
    if (!target.device->host_addressable()) {
      return nullptr;
    }
    std::byte* dst = target.params[run->param] + run->dst_offset;
    if (o.io.direct && (w.offset % kDirectAlign != 0 || w.nbytes % kDirectAlign != 0 ||
                     reinterpret_cast<std::uintptr_t>(dst) % kDirectAlign != 0)) {
      return nullptr;
    }
    return dst;
  }

  void dispatch(const io::Completion& c) {
    auto it = in_flight_.find(c.tag);
    InFlight chunk = std::move(it->second);
    in_flight_.erase(it);
    const Window& w = *chunk.window;
    if (c.error) {
      const io::TensorInfo& t = shared_->index().tensors[w.first_tensor];
      Error e = to_error(c.error, Stage::kRead, t.file, t.name, "");
      std::string more =
          w.tensor_count > 1
              ? " (the read also held " + std::to_string(w.tensor_count - 1) + " more tensor(s))"
              : "";
      throw Error(e.stage(), t.file, t.name,
                  e.rule() + " [reading bytes " + std::to_string(w.offset) + " to " +
                      std::to_string(w.offset + w.nbytes) + "]" + more);
    }
    // The file's last read: none in flight, and the next window (cut in file
    // order) is of another file or there is none.
    if (--reads_of_[w.file] == 0) {
      reads_of_.erase(w.file);
      if (!next_ || next_->file != w.file) {
        finish_file(w.file);
      }
    }
    shared_->reads.fetch_add(1);
    shared_->progress().bytes_read.fetch_add(w.nbytes, std::memory_order_relaxed);
    (w.direct ? shared_->bytes_direct : shared_->bytes_staged).fetch_add(w.nbytes);
    for (std::size_t r = 0; r < workers_.size(); ++r) {
      if (w.has_rank(r)) {
        self_->send(workers_[r], ChunkMsg{chunk.buf, chunk.window});
      }
    }
    position_ = std::max(position_, w.plan_end);
    if (prefetcher_) {
      self_->send(prefetcher_, AdvanceMsg{static_cast<std::uint32_t>(lane_), position_});
    }
  }

  caf::blocking_actor* self_;
  std::shared_ptr<Shared> shared_;
  std::size_t lane_;
  io::StagingPool& pool_;  // the lane's (Shared::lanes outlives the readers)
  unsigned depth_ = 1;     // reads in flight at most
  std::vector<CopyWorkerActor> workers_;
  PrefetcherActor prefetcher_;
  // Declaration order matters for the destructor: the reader (drained there) goes
  // before the buffers its reads write into, and both before the files.
  std::vector<std::shared_ptr<const io::File>> files_;  // by file index: the lane's only
  std::optional<io::StagingBuffer> spare_;
  std::map<std::uint64_t, InFlight> in_flight_;
  std::unique_ptr<io::Reader> reader_;
  std::uint64_t position_ = 0;
  std::shared_ptr<Window> next_;  // the next window to read (cut, not yet submitted)
  std::map<std::uint32_t, std::size_t> reads_of_;  // reads in flight, by file
};

// A blocking actor, so untyped: CAF 0.17 has no typed blocking actor. Its sends go
// to typed handles and are checked (messages_internal.hpp).
void reader(caf::blocking_actor* self, std::shared_ptr<Shared> shared, std::size_t lane,
            std::vector<CopyWorkerActor> workers, PrefetcherActor prefetcher,
            CoordinatorActor coordinator) {
  bool finished = false;
  try {
    ReadLoop loop(self, shared, lane, std::move(workers), std::move(prefetcher));
    finished = loop.run();
  } catch (...) {
    // A closed pool after an abort is the abort's echo, not a new error; fail()
    // keeps the first error anyway.
    shared->fail(std::current_exception(), Stage::kRead, "", "", "reader: ");
  }
  if (finished) {
    self->send(coordinator, ReaderDoneMsg{});
  }
}

}  // namespace

caf::actor spawn_reader(caf::local_actor* parent, std::shared_ptr<Shared> shared,
                        std::size_t lane, std::vector<CopyWorkerActor> workers,
                        PrefetcherActor prefetcher, CoordinatorActor coordinator) {
  return spawn_blocking(parent, "reader lane " + std::to_string(lane), reader, std::move(shared),
                        lane, std::move(workers), std::move(prefetcher), std::move(coordinator));
}

}  // namespace ferry::actors
