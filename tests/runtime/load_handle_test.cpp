// Runtime::start() and its LoadHandle: a load on a ferry thread that an engine can
// wait for (with or without a deadline), watch and cancel; a cancel issued once
// start() has returned is never lost; one load at a time; and nothing of a load is
// left once its results and handles are released.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gpu/host_device.hpp"
#include "models/model.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

// A gate a hook waits at until the test opens it (bounded, so a bug cannot hang).
class Gate {
 public:
  void wait() {
    reached_.store(true);
    for (int i = 0; i < 10'000 && !open_.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  void open() { open_.store(true); }
  bool reached() const { return reached_.load(); }
  // Waits (bounded) until a hook has reached the gate.
  bool await_reached() const {
    for (int i = 0; i < 10'000 && !reached_.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return reached_.load();
  }

 private:
  std::atomic<bool> open_{false};
  std::atomic<bool> reached_{false};
};

class LoadHandleTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    ck_ = new Checkpoint(synth_checkpoint(dir_->file("llama"), "llama"));
  }
  static void TearDownTestSuite() {
    delete ck_;
    delete dir_;
  }
  static LoadConfig config() { return make_config(ck_->dir, {"parallel.tp=2"}); }
  // A runtime whose copies wait at `gate` (RuntimeTestSeams::before_copy).
  static Runtime gated_runtime(Gate& gate, RuntimeTestSeams hooks = {}) {
    hooks.before_copy = [&gate](std::size_t, const std::string&) { gate.wait(); };
    return make_runtime(to_config(config()), hooks);
  }
  // Host devices whose allocations a test checks after everything is released.
  static std::vector<std::shared_ptr<gpu::Device>> devices() {
    return {gpu::make_host_device(0), gpu::make_host_device(1)};
  }
  static void expect_released(const std::vector<std::shared_ptr<gpu::Device>>& devices) {
    for (const auto& d : devices) {
      EXPECT_TRUE(d->stats().all_released()) << d->name();
    }
  }
  static TempDir* dir_;
  static Checkpoint* ck_;
};
TempDir* LoadHandleTest::dir_ = nullptr;
Checkpoint* LoadHandleTest::ck_ = nullptr;

TEST_F(LoadHandleTest, StartThenWaitIsALoadAndProgressEndsAtItsReport) {
  RuntimeTestSeams hooks;
  hooks.devices = devices();
  {
    Runtime rt = make_runtime(to_config(config()), hooks);
    LoadHandle h = rt.start();
    LoadResult r = h.wait();
    ASSERT_TRUE(r) << r.error->message;
    EXPECT_TRUE(h.done());
    EXPECT_EQ(h.wait().model, r.model);  // the same result on every call
    const LoadReport& rep = r.model->report();
    const LoadProgress p = h.progress();
    EXPECT_EQ(p.phase, LoadPhase::kDone);
    EXPECT_EQ(to_string(p.phase), "done");
    EXPECT_EQ(p.tensors_placed, rep.tensors.placed);
    EXPECT_GT(p.bytes_planned, 0u);
    EXPECT_EQ(p.bytes_read, p.bytes_planned);  // buffered reads: exactly the plan
    EXPECT_EQ(p.bytes_copied, rep.bytes_copied);
    // A plain load of the same config gives the same parameters.
    LoadResult again = rt.load();
    ASSERT_TRUE(again);
    for (std::size_t rank = 0; rank < 2; ++rank) {
      for (const LoadedParam& param : r.model->ranks()[rank].params) {
        EXPECT_EQ(r.model->read_param(rank, param.name), again.model->read_param(rank, param.name))
            << param.name;
      }
    }
  }
  expect_released(hooks.devices);
}

TEST_F(LoadHandleTest, WaitForTimesOutWhileTheLoadStreamsAndProgressShowsIt) {
  Gate gate;
  Runtime rt = gated_runtime(gate);
  LoadHandle h = rt.start();
  ASSERT_TRUE(gate.await_reached());
  EXPECT_EQ(h.wait_for(std::chrono::milliseconds(20)), std::nullopt);
  EXPECT_FALSE(h.done());
  const LoadProgress p = h.progress();
  EXPECT_EQ(p.phase, LoadPhase::kStream);
  EXPECT_GT(p.bytes_planned, 0u);
  EXPECT_GT(p.tensors_placed, 0u);
  gate.open();
  std::optional<LoadResult> r = h.wait_for(std::chrono::seconds(30));
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(*r) << r->error->message;
}

// A timeout too large for the clock is no deadline (hardening round two, 5): today's
// now() + milliseconds::max() wrapped into the past and returned nullopt at once.
TEST_F(LoadHandleTest, WaitForWithAHugeTimeoutWaitsForTheLoad) {
  using std::chrono::milliseconds;
  for (const milliseconds huge :
       {milliseconds::max(), milliseconds::max() - milliseconds(1),
        milliseconds(10'000'000'000'000'000)}) {  // 317,000 years: past steady_clock's range
    Gate gate;
    Runtime rt = gated_runtime(gate);
    LoadHandle h = rt.start();
    ASSERT_TRUE(gate.await_reached());
    auto waited = std::async(std::launch::async, [&h, huge] { return h.wait_for(huge); });
    // Still waiting while the load is held at its gate.
    EXPECT_EQ(waited.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
        << huge.count() << " ms returned at once";
    gate.open();
    ASSERT_EQ(waited.wait_for(std::chrono::seconds(60)), std::future_status::ready);
    const std::optional<LoadResult> r = waited.get();
    ASSERT_TRUE(r.has_value()) << huge.count() << " ms";
    EXPECT_TRUE(*r) << r->error->message;
  }
}

TEST_F(LoadHandleTest, WaitForWithANegativeTimeoutIsADeadlinePassed) {
  Gate gate;
  Runtime rt = gated_runtime(gate);
  LoadHandle h = rt.start();
  ASSERT_TRUE(gate.await_reached());
  EXPECT_EQ(h.wait_for(std::chrono::milliseconds(-5)), std::nullopt);
  EXPECT_EQ(h.wait_for(std::chrono::milliseconds::min()), std::nullopt);
  gate.open();
  const LoadResult r = h.wait();
  ASSERT_TRUE(r) << r.error->message;
  ASSERT_TRUE(h.wait_for(std::chrono::milliseconds::min()).has_value());  // ended: at once
}

TEST_F(LoadHandleTest, TheHandleCancelsItsLoad) {
  Gate gate;
  RuntimeTestSeams hooks;
  hooks.devices = devices();
  {
    Runtime rt = gated_runtime(gate, hooks);
    LoadHandle h = rt.start();
    ASSERT_TRUE(gate.await_reached());
    h.cancel();
    gate.open();
    LoadResult r = h.wait();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kCancelled) << r.error->message;
    EXPECT_EQ(h.progress().phase, LoadPhase::kFailed);
  }
  expect_released(hooks.devices);
}

TEST_F(LoadHandleTest, ACancelRightAfterStartIsNeverLost) {
  // The load is held in its plan phase (wrap_model runs there) until the cancel has
  // been issued: Runtime::cancel() right after start() must reach it every time.
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(round);
    Gate gate;
    RuntimeTestSeams hooks;
    hooks.wrap_model = [&](std::shared_ptr<const models::Model> m) {
      gate.wait();
      return m;
    };
    Runtime rt = make_runtime(to_config(config()), hooks);
    LoadHandle h = rt.start();
    rt.cancel();
    gate.open();
    LoadResult r = h.wait();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kCancelled);
  }
  // With no load in progress a cancel does nothing, and the next load runs.
  Runtime rt(to_config(config()));
  rt.cancel();
  EXPECT_TRUE(rt.load());
  rt.cancel();
  EXPECT_TRUE(rt.load());
}

TEST_F(LoadHandleTest, OneLoadAtATime) {
  Gate gate;
  Runtime rt = gated_runtime(gate);
  LoadHandle first = rt.start();
  ASSERT_TRUE(gate.await_reached());
  LoadHandle second = rt.start();
  ASSERT_TRUE(second.done());
  LoadResult refused = second.wait();
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error->stage, Stage::kConfig);
  EXPECT_THAT(refused.error->message, HasSubstr("a load is already running"));
  gate.open();
  EXPECT_TRUE(first.wait());
  EXPECT_TRUE(rt.start().wait());  // once it has ended, the next may start
}

