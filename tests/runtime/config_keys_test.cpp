// The table of configuration keys (runtime/config_keys.hpp): every row round-trips
// through to_json and build, its environment name sets it, the builder says where
// each value came from, and the checks that span several keys name a key and its
// source.
#include "runtime/config_keys.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "common/error.hpp"
#include "io/discover.hpp"
#include "models/postprocess.hpp"
#include "testing/error_of.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using Env = std::map<std::string, std::string>;

std::string config_error(const ConfigBuilder& b) {
  return testing::error_of(Stage::kConfig, [&] { b.build(); });
}

TEST(ConfigKeys, RowsAreNamedOnceWithADocAndAType) {
  std::set<std::string> names;
  for (const ConfigKey& key : config_keys()) {
    SCOPED_TRACE(std::string(key.name));
    EXPECT_TRUE(names.insert(std::string(key.name)).second) << "twice";
    EXPECT_EQ(find_config_key(key.name), &key);
    EXPECT_FALSE(key.doc.empty());
    EXPECT_EQ(key.doc.find('\n'), std::string_view::npos) << "one line";
    EXPECT_FALSE(key.type().empty());
    EXPECT_EQ(key.name, key.section().empty()
                            ? std::string(key.leaf())
                            : std::string(key.section()) + "." + std::string(key.leaf()));
  }
  EXPECT_EQ(find_config_key("io.chunk_byte"), nullptr);
  EXPECT_GE(names.size(), 50u);
}

TEST(ConfigKeys, ToJsonIsTheTable) {
  const LoadConfig defaults;
  const nlohmann::json j = to_json(defaults);
  std::size_t leaves = 0;
  for (const auto& [section, value] : j.items()) {
    leaves += value.is_object() ? value.size() : 1;
  }
  EXPECT_EQ(leaves, config_keys().size());
  for (const ConfigKey& key : config_keys()) {
    const nlohmann::json& value =
        key.section().empty() ? j.at(std::string(key.name))
                              : j.at(std::string(key.section())).at(std::string(key.leaf()));
    EXPECT_EQ(value, key.default_value()) << key.name;
    EXPECT_EQ(value, key.write(defaults)) << key.name;
  }
}

// At its default; load_config_test's EveryReportedKeyCanBeSetFromEverySource sets
// every key to a value other than its default from every source.
TEST(ConfigKeys, EveryKeyRoundTripsThroughBuildFromEverySource) {
  const LoadConfig expected = ConfigBuilder().build();
  for (const ConfigKey& key : config_keys()) {
    SCOPED_TRACE(std::string(key.name));
    const nlohmann::json value = key.default_value();
    // A config file's JSON, --set's text, the environment's text and a flag.
    ConfigBuilder by_json;
    nlohmann::json object;
    if (key.section().empty()) {
      object[std::string(key.name)] = value;
    } else {
      object[std::string(key.section())][std::string(key.leaf())] = value;
    }
    by_json.apply_json(object, "c.json");
    ConfigBuilder by_set;
    by_set.apply_set(std::string(key.name) + "=" + value.dump());
    ConfigBuilder by_env;
    by_env.apply_env(Env{{key.env_name(), value.dump()}});
    ConfigBuilder by_flag;
    by_flag.apply_flag("--flag", key.name, value.dump());
    for (const ConfigBuilder* b : {&by_json, &by_set, &by_env, &by_flag}) {
      const LoadConfig built = b->build();
      EXPECT_EQ(built, expected);
      EXPECT_EQ(key.write(built), value);
    }
    EXPECT_EQ(by_json.origin(key.name).layer, ConfigLayer::kFile);
    EXPECT_EQ(by_set.origin(key.name).layer, ConfigLayer::kSet);
    EXPECT_EQ(by_env.origin(key.name).layer, ConfigLayer::kEnvironment);
    EXPECT_EQ(by_env.origin(key.name).source, "environment " + key.env_name());
    EXPECT_EQ(by_flag.origin(key.name).layer, ConfigLayer::kFlag);
  }
}

