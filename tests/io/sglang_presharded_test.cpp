// SGLang's presharded plan (io/sglang_presharded.hpp): the stored key as SGLang
// 0.5.23's PreshardedModelLoader._hash_tensor makes it, and checksum.json parsed
// strictly.
#include "io/sglang_presharded.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/error.hpp"

namespace ferry::io {
namespace {

using ::testing::HasSubstr;

TEST(SglangStoredKey, HashesPythonsShapeAndTorchsDtypeThenTheBytes) {
  const std::vector<std::byte> data = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  // str((2,)) + str(torch.bfloat16) = "(2,)torch.bfloat16"
  const std::string prefix = "(2,)torch.bfloat16";
  std::vector<std::byte> all(reinterpret_cast<const std::byte*>(prefix.data()),
                             reinterpret_cast<const std::byte*>(prefix.data()) + prefix.size());
  all.insert(all.end(), data.begin(), data.end());
  EXPECT_EQ(sglang_stored_key(DType::kBF16, {2}, data), xxh3_128(all));
  const std::string scalar = "()torch.float32";
  EXPECT_EQ(sglang_stored_key(DType::kF32, {}, {}),
            xxh3_128(std::as_bytes(std::span(scalar.data(), scalar.size()))));
  const std::string matrix = "(4, 8)torch.float8_e4m3fn";
  EXPECT_EQ(sglang_stored_key(DType::kF8E4M3, {4, 8}, {}),
            xxh3_128(std::as_bytes(std::span(matrix.data(), matrix.size()))));
}

nlohmann::json plan() {
  return nlohmann::json::parse(R"({
    "version": 1, "world_size": 2,
    "rank_to_reads": {
      "0": [{"filename": "model-00000-common.safetensor",
             "stored_key": "0123456789abcdef0123456789abcdef", "name": "a.weight",
             "is_extra": false}],
      "1": [{"filename": "model-00000-common.safetensor",
             "stored_key": "0123456789abcdef0123456789abcdef", "name": "a.weight"},
            {"filename": "model-00001-rank-001.safetensor",
             "stored_key": "fedcba9876543210fedcba9876543210", "name": "w_kc",
             "is_extra": true}]},
    "shard_config": {"tp": 2}})");
}

TEST(SglangPlan, ParsesEachRanksReads) {
  const SglangPlan p = parse_sglang_plan(plan(), "checksum.json");
  EXPECT_EQ(p.world_size, 2);
  ASSERT_EQ(p.reads.at(1).size(), 2u);
  EXPECT_EQ(p.reads.at(1)[1].file, "model-00001-rank-001.safetensor");
  EXPECT_TRUE(p.reads.at(1)[1].extra);
  EXPECT_FALSE(p.reads.at(1)[0].extra);
  EXPECT_EQ(p.shard_config["tp"], 2);
}

TEST(SglangPlan, RefusesWhatSGLangDoesNotWriteNamingTheField) {
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, const char*>> cases = {
      {[](auto& j) { j["version"] = 2; }, "version 2"},
      {[](auto& j) { j["world_size"] = 0; }, "world_size 0"},
      {[](auto& j) { j["world_size"] = "2"; }, "world_size \"2\""},
      {[](auto& j) { j.erase("rank_to_reads"); }, "\"rank_to_reads\" is missing"},
      {[](auto& j) { j["rank_to_reads"]["2"] = j["rank_to_reads"]["0"]; }, "outside world_size"},
      {[](auto& j) { j["rank_to_reads"]["01"] = j["rank_to_reads"]["0"]; }, "not a world rank"},
      {[](auto& j) { j["rank_to_reads"]["0"] = 5; }, "is not an array"},
      {[](auto& j) { j["rank_to_reads"]["0"][0]["filename"] = "a/b"; }, "not a file of the folder"},
      {[](auto& j) { j["rank_to_reads"]["0"][0]["filename"] = ".."; }, "not a file of the folder"},
      {[](auto& j) { j["rank_to_reads"]["0"][0]["stored_key"] = "xyz"; }, "not 32 hex digits"},
      {[](auto& j) { j["rank_to_reads"]["0"][0].erase("name"); }, "\"name\" is missing"},
      {[](auto& j) { j["rank_to_reads"]["0"][0]["is_extra"] = 1; }, "not a boolean"},
      {[](auto& j) { j = nlohmann::json::array(); }, "not a JSON object"},
  };
  for (const auto& [edit, message] : cases) {
    nlohmann::json j = plan();
    edit(j);
    try {
      parse_sglang_plan(j, "checksum.json");
      ADD_FAILURE() << message << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kIndex);
      EXPECT_EQ(e.file(), "checksum.json");
      EXPECT_THAT(e.what(), HasSubstr(message));
    }
  }
}

}  // namespace
}  // namespace ferry::io
