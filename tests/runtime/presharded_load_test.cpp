// Presharded checkpoints through the whole runtime (issue 34): a load saves its
// ranks (load.save_presharded), a presharded load reads them back, and the two
// loads' params are the same, byte for byte, with the same names, dtypes, shapes and
// strides, over the layouts and families of the issue's matrix. Then the damage: a
// truncated file, a flipped byte under load.verify_checksums, another layout's
// folder, a missing rank, a save that never wrote READY, a manifest that disagrees
// with the layout; each one an error naming what is wrong, nothing handed over.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "ferry/runtime.hpp"
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
using testing::Sets;
using testing::with;

LoadResult load(const std::string& path, const Sets& sets) {
  return testing::load_with(path, sets);
}

// The part folders under a root.
std::vector<fs::path> parts_under(const std::string& root) {
  std::vector<fs::path> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (e.is_directory() && e.path().filename().string().rfind("part-", 0) == 0) {
      out.push_back(e.path());
    }
  }
  return out;
}

// Loads `ck` raw with `sets`, saving under `root`; reads the save back (every rank
// checked against its checksums) and compares. Returns the saved part.
std::string round_trip(const std::string& ck, const std::string& root, const Sets& sets) {
  const LoadResult raw = load(ck, with(sets, {"load.save_presharded=" + root}));
  EXPECT_TRUE(raw) << raw.error->message;
  if (!raw) {
    return {};
  }
  const LoadReport& saved = raw.model->report();
  EXPECT_FALSE(saved.presharded_saved.empty()) << ::testing::PrintToString(saved.warnings);
  EXPECT_EQ(saved.load_format, "checkpoint");
  const LoadResult back =
      load(root, with(sets, {"model.load_format=presharded", "load.verify_checksums=true"}));
  EXPECT_TRUE(back) << back.error->message;
  if (!back) {
    return {};
  }
  const LoadReport& read = back.model->report();
  EXPECT_EQ(read.load_format, "presharded");
  EXPECT_EQ(read.presharded_read, saved.presharded_saved);
  EXPECT_TRUE(read.checksums_verified);
  EXPECT_EQ(read.tensors.unmapped, 0u);
  EXPECT_EQ(read.hooks_skipped.size(), 0u);
  expect_same_model(*raw.model, *back.model);
  return saved.presharded_saved;
}

class PreshardedRoundTrip : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(PreshardedRoundTrip, ReadsBackWhatTheLoadLeft) {
  TempDir dir;
  const LayoutCase& c = GetParam();
  const std::string ck = std::string(c.family) == "deepseek_v3_fp8_128"
                             ? testing::synth_deepseek_v3_block128(dir)
                             : testing::layout_checkpoint(dir.file("ck"), c.family);
  const Sets sets = with(c.sets, {"prefetch.enabled=false"});
  const int pp = testing::set_value(sets, "parallel.pp", 1);
  for (int stage = 0; stage < pp; ++stage) {
    SCOPED_TRACE("pipeline stage " + std::to_string(stage));
    round_trip(ck, dir.file("root"), with(sets, {"parallel.pp_rank=" + std::to_string(stage)}));
  }
  EXPECT_EQ(parts_under(dir.file("root")).size(), static_cast<std::size_t>(pp));
}

// The matrix, and three more: tp 4 over ep 2, FP8 at the sm90 target, and 128 x 128
// FP8 blocks repacked for sm100's DeepEP.
std::vector<LayoutCase> presharded_layouts() {
  std::vector<LayoutCase> out = testing::restart_layouts();
  out.push_back({"qwen3_moe", {"parallel.tp=4", "parallel.ep=2"}});
  out.push_back({"deepseek_v3_fp8", {"parallel.tp=2", "postprocess.target=sm90"}});
  out.push_back({"deepseek_v3_fp8_128",
                 {"parallel.tp=1", "postprocess.target=sm100", "parallel.moe_a2a=deepep"}});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Matrix, PreshardedRoundTrip, ::testing::ValuesIn(presharded_layouts()),
                         testing::layout_case_name);

