// End-to-end loads of Mixtral, Qwen3-MoE and Qwen2-MoE checkpoints through
// ferry::Runtime on host devices, with expert parallelism: every element of every
// param of every local rank against the independent reference
// (tests/models/moe_reference.hpp), the bytes an expert-parallel rank reads against
// a sum computed here from the checkpoint's index and headers, fused 3-D expert
// tensors against the per-expert checkpoint they were made from, and bad inputs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "io/safetensors_writer.hpp"
#include "models/moe_reference.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::AllOf;
using testing::Checkpoint;
using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;
namespace moe_ref = testing::moe_ref;

LoadResult load(const LoadConfig& config) {
  Runtime rt(to_config(config));
  LoadResult r = rt.load();
  EXPECT_TRUE(r) << (r.error ? r.error->message : "");
  return r;
}

ErrorInfo load_error(const LoadConfig& config) {
  Runtime rt(to_config(config));
  LoadResult r = rt.load();
  EXPECT_FALSE(r);
  return r.error.value_or(ErrorInfo{});
}

std::string set(const std::string& key, const std::string& value) {
  return key + "=" + value;
}
std::string tp(int n) {
  return set("parallel.tp", std::to_string(n));
}
std::string ep(int n) {
  return set("parallel.ep", std::to_string(n));
}

// Checks every param of every local rank against the reference (names, shapes,
// dtype, bytes); returns the number of params compared.
std::size_t expect_matches(const LoadedModel& model, const nlohmann::json& config,
                           moe_ref::Values& values, const moe_ref::Options& o, DType dtype) {
  std::size_t compared = 0;
  for (std::size_t r = 0; r < model.ranks().size(); ++r) {
    compared += testing::expect_rank_matches(
        model, r, moe_ref::reference_rank(config, values, o, model.ranks()[r].tp_rank), dtype);
  }
  return compared;
}

moe_ref::Options ref_options(int tp_size, int ep_size) {
  moe_ref::Options o;
  o.tp = tp_size;
  o.ep = ep_size;
  return o;
}

// The shapes of a tiny synthetic checkpoint of `family` (per expert or fused).
std::map<std::string, std::vector<std::uint64_t>> tiny_shapes(const std::string& family,
                                                              bool fused) {
  std::map<std::string, std::vector<std::uint64_t>> out;
  for (const synth::SynthTensor& t :
       synth::synth_tensor_list(family, "tiny", DType::kBF16, false, fused)) {
    out[t.name] = t.shape;
  }
  return out;
}

class MoeLoadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    mixtral_ = new Checkpoint(synth_checkpoint(dir_->file("mixtral"), "mixtral", false, 3));
    qwen3_ = new Checkpoint(synth_checkpoint(dir_->file("qwen3"), "qwen3_moe", false, 5));
    qwen2_ = new Checkpoint(synth_checkpoint(dir_->file("qwen2"), "qwen2_moe", false, 9));
  }
  static void TearDownTestSuite() {
    delete mixtral_;
    delete qwen3_;
    delete qwen2_;
    delete dir_;
  }
  static moe_ref::Values& values_of(const Checkpoint& ck) {
    static std::map<std::uint64_t, moe_ref::Values> cache;
    return cache.try_emplace(ck.seed, ck.seed).first->second;
  }
  static TempDir* dir_;
  static Checkpoint* mixtral_;
  static Checkpoint* qwen3_;
  static Checkpoint* qwen2_;
};
TempDir* MoeLoadTest::dir_ = nullptr;
Checkpoint* MoeLoadTest::mixtral_ = nullptr;
Checkpoint* MoeLoadTest::qwen3_ = nullptr;
Checkpoint* MoeLoadTest::qwen2_ = nullptr;

TEST_F(MoeLoadTest, EveryFamilyAtEveryTpAndEp) {
  for (const Checkpoint* ck : {mixtral_, qwen3_, qwen2_}) {
    for (auto [t, e] :
         {std::pair{1, 1}, std::pair{2, 2}, std::pair{4, 1}, std::pair{4, 2}, std::pair{4, 4}}) {
      SCOPED_TRACE(ck->family + " tp " + std::to_string(t) + " ep " + std::to_string(e));
      LoadResult r = load(make_config(ck->dir, {tp(t), ep(e)}));
      ASSERT_TRUE(r);
      EXPECT_GT(
          expect_matches(*r.model, ck->config, values_of(*ck), ref_options(t, e), DType::kBF16),
          0u);
      const LoadReport& rep = r.model->report();
      EXPECT_EQ(rep.tensors.unmapped, 0u);
      EXPECT_EQ(rep.tensors.dropped, 0u);  // all ranks local: every expert is someone's
      EXPECT_EQ(rep.tensors.placed, ck->shapes.size());
    }
  }
}

