// The copy worker: one per local rank, a detached actor (so one OS thread for its
// whole life) that binds its device once and drives that rank's stream (made, with
// its scratch, before the pipeline started: PreparedResources).
//
//   reader ── ChunkMsg ──► copy worker ── LandedMsg, DrainedMsg, HookDoneMsg ──► post-processor
//   post-processor ── RunHookMsg ──►     (FlushMsg to itself)
//
// A chunk's fragments are queued on the stream by actors::copy_fragment (1-D and
// pitched host-to-device copies; narrow rows gathered and casts run through device
// scratch, made with the stream before streaming started, and one kernel each),
// then an event is recorded and the chunk is parked with its staging buffer. The
// worker first releases every parked chunk whose event has already fired (on an
// uncapped host device, all of them); for the rest it sends itself a FlushMsg,
// queued behind whatever chunks are already waiting, so a busy worker queues
// several chunks before it waits. A flush waits for the oldest parked event only,
// releases what has completed and, while chunks stay parked, sends itself another.
// A staging buffer never returns to the pool while a copy may still read it, not
// even when a chunk fails half queued (the worker waits for the stream first).
// Zero fills (vocabulary padding) run once, before the first chunk.
//
// Landed bytes are batched: a LandedMsg per chunk woke a scheduler thread per
// chunk, and on a small machine those wake-ups preempted the reader and this
// worker (the load benchmark counted ~6 context switches per 1 MiB chunk). The
// worker counts its rank's bytes itself and reports them when kLandedBatchBytes
// have accumulated, at once when a param some post-load hook waits for is
// complete (or any param, when the embedder watches completions: a layer is then
// announced as its last param lands, not at the next batch), and before it
// reports a drain or runs a hook.
#include <algorithm>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "actors/fragment_copy.hpp"
#include "actors/messages_internal.hpp"
#include "actors/threads_internal.hpp"
#include "common/log.hpp"
#include "gpu/device.hpp"
#include "models/hooks.hpp"

namespace ferry::actors {
namespace {

using Landed = std::map<std::uint32_t, std::uint64_t>;

constexpr std::uint64_t kLandedBatchBytes = std::uint64_t{64} << 20;

// What `inner` adds to an error that already names its stage, `file` and `tensor`:
// its rule, after its own file and tensor where they differ (inner's what() would
// name a stage, file and tensor a second time).
std::string detail(const Error& inner, const std::string& file, const std::string& tensor) {
  std::string out;
  if (!inner.file().empty() && inner.file() != file) {
    out += inner.file() + ": ";
  }
  if (!inner.tensor().empty() && inner.tensor() != tensor) {
    out += "tensor '" + inner.tensor() + "': ";
  }
  return out + inner.rule();
}

std::vector<std::pair<std::uint32_t, std::uint64_t>> to_vector(const Landed& landed) {
  return {landed.begin(), landed.end()};
}

struct CopyWorkerState;
using Self = CopyWorkerActor::stateful_pointer<CopyWorkerState>;

struct CopyWorkerState {
  std::shared_ptr<Shared> shared;
  std::size_t rank = 0;
  PostProcessorActor post_processor;
  std::vector<models::PostLoadHook> hooks;
  // The rank's stream and its device scratch for casts, gathers
  // (actors/fragment_copy.hpp) and hooks: PreparedResources', made before the pipeline
  // started, so that streaming allocates and creates nothing (capture safety).
  gpu::Stream* stream = nullptr;
  gpu::DeviceAllocation* scratch = nullptr;
  struct Parked {
    std::unique_ptr<gpu::Event> done;
    std::shared_ptr<io::StagingBuffer> buf;
    Landed landed;
  };
  std::deque<Parked> parked;
  Landed pending;  // landed, not reported yet
  std::uint64_t pending_bytes = 0;
  std::vector<std::uint64_t> totals;  // bytes landed per param of this rank
  std::vector<bool> hook_input;       // a hook of this rank waits for the param
  // The params' storage: RankTarget's, plus the load-only params allocated on their
  // first write (PipelineInput::allocate_transient) and null again once released.
  std::vector<std::byte*> storage;
  // Per load-only param, the hooks of this rank still to read it (released at 0).
  std::vector<std::size_t> transient_readers;
  bool ready = false;
  bool flush_scheduled = false;
  std::size_t ends_seen = 0;  // EndOfStreamMsg, one from each read lane

