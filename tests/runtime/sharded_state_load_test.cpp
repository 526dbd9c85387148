// SGLang's sharded_state checkpoints through the whole runtime (issue 34): a load
// saves each tp rank's state dict as SGLang's ShardedStateLoader.save_model names it
// (load.save_sharded_state, `ferry save --format sharded_state`), a sharded_state
// load reads it back, and the two loads' params are the same, byte for byte, over
// the layouts and families of the matrix. What SGLang's state dict lacks
// (MLA's w_kc, w_vc) is made again by the MLA hook, as SGLang's post_load_weights
// does. Then the damage: a missing rank, a larger tp's folder, a truncated file, a
// tensor of another shape, an extra or a missing tensor, a param that cannot be
// made again; each an error naming what is wrong, nothing handed over.
// (tests/parity/sharded_state_parity.py checks the same files against SGLang's own
// save_model and load_model.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/runtime.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_writer.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using testing::Checkpoint;
using testing::expect_same_model;
using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

using testing::LayoutCase;
using testing::set_value;
using testing::Sets;
using testing::with;

LoadResult load(const std::string& path, const Sets& sets) {
  return testing::load_with(path, sets);
}

// The names a folder's files hold, by file.
std::map<std::string, std::vector<std::string>> stored(const std::string& folder) {
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& e : fs::directory_iterator(folder)) {
    if (e.path().extension() == ".safetensors") {
      for (const io::TensorInfo& t :
           io::read_safetensors_header(e.path().string(), e.path().string()).tensors) {
        out[e.path().filename().string()].push_back(t.name);
      }
    }
  }
  return out;
}

// Loads `ck` raw with `sets`, saving under `root`; reads it back and compares.
// Returns the folder saved.
std::string round_trip(const std::string& ck, const std::string& root, const Sets& sets) {
  const LoadResult raw = load(ck, with(sets, {"load.save_sharded_state=" + root}));
  EXPECT_TRUE(raw) << raw.error->message;
  if (!raw) {
    return {};
  }
  const LoadReport& saved = raw.model->report();
  EXPECT_FALSE(saved.sharded_state_saved.empty()) << ::testing::PrintToString(saved.warnings);
  const LoadResult back = load(root, with(sets, {"model.load_format=sharded_state"}));
  EXPECT_TRUE(back) << back.error->message;
  if (!back) {
    return {};
  }
  const LoadReport& read = back.model->report();
  EXPECT_EQ(read.load_format, "sharded_state");
  EXPECT_EQ(read.sharded_state_read, saved.sharded_state_saved);
  EXPECT_EQ(read.tensors.unmapped, 0u);
  expect_same_model(*raw.model, *back.model);
  return saved.sharded_state_saved;
}

