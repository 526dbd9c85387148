// Capture-safe startup (Runtime::prepare() / commit()): the sentinel shells, the
// storage manifest and what it must catch, admission and its refusal codes, the
// state machine, byte equality with a serial load for every family and layout the
// contract tests cover, and cancellation at every point with everything given back.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpu/host_device.hpp"
#include "models/hooks.hpp"
#include "models/model.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/engine_memory.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/faulty_device.hpp"
#include "testing/temp_dir.hpp"
#include "testing/with_hooks.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::EngineMemory;
using ::testing::HasSubstr;
using testing::make_config;
using ::testing::Not;
using testing::synth_checkpoint;
using testing::TempDir;

LoadConfig config_for(const std::string& dir, std::vector<std::string> sets,
                      const std::string& mode) {
  sets.push_back("startup.mode=" + mode);
  return make_config(dir, sets);
}

// 1e-3 as the test writes it out by hand: F32 0x3A83126F; BF16 keeps the top half
// (the dropped half, 0x126F, is below the halfway point).
bool entirely_sentinel(const std::vector<std::byte>& bytes, DType dtype) {
  std::vector<std::byte> element;
  if (dtype == DType::kBF16) {
    element = {std::byte{0x83}, std::byte{0x3A}};
  } else if (dtype == DType::kF32) {
    element = {std::byte{0x6F}, std::byte{0x12}, std::byte{0x83}, std::byte{0x3A}};
  } else {
    ADD_FAILURE() << "no hand-written sentinel for " << dtype_name(dtype);
    return false;
  }
  if (bytes.empty() || bytes.size() % element.size() != 0) {
    return false;
  }
  for (std::size_t i = 0; i < bytes.size(); i += element.size()) {
    if (std::memcmp(bytes.data() + i, element.data(), element.size()) != 0) {
      return false;
    }
  }
  return true;
}

// Waits (bounded) until a condition holds: a load's thread drops its last
// references just after the handle says it ended.
template <class F>
bool eventually(F&& condition) {
  for (int i = 0; i < 500; ++i) {
    if (condition()) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return condition();
}

class StartupTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    for (const char* family :
         {"llama", "qwen2", "mistral", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"}) {
      (*checkpoints_)[family] = synth_checkpoint(dir_->file(family), family, false, 7);
    }
  }
  static void TearDownTestSuite() {
    checkpoints_->clear();
    delete dir_;
    dir_ = nullptr;
  }
  static const Checkpoint& ck(const std::string& family) { return checkpoints_->at(family); }

  static TempDir* dir_;
  static std::map<std::string, Checkpoint>* checkpoints_;
};
TempDir* StartupTest::dir_ = nullptr;
std::map<std::string, Checkpoint>* StartupTest::checkpoints_ =
    new std::map<std::string, Checkpoint>();

// ---- the sentinel shells and the boot sequence ------------------------------------