TEST_F(LoadHandleTest, DestroyingTheRuntimeCancelsARunningLoad) {
  // A slow stream (every copy sleeps), then the Runtime goes: its destructor cancels
  // the load and waits for it, and the handle kept by the engine sees the end.
  RuntimeTestSeams hooks;
  hooks.devices = devices();
  hooks.before_copy = [](std::size_t, const std::string&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  };
  std::optional<LoadHandle> h;
  {
    Runtime rt = make_runtime(
        to_config(make_config(ck_->dir, {"parallel.tp=2", "io.chunk_bytes=8192"})), hooks);
    h = rt.start();
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  ASSERT_TRUE(h->done());
  LoadResult r = h->wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kCancelled);
  h.reset();
  expect_released(hooks.devices);
}

// Every (layer, tp rank) once, every progress snapshot in phase order, all on the
// callback thread and all before wait() returns; a DeepSeek layer is ready only
// when its MLA hook outputs are too.
TEST_F(LoadHandleTest, CallbacksSeeProgressAndEveryLayerOnEveryRank) {
  for (const char* family : {"llama", "deepseek_v3"}) {
    SCOPED_TRACE(family);
    TempDir dir;
    const Checkpoint ck =
        std::string(family) == "llama" ? *ck_ : synth_checkpoint(dir.file(family), family);
    const std::uint64_t layers = ck.config.at("num_hidden_layers").get<std::uint64_t>();
    std::mutex mu;
    std::map<std::pair<std::uint64_t, int>, int> ready;
    std::vector<LoadProgress> seen;
    std::set<std::thread::id> threads;
    LoadCallbacks cb;
    cb.on_layer_ready = [&](std::uint64_t layer, int tp_rank) {
      std::lock_guard lock(mu);
      ++ready[{layer, tp_rank}];
      threads.insert(std::this_thread::get_id());
    };
    cb.on_progress = [&](const LoadProgress& p) {
      std::lock_guard lock(mu);
      seen.push_back(p);
      threads.insert(std::this_thread::get_id());
      return true;
    };
    const std::vector<std::string> sets =
        std::string(family) == "llama" ? std::vector<std::string>{"parallel.tp=2"}
                                       : std::vector<std::string>{"parallel.tp=2", "parallel.ep=2"};
    Runtime rt(to_config(make_config(ck.dir, sets)));
    LoadHandle h = rt.start(cb);
    LoadResult r = h.wait();
    ASSERT_TRUE(r) << r.error->message;
    std::lock_guard lock(mu);
    EXPECT_EQ(ready.size(), layers * 2);
    for (std::uint64_t l = 0; l < layers; ++l) {
      for (int rank : {0, 1}) {
        EXPECT_EQ((ready[{l, rank}]), 1) << "layer " << l << " rank " << rank;
      }
    }
    ASSERT_GE(seen.size(), 2u);
    for (std::size_t i = 1; i < seen.size(); ++i) {
      EXPECT_LE(seen[i - 1].phase, seen[i].phase);
      EXPECT_LE(seen[i - 1].bytes_copied, seen[i].bytes_copied);
    }
    EXPECT_EQ(seen.back().phase, LoadPhase::kDone);
    EXPECT_EQ(seen.back().bytes_copied, r.model->report().bytes_copied);
    EXPECT_EQ(threads.size(), 1u);
    EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u);
  }
}

