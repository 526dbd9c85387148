// Runtime::update (issue 34, section 2): new weights written into the storage of a
// loaded model. An update from checkpoint B of a model loaded from A must leave
// exactly what a fresh load of B leaves, at the same addresses, over the issue's
// matrix of families and layouts; from tensors in memory too, and with a names
// filter only the params those tensors feed (and the hooks those feed). Then what
// is refused before a byte is written, and what a failure while writing leaves:
// the old weights from a snapshot, from the old source read again, or a model that
// says it is invalid.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ferry/metrics.hpp"
#include "ferry/runtime.hpp"
#include "io/safetensors.hpp"
#include "models/model.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using testing::expect_same_model;
using ::testing::HasSubstr;
using testing::make_config;
using testing::param_bytes;
using testing::synth_checkpoint;
using testing::TempDir;

using testing::LayoutCase;
using testing::Sets;
using testing::with;

LoadResult fresh(const std::string& path, const Sets& sets) {
  return testing::load_with(path, sets);
}

// Every parameter's address, by local rank and name.
std::map<std::string, const std::byte*> addresses(const LoadedModel& m) {
  std::map<std::string, const std::byte*> out;
  for (std::size_t r = 0; r < m.ranks().size(); ++r) {
    for (const LoadedParam& p : m.ranks()[r].params) {
      out[std::to_string(r) + "/" + p.name] = p.data;
    }
  }
  return out;
}

// A checkpoint of `family` with values from `seed` (runtime_test_util's matrix).
std::string checkpoint(const TempDir& dir, const std::string& name, const std::string& family,
                       std::uint64_t seed) {
  return testing::layout_checkpoint(dir.file(name), family, seed);
}

// Every tensor of a checkpoint folder, read into memory.
struct HostTensors {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<UpdateTensor> tensors;
};
HostTensors read_tensors(const std::string& folder) {
  HostTensors out;
  std::vector<io::TensorInfo> infos;
  std::vector<std::string> paths;
  for (const auto& e : fs::directory_iterator(folder)) {
    if (e.path().extension() == ".safetensors") {
      for (const io::TensorInfo& t :
           io::read_safetensors_header(e.path().string(), e.path().string()).tensors) {
        infos.push_back(t);
        paths.push_back(e.path().string());
      }
    }
  }
  out.bytes.resize(infos.size());
  for (std::size_t i = 0; i < infos.size(); ++i) {
    std::ifstream in(paths[i], std::ios::binary);
    in.seekg(static_cast<std::streamoff>(infos[i].offset));
    out.bytes[i].resize(infos[i].nbytes);
    in.read(reinterpret_cast<char*>(out.bytes[i].data()),
            static_cast<std::streamsize>(infos[i].nbytes));
    out.tensors.push_back(
        {infos[i].name, infos[i].dtype, infos[i].shape, out.bytes[i].data(), "host"});
  }
  return out;
}

