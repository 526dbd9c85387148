// `ferry load` through the built binary: exit status, the JSON report, the dump
// files (readable by ferry's own header parser, params in logical shape with the
// reference's values), and a failing load that exits non-zero and dumps nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "models/model.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::read_file;
using testing::run;
using testing::synth_checkpoint;
using testing::TempDir;

TEST(LoadCli, LoadsReportsAndDumps) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "qwen2");
  const std::string report = dir.file("r.json");
  const std::string dump = dir.file("d/nested");
  testing::RunResult r = run({FERRY_BINARY, "load", "--model", ck.dir, "--tp", "2", "--report",
                              report, "--dump-dir", dump});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("loaded " + std::to_string(ck.shapes.size()) + " tensors"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("tp rank 1 on host:1"), std::string::npos) << r.out;

  nlohmann::json j = nlohmann::json::parse(read_file(report));
  for (const char* key :
       {"bytes_read", "bytes_skipped", "bytes_copied", "seconds", "phases", "gbps",
        "peak_rss_bytes", "staging_high_water_bytes", "files", "tensors"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["tensors"]["placed"], ck.shapes.size());
  EXPECT_EQ(j["bytes_read"].get<std::uint64_t>(), ck.file_bytes());
  for (const char* phase : {"resolve", "plan", "allocate", "stream", "postprocess", "verify"}) {
    EXPECT_TRUE(j["phases"].contains(phase)) << phase;
  }

  for (int rank : {0, 1}) {
    const std::string file = dump + "/rank-" + std::to_string(rank) + ".safetensors";
    ASSERT_TRUE(std::filesystem::exists(file)) << file;
    io::SafetensorsHeader h = io::read_safetensors_header(file, file);
    std::map<std::string, testing::RefTensor> ref = testing::reference_rank(ck, 2, rank);
    ASSERT_EQ(h.tensors.size(), ref.size());
    const std::string bytes = read_file(file);
    for (const io::TensorInfo& t : h.tensors) {
      ASSERT_TRUE(ref.count(t.name)) << t.name;
      EXPECT_EQ(t.shape, ref[t.name].shape) << t.name;
      EXPECT_EQ(t.dtype, DType::kBF16);
      std::vector<std::byte> want = testing::encode(ref[t.name].values, DType::kBF16);
      ASSERT_EQ(t.nbytes, want.size()) << t.name;
      EXPECT_EQ(std::memcmp(bytes.data() + t.offset, want.data(), want.size()), 0) << t.name;
    }
  }
}

TEST(LoadCli, RanksFlagDumpsOnlyLocalRanks) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama", true);
  const std::string dump = dir.file("d");
  testing::RunResult r = run({FERRY_BINARY, "load", "--model", ck.dir, "--tp=4", "--ranks", "3",
                              "--dump-dir", dump, "--set", "io.chunk_bytes=64KiB"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dump + "/rank-3.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dump + "/rank-0.safetensors"));
  EXPECT_NE(r.out.find("tp rank 3 on host:0"), std::string::npos) << r.out;
}

TEST(LoadCli, FailingLoadExitsNonZeroAndDumpsNothing) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::string shard = ck.dir + "/model-00003-of-00004.safetensors";
  std::filesystem::resize_file(shard, 1000);
  const std::string dump = dir.file("d");
  const std::string report = dir.file("r.json");
  testing::RunResult r = run({FERRY_BINARY, "load", "--model", ck.dir, "--tp", "2", "--dump-dir",
                              dump, "--report", report});
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.err.find("error"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("model-00003-of-00004.safetensors"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dump));
  EXPECT_FALSE(std::filesystem::exists(report));
}

