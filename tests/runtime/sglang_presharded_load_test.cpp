// SGLang's own presharded folders read by model.load_format=presharded (issue 34).
// The fixture is written here as SGLang 0.5.23's PreshardedModelLoader writes it
// (model_loader/loader.py: _dump_state_to_disk, _build_dump_plan,
// _dump_files_for_rank, _make_filename, _hash_tensor): every rank's state dict names
// and extras keyed by content, one stored tensor per key, in a common file when every
// rank reads it and in a rank-list file otherwise; checksum.json's rank_to_reads;
// READY last. The params come from a raw ferry load, so the read must give them back
// byte for byte. tests/parity/sharded_state_parity.py checks the same against a folder
// SGLang's own code dumped.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "ferry/runtime.hpp"
#include "io/safetensors_writer.hpp"
#include "io/sglang_presharded.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::make_config;
using testing::param_bytes;
using testing::synth_checkpoint;
using testing::TempDir;

using Sets = std::vector<std::string>;

LoadResult load(const std::string& path, const Sets& sets) {
  Runtime rt(to_config(make_config(path, sets)));
  return rt.load();
}

struct Stored {
  DType dtype;
  std::vector<std::uint64_t> shape;
  std::vector<std::byte> bytes;
  std::set<int> ranks;
  std::map<int, std::vector<std::pair<std::string, bool>>> names;  // rank -> (name, extra)
};

// Writes `model`'s ranks as SGLang's dump of them under `folder`. A tied embedding is
// in SGLang's state dict twice (lm_head.weight too); MLA's w_kc / w_vc are extras.
void write_sglang_folder(const LoadedModel& model, const fs::path& folder, int tp, bool tied,
                         const std::string& dtype) {
  fs::create_directories(folder);
  std::map<std::string, Stored> by_key;
  const auto bytes = param_bytes(model);
  for (std::size_t r = 0; r < model.ranks().size(); ++r) {
    const LoadedRank& rank = model.ranks()[r];
    std::vector<std::pair<const LoadedParam*, std::string>> names;
    for (const LoadedParam& p : rank.params) {
      names.emplace_back(&p, p.name);
      if (tied && p.name == "model.embed_tokens.weight") {
        names.emplace_back(&p, "lm_head.weight");
      }
    }
    for (const auto& [p, name] : names) {
      const std::vector<std::byte>& data = bytes.at(std::to_string(r) + "/" + p->name);
      const std::string key = io::sglang_stored_key(p->dtype, p->shape, data).hex();
      Stored& s = by_key[key];
      s.dtype = p->dtype;
      s.shape = p->shape;
      s.bytes = data;
      s.ranks.insert(rank.tp_rank);
      const bool extra =
          name.ends_with("w_kc") || name.ends_with("w_vc") || name.ends_with("w_scale");
      s.names[rank.tp_rank].emplace_back(name, extra);
    }
  }
  std::map<std::set<int>, std::vector<std::string>> by_ranks;
  for (const auto& [key, s] : by_key) {
    by_ranks[s.ranks].push_back(key);
  }
  nlohmann::json files = nlohmann::json::array();
  nlohmann::json reads = nlohmann::json::object();
  int id = 0;
  for (const auto& [ranks, keys] : by_ranks) {
    const bool common = static_cast<int>(ranks.size()) == tp;
    char head[32];
    std::snprintf(head, sizeof head, "model-%05d-", id++);
    std::string name = head;
    if (common) {
      name += "common";
    } else {
      name += "rank-";
      for (int r : ranks) {
        char three[8];
        std::snprintf(three, sizeof three, "%03d", r);
        name += (name.back() == '-' ? "" : ",") + std::string(three);
      }
    }
    name += ".safetensor";
    io::SafetensorsWriter w((folder / name).string());
    for (const std::string& key : keys) {
      w.add(key, by_key[key].dtype, by_key[key].shape);
    }
    w.begin();
    for (const std::string& key : keys) {
      w.write(by_key[key].bytes);
    }
    w.finish();
    nlohmann::json tensors = nlohmann::json::array();
    for (const std::string& key : keys) {
      tensors.push_back({{"stored_key", key}, {"size", by_key[key].bytes.size()}});
      for (const auto& [rank, named] : by_key[key].names) {
        for (const auto& [n, extra] : named) {
          reads[std::to_string(rank)].push_back(
              {{"filename", name}, {"stored_key", key}, {"name", n}, {"is_extra", extra}});
        }
      }
    }
    files.push_back({{"filename", name},
                     {"is_common", common},
                     {"rank_list", common ? nlohmann::json() : nlohmann::json(ranks)},
                     {"tensors", tensors}});
  }
  const nlohmann::json plan = {{"version", 1},
                               {"world_size", tp},
                               {"files", files},
                               {"rank_to_reads", reads},
                               {"rank_checksums", nlohmann::json::object()},
                               {"shard_config",
                                {{"tp", tp},
                                 {"dp", 1},
                                 {"ep", 1},
                                 {"pp", 1},
                                 {"moe_dense_tp_size", nullptr},
                                 {"moe_dp_size", 1},
                                 {"enable_dp_lm_head", false},
                                 {"enable_fp32_lm_head", false},
                                 {"quantization", nullptr},
                                 {"model_dtype", dtype},
                                 {"ep_num_redundant_experts", 0},
                                 {"enable_eplb", false},
                                 {"init_expert_location", "trivial"},
                                 {"structural_signature", "0123456789abcdef"}}}};
  std::ofstream(folder / "checksum.json") << plan.dump(2);
  std::ofstream(folder / "READY") << R"({"plan_version": 1, "world_size": )" << tp << "}";
}