// The parallel layout's rules run before the rows that place its ranks, so the
// first error names the cause: an ep that does not divide tp, not the device count
// (four local ranks) that follows from it.
TEST(ConfigKeys, TheParallelRulesComeBeforeTheDevices) {
  ConfigBuilder b;
  b.apply_set("parallel.tp=4");
  b.apply_set("parallel.ep=3");
  b.apply_set("devices=cuda:0");
  EXPECT_THAT(config_error(b), HasSubstr("parallel.ep: expected a divisor of parallel.tp 4, got 3"));
  b.apply_set("parallel.ep=2");
  EXPECT_THAT(config_error(b), HasSubstr("gives 1 device for 4 local ranks"));
}

// Every value of an enum with `count` values, set through `key` under the name
// `name_of` gives it, builds as that value (`read` takes it from the LoadConfig) and
// is written back under the same name; the key's type lists `extra` more choices.
template <class E, class NameOf, class Read>
void expect_choices_are_names(std::string_view key, int count, NameOf name_of, Read read,
                              int extra) {
  const ConfigKey* row = find_config_key(key);
  ASSERT_NE(row, nullptr) << key;
  for (int i = 0; i < count; ++i) {
    const auto v = static_cast<E>(i);
    const std::string name(name_of(v));
    ConfigBuilder b;
    // What model.load_format remote_instance needs to build (harmless elsewhere).
    b.apply_set("remote.seed=10.0.0.5:7400");
    b.apply_set("remote.token_file=/etc/ferry/fleet.token");
    b.apply_set(std::string(key) + "=" + name);
    const LoadConfig c = b.build();
    EXPECT_EQ(read(c), v) << name;
    EXPECT_EQ(row->write(c), name);
  }
  const std::string type = row->type();
  EXPECT_EQ(std::count(type.begin(), type.end(), '|') + 1, count + extra) << type;
}

// model.load_format and postprocess.target spell their choices in the key table;
// io/ and models/ spell the same enums for the loader and the report. Every value
// of each enum is a choice of the key under the same name, and the key has no other
// (postprocess.target adds "auto").
TEST(ConfigKeys, ChoiceNamesAreTheLayersNames) {
  expect_choices_are_names<io::LoadFormat>(
      "model.load_format", static_cast<int>(io::LoadFormat::kRemoteInstance) + 1,
      [](io::LoadFormat v) { return io::to_string(v); },
      [](const LoadConfig& c) { return c.model.load_format; }, 0);
  using Target = models::QuantScheme::Target;
  expect_choices_are_names<Target>(
      "postprocess.target", static_cast<int>(Target::kSm100) + 1,
      [](Target v) { return models::to_string(v); },
      [](const LoadConfig& c) { return c.postprocess.target; }, 1);
}

TEST(ConfigKeys, EnvironmentNames) {
  EXPECT_EQ(find_config_key("io.chunk_bytes")->env_name(), "FERRY_IO__CHUNK_BYTES");
  EXPECT_EQ(find_config_key("devices")->env_name(), "FERRY_DEVICES");
  EXPECT_EQ(find_config_key("parallel.pp_rank")->env_name(), "FERRY_PARALLEL__PP_RANK");
  for (const ConfigKey& key : config_keys()) {
    for (std::string_view other : kNonConfigVariables) {
      EXPECT_NE(key.env_name(), other);
    }
  }
}