TEST_F(StartupTest, PrepareHandsOverSentinelShellsThatCommitFillsInPlace) {
  Runtime rt(
      to_config(config_for(ck("deepseek_v3").dir, {"parallel.tp=2", "parallel.ep=2"}, "overlap")));
  EXPECT_EQ(rt.state(), RuntimeState::kCreated);
  LoadHandle prepare = rt.prepare();
  LoadResult prepared = prepare.wait();
  ASSERT_TRUE(prepared) << prepared.error->message;
  EXPECT_EQ(rt.state(), RuntimeState::kPrepared);
  std::shared_ptr<LoadedModel> model = prepared.model;
  EXPECT_EQ(model->report().startup_mode, "overlap");
  EXPECT_TRUE(model->report().startup_refusals.empty());

  // Every floating-point parameter holds the sentinel, the MLA split's outputs too
  // (the hook ran on the sentinel kv_b_proj).
  std::size_t params = 0;
  bool saw_w_kc = false;
  for (std::size_t r = 0; r < model->ranks().size(); ++r) {
    for (const LoadedParam& p : model->ranks()[r].params) {
      if (p.nbytes == 0) {
        continue;
      }
      ++params;
      saw_w_kc = saw_w_kc || p.name.find("w_kc") != std::string::npos;
      EXPECT_TRUE(entirely_sentinel(model->read_param(r, p.name), p.dtype)) << p.name;
    }
  }
  EXPECT_TRUE(saw_w_kc);
  // The manifest has every parameter and derived buffer, where the views say.
  const std::vector<ParamView> views = model->views();
  ASSERT_EQ(model->manifest().size(), views.size());
  EXPECT_GE(views.size(), params);
  for (std::size_t i = 0; i < views.size(); ++i) {
    const ManifestEntry& e = model->manifest()[i];
    EXPECT_EQ(e.name, views[i].name);
    EXPECT_EQ(e.data, views[i].data);
    EXPECT_EQ(e.shape, views[i].shape);
    EXPECT_EQ(e.strides, views[i].strides);
    EXPECT_EQ(e.device, views[i].device);
    EXPECT_EQ(e.byte_offset, 0u);  // one allocation per parameter
  }

  LoadResult ready = rt.commit().wait();
  ASSERT_TRUE(ready) << ready.error->message;
  EXPECT_EQ(rt.state(), RuntimeState::kReady);
  EXPECT_EQ(ready.model, model);  // the same model, in the same storage
  const std::vector<ParamView> after = model->views();
  ASSERT_EQ(after.size(), views.size());
  for (std::size_t i = 0; i < views.size(); ++i) {
    EXPECT_EQ(after[i].data, views[i].data) << views[i].name;
  }
  const LoadReport& report = model->report();
  EXPECT_GT(report.bytes_copied, 0u);
  EXPECT_GT(report.startup.time_to_ready, 0);
  EXPECT_GE(report.startup.time_to_ready, report.startup.prepare + report.startup.commit);
  EXPECT_EQ(to_json(report)["startup_mode"], "overlap");

  // A second commit, or a start() on top, is a clear error in the ready state...
  LoadResult again = rt.commit().wait();
  ASSERT_FALSE(again);
  EXPECT_THAT(again.error->message, HasSubstr("commit() needs a prepared model"));
  EXPECT_THAT(again.error->message, HasSubstr("ready"));
  EXPECT_EQ(rt.state(), RuntimeState::kReady);  // a refused call changes nothing
}

TEST_F(StartupTest, OverlapThenCommitIsByteIdenticalToASerialLoadForEveryFamilyAndLayout) {
  struct Case {
    std::string family;
    std::vector<std::string> sets;
  };
  const std::vector<Case> cases = {
      {"llama", {}},
      {"llama", {"parallel.tp=2"}},
      {"llama", {"parallel.pp=2", "parallel.pp_rank=1"}},
      {"qwen2", {"parallel.tp=2"}},
      {"mistral", {"parallel.tp=2"}},
      {"mixtral", {"parallel.tp=2", "parallel.ep=2"}},
      {"mixtral", {"parallel.tp=4"}},
      {"qwen3_moe", {"parallel.tp=4", "parallel.ep=2", "parallel.ranks=1,2"}},
      {"qwen2_moe", {"parallel.tp=2", "parallel.ep=2"}},
      {"deepseek_v3", {}},
      {"deepseek_v3", {"parallel.tp=2", "parallel.ep=2"}},
      {"deepseek_v3", {"parallel.tp=2", "parallel.pp=2", "parallel.pp_rank=0"}},
      {"deepseek_v3", {"model.draft=true"}},
  };
  for (const Case& c : cases) {
    std::string what = c.family;
    for (const std::string& s : c.sets) {
      what += " " + s;
    }
    SCOPED_TRACE(what);
    Runtime serial(to_config(make_config(ck(c.family).dir, c.sets)));
    LoadResult expected = serial.load();
    ASSERT_TRUE(expected) << expected.error->message;

    Runtime rt(to_config(config_for(ck(c.family).dir, c.sets, "overlap")));
    LoadResult prepared = rt.prepare().wait();
    ASSERT_TRUE(prepared) << prepared.error->message;
    LoadResult ready = rt.commit().wait();
    ASSERT_TRUE(ready) << ready.error->message;
    EXPECT_EQ(ready.model->report().startup_mode, "overlap");
    EXPECT_EQ(testing::param_bytes(*ready.model), testing::param_bytes(*expected.model));
  }
}

