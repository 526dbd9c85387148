// run_pipeline: one actor system per load. It splits the plan among the read lanes
// and creates each lane's staging pool, starts the
// coordinator (which starts everything else), waits for it to stop, then waits for
// every actor to be gone before it tears the system down: a CAF actor handle that
// outlives its system hangs the system's destructor, so every handle lives inside
// the inner scope or inside an actor's state, which CAF destroys when the actor
// stops.
#include "actors/pipeline.hpp"

#include <algorithm>
#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/system_messages.hpp>
#include <caf/thread_hook.hpp>
#include <exception>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "actors/fragment_copy.hpp"
#include "actors/messages_internal.hpp"
#include "actors/threads_internal.hpp"
#include "common/log.hpp"
#include "io/file.hpp"
#include "io/numa.hpp"

namespace ferry::actors {
namespace {

// Sets a log sink on each thread an actor system starts, for the thread's life
// (CAF calls both hooks on the thread itself, detached actors' threads included).
class LogSinkHook final : public caf::thread_hook {
 public:
  explicit LogSinkHook(std::shared_ptr<const log::Sink> sink) : sink_(std::move(sink)) {}
  void init(caf::actor_system&) override {}
  void thread_started() override { previous() = log::exchange_thread_sink(&sink_); }
  void thread_terminates() override { log::exchange_thread_sink(previous()); }