struct Case {
  const char* family;
  int tp;
  bool tied;
};

class SglangPresharded : public ::testing::TestWithParam<Case> {};

TEST_P(SglangPresharded, ReadsTheFolderBackAsTheLoadLeftIt) {
  const Case& c = GetParam();
  TempDir dir;
  const std::string ck = synth_checkpoint(dir.file("ck"), c.family, c.tied).dir;
  const Sets sets = {"parallel.tp=" + std::to_string(c.tp), "prefetch.enabled=false"};
  const LoadResult raw = load(ck, sets);
  ASSERT_TRUE(raw) << raw.error->message;
  const fs::path folder = fs::path(ck) / "presharded" / ("TP-" + std::to_string(c.tp) + "-sig-0");
  write_sglang_folder(*raw.model, folder, c.tp, c.tied, "torch.bfloat16");
  Sets read = sets;
  read.push_back("model.load_format=presharded");
  read.push_back("load.verify_checksums=true");
  for (const std::string& path : {ck, folder.string()}) {
    const LoadResult back = load(path, read);
    ASSERT_TRUE(back) << path << ": " << back.error->message;
    EXPECT_EQ(back.model->report().load_format, "presharded");
    EXPECT_EQ(back.model->report().presharded_read, folder.string());
    EXPECT_TRUE(back.model->report().checksums_verified);
    testing::expect_same_model(*raw.model, *back.model);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, SglangPresharded,
                         ::testing::Values(Case{"llama", 2, false}, Case{"llama", 1, true},
                                           Case{"qwen3_moe", 2, false},
                                           Case{"deepseek_v3", 2, false}, Case{"gemma2", 2, false}),
                         [](const ::testing::TestParamInfo<Case>& case_info) {
                           return std::string(case_info.param.family) + "_tp" +
                                  std::to_string(case_info.param.tp) +
                                  (case_info.param.tied ? "_tied" : "");
                         });

// ---- damage ----------------------------------------------------------------------

struct Fixture {
  TempDir dir;
  std::string ck;
  fs::path folder;
};

void make(Fixture& f, int tp) {
  f.ck = synth_checkpoint(f.dir.file("ck"), "llama").dir;
  const LoadResult raw = load(f.ck, {"parallel.tp=" + std::to_string(tp)});
  ASSERT_TRUE(raw) << raw.error->message;
  f.folder = fs::path(f.ck) / "presharded" / ("TP-" + std::to_string(tp) + "-sig-0");
  write_sglang_folder(*raw.model, f.folder, tp, false, "torch.bfloat16");
}

ErrorInfo failure(const std::string& path, const Sets& sets) {
  Sets all = sets;
  all.push_back("model.load_format=presharded");
  const LoadResult r = load(path, all);
  EXPECT_FALSE(r);
  EXPECT_EQ(r.model, nullptr);
  return r ? ErrorInfo{} : *r.error;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

TEST(SglangPreshardedDamage, AnotherLayoutAndAnUnfinishedDumpAreNamed) {
  Fixture f;
  make(f, 2);
  ErrorInfo e = failure(f.ck, {"parallel.tp=2", "model.dtype=f32", "load.strict=false"});
  EXPECT_THAT(e.message, HasSubstr("model_dtype: the folder has \"torch.bfloat16\", the load "
                                   "asks \"torch.float32\""));
  fs::remove(f.folder / "READY");
  e = failure(f.ck, {"parallel.tp=2"});
  EXPECT_THAT(e.message, HasSubstr("unfinished: no READY"));
}

TEST(SglangPreshardedDamage, AFlippedByteFailsTheKeyNamingTheParam) {
  Fixture f;
  make(f, 2);
  // A file only rank 1 reads: flip a byte in its last tensor's data.
  fs::path victim;
  for (const auto& e : fs::directory_iterator(f.folder)) {
    if (e.path().filename().string().find("rank-001") != std::string::npos) {
      victim = e.path();
    }
  }
  ASSERT_FALSE(victim.empty());
  {
    std::fstream io(victim, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-3, std::ios::end);
    char b = 0;
    io.read(&b, 1);
    b = static_cast<char>(b ^ 0x40);
    io.seekp(-3, std::ios::end);
    io.write(&b, 1);
  }
  const ErrorInfo e = failure(f.ck, {"parallel.tp=2", "load.verify_checksums=true"});
  EXPECT_EQ(e.stage, Stage::kVerify);
  EXPECT_THAT(e.message, HasSubstr("tp rank 1"));
  EXPECT_THAT(e.file, HasSubstr(victim.filename().string()));
  EXPECT_FALSE(e.tensor.empty());
}

TEST(SglangPreshardedDamage, APlanThatDisagreesIsRefusedBeforeReading) {
  Fixture f;
  make(f, 2);
  const fs::path file = f.folder / "checksum.json";
  const nlohmann::json good = read_json(file);
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json m = good;
    edit(m);
    std::ofstream(file) << m.dump();
    return failure(f.ck, {"parallel.tp=2"});
  };
  ErrorInfo e = refused([](auto& m) { m["rank_to_reads"].erase("1"); });
  EXPECT_THAT(e.message, HasSubstr("no reads for world rank(s) 1"));
  e = refused([](auto& m) { m["rank_to_reads"]["1"].erase(0); });
  EXPECT_EQ(e.stage, Stage::kIndex);
  EXPECT_THAT(e.message, HasSubstr("tp rank 1's files do not hold 1 of its params"));
  e = refused([](auto& m) { m["rank_to_reads"]["0"][0]["stored_key"] = std::string(32, 'a'); });
  EXPECT_THAT(e.message, HasSubstr("the file holds no such tensor"));
  e = refused([](auto& m) { m["rank_to_reads"]["0"][0]["filename"] = "../x"; });
  EXPECT_THAT(e.message, HasSubstr("is not a file of the folder"));
  e = refused([](auto& m) { m["version"] = 2; });
  EXPECT_THAT(e.message, HasSubstr("version 2"));
  e = refused([](auto& m) { m["rank_to_reads"]["0"][0]["name"] = "model.unknown.weight"; });
  EXPECT_EQ(e.tensor, "model.unknown.weight");
  EXPECT_THAT(e.message, HasSubstr("holds no param of this name"));
  e = refused([](auto& m) { m["world_size"] = 4; });
  EXPECT_THAT(e.message, HasSubstr("world_size 4"));
}

TEST(SglangPreshardedDamage, ATruncatedFileIsRefusedNamingIt) {
  Fixture f;
  make(f, 2);
  fs::path common;
  for (const auto& e : fs::directory_iterator(f.folder)) {
    if (e.path().filename().string().find("common") != std::string::npos) {
      common = e.path();
    }
  }
  ASSERT_FALSE(common.empty());
  fs::resize_file(common, fs::file_size(common) - 10);
  const ErrorInfo e = failure(f.ck, {"parallel.tp=2"});
  EXPECT_THAT(e.file, HasSubstr(common.filename().string()));
}

}  // namespace
}  // namespace ferry::runtime