TEST_F(StartupTest, SerialModeLoadsInPrepareAndCommitOnlyVerifies) {
  const Checkpoint& c = ck("qwen2");
  Runtime serial(to_config(make_config(c.dir, {"parallel.tp=2"})));
  LoadResult expected = serial.load();
  ASSERT_TRUE(expected);

  Runtime rt(to_config(config_for(c.dir, {"parallel.tp=2"}, "serial")));
  LoadResult prepared = rt.prepare().wait();
  ASSERT_TRUE(prepared) << prepared.error->message;
  // The real weights are already there: nothing waits for commit().
  EXPECT_EQ(testing::param_bytes(*prepared.model), testing::param_bytes(*expected.model));
  EXPECT_EQ(prepared.model->report().startup_mode, "serial");
  EXPECT_GT(prepared.model->report().bytes_copied, 0u);
  const std::uint64_t copied = prepared.model->report().bytes_copied;
  LoadResult ready = rt.commit().wait();
  ASSERT_TRUE(ready) << ready.error->message;
  EXPECT_EQ(ready.model->report().bytes_copied, copied);  // nothing streamed again
  EXPECT_EQ(ready.model->report().startup.bytes_prefetched, 0u);
  EXPECT_EQ(testing::param_bytes(*ready.model), testing::param_bytes(*expected.model));
}

// ---- admission ------------------------------------------------------------------

// A hook on local rank 0 that copies nothing (inputs and outputs both empty would
// be refused): it reads param `in`, and declares the given properties.
std::shared_ptr<const models::Model> with_flagged_hook(std::shared_ptr<const models::Model> base,
                                                       bool idempotent, bool reallocates) {
  const auto& params = base->shells()[0].params;
  std::size_t in = 0;
  while (params[in].nbytes == 0) {
    ++in;
  }
  models::PostLoadHook h;
  h.name = "test.flagged";
  h.local_rank = 0;
  h.inputs = {in};
  h.idempotent = idempotent;
  h.reallocates = reallocates;
  h.run = [](models::HookContext&) {};
  return ferry::testing::with_hooks(std::move(base), {h});
}

TEST_F(StartupTest, OverlapFailsWithEachRefusalCodeAndAutoRunsSerially) {
  const std::string dir = ck("llama").dir;
  struct Case {
    std::vector<std::string> sets;
    bool idempotent = true;
    bool reallocates = false;
    std::vector<std::string> codes;
  };
  const std::vector<Case> cases = {
      {{"io.direct=true"}, true, false, {"io_direct"}},
      {{"devices=null"}, true, false, {"backend"}},
      {{}, false, false, {"hook_not_idempotent"}},
      {{}, true, true, {"hook_reallocates"}},
      {{"io.direct=true", "devices=null"},
       false,
       true,
       {"backend", "io_direct", "hook_not_idempotent", "hook_reallocates"}},
  };
  for (const Case& c : cases) {
    std::string what;
    for (const std::string& code : c.codes) {
      what += code + " ";
    }
    SCOPED_TRACE(what);
    RuntimeTestSeams hooks;
    hooks.wrap_model = [&c](std::shared_ptr<const models::Model> base) {
      return with_flagged_hook(std::move(base), c.idempotent, c.reallocates);
    };
    {
      Runtime rt = make_runtime(to_config(config_for(dir, c.sets, "overlap")), hooks);
      LoadResult r = rt.prepare().wait();
      ASSERT_FALSE(r);
      EXPECT_EQ(r.error->stage, Stage::kConfig);
      EXPECT_THAT(r.error->message, HasSubstr("startup.mode overlap refused"));
      for (const std::string& code : c.codes) {
        EXPECT_THAT(r.error->message, HasSubstr(code + ": "));
      }
      EXPECT_EQ(rt.state(), RuntimeState::kFailed);
    }
    Runtime rt = make_runtime(to_config(config_for(dir, c.sets, "auto")), hooks);
    LoadResult r = rt.prepare().wait();
    ASSERT_TRUE(r) << r.error->message;
    EXPECT_EQ(r.model->report().startup_mode, "serial");
    std::vector<std::string> codes;
    for (const StartupRefusal& refusal : r.model->report().startup_refusals) {
      codes.push_back(refusal.code);
      EXPECT_FALSE(refusal.message.empty());
    }
    EXPECT_EQ(codes, c.codes);
    const nlohmann::json j = to_json(r.model->report());
    EXPECT_EQ(j["startup_refusals"].size(), c.codes.size());
    ASSERT_TRUE(rt.commit().wait());
  }
  // Nothing to refuse: auto overlaps.
  Runtime rt(to_config(config_for(dir, {}, "auto")));
  LoadResult r = rt.prepare().wait();
  ASSERT_TRUE(r);
  EXPECT_EQ(r.model->report().startup_mode, "overlap");
  EXPECT_TRUE(rt.commit().wait());
}

