// host.deferred_copies proves without a GPU that the pipeline's copies may run
// asynchronously: host devices run each copy later on a thread of their own, and
// staging buffers are poisoned as they come back. The pipeline, which waits for a
// copy's event before giving its buffer back, loads the same bytes as ever; a
// pipeline broken on purpose to give buffers back at once loads poison, so the
// check can fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "gpu/host_device.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

TEST(DeferredCopies, TheRealPipelineLoadsTheSameBytesAndAnEarlyReleaseIsCaught) {
  TempDir dir;
  testing::Checkpoint ck = synth_checkpoint(dir.file("ck"), "qwen2");
  const std::vector<std::string> layout = {"parallel.tp=2", "io.chunk_bytes=64KiB",
                                           "io.staging_bytes=128KiB"};
  std::vector<std::string> immediate = layout;
  immediate.push_back("host.deferred_copies=false");
  Runtime reference(to_config(make_config(ck.dir, immediate)));
  LoadResult want = reference.load();
  ASSERT_TRUE(want) << want.error->message;
  const auto expected = testing::param_bytes(*want.model);

  std::vector<std::string> deferred = layout;
  deferred.push_back("host.deferred_copies=true");
  Runtime rt(to_config(make_config(ck.dir, deferred)));
  LoadResult got = rt.load();
  ASSERT_TRUE(got) << got.error->message;
  EXPECT_EQ(testing::param_bytes(*got.model), expected);

  // The same with buffers given back before their copies ran: poison lands.
  RuntimeTestSeams broken;
  broken.release_staging_early = true;
  Runtime bad = make_runtime(to_config(make_config(ck.dir, deferred)), broken);
  LoadResult damaged = bad.load();
  ASSERT_TRUE(damaged) << damaged.error->message;  // the byte counts still add up
  const auto actual = testing::param_bytes(*damaged.model);
  std::size_t wrong = 0;
  std::size_t poisoned_bytes = 0;
  for (const auto& [name, bytes] : actual) {
    wrong += bytes != expected.at(name) ? 1 : 0;
    for (std::byte b : bytes) {
      poisoned_bytes += b == io::StagingPool::kPoisonPattern ? 1 : 0;
    }
  }
  EXPECT_GT(wrong, 0u) << "an early release went unnoticed";
  EXPECT_GT(poisoned_bytes, 0u);
}

// A chunk that fails half queued: the fragments queued before the failing one are
// still waiting on the deferred queue when the copy worker gives up. The worker
// must wait for them before the chunk's buffer goes back to its pool (where it is
// poisoned, as a reused buffer would be overwritten); the host devices report any
// copy whose source changed under it. Before the fix, the buffer went back with the
// failed message at once.
TEST(DeferredCopies, AChunkThatFailsHalfQueuedKeepsItsBufferUntilItsCopiesRan) {
  TempDir dir;
  testing::Checkpoint ck = synth_checkpoint(dir.file("ck"), "qwen2");
  std::atomic<int> changed{0};
  std::string first_change;
  std::mutex mu;
  gpu::HostDeviceOptions options;
  options.deferred_copies = true;
  options.on_changed_source = [&](const std::string& what) {
    std::lock_guard lock(mu);
    if (changed++ == 0) {
      first_change = what;
    }
  };
  // Several loads, each failing at another point of its first chunks: a release
  // before the copies ran is caught in every one of them, not by luck of timing.
  for (int fail_at : {4, 9, 17}) {
    RuntimeTestSeams hooks;
    hooks.devices = {gpu::make_host_device(0, options), gpu::make_host_device(1, options)};
    std::atomic<int> calls{0};
    hooks.before_copy = [&calls, fail_at](std::size_t, const std::string& param) {
      if (++calls == fail_at) {
        throw Error(Stage::kCopy, "", param, "injected copy failure");
      }
    };
    Runtime rt =
        make_runtime(to_config(make_config(
                         ck.dir, {"parallel.tp=2", "io.chunk_bytes=1MiB", "io.staging_bytes=2MiB",
                                  "io.read_lanes=1", "host.deferred_copies=true"})),
                     std::move(hooks));
    LoadResult r = rt.load();
    ASSERT_FALSE(r) << "fail_at " << fail_at;
    EXPECT_NE(r.error->message.find("injected copy failure"), std::string::npos)
        << r.error->message;
  }
  EXPECT_EQ(changed.load(), 0) << first_change;
}

// The detector itself: a host buffer changed after a deferred copy was queued and
// before it ran is reported, naming the device and the operation.
TEST(DeferredCopies, AHostDeviceReportsACopySourceChangedBeforeTheCopyRan) {
  std::vector<std::string> reports;
  std::mutex mu;
  gpu::HostDeviceOptions options;
  options.deferred_copies = true;
  options.on_changed_source = [&](const std::string& what) {
    std::lock_guard lock(mu);
    reports.push_back(what);
  };
  auto device = gpu::make_host_device(3, options);
  auto stream = device->create_stream();
  gpu::DeviceAllocation dst = device->allocate(1 << 20);
  // A long cast first (32 Mi elements: a tenth of a second and more, sanitizers
  // slower still), so that the copies queued behind it run well after the sources
  // changed below.
  const std::size_t n = std::size_t{32} << 20;
  gpu::DeviceAllocation wide = device->allocate(n * 4);
  gpu::DeviceAllocation narrow = device->allocate(n * 2);
  stream->zero(wide.data(), n * 4);
  stream->cast(narrow.data(), DType::kBF16, wide.data(), DType::kF32, n);
  std::vector<std::byte> small(4096, std::byte{1});
  std::vector<std::byte> large(1 << 20, std::byte{2});
  stream->copy_h2d(dst.data(), small.data(), small.size());
  stream->copy_h2d_2d(dst.data(), 8192, large.data(), 16384, 4096, 64);
  small[100] = std::byte{9};  // the copies wait behind the cast
  std::fill(large.begin(), large.end(), std::byte{7});
  stream->synchronize();
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_NE(reports[0].find("host:3: copy_h2d of 4096 bytes"), std::string::npos) << reports[0];
  EXPECT_NE(reports[1].find("copy_h2d_2d"), std::string::npos) << reports[1];
  // Unchanged sources are not reported.
  stream->copy_h2d(dst.data(), small.data(), small.size());
  stream->synchronize();
  EXPECT_EQ(reports.size(), 2u);
}

}  // namespace
}  // namespace ferry::runtime
