// The prefetcher actor: runs an io::Prefetcher (page-cache warm-up threads) per read
// lane over that lane's planned ranges in plan order, no further than its share of
// `ahead_bytes` past the lane's reader, whose position arrives as AdvanceMsg. Detached, because
// stopping the prefetch joins its threads, which may take one block read: that wait must not hold
// one of the two scheduler threads. A prefetch never fails a load: a failure is logged.
//
//   reader ── AdvanceMsg{plan position} ──► prefetcher
#include <algorithm>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/messages_internal.hpp"
#include "actors/threads_internal.hpp"
#include "common/log.hpp"
#include "io/prefetch.hpp"

namespace ferry::actors {
namespace {

struct PrefetcherState {
  std::shared_ptr<Shared> shared;
  std::vector<std::unique_ptr<io::Prefetcher>> lanes;  // by read lane; null: disabled

  PrefetcherState() = default;
  PrefetcherState(const PrefetcherState&) = delete;
  PrefetcherState& operator=(const PrefetcherState&) = delete;
  ~PrefetcherState() {
    for (auto& p : lanes) {
      if (p) {
        p->cancel();  // all lanes stop at once, then each is joined
      }
    }
    std::uint64_t bytes = 0;
    for (auto& p : lanes) {
      if (p) {
        p->stop(std::chrono::seconds(10));
        bytes += p->bytes_prefetched();
        p.reset();
      }
    }
    shared->bytes_prefetched.store(bytes);
  }
};

using Self = PrefetcherActor::stateful_pointer<PrefetcherState>;

PrefetcherActor::behavior_type prefetcher(Self self, std::shared_ptr<Shared> shared) {
  auto& st = self->state;
  st.shared = std::move(shared);
  // Prefetch is best effort per lane (below), but an exception out of the actor
  // (memory running out) fails the load cleanly: without this handler it would meet
  // CAF's default one, which prints through aout and crashes there.
  self->set_exception_handler([self](std::exception_ptr& ep) -> caf::error {
    self->state.shared->fail(ep, Stage::kRead, "", "", "prefetcher: ");
    return caf::sec::runtime_error;
  });
  const PipelineOptions& o = st.shared->input().options;
  const std::size_t lanes = st.shared->lanes.size();
  for (std::size_t l = 0; l < lanes; ++l) {
    const auto spans = st.shared->lanes[l].spans;
    // Only the lane's planned ranges, never whole files (what the ranks do not read
    // is not warmed either); the threads and the lead are shared among the lanes.
    io::PrefetchOptions options;
    options.threads = std::max<unsigned>(1, o.prefetch.threads / static_cast<unsigned>(lanes));
    options.block_bytes = o.prefetch.block_bytes;
    options.ahead_bytes = o.prefetch.ahead_bytes == 0
                              ? 0
                              : std::max<std::uint64_t>(1, o.prefetch.ahead_bytes / lanes);
    options.on_block_read = st.shared->input().on_prefetch_block;
    try {
      auto p = std::make_unique<io::Prefetcher>(
          planned_prefetch_files(st.shared->plan(), st.shared->index(), spans), options);
      // The lane starts reading here: its lead counts from this point.
      p->advance(lane_plan_begin(st.shared->plan(), spans));
      st.lanes.push_back(std::move(p));
    } catch (const std::exception& e) {
      log::warn(std::string("prefetch of read lane ") + std::to_string(l) +
                " disabled: " + e.what());
      st.lanes.emplace_back();
    }
  }
  return {
      [self](AdvanceMsg msg) {
        auto& prefetchers = self->state.lanes;
        if (msg.lane < prefetchers.size() && prefetchers[msg.lane]) {
          prefetchers[msg.lane]->advance(msg.position);
        }
      },
  };
}

}  // namespace

PrefetcherActor spawn_prefetcher(caf::local_actor* parent, std::shared_ptr<Shared> shared) {
  return spawn_detached<PrefetcherActor, PrefetcherState>(
      parent, "prefetcher", [shared = std::move(shared)](Self self) mutable {
        return prefetcher(self, std::move(shared));
      });
}

}  // namespace ferry::actors
