// The streaming half of a load: runs a Plan through the actor pipeline (reader,
// copy workers, post-processor, prefetcher, coordinator) and returns when every
// param is complete or the load failed. This header is what runtime/ sees of
// actors/: it names no CAF type, so CAF stays inside actors/*.cpp.
//
// The caller owns the param storage (allocated on each rank's device before the
// call) and frees it when the load failed. run_pipeline returns only after every
// actor has stopped, every staging buffer went back to its pool and every copy
// worker's stream has completed its work, so on return nothing of the pipeline
// touches device or staging memory any more. The pools, streams and scratch
// (PreparedResources) are released on return when the pipeline made them, and
// with the caller's last reference when the caller prepared them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "actors/plan.hpp"
#include "common/error.hpp"
#include "gpu/device.hpp"
#include "io/io_config.hpp"
#include "io/prefetch.hpp"
#include "io/reader.hpp"
#include "io/safetensors.hpp"
#include "io/staging_pool.hpp"
#include "models/hooks.hpp"
#include "models/model.hpp"

namespace ferry::actors {

struct PipelineOptions {
  // The configuration's io and prefetch sections as built (runtime/load_config.hpp,
  // io/io_config.hpp). The pipeline reads: io.engine, io.read_lanes (reader
  // threads, each with its own ring, staging and share of the spans; 0 = auto,
  // below), io.queue_depth (reads in flight per lane), io.cancel_timeout_ms
  // (teardown's bound on reads it asked the kernel to cancel), io.chunk_bytes,
  // io.staging_bytes (host staging split evenly across the lanes in chunk_bytes
  // buffers, at least one per lane: the pipeline never holds more; 0 = 8 MiB per
  // local rank), io.direct (O_DIRECT), io.direct_to_device and the prefetch section.
  //
  // io.direct_to_device: a read whose bytes are one contiguous run of exactly one
  // local rank's param, on a device whose memory is host memory
  // (gpu::Device::host_addressable), and under io.direct aligned
  // (io::kDirectAlignment) at both ends and in memory, lands in the param with no
  // staging (single-copy). kAuto: where possible when two lanes or more run (or the
  // machine has one core: one lane's copy worker on a second core beats the saved
  // copy); kOn: wherever possible, and a load with no local device that can take
  // such reads fails (naming them); kOff: never.
  ferry::io::IoConfig io;
  ferry::io::PrefetchConfig prefetch;
  // What the runtime derives from the devices (runtime::io_auto): with read_lanes 0,
  // at most max_auto_lanes lanes, and at most one per weight file read where
  // lanes_follow_files.
  unsigned max_auto_lanes = 4;
  bool lanes_follow_files = true;
  // Poison staging buffers as they return (io::StagingPool::poison_on_return), with
  // host devices that defer their copies (host.deferred_copies).
  bool poison_staging = false;
};

// One local rank: its device and the storage of each param of its shell.
struct RankTarget {
  std::shared_ptr<gpu::Device> device;
  std::vector<std::byte*> params;  // indexed like the rank's RankShell::params
};

// Counters a caller may watch while the pipeline runs (runtime::LoadHandle::progress):
// bytes of windows read and of param bytes copied so far.
struct PipelineProgress {
  std::atomic<std::uint64_t> bytes_read{0};
  std::atomic<std::uint64_t> bytes_copied{0};
};

struct PreparedResources;

struct PipelineInput {
  const io::CheckpointIndex* index = nullptr;
  const models::Model* model = nullptr;
  const Plan* plan = nullptr;
  std::vector<RankTarget> ranks;  // one per local rank, in shell order
  PipelineOptions options;
  // Staging memory; null = aligned host memory (runtime/ passes pinned memory of a
  // CUDA device when there is one).
  std::shared_ptr<io::BufferAllocator> staging_allocator;
  // Staging memory for a lane whose devices sit on NUMA node `node` (used only when
  // the system reports several nodes); empty = io::numa_allocator over
  // staging_allocator (pinned memory needs its pages placed before it is pinned).
  std::function<std::shared_ptr<io::BufferAllocator>(int node)> staging_allocator_on_node;
  std::shared_ptr<io::FaultInjector> faults;
  // Called by a copy worker before each fragment; throwing fails the load (a
  // ferry::Error keeps its stage, anything else becomes Stage::kCopy).
  std::function<void(std::size_t local_rank, const std::string& param)> before_copy;
  // Tests only: called by the coordinator on each message and tick, and by the
  // post-processor on each message, with the actor's name ("coordinator",
  // "post-processor"); what it throws is an exception in that actor.
  std::function<void(std::string_view actor)> fault_point;
  // Set by another thread to cancel; checked by every actor between steps.
  const std::atomic<bool>* cancel = nullptr;
  // Updated as windows are read and fragments copied (the result's bytes_copied is
  // read from it); null: the pipeline keeps its own.
  PipelineProgress* progress = nullptr;
  // Called by the post-processor (an actor: it must not block) when every byte of a
  // param has landed, hook outputs included; empty = not watched.
  std::function<void(std::size_t local_rank, std::size_t param)> on_param_complete;
  // Gives a param new storage for a post-load hook that declares `reallocates`
  // (models::HookContext::reallocate) and returns it; called on the hook's copy
  // worker. Empty: such a hook fails.
  std::function<std::byte*(std::size_t local_rank, std::size_t param)> reallocate;
  // load.layered: storage for a transient param (models::ParamSpec::transient) whose
  // RankTarget pointer is null, asked by its copy worker before its first write;
  // and its release, by the same worker once every hook that reads it has run.
  // Empty: transient params come allocated (RankTarget) and stay until the caller
  // frees them.
  std::function<std::byte*(std::size_t local_rank, std::size_t param)> allocate_transient;
  std::function<void(std::size_t local_rank, std::size_t param)> release_transient;
  // Observers (runtime metrics). `wrap_reader` decorates the reader the pipeline
  // makes (io::MeteredReader); `on_staging` observes the staging pool
  // (io::StagingPool::observe). Empty: none.
  std::function<std::unique_ptr<io::Reader>(std::unique_ptr<io::Reader>)> wrap_reader;
  std::function<void(std::size_t in_use)> on_staging;
  // Tests only: copy workers give each staging buffer back as soon as its copies
  // are queued, without waiting for them to complete (a broken pipeline), to show
  // that host.deferred_copies catches it.
  bool release_staging_early = false;
  // Observes the page-cache prefetch's block reads (io::PrefetchOptions::on_block_read).
  decltype(io::PrefetchOptions::on_block_read) on_prefetch_block;
  // Sees each post-load hook's run, on its copy worker (the runtime's trace).
  models::HookObserver on_hook;
  // Every device object the load needs, made ahead by prepare_resources (a
  // capture-safe commit: Runtime::prepare() makes them, commit() only uses them);
  // null: run_pipeline makes them itself, just before streaming (start()/load()).
  std::shared_ptr<PreparedResources> prepared;
};

// What a load's pipeline allocates and creates on its devices and in pinned host
// memory, made before any actor starts: the read lanes (their spans and staging
// pools: cudaHostAlloc on CUDA), and per local rank its copy worker's stream and
// device scratch (cudaStreamCreate, cudaMalloc), with the device's event pool
// holding an event for every chunk its worker can keep in flight plus its waits
// (so that record() and synchronize() create none). A pipeline given these makes
// no allocation and creates no CUDA object: it copies, launches kernels, records
// pooled events and waits. Used by one pipeline (a pool closed by an abort stays
// closed); freed when the last reference goes.
struct PreparedResources {
  struct Lane {
    std::pair<std::size_t, std::size_t> spans;  // the lane's share of plan.spans
    std::shared_ptr<io::StagingPool> pool;
  };
  std::vector<Lane> lanes;
  // Whether readers may read straight into params (io.direct_to_device resolved
  // against the lanes).
  bool single_copy = false;
  struct Rank {
    std::unique_ptr<gpu::Stream> stream;
    gpu::DeviceAllocation scratch;  // worker_scratch_bytes
  };
  std::vector<Rank> ranks;  // one per local rank
};

// The device scratch local rank `rank`'s copy worker needs: the most of its copies
// (casts and gathered narrow rows: actors::rank_scratch_bytes) and of its post-load
// hooks (models::PostLoadHook::scratch_bytes), which share it in stream order.
std::uint64_t worker_scratch_bytes(const PipelineInput& input, std::size_t rank);

// Makes `input`'s resources (its plan, model, ranks, options and staging
// allocators; nothing else is read). Throws ferry::Error naming what failed.
std::shared_ptr<PreparedResources> prepare_resources(const PipelineInput& input);

struct PipelineResult {
  std::optional<Error> error;          // the first error of any actor; empty on success
  std::uint64_t bytes_read = 0;        // bytes the reader requested (O_DIRECT widening included)
  std::uint64_t bytes_copied = 0;      // param bytes written from checkpoint data
  std::uint64_t bytes_prefetched = 0;  // page-cache prefetch reads
  std::uint64_t reads = 0;             // windows read
  std::uint64_t bytes_direct = 0;      // window bytes read straight into params
  std::uint64_t bytes_staged = 0;      // window bytes read into staging buffers
  unsigned read_lanes = 0;             // lanes that ran
  std::uint64_t staging_bytes = 0;     // staging memory allocated (all lanes)
  // Sum over the lanes of each lane's most staging memory leased at once.
  std::uint64_t staging_high_water_bytes = 0;
  std::size_t staging_buffers_leased_at_end = 0;  // 0 unless a lease leaked (a bug)
  // Of those, the buffers left to reads that never completed (cancelled, then
  // given up after io.cancel_timeout_ms): not a bug, and the error says so.
  std::size_t staging_buffers_leaked = 0;
  double stream_seconds = 0;  // start until every copy and fill landed
  double total_seconds = 0;   // start until every actor stopped
  // Bytes landed per param, [local rank][param]: what the post-processor counted.
  std::vector<std::vector<std::uint64_t>> landed;
};

// Streams `input.plan` into the params. Never throws: failures are in `error`.
PipelineResult run_pipeline(const PipelineInput& input);

}  // namespace ferry::actors