  CopyWorkerState() = default;
  CopyWorkerState(const CopyWorkerState&) = delete;
  CopyWorkerState& operator=(const CopyWorkerState&) = delete;
  // Runs when the actor stops for any reason (done, aborted, failed). Queued
  // copies may still read staging buffers and write device memory: wait for them
  // before the buffers go back to the pool and before the caller frees the params.
  ~CopyWorkerState() {
    if (stream) {
      try {
        stream->synchronize();
      } catch (const std::exception& e) {
        log::write_built(
            log::Level::kWarn,
            [&] { return std::string("copy worker: synchronize at shutdown failed: ") + e.what(); },
            "copy worker: synchronize at shutdown failed");
      }
    }
    parked.clear();
  }

  const RankTarget& target() const { return shared->input().ranks[rank]; }
  gpu::Device& device() const { return *target().device; }
  std::string device_name() const { return target().device->name(); }

  // Binds the device on this thread and runs the rank's zero fills. Lazy, because
  // chunks (from the reader) and the first message from anyone else are not
  // ordered with respect to each other.
  void ensure_ready(Self self) {
    if (ready) {
      return;
    }
    ready = true;
    device().bind();
    PreparedResources::Rank& prepared = shared->resources->ranks.at(rank);
    stream = prepared.stream.get();
    scratch = &prepared.scratch;
    hooks = shared->model().hooks();
    const auto& shell = shared->model().shells()[rank];
    totals.assign(shell.params.size(), 0);
    hook_input.assign(shell.params.size(), false);
    storage = target().params;
    transient_readers.assign(shell.params.size(), 0);
    for (const models::PostLoadHook& h : hooks) {
      if (h.local_rank == rank) {
        for (std::size_t in : h.inputs) {
          transient_readers.at(in) += shell.params.at(in).transient ? 1 : 0;
        }
      }
    }
    for (const models::PostLoadHook& h : hooks) {
      if (h.local_rank == rank) {
        for (const auto& ids : {h.inputs, h.rewrites}) {
          for (std::size_t in : ids) {
            hook_input.at(in) = true;
          }
        }
      }
    }
    Landed landed;
    for (const models::Piece& p : shared->plan().fills) {
      if (p.local_rank != rank || p.kind != models::Piece::Kind::kZero) {
        continue;
      }
      std::byte* dst = param_data(p.param) + p.dst_offset;
      const std::uint64_t row = p.width_elems * dtype_size(p.dst_dtype);
      try {
        if (p.rows == 1 || p.dst_pitch == row) {
          stream->zero(dst, p.rows * row);
        } else {
          stream->zero_2d(dst, p.dst_pitch, row, p.rows);
        }
      } catch (const Error& e) {
        throw Error(Stage::kCopy, device_name(), shell.params[p.param].name,
                    "zero fill: " + detail(e, device_name(), shell.params[p.param].name));
      }
      landed[static_cast<std::uint32_t>(p.param)] += p.dst_bytes();
    }
    if (!landed.empty()) {
      stream->synchronize();
      add_landed(self, landed);
    }
  }

  // A param's storage, a load-only one's allocated on its first write (load.layered).
  std::byte* param_data(std::size_t param) {
    std::byte*& p = storage.at(param);
    const models::ParamSpec& spec = shared->model().shells()[rank].params[param];
    if (p == nullptr && spec.transient && spec.nbytes != 0) {
      const auto& allocate = shared->input().allocate_transient;
      if (!allocate) {
        throw Error(Stage::kCopy, device_name(), spec.name,
                    "internal: a load-only param has no storage and none can be allocated");
      }
      p = allocate(rank, param);
    }
    return p;
  }

  // After hook `hook` ran: the load-only params it read that no other hook of this
  // rank reads any more are released (load.layered).
  void release_read_transients(const models::PostLoadHook& hook) {
    const auto& release = shared->input().release_transient;
    for (std::size_t in : hook.inputs) {
      if (transient_readers.at(in) != 0 && --transient_readers[in] == 0 && release) {
        release(rank, in);
        storage[in] = nullptr;
      }
    }
  }

