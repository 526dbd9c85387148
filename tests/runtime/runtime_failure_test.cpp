// Loads that must fail (or be cancelled) cleanly: the error names the stage, the
// file and the tensor; afterwards every device allocation, stream and event of the
// injected host devices is released and every staging buffer went back (the
// counting allocator sees each one freed).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gpu/host_device.hpp"
#include "io/fault_injection.hpp"
#include "models/hooks.hpp"
#include "models/model.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/temp_dir.hpp"
#include "testing/with_hooks.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::CountingAllocator;
using testing::make_config;
using testing::rewrite_shard;
using testing::shard_of;
using testing::ShardEntry;
using testing::synth_checkpoint;
using testing::TempDir;

// Injected devices and staging memory whose release a test checks afterwards.
struct Harness {
  explicit Harness(int ranks) {
    gpu::HostDeviceOptions o;
    o.poison_allocations = true;
    for (int i = 0; i < ranks; ++i) {
      devices.push_back(gpu::make_host_device(i, o));
    }
    staging = std::make_shared<CountingAllocator>();
  }
  RuntimeTestSeams hooks() const {
    RuntimeTestSeams h;
    h.devices = devices;
    h.staging_allocator = staging;
    return h;
  }
  void expect_all_released() const {
    for (const auto& d : devices) {
      gpu::AllocationStats s = d->stats();
      EXPECT_TRUE(s.all_released())
          << d->name() << ": " << s.device.live_count << " allocations, " << s.live_streams
          << " streams, " << s.live_events << " events live";
    }
    EXPECT_EQ(staging->live(), 0) << "staging buffers not returned to the allocator";
  }
  std::vector<std::shared_ptr<gpu::Device>> devices;
  std::shared_ptr<CountingAllocator> staging;
};

ErrorInfo expect_failure(const LoadConfig& config, const RuntimeTestSeams& hooks) {
  Runtime rt = make_runtime(to_config(config), hooks);
  LoadResult r = rt.load();
  EXPECT_FALSE(r);
  EXPECT_EQ(r.model, nullptr);
  EXPECT_TRUE(r.error.has_value());
  return r.error.value_or(ErrorInfo{});
}

class FailureTest : public ::testing::Test {
 protected:
  void SetUp() override { ck_ = synth_checkpoint(dir_.file("ck"), "llama"); }
  TempDir dir_;
  Checkpoint ck_;
};

TEST_F(FailureTest, ReadErrorNamesTheFileAndTensor) {
  for (const char* engine : {"uring", "pread"}) {
    for (const char* lanes : {"1", "4"}) {  // one reader, or four side by side
      SCOPED_TRACE(std::string(engine) + " lanes " + lanes);
      Harness h(2);
      RuntimeTestSeams hooks = h.hooks();
      io::FaultPlan plan;
      plan.fail_read_number = 3;
      hooks.faults = std::make_shared<io::FaultInjector>(plan);
      ErrorInfo e = expect_failure(
          make_config(ck_.dir, {"parallel.tp=2", std::string("io.engine=") + engine,
                                std::string("io.read_lanes=") + lanes, "io.chunk_bytes=16KiB"}),
          hooks);
      EXPECT_EQ(e.stage, Stage::kRead) << e.message;
      EXPECT_NE(e.file.find(".safetensors"), std::string::npos) << e.message;
      EXPECT_FALSE(e.tensor.empty()) << e.message;
      EXPECT_TRUE(ck_.shapes.count(e.tensor)) << e.message;
      EXPECT_EQ(hooks.faults->faults_injected(), 1u);
      h.expect_all_released();
    }
  }
}

TEST_F(FailureTest, CopyFailureFromBeforeCopyNamesTensorAndParam) {
  Harness h(2);
  RuntimeTestSeams hooks = h.hooks();
  std::atomic<int> calls{0};
  hooks.before_copy = [&](std::size_t, const std::string&) {
    if (++calls == 5) {
      throw std::runtime_error("injected copy failure");
    }
  };
  ErrorInfo e = expect_failure(make_config(ck_.dir, {"parallel.tp=2"}), hooks);
  EXPECT_EQ(e.stage, Stage::kCopy) << e.message;
  EXPECT_NE(e.message.find("injected copy failure"), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("into parameter "), std::string::npos) << e.message;
  EXPECT_TRUE(ck_.shapes.count(e.tensor)) << e.message;
  EXPECT_NE(e.file.find(".safetensors"), std::string::npos) << e.message;
  h.expect_all_released();
}

