// The public Config (include/ferry/config.hpp): layers applied in call order over
// the in-code defaults, each refused at once with the key and its source named and
// the Config left as it was; copies independent; to_json() round-trips; a Runtime
// built from one loads; the report's JSON text is its JSON object.
#include "ferry/config.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>  // setenv, unsetenv

#include <nlohmann/json.hpp>
#include <string>

#include "ferry/runtime.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/load_config.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::TempDir;
using testing::write_file;

template <typename F>
Error config_error(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no ferry::Error thrown";
  return Error(Stage::kVerify, "", "", "none");
}

TEST(PublicConfig, StartsFromTheInCodeDefaults) {
  Config c;
  EXPECT_EQ(c.load_config(), ConfigBuilder().build());
  EXPECT_EQ(c.load_config().parallel.tp, 1);
  EXPECT_EQ(c, to_config(ConfigBuilder().build()));
}

TEST(PublicConfig, LayersApplyInCallOrderKeyByKey) {
  TempDir dir;
  write_file(dir.file("c.json"), R"({"parallel": {"tp": 4}, "io": {"chunk_bytes": "2MiB"}})");
  Config c;
  c.set("parallel.tp=2").file(dir.file("c.json")).set("io.chunk_bytes", "4MiB");
  EXPECT_EQ(c.load_config().parallel.tp, 4);            // the file came after the set
  EXPECT_EQ(c.load_config().io.chunk_bytes, 4u << 20);  // the set came after the file
  c.json(R"({"parallel": {"tp": 8}})", "engine.json").set("model.path", "/m/2024");
  EXPECT_EQ(c.load_config().parallel.tp, 8);
  EXPECT_EQ(c.load_config().io.chunk_bytes, 4u << 20);  // a layer overrides only its keys
  EXPECT_EQ(c.load_config().model.path, "/m/2024");     // text stays text
}

TEST(PublicConfig, ARefusedLayerNamesTheKeyAndItsSourceAndChangesNothing) {
  TempDir dir;
  Config c;
  c.set("parallel.tp=2");
  const Config before = c;

  Error e = config_error([&] { c.set("io.no_such_key=1"); });
  EXPECT_EQ(e.stage(), Stage::kConfig);
  EXPECT_THAT(e.what(), HasSubstr("io.no_such_key"));
  EXPECT_EQ(c, before);

  e = config_error([&] { c.set("parallel.tp", "zero"); });
  EXPECT_THAT(e.what(), AllOf(HasSubstr("parallel.tp"), HasSubstr("--set")));
  EXPECT_EQ(c, before);

  write_file(dir.file("bad.json"), R"({"io": {"chunk_bytes": -1}})");
  e = config_error([&] { c.file(dir.file("bad.json")); });
  EXPECT_THAT(e.what(), AllOf(HasSubstr("bad.json"), HasSubstr("io.chunk_bytes")));
  EXPECT_EQ(c, before);

  e = config_error([&] { c.file(dir.file("missing.json")); });
  EXPECT_THAT(e.what(), HasSubstr("missing.json"));
  e = config_error([&] { c.json("{not json", "engine.json"); });
  EXPECT_THAT(e.what(), HasSubstr("engine.json"));
  e = config_error([&] { c.set("no equals sign"); });
  EXPECT_EQ(e.stage(), Stage::kConfig);
  EXPECT_EQ(c, before);
  EXPECT_EQ(c.load_config().parallel.tp, 2);
}

TEST(PublicConfig, TheEnvironmentLayerReadsFerryVariables) {
  ASSERT_EQ(setenv("FERRY_IO__CHUNK_BYTES", "8MiB", 1), 0);
  Config c;
  c.set("io.chunk_bytes=1MiB").environment();
  unsetenv("FERRY_IO__CHUNK_BYTES");
  EXPECT_EQ(c.load_config().io.chunk_bytes, 8u << 20);

  ASSERT_EQ(setenv("FERRY_IO__NO_SUCH_KEY", "1", 1), 0);
  Error e = config_error([&] { c.environment(); });
  unsetenv("FERRY_IO__NO_SUCH_KEY");
  EXPECT_THAT(e.what(), HasSubstr("FERRY_IO__NO_SUCH_KEY"));
  EXPECT_EQ(c.load_config().io.chunk_bytes, 8u << 20);
}

