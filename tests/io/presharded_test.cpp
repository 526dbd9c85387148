// The presharded folder's manifest: to_json / parse_presharded_manifest round-trip,
// every rule a reader relies on refuses a bad manifest naming the file, the param
// and the field, and the signature's first differing field is named.
#include "io/presharded.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "common/error.hpp"

namespace ferry::io {
namespace {

using ::testing::HasSubstr;

PreshardedManifest sample() {
  PreshardedManifest m;
  m.signature = {{"tp", "2"}, {"dtype", "bf16"}, {"postprocess_target", "sm100"}};
  m.structure = xxh3_128(std::as_bytes(std::span("shells", 6)));
  for (int r = 0; r < 2; ++r) {
    PreshardedRank rank;
    rank.tp_rank = r;
    rank.params.push_back({"model.norm.weight",
                           "model.norm.weight",
                           DType::kBF16,
                           {64},
                           128,
                           "common-00000.safetensors",
                           4096,
                           Hash128{1, 2}});
    rank.params.push_back({"model.layers.0.self_attn.o_proj.weight",
                           "model.layers.0.self_attn.o_proj.weight@" + std::to_string(r),
                           DType::kBF16,
                           {64, 32},
                           4096,
                           "rank-" + std::to_string(r) + "-00000.safetensors",
                           8192,
                           Hash128{3, static_cast<std::uint64_t>(r)}});
    m.ranks.push_back(std::move(rank));
  }
  return m;
}

std::string error_of(const nlohmann::json& j) {
  try {
    parse_presharded_manifest(j, "/ckpt/presharded/manifest.json");
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kIndex);
    EXPECT_EQ(e.file(), "/ckpt/presharded/manifest.json");
    return e.tensor() + " | " + e.rule();
  }
  ADD_FAILURE() << "accepted: " << j.dump();
  return {};
}

TEST(PreshardedManifest, RoundTripsThroughJson) {
  const PreshardedManifest m = sample();
  const nlohmann::json j = to_json(m);
  EXPECT_EQ(j["format"], "ferry-presharded");
  EXPECT_EQ(j["version"], kPreshardedVersion);
  const PreshardedManifest back =
      parse_presharded_manifest(nlohmann::json::parse(j.dump()), "manifest.json");
  EXPECT_EQ(back.signature, m.signature);
  EXPECT_EQ(back.structure, m.structure);
  ASSERT_EQ(back.ranks.size(), 2u);
  for (std::size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(back.ranks[r].params.size(), 2u);
    EXPECT_EQ(back.ranks[r].tp_rank, static_cast<int>(r));
    for (std::size_t k = 0; k < 2; ++k) {
      const PreshardedParam& a = back.ranks[r].params[k];
      const PreshardedParam& b = m.ranks[r].params[k];
      EXPECT_EQ(std::tie(a.name, a.tensor, a.dtype, a.shape, a.nbytes, a.file, a.offset),
                std::tie(b.name, b.tensor, b.dtype, b.shape, b.nbytes, b.file, b.offset));
      EXPECT_EQ(a.xxh3, b.xxh3);
    }
  }
}

TEST(PreshardedManifest, EveryBadFieldIsRefusedByName) {
  const nlohmann::json good = to_json(sample());
  auto with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = good;
    change(j);
    return error_of(j);
  };
  const std::string o_proj = "model.layers.0.self_attn.o_proj.weight";
  EXPECT_THAT(error_of(nlohmann::json::array()), HasSubstr("expected a JSON object"));
  EXPECT_THAT(with([](auto& j) { j["format"] = "other"; }), HasSubstr("format must be"));
  EXPECT_THAT(with([](auto& j) { j["version"] = 2; }), HasSubstr("version 2 is not the one"));
  EXPECT_THAT(with([](auto& j) { j.erase("signature"); }), HasSubstr("signature is missing"));
  EXPECT_THAT(with([](auto& j) { j["signature"]["tp"] = 2; }),
              HasSubstr("signature.tp must be a string"));
  EXPECT_THAT(with([](auto& j) { j["structure"] = "abc"; }), HasSubstr("32 hex digits"));
  EXPECT_THAT(with([](auto& j) { j["ranks"] = nlohmann::json::array(); }),
              HasSubstr("ranks must be a non-empty array"));
  EXPECT_THAT(with([](auto& j) { j["ranks"][1]["tp_rank"] = 0; }), HasSubstr("listed twice"));
  EXPECT_THAT(with([](auto& j) { j["ranks"][0]["tp_rank"] = -1; }),
              HasSubstr("ranks[0].tp_rank must be a non-negative integer"));
  EXPECT_THAT(with([](auto& j) { j["ranks"][0]["params"][1] = j["ranks"][0]["params"][0]; }),
              HasSubstr("model.norm.weight | presharded manifest: ranks[0].params[1].name is "
                        "listed twice"));
  EXPECT_THAT(with([](auto& j) { j["ranks"][0]["params"][1]["dtype"] = "F128"; }),
              HasSubstr(o_proj + " | presharded manifest: ranks[0].params[1].dtype"));
  EXPECT_THAT(with([](auto& j) {
                j["ranks"][0]["params"][1]["shape"] = {64, -1};
              }),
              HasSubstr("shape must be an array of non-negative integers"));
  EXPECT_THAT(with([](auto& j) { j["ranks"][0]["params"][1]["nbytes"] = 4095; }),
              HasSubstr("nbytes 4095 is not BF16 x the shape's elements"));
  for (const char* escape : {"../x.safetensors", "/etc/passwd", "..", "a/b.safetensors"}) {
    EXPECT_THAT(with([&](auto& j) { j["ranks"][0]["params"][1]["file"] = escape; }),
                HasSubstr("is not a file name inside the folder"))
        << escape;
  }
  EXPECT_THAT(with([](auto& j) { j["ranks"][0]["params"][1]["offset"] = 8193; }),
              HasSubstr("offset 8193 is not a multiple of 4096"));
  EXPECT_THAT(with([](auto& j) { j["ranks"][0]["params"][1]["offset"] = UINT64_MAX - 4095; }),
              HasSubstr("offset + nbytes overflows"));
  EXPECT_THAT(with([](auto& j) { j["ranks"][0]["params"][1]["xxh3"] = "zz"; }),
              HasSubstr("xxh3 must be 32 hex digits"));
  // The shared norm given another range on rank 1.
  EXPECT_THAT(with([](auto& j) { j["ranks"][1]["params"][0]["offset"] = 12288; }),
              HasSubstr("\"model.norm.weight\" is given two different files or byte ranges"));
  EXPECT_THAT(with([](auto& j) { j["ranks"][1]["params"][0].erase("tensor"); }),
              HasSubstr("ranks[1].params[0].tensor is missing"));
}

TEST(PreshardedManifest, TheFirstDifferingSignatureFieldIsNamed) {
  const std::map<std::string, std::string> folder = {{"tp", "2"}, {"dtype", "bf16"}};
  EXPECT_EQ(presharded_mismatch(folder, folder), "");
  EXPECT_EQ(presharded_mismatch(folder, {{"tp", "4"}, {"dtype", "bf16"}}),
            "tp: the folder has 2, the load asks 4");
  EXPECT_EQ(presharded_mismatch(folder, {{"tp", "2"}, {"dtype", "bf16"}, {"ep", "2"}}),
            "ep: the folder has (none), the load asks 2");
}

}  // namespace
}  // namespace ferry::io