TEST_F(FailureTest, TruncatedShardFailsAtTheHeaderStage) {
  const std::string shard = "model-00002-of-00004.safetensors";
  const std::string path = ck_.dir + "/" + shard;
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  Harness h(2);
  ErrorInfo e = expect_failure(make_config(ck_.dir, {"parallel.tp=2"}), h.hooks());
  EXPECT_EQ(e.stage, Stage::kHeader) << e.message;
  EXPECT_NE(e.message.find(shard), std::string::npos) << e.message;
  h.expect_all_released();
}

TEST_F(FailureTest, ShardTruncatedDuringTheLoadFailsTheRead) {
  Harness h(2);
  RuntimeTestSeams hooks = h.hooks();
  const std::string first = ck_.dir + "/model-00001-of-00004.safetensors";
  std::atomic<bool> once{false};
  hooks.before_copy = [&](std::size_t, const std::string&) {
    if (!once.exchange(true)) {
      // Staging is 2 chunks of 4 KiB: the reader is still in the first shard, which
      // its lane holds open; its next reads come up short.
      std::filesystem::resize_file(first, 10000);
    }
  };
  ErrorInfo e = expect_failure(
      make_config(ck_.dir, {"parallel.tp=2", "io.chunk_bytes=4096", "io.staging_bytes=8192"}),
      hooks);
  EXPECT_EQ(e.stage, Stage::kRead) << e.message;
  EXPECT_NE(e.file.find("model-00001-of-00004.safetensors"), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("truncated"), std::string::npos) << e.message;
  EXPECT_FALSE(e.tensor.empty());
  h.expect_all_released();
}

TEST_F(FailureTest, ShardTruncatedBeforeItsFirstReadIsRefusedBeforeAByteOfItIsRead) {
  Harness h(2);
  RuntimeTestSeams hooks = h.hooks();
  const std::string last = ck_.dir + "/model-00004-of-00004.safetensors";
  std::atomic<bool> once{false};
  hooks.before_copy = [&](std::size_t, const std::string&) {
    if (!once.exchange(true)) {
      // The reader is still in the first shard: a lane opens the last one only for
      // its first read, and finds it is not the file its header described.
      std::filesystem::resize_file(last, 10000);
    }
  };
  ErrorInfo e = expect_failure(
      make_config(ck_.dir, {"parallel.tp=2", "io.chunk_bytes=4096", "io.staging_bytes=8192"}),
      hooks);
  EXPECT_EQ(e.stage, Stage::kRead) << e.message;
  EXPECT_NE(e.file.find("model-00004-of-00004.safetensors"), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("changed since its header was read (size"), std::string::npos)
      << e.message;
  h.expect_all_released();
}

TEST_F(FailureTest, ShapeMismatchNamesWeightAndParameter) {
  const std::string name = "model.layers.1.self_attn.o_proj.weight";
  rewrite_shard(ck_.dir, shard_of(ck_.dir, name), [&](std::vector<ShardEntry>& entries) {
    for (ShardEntry& e : entries) {
      if (e.name == name) {
        e.shape = {128, 64};
        e.bytes.resize(128 * 64 * 2);
      }
    }
  });
  Harness h(2);
  ErrorInfo e = expect_failure(make_config(ck_.dir, {"parallel.tp=2"}), h.hooks());
  EXPECT_EQ(e.stage, Stage::kPlacement) << e.message;
  EXPECT_EQ(e.tensor, name);
  EXPECT_NE(e.message.find("Attempted to load weight " + name), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("into parameter " + name), std::string::npos) << e.message;
  EXPECT_EQ(e.file, shard_of(ck_.dir, name));
  h.expect_all_released();
}

TEST_F(FailureTest, StrictRejectsAnUnknownName) {
  rewrite_shard(ck_.dir, shard_of(ck_.dir, "model.norm.weight"), [](std::vector<ShardEntry>& e) {
    e.push_back({"model.vision_tower.weight", DType::kBF16, {8}, std::string(16, '\0')});
  });
  Harness h(2);
  ErrorInfo e =
      expect_failure(make_config(ck_.dir, {"parallel.tp=2", "load.strict=true"}), h.hooks());
  EXPECT_EQ(e.stage, Stage::kMapping) << e.message;
  EXPECT_EQ(e.tensor, "model.vision_tower.weight");
  EXPECT_EQ(e.file, shard_of(ck_.dir, "model.norm.weight"));
  h.expect_all_released();
}

