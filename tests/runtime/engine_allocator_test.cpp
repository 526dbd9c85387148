// Parameters in memory the engine manages (runtime::Allocator): one allocation per
// parameter, every parameter inside the engine's memory, and everything given back
// once the model (and every view) is gone, after a failed load too; refusals name
// the parameter.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "ferry/dlpack.hpp"
#include "gpu/host_device.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/engine_memory.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::EngineMemory;
using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

class EngineAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override { ck_ = synth_checkpoint(dir_.file("ds"), "deepseek_v3"); }
  TempDir dir_;
  testing::Checkpoint ck_;
};

TEST_F(EngineAllocatorTest, EveryParameterLivesInTheEnginesMemoryUntilTheLastViewGoes) {
  auto engine = std::make_shared<EngineMemory>();
  RuntimeTestSeams hooks;
  hooks.devices = {gpu::make_host_device(0), gpu::make_host_device(1)};
  DLManagedTensor* view = nullptr;
  std::vector<std::byte> expected;
  {
    Runtime rt = make_runtime(to_config(make_config(ck_.dir, {"parallel.tp=2", "parallel.ep=2"})),
                              hooks, engine);
    LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
    std::size_t params = 0;
    for (std::size_t rank = 0; rank < r.model->ranks().size(); ++rank) {
      const LoadedRank& lr = r.model->ranks()[rank];
      for (const LoadedParam& p : lr.params) {
        EXPECT_TRUE(engine->holds(lr.device, p.data, p.nbytes)) << lr.device << " " << p.name;
        params += p.nbytes != 0 ? 1 : 0;
      }
    }
    EXPECT_EQ(static_cast<std::size_t>(engine->calls()), params);  // one call a parameter
    EXPECT_EQ(engine->live(), params);
    // The same bytes as a load into the devices' own memory.
    Runtime own(to_config(make_config(ck_.dir, {"parallel.tp=2", "parallel.ep=2"})));
    LoadResult o = own.load();
    ASSERT_TRUE(o);
    for (const LoadedParam& p : r.model->ranks()[1].params) {
      EXPECT_EQ(r.model->read_param(1, p.name), o.model->read_param(1, p.name)) << p.name;
    }
    view = to_dlpack(r.model, 0, "model.layers.0.self_attn.w_kc");
    expected = r.model->read_param(0, "model.layers.0.self_attn.w_kc");
  }
  // A DLPack view still holds the model, and so the engine's memory.
  EXPECT_GT(engine->live(), 0u);
  EXPECT_TRUE(engine->holds("host:0", view->dl_tensor.data, expected.size()));
  view->deleter(view);
  EXPECT_EQ(engine->live(), 0u);
  EXPECT_EQ(engine->bad_releases(), 0);
  for (const auto& d : hooks.devices) {
    EXPECT_TRUE(d->stats().all_released()) << d->name();
  }
}

TEST_F(EngineAllocatorTest, ARefusalOrAFailedLoadGivesEverythingBack) {
  {
    // The allocator refuses its sixth request: the load fails naming the parameter,
    // and the five it gave are back.
    auto engine = std::make_shared<EngineMemory>();
    engine->fail_after(5);
    Runtime rt = make_runtime(to_config(make_config(ck_.dir, {"parallel.tp=2"})), {}, engine);
    LoadResult r = rt.load();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kCopy);
    EXPECT_FALSE(r.error->tensor.empty());
    EXPECT_THAT(r.error->message,
                HasSubstr("the engine's Allocator refused: engine pool exhausted"));
    EXPECT_EQ(engine->calls(), 5);
    EXPECT_EQ(engine->live(), 0u);
  }
  {
    // An allocator that throws what is not a std::exception: the same clean error,
    // naming the parameter, and everything given back.
    class ThrowsInt final : public EngineMemory {
     public:
      void* allocate(const std::string& device, std::size_t bytes, std::size_t align) override {
        if (++n_ == 4) {
          throw 42;
        }
        return EngineMemory::allocate(device, bytes, align);
      }

     private:
      int n_ = 0;
    };
    auto engine = std::make_shared<ThrowsInt>();
    Runtime rt = make_runtime(to_config(make_config(ck_.dir, {"parallel.tp=2"})), {}, engine);
    LoadResult r = rt.load();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kCopy);
    EXPECT_FALSE(r.error->tensor.empty());
    EXPECT_THAT(r.error->message, HasSubstr("an exception that is not a std::exception"));
    EXPECT_EQ(engine->live(), 0u);
  }
  {
    // A copy fails mid-stream: every parameter goes back to the engine.
    auto engine = std::make_shared<EngineMemory>();
    RuntimeTestSeams hooks;
    int copies = 0;
    hooks.before_copy = [&](std::size_t, const std::string&) {
      if (++copies == 10) {
        throw std::runtime_error("injected copy failure");
      }
    };
    Runtime rt = make_runtime(to_config(make_config(ck_.dir, {"parallel.tp=2"})), hooks, engine);
    LoadResult r = rt.load();
    ASSERT_FALSE(r);
    EXPECT_GT(engine->calls(), 0);
    EXPECT_EQ(engine->live(), 0u);
    EXPECT_EQ(engine->bad_releases(), 0);
  }
  {
    // A null device keeps no data: it takes no engine memory.
    auto engine = std::make_shared<EngineMemory>();
    Runtime rt = make_runtime(to_config(make_config(ck_.dir, {"parallel.tp=2", "devices=null"})),
                              {}, engine);
    LoadResult r = rt.load();
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("a null device keeps no data"));
    EXPECT_EQ(engine->live(), 0u);
  }
}

}  // namespace
}  // namespace ferry::runtime