TEST(ConfigKeys, ProvenanceFollowsThePrecedence) {
  ConfigBuilder b;
  EXPECT_EQ(b.origin("parallel.tp").layer, ConfigLayer::kDefault);
  EXPECT_EQ(b.origin("parallel.tp").source, "defaults");
  b.apply_json_text(R"({"parallel": {"tp": 4}, "io": {"direct": true}})", "c.json");
  EXPECT_EQ(b.origin("parallel.tp").layer, ConfigLayer::kFile);
  EXPECT_EQ(b.origin("parallel.tp").source, "c.json");
  b.apply_env(Env{{"FERRY_PARALLEL__TP", "2"}, {"FERRY_IO__QUEUE_DEPTH", "8"}});
  EXPECT_EQ(b.origin("parallel.tp").layer, ConfigLayer::kEnvironment);
  EXPECT_EQ(b.origin("parallel.tp").source, "environment FERRY_PARALLEL__TP");
  b.apply_set("parallel.tp=8");
  EXPECT_EQ(b.origin("parallel.tp").layer, ConfigLayer::kSet);
  EXPECT_EQ(b.origin("parallel.tp").source, "--set parallel.tp");
  b.apply_flag("--tp", "parallel.tp", "1");
  EXPECT_EQ(b.origin("parallel.tp").layer, ConfigLayer::kFlag);
  EXPECT_EQ(b.origin("parallel.tp").source, "--tp");
  // The others keep theirs.
  EXPECT_EQ(b.origin("io.direct").layer, ConfigLayer::kFile);
  EXPECT_EQ(b.origin("io.queue_depth").layer, ConfigLayer::kEnvironment);
  EXPECT_EQ(b.origin("io.engine").layer, ConfigLayer::kDefault);
  EXPECT_EQ(b.build().parallel.tp, 1);
  EXPECT_EQ(to_string(ConfigLayer::kDefault), "default");
  EXPECT_EQ(to_string(ConfigLayer::kFile), "file");
  EXPECT_EQ(to_string(ConfigLayer::kEnvironment), "environment");
  EXPECT_EQ(to_string(ConfigLayer::kSet), "--set");
  EXPECT_EQ(to_string(ConfigLayer::kFlag), "flag");
}

TEST(ConfigKeys, ARowsErrorNamesItsKeyAndSource) {
  ConfigBuilder b;
  b.apply_env(Env{{"FERRY_IO__QUEUE_DEPTH", "abc"}});
  EXPECT_THAT(config_error(b), HasSubstr("config: environment FERRY_IO__QUEUE_DEPTH: "
                                         "io.queue_depth: expected a positive integer"));
  ConfigBuilder choice;
  choice.apply_flag("--startup", "startup.mode", "later");
  EXPECT_THAT(config_error(choice),
              HasSubstr("config: --startup: startup.mode: expected serial, overlap or auto, got "
                        "\"later\""));
}

// The checks that span several keys, those runtime.cpp made at load time among them:
// each names the key it is charged to, and that key's source.
TEST(ConfigKeys, ChecksAcrossKeysNameAKeyAndItsSource) {
  struct Case {
    std::vector<std::string> sets;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"load.layered=true"},
       "--set load.layered: load.layered frees load-only parameters as soon as they are used, "
       "and only quantization.online makes any"},
      {{"load.layered=true", "quantization.online=auto", "model.load_format=dummy"},
       "--set load.layered: load.layered with model.load_format dummy: a dummy load fills every "
       "parameter at once"},
      {{"io.direct_to_device=on", "load.layered=true", "quantization.online=auto"},
       "--set io.direct_to_device: io.direct_to_device=on with load.layered: a load-only param "
       "has no storage"},
      {{"prefetch.enabled=true", "io.direct=true"},
       "--set prefetch.enabled: prefetch.enabled with io.direct: refused, because O_DIRECT reads "
       "bypass the page cache"},
      {{"parallel.tp=4", "parallel.ep=3"},
       "--set parallel.ep: parallel.ep: expected a divisor of parallel.tp 4, got 3"},
      {{"devices=null:1", "load.dump_dir=/tmp/d"},
       "--set load.dump_dir: load.dump_dir: devices null:1 keep no parameter data"},
      {{"io.direct=true", "io.chunk_bytes=6000"},
       "--set io.chunk_bytes: io.chunk_bytes: with io.direct it must be a multiple of 4096"},
  };
  for (const Case& c : cases) {
    ConfigBuilder b;
    for (const std::string& s : c.sets) {
      b.apply_set(s);
    }
    EXPECT_THAT(config_error(b), HasSubstr("config: " + c.says)) << c.sets.front();
  }
  // Each alone is fine.
  ConfigBuilder layered;
  layered.apply_set("load.layered=true");
  layered.apply_set("quantization.online=fp8_channel");
  EXPECT_TRUE(layered.build().load.layered);
}

}  // namespace
}  // namespace ferry::runtime
