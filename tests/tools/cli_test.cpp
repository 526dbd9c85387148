// The command line on CLI11, through the built binary: every verb's --help comes from
// the definitions that parse it; unknown flags, missing values and bad numbers exit 2
// naming the flag; flags keep their meaning and the configuration precedence
// (defaults < file < environment < --set < flags); FERRY_ variables that name no key
// are ignored with one warning, and those that must name a key still fail.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "synth/synth.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::tools {
namespace {

using ferry::testing::run;
using ferry::testing::RunResult;
using ferry::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;

RunResult ferry(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  std::vector<std::string> argv{"env"};
  argv.insert(argv.end(), env.begin(), env.end());
  argv.push_back(FERRY_BINARY);
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv);
}

std::size_t occurrences(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

// One tiny llama checkpoint for the whole suite.
class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    synth::SynthOptions o;
    o.family = "llama";
    o.preset = "tiny";
    o.out = dir_->file("llama");
    o.fsync = false;
    synth::synthesize(o);
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string model() { return dir_->file("llama"); }
  static TempDir* dir_;
};
TempDir* CliTest::dir_ = nullptr;

TEST_F(CliTest, EveryVerbsHelpListsWhatItParses) {
  const std::vector<std::string> config_flags = {
      "--config", "--set", "--model", "--tp", "--ep", "--pp", "--pp-rank", "--ranks", "--draft"};
  struct Want {
    std::string verb;
    std::vector<std::string> has;
    std::vector<std::string> lacks;
  };
  std::vector<Want> wants = {
      {"load", config_flags, {"--json"}},
      {"plan", config_flags, {"--dump-dir", "--devices", "--report"}},
      {"synth",
       {"--family", "--preset", "--out", "--seed", "--dtype", "--shard-bytes", "--tie-embeddings",
        "--fused-experts", "--format", "--force", "--no-fsync", "deepseek_v3", "glm4_moe"},
       {"--model"}},
      {"inspect", {"PATH", "--load-format", "--json", "--strict"}, {"--model"}},
      {"demo", {"--config", "--cache"}, {"--model"}},
      {"selftest", {"--devices"}, {"--model"}},
  };
  wants[0].has.insert(wants[0].has.end(), {"--devices", "--dump-dir", "--report"});
  wants[1].has.push_back("--json");
  for (const Want& w : wants) {
    SCOPED_TRACE(w.verb);
    for (const char* help : {"--help", "-h"}) {
      RunResult r = ferry({w.verb, help});
      EXPECT_EQ(r.status, 0) << r.err;
      EXPECT_THAT(r.out, HasSubstr("Usage: ferry " + w.verb + " [OPTIONS]"));
      for (const std::string& flag : w.has) {
        EXPECT_THAT(r.out, HasSubstr(flag));
      }
      for (const std::string& flag : w.lacks) {
        EXPECT_THAT(r.out, Not(HasSubstr(flag + " ")));
      }
      EXPECT_TRUE(r.err.empty()) << r.err;
    }
  }
  // Config flags say which key they set.
  EXPECT_THAT(ferry({"load", "--help"}).out, HasSubstr("[parallel.pp_rank]"));
}

TEST_F(CliTest, TheTopLevelListsTheVerbs) {
  RunResult help = ferry({"--help"});
  EXPECT_EQ(help.status, 0);
  for (const char* verb : {"demo", "synth", "inspect", "load", "plan", "selftest"}) {
    EXPECT_THAT(help.out, HasSubstr(std::string("\n  ") + verb + " "));
  }
  EXPECT_EQ(ferry({"help"}).status, 0);
  RunResult none = ferry({});
  EXPECT_EQ(none.status, 2);
  EXPECT_THAT(none.err, HasSubstr("A subcommand is required"));
  RunResult unknown = ferry({"frobnicate", "--tp", "2"});
  EXPECT_EQ(unknown.status, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown command 'frobnicate'"));
  EXPECT_THAT(unknown.err, HasSubstr("selftest"));
  EXPECT_EQ(ferry({"--bogus"}).status, 2);
}

TEST_F(CliTest, UsageErrorsExitTwoNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::string m = model();
  const std::vector<Case> cases = {
      {{"load", "--model", m, "--colour", "red"}, "not expected: red --colour"},
      {{"plan", "--model", m, "--bogus"}, "not expected: --bogus"},
      {{"load", "--model", m, "stray"}, "not expected: stray"},
      {{"load", "--model", m, "--tp"}, "--tp: 1 required N missing"},
      {{"plan", "--model"}, "--model: 1 required DIR missing"},
      {{"plan", "--model", m, "--set"}, "--set: 1 required KEY=VALUE missing"},
      {{"load", "--model", m, "--tp", "abc"}, "--tp: expected a whole number, not 'abc'"},
      {{"load", "--model", m, "--tp", "-1"}, "--tp: expected a whole number, not '-1'"},
      {{"plan", "--model", m, "--ep=2.5"}, "--ep: expected a whole number, not '2.5'"},
      {{"plan", "--model", m, "--pp", "1e3"}, "--pp: expected a whole number, not '1e3'"},
      {{"plan", "--model", m, "--pp-rank", "x"}, "--pp-rank: expected a whole number, not 'x'"},
      {{"plan", "--model", m, "--tp", "99999999999999999999"}, "--tp: expected a whole number"},
      {{"plan", "--model", m, "--json=yes"}, "json was given a disallowed flag override"},
      {{"plan", "--model", m, "--draft=maybe"}, "--draft: model.draft: expected true or false"},
      {{"plan", "--model", m, "--tp", "0"}, "--tp: parallel.tp"},
      {{"load", "--model", m, "--set", "io.chunk_byte=4096"}, "unknown key 'io.chunk_byte'"},
      {{"inspect", m, "--load-format", "onnx"}, "--load-format: unknown load format 'onnx'"},
      {{"inspect"}, "PATH is required"},
      {{"inspect", m, m}, "not expected"},
      {{"synth", "--family", "llama", "--preset", "tiny", "--out"},
       "--out: 1 required DIR missing"},
      {{"synth", "--preset", "tiny", "--out", "/nonexistent/x"}, "--family"},
      {{"synth", "--family", "llama", "--preset", "tiny", "--out", "/x", "--seed", "1.5"},
       "--seed: expected a whole number, not '1.5'"},
      {{"synth", "--family", "llama", "--preset", "tiny", "--out", "/x", "--format", "pt"},
       "--format: pt not in {safetensors,bin,gguf}"},
      {{"selftest", "--devices"}, "--devices: 1 required SPEC missing"},
      {{"selftest", "--bogus"}, "not expected: --bogus"},
      {{"demo", "--cache"}, "--cache: 1 required DIR missing"},
  };
  for (const Case& c : cases) {
    std::string line;
    for (const std::string& a : c.args) {
      line += a + " ";
    }
    SCOPED_TRACE(line);
    RunResult r = ferry(c.args);
    EXPECT_EQ(r.status, 2) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says));
    EXPECT_THAT(r.out, Not(HasSubstr("placed")));
  }
}

