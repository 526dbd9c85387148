// The coordinator: spawns and monitors every actor of one load, decides when the
// load is complete, and turns the first error anywhere (or a cancel request) into
// an abort of everything.
//
//   coordinator ──spawns, monitors──► post-processor, copy workers, prefetcher,
//                                     a reader per read lane
//   readers ── ReaderDoneMsg ──► coordinator ◄── AllCompleteMsg ── post-processor
//   coordinator ── TickMsg ──► itself (every kTick: cancel requested? error recorded?)
//
// Complete: every lane's reader has read all its windows and the post-processor has counted
// every byte of every param (hook outputs included). Then every actor gets an exit
// message and the coordinator quits.
//
// Abort: an actor that fails records its error in Shared (first one wins) and
// stops; the coordinator learns it from the actor's down message or from its tick.
// A spawn that fails (an actor's thread the system refuses) is an abort too.
// It marks the load aborted (workers drop queued chunks, the reader issues no more
// reads), closes the staging pools (so a blocked acquire wakes), ends the streams'
// emulated waits (so a copy worker sleeping on a capped host link wakes), sends
// every actor an exit message and quits. run_pipeline then waits until every actor is gone.
#include <algorithm>
#include <caf/actor_cast.hpp>
#include <caf/actor_system.hpp>
#include <caf/behavior.hpp>
#include <caf/exit_reason.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/system_messages.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/messages_internal.hpp"

namespace ferry::actors {
namespace {

constexpr std::chrono::milliseconds kTick{5};

struct CoordinatorState;
using Self = CoordinatorActor::stateful_pointer<CoordinatorState>;

struct CoordinatorState {
  std::shared_ptr<Shared> shared;
  PostProcessorActor post_processor;
  std::vector<CopyWorkerActor> workers;
  PrefetcherActor prefetcher;
  std::vector<caf::actor> readers;  // one per read lane (blocking: untyped)
  std::size_t readers_done = 0;
  bool all_complete = false;
  bool finishing = false;

  // Sends every child an exit message (which needs no interface); a child not
  // spawned (a null handle) is skipped.
  void stop_children(Self self) {
    finishing = true;
    const auto stop = [self](const auto& child) {
      self->send_exit(child, caf::exit_reason::user_shutdown);
    };
    std::for_each(workers.begin(), workers.end(), stop);
    stop(post_processor);
    stop(prefetcher);
    std::for_each(readers.begin(), readers.end(), stop);
  }

  void abort(Self self) {
    shared->abort();
    shared->close_pools();
    shared->abandon_emulated_waits();
    stop_children(self);
    self->quit(caf::exit_reason::user_shutdown);
  }

  void maybe_finish(Self self) {
    if (finishing || readers_done < readers.size() || !all_complete) {
      return;
    }
    stop_children(self);
    self->quit();
  }

  std::string name_of(const caf::actor_addr& source) const {
    for (std::size_t l = 0; l < readers.size(); ++l) {
      if (source == readers[l].address()) {
        return "reader of read lane " + std::to_string(l);
      }
    }
    if (source == post_processor.address()) {
      return "post-processor";
    }
    if (source == prefetcher.address()) {
      return "prefetcher";
    }
    for (std::size_t r = 0; r < workers.size(); ++r) {
      if (source == workers[r].address()) {
        return "copy worker of local rank " + std::to_string(r);
      }
    }
    return "an unknown actor";
  }
};

// PipelineInput::fault_point, for tests: an exception thrown here is one of the
// coordinator's.
void fault_point(const CoordinatorState& st) {
  if (st.shared->input().fault_point) {
    st.shared->input().fault_point("coordinator");
  }
}

CoordinatorActor::behavior_type coordinator(Self self, std::shared_ptr<Shared> shared) {
  auto& st = self->state;
  st.shared = std::move(shared);
  // First: an exception before it would meet CAF's default handler, which prints
  // through aout (and crashes there when memory runs out).
  self->set_exception_handler([self](std::exception_ptr& ep) -> caf::error {
    self->state.shared->fail(ep, Stage::kCopy, "", "", "coordinator: ");
    self->state.abort(self);
    return caf::sec::runtime_error;
  });
  auto me = caf::actor_cast<CoordinatorActor>(self);
  try {
    st.post_processor = spawn_post_processor(self, st.shared, me);
    self->monitor(st.post_processor);
    for (std::size_t r = 0; r < st.shared->input().ranks.size(); ++r) {
      st.workers.push_back(spawn_copy_worker(self, st.shared, r, st.post_processor));
      self->monitor(st.workers.back());
    }
    self->send(st.post_processor, WorkersMsg{st.workers});
    if (st.shared->input().options.prefetch.enabled) {
      st.prefetcher = spawn_prefetcher(self, st.shared);
      self->monitor(st.prefetcher);
    }
    for (std::size_t l = 0; l < st.shared->lanes.size(); ++l) {
      st.readers.push_back(spawn_reader(self, st.shared, l, st.workers, st.prefetcher, me));
      self->monitor(st.readers.back());
    }
  } catch (...) {
    // An actor whose thread could not be started (Stage::kResources): the load
    // fails with that error, and the actors spawned so far are stopped like on
    // any abort (run_pipeline then waits for them).
    st.shared->fail(std::current_exception(), Stage::kCopy, "", "", "coordinator: ");
    st.abort(self);
    // No behavior: the actor has quit. (A typed behavior is empty only by this
    // constructor, which skips the interface check that an empty one has no use for.)
    using Behavior = CoordinatorActor::behavior_type;
    return Behavior{Behavior::unsafe_init{}, caf::behavior{}};
  }

  self->set_down_handler([self](caf::down_msg& dm) {
    auto& s = self->state;
    if (s.finishing) {
      return;
    }
    if (!s.shared->failed()) {
      // The reader quits normally after its last chunk; anything else that stops
      // before the load is complete is a bug, reported rather than waited on.
      if (!dm.reason && std::any_of(s.readers.begin(), s.readers.end(), [&](const caf::actor& r) {
            return dm.source == r.address();
          })) {
        return;
      }
      s.shared->fail(Error(Stage::kCopy, "", "",
                           "internal: the " + s.name_of(dm.source) +
                               " stopped before the load completed (" + caf::to_string(dm.reason) +
                               ")"));
    }
    s.abort(self);
  });
  self->send(self, TickMsg{});
  return {
      [self](ReaderDoneMsg) {
        fault_point(self->state);
        ++self->state.readers_done;
        self->state.maybe_finish(self);
      },
      [self](AllCompleteMsg) {
        fault_point(self->state);
        self->state.all_complete = true;
        self->state.maybe_finish(self);
      },
      [self](TickMsg) {
        auto& s = self->state;
        if (s.finishing) {
          return;
        }
        fault_point(s);
        if (s.shared->cancel_requested()) {
          s.shared->fail(Error(Stage::kCancelled, "", "", "the load was cancelled"));
        }
        if (s.shared->failed()) {
          s.abort(self);
          return;
        }
        self->delayed_send(self, kTick, TickMsg{});
      },
  };
}

}  // namespace

CoordinatorActor spawn_coordinator(caf::actor_system& system, std::shared_ptr<Shared> shared) {
  return system.spawn(coordinator, std::move(shared));
}

}  // namespace ferry::actors