// ---- finding the folder ----------------------------------------------------------

TEST(PreshardedLoad, FindsTheLayoutUnderTheCheckpointsPresharded) {
  TempDir dir;
  const Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::string part = round_trip(ck.dir, ck.dir + "/presharded", {"parallel.tp=2"});
  ASSERT_FALSE(part.empty());
  // model.path is the checkpoint itself, or the layout folder, or the part.
  for (const std::string& path : {ck.dir, fs::path(part).parent_path().string(), part}) {
    const LoadResult r = load(path, {"parallel.tp=2", "model.load_format=presharded"});
    ASSERT_TRUE(r) << path << ": " << r.error->message;
    EXPECT_EQ(r.model->report().presharded_read, part);
  }
  // Each rank reads only its own files: rank 1 alone never opens rank-0's.
  const LoadResult one =
      load(ck.dir, {"parallel.tp=2", "parallel.ranks=1", "model.load_format=presharded"});
  ASSERT_TRUE(one) << one.error->message;
  const std::uint64_t both =
      load(ck.dir, {"parallel.tp=2", "model.load_format=presharded"}).model->report().bytes_read;
  EXPECT_LT(one.model->report().bytes_read, both * 3 / 4);
}

// A part is one large file a rank; read lanes share it rather than follow files
// (one lane reads it at about 0.73 of `cat`, docs/PERFORMANCE.md).
TEST(PreshardedLoad, LanesShareAOneFilePart) {
  if (std::thread::hardware_concurrency() < 2) {
    GTEST_SKIP() << "one core: one lane whatever the files";
  }
  TempDir dir;
  const Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama", false, 1, std::uint64_t{1} << 30);
  const std::string part = round_trip(ck.dir, dir.file("root"), {"parallel.tp=1"});
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(part)) {
    files += e.path().extension() == ".safetensors" ? 1 : 0;
  }
  ASSERT_EQ(files, 1u);
  const LoadResult r = load(part, {"parallel.tp=1", "model.load_format=presharded"});
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_GE(r.model->report().read_lanes, 2u);
  // A raw load of a one-file checkpoint keeps one lane a file on host devices.
  const LoadResult raw = load(ck.dir, {"parallel.tp=1"});
  ASSERT_TRUE(raw) << raw.error->message;
  EXPECT_EQ(raw.model->report().files, 1u);
  EXPECT_EQ(raw.model->report().read_lanes, 1u);
}

TEST(PreshardedLoad, WithSaveAndNoFolderLoadsTheCheckpointAndSavesIt) {
  TempDir dir;
  const Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const Sets sets = {"parallel.tp=2", "model.load_format=presharded",
                     "load.save_presharded=" + ck.dir + "/presharded"};
  const LoadResult first = load(ck.dir, sets);
  ASSERT_TRUE(first) << first.error->message;
  EXPECT_EQ(first.model->report().load_format, "checkpoint");
  EXPECT_FALSE(first.model->report().presharded_saved.empty());
  const LoadResult second = load(ck.dir, sets);
  ASSERT_TRUE(second) << second.error->message;
  EXPECT_EQ(second.model->report().load_format, "presharded");
  EXPECT_EQ(second.model->report().presharded_saved, "");  // read, so nothing to save
  expect_same_model(*first.model, *second.model);
  // A raw load asking to save again leaves the part as it is.
  const LoadResult third =
      load(ck.dir, {"parallel.tp=2", "load.save_presharded=" + ck.dir + "/presharded"});
  ASSERT_TRUE(third) << third.error->message;
  EXPECT_EQ(third.model->report().presharded_saved, "");
  EXPECT_EQ(parts_under(ck.dir + "/presharded").size(), 1u);
}

