// Read lanes (io.read_lanes), the staging budget (io.staging_bytes) and single-copy
// reads (io.direct_to_device): every way of reading gives the same parameters, the
// report says which path the bytes took and how many lanes ran, staging stays
// within its budget, and the settings that cannot work fail clearly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

LoadResult load_with(const std::string& dir, std::vector<std::string> sets) {
  Runtime rt(to_config(make_config(dir, sets)));
  return rt.load();
}

// Tensor bytes the windows read: what the two read paths add up to.
std::uint64_t windows_read(const LoadReport& r) {
  return r.read_paths.direct_to_device + r.read_paths.staged;
}

class ReadLanesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Small shards, so the tiny checkpoints have several files each.
    llama_ = synth_checkpoint(dir_.file("llama"), "llama", false, 1, 96 * 1024);
    moe_ = synth_checkpoint(dir_.file("moe"), "qwen3_moe", false, 1, 96 * 1024);
  }
  TempDir dir_;
  testing::Checkpoint llama_, moe_;
};

TEST_F(ReadLanesTest, EveryLaneCountAndReadPathLoadsTheSameBytes) {
  struct Case {
    const testing::Checkpoint* ck;
    std::vector<std::string> layout;
  };
  const std::vector<Case> cases = {
      {&llama_, {"parallel.tp=1"}},
      {&llama_, {"parallel.tp=2"}},
      {&moe_, {"parallel.tp=2", "parallel.ep=2"}},
      {&moe_, {"parallel.tp=4", "parallel.ep=2", "parallel.ranks=1,2"}},
  };
  for (const Case& c : cases) {
    std::vector<std::string> base = c.layout;
    base.push_back("io.chunk_bytes=16KiB");
    std::vector<std::string> ref = base;
    ref.insert(ref.end(), {"io.read_lanes=1", "io.direct_to_device=off"});
    LoadResult want = load_with(c.ck->dir, ref);
    ASSERT_TRUE(want) << want.error->message;
    const auto expected = testing::param_bytes(*want.model);
    const LoadReport& want_report = want.model->report();
    EXPECT_EQ(want_report.read_lanes, 1u);
    EXPECT_EQ(want_report.read_paths.direct_to_device, 0u);
    for (const char* lanes : {"1", "2", "3", "4"}) {
      for (const char* path : {"off", "auto"}) {
        const std::string what =
            c.ck->family + " " + c.layout.front() + " lanes " + lanes + " direct_to_device " + path;
        SCOPED_TRACE(what);
        std::vector<std::string> sets = base;
        sets.push_back(std::string("io.read_lanes=") + lanes);
        sets.push_back(std::string("io.direct_to_device=") + path);
        LoadResult got = load_with(c.ck->dir, sets);
        ASSERT_TRUE(got) << got.error->message;
        EXPECT_EQ(testing::param_bytes(*got.model), expected);
        const LoadReport& r = got.model->report();
        EXPECT_EQ(r.read_lanes, static_cast<unsigned>(std::stoi(lanes)));
        // The same windows' bytes are read, whichever lane or path took them.
        EXPECT_EQ(windows_read(r), windows_read(want_report));
        EXPECT_EQ(r.bytes_read, want_report.bytes_read);
        if (std::string(path) == "off" ||
            (std::string(lanes) == "1" && std::thread::hardware_concurrency() > 1)) {
          // auto with one lane on several cores stays staged (the copy worker
          // shares the work).
          EXPECT_EQ(r.read_paths.direct_to_device, 0u);
        }
        // The default budget, 8 MiB per local device, split across the lanes.
        EXPECT_LE(r.staging_bytes, (std::uint64_t{8} << 20) * got.model->ranks().size());
        EXPECT_LE(r.staging_high_water_bytes, r.staging_bytes);
      }
    }
  }
}

