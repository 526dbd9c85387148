// `ferry inspect` end to end through the binary: the stable JSON interface, the
// human form, exit codes, errors with the path as given, and `ferry demo`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "synth/synth.hpp"
#include "testing/run.hpp"
#include "testing/synth_tiny.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::tools {
namespace {

using ferry::testing::run;
using ferry::testing::synth_tiny;
using ferry::testing::TempDir;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

TEST(InspectCliTest, JsonIsOneDocumentMatchingTheFiles) {
  TempDir dir;
  std::string model = synth_tiny(dir);
  auto r = run({FERRY_BINARY, "inspect", model, "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto doc = nlohmann::json::parse(r.out);  // throws if stdout is not exactly one document
  ASSERT_TRUE(doc.contains("files") && doc.contains("skipped") && doc.contains("warnings") &&
              doc.contains("tensors") && doc.contains("total_bytes"));
  auto expected = synth::synth_tensor_list("llama", "tiny", DType::kBF16, false);
  ASSERT_EQ(doc["tensors"].size(), expected.size());
  std::uint64_t sum = 0;
  std::size_t tensor_count = 0;
  for (const auto& f : doc["files"]) {
    EXPECT_EQ(f["bytes"].get<std::uint64_t>(),
              fs::file_size(fs::path(model) / f["path"].get<std::string>()));
    EXPECT_THAT(f["reason"].get<std::string>(), HasSubstr("model.safetensors.index.json"));
    tensor_count += f["tensors"].get<std::size_t>();
  }
  EXPECT_EQ(tensor_count, expected.size());
  for (const auto& t : doc["tensors"]) {
    sum += t["nbytes"].get<std::uint64_t>();
    EXPECT_TRUE(t["dtype"] == "BF16") << t;
    // The bytes at the reported offset are the synthesized values.
    std::string file = (fs::path(model) / t["file"].get<std::string>()).string();
    std::string bytes = ferry::testing::read_file(file);
    auto off = t["offset"].get<std::uint64_t>();
    ASSERT_GE(bytes.size(), off + 2);
    std::byte want[2];
    synth::synth_encode(DType::kBF16, 1, t["name"].get<std::string>(), 0, want);
    EXPECT_EQ(std::memcmp(bytes.data() + off, want, 2), 0) << t["name"];
  }
  EXPECT_EQ(doc["total_bytes"].get<std::uint64_t>(), sum);
  EXPECT_TRUE(doc["skipped"].empty());
}

TEST(InspectCliTest, HumanFormListsFilesTensorsAndTotals) {
  TempDir dir;
  std::string model = synth_tiny(dir, "qwen2");
  auto r = run({FERRY_BINARY, "inspect", model});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("model-00001-of-"));
  EXPECT_THAT(r.out, HasSubstr("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_THAT(r.out, HasSubstr("total: "));
  EXPECT_THAT(r.out, HasSubstr("order: sorted"));
}

TEST(InspectCliTest, QuantizedGgufTensorsShowTheirBlocks) {
  TempDir dir;
  const std::string out = dir.file("q8");
  auto synth = run({FERRY_BINARY, "synth", "--family", "llama", "--preset", "tiny", "--out", out,
                    "--no-fsync", "--format", "gguf", "--gguf-type", "q8_0"});
  ASSERT_EQ(synth.status, 0) << synth.err;
  auto r = run({FERRY_BINARY, "inspect", out + "/model.gguf", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto doc = nlohmann::json::parse(r.out);
  std::size_t q8 = 0, plain = 0;
  for (const auto& t : doc["tensors"]) {
    EXPECT_TRUE(t["dtype"] == "F32") << t;  // what the blocks dequantize to, or the norms'
    if (t.contains("ggml_blocks")) {
      EXPECT_TRUE(t["ggml_blocks"] == "Q8_0") << t;
      std::uint64_t elements = 1;
      for (const auto& d : t["shape"]) {
        elements *= d.get<std::uint64_t>();
      }
      EXPECT_EQ(t["nbytes"].get<std::uint64_t>(), elements / 32 * 34) << t;
      ++q8;
    } else {
      EXPECT_EQ(t["shape"].size(), 1u) << t;  // norms stay F32
      ++plain;
    }
  }
  EXPECT_GT(q8, 5u);
  EXPECT_GT(plain, 2u);
  auto human = run({FERRY_BINARY, "inspect", out});
  ASSERT_EQ(human.status, 0) << human.err;
  EXPECT_THAT(human.out, HasSubstr("Q8_0"));
}

TEST(InspectCliTest, SingleFileIsInspectedOnItsOwn) {
  TempDir dir;
  std::string model = synth_tiny(dir);
  std::string shard = model + "/model-00001-of-0000";
  for (const auto& e : fs::directory_iterator(model)) {
    if (e.path().filename().string().rfind("model-00001-of-", 0) == 0) {
      shard = e.path().string();
    }
  }
  auto r = run({FERRY_BINARY, "inspect", shard, "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto doc = nlohmann::json::parse(r.out);
  ASSERT_EQ(doc["files"].size(), 1u);
  EXPECT_EQ(doc["files"][0]["path"], fs::path(shard).filename().string());
  EXPECT_EQ(doc["files"][0]["tensors"].get<std::size_t>(), doc["tensors"].size());
}

TEST(InspectCliTest, CorruptShardFailsWithPathAsGivenAndNoStdout) {
  TempDir dir;
  std::string model = synth_tiny(dir);
  std::string victim;
  for (const auto& e : fs::directory_iterator(model)) {
    if (e.path().extension() == ".safetensors") {
      victim = e.path().string();
    }
  }
  fs::resize_file(victim, fs::file_size(victim) - 3);
  auto r = run({FERRY_BINARY, "inspect", model, "--json"});
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_THAT(r.err, HasSubstr(model));
  EXPECT_THAT(r.err, HasSubstr(fs::path(victim).filename().string()));
  EXPECT_THAT(r.err, HasSubstr("header"));
}

TEST(InspectCliTest, MissingFolderAndUsageErrors) {
  auto r = run({FERRY_BINARY, "inspect", "/nonexistent/ferry-model"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("/nonexistent/ferry-model"));
  EXPECT_EQ(run({FERRY_BINARY, "inspect"}).status, 2);
  EXPECT_EQ(run({FERRY_BINARY, "inspect", "x", "--bogus"}).status, 2);
  auto lf = run({FERRY_BINARY, "inspect", "x", "--load-format", "onnx"});
  EXPECT_EQ(lf.status, 2);
  EXPECT_THAT(lf.err, HasSubstr("unknown load format 'onnx'"));
  EXPECT_EQ(run({FERRY_BINARY, "frobnicate"}).status, 2);
}

TEST(InspectCliTest, PickleCheckpointThatIsNotAnArchiveIsRefusedByName) {
  TempDir dir;
  ferry::testing::write_file(dir.file("pytorch_model.bin"), "not really a pickle");
  ferry::testing::write_file(dir.file("training_args.bin"), "x");
  auto r = run({FERRY_BINARY, "inspect", dir.str()});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("pytorch_model.bin"));
  EXPECT_THAT(r.err, HasSubstr("not a torch.save zip archive"));
}

TEST(DemoCliTest, SynthesizesOnceThenReusesTheCache) {
  TempDir dir;
  auto first = run({FERRY_BINARY, "demo", "--cache", dir.str()});
  ASSERT_EQ(first.status, 0) << first.err;
  EXPECT_THAT(first.out, HasSubstr("synthesized deepseek_v3 tiny"));
  // A real load of the embedded default: tp 2 and ep 2 on two host devices, where
  // each rank keeps half of the routed experts and the target model drops the MTP
  // layer.
  EXPECT_THAT(first.out, HasSubstr("tp rank 0 on host:0"));
  EXPECT_THAT(first.out, HasSubstr("tp rank 1 on host:1"));
  EXPECT_THAT(first.out, HasSubstr("dropped"));
  auto second = run({FERRY_BINARY, "demo", "--cache", dir.str()});
  ASSERT_EQ(second.status, 0) << second.err;
  EXPECT_THAT(second.out, HasSubstr("using the cached checkpoint"));
}

TEST(DemoCliTest, RejectsUnknownConfigKeys) {
  TempDir dir;
  ferry::testing::write_file(dir.file("c.json"), R"({"parallel":{"tp":2,"colour":"red"}})");
  auto r = run({FERRY_BINARY, "demo", "--config", dir.file("c.json"), "--cache", dir.str()});
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.err, HasSubstr("parallel.colour"));
}

}  // namespace
}  // namespace ferry::tools