TEST(PublicConfig, CopiesAreIndependentAndToJsonRoundTrips) {
  Config a;
  a.set("parallel.tp=4").set("parallel.ep=2").set("io.direct=true");
  Config b = a;
  b.set("parallel.tp=8");
  EXPECT_EQ(a.load_config().parallel.tp, 4);
  EXPECT_EQ(b.load_config().parallel.tp, 8);
  EXPECT_EQ(b.load_config().parallel.ep, 2);
  Config moved = std::move(b);
  EXPECT_EQ(moved.load_config().parallel.tp, 8);

  Config again;
  again.json(a.to_json(), "round trip");
  EXPECT_EQ(again, a);
  EXPECT_NE(again, moved);
  EXPECT_EQ(nlohmann::json::parse(a.to_json(-1)), to_json(a.load_config()));
}

TEST(PublicConfig, FromTheInternalFormLaterLayersApplyOverIt) {
  ConfigBuilder builder;
  builder.apply_set("parallel.tp=2");
  builder.apply_set("io.chunk_bytes=64KiB");
  const LoadConfig internal = builder.build();
  Config c = to_config(internal);
  EXPECT_EQ(c.load_config(), internal);
  c.set("parallel.tp=4");
  EXPECT_EQ(c.load_config().parallel.tp, 4);
  EXPECT_EQ(c.load_config().io.chunk_bytes, 64u << 10);
}

TEST(PublicConfig, ARuntimeFromAConfigLoadsAndItsReportJsonIsTheReport) {
  TempDir dir;
  testing::Checkpoint ck = testing::synth_checkpoint(dir.file("ck"), "llama");
  Config c;
  c.set("model.path", ck.dir).set("parallel.tp=2");
  Runtime rt(c);
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_GT(testing::expect_matches_reference(*r.model, ck, 2, DType::kBF16), 0u);
  const LoadReport& report = r.model->report();
  const nlohmann::json j = nlohmann::json::parse(report.json(-1));
  EXPECT_EQ(j, to_json(report));
  EXPECT_EQ(j.at("bytes_read").get<std::uint64_t>(), report.bytes_read);
  EXPECT_EQ(report.json(2), to_json(report).dump(2));
}

// The load rules (broken_load_rule) tie keys an engine may set in either order:
// a Config set call by call passes through a state that breaks one, and only the
// load refuses it, with the words the CLI's configuration refuses it with.
TEST(PublicConfig, TheLoadRulesWaitForTheLoadSoTheirKeysComeInAnyOrder) {
  TempDir dir;
  testing::Checkpoint ck = testing::synth_checkpoint(dir.file("ck"), "llama");
  Config c;
  c.set("model.path", ck.dir).set("parallel.tp=2").set("load.layered=true");
  {
    Runtime rt(c);
    LoadResult r = rt.load();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kConfig);
    EXPECT_THAT(r.error->message, HasSubstr("only quantization.online makes any"));
  }
  c.set("quantization.online=fp8_channel");
  {
    Runtime rt(c);
    LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
  }
  // The other order builds the same; turning both off goes in either order too.
  Config d;
  d.set("model.path", ck.dir).set("parallel.tp=2").set("quantization.online=fp8_channel");
  d.set("load.layered=true");
  EXPECT_EQ(d.load_config(), c.load_config());
  c.set("quantization.online=none").set("load.layered=false");
  d.set("load.layered=false").set("quantization.online=none");
  EXPECT_EQ(c.load_config(), d.load_config());
  EXPECT_FALSE(c.load_config().load.layered);
  // The CLI's builder, given the whole configuration at once, refuses it there.
  ConfigBuilder b;
  b.apply_set("load.layered=true");
  EXPECT_THAT(config_error([&] { b.build(); }).what(),
              HasSubstr("--set load.layered: load.layered frees load-only parameters"));
  // So does a load whose configuration came in the internal form.
  b.apply_set("prefetch.enabled=true");
  b.apply_set("io.direct=true");
  const LoadConfig internal = b.build(ConfigBuilder::Rules::kAllButLoad);
  Runtime rt(to_config(internal));
  LoadResult r = rt.load();
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error->message, HasSubstr("only quantization.online makes any"));
}

}  // namespace
}  // namespace ferry::runtime