TEST(PreshardedLoad, ACaptureSafeStartupReadsIt) {
  TempDir dir;
  const Checkpoint ck = synth_checkpoint(dir.file("ck"), "qwen3_moe");
  const std::string root = dir.file("root");
  const LoadResult raw = load(ck.dir, {"parallel.tp=2", "load.save_presharded=" + root});
  ASSERT_TRUE(raw) << raw.error->message;
  Runtime rt(to_config(make_config(
      root, {"parallel.tp=2", "model.load_format=presharded", "startup.mode=overlap"})));
  ASSERT_TRUE(rt.prepare().wait());
  const LoadResult committed = rt.commit().wait();
  ASSERT_TRUE(committed) << committed.error->message;
  EXPECT_EQ(committed.model->report().startup_mode, "overlap");
  expect_same_model(*raw.model, *committed.model);
}

// ---- damage ----------------------------------------------------------------------

struct Saved {
  Checkpoint ck;
  std::string root;
  std::string part;
};

Saved save_llama(TempDir& dir, const Sets& sets) {
  Saved s{synth_checkpoint(dir.file("ck"), "llama"), dir.file("root"), {}};
  const LoadResult raw = load(s.ck.dir, with(sets, {"load.save_presharded=" + s.root}));
  EXPECT_TRUE(raw) << raw.error->message;
  s.part = raw ? raw.model->report().presharded_saved : "";
  return s;
}

ErrorInfo failure(const std::string& path, const Sets& sets) {
  const LoadResult r = load(path, with(sets, {"model.load_format=presharded"}));
  EXPECT_FALSE(r);
  EXPECT_EQ(r.model, nullptr);
  return r ? ErrorInfo{} : *r.error;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// A rank's own data file (not common-*).
fs::path rank_file(const std::string& part, int tp_rank) {
  for (const auto& e : fs::directory_iterator(part)) {
    if (e.path().filename().string().rfind("rank-" + std::to_string(tp_rank) + "-", 0) == 0) {
      return e.path();
    }
  }
  ADD_FAILURE() << "no rank-" << tp_rank << " file in " << part;
  return {};
}

TEST(PreshardedDamage, ATruncatedFileIsRefusedNamingIt) {
  TempDir dir;
  const Saved s = save_llama(dir, {"parallel.tp=2"});
  const fs::path file = rank_file(s.part, 1);
  fs::resize_file(file, fs::file_size(file) - 4096);
  const ErrorInfo e = failure(s.root, {"parallel.tp=2"});
  EXPECT_THAT(e.file, HasSubstr(file.filename().string()));
  EXPECT_THAT(e.message, HasSubstr(file.filename().string()));
}

TEST(PreshardedDamage, AFlippedByteFailsTheChecksumNamingTheParam) {
  TempDir dir;
  const Saved s = save_llama(dir, {"parallel.tp=2"});
  const fs::path part(s.part);
  const nlohmann::json manifest = read_json(part / "manifest.json");
  const nlohmann::json& victim = manifest["ranks"][1]["params"][3];
  {
    std::fstream f(part / victim["file"].get<std::string>(),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(victim["offset"].get<std::uint64_t>() + 5));
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x10);
    f.seekp(static_cast<std::streamoff>(victim["offset"].get<std::uint64_t>() + 5));
    f.write(&b, 1);
  }
  const ErrorInfo e = failure(s.root, {"parallel.tp=2", "load.verify_checksums=true"});
  EXPECT_EQ(e.stage, Stage::kVerify);
  EXPECT_EQ(e.tensor, victim["name"].get<std::string>());
  EXPECT_THAT(e.message, HasSubstr("XXH3-128"));
  EXPECT_THAT(e.message, HasSubstr("tp rank 1"));
  // Without the check the load takes the bytes as they are (what the key is for).
  const LoadResult unchecked = load(s.root, {"parallel.tp=2", "model.load_format=presharded"});
  EXPECT_TRUE(unchecked) << unchecked.error->message;
}

