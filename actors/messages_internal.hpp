// The messages of the load pipeline and the functions that spawn its actors.
// Internal to actors/ (it includes CAF).
//
// Message flow (one load):
//
//   coordinator ──spawns, monitors──► reader × lanes, copy worker × ranks, post-processor,
//        ▲  ▲                         prefetcher (when enabled)
//        │  └── AllCompleteMsg ─────── post-processor ◄── LandedMsg, HookDoneMsg,
//        │                                 │              DrainedMsg ── copy workers
//        └──── ReaderDoneMsg ─── readers   └── RunHookMsg ──────────────►  ▲
//                                  │                                       │
//                                  ├── ChunkMsg{staging lease, window} ────┤
//                                  ├── EndOfStreamMsg (after the last) ────┘
//                                  └── AdvanceMsg{plan position} ──► prefetcher
//
// Every payload is copyable (CAF 0.17 requires it): staging buffers travel as
// shared_ptr<StagingBuffer>, so the buffer returns to its pool when the last copy
// worker that used it drops its reference. Per-sender ordering is what the
// protocol relies on: a worker sees each lane's EndOfStreamMsg after every chunk of
// that lane (both from its reader), and the post-processor sees a worker's DrainedMsg after all of
// its LandedMsgs (both from that worker).
#pragma once

#include <caf/actor.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/fwd.hpp>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "actors/shared_internal.hpp"
#include "io/staging_pool.hpp"

namespace ferry::actors {

// One completed read: the staging buffer holding `window`, which the reader cut
// from the plan just before reading it (shared by every worker it goes to, and
// freed with the last of them). A null buffer: the window was read straight into
// its one fragment's param (Window::direct).
struct ChunkMsg {
  std::shared_ptr<io::StagingBuffer> buf;
  std::shared_ptr<const Window> window;
};
// A read lane sent every chunk; after one from every lane the worker flushes and
// reports DrainedMsg.
struct EndOfStreamMsg {};
// A copy worker to itself: wait for queued copies and release their buffers.
struct FlushMsg {};
// Post-processor to a copy worker: run hook `hook` (index into Model::hooks()).
struct RunHookMsg {
  std::uint32_t hook = 0;
};
// Copy worker to post-processor: bytes that have landed (copies complete on the
// device) per param of local rank `rank`.
struct LandedMsg {
  std::uint32_t rank = 0;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> bytes;
};
struct HookDoneMsg {
  std::uint32_t hook = 0;
};
// Copy worker to post-processor: every chunk of the stream has landed.
struct DrainedMsg {
  std::uint32_t rank = 0;
};
// Coordinator to post-processor: the copy workers, by local rank.
struct WorkersMsg {
  std::vector<caf::actor> workers;
};
struct ReaderDoneMsg {};
struct AllCompleteMsg {};
struct TickMsg {};
// Reader of lane `lane` to prefetcher: that lane has read its plan bytes up to
// `position`.
struct AdvanceMsg {
  std::uint32_t lane = 0;
  std::uint64_t position = 0;
};

// Spawners (each actor's state stays private to its file). Children of the
// coordinator `parent`; the caller monitors them.
caf::actor spawn_copy_worker(caf::event_based_actor* parent, std::shared_ptr<Shared> shared,
                             std::size_t rank, caf::actor post_processor);
caf::actor spawn_post_processor(caf::event_based_actor* parent, std::shared_ptr<Shared> shared,
                                caf::actor coordinator);
caf::actor spawn_prefetcher(caf::event_based_actor* parent, std::shared_ptr<Shared> shared);
// The reader of read lane `lane` (Shared::lanes).
caf::actor spawn_reader(caf::event_based_actor* parent, std::shared_ptr<Shared> shared,
                        std::size_t lane, std::vector<caf::actor> workers, caf::actor prefetcher,
                        caf::actor coordinator);
caf::actor spawn_coordinator(caf::actor_system& system, std::shared_ptr<Shared> shared);

}  // namespace ferry::actors

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::ChunkMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::EndOfStreamMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::FlushMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::RunHookMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::LandedMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::HookDoneMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::DrainedMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::WorkersMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::ReaderDoneMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::AllCompleteMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::TickMsg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::AdvanceMsg)