TEST_F(FailureTest, AParamNothingFillsIsListedBeforeReading) {
  const std::string gone = "model.layers.2.mlp.down_proj.weight";
  rewrite_shard(ck_.dir, shard_of(ck_.dir, gone), [&](std::vector<ShardEntry>& entries) {
    std::erase_if(entries, [&](const ShardEntry& e) { return e.name == gone; });
  });
  Harness h(2);
  RuntimeTestSeams hooks = h.hooks();
  std::atomic<int> copies{0};
  hooks.before_copy = [&](std::size_t, const std::string&) { ++copies; };
  ErrorInfo e = expect_failure(make_config(ck_.dir, {"parallel.tp=2"}), hooks);
  EXPECT_EQ(e.stage, Stage::kMapping) << e.message;
  EXPECT_NE(e.message.find(gone), std::string::npos) << e.message;
  EXPECT_NE(e.file.find("ck"), std::string::npos) << e.message;
  EXPECT_EQ(copies.load(), 0) << "the load must fail before streaming";
  EXPECT_EQ(h.staging->total(), 0) << "no staging memory is needed to fail the plan";
  h.expect_all_released();
}

// Something on the loading thread throws what is not a std::exception (here a test
// hook; in an engine, say, a callback of its own): the load fails with a clear
// error instead of the exception escaping the load's thread (std::terminate), and
// the same Runtime loads next.
TEST_F(FailureTest, ANonStandardExceptionIsAFailedLoadNotATerminate) {
  Harness h(0);
  RuntimeTestSeams hooks = h.hooks();
  bool thrown = false;
  hooks.wrap_model = [&thrown](std::shared_ptr<const models::Model> m) {
    if (!thrown) {
      thrown = true;
      throw 42;
    }
    return m;
  };
  Runtime rt = make_runtime(to_config(make_config(ck_.dir, {"parallel.tp=2"})), hooks);
  LoadResult r = rt.load();
  ASSERT_FALSE(r);
  EXPECT_NE(r.error->message.find("an exception that is not a std::exception"), std::string::npos)
      << r.error->message;
  EXPECT_EQ(rt.state(), RuntimeState::kFailed);
  h.expect_all_released();
  EXPECT_TRUE(rt.load()) << "the same Runtime loads next";
}

TEST_F(FailureTest, DeviceOutOfMemoryFreesWhatWasAllocated) {
  gpu::HostDeviceOptions o;
  o.capacity_bytes = 300000;  // less than one rank's share
  Harness h(0);
  h.devices = {gpu::make_host_device(0, o), gpu::make_host_device(1, o)};
  ErrorInfo e = expect_failure(make_config(ck_.dir, {"parallel.tp=2"}), h.hooks());
  EXPECT_EQ(e.stage, Stage::kCopy) << e.message;
  EXPECT_NE(e.message.find("out of memory"), std::string::npos) << e.message;
  EXPECT_FALSE(e.tensor.empty());
  h.expect_all_released();
}

TEST_F(FailureTest, CancelFromBeforeCopyAtSeveralPoints) {
  for (int at : {1, 9, 40, 120}) {
    SCOPED_TRACE("cancel at copy " + std::to_string(at));
    Harness h(4);
    RuntimeTestSeams hooks = h.hooks();
    Runtime* rt_ptr = nullptr;
    std::atomic<int> calls{0};
    hooks.before_copy = [&](std::size_t, const std::string&) {
      if (++calls == at) {
        rt_ptr->cancel();
      }
    };
    Runtime rt = make_runtime(
        to_config(make_config(ck_.dir,
                              {"parallel.tp=4", "io.chunk_bytes=8192", "io.staging_bytes=24576"})),
        hooks);
    rt_ptr = &rt;
    LoadResult r = rt.load();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kCancelled) << r.error->message;
    h.expect_all_released();
  }
}

TEST_F(FailureTest, CancelFromAnotherThreadAtRandomTimes) {
  // A bandwidth cap keeps the stream going for tens of milliseconds.
  std::vector<int> delays_us = {0, 700, 2000, 5000, 12000, 30000};
  int cancelled = 0;
  for (int delay : delays_us) {
    SCOPED_TRACE("cancel after " + std::to_string(delay) + " us");
    gpu::HostDeviceOptions o;
    o.bandwidth_gbps = 0.05;
    Harness h(0);
    h.devices = {gpu::make_host_device(0, o), gpu::make_host_device(1, o)};
    Runtime rt = make_runtime(
        to_config(make_config(ck_.dir, {"parallel.tp=2", "io.chunk_bytes=16384"})), h.hooks());
    std::thread canceller([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
      rt.cancel();
    });
    LoadResult r = rt.load();
    canceller.join();
    if (r) {
      // The cancel came before the load was started (no load in progress, so it did
      // nothing) or after it ended.
      r.model.reset();
    } else {
      EXPECT_EQ(r.error->stage, Stage::kCancelled) << r.error->message;
      ++cancelled;
    }
    h.expect_all_released();
  }
  EXPECT_GT(cancelled, 0);
}