class UpdateMatrix : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(UpdateMatrix, AnUpdateLeavesWhatAFreshLoadOfTheNewCheckpointLeavesAtTheSameAddresses) {
  TempDir dir;
  const LayoutCase& c = GetParam();
  const std::string a = checkpoint(dir, "a", c.family, 1);
  const std::string b = checkpoint(dir, "b", c.family, 2);
  const Sets sets = with(c.sets, {"prefetch.enabled=false"});
  const int pp = testing::set_value(sets, "parallel.pp", 1);
  for (int stage = 0; stage < pp; ++stage) {
    SCOPED_TRACE("pipeline stage " + std::to_string(stage));
    const Sets staged = with(sets, {"parallel.pp_rank=" + std::to_string(stage)});
    Runtime rt(to_config(make_config(a, staged)));
    const LoadResult loaded = rt.load();
    ASSERT_TRUE(loaded) << loaded.error->message;
    const auto before = addresses(*loaded.model);
    const LoadResult updated = rt.update(UpdateSource::from_folder(b));
    ASSERT_TRUE(updated) << updated.error->message;
    EXPECT_EQ(updated.model, loaded.model);
    EXPECT_EQ(addresses(*loaded.model), before);
    EXPECT_TRUE(loaded.model->valid());
    const LoadReport& report = loaded.model->report();
    EXPECT_EQ(report.startup_mode, "update");
    EXPECT_TRUE(report.update.ran);
    EXPECT_EQ(report.update.source, b);
    EXPECT_EQ(report.update.rollback, "reread");  // A's files are unchanged
    EXPECT_EQ(report.update.params_unchanged, 0u);
    EXPECT_GT(report.update.params_written, 0u);
    EXPECT_EQ(rt.state(), RuntimeState::kReady);
    // The phases add up to the update's seconds, each of them a duration.
    const LoadReport::Phases& ph = report.phases;
    for (double x : {ph.resolve, ph.plan, ph.allocate, ph.stream, ph.postprocess, ph.verify}) {
      EXPECT_GE(x, 0);
    }
    EXPECT_NEAR(ph.resolve + ph.plan + ph.allocate + ph.stream + ph.postprocess + ph.verify,
                report.seconds, 1e-9);
    EXPECT_LT(report.seconds, 600);
    const LoadResult want = fresh(b, staged);
    ASSERT_TRUE(want) << want.error->message;
    expect_same_model(*want.model, *loaded.model);

    // And back to A from memory: the same as a fresh load of A.
    HostTensors host = read_tensors(a);
    const LoadResult back = rt.update(UpdateSource::from_tensors(host.tensors));
    ASSERT_TRUE(back) << back.error->message;
    EXPECT_EQ(loaded.model->report().update.source, "tensors");
    EXPECT_EQ(addresses(*loaded.model), before);
    const LoadResult was = fresh(a, staged);
    ASSERT_TRUE(was) << was.error->message;
    expect_same_model(*was.model, *loaded.model);
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, UpdateMatrix, ::testing::ValuesIn(testing::restart_layouts()),
                         testing::layout_case_name);

// An update of a model whose hooks read load-only params (quantization.online:
// full-precision weights quantized to FP8 after loading): they are allocated for the
// update and freed after the hooks ran again.
TEST(Update, LoadOnlyParamsAreMadeAgainForTheHooksThatReadThem) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "llama", 1);
  const std::string b = checkpoint(dir, "b", "llama", 2);
  const Sets sets = {"parallel.tp=2", "quantization.online=fp8_channel"};
  Runtime rt(to_config(make_config(a, sets)));
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded) << loaded.error->message;
  const auto before = addresses(*loaded.model);
  const LoadResult updated = rt.update(UpdateSource::from_folder(b));
  ASSERT_TRUE(updated) << updated.error->message;
  EXPECT_EQ(addresses(*loaded.model), before);
  EXPECT_THAT(loaded.model->report().update.hooks_rerun, ::testing::Not(::testing::IsEmpty()));
  const LoadResult want = fresh(b, sets);
  ASSERT_TRUE(want) << want.error->message;
  expect_same_model(*want.model, *loaded.model);
}

// A model read from a presharded folder takes an update from another presharded
// folder of the same layout (nothing sliced or post-processed again).
TEST(Update, APreshardedModelTakesAnUpdateFromAPreshardedFolder) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "deepseek_v3", 1);
  const std::string b = checkpoint(dir, "b", "deepseek_v3", 2);
  const Sets sets = {"parallel.tp=2", "parallel.ep=2"};
  for (const auto& [ck, root] : {std::pair{a, dir.file("pa")}, std::pair{b, dir.file("pb")}}) {
    const LoadResult saved = fresh(ck, with(sets, {"load.save_presharded=" + root}));
    ASSERT_TRUE(saved) << saved.error->message;
    ASSERT_FALSE(saved.model->report().presharded_saved.empty());
  }
  const Sets pre = with(sets, {"model.load_format=presharded"});
  Runtime rt(to_config(make_config(dir.file("pa"), pre)));
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded) << loaded.error->message;
  const LoadResult updated = rt.update(UpdateSource::from_folder(dir.file("pb")));
  ASSERT_TRUE(updated) << updated.error->message;
  EXPECT_EQ(loaded.model->report().load_format, "presharded");
  EXPECT_EQ(loaded.model->report().update.params_unchanged, 0u);
  const LoadResult want = fresh(b, sets);
  ASSERT_TRUE(want) << want.error->message;
  expect_same_model(*want.model, *loaded.model);

  // A raw load takes the same folder with the source's load_format.
  Runtime raw(to_config(make_config(a, sets)));
  const LoadResult held = raw.load();
  ASSERT_TRUE(held);
  const LoadResult from_pre =
      raw.update(UpdateSource::from_folder(dir.file("pb"), {}, "presharded"));
  ASSERT_TRUE(from_pre) << from_pre.error->message;
  expect_same_model(*want.model, *held.model);
  for (const char* bad : {"dummy", "gguf-nope"}) {
    const LoadResult r = raw.update(UpdateSource::from_folder(b, {}, bad));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("update refused: source"));
  }
}

