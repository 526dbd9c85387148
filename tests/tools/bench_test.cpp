// `ferry bench`: experiment files (their checks and bad inputs), the matrix
// expansion with skipped combinations, every shipped experiment building every
// combination (a renamed key breaks this test, not the user), and a whole run
// through the binary with its table, JSON, CSV and chart.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/runtime_test_util.hpp"
#include "testing/error_of.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"
#include "tools/bench_experiment.hpp"

namespace ferry::tools {
namespace {

using testing::error_of;
using ::testing::HasSubstr;

Experiment parse(const std::string& text) {
  return parse_experiment(nlohmann::ordered_json::parse(text), "exp.json");
}

TEST(BenchExperiment, BadExperimentsNameTheField) {
  struct Case {
    std::string text;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"([1])", "expected a JSON object"},
      {R"({"matrx": {}})", "unknown field 'matrx'"},
      {R"({"checkpoint": {"family": "llama"}})", "checkpoint: expected"},
      {R"({"checkpoint": {"path": 3}})", "checkpoint: {\"path\": DIR} takes one string"},
      {R"({"matrix": {"io.queue_depth": 4}})", "matrix.io.queue_depth: expected a non-empty array"},
      {R"({"matrix": {"io.queue_depth": []}})", "matrix.io.queue_depth: expected a non-empty"},
      {R"({"cold": "yes"})", "cold: expected true or false"},
      {R"({"peers": ["vllm"]})", "peers: unknown peer \"vllm\""},
      {R"({"base": [1]})", "base: expected an object"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(error_of(Stage::kConfig, [&] { parse(c.text); }), HasSubstr(c.message)) << c.text;
  }
  testing::TempDir dir;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { read_experiment(dir.file("none.json")); }),
              HasSubstr("cannot open"));
  std::ofstream(dir.file("bad.json")) << "{not json";
  EXPECT_THAT(error_of(Stage::kConfig, [&] { read_experiment(dir.file("bad.json")); }),
              HasSubstr("not JSON"));
}

TEST(BenchExperiment, TheMatrixExpandsInFileOrderAndSkipsWhatCannotRun) {
  const Experiment e = parse(R"({
      "checkpoint": {"family": "llama", "preset": "tiny"},
      "base": {"io": {"chunk_bytes": "64KiB"}},
      "matrix": {"prefetch.enabled": [false, true], "io.direct": [false, true],
                 "io.queue_depth": [4, 0]},
      "peers": ["cat", "pread"]})");
  EXPECT_EQ(e.family, "llama");
  EXPECT_EQ(e.peers, (std::vector<std::string>{"cat", "pread"}));
  const std::vector<Combination> all = expand(e, "/some/model");
  ASSERT_EQ(all.size(), 8u);
  EXPECT_EQ(all[0].label, "prefetch.enabled=false io.direct=false io.queue_depth=4");
  EXPECT_EQ(all[1].label, "prefetch.enabled=false io.direct=false io.queue_depth=0");
  EXPECT_EQ(all[7].label, "prefetch.enabled=true io.direct=true io.queue_depth=0");
  ASSERT_TRUE(all[0].config);
  EXPECT_EQ(all[0].config->io.chunk_bytes, 64u << 10);  // the base applies
  EXPECT_EQ(all[0].config->model.path, "/some/model");
  EXPECT_FALSE(all[1].config);  // queue depth 0 is refused by the configuration
  EXPECT_THAT(all[1].skipped, HasSubstr("io.queue_depth"));
  EXPECT_FALSE(all[6].config);  // prefetch with io.direct
  EXPECT_THAT(all[6].skipped, HasSubstr("prefetch.enabled with io.direct: refused"));
  std::size_t runnable = 0;
  for (const Combination& c : all) {
    runnable += c.config ? 1 : 0;
  }
  EXPECT_EQ(runnable, 3u);
  EXPECT_EQ(expand(parse("{}"), "/m").at(0).label, "base");
}

TEST(BenchExperiment, EveryShippedExperimentBuildsEveryCombination) {
  std::size_t files = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(FERRY_SOURCE_DIR) + "/config/experiments")) {
    SCOPED_TRACE(entry.path().string());
    ++files;
    const Experiment e = read_experiment(entry.path().string());
    std::size_t runnable = 0;
    for (const Combination& c : expand(e, "/some/model")) {
      if (c.config) {
        ++runnable;
      } else {
        // Only combinations the configuration refuses on purpose (ep not dividing
        // tp), never a key it does not know.
        EXPECT_THAT(c.skipped, ::testing::Not(HasSubstr("unknown key"))) << c.label;
      }
    }
    EXPECT_GT(runnable, 0u);
  }
  EXPECT_GE(files, 3u);  // overlap, memory, parallel
}

TEST(BenchCli, ARunWritesTheTableJsonCsvAndChart) {
  testing::TempDir dir;
  const std::string exp = dir.file("exp.json");
  std::ofstream(exp) << R"({"checkpoint": {"family": "llama", "preset": "tiny"},
      "base": {"host": {"bandwidth_gbps": 5}},
      "matrix": {"io.queue_depth": [2, 4], "prefetch.enabled": [false, true],
                 "io.direct": [false, true]},
      "overlap": true, "peers": ["cat", "pread", "sglang"]})";
  const std::string out = dir.file("out");
  testing::RunResult r = testing::run({"env", "FERRY_BENCH_PYTHON=", FERRY_BINARY, "bench",
                                       "--experiment", exp, "--repeat", "2", "--out", out});
  ASSERT_EQ(r.status, 0) << r.err << r.out;
  EXPECT_THAT(r.out, HasSubstr("skipped: io.queue_depth=2 prefetch.enabled=true io.direct=true: "
                               "config: --set prefetch.enabled: prefetch.enabled with io.direct: "
                               "refused"));
  EXPECT_THAT(r.out, HasSubstr("skipped: peer sglang: no Python"));
  EXPECT_THAT(r.out, HasSubstr("peer: cat"));
  const nlohmann::json j = nlohmann::json::parse(testing::read_file(out + "/results.json"));
  // 6 runnable combinations, each with its read-alone twin, and two peers.
  ASSERT_EQ(j["runs"].size(), 6u * 2 + 2);
  for (const nlohmann::json& run : j["runs"]) {
    EXPECT_EQ(run["seconds"].size(), 2u) << run["name"];
    if (run["kind"] == "ferry") {
      EXPECT_GT(run["overlap_efficiency"].get<double>(), 0) << run["name"];
    }
    if (run["kind"] == "peer") {
      EXPECT_GT(run["ratio_to_best_ferry"].get<double>(), 0) << run["name"];
    }
  }
  EXPECT_EQ(j["skipped"].size(), 3u);
  const std::string csv = testing::read_file(out + "/results.csv");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 6 * 2 + 2);
  const std::string svg = testing::read_file(out + "/chart.svg");
  EXPECT_THAT(svg, HasSubstr("<svg"));
  EXPECT_THAT(svg, HasSubstr("timeline of the median run of the fastest configuration"));
  EXPECT_THAT(svg, HasSubstr("peer: pread"));
  EXPECT_TRUE(std::filesystem::exists(j["timeline_trace"].get<std::string>()));

  // Bad invocations.
  r = testing::run({FERRY_BINARY, "bench"});
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.err, HasSubstr("--experiment"));
  r = testing::run({FERRY_BINARY, "bench", "--experiment", dir.file("none.json")});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot open"));
}

}  // namespace
}  // namespace ferry::tools
