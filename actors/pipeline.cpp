// run_pipeline: one actor system per load. It creates the staging pool, starts the
// coordinator (which starts everything else), waits for it to stop, then waits for
// every actor to be gone before it tears the system down: a CAF actor handle that
// outlives its system hangs the system's destructor, so every handle lives inside
// the inner scope or inside an actor's state, which CAF destroys when the actor
// stops.
#include "actors/pipeline.hpp"

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/system_messages.hpp>
#include <exception>
#include <memory>

#include "actors/messages_internal.hpp"

namespace ferry::actors {

PipelineResult run_pipeline(const PipelineInput& input) {
  PipelineResult result;
  auto shared = std::make_shared<Shared>(input);
  try {
    if (input.plan == nullptr || input.model == nullptr || input.index == nullptr ||
        input.ranks.size() != input.model->shells().size()) {
      throw Error(Stage::kConfig, "", "",
                  "internal: run_pipeline needs a plan, a model, an index and one target per "
                  "local rank");
    }
    const PipelineOptions& o = input.options;
    shared->pool = std::make_shared<io::StagingPool>(
        o.staging_buffers, o.chunk_bytes,
        input.staging_allocator ? input.staging_allocator : io::aligned_host_allocator());
    if (input.on_staging) {
      shared->pool->observe(input.on_staging);
    }
    shared->pool->poison_on_return(o.poison_staging);
    {
      caf::actor_system_config config;
      // No cfg.parse(): an embedded library reads no argv or caf-application.ini.
      config.set("scheduler.max-threads", 2);
      // The scheduler's actors (coordinator, post-processor, prefetcher) handle a
      // few messages per second of loading; CAF's default busy-polls and then
      // sleeps 50 us at a time after every message, which on a small machine
      // preempts the reader and the copy workers (measured: half the load's
      // context switches). Idle workers go straight to their condition variable.
      config.set("work-stealing.aggressive-poll-attempts", 0);
      config.set("work-stealing.moderate-poll-attempts", 0);
      caf::actor_system system{config};
      {
        caf::scoped_actor self{system};
        caf::actor coordinator = spawn_coordinator(system, shared);
        self->monitor(coordinator);
        self->receive([](caf::down_msg&) {});
      }
      system.await_all_actors_done();
    }
  } catch (...) {
    shared->fail(to_error(std::current_exception(), Stage::kCopy, "", "", "pipeline: "));
  }
  result.error = shared->error();
  result.bytes_read = shared->bytes_read.load();
  result.bytes_copied = shared->progress().bytes_copied.load();
  result.bytes_prefetched = shared->bytes_prefetched.load();
  result.reads = shared->reads.load();
  result.total_seconds = shared->seconds_since_start();
  double stream_done = shared->stream_done_seconds.load();
  result.stream_seconds = stream_done >= 0 ? stream_done : result.total_seconds;
  result.landed = shared->landed();
  if (shared->pool) {
    result.staging_high_water_bytes = shared->pool->high_water() * shared->pool->buffer_bytes();
    result.staging_buffers_leased_at_end = shared->pool->in_use();
    shared->pool.reset();
  }
  return result;
}

}  // namespace ferry::actors