// ---- what the manifest catches ---------------------------------------------------

TEST_F(StartupTest, TheManifestCatchesReplacedStorageAndChangedStridesOrDtypes) {
  const std::string dir = ck("llama").dir;
  auto other = gpu::make_host_device(7);
  gpu::DeviceAllocation elsewhere = other->allocate(1 << 20);
  struct Case {
    std::string what;
    std::function<void(std::vector<LoadedRank>&)> edit;
    std::string param;
  };
  const std::vector<Case> cases = {
      {"pointer",
       [&](std::vector<LoadedRank>& ranks) { ranks[0].params[1].data = elsewhere.data(); }, ""},
      {"strides", [](std::vector<LoadedRank>& ranks) { ranks[0].params[2].strides.back() = 2; },
       ""},
      {"dtype", [](std::vector<LoadedRank>& ranks) { ranks[0].params[3].dtype = DType::kF16; }, ""},
  };
  for (const std::string mode : {"overlap", "serial"}) {
    for (std::size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(mode + std::string(" ") + cases[i].what);
      RuntimeTestSeams hooks;
      std::string victim;
      hooks.before_startup_verify = [&](std::vector<LoadedRank>& ranks) {
        victim = ranks[0].params[i + 1].name;
        cases[i].edit(ranks);
      };
      Runtime rt = make_runtime(to_config(config_for(dir, {}, mode)), hooks);
      ASSERT_TRUE(rt.prepare().wait());
      LoadResult r = rt.commit().wait();
      ASSERT_FALSE(r);
      EXPECT_EQ(r.error->stage, Stage::kVerify);
      EXPECT_THAT(r.error->message, HasSubstr("1 storage manifest entr(ies) changed"));
      EXPECT_THAT(r.error->message, HasSubstr(victim + " (tp rank 0): " + cases[i].what));
      EXPECT_THAT(r.error->message, Not(HasSubstr("sentinel")));
      EXPECT_EQ(rt.state(), RuntimeState::kFailed);
    }
  }
}

// A model whose routes drop one tensor and whose hook claims that tensor's
// parameter but writes nothing: the plan is satisfied, yet after commit the
// parameter is exactly as prepare() left it, as if its tensor never arrived.
class NeverArrives final : public models::Model {
 public:
  NeverArrives(std::shared_ptr<const models::Model> base, std::string tensor)
      : base_(std::move(base)), tensor_(std::move(tensor)) {}
  std::string family() const override { return base_->family(); }
  const models::ParallelLayout& layout() const override { return base_->layout(); }
  const std::vector<models::RankShell>& shells() const override { return base_->shells(); }
  models::Route route(const io::TensorInfo& tensor) const override {
    if (tensor.name == tensor_) {
      models::Route r;
      r.kind = models::RouteKind::kDropped;
      r.reason = "test_never_arrives";
      return r;
    }
    return base_->route(tensor);
  }
  std::vector<models::Piece> fill_pieces() const override { return base_->fill_pieces(); }
  std::vector<models::PostLoadHook> hooks() const override { return base_->hooks(); }

 private:
  std::shared_ptr<const models::Model> base_;
  std::string tensor_;
};

