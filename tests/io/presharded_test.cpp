// The presharded folder's manifest: to_json / parse_presharded_manifest round-trip,
// every rule a reader relies on refuses a bad manifest naming the file, the param
// and the field, and the signature's first differing field is named.
#include "io/presharded.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/safetensors.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

using ::testing::HasSubstr;

PreshardedManifest sample() {
  PreshardedManifest m;
  m.signature = {{"tp", "2"}, {"dtype", "bf16"}, {"postprocess_target", "sm100"}};
  m.structure = xxh3_128(std::as_bytes(std::span("shells", 6)));
  m.pp_rank = 1;
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
  EXPECT_EQ(back.pp_rank, 1);
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
  EXPECT_THAT(with([](auto& j) { j.erase("pp_rank"); }), HasSubstr("pp_rank is missing"));
  EXPECT_THAT(with([](auto& j) { j["pp_rank"] = -2; }),
              HasSubstr("pp_rank must be a non-negative integer"));
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

// Three ranks' params in host memory: a norm the same everywhere, an o_proj of
// each rank's own, a bias two ranks share and the third does not, an empty param,
// and a large one that fills a file by itself.
struct Params {
  std::vector<PreshardedRankSpec> specs;
  std::vector<std::vector<std::vector<std::byte>>> bytes;  // [rank][param]
};

Params three_ranks() {
  Params out;
  for (int r = 0; r < 3; ++r) {
    PreshardedRankSpec spec;
    spec.tp_rank = r;
    std::vector<std::vector<std::byte>> data;
    auto add = [&](std::string name, DType dtype, std::vector<std::uint64_t> shape, unsigned seed) {
      std::uint64_t n = dtype_size(dtype);
      for (std::uint64_t d : shape) {
        n *= d;
      }
      spec.params.push_back({std::move(name), dtype, std::move(shape), n});
      std::vector<std::byte> b(n);
      for (std::uint64_t i = 0; i < n; ++i) {
        b[i] = static_cast<std::byte>((i * 131 + seed) & 0xFF);
      }
      data.push_back(std::move(b));
    };
    add("model.norm.weight", DType::kBF16, {100}, 1);
    add("model.layers.0.self_attn.o_proj.weight", DType::kBF16, {64, 40}, 10 + r);
    add("model.layers.0.mlp.bias", DType::kF32, {33}, r < 2 ? 20 : 21);
    add("model.empty", DType::kF32, {0}, 0);
    add("model.embed_tokens.weight", DType::kF8E4M3, {3, 10000}, 30 + r);
    out.specs.push_back(std::move(spec));
    out.bytes.push_back(std::move(data));
  }
  return out;
}

std::string file_bytes(const std::string& path, std::uint64_t offset, std::uint64_t n) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(offset));
  std::string out(n, '\0');
  in.read(out.data(), static_cast<std::streamsize>(n));
  return out;
}