// A dummy model (model.path is config.json itself) takes real weights from memory.
TEST(Update, ADummyModelTakesTheCheckpointsTensorsFromMemory) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "qwen3_moe", 1);
  const Sets sets = {"parallel.tp=2", "parallel.ep=2"};
  Runtime rt(to_config(make_config(a + "/config.json", with(sets, {"model.load_format=dummy"}))));
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded) << loaded.error->message;
  HostTensors host = read_tensors(a);
  const LoadResult updated = rt.update(UpdateSource::from_tensors(host.tensors));
  ASSERT_TRUE(updated) << updated.error->message;
  const LoadResult want = fresh(a, sets);
  ASSERT_TRUE(want) << want.error->message;
  expect_same_model(*want.model, *loaded.model);
}

// A source file that changes after its header was read is refused before a byte of
// it is written.
TEST(Update, ASourceFileThatChangesAfterItsHeaderWasReadIsRefused) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "llama", 1);
  const std::string b = checkpoint(dir, "b", "llama", 2);
  auto armed = std::make_shared<std::atomic<bool>>(false);
  RuntimeTestSeams seams;
  seams.wrap_model = [armed, b](std::shared_ptr<const models::Model> m) {
    if (armed->exchange(false)) {  // the update's plan: its headers are read
      for (const auto& e : fs::directory_iterator(b)) {
        if (e.path().extension() == ".safetensors") {
          std::ofstream(e.path(), std::ios::app) << "x";
        }
      }
    }
    return m;
  };
  Runtime rt = make_runtime(to_config(make_config(a, {"parallel.tp=2"})), seams);
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded);
  const auto bytes = param_bytes(*loaded.model);
  armed->store(true);
  const LoadResult r = rt.update(UpdateSource::from_folder(b));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kRead);
  EXPECT_THAT(r.error->message, HasSubstr("changed after the update read its header"));
  EXPECT_EQ(param_bytes(*loaded.model), bytes);
  EXPECT_TRUE(loaded.model->valid());
}

// Params of `m` whose bytes equal those of `other`, and those that differ.
std::pair<std::vector<std::string>, std::vector<std::string>> same_and_different(
    const LoadedModel& m, const LoadedModel& other) {
  const auto x = param_bytes(m);
  const auto y = param_bytes(other);
  std::vector<std::string> same, different;
  for (const auto& [name, bytes] : x) {
    (y.at(name) == bytes ? same : different).push_back(name);
  }
  return {same, different};
}

TEST(Update, ANamesFilterWritesOnlyTheParamsItsTensorsFeedAndTheHooksThoseFeed) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "deepseek_v3", 1);
  const std::string b = checkpoint(dir, "b", "deepseek_v3", 2);
  const Sets sets = {"parallel.tp=2", "prefetch.enabled=false"};
  Runtime rt(to_config(make_config(a, sets)));
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded) << loaded.error->message;
  const LoadResult updated =
      rt.update(UpdateSource::from_folder(b, {"model.layers.0.self_attn.kv_b_proj.*"}));
  ASSERT_TRUE(updated) << updated.error->message;
  const LoadReport::Update& up = loaded.model->report().update;
  EXPECT_GT(up.params_unchanged, 0u);
  EXPECT_THAT(up.hooks_rerun, ::testing::Not(::testing::IsEmpty()));
  const LoadResult want_b = fresh(b, sets);
  ASSERT_TRUE(want_b);
  const auto [same_b, different_b] = same_and_different(*loaded.model, *want_b.model);
  // kv_b_proj and the w_kc / w_vc the MLA hook splits from it, on both ranks: B's.
  std::vector<std::string> expect_b;
  for (const char* r : {"0/", "1/"}) {
    for (const char* p : {"kv_b_proj.weight", "w_kc", "w_vc"}) {
      expect_b.push_back(std::string(r) + "model.layers.0.self_attn." + p);
    }
  }
  for (const std::string& name : expect_b) {
    EXPECT_THAT(same_b, ::testing::Contains(name));
  }
  // Everything else: A's.
  const LoadResult want_a = fresh(a, sets);
  ASSERT_TRUE(want_a);
  const auto [same_a, different_a] = same_and_different(*loaded.model, *want_a.model);
  EXPECT_THAT(different_a, ::testing::UnorderedElementsAreArray(expect_b));
}