class ShardedStateRoundTrip : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(ShardedStateRoundTrip, ReadsBackWhatTheLoadLeft) {
  TempDir dir;
  const LayoutCase& c = GetParam();
  const std::string ck = testing::layout_checkpoint(dir.file("ck"), c.family);
  const Sets sets = with(c.sets, {"prefetch.enabled=false"});
  const int pp = set_value(sets, "parallel.pp", 1);
  const int tp = set_value(sets, "parallel.tp", 1);
  for (int stage = 0; stage < pp; ++stage) {
    SCOPED_TRACE("pipeline stage " + std::to_string(stage));
    const std::string folder =
        round_trip(ck, dir.file("root"), with(sets, {"parallel.pp_rank=" + std::to_string(stage)}));
    // SGLang's names: a rank's files, its params less MLA's w_kc / w_vc.
    const auto files = stored(folder);
    EXPECT_EQ(files.size(), static_cast<std::size_t>(tp));
    for (const auto& [file, names] : files) {
      EXPECT_TRUE(file.rfind("model-rank-", 0) == 0) << file;
      for (const std::string& n : names) {
        EXPECT_FALSE(n.ends_with("w_kc") || n.ends_with("w_vc")) << n;
      }
    }
    EXPECT_TRUE(fs::exists(fs::path(folder) / "config.json"));
    if (std::string(c.family) == "gemma2") {  // SGLang's buffer, in every rank's state
      for (const auto& [file, names] : files) {
        EXPECT_THAT(names, ::testing::Contains("model.normalizer")) << file;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, ShardedStateRoundTrip,
                         ::testing::ValuesIn(testing::restart_layouts()),
                         testing::layout_case_name);

TEST(ShardedStateLoad, ATiedEmbeddingIsStoredAsLmHeadAsSGLangNamesIt) {
  TempDir dir;
  const Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama", /*tie_embeddings=*/true);
  const std::string folder = round_trip(ck.dir, dir.file("root"), {"parallel.tp=2"});
  const auto names = stored(folder).at("model-rank-0-part-0.safetensors");
  EXPECT_THAT(names, ::testing::Contains("lm_head.weight"));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("model.embed_tokens.weight")));
}

TEST(ShardedStateLoad, PartsFollowSaveMaxFileBytesAndEachRankReadsOnlyItsOwn) {
  TempDir dir;
  synth::SynthOptions o;  // about 19 MiB a rank at tp 2
  o.family = "llama";
  o.preset = "small";
  o.out = dir.file("ck");
  o.fsync = false;
  synth::synthesize(o);
  const std::string folder =
      round_trip(o.out, dir.file("root"), {"parallel.tp=2", "save.max_file_bytes=4194304"});
  std::size_t rank1 = 0;
  for (const auto& [file, names] : stored(folder)) {
    rank1 += file.rfind("model-rank-1-", 0) == 0 ? 1 : 0;
    const std::uint64_t size = fs::file_size(fs::path(folder) / file);
    EXPECT_LE(size, std::uint64_t{4194304} + 65536) << file;  // a header's worth over
  }
  EXPECT_GT(rank1, 2u);
  const LoadResult one =
      load(folder, {"parallel.tp=2", "parallel.ranks=1", "model.load_format=sharded_state"});
  ASSERT_TRUE(one) << one.error->message;
  EXPECT_EQ(one.model->report().files, rank1);
}

TEST(ShardedStateLoad, SaveCliWritesEveryStageAndRefusesWhatItCannotSave) {
  TempDir dir;
  const Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::string root = dir.file("root");
  const testing::RunResult saved =
      testing::run({FERRY_BINARY, "save", "--model", ck.dir, "--tp", "2", "--pp", "2", "--format",
                    "sharded_state", "--out", root, "--quiet"});
  ASSERT_EQ(saved.status, 0) << saved.err;
  for (int stage = 0; stage < 2; ++stage) {
    const std::string sets = "parallel.pp_rank=" + std::to_string(stage);
    const LoadResult raw = load(ck.dir, {"parallel.tp=2", "parallel.pp=2", sets});
    const LoadResult back =
        load(root, {"parallel.tp=2", "parallel.pp=2", sets, "model.load_format=sharded_state"});
    ASSERT_TRUE(raw && back) << (back ? raw.error->message : back.error->message);
    EXPECT_EQ(back.model->report().sharded_state_read, root + "/pp-" + std::to_string(stage));
    expect_same_model(*raw.model, *back.model);
  }
  // A second save into the same folder would mix two saves: refused, files kept.
  const testing::RunResult again =
      testing::run({FERRY_BINARY, "save", "--model", ck.dir, "--tp", "2", "--pp", "2", "--format",
                    "sharded_state", "--out", root, "--quiet"});
  EXPECT_EQ(again.status, 1);
  EXPECT_THAT(again.err, HasSubstr("holds tp rank 0's files already"));
  const testing::RunResult from_state =
      testing::run({FERRY_BINARY, "save", "--model", root + "/pp-0", "--format", "sharded_state",
                    "--out", dir.file("x"), "--set", "model.load_format=sharded_state", "--quiet"});
  EXPECT_EQ(from_state.status, 2);
  EXPECT_THAT(from_state.err, HasSubstr("model.load_format=sharded_state"));
}

TEST(ShardedStateLoad, ConfigRefusesSavesWithNothingToSave) {
  for (const Sets& sets :
       std::vector<Sets>{{"devices=null", "load.save_sharded_state=/y"},
                         {"model.load_format=dummy", "load.save_sharded_state=/y"},
                         {"model.load_format=sharded_state", "load.save_sharded_state=/y"}}) {
    try {
      make_config("/x", sets);
      ADD_FAILURE() << sets[0] << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kConfig) << e.what();
      EXPECT_THAT(e.what(), HasSubstr("load.save_sharded_state"));
    }
  }
  EXPECT_NO_THROW(make_config("/x", {"load.save_sharded_state=/y"}));
}

// ---- damage ----------------------------------------------------------------------

struct Saved {
  Checkpoint ck;
  std::string folder;
};

Saved save(TempDir& dir, const char* family, const Sets& sets) {
  Saved s{synth_checkpoint(dir.file("ck"), family), dir.file("root")};
  const LoadResult raw = load(s.ck.dir, with(sets, {"load.save_sharded_state=" + s.folder}));
  EXPECT_TRUE(raw) << raw.error->message;
  return s;
}

ErrorInfo failure(const std::string& path, const Sets& sets) {
  const LoadResult r = load(path, with(sets, {"model.load_format=sharded_state"}));
  EXPECT_FALSE(r);
  EXPECT_EQ(r.model, nullptr);
  return r ? ErrorInfo{} : *r.error;
}