TEST_F(StartupTest, AParameterNothingWroteStaysSentinelAndCommitNamesIt) {
  const std::string victim = "model.layers.1.post_attention_layernorm.weight";
  RuntimeTestSeams hooks;
  hooks.wrap_model = [&](std::shared_ptr<const models::Model> base) {
    const auto& params = base->shells()[0].params;
    std::size_t index = 0;
    while (params.at(index).name != victim) {
      ++index;
    }
    models::PostLoadHook h;
    h.name = "test.claims_but_writes_nothing";
    h.outputs = {index};
    h.run = [](models::HookContext&) {};
    auto dropped = std::make_shared<NeverArrives>(std::move(base), victim);
    return std::shared_ptr<const models::Model>(ferry::testing::with_hooks(dropped, {h}));
  };
  Runtime rt = make_runtime(to_config(config_for(ck("llama").dir, {}, "overlap")), hooks);
  LoadResult prepared = rt.prepare().wait();
  ASSERT_TRUE(prepared) << prepared.error->message;
  LoadResult r = rt.commit().wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kVerify);
  EXPECT_THAT(r.error->message,
              HasSubstr("1 floating-point parameter(s) still hold only the sentinel"));
  EXPECT_THAT(r.error->message, HasSubstr(victim + " (tp rank 0)"));
  EXPECT_THAT(r.error->message, Not(HasSubstr("manifest")));
  // The prepared model is still valid memory (graphs may point at it).
  EXPECT_TRUE(entirely_sentinel(prepared.model->read_param(0, victim), DType::kBF16));
}

TEST_F(StartupTest, TheManifestCatchesAHookThatReallocated) {
  // Admission refuses such a hook; skipping admission shows the manifest would
  // still catch it: the hook moves its output when it runs on the real weights.
  RuntimeTestSeams hooks;
  hooks.skip_startup_admission = true;
  std::string output;
  auto runs = std::make_shared<std::atomic<int>>(0);
  hooks.wrap_model = [&](std::shared_ptr<const models::Model> base) {
    const auto& params = base->shells()[0].params;
    std::size_t in = 0, out = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].name == "model.layers.0.input_layernorm.weight") {
        in = i;
      }
      if (params[i].name == "model.layers.0.post_attention_layernorm.weight") {
        out = i;
      }
    }
    output = params[out].name;
    // The output's tensor goes elsewhere; the hook copies the input into it.
    auto dropped = std::make_shared<NeverArrives>(base, output);
    models::PostLoadHook h;
    h.name = "test.reallocating_copy";
    h.inputs = {in};
    h.outputs = {out};
    h.reallocates = true;
    const std::size_t bytes = params[in].nbytes;
    h.run = [in, out, bytes, runs](models::HookContext& ctx) {
      std::byte* dst = ++*runs > 1 ? ctx.reallocate(out) : ctx.param_data(out);
      std::vector<std::byte> host(bytes);
      ctx.stream().copy_d2h(host.data(), ctx.param_data(in), bytes);
      ctx.stream().synchronize();
      ctx.stream().copy_h2d(dst, host.data(), bytes);
    };
    return std::shared_ptr<const models::Model>(ferry::testing::with_hooks(dropped, {h}));
  };
  Runtime rt = make_runtime(to_config(config_for(ck("llama").dir, {}, "overlap")), hooks);
  ASSERT_TRUE(rt.prepare().wait());
  LoadResult r = rt.commit().wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(runs->load(), 2);
  EXPECT_EQ(r.error->stage, Stage::kVerify);
  EXPECT_THAT(r.error->message, HasSubstr(output + " (tp rank 0): pointer"));

  // Without the declaration the hook cannot reallocate at all.
  hooks.wrap_model = [&](std::shared_ptr<const models::Model> base) {
    models::PostLoadHook h;
    h.name = "test.undeclared";
    h.inputs = {0};
    h.run = [](models::HookContext& ctx) { ctx.reallocate(0); };
    return std::shared_ptr<const models::Model>(ferry::testing::with_hooks(std::move(base), {h}));
  };
  Runtime undeclared = make_runtime(to_config(config_for(ck("llama").dir, {}, "overlap")), hooks);
  LoadResult u = undeclared.prepare().wait();
  ASSERT_FALSE(u);
  EXPECT_EQ(u.error->stage, Stage::kPostProcess);
  EXPECT_THAT(u.error->message, HasSubstr("test.undeclared"));
}

