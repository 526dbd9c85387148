// End-to-end loads through ferry::Runtime on host devices: every element of every
// param of every local rank is compared with an independent reference computed
// from the synthetic checkpoint's values (tests/runtime/runtime_test_util.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "gpu/host_device.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::expect_matches_reference;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

LoadResult load(const LoadConfig& config, RuntimeTestSeams hooks = {}) {
  Runtime rt = make_runtime(to_config(config), std::move(hooks));
  LoadResult r = rt.load();
  EXPECT_TRUE(r) << (r.error ? r.error->message : "");
  return r;
}

std::string tp(int n) {
  return "parallel.tp=" + std::to_string(n);
}

class LoadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    llama_ = new Checkpoint(synth_checkpoint(dir_->file("llama"), "llama"));
    llama_tied_ = new Checkpoint(synth_checkpoint(dir_->file("llama-tied"), "llama", true, 7));
    qwen2_ = new Checkpoint(synth_checkpoint(dir_->file("qwen2"), "qwen2", false, 3));
  }
  static void TearDownTestSuite() {
    delete llama_;
    delete llama_tied_;
    delete qwen2_;
    delete dir_;
  }
  static TempDir* dir_;
  static Checkpoint* llama_;
  static Checkpoint* llama_tied_;
  static Checkpoint* qwen2_;
};
TempDir* LoadTest::dir_ = nullptr;
Checkpoint* LoadTest::llama_ = nullptr;
Checkpoint* LoadTest::llama_tied_ = nullptr;
Checkpoint* LoadTest::qwen2_ = nullptr;

TEST_F(LoadTest, LlamaEveryTpSizeAllRanksLocal) {
  for (int t : {1, 2, 4, 8}) {
    SCOPED_TRACE("tp " + std::to_string(t));
    LoadResult r = load(make_config(llama_->dir, {tp(t)}));
    ASSERT_TRUE(r);
    ASSERT_EQ(r.model->ranks().size(), static_cast<std::size_t>(t));
    for (int i = 0; i < t; ++i) {
      EXPECT_EQ(r.model->ranks()[i].tp_rank, i);
      EXPECT_EQ(r.model->ranks()[i].device, "host:" + std::to_string(i));
    }
    // 4 layers x 6 params + embed, norm, lm_head, per rank.
    EXPECT_EQ(expect_matches_reference(*r.model, *llama_, t, DType::kBF16), 27u * t);
    const LoadReport& rep = r.model->report();
    EXPECT_EQ(rep.tensors.placed, 39u);
    EXPECT_EQ(rep.tensors.dropped, 0u);
    EXPECT_EQ(rep.tensors.unmapped, 0u);
    EXPECT_EQ(rep.files, 4u);
  }
}

TEST_F(LoadTest, Qwen2BiasesWithKvReplicationAtTp8) {
  for (int t : {2, 8}) {
    SCOPED_TRACE("tp " + std::to_string(t));
    LoadResult r = load(make_config(qwen2_->dir, {tp(t)}));
    ASSERT_TRUE(r);
    // Qwen2 adds one qkv bias per layer.
    EXPECT_EQ(expect_matches_reference(*r.model, *qwen2_, t, DType::kBF16), 31u * t);
    ASSERT_NE(r.model->ranks()[0].find("model.layers.0.self_attn.qkv_proj.bias"), nullptr);
  }
}

