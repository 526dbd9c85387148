// The Runtime's test seams: not part of the embedding API (they expose io/, gpu/
// and models/ types), and not in the installed headers or libferry.so's exports.
// Tests and benchmark probes include this header and make a Runtime with them
// through make_runtime(). Not to be confused with the models' post-load hooks
// (models/hooks.hpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/api_internal.hpp"

namespace ferry::io {
class BufferAllocator;
class FaultInjector;
class Reader;
}  // namespace ferry::io
namespace ferry::gpu {
class Device;
}  // namespace ferry::gpu
namespace ferry::models {
class Model;
}  // namespace ferry::models

namespace ferry::runtime {

// An engine never sets these; a default RuntimeTestSeams changes nothing.
struct RuntimeTestSeams {
  std::shared_ptr<io::FaultInjector> faults;  // perturbs every system read of the reader
  // Use these devices instead of creating them from the config (one per local rank),
  // e.g. host devices whose allocation stats a test inspects after a failed load.
  std::vector<std::shared_ptr<gpu::Device>> devices;
  // Called by the copy workers before each piece; throwing fails the load at the
  // copy stage (tests use it to inject copy failures and to cancel at random points).
  std::function<void(std::size_t local_rank, const std::string& param)> before_copy;
  // Called once the load enters its resolve phase, before the checkpoint's files are
  // read (tests cancel there: a config.json that blocks is refused now).
  std::function<void()> in_resolve;
  // remote_instance: called after the seed's table was checked and the storage
  // allocated, just before the first get (tests stop the seed there); and with a
  // failed pull's count of gets in doubt (and their bytes) before the runtime acts on
  // it: a test marks gets in doubt, as an RDMA transport can leave them and TCP,
  // whose forced close cancels every get, never does (remote/ucx.hpp's own test
  // reaches the state for real, by not waiting for the cancellations).
  std::function<void()> before_pull;
  std::function<void(std::size_t& gets, std::uint64_t& bytes)> after_failed_pull;
  // Staging memory comes from here instead of aligned host memory (or pinned memory
  // of the first CUDA device), e.g. a counting allocator that proves a failed load
  // gave every staging buffer back.
  std::shared_ptr<io::BufferAllocator> staging_allocator;
  // Replaces the model made from config.json before planning, e.g. with
  // testing::with_hooks(base, extra) (tests/testing/with_hooks.hpp) to add post-load
  // hooks.
  std::function<std::shared_ptr<const models::Model>(std::shared_ptr<const models::Model>)>
      wrap_model;
  // Capture-safe startup probes. `before_startup_verify` runs in commit() just
  // before the manifest check, on the loaded model's table, so that a test can
  // move storage, strides or dtypes behind ferry's back. `skip_startup_admission`
  // runs overlap even when admission would refuse it, to prove that the manifest
  // still catches what a refused hook does.
  std::function<void(std::vector<LoadedRank>& ranks)> before_startup_verify;
  bool skip_startup_admission = false;
  // A broken pipeline on purpose: copy workers return staging buffers before their
  // copies complete (actors::PipelineInput::release_staging_early).
  bool release_staging_early = false;
  // Exceptions in the actors that have no other seam (actors::PipelineInput::
  // fault_point): called with "coordinator" or "post-processor" on each of their
  // messages; what it throws is an exception in that actor.
  std::function<void(std::string_view actor)> fault_point;
  // Decorates each read lane's reader (after ferry's own observers), e.g. with one
  // whose reads never complete.
  std::function<std::unique_ptr<io::Reader>(std::unique_ptr<io::Reader>)> wrap_reader;
};

// A Runtime with test seams (the public constructor makes one without any).
// Returned by value: `Runtime rt = make_runtime(config, seams);`.
Runtime make_runtime(Config config, RuntimeTestSeams seams,
                     std::shared_ptr<Allocator> allocator = nullptr);

}  // namespace ferry::runtime