TEST_F(StartupTest, ACheckpointFileChangedDuringTheCaptureFailsTheCommit) {
  TempDir dir;
  Checkpoint c = synth_checkpoint(dir.file("ck"), "llama", false, 3);
  Runtime rt(to_config(config_for(c.dir, {}, "overlap")));
  ASSERT_TRUE(rt.prepare().wait());
  std::string shard;
  for (const auto& e : std::filesystem::directory_iterator(c.dir)) {
    if (e.path().extension() == ".safetensors") {
      shard = e.path().filename().string();
    }
  }
  testing::rewrite_shard(c.dir, shard, [](std::vector<testing::ShardEntry>&) {});
  std::filesystem::last_write_time(
      c.dir + "/" + shard,
      std::filesystem::last_write_time(c.dir + "/" + shard) + std::chrono::seconds(5));
  LoadResult r = rt.commit().wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->file, shard);
  EXPECT_THAT(r.error->message, HasSubstr("changed between prepare() and commit()"));
}

// ---- the state machine ----------------------------------------------------------

TEST_F(StartupTest, CallsInTheWrongStateAreClearErrorsThatChangeNothing) {
  Runtime rt(to_config(config_for(ck("llama").dir, {}, "overlap")));
  LoadResult early = rt.commit().wait();
  ASSERT_FALSE(early);
  EXPECT_THAT(early.error->message, HasSubstr("(call prepare() first); the runtime is created"));
  EXPECT_EQ(rt.state(), RuntimeState::kCreated);

  ASSERT_TRUE(rt.prepare().wait());
  for (LoadResult r : {rt.start().wait(), rt.prepare().wait()}) {
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("a prepared model waits for commit()"));
  }
  EXPECT_EQ(rt.state(), RuntimeState::kPrepared);
  ASSERT_TRUE(rt.commit().wait());
  // From ready, a new load of either kind.
  LoadHandle h = rt.start();
  EXPECT_TRUE(h.wait());
  EXPECT_EQ(rt.state(), RuntimeState::kReady);

  // A failed startup leaves the failed state with the next prepare().
  Runtime bad(to_config(config_for(ck("llama").dir, {"io.direct=true"}, "overlap")));
  ASSERT_FALSE(bad.prepare().wait());
  EXPECT_EQ(bad.state(), RuntimeState::kFailed);
  ASSERT_FALSE(bad.commit().wait());
  EXPECT_EQ(bad.state(), RuntimeState::kFailed);
}



// commit() allocates and creates nothing, so it runs while another thread of the
// engine captures a graph in global mode: the host backend's emulated capture
// (gpu::HostCaptureGuard) refuses allocations, pinned memory, streams, event
// creation, and waits on threads that did not bind() a device, and commit() still
// streams the same bytes as a serial load. (Before: the copy workers created their
// streams, scratch and the staging pools' pinned memory in commit().)
TEST_F(StartupTest, CommitRunsWhileAGraphIsCapturedAndCreatesNothing) {
  for (const std::string lanes : {"1", "2"}) {
    SCOPED_TRACE("read lanes " + lanes);
    const std::vector<std::string> sets = {"parallel.tp=2", "parallel.ep=2", "io.read_lanes=" + lanes};
    Runtime serial(to_config(config_for(ck("deepseek_v3").dir, sets, "serial")));
    LoadResult want = serial.load();
    ASSERT_TRUE(want) << want.error->message;

    RuntimeTestSeams hooks;
    hooks.devices = {gpu::make_host_device(0, {.narrow_row_bytes = 64}),
                     gpu::make_host_device(1, {.narrow_row_bytes = 64})};
    Runtime rt = make_runtime(to_config(config_for(ck("deepseek_v3").dir, sets, "overlap")), hooks);
    LoadResult prepared = rt.prepare().wait();
    ASSERT_TRUE(prepared) << prepared.error->message;
    LoadResult r;
    {
      gpu::HostCaptureGuard capture;
      // The guard is on: what commit() must not do fails here.
      EXPECT_THROW(hooks.devices[0]->create_stream(), Error);
      EXPECT_THROW(hooks.devices[0]->allocate(256), Error);
      EXPECT_THROW(hooks.devices[1]->allocate_pinned(4096), Error);
      r = rt.commit().wait();
    }
    ASSERT_TRUE(r) << r.error->message;
    for (std::size_t rank = 0; rank < want.model->ranks().size(); ++rank) {
      for (const LoadedParam& p : want.model->ranks()[rank].params) {
        EXPECT_EQ(r.model->read_param(rank, p.name), want.model->read_param(rank, p.name))
            << p.name;
      }
    }
  }
}

