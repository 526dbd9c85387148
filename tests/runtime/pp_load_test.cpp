// Pipeline stages loaded end to end through ferry::Runtime on host devices: each
// stage of a synthetic Llama (tied and untied embeddings) under pp 2 and 3, even
// splits and explicit partitions, tp 1 and 2, loaded on its own. For every stage:
// the shells hold exactly the expected names, every element of every param equals
// the independent reference (tests/runtime/runtime_test_util.hpp, Megatron splits
// written out), and the bytes read are exactly the headers plus the tensors the
// stage keeps — nothing of another stage's layers is read.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::make_config;
using testing::RefTensor;
using testing::synth_checkpoint;
using testing::TempDir;

constexpr std::uint64_t kLayers = 4;  // synth/synth.hpp tiny llama

struct StageRange {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

// The layers of stage `s`, by the definitions: even split [s*L/pp, (s+1)*L/pp);
// a partition gives each stage its count after the earlier stages' counts.
StageRange stage_range(int pp, int s, const std::vector<int>& partition) {
  if (partition.empty()) {
    const std::uint64_t P = static_cast<std::uint64_t>(pp);
    const std::uint64_t S = static_cast<std::uint64_t>(s);
    return {S * kLayers / P, (S + 1) * kLayers / P};
  }
  std::uint64_t begin = 0;
  for (int i = 0; i < s; ++i) {
    begin += static_cast<std::uint64_t>(partition[static_cast<std::size_t>(i)]);
  }
  return {begin, begin + static_cast<std::uint64_t>(partition[static_cast<std::size_t>(s)])};
}

// -1 for names that are not decoder-layer tensors.
long layer_of(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) {
    return -1;
  }
  return std::stol(name.substr(prefix.size()));
}

bool in_stage(long layer, StageRange r) {
  return layer >= 0 && static_cast<std::uint64_t>(layer) >= r.begin &&
         static_cast<std::uint64_t>(layer) < r.end;
}

// What tp rank `rank` of stage `s` must hold: the full-model reference narrowed to
// the stage — its layers, embed_tokens on the first stage, the final norm and
// lm_head on the last; with tied embeddings a last stage that is not the first
// holds lm_head.weight with the embedding's rows (the same vocabulary split).
std::map<std::string, RefTensor> stage_reference(const Checkpoint& ck, int tp, int rank, int pp,
                                                 int s, StageRange layers) {
  std::map<std::string, RefTensor> full = testing::reference_rank(ck, tp, rank);
  const bool first = s == 0;
  const bool last = s == pp - 1;
  std::map<std::string, RefTensor> out;
  for (auto& [name, t] : full) {
    const long layer = layer_of(name);
    if (layer >= 0) {
      if (in_stage(layer, layers)) {
        out[name] = t;
      }
    } else if (name == "model.embed_tokens.weight") {
      if (first) {
        out[name] = t;
      }
      if (last && !first && ck.tied) {
        out["lm_head.weight"] = t;
      }
    } else if (name == "model.norm.weight" || name == "lm_head.weight") {
      // Llama's lm_head (untied) is on every stage: SGLang 0.5.23's
      // LlamaForCausalLM builds and loads its ParallelLMHead whatever the stage.
      if (last || (name == "lm_head.weight" && !ck.tied)) {
        out[name] = t;
      }
    } else {
      ADD_FAILURE() << "reference param without a stage rule: " << name;
    }
  }
  return out;
}

// Whether the stage reads checkpoint tensor `name`.
bool stage_keeps(const Checkpoint& ck, const std::string& name, int pp, int s, StageRange layers) {
  const bool first = s == 0;
  const bool last = s == pp - 1;
  const long layer = layer_of(name);
  if (layer >= 0) {
    return in_stage(layer, layers);
  }
  if (name == "model.embed_tokens.weight") {
    return first || (last && ck.tied);
  }
  if (name == "model.norm.weight") {
    return last;
  }
  if (name == "lm_head.weight") {
    return !ck.tied;  // every stage (LlamaForCausalLM's ParallelLMHead)
  }
  ADD_FAILURE() << "checkpoint tensor without a stage rule: " << name;
  return false;
}

std::uint64_t bf16_bytes(const std::vector<std::uint64_t>& shape) {
  std::uint64_t n = 2;
  for (std::uint64_t d : shape) {
    n *= d;
  }
  return n;
}