TEST(Update, APartOfAFusedParamIsRefusedBeforeAByteIsWritten) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "llama", 1);
  const std::string b = checkpoint(dir, "b", "llama", 2);
  const Sets sets = {"parallel.tp=2"};
  Runtime rt(to_config(make_config(a, sets)));
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded);
  const auto bytes = param_bytes(*loaded.model);
  const LoadResult r =
      rt.update(UpdateSource::from_folder(b, {"model.layers.0.self_attn.q_proj.weight"}));
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, HasSubstr("update refused"));
  EXPECT_EQ(r.error->tensor, "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_THAT(r.error->message, HasSubstr("give every checkpoint tensor"));
  EXPECT_EQ(param_bytes(*loaded.model), bytes);
  EXPECT_TRUE(loaded.model->valid());
  // The runtime takes the next update.
  const LoadResult whole =
      rt.update(UpdateSource::from_folder(b, {"model.layers.0.self_attn.*_proj.weight"}));
  EXPECT_TRUE(whole) << whole.error->message;
}

TEST(Update, TensorsThatDoNotFitAreRefusedNamingTheTensor) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "llama", 1);
  Runtime rt(to_config(make_config(a, {"parallel.tp=2"})));
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded);
  const auto bytes = param_bytes(*loaded.model);
  HostTensors host = read_tensors(a);
  auto find = [&](const std::string& name) -> UpdateTensor& {
    for (UpdateTensor& t : host.tensors) {
      if (t.name == name) {
        return t;
      }
    }
    throw std::runtime_error(name);
  };
  const std::string norm = "model.layers.0.input_layernorm.weight";
  {
    std::vector<UpdateTensor> one = {find(norm)};
    one[0].name = "model.layers.0.no_such.weight";
    const LoadResult r = rt.update(UpdateSource::from_tensors(one));
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->tensor, "model.layers.0.no_such.weight");
    EXPECT_THAT(r.error->message, HasSubstr("map to no parameter"));
  }
  {
    std::vector<UpdateTensor> one = {find(norm)};
    one[0].shape = {one[0].shape[0] / 2};
    const LoadResult r = rt.update(UpdateSource::from_tensors(one));
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->tensor, norm);
    EXPECT_EQ(r.error->stage, Stage::kPlacement);
  }
  {
    std::vector<UpdateTensor> two = {find(norm), find(norm)};
    const LoadResult r = rt.update(UpdateSource::from_tensors(two));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("given twice"));
  }
  {
    std::vector<UpdateTensor> one = {find(norm)};
    one[0].device = "cuda:7";
    const LoadResult r = rt.update(UpdateSource::from_tensors(one));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("neither host memory"));
  }
  {
    UpdateSource both = UpdateSource::from_tensors(host.tensors);
    both.folder = a;
    const LoadResult r = rt.update(both);
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("update refused: source"));
  }
  {
    const LoadResult r = rt.update(UpdateSource::from_folder(a, {"nothing.matches.*"}));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("write no parameter"));
  }
  {
    // Another model: a layout of another family is refused param by param.
    const std::string other = checkpoint(dir, "other", "qwen2", 1);
    const LoadResult r = rt.update(UpdateSource::from_folder(other));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("update refused"));
  }
  EXPECT_EQ(param_bytes(*loaded.model), bytes);
  EXPECT_TRUE(loaded.model->valid());
}

TEST(Update, TensorDirMustNameAFolderThatCanBeWritten) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "llama", 1);
  EXPECT_THROW(make_config(a, {"update.tensor_dir="}), Error);
  Runtime rt(to_config(make_config(a, {"update.tensor_dir=" + dir.file("no/such/dir")})));
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded);
  HostTensors host = read_tensors(a);
  const LoadResult r = rt.update(UpdateSource::from_tensors(host.tensors));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kOutput);
  EXPECT_THAT(r.error->message, HasSubstr("update.tensor_dir"));
  // Nothing is left behind in a folder that works.
  const std::string tensors = dir.file("tensors");
  fs::create_directories(tensors);
  Runtime ok(to_config(make_config(a, {"update.tensor_dir=" + tensors})));
  const LoadResult held = ok.load();
  ASSERT_TRUE(held);
  const LoadResult u = ok.update(UpdateSource::from_tensors(host.tensors));
  ASSERT_TRUE(u) << u.error->message;
  EXPECT_TRUE(fs::is_empty(tensors));
}

