// `ferry config` through the binary: --list prints every key of the key table with
// its type, default and doc (as a table and as JSON); --show prints the effective
// configuration of `ferry load`'s options and where each value came from; usage
// errors exit 2, and a bad key or value names the key and its source.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/config_keys.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::tools {
namespace {

using ferry::testing::RunResult;
using ::testing::HasSubstr;

// `ferry ARGS` with `env` ("NAME=value") added to the environment.
RunResult ferry(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  std::vector<std::string> argv = env;
  argv.insert(argv.begin(), "env");
  argv.push_back(FERRY_BINARY);
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::run(argv);
}

TEST(ConfigCli, ListPrintsEveryKeyWithItsTypeDefaultAndDoc) {
  RunResult r = ferry({"config", "--list"});
  ASSERT_EQ(r.status, 0) << r.err;
  for (const runtime::ConfigKey& key : runtime::config_keys()) {
    // One line per key: name, type, default, doc, in that order.
    const std::size_t at = r.out.find("\n" + std::string(key.name) + " ");
    ASSERT_NE(at, std::string::npos) << key.name;
    const std::string line = r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
    const std::size_t type = line.find(key.type());
    const std::size_t def = line.find(key.default_value().dump(), type + key.type().size());
    const std::size_t doc = line.find(std::string(key.doc), def);
    EXPECT_NE(type, std::string::npos) << line;
    EXPECT_NE(def, std::string::npos) << line;
    EXPECT_NE(doc, std::string::npos) << line;
  }
  EXPECT_THAT(r.out, HasSubstr("FERRY_IO__CHUNK_BYTES"));

  RunResult j = ferry({"config", "--list", "--json"});
  ASSERT_EQ(j.status, 0) << j.err;
  const nlohmann::json keys = nlohmann::json::parse(j.out);
  ASSERT_EQ(keys.size(), runtime::config_keys().size());
  std::size_t i = 0;
  for (const runtime::ConfigKey& key : runtime::config_keys()) {
    const nlohmann::json& row = keys.at(i++);
    EXPECT_EQ(row.at("key"), std::string(key.name));
    EXPECT_EQ(row.at("section"), std::string(key.section()));
    EXPECT_EQ(row.at("type"), key.type());
    EXPECT_EQ(row.at("default"), key.default_value());
    EXPECT_EQ(row.at("env"), key.env_name());
    EXPECT_EQ(row.at("doc"), std::string(key.doc));
  }
}

TEST(ConfigCli, ShowSaysWhereEachValueCameFrom) {
  testing::TempDir dir;
  const std::string file = dir.file("c.json");
  std::ofstream(file) << R"({"parallel": {"tp": 4}, "io": {"queue_depth": 8, "direct": true}})";
  RunResult r = ferry({"config", "--show", "--json", "--config", file, "--set", "io.queue_depth=16",
                       "--tp", "2", "--devices", "null:2"},
                      {"FERRY_IO__ENGINE=pread", "FERRY_IO__DIRECT=false"});
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.size(), runtime::config_keys().size());
  auto expect = [&](const std::string& key, const nlohmann::json& value, const std::string& from,
                    const std::string& source) {
    SCOPED_TRACE(key);
    EXPECT_EQ(j.at(key).at("value"), value);
    EXPECT_EQ(j.at(key).at("from"), from);
    EXPECT_EQ(j.at(key).at("source"), source);
  };
  expect("parallel.tp", 2, "flag", "--tp");
  expect("devices", "null:2", "flag", "--devices");
  expect("io.queue_depth", 16, "--set", "--set io.queue_depth");
  expect("io.engine", "pread", "environment", "environment FERRY_IO__ENGINE");
  expect("io.direct", false, "environment", "environment FERRY_IO__DIRECT");
  expect("io.read_lanes", 0, "default", "defaults");
  expect("parallel.ranks", nlohmann::json({0, 1}), "default", "defaults");  // from tp
  expect("model.path", "", "default", "defaults");  // no model needed to show

  // Without --config, the embedded config/default.json is the file layer.
  RunResult embedded = ferry({"config", "--show"});
  ASSERT_EQ(embedded.status, 0) << embedded.err;
  EXPECT_THAT(embedded.out, HasSubstr("file embedded config/default.json"));
  EXPECT_THAT(embedded.out, HasSubstr("io.engine"));
  RunResult text = ferry({"config", "--show", "--set", "io.direct=true", "--tp", "1"},
                         {"FERRY_IO__ENGINE=pread"});
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("--set io.direct"));
  EXPECT_THAT(text.out, HasSubstr("flag --tp"));
  EXPECT_THAT(text.out, HasSubstr("environment FERRY_IO__ENGINE"));
}

TEST(ConfigCli, BadInputsExitTwoNamingTheKey) {
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> env;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"config"}, {}, "give one of --list and --show"},
      {{"config", "--list", "--show"}, {}, "give one of --list and --show"},
      {{"config", "--list", "--tp", "2"}, {}, "--list takes no configuration options"},
      {{"config", "--bogus"}, {}, "--bogus"},
      {{"config", "--show", "--set", "io.chunk_byte=1MiB"},
       {},
       "config: --set io.chunk_byte: unknown key 'io.chunk_byte' (did you mean 'io.chunk_bytes'?)"},
      {{"config", "--show", "--set", "io.queue_depth=abc"},
       {},
       "config: --set io.queue_depth: io.queue_depth: expected a positive integer, got \"abc\""},
      {{"config", "--show"},
       {"FERRY_IO__ENGINE=aio"},
       "config: environment FERRY_IO__ENGINE: io.engine: expected uring or pread, got \"aio\""},
      {{"config", "--show", "--startup", "later"}, {}, "--startup: startup.mode: expected serial"},
      {{"config", "--show", "--set", "load.layered=true"},
       {},
       "--set load.layered: load.layered frees load-only parameters"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args.back());
    RunResult r = ferry(c.args, c.env);
    EXPECT_EQ(r.status, 2);
    EXPECT_THAT(r.err, HasSubstr(c.says));
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

TEST(ConfigCli, TheVerbIsListedWithItsHelp) {
  EXPECT_THAT(ferry({"--help"}).out, HasSubstr("\n  config "));
  RunResult help = ferry({"config", "--help"});
  EXPECT_EQ(help.status, 0);
  for (const char* flag : {"--list", "--show", "--json", "--config", "--set", "--tp", "--devices",
                           "--startup", "--report"}) {
    EXPECT_THAT(help.out, HasSubstr(flag));
  }
}

}  // namespace
}  // namespace ferry::tools
