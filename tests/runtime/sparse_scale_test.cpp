// Real scale, end to end: a sparse Llama-3.1-8B (its real config.json, 291 tensors,
// 16 GB of holes that cost no disk) planned and loaded onto null devices at tp 2.
// The load reads exactly the plan's bytes plus the headers, and every parameter
// byte of both ranks is written once.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "gpu/null_device.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/plan_report.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::runtime {
namespace {

TEST(SparseScale, FullSizeLlama31_8bPlansAndLoadsOnNullAtTp2) {
  FERRY_NEED_TEST_DATA();
  testing::TempDir dir;
  synth::SynthOptions o;
  o.from_config = ::ferry::testing::test_data_path("models/llama-3.1-8b/config.json");
  o.sparse = true;
  o.out = dir.file("llama-3.1-8b");
  o.fsync = false;
  synth::SynthResult written = synth::synthesize(o);
  ASSERT_EQ(written.tensors, 291u);
  ASSERT_EQ(written.total_bytes, 16'060'522'496u);  // 16.06 GB of BF16, as the real checkpoint

  LoadConfig config = testing::make_config(o.out, {"parallel.tp=2", "devices=null"});
  PlanReport plan = make_plan_report(config);
  EXPECT_EQ(plan.placed, 291u);
  EXPECT_EQ(plan.unmapped, 0u);
  EXPECT_EQ(plan.checkpoint_bytes, written.total_bytes);
  EXPECT_EQ(plan.read_bytes, written.total_bytes);  // both ranks local: everything is read

  RuntimeTestSeams hooks;
  hooks.devices = {gpu::make_null_device(0), gpu::make_null_device(1)};
  Runtime rt = make_runtime(to_config(config), hooks);
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  const LoadReport& rep = r.model->report();
  EXPECT_EQ(rep.bytes_read, plan.read_bytes + testing::synth_header_bytes(written));
  EXPECT_EQ(rep.tensors.placed, 291u);
  // ferry's own host memory for a 16 GB model: the staging it was given, plus an
  // index and a plan of a few KiB per tensor (§6 of the hardening issue), whatever
  // else the test process holds.
  EXPECT_LT(rep.host_bytes_owned_by.at("index") + rep.host_bytes_owned_by.at("plan"), 291u * 4096);
  EXPECT_LE(rep.host_bytes_owned, rep.staging_bytes + 291u * 4096);
  for (std::size_t rank = 0; rank < 2; ++rank) {
    std::uint64_t param_bytes = 0;
    for (const LoadedParam& p : r.model->ranks()[rank].params) {
      param_bytes += p.nbytes;
    }
    EXPECT_EQ(gpu::null_device_bytes_written(*hooks.devices[rank]), param_bytes) << rank;
  }
  // Rank 1 alone reads its half of every split tensor and the replicated ones whole.
  LoadConfig one =
      testing::make_config(o.out, {"parallel.tp=2", "parallel.ranks=1", "devices=null"});
  PlanReport plan1 = make_plan_report(one);
  Runtime rt1(to_config(one));
  LoadResult r1 = rt1.load();
  ASSERT_TRUE(r1) << r1.error->message;
  EXPECT_EQ(r1.model->report().bytes_read, plan1.read_bytes + testing::synth_header_bytes(written));
  // (o_proj and down_proj are split by columns: a rank's slice spans nearly all rows.)
  EXPECT_LT(plan1.read_bytes, plan.read_bytes);
  EXPECT_GT(plan1.read_bytes, plan.read_bytes / 2);
}

}  // namespace
}  // namespace ferry::runtime