TEST_F(MoeLoadTest, SubsetsOfRanksSwitchW13PaddingEplbAndFusedSharedExperts) {
  // EPLB with replicas: 8 logical experts on 12 slots, physical id (5i + l) % 12.
  nlohmann::json map;
  map["num_physical_experts"] = 12;
  std::map<std::uint64_t, std::vector<std::vector<std::uint64_t>>> eplb;
  for (std::uint64_t l = 0; l < 4; ++l) {
    auto& layer = eplb[l];
    for (std::uint64_t x = 0; x < 8; ++x) {
      layer.push_back({(5 * x + l) % 12});
      if (x < 4) {
        layer.back().push_back((5 * (8 + x) + l) % 12);
      }
    }
    map["layers"][std::to_string(l)] = layer;
  }
  const std::string map_file = dir_->file("eplb.json");
  testing::write_file(map_file, map.dump());

  struct Variant {
    std::vector<std::string> sets;
    moe_ref::Options o;
  };
  auto opts = [&](int t, int e, bool sw, std::uint64_t pad, bool use_eplb, bool unaligned) {
    moe_ref::Options o = ref_options(t, e);
    o.switch_w13 = sw;
    o.pad = pad;
    o.unaligned_pad = unaligned;
    if (use_eplb) {
      o.physical = 12;
      o.eplb = eplb;
    }
    return o;
  };
  const std::vector<Variant> variants{
      {{tp(4), ep(2), "parallel.ranks=3,0"}, opts(4, 2, false, 0, false, false)},
      {{tp(2), ep(1), "model.switch_w13=true", "model.pad_moe_intermediate_to=128"},
       opts(2, 1, true, 128, false, false)},
      {{tp(4), ep(2), set("model.eplb_map", map_file), "parallel.ranks=1,2"},
       opts(4, 2, false, 0, true, false)},
      {{tp(4), ep(4), set("model.eplb_map", map_file), "model.unaligned_tp=pad",
        "model.switch_w13=true", "model.pad_moe_intermediate_to=128", "parallel.ranks=2"},
       opts(4, 4, true, 128, true, true)},
  };
  for (const Checkpoint* ck : {mixtral_, qwen3_, qwen2_}) {
    for (const Variant& v : variants) {
      std::string label = ck->family;
      for (const std::string& s : v.sets) {
        label += " " + s;
      }
      SCOPED_TRACE(label);
      LoadResult r = load(make_config(ck->dir, v.sets));
      ASSERT_TRUE(r);
      EXPECT_GT(expect_matches(*r.model, ck->config, values_of(*ck), v.o, DType::kBF16), 0u);
    }
  }
}