TEST(ShardedStateDamage, AMissingRankAndALargerTpAreNamed) {
  TempDir dir;
  const Saved s = save(dir, "llama", {"parallel.tp=2", "parallel.ranks=0"});
  ErrorInfo e = failure(s.folder, {"parallel.tp=2"});
  EXPECT_EQ(e.stage, Stage::kDiscovery);
  EXPECT_THAT(e.message, HasSubstr("no files of tp rank 1"));
  EXPECT_THAT(e.message, HasSubstr("holds tp ranks 0"));
  TempDir dir2;
  const Saved t = save(dir2, "llama", {"parallel.tp=4"});
  e = failure(t.folder, {"parallel.tp=2"});
  EXPECT_THAT(e.message, HasSubstr("holds files of tp ranks 0,1,2,3, the load asks tp 2"));
  e = failure(dir2.file("nowhere"), {"parallel.tp=2"});
  EXPECT_THAT(e.message, HasSubstr("no such folder"));
  e = failure(t.ck.dir, {"parallel.tp=2"});  // a raw checkpoint: none of SGLang's names
  EXPECT_THAT(e.message, HasSubstr("no model-rank-<r>-part-<p>.safetensors here"));
}

TEST(ShardedStateDamage, ATruncatedFileIsRefusedNamingIt) {
  TempDir dir;
  const Saved s = save(dir, "llama", {"parallel.tp=2"});
  const fs::path file = fs::path(s.folder) / "model-rank-1-part-0.safetensors";
  fs::resize_file(file, fs::file_size(file) - 100);
  const ErrorInfo e = failure(s.folder, {"parallel.tp=2"});
  EXPECT_THAT(e.file, HasSubstr("model-rank-1-part-0.safetensors"));
}

// Rewrites one rank's file with `edit` applied to its tensors (name -> shape).
void rewrite(const fs::path& file, const std::function<void(std::vector<io::TensorInfo>&)>& edit) {
  const io::SafetensorsHeader h = io::read_safetensors_header(file.string(), file.string());
  std::vector<io::TensorInfo> tensors = h.tensors;
  edit(tensors);
  io::SafetensorsWriter w(file.string() + ".new");
  for (const io::TensorInfo& t : tensors) {
    w.add(t.name, t.dtype, t.shape);
  }
  w.begin();
  for (const io::TensorInfo& t : tensors) {
    w.write(std::vector<std::byte>(t.nbytes));
  }
  w.finish();
  fs::rename(file.string() + ".new", file);
}

TEST(ShardedStateDamage, ATensorOfAnotherShapeAnExtraOneAndAMissingOneAreNamed) {
  TempDir dir;
  const Saved s = save(dir, "llama", {"parallel.tp=2"});
  const fs::path file = fs::path(s.folder) / "model-rank-1-part-0.safetensors";
  const fs::path keep = fs::path(s.folder) / "keep";
  fs::copy_file(file, keep);
  const std::string norm = "model.layers.0.input_layernorm.weight";
  rewrite(file, [&](auto& ts) {
    for (auto& t : ts) {
      if (t.name == norm) {
        t.shape = {t.shape[0] / 2};
        t.nbytes /= 2;
      }
    }
  });
  ErrorInfo e = failure(s.folder, {"parallel.tp=2"});
  EXPECT_EQ(e.stage, Stage::kIndex);
  EXPECT_EQ(e.tensor, norm);
  EXPECT_THAT(e.message, HasSubstr("the layout has BF16"));
  EXPECT_THAT(e.message, HasSubstr("tp rank 1"));
  fs::copy_file(keep, file, fs::copy_options::overwrite_existing);
  rewrite(file, [](auto& ts) {
    io::TensorInfo extra;
    extra.name = "model.extra.weight";
    extra.dtype = DType::kBF16;
    extra.shape = {4};
    extra.nbytes = 8;
    ts.push_back(extra);
  });
  e = failure(s.folder, {"parallel.tp=2"});
  EXPECT_EQ(e.tensor, "model.extra.weight");
  EXPECT_THAT(e.message, HasSubstr("holds no param of this name"));
  fs::copy_file(keep, file, fs::copy_options::overwrite_existing);
  rewrite(file, [&](auto& ts) {
    std::erase_if(ts, [&](const io::TensorInfo& t) { return t.name == norm; });
  });
  e = failure(s.folder, {"parallel.tp=2"});
  EXPECT_EQ(e.tensor, norm);
  EXPECT_THAT(e.message, HasSubstr("tp rank 1's files do not hold 1 of its params"));
  // The same tensor in two of a rank's parts.
  fs::copy_file(keep, file, fs::copy_options::overwrite_existing);
  fs::copy_file(keep, fs::path(s.folder) / "model-rank-1-part-1.safetensors");
  e = failure(s.folder, {"parallel.tp=2"});
  EXPECT_THAT(e.message, HasSubstr("stored twice for one rank"));
}

TEST(ShardedStateDamage, WhatCannotBeMadeAgainIsRefusedNamingThePath) {
  TempDir dir;
  // quantization.online converts params loaded only for that: nothing to redo from.
  const Saved s = save(dir, "llama", {"parallel.tp=1"});
  ErrorInfo e = failure(s.folder, {"parallel.tp=1", "quantization.online=fp8_channel"});
  EXPECT_EQ(e.stage, Stage::kIndex);
  EXPECT_THAT(e.message, HasSubstr("model.load_format=presharded"));
}

}  // namespace
}  // namespace ferry::runtime
