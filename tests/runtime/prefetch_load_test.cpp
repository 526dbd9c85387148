// The page-cache prefetch of a load reads only the planned ranges: at ep 8 a rank's
// prefetch stays within what it reads (the pipeline's prefetch and the startup's
// during the capture alike); prefetch with io.direct is refused by the configuration.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/error_of.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

TEST(PrefetchLoad, AtEp8ThePrefetchStaysWithinThePlannedReads) {
  TempDir dir;
  testing::Checkpoint ck = synth_checkpoint(dir.file("ck"), "mixtral");
  const std::uint64_t all = ck.tensor_bytes();  // what a whole-file prefetch approaches
  // Slow copies hold the reader back (its two staging buffers come back late), so
  // the prefetch gets ahead of it; reads straight into params would not wait for
  // them, and the default budget (8 MiB) would hold all the planned bytes.
  RuntimeTestSeams hooks;
  hooks.before_copy = [](std::size_t, const std::string&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  Runtime rt = make_runtime(
      to_config(make_config(
          ck.dir, {"parallel.tp=8", "parallel.ep=8", "parallel.ranks=0", "prefetch.enabled=true",
                   "prefetch.block_bytes=4KiB", "io.chunk_bytes=64KiB", "io.direct_to_device=off",
                   "io.read_lanes=1", "io.staging_bytes=128KiB"})),
      hooks);
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  const LoadReport& report = r.model->report();
  const std::uint64_t planned = all - report.bytes_skipped;
  EXPECT_LT(planned * 3, all);  // rank 0 of ep 8 reads a small part of the checkpoint
  EXPECT_GT(report.bytes_prefetched, 0u);
  EXPECT_LE(report.bytes_prefetched, planned);

  // The startup's prefetch during the capture: planned ranges too.
  Runtime boot(
      to_config(make_config(ck.dir, {"parallel.tp=8", "parallel.ep=8", "parallel.ranks=0",
                                     "prefetch.block_bytes=4KiB", "startup.mode=overlap"})));
  ASSERT_TRUE(boot.prepare().wait());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the "capture"
  LoadResult ready = boot.commit().wait();
  ASSERT_TRUE(ready) << ready.error->message;
  EXPECT_GT(ready.model->report().startup.bytes_prefetched, 0u);
  EXPECT_LE(ready.model->report().startup.bytes_prefetched, planned);
}

TEST(PrefetchLoad, PrefetchWithDirectReadsIsRefused) {
  TempDir dir;
  testing::Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  // By the configuration built whole, before any load (a check that spans two keys),
  // and by the load for a configuration set call by call.
  const std::vector<std::string> sets = {"prefetch.enabled=true", "io.direct=true"};
  EXPECT_THAT(testing::error_of(Stage::kConfig, [&] { make_config(ck.dir, sets); }),
              HasSubstr("prefetch.enabled with io.direct: refused"));
  Runtime rt(to_config(make_config(ck.dir, sets, ConfigBuilder::Rules::kAllButLoad)));
  LoadResult r = rt.load();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kConfig);
  EXPECT_THAT(r.error->message, HasSubstr("prefetch.enabled with io.direct: refused"));
}

}  // namespace
}  // namespace ferry::runtime
