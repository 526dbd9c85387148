// `ferry plan` end to end through the binary: the stable JSON interface
// (docs/plan-json.md) with every route and reason a dense pipeline stage produces,
// byte totals checked against the checkpoint's own tensor sizes, the human form,
// exit codes and errors; and `ferry load` taking the same parallel flags.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "runtime/runtime_test_util.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The synthetic tiny llama (4 layers) plus two rotary caches (layer 0 and layer 3)
// and a tensor no model knows, all F32/BF16 in the first layer's shard.
struct PlanCheckpoint {
  Checkpoint ck;
  std::map<std::string, std::uint64_t> nbytes;  // every tensor in the files
};

PlanCheckpoint make_checkpoint(const std::string& dir, bool tie_in_config) {
  PlanCheckpoint out;
  out.ck = synth_checkpoint(dir, "llama", /*tied=*/false, 3);
  const std::string shard = shard_of(dir, "model.layers.0.self_attn.q_proj.weight");
  rewrite_shard(dir, shard, [](std::vector<ShardEntry>& entries) {
    for (const char* name : {"model.layers.0.self_attn.rotary_emb.inv_freq",
                             "model.layers.3.self_attn.rotary_emb.inv_freq"}) {
      entries.push_back({name, DType::kF32, {8}, std::string(32, '\0')});
    }
    entries.push_back({"model.extra_head.weight", DType::kBF16, {2, 2}, std::string(8, '\0')});
  });
  for (const auto& [name, shape] : out.ck.shapes) {
    std::uint64_t n = 2;
    for (std::uint64_t d : shape) {
      n *= d;
    }
    out.nbytes[name] = n;
  }
  out.nbytes["model.layers.0.self_attn.rotary_emb.inv_freq"] = 32;
  out.nbytes["model.layers.3.self_attn.rotary_emb.inv_freq"] = 32;
  out.nbytes["model.extra_head.weight"] = 8;
  if (tie_in_config) {
    // A tied model whose checkpoint still carries lm_head.weight (some do).
    nlohmann::json config = out.ck.config;
    config["tie_word_embeddings"] = true;
    write_file(dir + "/config.json", config.dump(2));
  }
  return out;
}

// SGLang's param for a checkpoint tensor of a Llama layer or edge.
std::string param_of(const std::string& name) {
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string s = name;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  for (const char* p : {"q_proj", "k_proj", "v_proj"}) {
    if (name.find(std::string("self_attn.") + p + ".weight") != std::string::npos) {
      return replace(p, "qkv_proj");
    }
  }
  for (const char* p : {"gate_proj", "up_proj"}) {
    if (name.find(std::string("mlp.") + p + ".weight") != std::string::npos) {
      return replace(p, "gate_up_proj");
    }
  }
  return name;
}

long layer_of(const std::string& name) {
  const std::string prefix = "model.layers.";
  return name.rfind(prefix, 0) == 0 ? std::stol(name.substr(prefix.size())) : -1;
}

struct Expected {
  std::string route;
  std::string reason;
  std::string param;  // placed: the param on every local rank
};

// Stage `s` of pp 2 (layers [2s, 2s+2)) of the tiny llama, written out.
Expected expected_route(const std::string& name, int s, bool tied) {
  const bool first = s == 0;
  const bool last = s == 1;
  const long layer = layer_of(name);
  if (name == "model.extra_head.weight") {
    return {"unmapped", "unknown_name", ""};
  }
  if (layer >= 0 && layer / 2 != s) {
    return {"dropped", "pp_stage", ""};
  }
  if (name.find("rotary_emb.inv_freq") != std::string::npos) {
    return {"dropped", "inv_freq", ""};
  }
  if (layer >= 0) {
    return {"placed", "", param_of(name)};
  }
  if (name == "model.embed_tokens.weight") {
    if (first) {
      return {"placed", "", name};
    }
    return tied ? Expected{"placed", "", "lm_head.weight"}
                : Expected{"dropped", "first_stage_only", ""};
  }
  if (!last && name == "lm_head.weight" && !tied) {
    // Llama's untied lm_head is on every stage (SGLang 0.5.23's LlamaForCausalLM
    // builds and loads its ParallelLMHead whatever the stage).
    return {"placed", "", name};
  }
  if (!last) {
    return {"dropped", "last_stage_only", ""};
  }
  if (name == "lm_head.weight" && tied) {
    return {"dropped", "tied_lm_head", ""};
  }
  return {"placed", "", name};
}