// The sentinel is filled and checked per device, not per parameter: an FP8 model
// (one-byte sentinel: set_bytes, no host source) on two devices whose streams count
// their calls. prepare() waits a few times per device (the fill, the check's
// upload), commit() reads back once per device (the check's flags) and waits a
// few times per device. (Before: a synchronize per FP8 parameter in prepare(), a
// 4 KiB copy_d2h and a synchronize per floating-point parameter in commit().)
TEST(StartupSyncTest, TheSentinelIsFilledAndCheckedPerDeviceNotPerParameter) {
  TempDir dir;
  synth::SynthOptions o;
  o.family = "llama";
  o.preset = "tiny";
  o.out = dir.file("fp8");
  o.seed = 5;
  o.fsync = false;
  o.quant = synth::SynthQuant::kFp8Block;
  o.quant_block = 16;
  synth::synthesize(o);

  auto mu = std::make_shared<std::mutex>();
  auto ops = std::make_shared<std::map<std::string, int>>();
  RuntimeTestSeams hooks;
  for (int i = 0; i < 2; ++i) {
    hooks.devices.push_back(std::make_shared<ferry::testing::FaultyDevice>(
        gpu::make_host_device(i), [mu, ops](std::string_view op) {
          std::lock_guard lock(*mu);
          ++(*ops)[std::string(op)];
        }));
  }
  auto count = [&](const std::string& op) {
    std::lock_guard lock(*mu);
    return (*ops)[op];
  };
  Runtime rt = make_runtime(to_config(config_for(o.out, {"parallel.tp=2"}, "overlap")), hooks);
  LoadResult prepared = rt.prepare().wait();
  ASSERT_TRUE(prepared) << prepared.error->message;
  std::size_t fp8 = 0, floating = 0;
  for (const LoadedRank& rank : prepared.model->ranks()) {
    for (const LoadedParam& p : rank.params) {
      fp8 += p.dtype == DType::kF8E4M3 ? 1 : 0;
      floating += p.dtype == DType::kF8E4M3 || p.dtype == DType::kBF16 ||
                          p.dtype == DType::kF32 || p.dtype == DType::kF16
                      ? 1
                      : 0;
    }
  }
  ASSERT_GE(fp8, 8u);  // the FP8 path is what the test is about
  const int devices = 2;
  EXPECT_GT(count("set_bytes"), 0);
  EXPECT_LE(count("synchronize"), 2 * devices) << fp8 << " FP8 params";
  EXPECT_EQ(count("copy_d2h"), 0);
  // Every FP8 parameter holds its sentinel byte (2^-9: 0x01).
  const std::vector<std::byte> w = prepared.model->read_param(0, "model.layers.0.mlp.down_proj.weight");
  ASSERT_FALSE(w.empty());
  EXPECT_TRUE(std::all_of(w.begin(), w.end(), [](std::byte b) { return b == std::byte{0x01}; }));

  {
    std::lock_guard lock(*mu);
    ops->clear();
  }
  LoadResult r = rt.commit().wait();
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_EQ(count("match_pattern"), devices);
  EXPECT_EQ(count("copy_d2h"), devices) << floating << " floating-point params";
  EXPECT_LE(count("synchronize"), 3 * devices) << [&] {
    std::string all;
    std::lock_guard lock(*mu);
    for (const auto& [op, n] : *ops) {
      all += op + " " + std::to_string(n) + "; ";
    }
    return all;
  }();
}

// ---- cancellation ---------------------------------------------------------------

class StartupCancelTest : public StartupTest {
 protected:
  // A runtime over host devices the test can inspect, with the engine's memory.
  std::unique_ptr<Runtime> runtime(const std::string& mode, RuntimeTestSeams hooks = {}) {
    hooks.devices = devices_;
    return std::unique_ptr<Runtime>(new Runtime(make_runtime(
        to_config(config_for(ck("mixtral").dir, {"parallel.tp=2", "parallel.ep=2"}, mode)), hooks,
        engine_)));
  }
  // Everything given back: the devices' tracker and the engine's allocator.
  bool all_back() const {
    for (const auto& d : devices_) {
      if (!d->stats().all_released()) {
        return false;
      }
    }
    return engine_->live() == 0 && engine_->bad_releases() == 0;
  }
  std::vector<std::shared_ptr<gpu::Device>> devices_ = {gpu::make_host_device(0),
                                                        gpu::make_host_device(1)};
  std::shared_ptr<EngineMemory> engine_ = std::make_shared<EngineMemory>();
};