// One rank of tp 8 / ep 8 reads the bytes of the non-expert tensors it keeps (its
// slices of them) and its own expert, nothing else.
TEST_F(MoeLoadTest, AnExpertParallelRankReadsOnlyItsExperts) {
  const Checkpoint& ck = *mixtral_;
  LoadResult r = load(make_config(ck.dir, {tp(8), ep(8), "parallel.ranks=5"}));
  ASSERT_TRUE(r);
  EXPECT_GT(expect_matches(*r.model, ck.config, values_of(ck), ref_options(8, 8), DType::kBF16),
            0u);

  // Tensor sizes from the checkpoint's own index and headers.
  const nlohmann::json index =
      nlohmann::json::parse(testing::read_file(ck.dir + "/model.safetensors.index.json"));
  std::map<std::string, io::TensorInfo> tensors;
  std::set<std::string> files;
  for (const auto& [name, file] : index.at("weight_map").items()) {
    files.insert(file.get<std::string>());
  }
  std::uint64_t file_bytes = 0;
  for (const std::string& f : files) {
    io::SafetensorsHeader h = io::read_safetensors_header(ck.dir + "/" + f, f);
    for (const io::TensorInfo& t : h.tensors) {
      tensors[t.name] = t;
    }
    file_bytes += std::filesystem::file_size(ck.dir + "/" + f);
  }
  ASSERT_EQ(tensors.size(), index.at("weight_map").size());

  // What rank 5 must read of each tensor, in bytes (BF16), by Megatron's rules:
  // H 128, 8 q heads and 2 kv heads of 16, vocab 1000 padded to 1024 (128 rows a
  // rank), 8 experts (one an ep rank: expert 5, whole since tp / ep = 1).
  const std::uint64_t H = 128, hd = 16, es = 2;
  std::uint64_t expected = 0;
  std::uint64_t all = 0;
  for (const auto& [name, t] : tensors) {
    all += t.nbytes;
    std::uint64_t need = 0;
    auto ends = [&](const std::string& suffix) {
      return name.size() >= suffix.size() &&
             name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
      need = 128 * H * es;  // rows [640, 768), all real
    } else if (ends("q_proj.weight")) {
      need = hd * H * es;  // one q head: rows [80, 96)
    } else if (ends("k_proj.weight") || ends("v_proj.weight")) {
      need = hd * H * es;  // kv head 5 / (8 / 2) = 1, replicated on ranks 4..7
    } else if (ends("o_proj.weight")) {
      need = ((H - 1) * H + hd) * es;  // columns [80, 96) of every row: one span
    } else if (name.find(".experts.") != std::string::npos) {
      need = name.find(".experts.5.") != std::string::npos ? t.nbytes : 0;
    } else {
      need = t.nbytes;  // norms, router: replicated
    }
    expected += need;
  }
  const LoadReport& rep = r.model->report();
  const std::uint64_t headers = file_bytes - all;
  EXPECT_EQ(rep.bytes_read, headers + expected);
  EXPECT_EQ(rep.bytes_skipped, all - expected);
  // 7 of 8 experts' w1, w2, w3 in each of the 4 layers are dropped unread.
  EXPECT_EQ(rep.tensors.dropped, 7u * 3 * 4);
  EXPECT_LT(rep.bytes_read, ck.file_bytes() / 4);
}

// A per-expert checkpoint rewritten as one file with fused 3-D tensors
// <moe>experts.gate_up_proj [E, 2I, H] and <moe>experts.down_proj [E, H, I] made of
// the same values; `transposed` writes gate_up_proj as [E, H, 2I] instead.
void write_fused_copy(const Checkpoint& ck, const std::string& out, bool transposed) {
  const moe_ref::Config c = moe_ref::read_config(ck.config);
  std::filesystem::create_directories(out);
  std::filesystem::copy_file(ck.dir + "/config.json", out + "/config.json");
  struct Entry {
    std::string name;
    std::vector<std::uint64_t> shape;
    std::vector<float> values;
  };
  std::vector<Entry> entries;
  std::set<std::uint64_t> fused_layers;
  for (const synth::SynthTensor& t :
       synth::synth_tensor_list(ck.family, "tiny", DType::kBF16, false)) {
    const auto at = t.name.find(c.moe + "experts.");
    if (at == std::string::npos) {
      entries.push_back({t.name, t.shape, ck.values(t.name)});
      continue;
    }
    const std::uint64_t layer = std::stoull(t.name.substr(std::string("model.layers.").size()));
    if (!fused_layers.insert(layer).second) {
      continue;
    }
    const std::string moe = t.name.substr(0, at) + c.moe;
    Entry gu{moe + "experts.gate_up_proj",
             transposed ? std::vector<std::uint64_t>{c.E, c.H, 2 * c.I}
                        : std::vector<std::uint64_t>{c.E, 2 * c.I, c.H},
             {}};
    Entry down{moe + "experts.down_proj", {c.E, c.H, c.I}, {}};
    for (std::uint64_t e = 0; e < c.E; ++e) {
      const std::string x = moe + "experts." + std::to_string(e) + ".";
      for (const std::string& n : {c.gate_name, c.up_name}) {
        std::vector<float> v = ck.values(x + n + ".weight");
        gu.values.insert(gu.values.end(), v.begin(), v.end());
      }
      std::vector<float> d = ck.values(x + c.down_name + ".weight");
      down.values.insert(down.values.end(), d.begin(), d.end());
    }
    entries.push_back(std::move(gu));
    entries.push_back(std::move(down));
  }
  io::SafetensorsWriter w(out + "/model.safetensors");
  for (const Entry& e : entries) {
    w.add(e.name, DType::kBF16, e.shape);
  }
  w.begin();
  for (const Entry& e : entries) {
    w.write(testing::encode(e.values, DType::kBF16));
  }
  w.finish();
}