TEST(Update, IsRefusedWithoutAModelAndWhileAPrepareWaitsForCommit) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "llama", 1);
  {
    Runtime rt(to_config(make_config(a, {})));
    const LoadResult r = rt.update(UpdateSource::from_folder(a));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("update refused: no_model"));
  }
  {
    Runtime rt(to_config(make_config(a, {})));
    const LoadResult loaded = rt.load();
    ASSERT_TRUE(loaded);
    const LoadResult prepared = rt.prepare().wait();
    ASSERT_TRUE(prepared) << prepared.error->message;
    const LoadResult r = rt.update(UpdateSource::from_folder(a));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("update refused: prepared"));
    ASSERT_TRUE(rt.commit().wait());
    // The committed model is the one updated now.
    const LoadResult u = rt.update(UpdateSource::from_folder(a));
    ASSERT_TRUE(u) << u.error->message;
    EXPECT_EQ(u.model, prepared.model);
  }
  {
    Runtime rt(to_config(make_config(a, {})));
    ASSERT_TRUE(rt.load());  // the result is dropped: nothing is held
    const LoadResult r = rt.update(UpdateSource::from_folder(a));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("no_model"));
  }
  {
    Runtime rt(to_config(make_config(a, {"devices=null"})));
    const LoadResult loaded = rt.load();
    ASSERT_TRUE(loaded);
    const LoadResult r = rt.update(UpdateSource::from_folder(a));
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("update refused: backend"));
  }
}

// A runtime whose next copy into layer 1 fails once `armed` is set (once: a
// re-read of the old source then succeeds).
struct Failing {
  std::shared_ptr<std::atomic<bool>> armed = std::make_shared<std::atomic<bool>>(false);
  RuntimeTestSeams seams() const {
    RuntimeTestSeams s;
    s.before_copy = [armed = armed](std::size_t, const std::string& param) {
      if (param.find("layers.1.") != std::string::npos && armed->exchange(false)) {
        throw std::runtime_error("injected copy failure");
      }
    };
    return s;
  }
};

// Appends a byte to every weight file of `folder`: its stamps change.
void touch_weights(const std::string& folder) {
  for (const auto& e : fs::directory_iterator(folder)) {
    if (e.path().extension() == ".safetensors") {
      std::ofstream(e.path(), std::ios::app) << "x";
    }
  }
}

// A (seed 1) loaded at tp 2 with `sets` on a Failing runtime; B (seed 2) beside it.
// fail_update() arms the failure and updates from B, `touch_old` first changing A's
// files; the update must fail, and the caller checks what it left.
struct FailingUpdate {
  TempDir dir;
  std::string a, b;
  Failing failing;
  Runtime rt;
  LoadResult loaded;
  std::map<std::string, std::vector<std::byte>> bytes;

  FailingUpdate(const std::string& family, const Sets& sets)
      : a(checkpoint(dir, "a", family, 1)),
        b(checkpoint(dir, "b", family, 2)),
        rt(make_runtime(to_config(make_config(a, with({"parallel.tp=2"}, sets))), failing.seams())),
        loaded(rt.load()) {
    if (loaded) {
      bytes = param_bytes(*loaded.model);
    }
  }
  LoadResult fail_update(bool touch_old) {
    if (touch_old) {
      touch_weights(a);
    }
    failing.armed->store(true);
    return rt.update(UpdateSource::from_folder(b));
  }
};

TEST(Update, AFailureWhileWritingRestoresTheOldWeightsFromASnapshot) {
  for (const char* how : {"reread", "snapshot"}) {
    SCOPED_TRACE(how);
    // reread first: A's files change after the load, so only a snapshot is left;
    // snapshot first: taken although A could be read again.
    FailingUpdate t("llama", {std::string("update.rollback=") + how});
    ASSERT_TRUE(t.loaded);
    const LoadResult r = t.fail_update(std::string(how) == "reread");
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error->message, HasSubstr("injected copy failure"));
    EXPECT_THAT(r.error->message, HasSubstr("restored from a snapshot"));
    EXPECT_TRUE(t.loaded.model->valid());
    EXPECT_EQ(param_bytes(*t.loaded.model), t.bytes);
    const LoadResult ok = t.rt.update(UpdateSource::from_folder(t.b));
    ASSERT_TRUE(ok) << ok.error->message;
    EXPECT_EQ(t.loaded.model->report().update.rollback, "snapshot");
    EXPECT_GT(t.loaded.model->report().update.snapshot_bytes, 0u);
  }
}