TEST_F(LoadHandleTest, AProgressCallbackCanCancel) {
  // The stream is held at its first copy until the callback, seeing the stream
  // phase, has asked to stop.
  std::atomic<bool> asked{false};
  LoadCallbacks cb;
  cb.on_progress = [&](const LoadProgress& p) {
    if (p.phase == LoadPhase::kStream) {
      asked.store(true);
      return false;
    }
    return true;
  };
  Gate gate;
  Runtime rt = gated_runtime(gate);
  LoadHandle h = rt.start(cb);
  for (int i = 0; i < 10'000 && !asked.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(asked.load());
  gate.open();
  LoadResult r = h.wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kCancelled) << r.error->message;
}

TEST_F(LoadHandleTest, ACallbackThatThrowsFailsTheLoadCleanly) {
  LoadCallbacks cb;
  cb.on_layer_ready = [](std::uint64_t layer, int) {
    if (layer == 1) {
      throw std::runtime_error("boom at layer 1");
    }
  };
  RuntimeTestSeams hooks;
  hooks.devices = devices();
  {
    Runtime rt = make_runtime(to_config(config()), hooks);
    LoadResult r = rt.start(cb).wait();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kCancelled);
    EXPECT_THAT(r.error->message, HasSubstr("on_layer_ready threw: boom at layer 1"));
  }
  expect_released(hooks.devices);
}

