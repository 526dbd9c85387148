// host.deferred_copies proves without a GPU that the pipeline's copies may run
// asynchronously: host devices run each copy later on a thread of their own, and
// staging buffers are poisoned as they come back. The pipeline, which waits for a
// copy's event before giving its buffer back, loads the same bytes as ever; a
// pipeline broken on purpose to give buffers back at once loads poison, so the
// check can fail.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "runtime/runtime.hpp"
#include "runtime/runtime_internal.hpp"
#include "runtime/runtime_test_util.hpp"
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
  Runtime reference(make_config(ck.dir, immediate));
  LoadResult want = reference.load();
  ASSERT_TRUE(want) << want.error->message;
  const auto expected = testing::param_bytes(*want.model);

  std::vector<std::string> deferred = layout;
  deferred.push_back("host.deferred_copies=true");
  Runtime rt(make_config(ck.dir, deferred));
  LoadResult got = rt.load();
  ASSERT_TRUE(got) << got.error->message;
  EXPECT_EQ(testing::param_bytes(*got.model), expected);

  // The same with buffers given back before their copies ran: poison lands.
  RuntimeHooks broken;
  broken.release_staging_early = true;
  Runtime bad(make_config(ck.dir, deferred), broken);
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

}  // namespace
}  // namespace ferry::runtime