TEST(Update, AnUnchangedOldSourceIsReadAgain) {
  FailingUpdate t("deepseek_v3", {"update.rollback_bytes=0"});
  ASSERT_TRUE(t.loaded);
  const LoadResult r = t.fail_update(false);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, HasSubstr("read again from " + t.a));
  EXPECT_TRUE(t.loaded.model->valid());
  EXPECT_EQ(param_bytes(*t.loaded.model), t.bytes);
  const LoadResult ok = t.rt.update(UpdateSource::from_folder(t.b));
  ASSERT_TRUE(ok) << ok.error->message;
  EXPECT_EQ(t.loaded.model->report().update.rollback, "reread");
  EXPECT_EQ(t.loaded.model->report().update.snapshot_bytes, 0u);
}

TEST(Update, WithNeitherASnapshotNorAnUnchangedOldSourceAFailureMarksTheModelInvalid) {
  FailingUpdate t("llama", {"update.rollback_bytes=0"});
  ASSERT_TRUE(t.loaded);
  // The old source changes after the load: it can no longer give the old weights.
  const LoadResult r = t.fail_update(true);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, HasSubstr("the model is invalid"));
  EXPECT_FALSE(t.loaded.model->valid());
  EXPECT_THAT(t.loaded.model->invalid_reason(), HasSubstr("could not be undone"));
  EXPECT_EQ(t.rt.state(), RuntimeState::kFailed);
  EXPECT_THROW(t.loaded.model->dump(t.dir.file("dump")), Error);
  // An update that writes every param makes it valid again.
  const LoadResult ok = t.rt.update(UpdateSource::from_folder(t.b));
  ASSERT_TRUE(ok) << ok.error->message;
  EXPECT_TRUE(t.loaded.model->valid());
  const LoadResult want = fresh(t.b, {"parallel.tp=2"});
  ASSERT_TRUE(want);
  expect_same_model(*want.model, *t.loaded.model);
}

TEST(Update, ACancelWhileWritingRestoresTheOldWeights) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "llama", 1);
  const std::string b = checkpoint(dir, "b", "llama", 2);
  auto runtime = std::make_shared<Runtime*>(nullptr);
  auto armed = std::make_shared<std::atomic<bool>>(false);
  RuntimeTestSeams seams;
  seams.before_copy = [runtime, armed](std::size_t, const std::string&) {
    if (armed->exchange(false)) {
      (*runtime)->cancel();
    }
  };
  // Small windows: the pipeline sees the cancel before the last one.
  Runtime rt =
      make_runtime(to_config(make_config(a, {"parallel.tp=2", "io.chunk_bytes=4096"})), seams);
  *runtime = &rt;
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded);
  const auto bytes = param_bytes(*loaded.model);
  armed->store(true);
  const LoadResult r = rt.update(UpdateSource::from_folder(b));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kCancelled);
  EXPECT_THAT(r.error->message, HasSubstr("read again from " + a));
  EXPECT_EQ(param_bytes(*loaded.model), bytes);
}

TEST(Update, TheMetricsCountUpdatesByOutcome) {
  TempDir dir;
  const std::string a = checkpoint(dir, "a", "llama", 1);
  const std::string b = checkpoint(dir, "b", "llama", 2);
  const std::string textfile = dir.file("metrics.prom");
  Runtime rt(to_config(make_config(a, {"metrics.textfile=" + textfile})));
  const LoadResult loaded = rt.load();
  ASSERT_TRUE(loaded);
  ASSERT_TRUE(rt.update(UpdateSource::from_folder(b)));
  ASSERT_FALSE(rt.update(UpdateSource::from_folder(b, {"nothing.*"})));
  std::ifstream in(textfile);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("ferry_updates_total{outcome=\"applied\"} 1"));
  EXPECT_THAT(text, HasSubstr("ferry_updates_total{outcome=\"refused\"} 1"));
  EXPECT_THAT(text, HasSubstr("ferry_update_bytes_total " +
                              std::to_string(loaded.model->report().update.bytes_written)));
}

}  // namespace
}  // namespace ferry::runtime