TEST_F(CliTest, FlagsKeepTheirMeaningAndPrecedence) {
  const std::string m = model();
  // The human plan's first line names the layout.
  auto layout = [](const RunResult& r) { return r.out.substr(0, r.out.find('\n')); };
  RunResult r = ferry({"plan", "--model", m, "--tp", "2", "--tp=4"});  // the last one wins
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(layout(r), HasSubstr("tp 4 (local ranks 0,1,2,3)"));

  TempDir dir;
  const std::string file = dir.file("c.json");
  ferry::testing::write_file(
      file, R"({"parallel": {"tp": 8, "ranks": [1]}, "model": {"path": ")" + m + R"("}})");
  // file < environment < --set < flag, key by key.
  r = ferry({"plan", "--config", file});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(layout(r), HasSubstr("tp 8 (local ranks 1)"));
  r = ferry({"plan", "--config", file}, {"FERRY_PARALLEL__TP=4"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(layout(r), HasSubstr("tp 4 (local ranks 1)"));
  r = ferry({"plan", "--config", file, "--set", "parallel.tp=2"}, {"FERRY_PARALLEL__TP=4"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(layout(r), HasSubstr("tp 2 (local ranks 1)"));
  r = ferry({"plan", "--tp", "1", "--config", file, "--set", "parallel.tp=2", "--ranks", "0"},
            {"FERRY_PARALLEL__TP=4"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(layout(r), HasSubstr("tp 1 (local ranks 0)"));
  // --set arguments apply in order; --model wins over model.path from anywhere.
  r = ferry({"plan", "--set", "parallel.tp=2", "--set", "parallel.tp=4", "--model", m, "--set",
             "model.path=/nonexistent"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(layout(r), HasSubstr("tp 4"));

  // A model path from the environment alone is enough.
  r = ferry({"plan", "--json"}, {"FERRY_MODEL__PATH=" + m});
  EXPECT_EQ(r.status, 0) << r.err;
}

TEST_F(CliTest, WrapperVariablesAreIgnoredWithOneWarning) {
  const std::string m = model();
  RunResult r = ferry({"load", "--model", m, "--tp", "2"},
                      {"FERRY_BIN=/opt/ferry/bin/ferry", "FERRY_HOME=/opt/ferry", "FERRY_LOG=info",
                       "FERRY_TEST_DATA=/nonexistent", "FERRY_REQUIRE_TEST_DATA=1"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("tp rank 1 on host:1"));
  EXPECT_EQ(occurrences(r.err, "FERRY_BIN"), 1u) << r.err;
  EXPECT_EQ(occurrences(r.err, "FERRY_HOME"), 1u) << r.err;
  EXPECT_THAT(r.err, HasSubstr("environment FERRY_BIN: not a ferry variable"));
  for (const char* silent : {"FERRY_LOG", "FERRY_TEST_DATA", "FERRY_REQUIRE_TEST_DATA"}) {
    EXPECT_THAT(r.err, Not(HasSubstr(silent)));
  }

  // FERRY_DEVICES and names with __ must still name a key.
  RunResult bad = ferry({"plan", "--model", m}, {"FERRY_IO__CHUNKBYTES=4096"});
  EXPECT_EQ(bad.status, 2);
  EXPECT_THAT(bad.err, HasSubstr("environment FERRY_IO__CHUNKBYTES: unknown key 'io.chunkbytes'"));
  RunResult devices = ferry({"load", "--model", m, "--tp", "2"}, {"FERRY_DEVICES=tpu:0"});
  EXPECT_EQ(devices.status, 2);
  EXPECT_THAT(devices.err, HasSubstr("environment FERRY_DEVICES"));
  RunResult good = ferry({"load", "--model", m, "--tp", "2"}, {"FERRY_DEVICES=host:2"});
  EXPECT_EQ(good.status, 0) << good.err;
}

}  // namespace
}  // namespace ferry::tools