RunResult plan(const std::vector<std::string>& args) {
  std::vector<std::string> argv{FERRY_BINARY, "plan"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv);
}

class PlanCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    untied_ = new PlanCheckpoint(make_checkpoint(dir_->file("llama"), false));
    tied_ = new PlanCheckpoint(make_checkpoint(dir_->file("llama-tied"), true));
  }
  static void TearDownTestSuite() {
    delete untied_;
    delete tied_;
    delete dir_;
  }
  static TempDir* dir_;
  static PlanCheckpoint* untied_;
  static PlanCheckpoint* tied_;
};
TempDir* PlanCliTest::dir_ = nullptr;
PlanCheckpoint* PlanCliTest::untied_ = nullptr;
PlanCheckpoint* PlanCliTest::tied_ = nullptr;

// Checks routes, reasons, targets and totals of one stage's JSON.
void check_stage_json(const PlanCheckpoint& pc, bool tied, int tp, int s) {
  SCOPED_TRACE(std::string(tied ? "tied" : "untied") + " tp " + std::to_string(tp) + " stage " +
               std::to_string(s));
  RunResult r = plan({"--model", pc.ck.dir, "--tp", std::to_string(tp), "--pp", "2", "--pp-rank",
                      std::to_string(s), "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  nlohmann::json doc = nlohmann::json::parse(r.out);  // throws unless exactly one document
  ASSERT_TRUE(doc.is_object());
  EXPECT_EQ(doc.size(), 5u) << "load_format, postprocess_target, tensors, ranks and totals";
  ASSERT_TRUE(doc.contains("tensors") && doc.contains("totals") && doc.contains("ranks"));
  EXPECT_EQ(doc.at("load_format"), "checkpoint");
  EXPECT_EQ(doc.at("postprocess_target"), "loader");
  ASSERT_EQ(doc.at("ranks").size(), static_cast<std::size_t>(tp));
  for (const nlohmann::json& rank : doc.at("ranks")) {
    EXPECT_GT(rank.at("params").get<std::size_t>(), 0u);
    EXPECT_GT(rank.at("param_bytes").get<std::uint64_t>(), 0u);
  }
  // The unknown tensor is a warning, on stderr only.
  EXPECT_THAT(r.err, HasSubstr("1 checkpoint tensor(s) map to no parameter"));

  std::set<std::string> seen;
  std::uint64_t read = 0;
  std::map<std::string, std::uint64_t> skipped;
  for (const nlohmann::json& t : doc["tensors"]) {
    const std::string name = t.at("name");
    SCOPED_TRACE(name);
    ASSERT_TRUE(pc.nbytes.count(name)) << "not a checkpoint tensor";
    EXPECT_TRUE(seen.insert(name).second) << "listed twice";
    Expected want = expected_route(name, s, tied);
    EXPECT_EQ(t.at("route"), want.route);
    EXPECT_EQ(t.at("reason"), want.reason);
    nlohmann::json targets = nlohmann::json::array();
    if (want.route == "placed") {
      for (int rank = 0; rank < tp; ++rank) {
        targets.push_back({{"rank", rank}, {"param", want.param}});
      }
      read += pc.nbytes.at(name);
    } else {
      skipped[want.reason] += pc.nbytes.at(name);
    }
    EXPECT_EQ(t.at("targets"), targets);
  }
  EXPECT_EQ(seen.size(), pc.nbytes.size());

  const nlohmann::json& totals = doc["totals"];
  std::uint64_t checkpoint = 0;
  for (const auto& [name, n] : pc.nbytes) {
    checkpoint += n;
  }
  EXPECT_EQ(totals.at("checkpoint_bytes").get<std::uint64_t>(), checkpoint);
  // All tp ranks are local, so every placed tensor is read whole.
  EXPECT_EQ(totals.at("read_bytes").get<std::uint64_t>(), read);
  using ByReason = std::map<std::string, std::uint64_t>;
  EXPECT_EQ(totals.at("skipped_bytes").get<ByReason>(), skipped);
  std::uint64_t skipped_sum = 0;
  for (const auto& [reason, n] : skipped) {
    skipped_sum += n;
  }
  EXPECT_EQ(checkpoint, read + skipped_sum);
}

TEST_F(PlanCliTest, JsonRoutesReasonsTargetsAndTotalsOfEachStage) {
  for (int tp : {1, 2}) {
    for (int s : {0, 1}) {
      check_stage_json(*untied_, false, tp, s);
      check_stage_json(*tied_, true, tp, s);
    }
  }
}

TEST_F(PlanCliTest, SingleStageTiedDropsTheCheckpointsLmHead) {
  RunResult r = plan({"--model", tied_->ck.dir, "--tp", "1", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  nlohmann::json doc = nlohmann::json::parse(r.out);
  std::map<std::string, nlohmann::json> by_name;
  for (const nlohmann::json& t : doc["tensors"]) {
    by_name[t["name"]] = t;
  }
  EXPECT_EQ(by_name.at("lm_head.weight")["reason"], "tied_lm_head");
  EXPECT_EQ(by_name.at("model.embed_tokens.weight")["targets"],
            nlohmann::json::parse(R"([{"rank":0,"param":"model.embed_tokens.weight"}])"));
  EXPECT_EQ(by_name.at("model.layers.3.mlp.down_proj.weight")["route"], "placed");
  EXPECT_EQ(doc["totals"]["skipped_bytes"],
            nlohmann::json({{"inv_freq", 64},
                            {"tied_lm_head", untied_->nbytes.at("lm_head.weight")},
                            {"unknown_name", 8}}));
}

TEST_F(PlanCliTest, SubsetOfRanksCountsTheirUnreadSlices) {
  // tp 4, only rank 2 local: targets name tp rank 2, and the bytes only other
  // ranks need are "remote_slices", so the totals still add up.
  RunResult r = plan({"--model", untied_->ck.dir, "--tp", "4", "--ranks", "2", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  nlohmann::json doc = nlohmann::json::parse(r.out);
  for (const nlohmann::json& t : doc["tensors"]) {
    if (t["route"] == "placed") {
      ASSERT_EQ(t["targets"].size(), 1u) << t;
      EXPECT_EQ(t["targets"][0]["rank"], 2) << t;
    }
  }
  const nlohmann::json& totals = doc["totals"];
  const auto skipped = totals["skipped_bytes"].get<std::map<std::string, std::uint64_t>>();
  ASSERT_TRUE(skipped.count("remote_slices"));
  EXPECT_GT(skipped.at("remote_slices"), 0u);
  std::uint64_t sum = totals["read_bytes"].get<std::uint64_t>();
  for (const auto& [reason, n] : skipped) {
    sum += n;
  }
  EXPECT_EQ(sum, totals["checkpoint_bytes"].get<std::uint64_t>());
  EXPECT_LT(totals["read_bytes"].get<std::uint64_t>(),
            totals["checkpoint_bytes"].get<std::uint64_t>());
}

TEST_F(PlanCliTest, HumanFormIsATableWithTotals) {
  RunResult r = plan({"--model", untied_->ck.dir, "--tp", "2", "--pp", "2", "--pp-rank", "1"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("llama: tp 2 (local ranks 0,1), ep 1, pp stage 1 of 2"));
  EXPECT_THAT(r.out, HasSubstr("pp_stage"));
  EXPECT_THAT(r.out, HasSubstr("first_stage_only"));
  EXPECT_THAT(r.out, HasSubstr("model.layers.2.self_attn.qkv_proj.weight @ tp 0,1"));
  EXPECT_THAT(r.out, HasSubstr("placed, "));
  EXPECT_THAT(r.out, HasSubstr("checkpoint "));
  EXPECT_THAT(r.out, HasSubstr("warning: 1 checkpoint tensor(s) map to no parameter"));
}

TEST_F(PlanCliTest, ErrorsExitOneNamingWhatFailed) {
  TempDir dir;
  const std::string missing = dir.file("no-such-model");
  RunResult r = plan({"--model", missing, "--tp", "1", "--json"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr(missing));
  EXPECT_TRUE(r.out.empty()) << r.out;

  RunResult bad = plan({"--model", untied_->ck.dir, "--tp", "1", "--pp", "2", "--set",
                        "parallel.pp_partition=[1,2]", "--json"});
  EXPECT_EQ(bad.status, 1);
  EXPECT_THAT(bad.err, HasSubstr("pp_partition sums to 3"));
  EXPECT_TRUE(bad.out.empty()) << bad.out;

  // A dense model has no draft (MTP) layer: --draft reaches the model and fails.
  RunResult draft = plan({"--model", untied_->ck.dir, "--tp", "1", "--draft"});
  EXPECT_EQ(draft.status, 1);
  EXPECT_THAT(draft.err, HasSubstr("draft"));
}

TEST_F(PlanCliTest, UsageErrorsExitTwo) {
  EXPECT_EQ(plan({"--model", untied_->ck.dir, "--bogus"}).status, 2);
  EXPECT_THAT(plan({"--model", untied_->ck.dir, "--bogus"}).err,
              HasSubstr("The following argument was not expected: --bogus"));
  EXPECT_EQ(plan({"--model", untied_->ck.dir, "--tp"}).status, 2);
  EXPECT_EQ(plan({"--tp", "1"}).status, 2);  // no --model
  EXPECT_EQ(plan({"--model", untied_->ck.dir, "--set", "parallel.nope=1"}).status, 2);
  // --json is plan's own switch; load does not take it.
  EXPECT_EQ(run({FERRY_BINARY, "load", "--model", untied_->ck.dir, "--json"}).status, 2);
  RunResult help = plan({"--help"});
  EXPECT_EQ(help.status, 0);
  EXPECT_THAT(help.out, HasSubstr("Usage: ferry plan [OPTIONS]"));
}

TEST_F(PlanCliTest, LoadTakesTheSameParallelFlags) {
  // Stage 1 of 2 at tp 1: layers 2 and 3 (6 params each), the final norm and
  // lm_head; no embed_tokens.
  RunResult r = run({FERRY_BINARY, "load", "--model", untied_->ck.dir, "--tp", "1", "--pp", "2",
                     "--pp-rank", "1"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("tp rank 0 on host:0: 14 parameters"));
  RunResult bad_rank = run({FERRY_BINARY, "load", "--model", untied_->ck.dir, "--tp", "1", "--pp",
                            "2", "--pp-rank", "2"});
  EXPECT_EQ(bad_rank.status, 2);  // a configuration error: pp_rank outside [0, pp)
  EXPECT_THAT(bad_rank.err, HasSubstr("parallel.pp_rank"));
  RunResult draft = run({FERRY_BINARY, "load", "--model", untied_->ck.dir, "--tp", "1", "--draft"});
  EXPECT_EQ(draft.status, 1);
  EXPECT_THAT(draft.err, HasSubstr("draft"));
  EXPECT_THAT(draft.out, Not(HasSubstr("parameters")));
}

}  // namespace
}  // namespace ferry::testing