// Layers are announced as they land, not when the stream ends: with a slow stream,
// the first layer is ready while most bytes are still to be copied.
TEST_F(LoadHandleTest, LayersAreAnnouncedWhileTheStreamRuns) {
  std::atomic<LoadHandle*> handle{nullptr};
  std::atomic<std::uint64_t> copied_at_first{0};
  std::atomic<bool> first{true};
  LoadCallbacks cb;
  cb.on_layer_ready = [&](std::uint64_t, int) {
    if (first.exchange(false)) {
      while (handle.load() == nullptr) {
        std::this_thread::yield();
      }
      copied_at_first.store(handle.load()->progress().bytes_copied);
    }
  };
  RuntimeTestSeams hooks;
  hooks.before_copy = [](std::size_t, const std::string&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  // One read lane: with several, each reads its own files at once, and the first
  // layer completes only as late as the interleaving makes it.
  Runtime rt = make_runtime(
      to_config(make_config(ck_->dir, {"parallel.tp=2", "io.chunk_bytes=8192", "io.read_lanes=1"})),
      hooks);
  LoadHandle h = rt.start(cb);
  handle.store(&h);
  LoadResult r = h.wait();
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_FALSE(first.load());
  EXPECT_LT(copied_at_first.load(), r.model->report().bytes_copied / 2);
}

// A callback may call Runtime::cancel() while the Runtime is being destroyed (the
// destructor joins the load's thread without holding the lock cancel() takes).
TEST_F(LoadHandleTest, ACallbackMayCancelThroughTheRuntimeWhileItIsDestroyed) {
  std::atomic<Runtime*> rt_ptr{nullptr};
  LoadCallbacks cb;
  cb.on_progress = [&](const LoadProgress&) {
    if (Runtime* rt = rt_ptr.load()) {
      rt->cancel();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return true;
  };
  RuntimeTestSeams hooks;
  hooks.before_copy = [](std::size_t, const std::string&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  std::optional<LoadHandle> h;
  {
    Runtime rt = make_runtime(
        to_config(make_config(ck_->dir, {"parallel.tp=2", "io.chunk_bytes=8192"})), hooks);
    rt_ptr.store(&rt);
    h = rt.start(cb);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  rt_ptr.store(nullptr);
  ASSERT_TRUE(h->done());
  EXPECT_FALSE(h->wait());
}

}  // namespace
}  // namespace ferry::runtime