TEST(LoadCli, ThenUpdateDumpsAndReportsTheUpdatedModel) {
  TempDir dir;
  Checkpoint a = synth_checkpoint(dir.file("a"), "qwen2", false, 1);
  Checkpoint b = synth_checkpoint(dir.file("b"), "qwen2", false, 2);
  const std::string report = dir.file("r.json");
  const std::string dump = dir.file("d");
  testing::RunResult r = run({FERRY_BINARY, "load", "--model", a.dir, "--tp", "2", "--then-update",
                              b.dir, "--report", report, "--dump-dir", dump, "--quiet"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("update from " + b.dir), std::string::npos) << r.out;
  nlohmann::json j = nlohmann::json::parse(read_file(report));
  EXPECT_EQ(j["startup_mode"], "update");
  EXPECT_EQ(j["update"]["source"], b.dir);
  EXPECT_EQ(j["update"]["params_unchanged"], 0);
  EXPECT_EQ(j["update"]["rollback"], "reread");
  // The dump is B's, as the reference computes rank 1 of tp 2 from B's values.
  const std::string file = dump + "/rank-1.safetensors";
  io::SafetensorsHeader h = io::read_safetensors_header(file, file);
  std::map<std::string, testing::RefTensor> ref = testing::reference_rank(b, 2, 1);
  const std::string bytes = read_file(file);
  ASSERT_EQ(h.tensors.size(), ref.size());
  for (const io::TensorInfo& t : h.tensors) {
    std::vector<std::byte> want = testing::encode(ref.at(t.name).values, DType::kBF16);
    ASSERT_EQ(t.nbytes, want.size()) << t.name;
    EXPECT_EQ(std::memcmp(bytes.data() + t.offset, want.data(), want.size()), 0) << t.name;
  }
  // A part of a fused param: refused, exit 1, nothing dumped.
  const std::string dump2 = dir.file("d2");
  r = run({FERRY_BINARY, "load", "--model", a.dir, "--then-update", b.dir, "--update-names",
           "model.layers.0.self_attn.k_proj.*", "--dump-dir", dump2, "--quiet"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("update refused"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dump2));
  // --update-names alone is a usage error.
  r = run({FERRY_BINARY, "load", "--model", a.dir, "--update-names", "x", "--quiet"});
  EXPECT_EQ(r.status, 2);
}

TEST(LoadCli, StartupBootsThroughPrepareACaptureAndCommit) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  for (const std::string mode : {"serial", "overlap", "auto"}) {
    SCOPED_TRACE(mode);
    const std::string report = dir.file(mode + ".json");
    testing::RunResult r = run({FERRY_BINARY, "load", "--model", ck.dir, "--startup", mode,
                                "--capture-seconds", "0.2", "--report", report});
    ASSERT_EQ(r.status, 0) << r.err;
    const std::string ran = mode == "serial" ? "serial" : "overlap";
    EXPECT_NE(r.out.find("startup " + ran + ": ready "), std::string::npos) << r.out;
    nlohmann::json j = nlohmann::json::parse(read_file(report));
    EXPECT_EQ(j["startup_mode"], ran);
    EXPECT_GE(j["startup"]["capture"].get<double>(), 0.2);
    EXPECT_GE(j["startup"]["time_to_ready"].get<double>(), 0.2);
  }
  // Overlap refuses O_DIRECT reads with its code; auto says why it ran serially.
  testing::RunResult r = run(
      {FERRY_BINARY, "load", "--model", ck.dir, "--startup", "overlap", "--set", "io.direct=true"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("startup.mode overlap refused: io_direct: "), std::string::npos) << r.err;
  r = run(
      {FERRY_BINARY, "load", "--model", ck.dir, "--startup", "auto", "--set", "io.direct=true"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("startup overlap refused: io_direct: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("startup serial: ready "), std::string::npos) << r.out;
  // Bad values.
  r = run({FERRY_BINARY, "load", "--model", ck.dir, "--startup", "eager"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("startup.mode"), std::string::npos) << r.err;
  r = run(
      {FERRY_BINARY, "load", "--model", ck.dir, "--startup", "overlap", "--capture-seconds", "-1"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--capture-seconds"), std::string::npos) << r.err;
}

// postprocess.target on the command line: a tiny FP8 per-tensor Llama and a
// block-FP8 DeepSeek-V3 load on sm90, the report and the dump say and hold the
// target's layout; on sm100 DeepSeek-V3's experts follow flashinfer_trtllm, and the
// unquantized ones are refused naming that MoE runner.
TEST(LoadCli, PostprocessTargetOnTheCommandLine) {
  TempDir dir;
  struct Case {
    std::string family, quant, served_param, served_shape;
  };
  const Case cases[] = {
      // fp8-tensor is compressed-tensors: one scalar scale a weight after requantizing.
      {"llama", "fp8-tensor", "model.layers.0.self_attn.qkv_proj.weight_scale", "[]"},
      {"deepseek_v3", "fp8-block", "", ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.family);
    const std::string ck = dir.file(c.family);
    std::vector<std::string> synth = {FERRY_BINARY, "synth", "--family", c.family, "--preset",
                                      "tiny", "--quant", c.quant, "--out", ck};
    if (c.quant == "fp8-block") {  // blocks of 32: tiny DeepSeek's fused slots start on them
      synth.insert(synth.end(), {"--quant-block", "32"});
    }
    testing::RunResult s = run(synth);
    ASSERT_EQ(s.status, 0) << s.err;
    const std::string report = dir.file(c.family + ".json");
    const std::string dump = dir.file(c.family + "-dump");
    testing::RunResult r =
        run({FERRY_BINARY, "load", "--model", ck, "--tp", "1", "--set", "postprocess.target=sm90",
             "--report", report, "--dump-dir", dump});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(nlohmann::json::parse(read_file(report))["postprocess_target"], "sm90");
    const std::string file = dump + "/rank-0.safetensors";
    io::SafetensorsHeader h = io::read_safetensors_header(file, file);
    bool found = c.served_param.empty();
    for (const io::TensorInfo& t : h.tensors) {
      EXPECT_EQ(t.name.find("_loaded"), std::string::npos) << t.name;  // freed twins
      if (t.name == c.served_param) {
        found = true;
        EXPECT_EQ(models::format_shape(t.shape), c.served_shape);
      }
    }
    EXPECT_TRUE(found) << c.served_param;
  }
  // On sm100 the block-FP8 DeepSeek-V3's experts are flashinfer_trtllm's (w13 up rows
  // first, the intermediate size padded to 128); the unquantized one's are its BF16
  // blocks, and refused in an F16 model (SGLang views them as BF16).
  testing::RunResult served = run({FERRY_BINARY, "load", "--model", dir.file("deepseek_v3"),
                                   "--tp", "1", "--set", "postprocess.target=sm100"});
  EXPECT_EQ(served.status, 0) << served.err;
  EXPECT_NE((served.out + served.err).find("flashinfer_trtllm"), std::string::npos)  // a note
      << served.out << served.err;
  const std::string bf16 = dir.file("deepseek_v3-bf16");
  ASSERT_EQ(run({FERRY_BINARY, "synth", "--family", "deepseek_v3", "--preset", "tiny", "--out",
                 bf16})
                .status,
            0);
  testing::RunResult blocks = run(
      {FERRY_BINARY, "load", "--model", bf16, "--tp", "1", "--set", "postprocess.target=sm100"});
  EXPECT_EQ(blocks.status, 0) << blocks.err;
  testing::RunResult refused = run({FERRY_BINARY, "load", "--model", bf16, "--tp", "1", "--set",
                                    "postprocess.target=sm100", "--set", "model.dtype=f16"});
  EXPECT_NE(refused.status, 0);
  EXPECT_NE(refused.err.find("flashinfer_trtllm"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("views them as BF16"), std::string::npos) << refused.err;
  testing::RunResult bad =
      run({FERRY_BINARY, "load", "--model", dir.file("llama"), "--set", "postprocess.target=h100"});
  EXPECT_EQ(bad.status, 2) << bad.err;
  EXPECT_NE(bad.err.find("postprocess.target"), std::string::npos) << bad.err;
}

TEST(LoadCli, UsageErrors) {
  testing::RunResult r = run({FERRY_BINARY, "load"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--model"), std::string::npos) << r.err;
  r = run({FERRY_BINARY, "load", "--model"});
  EXPECT_EQ(r.status, 2);
  r = run({FERRY_BINARY, "load", "--bogus", "x"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--bogus"), std::string::npos) << r.err;
  r = run({FERRY_BINARY, "load", "--model", "/nonexistent", "--set", "io.chunk_byte=4096"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("io.chunk_byte"), std::string::npos) << r.err;
  r = run({FERRY_BINARY, "load", "--help"});
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("--dump-dir"), std::string::npos);
}

}  // namespace
}  // namespace ferry::runtime
