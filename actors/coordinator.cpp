// The coordinator: spawns and monitors every actor of one load, decides when the
// load is complete, and turns the first error anywhere (or a cancel request) into
// an abort of everything.
//
//   coordinator ──spawns, monitors──► post-processor, copy workers, prefetcher, reader
//   reader ── ReaderDoneMsg ──► coordinator ◄── AllCompleteMsg ── post-processor
//   coordinator ── TickMsg ──► itself (every kTick: cancel requested? error recorded?)
//
// Complete: the reader has read every window and the post-processor has counted
// every byte of every param (hook outputs included). Then every actor gets an exit
// message and the coordinator quits.
//
// Abort: an actor that fails records its error in Shared (first one wins) and
// stops; the coordinator learns it from the actor's down message or from its tick.
// It marks the load aborted (workers drop queued chunks, the reader issues no more
// reads), closes the staging pool (so a blocked acquire wakes), sends every actor
// an exit message and quits. run_pipeline then waits until every actor is gone.
#include <caf/actor_cast.hpp>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/exit_reason.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/system_messages.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/messages_internal.hpp"

namespace ferry::actors {
namespace {

constexpr std::chrono::milliseconds kTick{5};

struct CoordinatorState {
  std::shared_ptr<Shared> shared;
  caf::actor post_processor;
  std::vector<caf::actor> workers;
  caf::actor prefetcher;
  caf::actor reader;
  bool reader_done = false;
  bool all_complete = false;
  bool finishing = false;

  std::vector<caf::actor> children() const {
    std::vector<caf::actor> out = workers;
    for (const caf::actor& a : {post_processor, prefetcher, reader}) {
      if (a) {
        out.push_back(a);
      }
    }
    return out;
  }

  void stop_children(caf::event_based_actor* self) {
    finishing = true;
    for (const caf::actor& a : children()) {
      self->send_exit(a, caf::exit_reason::user_shutdown);
    }
  }

  void abort(caf::event_based_actor* self) {
    shared->abort();
    if (shared->pool) {
      shared->pool->close();
    }
    stop_children(self);
    self->quit(caf::exit_reason::user_shutdown);
  }

  void maybe_finish(caf::event_based_actor* self) {
    if (finishing || !reader_done || !all_complete) {
      return;
    }
    stop_children(self);
    self->quit();
  }

  std::string name_of(const caf::actor_addr& source) const {
    if (source == reader.address()) {
      return "reader";
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

caf::behavior coordinator(caf::stateful_actor<CoordinatorState>* self,
                          std::shared_ptr<Shared> shared) {
  auto& st = self->state;
  st.shared = std::move(shared);
  caf::actor me = caf::actor_cast<caf::actor>(self);
  st.post_processor = spawn_post_processor(self, st.shared, me);
  self->monitor(st.post_processor);
  for (std::size_t r = 0; r < st.shared->input().ranks.size(); ++r) {
    st.workers.push_back(spawn_copy_worker(self, st.shared, r, st.post_processor));
    self->monitor(st.workers.back());
  }
  self->send(st.post_processor, WorkersMsg{st.workers});
  if (st.shared->input().options.prefetch) {
    st.prefetcher = spawn_prefetcher(self, st.shared);
    self->monitor(st.prefetcher);
  }
  st.reader = spawn_reader(self, st.shared, st.workers, st.prefetcher, me);
  self->monitor(st.reader);

  self->set_down_handler([self](caf::down_msg& dm) {
    auto& s = self->state;
    if (s.finishing) {
      return;
    }
    if (!s.shared->failed()) {
      // The reader quits normally after its last chunk; anything else that stops
      // before the load is complete is a bug, reported rather than waited on.
      if (dm.source == s.reader.address() && !dm.reason) {
        return;
      }
      s.shared->fail(Error(Stage::kCopy, "", "",
                           "internal: the " + s.name_of(dm.source) +
                               " stopped before the load completed (" + caf::to_string(dm.reason) +
                               ")"));
    }
    s.abort(self);
  });
  self->set_exception_handler([self](std::exception_ptr& ep) -> caf::error {
    self->state.shared->fail(to_error(ep, Stage::kCopy, "", "", "coordinator: "));
    self->state.abort(self);
    return caf::sec::runtime_error;
  });
  self->send(self, TickMsg{});
  return {
      [self](ReaderDoneMsg) {
        self->state.reader_done = true;
        self->state.maybe_finish(self);
      },
      [self](AllCompleteMsg) {
        self->state.all_complete = true;
        self->state.maybe_finish(self);
      },
      [self](TickMsg) {
        auto& s = self->state;
        if (s.finishing) {
          return;
        }
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

caf::actor spawn_coordinator(caf::actor_system& system, std::shared_ptr<Shared> shared) {
  return system.spawn(coordinator, std::move(shared));
}

}  // namespace ferry::actors