TEST(PreshardedDamage, AnotherLayoutsFolderNamesTheFieldThatDiffers) {
  TempDir dir;
  const Saved s = save_llama(dir, {"parallel.tp=2"});
  // The layout folder itself, loaded at tp 1.
  const ErrorInfo e = failure(fs::path(s.part).parent_path().string(), {"parallel.tp=1"});
  EXPECT_EQ(e.stage, Stage::kIndex);
  EXPECT_THAT(e.message, HasSubstr("tp: the folder has 2, the load asks 1"));
  // Looked for under the checkpoint and the root: none for this layout, the other named.
  const ErrorInfo f = failure(s.ck.dir, {"parallel.tp=2", "model.dtype=f32", "load.strict=false"});
  EXPECT_THAT(f.message, HasSubstr("no presharded folder for this layout"));
  const ErrorInfo g = failure(s.root, {"parallel.tp=2", "model.dtype=f32"});
  EXPECT_THAT(g.message, HasSubstr("dtype: the folder has auto, the load asks F32"));
}

TEST(PreshardedDamage, AMissingRankIsNamed) {
  TempDir dir;
  const Saved s = save_llama(dir, {"parallel.tp=2", "parallel.ranks=0"});
  const ErrorInfo e = failure(s.root, {"parallel.tp=2", "parallel.ranks=1"});
  EXPECT_THAT(e.message, HasSubstr("tp ranks 0; the load asks stage 0, tp ranks 1"));
  // The manifest edited to drop rank 1 from a two-rank part.
  TempDir dir2;
  const Saved t = save_llama(dir2, {"parallel.tp=2"});
  nlohmann::json m = read_json(fs::path(t.part) / "manifest.json");
  m["ranks"].erase(1);
  std::ofstream(fs::path(t.part) / "manifest.json") << m.dump();
  const ErrorInfo f = failure(t.part, {"parallel.tp=2"});
  EXPECT_THAT(f.message, HasSubstr("tp ranks 0; the load asks stage 0, tp ranks 0,1"));
}

TEST(PreshardedDamage, ASaveThatNeverWroteReadyIsNamedUnfinished) {
  TempDir dir;
  const Saved s = save_llama(dir, {"parallel.tp=2"});
  fs::remove(fs::path(s.part) / "READY");
  const ErrorInfo e = failure(s.root, {"parallel.tp=2"});
  EXPECT_THAT(e.message, HasSubstr("unfinished: no READY"));
  // A save killed while it wrote: its hidden folder is named, never read.
  fs::rename(s.part, fs::path(s.part).parent_path() / ".part-pp0-tp0_1.tmp-123");
  const ErrorInfo f = failure(s.root, {"parallel.tp=2"});
  EXPECT_THAT(f.message, HasSubstr("killed before READY"));
  // With load.save_presharded the load reads the checkpoint instead, and saves it.
  const LoadResult fallback = load(s.ck.dir, {"parallel.tp=2", "model.load_format=presharded",
                                              "load.save_presharded=" + s.root});
  ASSERT_TRUE(fallback) << fallback.error->message;
  EXPECT_EQ(fallback.model->report().load_format, "checkpoint");
  EXPECT_EQ(fallback.model->report().presharded_saved, s.part);
}

TEST(PreshardedDamage, AManifestThatDisagreesWithTheLayoutIsRefusedBeforeReading) {
  TempDir dir;
  const Saved s = save_llama(dir, {"parallel.tp=2"});
  const fs::path file = fs::path(s.part) / "manifest.json";
  const nlohmann::json good = read_json(file);
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json m = good;
    edit(m);
    std::ofstream(file) << m.dump();
    return failure(s.part, {"parallel.tp=2"});
  };
  // A param rank 0 stores on its own (its tensor is "<name>@0").
  std::size_t own = 0;
  while (good["ranks"][0]["params"][own]["tensor"].get<std::string>().find('@') ==
         std::string::npos) {
    ++own;
  }
  const std::string name = good["ranks"][0]["params"][own]["name"];
  ErrorInfo e = refused([&](auto& m) {
    m["ranks"][0]["params"][own]["shape"] = {1};
    m["ranks"][0]["params"][own]["nbytes"] = 2;
  });
  EXPECT_EQ(e.stage, Stage::kIndex);
  EXPECT_EQ(e.tensor, name);
  EXPECT_THAT(e.message, HasSubstr("the layout asks BF16"));
  e = refused([&](auto& m) { m["ranks"][0]["params"].erase(own); });
  EXPECT_THAT(e.message, HasSubstr("where the layout has"));
  e = refused([&](auto& m) { m["ranks"][0]["params"][own]["offset"] = 4096 * 1000; });
  EXPECT_EQ(e.stage, Stage::kIndex);
  EXPECT_THAT(e.message, HasSubstr("the manifest stores param '" + name + "'"));
  e = refused([](auto& m) { m["pp_rank"] = 1; });
  EXPECT_THAT(e.message, HasSubstr("holds pipeline stage 1"));
  std::ofstream(file) << "{ not json";
  e = failure(s.part, {"parallel.tp=2"});
  EXPECT_EQ(e.stage, Stage::kIndex);
  EXPECT_THAT(e.message, HasSubstr("does not parse"));
  // A number too large for a double (nlohmann's out_of_range, not a parse_error).
  std::ofstream(file) << R"({"format": "ferry-presharded", "version": 98.84e888})";
  e = failure(s.part, {"parallel.tp=2"});
  EXPECT_EQ(e.stage, Stage::kIndex);
  EXPECT_THAT(e.message, HasSubstr("does not parse"));
}