 private:
  // A plain pointer: a thread_local with a destructor would make glibc allocate on
  // each new thread, and abort the process when that fails (under ulimit -v).
  static const std::shared_ptr<const log::Sink>*& previous() {
    thread_local const std::shared_ptr<const log::Sink>* p = nullptr;
    return p;
  }
  std::shared_ptr<const log::Sink> sink_;
};

constexpr std::size_t kStagingPerRank = std::size_t{8} << 20;

// Param bytes per local rank that the spans of `lane` feed (a tensor split over
// several spans counts once per span: a weight, not a byte count).
std::vector<unsigned long long> lane_rank_bytes(const Plan& plan,
                                                std::pair<std::size_t, std::size_t> lane) {
  std::vector<unsigned long long> bytes(plan.local_ranks, 0);
  for (std::size_t i = lane.first; i < lane.second; ++i) {
    for (const models::Piece& p : plan.routes[plan.spans[i].route].pieces) {
      bytes.at(p.local_rank) += p.dst_bytes();
    }
  }
  return bytes;
}

// How many lanes, their spans, and each one's staging pool (on its devices' NUMA
// node where the system has several): the staging budget split evenly.
void make_lanes(const PipelineInput& input, PreparedResources& out) {
  const PipelineOptions& o = input.options;
  const Plan& plan = *input.plan;
  const std::size_t budget = o.io.staging_bytes != 0
                                 ? o.io.staging_bytes
                                 : kStagingPerRank * std::max<std::size_t>(1, plan.local_ranks);
  const std::size_t buffer_bytes =
      (o.io.chunk_bytes + io::kDirectAlignment - 1) / io::kDirectAlignment * io::kDirectAlignment;
  const std::size_t buffers = buffer_bytes == 0 ? 0 : budget / buffer_bytes;
  if (buffers == 0) {
    throw Error(Stage::kConfig, "", "",
                "io.staging_bytes (" + std::to_string(budget) + ") holds no staging buffer of " +
                    "io.chunk_bytes (" + std::to_string(buffer_bytes) + " after rounding to " +
                    std::to_string(io::kDirectAlignment) +
                    "): raise io.staging_bytes or lower io.chunk_bytes");
  }
  if (o.io.direct_to_device == io::DirectToDevice::kOn &&
      std::none_of(input.ranks.begin(), input.ranks.end(),
                   [](const RankTarget& t) { return t.device->host_addressable(); })) {
    std::string names;
    for (const RankTarget& t : input.ranks) {
      names += (names.empty() ? "" : ", ") + t.device->name();
    }
    throw Error(Stage::kConfig, names, "",
                "io.direct_to_device=on, but no local device can take reads into its memory "
                "(GPUs without mapped host memory, host devices with a bandwidth cap and null "
                "devices cannot); use auto or off");
  }
  const std::size_t cores = std::max(1u, std::thread::hardware_concurrency());
  std::size_t lanes = o.io.read_lanes;
  if (lanes == 0) {
    const std::size_t files =
        o.lanes_follow_files ? std::max<std::size_t>(1, files_read(plan)) : cores;
    lanes = std::min({cores, files, std::max<std::size_t>(1, o.max_auto_lanes),
                      std::max<std::size_t>(1, buffers / 2)});
  }
  lanes = std::min(lanes, buffers);
  std::vector<std::pair<std::size_t, std::size_t>> spans =
      lane_spans(plan, static_cast<unsigned>(lanes));
  if (spans.empty()) {
    spans.emplace_back(0, 0);  // nothing to read: one lane that reads nothing
  }
  const std::size_t per_lane = buffers / spans.size();
  // Single-copy reads move the copy onto the reader's thread. With one lane on a
  // machine of several cores that loses the copy worker's second thread, which is
  // worth more than the saved copy (docs/PERFORMANCE.md, read width: 6.1 against
  // 5.0 GB/s on 2 cores), so auto takes them with two lanes or more, or one core.
  out.single_copy =
      o.io.direct_to_device == io::DirectToDevice::kOn ||
      (o.io.direct_to_device == io::DirectToDevice::kAuto && (spans.size() >= 2 || cores == 1));
  const std::vector<int> nodes = io::numa_nodes();
  const auto base =
      input.staging_allocator ? input.staging_allocator : io::aligned_host_allocator();
  std::vector<int> rank_nodes;  // each local rank's device's node
  for (const RankTarget& t : input.ranks) {
    rank_nodes.push_back(nodes.size() > 1 ? t.device->numa_node() : -1);
  }
  for (std::size_t l = 0; l < spans.size(); ++l) {
    std::shared_ptr<io::BufferAllocator> allocator = base;
    if (nodes.size() > 1) {
      const int node = io::preferred_numa_node(lane_rank_bytes(plan, spans[l]), rank_nodes);
      if (node >= 0) {
        allocator = input.staging_allocator_on_node ? input.staging_allocator_on_node(node)
                                                    : io::numa_allocator(base, node);
      }
    }
    PreparedResources::Lane& lane = out.lanes.emplace_back();
    lane.spans = spans[l];
    lane.pool = std::make_shared<io::StagingPool>(per_lane, o.io.chunk_bytes, allocator);
    lane.pool->poison_on_return(o.poison_staging);
  }
}

// The staging gauge sees the sum over the lanes' pools.
void observe_lanes(Shared& shared) {
  const auto& observer = shared.input().on_staging;
  if (!observer) {
    return;
  }
  auto in_use = std::make_shared<std::vector<std::atomic<std::size_t>>>(shared.lanes.size());
  for (std::size_t l = 0; l < shared.lanes.size(); ++l) {
    shared.lanes[l].pool->observe([in_use, l, observer](std::size_t n) {
      (*in_use)[l].store(n);
      std::size_t total = 0;
      for (const auto& count : *in_use) {
        total += count.load();
      }
      observer(total);
    });
  }
}

// Events a copy worker may hold at once: one per staging buffer of every lane
// (each parked chunk), one for a synchronize() and one spare.
std::size_t events_in_flight(const PreparedResources& r) {
  std::size_t buffers = 0;
  for (const PreparedResources::Lane& lane : r.lanes) {
    buffers += lane.pool->count();
  }
  return buffers + 2;
}

}  // namespace

std::uint64_t worker_scratch_bytes(const PipelineInput& input, std::size_t rank) {
  // Copies and this rank's post-load hooks share it: both queue on the one stream,
  // in order. A hook must not allocate while it runs (it may run during a capture).
  std::uint64_t bytes =
      rank_scratch_bytes(*input.plan, rank, input.ranks.at(rank).device->narrow_row_bytes());
  for (const models::PostLoadHook& h : input.model->hooks()) {
    if (h.local_rank == rank) {
      bytes = std::max<std::uint64_t>(bytes, h.scratch_bytes);
    }
  }
  return bytes;
}

std::shared_ptr<PreparedResources> prepare_resources(const PipelineInput& input) {
  if (input.plan == nullptr || input.model == nullptr || input.index == nullptr ||
      input.ranks.size() != input.model->shells().size()) {
    throw Error(Stage::kConfig, "", "",
                "internal: the pipeline needs a plan, a model, an index and one target per "
                "local rank");
  }
  auto out = std::make_shared<PreparedResources>();
  make_lanes(input, *out);
  // Each device's event pool, for every worker on it (usually one).
  std::map<gpu::Device*, std::size_t> events;
  for (std::size_t r = 0; r < input.ranks.size(); ++r) {
    gpu::Device& device = *input.ranks[r].device;
    PreparedResources::Rank& rank = out->ranks.emplace_back();
    try {
      rank.stream = device.create_stream();
    } catch (...) {
      const Error e = to_error(std::current_exception(), Stage::kCopy, device.name(), "", "");
      throw Error(e.stage(), device.name(), "", "creating the copy worker's stream: " + e.rule());
    }
    const std::uint64_t bytes = worker_scratch_bytes(input, r);
    try {
      rank.scratch = device.allocate(bytes);
    } catch (const Error& e) {
      throw Error(Stage::kCopy, device.name(), "",
                  "allocating " + std::to_string(bytes) + " bytes of copy scratch: " + e.rule());
    }
    events[&device] += events_in_flight(*out);
  }
  for (const auto& [device, count] : events) {
    device->reserve_events(count);
  }
  return out;
}

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
    shared->resources = input.prepared ? input.prepared : prepare_resources(input);
    if (shared->resources->ranks.size() != input.ranks.size()) {
      throw Error(Stage::kConfig, "", "",
                  "internal: the prepared resources are for another plan (" +
                      std::to_string(shared->resources->ranks.size()) + " ranks, not " +
                      std::to_string(input.ranks.size()) + ")");
    }
    shared->lanes = shared->resources->lanes;
    shared->single_copy = shared->resources->single_copy;
    observe_lanes(*shared);
    {
      // ferry's scheduler (actors/load_scheduler.cpp), two workers: its threads
      // start here, through the thread-start seam, before the actor system (a
      // refused one is an Error; CAF's own scheduler ended the process). Its idle
      // workers sleep on a condition variable: CAF's default busy-polled and then
      // slept 50 us at a time after every message, which on a small machine
      // preempted the reader and the copy workers (measured: half the load's
      // context switches). Declared first: it outlives the actor system.
      LoadSchedulerThreads scheduler(2);
      caf::actor_system_config config;
      // No cfg.parse(): an embedded library reads no argv or caf-application.ini.
      scheduler.use_in(config);
      // Every thread of this actor system (scheduler workers, detached actors)
      // logs where the thread that runs the load does (a Runtime's own sink).
      config.add_thread_hook<LogSinkHook>(log::thread_sink());
      caf::actor_system system{config};
      {
        caf::scoped_actor self{system};
        CoordinatorActor coordinator = spawn_coordinator(system, shared);
        self->monitor(coordinator);
        // An abnormal exit that no actor reported as an error (the exit reason was
        // once ignored here) still fails the load, naming the coordinator.
        self->receive([&shared](caf::down_msg& down) {
          if (down.reason && !shared->error()) {
            shared->fail(Error(Stage::kCopy, "", "",
                               "the pipeline's coordinator stopped abnormally (" +
                                   caf::to_string(down.reason) + ")"));
          }
        });
      }
      system.await_all_actors_done();
    }
  } catch (...) {
    shared->fail(std::current_exception(), Stage::kCopy, "", "", "pipeline: ");
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
  result.bytes_direct = shared->bytes_direct.load();
  result.bytes_staged = shared->bytes_staged.load();
  result.read_lanes = static_cast<unsigned>(shared->lanes.size());
  result.staging_buffers_leaked = shared->staging_leaked.load();
  for (PreparedResources::Lane& lane : shared->lanes) {
    if (lane.pool) {
      result.staging_bytes += lane.pool->total_bytes();
      result.staging_high_water_bytes += lane.pool->high_water() * lane.pool->buffer_bytes();
      result.staging_buffers_leased_at_end += lane.pool->in_use();
      lane.pool.reset();
    }
  }
  return result;
}

}  // namespace ferry::actors
