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
// Every actor that takes ordinary messages is typed (caf::typed_actor, as CAF's
// typed_calculator example): its handle names the messages it accepts, so a send of
// any other message to it fails to compile (the static_asserts below prove a few).
// The reader is the exception: a blocking actor, which CAF 0.17 cannot type (it has
// no typed blocking actor), and which takes no ordinary message anyway (only the
// coordinator's exit); its own sends, to typed handles, are checked all the same.
//
// Every payload is copyable (CAF 0.17 requires it): staging buffers travel as
// shared_ptr<StagingBuffer>, so the buffer returns to its pool when the last copy
// worker that used it drops its reference. Per-sender ordering is what the
// protocol relies on: a worker sees each lane's EndOfStreamMsg after every chunk of
// that lane (both from its reader), and the post-processor sees a worker's DrainedMsg after all of
// its LandedMsgs (both from that worker).
//
// CAF 0.17 stores a message's payload in a type-erased value that can serialise it,
// so each type must be inspectable (inspect() and fields() below) or whitelisted
// as unsafe; only ChunkMsg is, since what it carries cannot be serialised. Each type
// also has a type ID (the block at the end): CAF 0.17.6 checks those only when
// asked (CAF_ENABLE_TYPE_ID_CHECKS, which ferry_actors sets), CAF 0.18 always.
// Nothing is announced (actor_system_config::add_message_type): CAF 0.17 needs that
// only to deserialise a type by name, and these messages never leave the process.
#pragma once

#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/fwd.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/replies_to.hpp>
#include <caf/response_type.hpp>
#include <caf/type_id.hpp>
#include <caf/typed_actor.hpp>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
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
  auto fields() { return std::tie(hook); }
};
// Copy worker to post-processor: bytes that have landed (copies complete on the
// device) per param of local rank `rank`.
struct LandedMsg {
  std::uint32_t rank = 0;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> bytes;
  auto fields() { return std::tie(rank, bytes); }
};
struct HookDoneMsg {
  std::uint32_t hook = 0;
  auto fields() { return std::tie(hook); }
};
// Copy worker to post-processor: every chunk of the stream has landed.
struct DrainedMsg {
  std::uint32_t rank = 0;
  auto fields() { return std::tie(rank); }
};
struct ReaderDoneMsg {};
struct AllCompleteMsg {};
// The coordinator to itself: check for a cancel request or a recorded error.
struct TickMsg {};
// Reader of lane `lane` to prefetcher: that lane has read its plan bytes up to
// `position`.
struct AdvanceMsg {
  std::uint32_t lane = 0;
  std::uint64_t position = 0;
  auto fields() { return std::tie(lane, position); }
};

// The actors' interfaces. A self-sent message (FlushMsg, TickMsg) is in its actor's
// interface too: CAF checks a typed actor's send to itself like any other.
using CopyWorkerActor = caf::typed_actor<caf::reacts_to<ChunkMsg>, caf::reacts_to<EndOfStreamMsg>,
                                         caf::reacts_to<FlushMsg>, caf::reacts_to<RunHookMsg>>;

// Coordinator to post-processor: the copy workers, by local rank.
struct WorkersMsg {
  std::vector<CopyWorkerActor> workers;
  auto fields() { return std::tie(workers); }
};

using PostProcessorActor =
    caf::typed_actor<caf::reacts_to<WorkersMsg>, caf::reacts_to<LandedMsg>,
                     caf::reacts_to<HookDoneMsg>, caf::reacts_to<DrainedMsg>>;
using CoordinatorActor = caf::typed_actor<caf::reacts_to<ReaderDoneMsg>,
                                          caf::reacts_to<AllCompleteMsg>, caf::reacts_to<TickMsg>>;
using PrefetcherActor = caf::typed_actor<caf::reacts_to<AdvanceMsg>>;
// The reader stays caf::actor: a blocking actor (see the top of this file).