// `ferry save` through the binary: every pipeline stage saved in turn, then each
// stage read back by `ferry load` and compared with a raw load's dump.
TEST(SaveCli, SavesEveryStageAndLoadReadsThemBack) {
  TempDir dir;
  const Checkpoint ck = synth_checkpoint(dir.file("ck"), "qwen3_moe");
  const std::string root = dir.file("root");
  testing::RunResult r =
      testing::run({FERRY_BINARY, "save", "--format", "presharded", "--out", root, "--model",
                    ck.dir, "--tp", "2", "--ep", "2", "--pp", "2", "--quiet"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("pipeline stage 0: saved 2 rank(s)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("pipeline stage 1: saved 2 rank(s)"), std::string::npos) << r.out;
  EXPECT_EQ(parts_under(root).size(), 2u);
  for (const char* stage : {"0", "1"}) {
    const Sets sets = {"parallel.tp=2", "parallel.ep=2", "parallel.pp=2",
                       std::string("parallel.pp_rank=") + stage};
    const LoadResult raw = load(ck.dir, sets);
    const LoadResult back = load(root, with(sets, {"model.load_format=presharded"}));
    ASSERT_TRUE(raw && back) << (raw ? back.error->message : raw.error->message);
    expect_same_model(*raw.model, *back.model);
  }
  // Again: nothing to do, and said so.
  r = testing::run({FERRY_BINARY, "save", "--out", root, "--model", ck.dir, "--tp", "2", "--ep",
                    "2", "--pp", "2", "--quiet"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("pipeline stage 1: already saved"), std::string::npos) << r.out;
  // Usage errors exit 2 and name the problem.
  r = testing::run({FERRY_BINARY, "save", "--model", ck.dir});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
  r = testing::run({FERRY_BINARY, "save", "--out", root, "--model", ck.dir, "--devices", "null"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("null devices"), std::string::npos) << r.err;
  r = testing::run({FERRY_BINARY, "save", "--out", root, "--model", ck.dir, "--format", "gguf"});
  EXPECT_EQ(r.status, 2);
  // A root that cannot be written: the save fails, naming it.
  const std::string blocked = dir.file("file-not-folder");
  std::ofstream(blocked) << "x";
  r = testing::run({FERRY_BINARY, "save", "--out", blocked, "--model", ck.dir, "--quiet"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(blocked), std::string::npos) << r.err;
}

TEST(PreshardedConfig, KeysThatWouldDoNothingAreRefused) {
  EXPECT_THROW(make_config("/x", {"load.verify_checksums=true"}), Error);
  EXPECT_THROW(make_config("/x", {"devices=null", "load.save_presharded=/y"}), Error);
  EXPECT_THROW(make_config("/x", {"model.load_format=dummy", "load.save_presharded=/y"}), Error);
  EXPECT_NO_THROW(
      make_config("/x", {"model.load_format=presharded", "load.verify_checksums=true"}));
}

}  // namespace
}  // namespace ferry::runtime