// Loads stage `s` and checks names, every element, and the bytes read.
void check_stage(const Checkpoint& ck, int tp, int pp, int s, const std::vector<int>& partition) {
  std::vector<std::string> sets{"parallel.tp=" + std::to_string(tp),
                                "parallel.pp=" + std::to_string(pp),
                                "parallel.pp_rank=" + std::to_string(s)};
  std::string label = "tp " + std::to_string(tp) + " pp " + std::to_string(pp) + " stage " +
                      std::to_string(s) + (ck.tied ? " tied" : " untied");
  if (!partition.empty()) {
    std::string p;
    for (int n : partition) {
      p += (p.empty() ? "" : ",") + std::to_string(n);
    }
    sets.push_back("parallel.pp_partition=[" + p + "]");
    label += " partition [" + p + "]";
  }
  SCOPED_TRACE(label);
  const StageRange layers = stage_range(pp, s, partition);

  Runtime rt(to_config(make_config(ck.dir, sets)));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  const LoadedModel& model = *r.model;
  ASSERT_EQ(model.ranks().size(), static_cast<std::size_t>(tp));

  for (std::size_t i = 0; i < model.ranks().size(); ++i) {
    const LoadedRank& rank = model.ranks()[i];
    EXPECT_EQ(rank.tp_rank, static_cast<int>(i));
    EXPECT_EQ(rank.pp_rank, s);
    testing::expect_rank_matches(
        model, i, stage_reference(ck, tp, rank.tp_rank, pp, s, layers), DType::kBF16);
  }

  // Bytes: with every tp rank local, each kept tensor is read whole and nothing
  // else of tensor data is read; headers are always read.
  std::uint64_t tensor_bytes = 0;
  std::uint64_t kept_bytes = 0;
  std::size_t kept = 0;
  for (const auto& [name, shape] : ck.shapes) {
    tensor_bytes += bf16_bytes(shape);
    if (stage_keeps(ck, name, pp, s, layers)) {
      kept_bytes += bf16_bytes(shape);
      ++kept;
    }
  }
  const std::uint64_t headers = ck.file_bytes() - tensor_bytes;
  const LoadReport& rep = model.report();
  EXPECT_EQ(rep.bytes_read, headers + kept_bytes);
  EXPECT_EQ(rep.bytes_skipped, tensor_bytes - kept_bytes);
  EXPECT_EQ(rep.tensors.placed, kept);
  EXPECT_EQ(rep.tensors.dropped, ck.shapes.size() - kept);
  EXPECT_EQ(rep.tensors.unmapped, 0u);
}

class PpLoadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    untied_ = new Checkpoint(synth_checkpoint(dir_->file("llama"), "llama", false, 5));
    tied_ = new Checkpoint(synth_checkpoint(dir_->file("llama-tied"), "llama", true, 9));
  }
  static void TearDownTestSuite() {
    delete untied_;
    delete tied_;
    delete dir_;
  }
  static TempDir* dir_;
  static Checkpoint* untied_;
  static Checkpoint* tied_;
};
TempDir* PpLoadTest::dir_ = nullptr;
Checkpoint* PpLoadTest::untied_ = nullptr;
Checkpoint* PpLoadTest::tied_ = nullptr;

TEST_F(PpLoadTest, EvenSplitsEveryStageUntiedAndTied) {
  for (const Checkpoint* ck : {untied_, tied_}) {
    for (int tp : {1, 2}) {
      for (int pp : {2, 3}) {
        for (int s = 0; s < pp; ++s) {
          check_stage(*ck, tp, pp, s, {});
        }
      }
    }
  }
}

TEST_F(PpLoadTest, ExplicitPartitionsEveryStageUntiedAndTied) {
  const std::vector<std::vector<int>> partitions{{1, 3}, {3, 1}, {1, 2, 1}};
  for (const Checkpoint* ck : {untied_, tied_}) {
    for (int tp : {1, 2}) {
      for (const std::vector<int>& partition : partitions) {
        const int pp = static_cast<int>(partition.size());
        for (int s = 0; s < pp; ++s) {
          check_stage(*ck, tp, pp, s, partition);
        }
      }
    }
  }
}

TEST_F(PpLoadTest, StageWithoutLayersHoldsOnlyItsEdges) {
  // Partition {2, 0, 2}: the middle stage holds no layer and no edge; the last
  // stage of a tied model still reads the embedding for its lm_head.
  for (const Checkpoint* ck : {untied_, tied_}) {
    for (int s = 0; s < 3; ++s) {
      check_stage(*ck, 2, 3, s, {2, 0, 2});
    }
  }
}

TEST_F(PpLoadTest, BadPartitionFailsBeforeReadingNamingTheField) {
  Runtime rt(
      to_config(make_config(untied_->dir, {"parallel.pp=2", "parallel.pp_partition=[1,2]"})));
  LoadResult r = rt.load();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kConfig);
  EXPECT_NE(r.error->message.find("pp_partition sums to 3"), std::string::npos) << r.error->message;
  EXPECT_NE(r.error->message.find("num_hidden_layers 4"), std::string::npos) << r.error->message;
}

}  // namespace
}  // namespace ferry::runtime