TEST_F(MoeLoadTest, FusedExpertTensorsLoadLikePerExpertOnes) {
  for (const Checkpoint* ck : {mixtral_, qwen2_}) {
    SCOPED_TRACE(ck->family);
    const std::string fused = dir_->file(ck->family + "-fused");
    write_fused_copy(*ck, fused, false);
    for (const std::vector<std::string>& sets :
         {std::vector<std::string>{tp(4), ep(2)},
          std::vector<std::string>{tp(4), ep(2), "parallel.ranks=3", "model.switch_w13=true",
                                   "model.pad_moe_intermediate_to=128"}}) {
      LoadResult a = load(make_config(ck->dir, sets));
      LoadResult b = load(make_config(fused, sets));
      ASSERT_TRUE(a && b);
      ASSERT_EQ(a.model->ranks().size(), b.model->ranks().size());
      std::size_t compared = 0;
      for (std::size_t i = 0; i < a.model->ranks().size(); ++i) {
        const LoadedRank& ra = a.model->ranks()[i];
        const LoadedRank& rb = b.model->ranks()[i];
        ASSERT_EQ(ra.params.size(), rb.params.size());
        for (std::size_t k = 0; k < ra.params.size(); ++k) {
          ASSERT_EQ(ra.params[k].name, rb.params[k].name);
          EXPECT_EQ(ra.params[k].shape, rb.params[k].shape) << ra.params[k].name;
          EXPECT_TRUE(a.model->read_param(i, ra.params[k].name) ==
                      b.model->read_param(i, rb.params[k].name))
              << "tp rank " << ra.tp_rank << " " << ra.params[k].name;
          ++compared;
        }
      }
      EXPECT_GT(compared, 0u);
    }
    // ep 2 of tp 2, rank 1: only experts 4..7's ranges of the fused tensors are read.
    LoadResult one = load(make_config(fused, {tp(2), ep(2), "parallel.ranks=1"}));
    ASSERT_TRUE(one);
    EXPECT_GT(one.model->report().bytes_skipped, 0u);
  }
}

TEST_F(MoeLoadTest, SynthesizedFusedExpertsMatchTheReference) {
  TempDir dir;
  synth::SynthOptions o;
  o.family = "qwen3_moe";
  o.preset = "tiny";
  o.out = dir.file("ck");
  o.seed = 11;
  o.fsync = false;
  o.fused_experts = true;
  synth::synthesize(o);
  const nlohmann::json config =
      nlohmann::json::parse(testing::read_file(dir.file("ck") + "/config.json"));
  moe_ref::Values values(11);
  for (auto [t, e] : {std::pair{2, 2}, std::pair{4, 4}}) {
    SCOPED_TRACE("tp " + std::to_string(t) + " ep " + std::to_string(e));
    LoadResult r = load(make_config(dir.file("ck"), {tp(t), ep(e)}));
    ASSERT_TRUE(r);
    moe_ref::Options ro = ref_options(t, e);
    ro.fused_checkpoint = true;
    EXPECT_GT(expect_matches(*r.model, config, values, ro, DType::kBF16), 0u);
    EXPECT_EQ(r.model->report().tensors.placed, tiny_shapes("qwen3_moe", true).size());
  }
}

TEST_F(MoeLoadTest, ATransposedFusedLayoutIsRefused) {
  const std::string dir = dir_->file("mixtral-transposed");
  write_fused_copy(*mixtral_, dir, true);
  ErrorInfo e = load_error(make_config(dir, {tp(2), ep(2)}));
  EXPECT_EQ(e.stage, Stage::kPlacement);
  EXPECT_EQ(e.tensor, "model.layers.0.block_sparse_moe.experts.gate_up_proj");
  EXPECT_THAT(e.message, AllOf(HasSubstr("[8, 128, 256]"), HasSubstr("[8, 256, 128]"),
                               HasSubstr("w13_weight")));
}

// ---- bad inputs -----------------------------------------------------------------------