TEST_F(ReadLanesTest, SingleCopyReadsTakeWhatOneDeviceAloneNeeds) {
  // tp 1: every window inside one large tensor is one contiguous run of one param.
  LoadResult one = load_with(llama_.dir, {"io.chunk_bytes=16KiB", "io.read_lanes=2"});
  ASSERT_TRUE(one) << one.error->message;
  const LoadReport& r1 = one.model->report();
  EXPECT_GT(r1.read_paths.direct_to_device, 0u);
  EXPECT_GT(r1.read_paths.staged, 0u);  // windows of several small tensors stay staged
  // tp 1 reads every tensor byte once, and each lands once: the two paths add up
  // to the checkpoint's tensor bytes and to the bytes written to the device.
  EXPECT_EQ(windows_read(r1), llama_.tensor_bytes());
  EXPECT_EQ(r1.bytes_copied, llama_.tensor_bytes());

  // tp 2 with a bandwidth cap: nothing may bypass the emulated link.
  LoadResult capped =
      load_with(llama_.dir, {"parallel.tp=2", "io.chunk_bytes=16KiB", "host.bandwidth_gbps=50"});
  ASSERT_TRUE(capped) << capped.error->message;
  EXPECT_EQ(capped.model->report().read_paths.direct_to_device, 0u);

  // Under io.direct a read goes straight in only when its file offset and its
  // place in the param are both 4096-aligned. A safetensors file aligns tensors to
  // 8 bytes, so that needs a tensor whose data offset is a multiple of 4096 apart
  // from its param's: none here, and everything is staged, with the same bytes.
  LoadResult staged = load_with(llama_.dir, {"io.chunk_bytes=16KiB", "io.direct_to_device=off"});
  LoadResult direct = load_with(llama_.dir, {"io.chunk_bytes=16KiB", "io.direct=true"});
  ASSERT_TRUE(staged && direct);
  EXPECT_EQ(testing::param_bytes(*direct.model), testing::param_bytes(*staged.model));
  EXPECT_EQ(windows_read(direct.model->report()), windows_read(staged.model->report()));
}

TEST_F(ReadLanesTest, ReplicatedBytesStayStagedAndAreReadOnce) {
  // tp 2: the norms are needed by both ranks, so no window of them goes direct, and
  // every tensor byte is still read exactly once.
  LoadResult r = load_with(llama_.dir, {"parallel.tp=2", "io.chunk_bytes=16KiB"});
  ASSERT_TRUE(r) << r.error->message;
  const LoadReport& rep = r.model->report();
  EXPECT_EQ(windows_read(rep), llama_.tensor_bytes());
  EXPECT_GT(rep.read_paths.staged, 0u);
}

TEST_F(ReadLanesTest, BadSettingsFailClearly) {
  // on, where no local device can take reads into its memory.
  LoadResult null_dev = load_with(llama_.dir, {"devices=null:1", "io.direct_to_device=on"});
  ASSERT_FALSE(null_dev);
  EXPECT_EQ(null_dev.error->stage, Stage::kConfig);
  EXPECT_THAT(null_dev.error->message, HasSubstr("io.direct_to_device=on"));
  EXPECT_THAT(null_dev.error->message, HasSubstr("null:0"));
  LoadResult capped = load_with(llama_.dir, {"host.bandwidth_gbps=10", "io.direct_to_device=on"});
  ASSERT_FALSE(capped);
  EXPECT_THAT(capped.error->message, HasSubstr("bandwidth cap"));
  // on, where it can: loads, single-copy even with one lane.
  LoadResult on =
      load_with(llama_.dir, {"io.direct_to_device=on", "io.chunk_bytes=16KiB", "io.read_lanes=1"});
  ASSERT_TRUE(on) << on.error->message;
  EXPECT_GT(on.model->report().read_paths.direct_to_device, 0u);
}

TEST_F(ReadLanesTest, TheStagingBudgetBoundsMemoryAndLimitsTheLanes) {
  // 3 buffers of 16 KiB for 4 lanes asked: 3 lanes of one buffer each.
  LoadResult r = load_with(llama_.dir, {"parallel.tp=2", "io.chunk_bytes=16KiB",
                                        "io.staging_bytes=48KiB", "io.read_lanes=4"});
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_EQ(r.model->report().read_lanes, 3u);
  EXPECT_EQ(r.model->report().staging_bytes, 48u * 1024);
  EXPECT_LE(r.model->report().staging_high_water_bytes, 48u * 1024);
  EXPECT_GT(r.model->report().staging_high_water_bytes, 0u);
  // Auto keeps two buffers per lane: 64 KiB of 16 KiB buffers is at most 2 lanes.
  LoadResult a = load_with(llama_.dir, {"io.chunk_bytes=16KiB", "io.staging_bytes=64KiB"});
  ASSERT_TRUE(a) << a.error->message;
  EXPECT_LE(a.model->report().read_lanes, 2u);
  EXPECT_GE(a.model->report().read_lanes, 1u);
}

}  // namespace
}  // namespace ferry::runtime