  // Counts bytes whose copies have completed; reports them in batches (see top).
  void add_landed(Self self, const Landed& landed) {
    const auto& params = shared->model().shells()[rank].params;
    const bool watched = static_cast<bool>(shared->input().on_param_complete);
    bool now = false;
    for (const auto& [param, bytes] : landed) {
      pending[param] += bytes;
      pending_bytes += bytes;
      totals[param] += bytes;
      now = now || ((hook_input[param] || watched) && totals[param] >= params[param].nbytes);
    }
    if (now || pending_bytes >= kLandedBatchBytes) {
      report_landed(self);
    }
  }

  void report_landed(Self self) {
    if (!pending.empty()) {
      self->send(post_processor, LandedMsg{static_cast<std::uint32_t>(rank), to_vector(pending)});
    }
    pending.clear();
    pending_bytes = 0;
  }

  // Queues every fragment of this rank in window `w`; returns the bytes per param.
  // A direct window (staging == nullptr) was read straight into its param
  // (actors::single_param_run): its fragments have landed, nothing is copied.
  Landed execute(const Window& w, const std::byte* staging) {
    Landed landed;
    const PipelineInput& input = shared->input();
    const auto& shell = shared->model().shells()[rank];
    for (std::uint32_t i = w.rank_begin[rank]; i < w.rank_begin[rank + 1]; ++i) {
      const Fragment& f = w.fragments[i];
      if (shared->aborted()) {
        break;
      }
      shared->check_cancel();
      const std::string& param = shell.params[f.param].name;
      try {
        if (input.before_copy) {
          input.before_copy(rank, param);
        }
        if (staging != nullptr) {
          copy_fragment(*stream, f, param_data(f.param), staging, scratch->data(),
                        scratch->size(), device().narrow_row_bytes());
        }
      } catch (...) {
        const io::TensorInfo& t = shared->index().tensors[f.tensor];
        Error e = to_error(std::current_exception(), Stage::kCopy, t.file, t.name, "");
        if (e.stage() == Stage::kCancelled) {
          throw e;
        }
        throw Error(
            e.stage(), t.file, t.name,
            "into parameter " + param + " on " + device_name() + ": " + detail(e, t.file, t.name));
      }
      landed[f.param] += f.dst_bytes();
      shared->progress().bytes_copied.fetch_add(f.dst_bytes(), std::memory_order_relaxed);
    }
    return landed;
  }

  // Waits for everything queued on the stream, on a failure path: an error of the
  // wait itself is logged, since the failure being reported comes first.
  void wait_for_stream() noexcept {
    try {
      stream->synchronize();
    } catch (const std::exception& e) {
      log::write_built(
          log::Level::kWarn,
          [&] {
            return std::string("copy worker: synchronize after a failed chunk failed: ") + e.what();
          },
          "copy worker: synchronize after a failed chunk failed");
    }
  }

  // Waits for every parked chunk, reports its bytes, releases its staging buffer.
  void flush(Self self) {
    while (!parked.empty()) {
      parked.front().done->synchronize();
      release_front(self);
    }
  }

  // Releases, oldest first and without waiting, the parked chunks whose copies have
  // already completed, so their buffers go back to the reader at once instead of
  // after every chunk queued before the flush (which left the reader idle while the
  // worker drained its queue, and then the worker idle while the reader refilled).
  void release_completed(Self self) {
    const bool early = shared->input().release_staging_early;  // a test's broken pipeline
    while (!parked.empty() && (early || parked.front().done->query())) {
      release_front(self);
    }
  }

  void release_front(Self self) {
    Landed landed = std::move(parked.front().landed);
    parked.pop_front();  // the last reference to the lease returns the buffer
    add_landed(self, landed);
  }

  // How a hook that declares `reallocates` gets new storage: through the runtime
  // (PipelineInput::reallocate), which keeps the old storage alive.
  models::ParamsHookContext::ReallocateParam reallocate_param(const models::PostLoadHook& hook) {
    const auto& realloc = shared->input().reallocate;
    if (!realloc || !hook.reallocates) {
      return {};
    }
    return [&realloc, r = rank](std::size_t param) { return realloc(r, param); };
  }