// A copy of `ck` whose config.json `edit` changed (the tensors stay as they are).
std::string with_config(const Checkpoint& ck, const std::string& out,
                        const std::function<void(nlohmann::json&)>& edit) {
  std::filesystem::create_directories(out);
  for (const auto& e : std::filesystem::directory_iterator(ck.dir)) {
    std::filesystem::copy_file(e.path(), out + "/" + e.path().filename().string(),
                               std::filesystem::copy_options::overwrite_existing);
  }
  nlohmann::json c = ck.config;
  edit(c);
  testing::write_file(out + "/config.json", c.dump(2));
  return out;
}

TEST_F(MoeLoadTest, LayoutsThatDoNotSplitFailBeforeReading) {
  // tp % ep != 0: the configuration itself is refused.
  try {
    make_config(qwen3_->dir, {tp(4), ep(3)});
    ADD_FAILURE() << "ep 3 of tp 4 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kConfig);
    EXPECT_THAT(e.what(), HasSubstr("parallel.ep"));
  }
  {
    const std::string dir = with_config(*mixtral_, dir_->file("mixtral-6"),
                                        [](nlohmann::json& c) { c["num_local_experts"] = 6; });
    ErrorInfo e = load_error(make_config(dir, {tp(4), ep(4)}));
    EXPECT_EQ(e.stage, Stage::kPlacement);
    EXPECT_THAT(e.message, AllOf(HasSubstr("num_local_experts (6)"), HasSubstr("ep 4")));
  }
  {
    const std::string dir = with_config(*qwen3_, dir_->file("qwen3-100"), [](nlohmann::json& c) {
      c["moe_intermediate_size"] = 100;
    });
    // moe_tp 8 does not split 100: under pad the experts are padded (to 256, 32
    // rows a share), and the checkpoint's 64-row experts no longer fit the config.
    ErrorInfo e = load_error(make_config(dir, {tp(8), ep(1), "model.unaligned_tp=pad"}));
    EXPECT_EQ(e.stage, Stage::kPlacement);
    EXPECT_THAT(e.message, AllOf(HasSubstr("model.layers.0.mlp.experts.0.gate_proj.weight"),
                                 HasSubstr("must be [100, 128]")));
    // Without pad it is refused before any tensor is looked at.
    e = load_error(make_config(dir, {tp(8), ep(1)}));
    EXPECT_EQ(e.stage, Stage::kPlacement);
    EXPECT_THAT(e.message,
                AllOf(HasSubstr("moe_intermediate_size (100)"), HasSubstr("model.unaligned_tp")));
  }
  {
    testing::write_file(dir_->file("bad-eplb.json"),
                        R"({"num_physical_experts": 8, "layers": {}})");
    ErrorInfo e = load_error(make_config(
        qwen3_->dir, {tp(2), ep(2), set("model.eplb_map", dir_->file("bad-eplb.json"))}));
    EXPECT_EQ(e.stage, Stage::kConfig);
    EXPECT_THAT(e.message, AllOf(HasSubstr("bad-eplb.json"), HasSubstr("layers")));
  }
}

TEST_F(MoeLoadTest, AWrongExpertShapeNamesTheTensorAndTheParam) {
  const std::string dir = dir_->file("qwen3-badshape");
  std::filesystem::create_directories(dir);
  for (const auto& e : std::filesystem::directory_iterator(qwen3_->dir)) {
    std::filesystem::copy_file(e.path(), dir + "/" + e.path().filename().string());
  }
  const std::string name = "model.layers.2.mlp.experts.6.up_proj.weight";
  testing::rewrite_shard(dir, testing::shard_of(dir, name), [&](auto& entries) {
    for (testing::ShardEntry& t : entries) {
      if (t.name == name) {
        t.shape = {32, 256};  // the same bytes, the wrong shape
      }
    }
  });
  // Even the rank that does not own expert 6 refuses it: shapes are checked first.
  for (const char* ranks : {"parallel.ranks=1", "parallel.ranks=0"}) {
    ErrorInfo e = load_error(make_config(dir, {tp(2), ep(2), ranks}));
    EXPECT_EQ(e.stage, Stage::kPlacement);
    EXPECT_EQ(e.tensor, name);
    EXPECT_THAT(e.message,
                AllOf(HasSubstr("Attempted to load weight " + name + " [32, 256]"),
                      HasSubstr("model.layers.2.mlp.experts.w13_weight"), HasSubstr("[64, 128]")));
  }
}

}  // namespace
}  // namespace ferry::runtime