TEST_F(LoadTest, UnevenTpPadsHeadsWithZeros) {
  // Under model.unaligned_tp=pad, 8 q / 2 kv heads at tp 16: padded to 64 / 16
  // heads; ranks 0 and 1 hold the real heads, the others zeros (fills), and the
  // ranks that hold only padding read no attention tensor. Every element is checked
  // against the reference.
  LoadResult r = load(make_config(qwen2_->dir, {tp(16), "model.unaligned_tp=pad"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(expect_matches_reference(*r.model, *qwen2_, 16, DType::kBF16, true), 31u * 16u);
  // The report tells the operator.
  const std::vector<std::string>& warnings = r.model->report().warnings;
  EXPECT_TRUE(std::any_of(warnings.begin(), warnings.end(), [](const std::string& w) {
    return w.find("uneven tensor parallelism") != std::string::npos &&
           w.find("of the tp ranks, 2..15 hold only zero heads") != std::string::npos;
  }));
  LoadResult sub =
      load(make_config(qwen2_->dir, {tp(16), "parallel.ranks=9,1", "model.unaligned_tp=pad"}));
  ASSERT_TRUE(sub);
  EXPECT_EQ(expect_matches_reference(*sub.model, *qwen2_, 16, DType::kBF16, true), 31u * 2u);
  // By default the layout is refused, as SGLang's GPU path asserts.
  Runtime refused(to_config(make_config(qwen2_->dir, {tp(16)})));
  LoadResult no = refused.load();
  ASSERT_FALSE(no);
  EXPECT_EQ(no.error->stage, Stage::kPlacement);
  EXPECT_NE(no.error->message.find("model.unaligned_tp=pad"), std::string::npos);
}

TEST_F(LoadTest, TiedEmbeddingsHaveNoLmHead) {
  LoadResult r = load(make_config(llama_tied_->dir, {tp(2)}));
  ASSERT_TRUE(r);
  EXPECT_EQ(expect_matches_reference(*r.model, *llama_tied_, 2, DType::kBF16), 26u * 2);
  EXPECT_EQ(r.model->ranks()[0].find("lm_head.weight"), nullptr);
}

TEST_F(LoadTest, SubsetsOfRanksGetTheirOwnShards) {
  {
    LoadResult r = load(make_config(llama_->dir, {tp(4), "parallel.ranks=1,3"}));
    ASSERT_TRUE(r);
    ASSERT_EQ(r.model->ranks().size(), 2u);
    EXPECT_EQ(r.model->ranks()[0].tp_rank, 1);
    EXPECT_EQ(r.model->ranks()[1].tp_rank, 3);
    EXPECT_EQ(r.model->ranks()[1].device, "host:1");
    EXPECT_EQ(expect_matches_reference(*r.model, *llama_, 4, DType::kBF16), 27u * 2);
  }
  {
    LoadResult r = load(make_config(qwen2_->dir, {tp(8), "parallel.ranks=5"}));
    ASSERT_TRUE(r);
    ASSERT_EQ(r.model->ranks().size(), 1u);
    EXPECT_EQ(r.model->ranks()[0].tp_rank, 5);
    EXPECT_EQ(expect_matches_reference(*r.model, *qwen2_, 8, DType::kBF16), 31u);
  }
}

TEST_F(LoadTest, CastsBf16CheckpointToF32AndF16Params) {
  LoadResult r = load(make_config(llama_->dir, {tp(2), "model.dtype=f32"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(expect_matches_reference(*r.model, *llama_, 2, DType::kF32), 27u * 2);
  // Param bytes are twice the checkpoint's: bytes_copied counts what landed.
  const LoadReport& rep = r.model->report();
  EXPECT_GT(rep.bytes_copied, rep.bytes_read);
  LoadResult h = load(make_config(qwen2_->dir, {tp(4), "model.dtype=f16"}));
  ASSERT_TRUE(h);
  EXPECT_EQ(expect_matches_reference(*h.model, *qwen2_, 4, DType::kF16), 31u * 4);
}

TEST_F(LoadTest, ReadsEachByteOnceWhenAllRanksAreLocal) {
  LoadResult r = load(make_config(llama_->dir, {tp(4)}));
  ASSERT_TRUE(r);
  const LoadReport& rep = r.model->report();
  // Headers plus tensor data, nothing twice although four devices need most bytes.
  EXPECT_LE(rep.bytes_read, llama_->file_bytes());
  EXPECT_EQ(rep.bytes_read, llama_->file_bytes());
  EXPECT_EQ(rep.bytes_skipped, 0u);
  EXPECT_GT(rep.bytes_copied, rep.bytes_read);  // replicated norms land four times
}

TEST_F(LoadTest, OneRankOfFourSkipsWhatItDoesNotKeep) {
  LoadResult r = load(make_config(llama_->dir, {tp(4), "parallel.ranks=2"}));
  ASSERT_TRUE(r);
  const LoadReport& rep = r.model->report();
  EXPECT_GT(rep.bytes_skipped, 0u);
  EXPECT_LT(rep.bytes_read, llama_->file_bytes());
  // Every tensor byte is either read or skipped (headers are read, never skipped).
  std::uint64_t tensor_bytes = 0;
  for (const auto& [name, shape] : llama_->shapes) {
    std::uint64_t n = 2;
    for (std::uint64_t d : shape) {
      n *= d;
    }
    tensor_bytes += n;
  }
  const std::uint64_t headers = llama_->file_bytes() - tensor_bytes;
  EXPECT_EQ(rep.bytes_read - headers + rep.bytes_skipped, tensor_bytes);
  EXPECT_EQ(expect_matches_reference(*r.model, *llama_, 4, DType::kBF16), 27u);
}

TEST_F(LoadTest, SmallChunksSplitTensorsAndStagingStaysBounded) {
  for (const char* chunk : {"4096", "12288"}) {
    SCOPED_TRACE(chunk);
    LoadResult r = load(
        make_config(llama_->dir, {tp(2), std::string("io.chunk_bytes=") + chunk,
                                  "io.staging_bytes=" + std::to_string(2 * std::stoull(chunk))}));
    ASSERT_TRUE(r);
    EXPECT_EQ(expect_matches_reference(*r.model, *llama_, 2, DType::kBF16), 27u * 2);
    const LoadReport& rep = r.model->report();
    EXPECT_LE(rep.staging_high_water_bytes, 2u * std::stoull(chunk));
    EXPECT_GT(rep.staging_high_water_bytes, 0u);
    EXPECT_EQ(rep.bytes_read, llama_->file_bytes());
  }
  // A cast across chunk edges, with the reader's split rows.
  LoadResult r = load(make_config(
      qwen2_->dir, {tp(8), "io.chunk_bytes=4096", "io.staging_bytes=12288", "model.dtype=f32"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(expect_matches_reference(*r.model, *qwen2_, 8, DType::kF32), 31u * 8);
  EXPECT_LE(r.model->report().staging_high_water_bytes, 3u * 4096);
}

// The CUDA copy path without a GPU: host devices told to gather rows narrower than
// 64 KiB (host.narrow_row_bytes) copy tp 2's row-parallel slices contiguously into
// device scratch and gather them with copy_d2d_2d; casts go through one cast_2d.
// Every tp size, plain and cast, small chunks included, must still equal the
// reference.
TEST_F(LoadTest, GatheringNarrowRowsAsOnAGpuGivesTheSameParams) {
  const std::string narrow = "host.narrow_row_bytes=65536";
  for (int t : {2, 4}) {
    SCOPED_TRACE("tp " + std::to_string(t));
    LoadResult r = load(make_config(llama_->dir, {tp(t), narrow}));
    ASSERT_TRUE(r);
    EXPECT_EQ(expect_matches_reference(*r.model, *llama_, t, DType::kBF16), 27u * t);
    LoadResult c = load(make_config(qwen2_->dir, {tp(t), narrow, "model.dtype=f32"}));
    ASSERT_TRUE(c);
    EXPECT_EQ(expect_matches_reference(*c.model, *qwen2_, t, DType::kF32), 31u * t);
  }
  LoadResult small = load(
      make_config(llama_->dir, {tp(2), narrow, "io.chunk_bytes=4096", "io.staging_bytes=12288"}));
  ASSERT_TRUE(small);
  EXPECT_EQ(expect_matches_reference(*small.model, *llama_, 2, DType::kBF16), 27u * 2);
}

TEST_F(LoadTest, DirectAndPreadEnginesGiveIdenticalParams) {
  LoadResult a = load(make_config(llama_->dir, {tp(2), "io.direct=true", "io.chunk_bytes=8192"}));
  LoadResult b = load(make_config(llama_->dir, {tp(2), "io.engine=pread"}));
  LoadResult c = load(make_config(llama_->dir, {tp(2), "io.engine=pread", "io.direct=true"}));
  ASSERT_TRUE(a && b && c);
  for (std::size_t r = 0; r < 2; ++r) {
    for (const LoadedParam& p : b.model->ranks()[r].params) {
      EXPECT_EQ(a.model->read_param(r, p.name), b.model->read_param(r, p.name)) << p.name;
      EXPECT_EQ(c.model->read_param(r, p.name), b.model->read_param(r, p.name)) << p.name;
    }
  }
  EXPECT_EQ(expect_matches_reference(*a.model, *llama_, 2, DType::kBF16), 27u * 2);
  // O_DIRECT reads whole 4096-byte blocks, so it may read more than the files hold
  // at tensor-range edges, never less.
  EXPECT_GE(a.model->report().bytes_read, b.model->report().bytes_read);
}

TEST_F(LoadTest, PrefetchEnabledLoadsTheSameParams) {
  LoadResult r =
      load(make_config(llama_->dir, {tp(2), "prefetch.enabled=true", "prefetch.block_bytes=65536",
                                     "prefetch.ahead_bytes=131072"}));
  ASSERT_TRUE(r);
  EXPECT_EQ(expect_matches_reference(*r.model, *llama_, 2, DType::kBF16), 27u * 2);
  EXPECT_LE(r.model->report().bytes_prefetched, llama_->file_bytes());
}

TEST_F(LoadTest, ReportFieldsAreFilledAndPhasesAddUp) {
  LoadResult r = load(make_config(llama_->dir, {tp(2)}));
  ASSERT_TRUE(r);
  const LoadReport& rep = r.model->report();
  const auto& ph = rep.phases;
  EXPECT_NEAR(ph.resolve + ph.plan + ph.allocate + ph.stream + ph.postprocess + ph.verify,
              rep.seconds, 1e-9);
  for (double v : {ph.resolve, ph.plan, ph.allocate, ph.stream, ph.postprocess, ph.verify}) {
    EXPECT_GE(v, 0.0);
  }
  EXPECT_GT(rep.seconds, 0.0);
  EXPECT_GT(rep.gbps, 0.0);
  EXPECT_GT(rep.peak_rss_bytes, 0u);
  EXPECT_GT(rep.staging_high_water_bytes, 0u);
  nlohmann::json j = to_json(rep);
  for (const char* key :
       {"bytes_read", "bytes_skipped", "bytes_copied", "bytes_prefetched", "seconds", "phases",
        "gbps", "peak_rss_bytes", "staging_high_water_bytes", "files", "tensors", "warnings"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["tensors"]["placed"], 39);
  EXPECT_EQ(j["phases"].size(), 6u);
  EXPECT_EQ(j["host_bytes_owned"], rep.host_bytes_owned);
}

// ferry's own host memory, counted by ferry (the hardening issue, §6): its parts add
// up, staging is what was allocated, the index and plan are counted and small next
// to it, and O_DIRECT bounce and prefetch buffers appear only when they exist.
TEST_F(LoadTest, HostBytesOwnedCountsFerrysOwnMemory) {
  LoadResult r = load(make_config(llama_->dir, {tp(2)}));
  ASSERT_TRUE(r);
  const LoadReport& rep = r.model->report();
  std::uint64_t sum = 0;
  for (const auto& [part, bytes] : rep.host_bytes_owned_by) {
    sum += bytes;
  }
  EXPECT_EQ(sum, rep.host_bytes_owned);
  EXPECT_EQ(rep.host_bytes_owned_by.at("staging"), rep.staging_bytes);
  // 39 tensors: a few KiB of names, shapes and pieces each, well under the staging.
  EXPECT_GT(rep.host_bytes_owned_by.at("index"), 39u * sizeof(io::TensorInfo));
  EXPECT_LT(rep.host_bytes_owned_by.at("index"), 64u << 10);
  EXPECT_GT(rep.host_bytes_owned_by.at("plan"), 0u);
  EXPECT_LT(rep.host_bytes_owned_by.at("plan"), 64u << 10);
  EXPECT_EQ(rep.host_bytes_owned_by.at("bounce"), 0u);
  EXPECT_EQ(rep.host_bytes_owned_by.at("prefetch"), 0u);
  LoadResult p =
      load(make_config(llama_->dir, {tp(2), "prefetch.enabled=true", "prefetch.threads=2",
                                     "prefetch.block_bytes=1048576"}));
  ASSERT_TRUE(p);
  EXPECT_EQ(p.model->report().host_bytes_owned_by.at("prefetch"), 2u << 20);
  LoadResult d = load(make_config(llama_->dir, {tp(2), "io.direct=true", "io.chunk_bytes=65536"}));
  ASSERT_TRUE(d);
  const LoadReport& q = d.model->report();
  EXPECT_EQ(q.host_bytes_owned_by.at("bounce"),
            std::uint64_t{q.read_lanes} * 4 * (65536 + 4096));  // io.queue_depth 4
  EXPECT_NE(rep.summary().find("loaded 39 tensors"), std::string::npos);
}

TEST_F(LoadTest, ModelOutlivesTheRuntimeAndOwnsItsMemory) {
  std::vector<std::shared_ptr<gpu::Device>> devices = {gpu::make_host_device(0),
                                                       gpu::make_host_device(1)};
  std::shared_ptr<LoadedModel> model;
  {
    RuntimeTestSeams hooks;
    hooks.devices = devices;
    Runtime rt = make_runtime(to_config(make_config(llama_->dir, {tp(2)})), hooks);
    LoadResult r = rt.load();
    ASSERT_TRUE(r);
    model = r.model;
  }
  EXPECT_EQ(expect_matches_reference(*model, *llama_, 2, DType::kBF16), 27u * 2);
  // The model holds its params: one arena per device (runtime allocate_rank).
  EXPECT_EQ(devices[0]->stats().device.live_count, 1u);
  EXPECT_GE(devices[0]->stats().device.live_bytes, model->ranks()[0].params.back().nbytes);
  EXPECT_EQ(devices[0]->stats().live_streams, 0u);
  model.reset();
  EXPECT_TRUE(devices[0]->stats().all_released());
  EXPECT_TRUE(devices[1]->stats().all_released());
}

// Each rank's params come from one arena on its device: one allocation, every param
// at a 256-byte boundary inside it, none overlapping, in shell order.
TEST_F(LoadTest, EachRanksParamsShareOneAlignedArena) {
  std::vector<std::shared_ptr<gpu::Device>> devices = {gpu::make_host_device(0),
                                                       gpu::make_host_device(1)};
  RuntimeTestSeams hooks;
  hooks.devices = devices;
  LoadResult r = load(make_config(llama_->dir, {tp(2)}), hooks);
  ASSERT_TRUE(r);
  for (std::size_t rank = 0; rank < 2; ++rank) {
    const gpu::AllocationStats stats = devices[rank]->stats();
    EXPECT_EQ(stats.device.live_count, 1u);
    EXPECT_EQ(stats.device.total_count, 1u);  // no scratch either: nothing is cast
    const auto& params = r.model->ranks()[rank].params;
    const std::byte* arena = params.front().data;
    const std::byte* end = arena;
    for (const LoadedParam& p : params) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.data) % gpu::kDeviceAlignment, 0u) << p.name;
      EXPECT_GE(p.data, end) << p.name;  // after the one before, no overlap
      EXPECT_LT(static_cast<std::size_t>(p.data - end), gpu::kDeviceAlignment) << p.name;
      end = p.data + p.nbytes;
    }
    EXPECT_EQ(static_cast<std::size_t>(end - arena), stats.device.live_bytes);
  }
  EXPECT_EQ(expect_matches_reference(*r.model, *llama_, 2, DType::kBF16), 27u * 2);
}

TEST_F(LoadTest, ReadParamRejectsUnknownNamesAndRanks) {
  LoadResult r = load(make_config(llama_->dir, {tp(1)}));
  ASSERT_TRUE(r);
  EXPECT_THROW(r.model->read_param(0, "no.such.param"), Error);
  EXPECT_THROW(r.model->read_param(1, "model.norm.weight"), Error);
}

TEST_F(LoadTest, TheSameRuntimeLoadsTwice) {
  Runtime rt(to_config(make_config(llama_->dir, {tp(2)})));
  LoadResult a = rt.load();
  LoadResult b = rt.load();
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a.model->read_param(1, "lm_head.weight"), b.model->read_param(1, "lm_head.weight"));
  EXPECT_NE(a.model->ranks()[1].find("lm_head.weight")->data,
            b.model->ranks()[1].find("lm_head.weight")->data);
}

TEST_F(LoadTest, UnmappedTensorsAreAWarningUnlessStrict) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::string shard = testing::shard_of(ck.dir, "model.norm.weight");
  testing::rewrite_shard(ck.dir, shard, [](std::vector<testing::ShardEntry>& e) {
    e.push_back({"model.extra_head.weight", DType::kBF16, {4, 4}, std::string(32, '\0')});
  });
  LoadResult r = load(make_config(ck.dir, {tp(2)}));
  ASSERT_TRUE(r);
  EXPECT_EQ(r.model->report().tensors.unmapped, 1u);
  EXPECT_EQ(r.model->report().bytes_skipped, 32u);
  ASSERT_FALSE(r.model->report().warnings.empty());
  EXPECT_NE(r.model->report().warnings.back().find("model.extra_head.weight"), std::string::npos);
  EXPECT_EQ(expect_matches_reference(*r.model, ck, 2, DType::kBF16), 27u * 2);
}

}  // namespace
}  // namespace ferry::runtime
