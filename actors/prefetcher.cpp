// The prefetcher actor: runs io::Prefetcher (page-cache warm-up threads) over the
// weight files in plan order, no further than `ahead_bytes` past the reader, whose
// position arrives as AdvanceMsg. Detached, because stopping the prefetch joins
// its threads, which may take one block read: that wait must not hold one of the
// two scheduler threads. A prefetch never fails a load: a failure is logged.
//
//   reader ── AdvanceMsg{plan position} ──► prefetcher
#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/messages_internal.hpp"
#include "common/log.hpp"
#include "io/prefetch.hpp"

namespace ferry::actors {
namespace {

struct PrefetcherState {
  std::shared_ptr<Shared> shared;
  std::unique_ptr<io::Prefetcher> prefetcher;

  PrefetcherState() = default;
  PrefetcherState(const PrefetcherState&) = delete;
  PrefetcherState& operator=(const PrefetcherState&) = delete;
  ~PrefetcherState() {
    if (prefetcher) {
      prefetcher->stop(std::chrono::seconds(10));
      shared->bytes_prefetched.store(prefetcher->bytes_prefetched());
      prefetcher.reset();
    }
  }
};

caf::behavior prefetcher(caf::stateful_actor<PrefetcherState>* self,
                         std::shared_ptr<Shared> shared) {
  auto& st = self->state;
  st.shared = std::move(shared);
  const PipelineOptions& o = st.shared->input().options;
  // Only the planned ranges, never whole files (what the ranks do not read is not
  // warmed either).
  std::vector<io::PrefetchFile> files =
      planned_prefetch_files(st.shared->plan(), st.shared->index());
  io::PrefetchOptions options;
  options.threads = o.prefetch_threads;
  options.block_bytes = o.prefetch_block_bytes;
  options.ahead_bytes = o.prefetch_ahead_bytes;
  options.on_block_read = st.shared->input().on_prefetch_block;
  try {
    st.prefetcher = std::make_unique<io::Prefetcher>(std::move(files), options);
  } catch (const std::exception& e) {
    log::warn(std::string("prefetch disabled: ") + e.what());
  }
  return {
      [self](AdvanceMsg msg) {
        if (self->state.prefetcher) {
          self->state.prefetcher->advance(msg.position);
        }
      },
  };
}

}  // namespace

caf::actor spawn_prefetcher(caf::event_based_actor* parent, std::shared_ptr<Shared> shared) {
  return parent->spawn<caf::detached>(prefetcher, std::move(shared));
}

}  // namespace ferry::actors