TEST(PreshardedWrite, StoresSharedParamsOnceAlignedAndChecksummed) {
  testing::TempDir dir;
  const Params p = three_ranks();
  const std::string folder = dir.file("presharded");
  auto read = [&](std::size_t r, std::size_t k, std::uint64_t off, std::span<std::byte> out) {
    std::copy_n(p.bytes[r][k].begin() + static_cast<std::ptrdiff_t>(off), out.size(), out.begin());
  };
  PreshardedWriteOptions options;
  options.max_file_bytes = 16384;
  options.block_bytes = 4096;  // several blocks a param
  const PreshardedManifest m =
      write_presharded(folder, {{"tp", "3"}}, Hash128{7, 8}, 2, p.specs, read, options);
  EXPECT_TRUE(std::filesystem::exists(folder + "/READY"));
  // What a reader parses is what was returned.
  std::ifstream in(folder + "/manifest.json");
  const PreshardedManifest back =
      parse_presharded_manifest(nlohmann::json::parse(in), folder + "/manifest.json");
  EXPECT_EQ(back.signature, (std::map<std::string, std::string>{{"tp", "3"}}));
  EXPECT_EQ(back.structure, (Hash128{7, 8}));
  EXPECT_EQ(back.pp_rank, 2);
  ASSERT_EQ(back.ranks.size(), 3u);
  std::map<std::string, std::string> tensor_file;
  for (std::size_t r = 0; r < 3; ++r) {
    ASSERT_EQ(back.ranks[r].params.size(), 5u);
    for (std::size_t k = 0; k < 5; ++k) {
      const PreshardedParam& e = back.ranks[r].params[k];
      const std::vector<std::byte>& want = p.bytes[r][k];
      EXPECT_EQ(e.name, p.specs[r].params[k].name);
      EXPECT_EQ(e.nbytes, want.size());
      EXPECT_EQ(e.xxh3, xxh3_128(want)) << e.name;
      if (e.nbytes != 0) {
        EXPECT_EQ(e.offset % 4096, 0u) << e.name;
      }
      EXPECT_EQ(file_bytes(folder + "/" + e.file, e.offset, e.nbytes),
                std::string(reinterpret_cast<const char*>(want.data()), want.size()))
          << e.name << " rank " << r;
      tensor_file[e.tensor] = e.file;
    }
    const std::string rs = std::to_string(r);
    EXPECT_EQ(back.ranks[r].params[0].tensor, "model.norm.weight");
    EXPECT_EQ(back.ranks[r].params[1].tensor, "model.layers.0.self_attn.o_proj.weight@" + rs);
    EXPECT_EQ(back.ranks[r].params[2].tensor,
              std::string("model.layers.0.mlp.bias@") + (r < 2 ? "0,1" : "2"));
  }
  EXPECT_EQ(tensor_file.at("model.norm.weight").rfind("common-", 0), 0u);
  EXPECT_EQ(tensor_file.at("model.layers.0.self_attn.o_proj.weight@2").rfind("rank-2-", 0), 0u);
  // Every file is a safetensors file whose tensors are where the manifest says, and
  // none but a lone large tensor's exceeds max_file_bytes of data.
  std::size_t files = 0;
  std::set<std::string> names;  // over the whole folder: no tensor name twice, padding included
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    if (entry.path().extension() != ".safetensors") {
      continue;
    }
    ++files;
    const SafetensorsHeader h = read_safetensors_header(entry.path().string(), "f");
    std::size_t real = 0;
    for (const TensorInfo& t : h.tensors) {
      EXPECT_TRUE(names.insert(t.name).second) << t.name << " in a second file";
      if (!t.name.starts_with("__pad__.")) {
        ++real;
        EXPECT_EQ(tensor_file.at(t.name), entry.path().filename().string());
      }
    }
    EXPECT_TRUE(h.file_size - h.header_bytes <= options.max_file_bytes || real == 1)
        << entry.path();
  }
  EXPECT_GE(files, 4u);  // common, and each rank's (the embeddings alone)
}

TEST(PreshardedWrite, RefusesAFolderInUseAndBytesThatChange) {
  testing::TempDir dir;
  const Params p = three_ranks();
  const std::string used = dir.file("used");
  std::filesystem::create_directories(used);
  std::ofstream(used + "/stale.safetensors") << "x";
  auto read = [&](std::size_t r, std::size_t k, std::uint64_t off, std::span<std::byte> out) {
    std::copy_n(p.bytes[r][k].begin() + static_cast<std::ptrdiff_t>(off), out.size(), out.begin());
  };
  try {
    write_presharded(used, {}, {}, 0, p.specs, read);
    ADD_FAILURE() << "wrote into a folder that was not empty";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kOutput);
    EXPECT_THAT(e.rule(), HasSubstr("the folder is not empty"));
  }
  // The second read of a param differs from the first: an error naming it.
  int calls = 0;
  auto drifting = [&](std::size_t r, std::size_t k, std::uint64_t off, std::span<std::byte> out) {
    read(r, k, off, out);
    if (r == 1 && k == 1 && off == 0 && ++calls == 2) {
      out[0] ^= std::byte{1};
    }
  };
  const std::string folder = dir.file("drift");
  try {
    write_presharded(folder, {}, {}, 0, p.specs, drifting);
    ADD_FAILURE() << "bytes that changed were written";
  } catch (const Error& e) {
    EXPECT_EQ(e.tensor(), "model.layers.0.self_attn.o_proj.weight");
    EXPECT_THAT(e.rule(), HasSubstr("changed while it was written (tp rank 1)"));
  }
  // Nothing of it is left (the files written before the failure are removed).
  EXPECT_TRUE(std::filesystem::is_empty(folder));
}
}  // namespace
}  // namespace ferry::io