// Whether an actor of handle type `Handle` accepts a message of type `Msg` (what
// CAF's send checks before it compiles).
template <class Handle, class Msg>
inline constexpr bool kAccepts = caf::response_type<caf::signatures_of_t<Handle>, Msg>::valid;

static_assert(kAccepts<CopyWorkerActor, ChunkMsg> && kAccepts<PostProcessorActor, LandedMsg> &&
              kAccepts<CoordinatorActor, ReaderDoneMsg> && kAccepts<PrefetcherActor, AdvanceMsg>);
// A message sent to the wrong actor does not compile: chunks go to copy workers only,
// landed bytes and hook results to the post-processor only, the end of a load to
// the coordinator only.
static_assert(!kAccepts<PostProcessorActor, ChunkMsg> && !kAccepts<PrefetcherActor, ChunkMsg>);
static_assert(!kAccepts<CopyWorkerActor, LandedMsg> && !kAccepts<CoordinatorActor, LandedMsg>);
static_assert(!kAccepts<CopyWorkerActor, HookDoneMsg> && !kAccepts<CopyWorkerActor, AdvanceMsg>);
static_assert(!kAccepts<PostProcessorActor, AllCompleteMsg> &&
              !kAccepts<CopyWorkerActor, ReaderDoneMsg>);
static_assert(!kAccepts<CoordinatorActor, RunHookMsg> && !kAccepts<PrefetcherActor, TickMsg>);
// An untyped handle accepts anything: what the typing above removes.
static_assert(kAccepts<caf::actor, LandedMsg>);

// Spawners (each actor's state stays private to its file). Children of the
// coordinator `parent`; the caller monitors them.
CopyWorkerActor spawn_copy_worker(caf::local_actor* parent, std::shared_ptr<Shared> shared,
                                  std::size_t rank, PostProcessorActor post_processor);
PostProcessorActor spawn_post_processor(caf::local_actor* parent, std::shared_ptr<Shared> shared,
                                        CoordinatorActor coordinator);
PrefetcherActor spawn_prefetcher(caf::local_actor* parent, std::shared_ptr<Shared> shared);
// The reader of read lane `lane` (Shared::lanes).
caf::actor spawn_reader(caf::local_actor* parent, std::shared_ptr<Shared> shared,
                        std::size_t lane, std::vector<CopyWorkerActor> workers,
                        PrefetcherActor prefetcher, CoordinatorActor coordinator);
CoordinatorActor spawn_coordinator(caf::actor_system& system, std::shared_ptr<Shared> shared);

}  // namespace ferry::actors

// ChunkMsg alone is whitelisted: its staging buffer is pinned host memory that a
// device copy may still be reading, and its window a pointer into this load's
// plan; neither has a meaning outside this process, so it is never serialised.
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(ferry::actors::ChunkMsg)

CAF_BEGIN_TYPE_ID_BLOCK(ferry_actors, caf::first_custom_type_id)
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::ChunkMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::EndOfStreamMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::FlushMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::RunHookMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::LandedMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::HookDoneMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::DrainedMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::WorkersMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::ReaderDoneMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::AllCompleteMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::TickMsg))
  CAF_ADD_TYPE_ID(ferry_actors, (ferry::actors::AdvanceMsg))
CAF_END_TYPE_ID_BLOCK(ferry_actors)

namespace ferry::actors {

// CAF's inspectors (serialisation, to_string), one for every message but ChunkMsg:
// the name its type ID gives it and its fields(), none for a tag.
template <class Inspector, class Msg>
  requires requires { caf::type_name<Msg>::value; } &&
           (std::is_empty_v<Msg> || requires(Msg& m) { m.fields(); })
typename Inspector::result_type inspect(Inspector& f, Msg& x) {
  const auto name = caf::meta::type_name(caf::type_name<Msg>::value);
  if constexpr (std::is_empty_v<Msg>) {
    return f(name);
  } else {
    return std::apply([&](auto&... field) { return f(name, field...); }, x.fields());
  }
}

}  // namespace ferry::actors