TEST_F(FailureTest, CancelBeforeLoadDoesNotAffectTheNextLoad) {
  Harness h(1);
  Runtime rt = make_runtime(to_config(make_config(ck_.dir, {"parallel.tp=1"})), h.hooks());
  rt.cancel();
  LoadResult r = rt.load();
  EXPECT_TRUE(r) << (r.error ? r.error->message : "");
}

TEST_F(FailureTest, HooksRunAfterTheirInputsAndTheirFailuresAbort) {
  const std::string input = "model.layers.0.self_attn.qkv_proj.weight";
  for (bool fail : {false, true}) {
    SCOPED_TRACE(fail ? "failing hook" : "checking hook");
    Harness h(2);
    RuntimeTestSeams hooks = h.hooks();
    std::atomic<int> ran{0};
    std::atomic<int> complete{0};
    hooks.wrap_model = [&](std::shared_ptr<const models::Model> base) {
      std::vector<models::PostLoadHook> extra;
      for (std::size_t r = 0; r < base->shells().size(); ++r) {
        const models::RankShell& shell = base->shells()[r];
        const std::size_t index = shell.by_name.at(input);
        const std::uint64_t nbytes = shell.params[index].nbytes;
        models::PostLoadHook hook;
        hook.name = "check-qkv-" + std::to_string(r);
        hook.local_rank = r;
        hook.inputs = {index};
        hook.run = [&, index, nbytes, fail](models::HookContext& ctx) {
          ++ran;
          if (fail) {
            throw std::runtime_error("injected hook failure");
          }
          // The input is complete: no poison byte is left in it.
          std::vector<std::byte> host(nbytes);
          ctx.stream().copy_d2h(host.data(), ctx.param_data(index), nbytes);
          ctx.stream().synchronize();
          std::size_t poison = 0;
          for (std::size_t i = 0; i + 1 < host.size(); i += 2) {
            poison += host[i] == gpu::kPoisonByte && host[i + 1] == gpu::kPoisonByte;
          }
          if (poison == 0) {
            ++complete;
          }
        };
        extra.push_back(std::move(hook));
      }
      return std::shared_ptr<const models::Model>(ferry::testing::with_hooks(base, std::move(extra)));
    };
    Runtime rt = make_runtime(
        to_config(make_config(ck_.dir, {"parallel.tp=2", "io.chunk_bytes=4096"})), hooks);
    LoadResult r = rt.load();
    if (fail) {
      ASSERT_FALSE(r);
      EXPECT_EQ(r.error->stage, Stage::kPostProcess) << r.error->message;
      EXPECT_NE(r.error->message.find("injected hook failure"), std::string::npos);
      EXPECT_NE(r.error->message.find("check-qkv-"), std::string::npos);
    } else {
      ASSERT_TRUE(r) << r.error->message;
      EXPECT_EQ(ran.load(), 2);
      EXPECT_EQ(complete.load(), 2);
      r.model.reset();
    }
    h.expect_all_released();
  }
}

TEST_F(FailureTest, ConfigProblemsAreReportedNotThrown) {
  Harness h(1);
  ErrorInfo e = expect_failure(make_config(dir_.file("nowhere"), {}), h.hooks());
  EXPECT_EQ(e.stage, Stage::kDiscovery) << e.message;
  std::filesystem::remove(ck_.dir + "/config.json");
  e = expect_failure(make_config(ck_.dir, {}), h.hooks());
  EXPECT_EQ(e.stage, Stage::kConfig) << e.message;
  EXPECT_NE(e.file.find("config.json"), std::string::npos);
  // Two devices for one local rank.
  synth_checkpoint(dir_.file("ck2"), "llama");
  Harness two(2);
  e = expect_failure(make_config(dir_.file("ck2"), {"parallel.tp=1"}), two.hooks());
  EXPECT_EQ(e.stage, Stage::kConfig) << e.message;
  two.expect_all_released();
}

}  // namespace
}  // namespace ferry::runtime