  void run_hook(std::uint32_t index) {
    const models::PostLoadHook& hook = hooks.at(index);
    try {
      shared->check_cancel();
      models::ParamsHookContext context(hook, storage, *stream, device_name(),
                                        reallocate_param(hook), {scratch->data(), scratch->size()});
      if (!target().device->holds_data()) {
        // Nothing to transform on a device that keeps no bytes (null): check that
        // every declared param exists on this rank, and skip (the report lists it).
        for (const auto& ids : {hook.inputs, hook.outputs, hook.rewrites}) {
          for (std::size_t param : ids) {
            context.param_data(param);
          }
        }
        return;
      }
      models::run_hook(hook, context, shared->input().on_hook);
      stream->synchronize();
    } catch (...) {
      Error e = to_error(std::current_exception(), Stage::kPostProcess, device_name(), "", "");
      if (e.stage() == Stage::kCancelled) {
        throw e;
      }
      throw Error(Stage::kPostProcess, device_name(), "",
                  "post-load hook '" + hook.name + "' failed: " + detail(e, device_name(), ""));
    }
  }
};

CopyWorkerActor::behavior_type copy_worker(Self self, std::shared_ptr<Shared> shared,
                                           std::size_t rank, PostProcessorActor post_processor) {
  self->state.shared = std::move(shared);
  self->state.rank = rank;
  self->state.post_processor = std::move(post_processor);
  self->set_exception_handler([self](std::exception_ptr& ep) -> caf::error {
    auto& st = self->state;
    st.shared->fail(ep, Stage::kCopy, st.device_name(), "", "copy worker: ");
    return caf::sec::runtime_error;
  });
  return {
      [self](ChunkMsg& msg) {
        auto& st = self->state;
        if (st.shared->aborted()) {
          return;  // dropping the message returns the buffer
        }
        st.ensure_ready(self);
        if (!msg.buf) {  // read straight into the param: landed, nothing to copy
          st.add_landed(self, st.execute(*msg.window, nullptr));
          return;
        }
        Landed landed;
        try {
          landed = st.execute(*msg.window, msg.buf->data());
        } catch (...) {
          // Fragments queued before the failure may still be reading the buffer,
          // which goes back to its pool (or is freed) with this message: wait for
          // them first.
          st.wait_for_stream();
          throw;
        }
        st.parked.push_back({st.stream->record(), std::move(msg.buf), std::move(landed)});
        st.release_completed(self);
        if (!st.parked.empty() && !st.flush_scheduled) {
          st.flush_scheduled = true;
          self->send(self, FlushMsg{});
        }
      },
      [self](FlushMsg) {
        // Waits for the oldest parked chunk only, then goes back to the mailbox:
        // chunks that arrived meanwhile are queued on the stream before the next
        // wait, so the copy engine (or the host backend's emulated link) never
        // runs dry while this worker sleeps.
        auto& st = self->state;
        st.flush_scheduled = false;
        if (!st.parked.empty()) {
          st.parked.front().done->synchronize();
          st.release_completed(self);
        }
        if (!st.parked.empty()) {
          st.flush_scheduled = true;
          self->send(self, FlushMsg{});
        }
      },
      [self](EndOfStreamMsg) {
        auto& st = self->state;
        if (st.shared->aborted() || ++st.ends_seen < st.shared->lanes.size()) {
          return;  // another lane is still reading
        }
        st.ensure_ready(self);
        st.flush(self);
        st.report_landed(self);
        self->send(st.post_processor, DrainedMsg{static_cast<std::uint32_t>(st.rank)});
      },
      [self](RunHookMsg msg) {
        auto& st = self->state;
        if (st.shared->aborted()) {
          return;
        }
        st.ensure_ready(self);
        st.flush(self);
        st.report_landed(self);
        st.run_hook(msg.hook);
        st.release_read_transients(st.hooks.at(msg.hook));
        self->send(st.post_processor, HookDoneMsg{msg.hook});
      },
  };
}

}  // namespace

CopyWorkerActor spawn_copy_worker(caf::local_actor* parent, std::shared_ptr<Shared> shared,
                                  std::size_t rank, PostProcessorActor post_processor) {
  return spawn_detached<CopyWorkerActor, CopyWorkerState>(
      parent, "copy worker rank " + std::to_string(rank),
      [shared = std::move(shared), rank,
       post_processor = std::move(post_processor)](Self self) mutable {
        return copy_worker(self, std::move(shared), rank, std::move(post_processor));
      });
}

}  // namespace ferry::actors
