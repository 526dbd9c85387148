// The threads of a load's actor system, each started through the thread-start seam
// (common/thread_start.hpp), so that one the system refuses becomes
// "resources: could not start thread NAME" and nothing is left running or counted.
//
//  - LoadSchedulerThreads: the actor system's scheduler. CAF 0.17's own coordinator
//    starts its workers, its clock thread and a printer actor's thread inside
//    caf::actor_system's constructor, and a failed start there destroys running,
//    joinable std::threads (std::terminate); nor can that constructor be unwound
//    at all (it crashes in ~actor_registry). ferry's starts its threads through
//    the seam before the actor system exists, and hands them over.
//  - spawn_detached() / spawn_blocking(): an actor on a thread of its own. CAF 0.17
//    counts such an actor (registry, detached threads) before std::thread is
//    created and never uncounts it when creation fails, so await_all_actors_done()
//    and ~actor_system() waited forever; these undo the counts and turn the failure
//    into the Error, thrown to the spawner (the coordinator), which stops the rest.
#pragma once

#include <caf/actor.hpp>
#include <caf/actor_registry.hpp>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/blocking_actor.hpp>
#include <caf/config.hpp>
#include <caf/local_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <utility>

#include "common/thread_start.hpp"

// The undo below matches what CAF 0.17.6 counts before it creates a detached
// actor's thread (found by failing pthread_create under it; the attack suite's
// AttackThreads.EveryRealThreadStartFails repeats that). Check again on another CAF.
static_assert(CAF_VERSION == 1706, "re-check spawn_detached/spawn_blocking against this CAF");

namespace ferry::actors {

// The scheduler of a load's actor system: `workers` worker threads ("scheduler
// worker N") and a clock thread ("scheduler clock"), started here, before the
// actor system exists (Error(Stage::kResources) when one is refused, the others
// stopped and joined), and waiting for the scheduler that use_in() puts into
// `config` in place of CAF's. Must outlive the actor system made from `config`.
class LoadSchedulerThreads {
 public:
  explicit LoadSchedulerThreads(std::size_t workers);
  ~LoadSchedulerThreads();
  LoadSchedulerThreads(const LoadSchedulerThreads&) = delete;
  LoadSchedulerThreads& operator=(const LoadSchedulerThreads&) = delete;

  void use_in(caf::actor_system_config& config);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// What a detached actor's thread runs first: the body that holds the actor's
// arguments. Kept apart so that a spawn whose thread never starts can drop them
// (CAF 0.17 keeps the unstarted actor itself alive: its private_thread holds a
// reference; about 1 KB, never ferry's resources). `Handle` is the actor's typed
// handle (caf::typed_actor), `State` its state.
template <class Handle, class State>
struct DetachedLaunch {
  using Self = typename Handle::template stateful_pointer<State>;
  std::function<typename Handle::behavior_type(Self)> body;
};

template <class Handle, class State>
typename Handle::behavior_type run_detached_launch(
    typename DetachedLaunch<Handle, State>::Self self,
    std::shared_ptr<DetachedLaunch<Handle, State>> launch) {
  auto body = std::move(launch->body);
  launch->body = nullptr;
  return body(self);
}

// Spawns `body` (a function of Handle::stateful_pointer<State>) as a detached actor
// of `parent`, on a thread named `name`. Throws Error(Stage::kResources) when the
// thread cannot be started.
template <class Handle, class State, class Body>
Handle spawn_detached(caf::local_actor* parent, const std::string& name, Body body) {
  try {
    check_thread_start(name);
  } catch (const std::system_error& e) {
    throw thread_start_failed(name, e);
  }
  auto launch = std::make_shared<DetachedLaunch<Handle, State>>();
  launch->body = std::move(body);
  try {
    return parent->spawn<caf::detached>(run_detached_launch<Handle, State>, launch);
  } catch (const std::system_error& e) {
    // CAF registered the actor as running and counted a detached thread before
    // std::thread failed.
    parent->home_system().registry().dec_running();
    parent->home_system().dec_detached_threads();
    launch->body = nullptr;
    throw thread_start_failed(name, e);
  }
}

// Spawns the blocking actor `fun(self, args...)` (untyped: CAF 0.17 has no typed blocking
// actor; CAF gives each its own thread) on a thread named `name`. Throws
// Error(Stage::kResources) when the thread cannot be started.
template <class Fun, class... Ts>
caf::actor spawn_blocking(caf::local_actor* parent, const std::string& name, Fun fun,
                          Ts&&... args) {
  try {
    check_thread_start(name);
  } catch (const std::system_error& e) {
    throw thread_start_failed(name, e);
  }
  try {
    return parent->spawn(fun, std::forward<Ts>(args)...);
  } catch (const std::system_error& e) {
    // CAF counted a detached thread before std::thread failed (a blocking actor
    // registers as running on its own thread, so that count did not move); the
    // actor and its arguments went with the failed thread's state.
    parent->home_system().dec_detached_threads();
    throw thread_start_failed(name, e);
  }
}

}  // namespace ferry::actors