TEST_F(StartupCancelTest, DuringPrepare) {
  for (const std::string mode : {"overlap", "serial"}) {
    SCOPED_TRACE(mode);
    auto rt = runtime(mode);
    LoadCallbacks cb;
    cb.on_progress = [](const LoadProgress& p) { return p.phase < LoadPhase::kAllocate; };
    LoadHandle h = rt->prepare(cb);
    LoadResult r = h.wait();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kCancelled);
    EXPECT_EQ(rt->state(), RuntimeState::kFailed);
    EXPECT_TRUE(rt->start().wait());  // the next load is not affected
  }
  EXPECT_TRUE(eventually([&] { return all_back(); }));
}

TEST_F(StartupCancelTest, DuringTheCaptureWindow) {
  auto rt = runtime("overlap");
  auto prepare = std::make_optional(rt->prepare());
  auto prepared = std::make_optional(prepare->wait());
  ASSERT_TRUE(*prepared);
  std::vector<ParamView> views = (*prepared).model->views();
  rt->cancel();
  EXPECT_EQ(rt->state(), RuntimeState::kFailed);
  LoadResult c = rt->commit().wait();
  ASSERT_FALSE(c);
  EXPECT_THAT(c.error->message, HasSubstr("the runtime is failed"));
  // The prepared storage is still there for graphs that point at it: the views
  // alone keep it once the handle and its result are gone.
  prepared.reset();
  prepare.reset();
  EXPECT_TRUE(engine_->holds(views[0].device, views[0].data, 1));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the load's thread ends
  EXPECT_FALSE(all_back());
  views.clear();
  EXPECT_TRUE(eventually([&] { return all_back(); }));
  EXPECT_EQ(rt->state(), RuntimeState::kFailed);  // the runtime itself holds nothing
}

TEST_F(StartupCancelTest, DuringCommitTheStorageStaysUntilHandlesAndViewsGo) {
  RuntimeTestSeams hooks;
  Runtime* self = nullptr;
  std::atomic<int> copies{0};
  hooks.before_copy = [&](std::size_t, const std::string&) {
    if (++copies == 3) {
      self->cancel();
    }
  };
  auto rt = runtime("overlap", hooks);
  self = rt.get();
  auto prepared = std::make_optional(rt->prepare().wait());
  ASSERT_TRUE(*prepared);
  EXPECT_EQ(copies.load(), 0);  // overlap prepares without copying
  std::vector<ParamView> views = (*prepared).model->views();
  prepared.reset();
  auto commit = std::make_optional(rt->commit());
  LoadResult r = commit->wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kCancelled);
  EXPECT_EQ(rt->state(), RuntimeState::kFailed);
  EXPECT_TRUE(engine_->holds(views[0].device, views[0].data, 1));
  views.clear();
  // The failed commit's handle alone still keeps the storage a graph may point at.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the load's thread ends
  EXPECT_FALSE(all_back());
  EXPECT_GT(engine_->live(), 0u);
  commit.reset();
  EXPECT_TRUE(eventually([&] { return all_back(); }));
}

TEST_F(StartupCancelTest, RacingStartOrPrepareIsNeverLost) {
  for (int i = 0; i < 20; ++i) {
    auto rt = runtime(i % 2 == 0 ? "overlap" : "serial");
    LoadHandle h = i % 4 < 2 ? rt->prepare() : rt->start();
    rt->cancel();
    LoadResult r = h.wait();
    ASSERT_FALSE(r) << i;
    EXPECT_EQ(r.error->stage, Stage::kCancelled) << i;
    EXPECT_EQ(rt->state(), RuntimeState::kFailed) << i;
  }
  EXPECT_TRUE(eventually([&] { return all_back(); }));
}

}  // namespace
}  // namespace ferry::runtime
