// LoadConfig: in-code defaults, the layering of file < environment < --set < flags,
// unknown keys from every source, type and range errors, sizes, ranks and devices,
// and the to_json round trip the load report relies on.
#include "runtime/load_config.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "testing/error_of.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using Env = std::map<std::string, std::string>;

// Runs `fn`, expects a config-stage ferry::Error and returns its message.
std::string config_error(const std::function<void()>& fn) {
  return testing::error_of(Stage::kConfig, fn);
}

LoadConfig from_json_text(std::string_view text) {
  ConfigBuilder b;
  b.apply_json_text(text, "test.json");
  return b.build();
}

LoadConfig from_sets(const std::vector<std::string>& sets) {
  ConfigBuilder b;
  for (const auto& s : sets) {
    b.apply_set(s);
  }
  return b.build();
}

LoadConfig from_env(const Env& env) {
  ConfigBuilder b;
  b.apply_env(env);
  return b.build();
}

TEST(LoadConfigTest, InCodeDefaults) {
  LoadConfig c;
  EXPECT_EQ(c.model.path, "");
  EXPECT_EQ(c.model.load_format, io::LoadFormat::kAuto);
  EXPECT_FALSE(c.model.dtype.has_value());
  EXPECT_EQ(c.parallel.tp, 1);
  EXPECT_EQ(c.parallel.ep, 1);
  EXPECT_EQ(c.parallel.pp, 1);
  EXPECT_EQ(c.parallel.pp_rank, 0);
  EXPECT_TRUE(c.parallel.pp_partition.empty());
  EXPECT_EQ(c.parallel.ranks, std::vector<int>{0});
  EXPECT_EQ(c.devices.kind, DeviceSpec::Kind::kHost);
  EXPECT_EQ(c.devices.ids, std::vector<int>{0});
  EXPECT_EQ(c.io.engine, io::Engine::kUring);
  EXPECT_EQ(c.io.queue_depth, 4u);
  EXPECT_EQ(c.io.chunk_bytes, std::size_t{1} << 20);
  EXPECT_EQ(c.io.staging_bytes, 0u);  // 8 MiB per local device
  EXPECT_EQ(c.io.read_lanes, 0u);     // min(cores, files, 4)
  EXPECT_EQ(c.io.direct_to_device, io::DirectToDevice::kAuto);
  EXPECT_FALSE(c.io.direct);
  EXPECT_FALSE(c.io.drop_cache);
  EXPECT_FALSE(c.prefetch.enabled);
  EXPECT_EQ(c.prefetch.threads, 4u);
  EXPECT_EQ(c.prefetch.block_bytes, std::size_t{16} << 20);
  EXPECT_EQ(c.prefetch.ahead_bytes, std::uint64_t{1} << 30);
  EXPECT_FALSE(c.load.strict);
  EXPECT_EQ(c.load.sort_weight_files, 0);
  EXPECT_EQ(c.load.report, "");
  EXPECT_EQ(c.load.dump_dir, "");
  EXPECT_FALSE(c.model.draft);
  EXPECT_FALSE(c.model.switch_w13);
  EXPECT_EQ(c.model.eplb_map, "");
  EXPECT_EQ(c.model.fuse_shared_experts, std::nullopt);  // auto
  EXPECT_EQ(c.model.unaligned_tp, models::Unaligned::kRefuse);
  EXPECT_EQ(c.model.pad_moe_intermediate_to, 0);
  EXPECT_EQ(c.host.bandwidth_gbps, 0.0);
  EXPECT_FALSE(c.host.huge_pages);
  EXPECT_EQ(c.metrics.listen, "");
  EXPECT_EQ(c.metrics.textfile, "");
}

TEST(LoadConfigTest, EmptyObjectAndNoSourcesGiveInCodeDefaults) {
  EXPECT_EQ(ConfigBuilder().build(), LoadConfig{});
  EXPECT_EQ(from_json_text("{}"), LoadConfig{});
  EXPECT_EQ(from_json_text(R"({"io": {}, "model": {}})"), LoadConfig{});

  // --config {} wins over the embedded default, whatever that holds.
  testing::TempDir dir;
  testing::write_file(dir.file("empty.json"), "{}");
  ConfigSources sources;
  sources.config_file = dir.file("empty.json");
  sources.default_json = R"({"io": {"queue_depth": 99}})";
  EXPECT_EQ(load_config(sources, Env{}), LoadConfig{});

  // Without --config the embedded default text applies.
  sources.config_file.clear();
  EXPECT_EQ(load_config(sources, Env{}).io.queue_depth, 99u);
}

TEST(LoadConfigTest, RanksAndDevicesFollowTpWhenNotGiven) {
  LoadConfig c = from_json_text(R"({"parallel": {"tp": 4}})");
  EXPECT_EQ(c.parallel.ranks, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(c.devices.kind, DeviceSpec::Kind::kHost);
  EXPECT_EQ(c.devices.ids, (std::vector<int>{0, 1, 2, 3}));

  c = from_sets({"parallel.tp=4", "parallel.ranks=1-2"});
  EXPECT_EQ(c.parallel.ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(to_string(c.devices), "host:2");

  c = from_json_text(R"({"parallel": {"tp": 4, "ranks": [3, 0]}, "devices": "cuda:1,0"})");
  EXPECT_EQ(c.parallel.ranks, (std::vector<int>{3, 0}));
  EXPECT_EQ(c.devices.kind, DeviceSpec::Kind::kCuda);
  EXPECT_EQ(c.devices.ids, (std::vector<int>{1, 0}));

  c = from_json_text(R"({"parallel": {"tp": 2, "ranks": []}})");
  EXPECT_EQ(c.parallel.ranks, (std::vector<int>{0, 1}));
  c = from_json_text(R"({"parallel": {"tp": 2, "ranks": 1}})");
  EXPECT_EQ(c.parallel.ranks, (std::vector<int>{1}));
}

TEST(LoadConfigTest, PrecedenceDefaultsFileEnvSetFlag) {
  testing::TempDir dir;
  testing::write_file(dir.file("c.json"), R"({
    "model": {"path": "/file"},
    "io": {"queue_depth": 32, "staging_bytes": "3MiB", "engine": "pread"},
    "prefetch": {"threads": 2},
    "parallel": {"tp": 2}
  })");
  ConfigSources sources;
  sources.config_file = dir.file("c.json");
  sources.default_json = R"({"load": {"strict": true}})";  // not used: --config given
  sources.sets = {"model.path=/set", "io.queue_depth=128", "prefetch.threads=3"};
  sources.flags = {{"--model", "model.path", "/flag"}};
  Env env = {{"FERRY_MODEL__PATH", "/env"},
             {"FERRY_IO__QUEUE_DEPTH", "64"},
             {"FERRY_IO__STAGING_BYTES", "5MiB"},
             {"HOME", "/root"}};

  LoadConfig c = load_config(sources, env);
  EXPECT_EQ(c.model.path, "/flag");                     // file < env < --set < flag
  EXPECT_EQ(c.io.queue_depth, 128u);                    // file < env < --set
  EXPECT_EQ(c.io.staging_bytes, std::size_t{5} << 20);  // file < env
  EXPECT_EQ(c.prefetch.threads, 3u);                    // file < --set
  EXPECT_EQ(c.io.engine, io::Engine::kPread);           // file only
  EXPECT_EQ(c.parallel.tp, 2);                          // file only
  EXPECT_EQ(c.io.chunk_bytes, std::size_t{1} << 20);    // in-code default
  EXPECT_FALSE(c.load.strict);                          // the embedded default was not read

  // Later --set arguments override earlier ones; flags override every --set.
  sources.sets.push_back("model.path=/set2");
  sources.flags.push_back({"--tp", "parallel.tp", "1"});
  c = load_config(sources, env);
  EXPECT_EQ(c.model.path, "/flag");
  EXPECT_EQ(c.parallel.tp, 1);
  sources.flags.clear();
  EXPECT_EQ(load_config(sources, env).model.path, "/set2");
}

TEST(LoadConfigTest, EnvironmentNamesAndValues) {
  LoadConfig c = from_env({{"FERRY_IO__CHUNK_BYTES", "8MiB"},
                           {"FERRY_PARALLEL__TP", "2"},
                           {"FERRY_MODEL__PATH", "/x"},
                           {"FERRY_IO__DIRECT", "true"},
                           {"FERRY_DEVICES", "cuda:0,2"},
                           {"FERRY_LOG", "debug"},
                           {"FERRY_DISABLE_URING", "1"},
                           {"FERRYX", "not ours"},
                           {"PATH", "/usr/bin"}});
  EXPECT_EQ(c.io.chunk_bytes, std::size_t{8} << 20);
  EXPECT_EQ(c.parallel.tp, 2);    // "2" parsed as a JSON number
  EXPECT_EQ(c.model.path, "/x");  // not JSON, so a string
  EXPECT_TRUE(c.io.direct);
  EXPECT_EQ(c.devices.ids, (std::vector<int>{0, 2}));

  // A string key keeps the text even when it parses as JSON.
  EXPECT_EQ(from_env({{"FERRY_MODEL__PATH", "2024"}}).model.path, "2024");
  EXPECT_EQ(from_env({{"FERRY_LOAD__REPORT", "true"}}).load.report, "true");

  const char* envp[] = {"FERRY_IO__QUEUE_DEPTH=9", "FERRY_LOG=warn", "NO_EQUALS", "A=b=c", nullptr};
  ConfigBuilder b;
  b.apply_env(envp);
  EXPECT_EQ(b.build().io.queue_depth, 9u);
  EXPECT_EQ(load_config(ConfigSources{}, envp).io.queue_depth, 9u);
}

TEST(LoadConfigTest, FerryVariablesThatNameNoKeyAreIgnoredWithOneWarningEach) {
  // Only names with "__" and FERRY_DEVICES are configuration variables. Wrappers set
  // FERRY_ names of their own; those are ignored with a warning, and the variables
  // ferry reads elsewhere pass in silence.
  Env env = {{"FERRY_BIN", "/opt/ferry/bin/ferry"},
             {"FERRY_IO", R"({"queue_depth": 7})"},
             {"FERRY_MODEL", "/models/llama"},
             {"FERRY_", "1"},
             {"FERRY_LOG", "warn"},
             {"FERRY_DISABLE_URING", "1"},
             {"FERRY_TEST_DATA", "/data"},
             {"FERRY_REQUIRE_TEST_DATA", "1"},
             {"FERRY_IO__QUEUE_DEPTH", "9"}};
  ConfigBuilder b;
  b.apply_env(env);
  LoadConfig want;
  want.io.queue_depth = 9;
  EXPECT_EQ(b.build(), want);  // nothing but FERRY_IO__QUEUE_DEPTH was applied
  ASSERT_EQ(b.warnings().size(), 4u) << ::testing::PrintToString(b.warnings());
  // In name order: FERRY_, FERRY_BIN, FERRY_IO, FERRY_MODEL.
  EXPECT_THAT(b.warnings()[0], HasSubstr("environment FERRY_: not a ferry variable"));
  EXPECT_THAT(b.warnings()[1], HasSubstr("environment FERRY_BIN: not a ferry variable"));
  EXPECT_THAT(b.warnings()[1], HasSubstr("FERRY_IO__CHUNK_BYTES"));
  EXPECT_THAT(b.warnings()[1], HasSubstr("; ignored"));
  EXPECT_THAT(b.warnings()[2],
              HasSubstr("environment FERRY_IO: names the section 'io', not a key; set its keys "
                        "one by one (FERRY_IO__<KEY>)"));
  EXPECT_THAT(b.warnings()[3], HasSubstr("environment FERRY_MODEL: names the section 'model'"));

  // FERRY_DEVICES and every name with "__" must name a key and hold a valid value.
  EXPECT_EQ(from_env({{"FERRY_DEVICES", "host:2"}, {"FERRY_PARALLEL__TP", "2"}}).devices.ids,
            (std::vector<int>{0, 1}));
  EXPECT_THAT(config_error([] {
                from_env({{"FERRY_DEVICES", "tpu:0"}});
              }),
              HasSubstr("environment FERRY_DEVICES"));
  EXPECT_THAT(config_error([] {
                from_env({{"FERRY_BIN", "x"}, {"FERRY_LOAD__NOPE", "1"}});
              }),
              HasSubstr("config: environment FERRY_LOAD__NOPE: unknown key 'load.nope'"));

  // load_config logs each warning once, and the load goes on.
  std::vector<std::string> logged;
  log::Sink previous = log::set_sink([&](log::Level level, std::string_view m) {
    if (level == log::Level::kWarn) {
      logged.emplace_back(m);
    }
  });
  LoadConfig c = load_config(ConfigSources{}, Env{{"FERRY_BIN", "/x"}, {"FERRY_LOG", "info"}});
  log::set_sink(previous);
  EXPECT_EQ(c, LoadConfig{});
  ASSERT_EQ(logged.size(), 1u) << ::testing::PrintToString(logged);
  EXPECT_THAT(logged[0], HasSubstr("config: environment FERRY_BIN: not a ferry variable"));
}

// io.chunk_bytes "auto" (the default), io.staging_bytes 0 and io.read_lanes 0 follow
// the devices' link (io_auto): host memory keeps the sizes measured best there, a
// GPU's link gets larger chunks, more staging and more lanes.
TEST(LoadConfigTest, AutoIoSizesFollowTheDevices) {
  const IoAuto host = io_auto(DeviceSpec::Kind::kHost, 2);
  EXPECT_EQ(host.chunk_bytes, std::size_t{1} << 20);
  EXPECT_EQ(host.staging_bytes, std::size_t{16} << 20);  // 8 MiB per device
  EXPECT_EQ(host.max_lanes, 4u);
  EXPECT_TRUE(host.lanes_follow_files);
  EXPECT_EQ(io_auto(DeviceSpec::Kind::kNull, 1).chunk_bytes, std::size_t{1} << 20);
  const IoAuto one_gpu = io_auto(DeviceSpec::Kind::kCuda, 1);
  EXPECT_EQ(one_gpu.chunk_bytes, std::size_t{16} << 20);
  EXPECT_EQ(one_gpu.staging_bytes, std::size_t{256} << 20);
  EXPECT_EQ(one_gpu.max_lanes, 8u);
  EXPECT_FALSE(one_gpu.lanes_follow_files);
  const IoAuto eight = io_auto(DeviceSpec::Kind::kCuda, 8);
  EXPECT_EQ(eight.staging_bytes, std::size_t{1} << 30);  // capped
  EXPECT_EQ(eight.max_lanes, 16u);

  EXPECT_EQ(from_sets({}).io.chunk_bytes, std::size_t{1} << 20);
  EXPECT_EQ(from_sets({"io.chunk_bytes=auto"}).io.chunk_bytes, std::size_t{1} << 20);
  EXPECT_EQ(from_sets({"devices=cuda:0"}).io.chunk_bytes, std::size_t{16} << 20);
  EXPECT_EQ(from_sets({"devices=cuda:0", "io.chunk_bytes=auto"}).io.chunk_bytes,
            std::size_t{16} << 20);
  // What the user sets stands.
  EXPECT_EQ(from_sets({"devices=cuda:0", "io.chunk_bytes=2MiB"}).io.chunk_bytes,
            std::size_t{2} << 20);
  // Auto chunks leave explicit staging at least two buffers.
  EXPECT_EQ(from_sets({"devices=cuda:0", "io.staging_bytes=8MiB"}).io.chunk_bytes,
            std::size_t{4} << 20);
  EXPECT_EQ(from_sets({"io.staging_bytes=12KiB"}).io.chunk_bytes, 4096u);
  EXPECT_EQ(from_sets({"devices=cuda:0"}).io.staging_bytes, 0u);  // auto, resolved per load
  // The dump keeps "auto" where ferry chose, so a dumped config chooses again.
  EXPECT_EQ(to_json(from_sets({"devices=cuda:0"}))["io"]["chunk_bytes"], "auto");
  EXPECT_EQ(to_json(from_sets({"io.chunk_bytes=2MiB"}))["io"]["chunk_bytes"], 2u << 20);
  EXPECT_THAT(config_error([] { from_sets({"io.chunk_bytes=most"}); }),
              HasSubstr("io.chunk_bytes"));
}

TEST(LoadConfigTest, SetValuesAreJsonElseText) {
  EXPECT_TRUE(from_sets({"io.direct=true"}).io.direct);
  EXPECT_EQ(from_sets({R"(model.path="/a b")"}).model.path, "/a b");
  EXPECT_EQ(from_sets({"model.path=/a b"}).model.path, "/a b");
  EXPECT_EQ(from_sets({"model.path=a=b"}).model.path, "a=b");
  EXPECT_EQ(from_sets({" io.queue_depth =3"}).io.queue_depth, 3u);
  EXPECT_EQ(from_sets({"io.chunk_bytes=4 MiB"}).io.chunk_bytes, std::size_t{4} << 20);
  EXPECT_EQ(from_sets({"io.chunk_bytes=8192"}).io.chunk_bytes, 8192u);
  EXPECT_EQ(from_sets({R"(io={"direct": true, "queue_depth": 2})"}).io.queue_depth, 2u);
  EXPECT_EQ(from_sets({"model.dtype=bf16"}).model.dtype, DType::kBF16);
  EXPECT_EQ(from_sets({"model.load_format=mistral"}).model.load_format, io::LoadFormat::kMistral);
  EXPECT_EQ(from_sets({"parallel.pp=2", "parallel.pp_partition=[3,4]"}).parallel.pp_partition,
            (std::vector<int>{3, 4}));
  EXPECT_DOUBLE_EQ(from_sets({"host.bandwidth_gbps=12.5"}).host.bandwidth_gbps, 12.5);
  EXPECT_EQ(from_sets({"load.sort_weight_files=-1"}).load.sort_weight_files, -1);

  ConfigBuilder b;
  b.apply_flag_value("--threads", "prefetch.threads", 6);
  EXPECT_EQ(b.build().prefetch.threads, 6u);

  EXPECT_EQ(config_error([] { from_sets({"io.direct"}); }),
            "config: --set io.direct: expected key=value");
  EXPECT_THAT(config_error([] { from_sets({"=3"}); }), HasSubstr("the key is empty"));
}

TEST(LoadConfigTest, UnknownKeysAreRejectedFromEverySource) {
  testing::TempDir dir;
  testing::write_file(dir.file("c.json"), R"({"model": {"pth": "/x"}})");
  std::string file = dir.file("c.json");
  EXPECT_THAT(
      config_error([&] {
        ConfigBuilder b;
        b.apply_file(file);
      }),
      HasSubstr("config: " + file + ": unknown key 'model.pth' (did you mean 'model.path'?)"));

  // The demo block is not a LoadConfig key.
  EXPECT_THAT(config_error([] { from_json_text(R"({"demo": {"family": "llama"}})"); }),
              HasSubstr("config: test.json: unknown key 'demo'"));
  EXPECT_THAT(config_error([] { from_json_text(R"({"io": {"direct": true, "aio": 1}})"); }),
              HasSubstr("config: test.json: unknown key 'io.aio'"));

  EXPECT_THAT(config_error([] {
                from_env({{"FERRY_IO__FOO", "1"}});
              }),
              HasSubstr("config: environment FERRY_IO__FOO: unknown key 'io.foo'"));
  EXPECT_THAT(config_error([] {
                from_env({{"FERRY_IO__CHUNKBYTES", "4096"}});
              }),
              HasSubstr("config: environment FERRY_IO__CHUNKBYTES: unknown key 'io.chunkbytes'"));
  EXPECT_THAT(config_error([] {
                from_env({{"FERRY_io__direct", "true"}});
              }),
              HasSubstr("config: environment FERRY_io__direct: not a configuration variable"));
  EXPECT_THAT(config_error([] {
                from_env({{"FERRY___", "1"}});
              }),
              HasSubstr("config: environment FERRY___: unknown key '.'"));

  EXPECT_THAT(config_error([] { from_sets({"tp=2"}); }),
              HasSubstr("config: --set tp: unknown key 'tp' (did you mean 'parallel.tp'?)"));
  EXPECT_THAT(config_error([] { from_sets({"io.chunk_byte=4096"}); }),
              HasSubstr("config: --set io.chunk_byte: unknown key 'io.chunk_byte'"));
  EXPECT_THAT(config_error([] { from_sets({"io.direct.x=1"}); }),
              HasSubstr("config: --set io.direct.x: unknown key 'io.direct.x'"));
  EXPECT_THAT(config_error([] { from_sets({R"(io={"nope": 1})"}); }),
              HasSubstr("config: --set io: unknown key 'io.nope'"));

  EXPECT_THAT(config_error([] {
                ConfigBuilder b;
                b.apply_flag("--tp", "parallel.tpp", "2");
              }),
              HasSubstr("config: --tp: unknown key 'parallel.tpp'"));
}

TEST(LoadConfigTest, MalformedSourcesAreErrors) {
  testing::TempDir dir;
  std::string missing = dir.file("missing.json");
  EXPECT_THAT(config_error([&] {
                ConfigBuilder b;
                b.apply_file(missing);
              }),
              HasSubstr("config: " + missing + ": cannot open the config file"));
  testing::write_file(dir.file("bad.json"), R"({"io": )");
  std::string bad = dir.file("bad.json");
  EXPECT_THAT(config_error([&] {
                ConfigBuilder b;
                b.apply_file(bad);
              }),
              HasSubstr("config: " + bad + ": not valid JSON"));
  EXPECT_THAT(config_error([] { from_json_text("[1]"); }),
              HasSubstr("config: test.json: expected a JSON object at the top level, got [1]"));
  EXPECT_THAT(config_error([] { from_json_text(R"({"io": 5})"); }),
              HasSubstr("config: test.json: io: expected an object, got 5"));
}

TEST(LoadConfigTest, TypeAndRangeErrorsNameKeyAndSource) {
  EXPECT_EQ(config_error([] {
              from_env({{"FERRY_IO__QUEUE_DEPTH", "abc"}});
            }),
            "config: environment FERRY_IO__QUEUE_DEPTH: io.queue_depth: expected a positive "
            "integer, got \"abc\"");
  EXPECT_EQ(config_error([] { from_sets({"io.engine=aio"}); }),
            "config: --set io.engine: io.engine: expected uring or pread, got \"aio\"");
  EXPECT_EQ(from_sets({"metrics.listen=9400"}).metrics.listen, "127.0.0.1:9400");
  EXPECT_EQ(from_sets({"metrics.listen=0.0.0.0:0"}).metrics.listen, "0.0.0.0:0");
  EXPECT_THAT(config_error([] { from_sets({"metrics.listen=port80"}); }),
              HasSubstr("metrics.listen: expected PORT or ADDRESS:PORT"));
  EXPECT_THAT(config_error([] { from_sets({"metrics.listen=99999"}); }),
              HasSubstr("metrics.listen: expected PORT or ADDRESS:PORT"));
  EXPECT_THAT(config_error([] { from_sets({"metrics.prometheus_file=/tmp/m.prom"}); }),
              HasSubstr("unknown key 'metrics.prometheus_file': it was removed: "
                        "metrics.textfile"));
  EXPECT_EQ(config_error([] { from_sets({"startup.mode=parallel"}); }),
            "config: --set startup.mode: startup.mode: expected serial, overlap or auto, got "
            "\"parallel\"");
  EXPECT_THAT(config_error([] { from_sets({"io.direct=1"}); }),
              HasSubstr("io.direct: expected true or false, got 1"));
  EXPECT_THAT(config_error([] { from_json_text(R"({"model": {"path": 3}})"); }),
              HasSubstr("config: test.json: model.path: expected a string, got 3"));
  EXPECT_THAT(config_error([] { from_sets({"model.dtype=fp8"}); }),
              HasSubstr("model.dtype: expected auto, bf16, f16 or f32, got \"fp8\""));
  EXPECT_THAT(config_error([] { from_sets({"model.fuse_shared_experts=maybe"}); }),
              HasSubstr("model.fuse_shared_experts: expected auto, true or false, got \"maybe\""));
  EXPECT_THAT(config_error([] { from_sets({"model.fuse_shared_experts=1"}); }),
              HasSubstr("model.fuse_shared_experts: expected auto, true or false, got 1"));
  EXPECT_THAT(config_error([] { from_sets({"model.unaligned_tp=round"}); }),
              HasSubstr("model.unaligned_tp: expected refuse or pad, got \"round\""));
  EXPECT_EQ(from_sets({"model.fuse_shared_experts=auto"}).model.fuse_shared_experts, std::nullopt);
  EXPECT_EQ(from_sets({"model.fuse_shared_experts=false"}).model.fuse_shared_experts, false);
  EXPECT_EQ(from_sets({"model.unaligned_tp=pad"}).model.unaligned_tp, models::Unaligned::kPad);
  EXPECT_THAT(config_error([] { from_sets({"model.load_format=onnx"}); }),
              HasSubstr("model.load_format: expected auto, safetensors, mistral, pt, gguf, dummy, "
                        "presharded, sharded_state, ipc_cache or remote_instance"));
  EXPECT_THAT(config_error([] { from_sets({"parallel.tp=0"}); }),
              HasSubstr("parallel.tp: expected an integer from 1 to 4096, got 0"));
  EXPECT_THAT(config_error([] { from_sets({"parallel.tp=2.5"}); }),
              HasSubstr("parallel.tp: expected a positive integer, got 2.5"));
  EXPECT_THAT(config_error([] { from_sets({"parallel.tp=-1"}); }),
              HasSubstr("parallel.tp: expected an integer from 1 to 4096, got -1"));
  EXPECT_THAT(config_error([] { from_sets({"io.queue_depth=40000"}); }),
              HasSubstr("io.queue_depth: expected an integer from 1 to 32768"));
  EXPECT_THAT(config_error([] { from_sets({"io.staging_buffers=8"}); }),
              HasSubstr("unknown key 'io.staging_buffers': it was replaced by io.staging_bytes"));
  EXPECT_THAT(config_error([] {
                from_sets({"io.staging_bytes=1MiB", "io.chunk_bytes=2MiB"});
              }),
              HasSubstr("io.staging_bytes: must hold at least one io.chunk_bytes buffer (2097152 "
                        "bytes), got 1048576"));
  EXPECT_THAT(config_error([] { from_sets({"io.staging_bytes=lots"}); }),
              HasSubstr("io.staging_bytes"));
  EXPECT_THAT(config_error([] { from_sets({"io.read_lanes=65"}); }),
              HasSubstr("io.read_lanes: expected an integer from 0 to 64, got 65"));
  EXPECT_THAT(config_error([] { from_sets({"io.direct_to_device=yes"}); }),
              HasSubstr("io.direct_to_device: expected auto, on or off, got \"yes\""));
  EXPECT_THAT(
      config_error([] {
        from_sets({"parallel.tp=4", "parallel.ep=3"});
      }),
      HasSubstr(
          "config: --set parallel.ep: parallel.ep: expected a divisor of parallel.tp 4, got 3"));
  EXPECT_THAT(config_error([] {
                from_sets({"parallel.pp=2", "parallel.pp_rank=2"});
              }),
              HasSubstr("parallel.pp_rank: expected 0 to 1 (parallel.pp 2), got 2"));
  EXPECT_THAT(config_error([] {
                from_sets({"parallel.pp=2", "parallel.pp_partition=[1]"});
              }),
              HasSubstr("parallel.pp_partition: expected one layer count per stage"));
  EXPECT_THAT(config_error([] { from_sets({"parallel.pp_partition=4,4"}); }),
              HasSubstr("parallel.pp_partition: expected an array of layer counts"));
  // SGLang's DeepSeek deployment layouts.
  EXPECT_THAT(config_error([] {
                from_sets({"parallel.tp=4", "parallel.attn_dp=3"});
              }),
              HasSubstr("parallel.attn_dp: expected a divisor of parallel.tp 4"));
  EXPECT_THAT(config_error([] {
                from_sets({"parallel.tp=4", "parallel.dp_lm_head=true"});
              }),
              HasSubstr("parallel.dp_lm_head: splits lm_head over the attention tp group"));
  EXPECT_THAT(config_error([] { from_sets({"parallel.moe_dense_tp=2"}); }),
              HasSubstr("parallel.moe_dense_tp: expected none or 1"));
  EXPECT_THAT(config_error([] { from_sets({"parallel.moe_a2a=mooncake"}); }),
              HasSubstr("parallel.moe_a2a: expected none or deepep"));
  EXPECT_THAT(config_error([] {
                from_sets({"parallel.tp=4", "parallel.ep=2", "parallel.moe_a2a=deepep"});
              }),
              HasSubstr("parallel.moe_a2a: deepep runs experts with ep = tp"));
  {
    const LoadConfig c = from_sets({"parallel.tp=8", "parallel.ep=8", "parallel.attn_dp=4",
                                    "parallel.dp_lm_head=true", "parallel.moe_dense_tp=1",
                                    "parallel.moe_a2a=deepep"});
    EXPECT_EQ(c.parallel.attn_dp, 4);
    EXPECT_TRUE(c.parallel.dp_lm_head);
    EXPECT_EQ(c.parallel.moe_dense_tp, 1);
    EXPECT_TRUE(c.parallel.moe_a2a_deepep);
    EXPECT_EQ(from_sets({"parallel.moe_dense_tp=none"}).parallel.moe_dense_tp, 0);
  }
  EXPECT_THAT(config_error([] { from_sets({"load.sort_weight_files=-2"}); }),
              HasSubstr("load.sort_weight_files: expected an integer from -1"));
  EXPECT_THAT(config_error([] { from_sets({"host.huge_pages=maybe"}); }),
              HasSubstr("host.huge_pages"));
  EXPECT_THAT(config_error([] { from_sets({"host.bandwidth_gbps=-1"}); }),
              HasSubstr("host.bandwidth_gbps: expected a number from 0"));
  EXPECT_THAT(config_error([] { from_sets({"host.bandwidth_gbps=fast"}); }),
              HasSubstr("host.bandwidth_gbps: expected a number, got \"fast\""));
  EXPECT_THAT(config_error([] { from_sets({"io.chunk_bytes=1000"}); }),
              HasSubstr("io.chunk_bytes: expected 4096 to 1073741824 bytes, got 1000"));
  EXPECT_THAT(config_error([] { from_sets({"io.chunk_bytes=2GiB"}); }),
              HasSubstr("io.chunk_bytes: expected 4096 to 1073741824 bytes"));
  EXPECT_THAT(config_error([] { from_sets({"prefetch.block_bytes=0"}); }),
              HasSubstr("prefetch.block_bytes: expected 4096"));
  // O_DIRECT needs whole 4 KiB blocks; without it any size from 4096 up is fine.
  EXPECT_EQ(from_sets({"io.chunk_bytes=6000"}).io.chunk_bytes, 6000u);
  EXPECT_THAT(config_error([] {
                from_sets({"io.chunk_bytes=6000", "io.direct=true"});
              }),
              HasSubstr("config: --set io.chunk_bytes: io.chunk_bytes: with io.direct it must be "
                        "a multiple of 4096, got 6000"));
  EXPECT_THAT(config_error([] { from_sets({"parallel.ranks=0,x"}); }),
              HasSubstr("config: --set parallel.ranks: parallel.ranks \"0,x\": 'x' is not a rank"));
  EXPECT_THAT(config_error([] { from_sets({"parallel.ranks=[0, -1]"}); }),
              HasSubstr("parallel.ranks: expected a list of ranks"));
  // The key's source is named even when the rule involves another key.
  EXPECT_THAT(config_error([] {
                ConfigBuilder b;
                b.apply_json_text(R"({"devices": "host:2"})", "c.json");
                b.build();
              }),
              HasSubstr("config: c.json: devices host:2 gives 2 devices for 1 local rank (0)"));
}

// metrics.listen's address (hardening round two, item 8): "999.1.1.1:19125" was
// accepted, and civetweb bound 231.1.1.1 (each number taken modulo 256).
TEST(LoadConfigTest, MetricsListenAddressIsAnIpv4AnIpv6InBracketsOrAHostName) {
  EXPECT_EQ(metrics_bind_address("9400"), "127.0.0.1:9400");
  EXPECT_EQ(metrics_bind_address("255.255.255.255:1"), "255.255.255.255:1");
  EXPECT_EQ(metrics_bind_address("[::1]:9400"), "[::1]:9400");
  EXPECT_EQ(metrics_bind_address("[::]:0"), "[::]:0");
  EXPECT_EQ(metrics_bind_address("[fe80::1:2]:65535"), "[fe80::1:2]:65535");
  EXPECT_EQ(metrics_bind_address("localhost:9400"), "localhost:9400");
  EXPECT_EQ(metrics_bind_address("metrics-1.example.com:80"), "metrics-1.example.com:80");
  EXPECT_EQ(metrics_bind_address("4chan.example:80"), "4chan.example:80");  // digits lead
  for (const std::string& bad :
       std::vector<std::string>{"999.1.1.1:19125", "256.0.0.1:1",  "1.2.3:80",
                                "1.2.3.4.5:80",    "01.2.3.4:80",  "[::1:9400",
                                "[::1]9400",       "[1.2.3.4]:80", "[:::]:80",
                                "::1:9400",        "[::1]:",       "-host:80",
                                "host-:80",        "ho_st:80",     "a..b:80",
                                ".host:80",        "host.:80",     std::string(64, 'a') + ":80",
                                "h st:80",         "[::1]:99999",  "1.2.3.4:-1"}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(config_error([&] { metrics_bind_address(bad); }),
                HasSubstr("expected PORT or ADDRESS:PORT"));
    EXPECT_THAT(config_error([&] { from_sets({"metrics.listen=" + bad}); }),
                HasSubstr("--set metrics.listen: metrics.listen: "));
  }
  EXPECT_THAT(config_error([] { from_sets({"metrics.listen=999.1.1.1:19125"}); }),
              HasSubstr("the address \"999.1.1.1\" is neither an IPv4 address"));
  EXPECT_THAT(config_error([] { from_sets({"metrics.listen=[::g]:1"}); }),
              HasSubstr("the address \"[::g]\" is not an IPv6 address"));
  EXPECT_THAT(config_error([] { from_sets({"metrics.listen=::1:9400"}); }),
              HasSubstr("an IPv6 address goes in brackets"));
  // 253 characters is the longest name; a label of 63 the longest label.
  const std::string label(63, 'a');
  const std::string longest = label + "." + label + "." + label + "." + std::string(61, 'b');
  ASSERT_EQ(longest.size(), 253u);
  EXPECT_EQ(metrics_bind_address(longest + ":1"), longest + ":1");
  EXPECT_THAT(config_error([&] { metrics_bind_address(longest + "a:1"); }),
              HasSubstr("neither an IPv4 address"));
}

TEST(LoadConfigTest, Sizes) {
  using nlohmann::json;
  EXPECT_EQ(parse_size(4096), 4096u);
  EXPECT_EQ(parse_size(json(0)), 0u);
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("4KiB"), 4096u);
  EXPECT_EQ(parse_size("4 MiB"), std::uint64_t{4} << 20);
  EXPECT_EQ(parse_size(" 2GiB "), std::uint64_t{2} << 30);
  EXPECT_EQ(parse_size("1GB"), 1000000000u);
  EXPECT_EQ(parse_size("3KB"), 3000u);
  EXPECT_EQ(parse_size("5MB"), 5000000u);
  EXPECT_EQ(parse_size("12B"), 12u);
  EXPECT_EQ(parse_size("1.5GiB"), std::uint64_t{3} << 29);
  EXPECT_EQ(parse_size("1.50KiB"), 1536u);
  EXPECT_EQ(parse_size("2.0"), 2u);
  EXPECT_EQ(parse_size("17179869183GiB"), std::uint64_t{17179869183} << 30);  // 2^64 - 1 GiB
  EXPECT_EQ(parse_size(json(std::int64_t{5})), 5u);  // a signed JSON integer, as to_json makes
  EXPECT_EQ(parse_size(json(std::uint64_t{18446744073709551615u})), 18446744073709551615u);

  auto size_error = [](const json& v) { return config_error([&] { parse_size(v); }); };
  EXPECT_THAT(size_error("4XB"), HasSubstr("expected a size"));
  EXPECT_THAT(size_error("4XB"), HasSubstr("got \"4XB\""));
  EXPECT_THAT(size_error("4mib"), HasSubstr("expected a size"));
  EXPECT_THAT(size_error("-1"), HasSubstr("expected a size"));
  EXPECT_THAT(size_error(-1), HasSubstr("expected a non-negative size, got -1"));
  EXPECT_THAT(size_error("1.5"), HasSubstr("\"1.5\" is not a whole number of bytes"));
  EXPECT_THAT(size_error("1.1KiB"), HasSubstr("is not a whole number of bytes"));
  EXPECT_THAT(size_error("abc"), HasSubstr("expected a size"));
  EXPECT_THAT(size_error(""), HasSubstr("expected a size"));
  EXPECT_THAT(size_error("MiB"), HasSubstr("expected a size"));
  EXPECT_THAT(size_error(".5GiB"), HasSubstr("expected a size"));
  EXPECT_THAT(size_error("4.GiB"), HasSubstr("expected a size"));
  EXPECT_THAT(size_error("4 Mi B"), HasSubstr("expected a size"));
  EXPECT_EQ(parse_size(json::parse("1e9")), 1000000000u);  // a JSON float, but whole bytes
  EXPECT_THAT(size_error(1.5), HasSubstr("1.5 is not a whole number of bytes"));
  EXPECT_THAT(size_error(-2.0), HasSubstr("expected a non-negative size"));
  EXPECT_THAT(size_error(1e20), HasSubstr("is too large"));
  EXPECT_THAT(size_error(true), HasSubstr("expected a size"));
  EXPECT_THAT(size_error("100000000000GiB"), HasSubstr("is too large"));
  EXPECT_THAT(size_error("18446744073709551616"), HasSubstr("is too large"));
  EXPECT_THAT(size_error("17179869184GiB"), HasSubstr("is too large"));  // exactly 2^64
}

TEST(LoadConfigTest, ParseRanks) {
  EXPECT_EQ(parse_ranks("", 3), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(parse_ranks("  ", 1), (std::vector<int>{0}));
  EXPECT_EQ(parse_ranks("0,2", 4), (std::vector<int>{0, 2}));
  EXPECT_EQ(parse_ranks("0-3", 4), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(parse_ranks("1-2,5", 8), (std::vector<int>{1, 2, 5}));
  EXPECT_EQ(parse_ranks(" 3 , 0 - 1 ", 4), (std::vector<int>{3, 0, 1}));
  EXPECT_EQ(parse_ranks("2-2", 4), (std::vector<int>{2}));

  auto rank_error = [](std::string_view text, int tp) {
    return config_error([&] { parse_ranks(text, tp); });
  };
  EXPECT_EQ(rank_error("0,4", 4),
            "config: parallel.ranks \"0,4\": rank 4 is out of range for parallel.tp 4 (0..3)");
  EXPECT_THAT(rank_error("0-7", 4), HasSubstr("\"0-7\": rank 7 is out of range"));
  EXPECT_THAT(rank_error("0-2000000000", 4), HasSubstr("rank 2000000000 is out of range"));
  EXPECT_THAT(rank_error("0,0", 4), HasSubstr("\"0,0\": rank 0 is listed twice"));
  EXPECT_THAT(rank_error("0-2,1", 4), HasSubstr("rank 1 is listed twice"));
  EXPECT_THAT(rank_error("0,,1", 4), HasSubstr("\"0,,1\": empty item"));
  EXPECT_THAT(rank_error("0,", 4), HasSubstr("empty item"));
  EXPECT_THAT(rank_error("3-1", 4), HasSubstr("\"3-1\": reversed range 3-1"));
  EXPECT_THAT(rank_error("a", 4), HasSubstr("'a' is not a rank or a range"));
  EXPECT_THAT(rank_error("-1", 4), HasSubstr("'-1' is not a rank or a range"));
  EXPECT_THAT(rank_error("1-", 4), HasSubstr("'1-' is not a rank or a range"));
  EXPECT_THAT(rank_error("1.5", 4), HasSubstr("'1.5' is not a rank or a range"));
  EXPECT_THAT(rank_error("99999999999", 4), HasSubstr("is not a rank or a range"));
  EXPECT_THAT(rank_error("", 0), HasSubstr("parallel.tp must be at least 1"));
}

TEST(LoadConfigTest, ResolveDevices) {
  const std::vector<int> two = {0, 1};
  const std::vector<int> one = {3};
  DeviceSpec d = resolve_devices("", two);
  EXPECT_EQ(d.kind, DeviceSpec::Kind::kHost);
  EXPECT_EQ(d.ids, (std::vector<int>{0, 1}));
  EXPECT_EQ(resolve_devices("host", two), d);
  EXPECT_EQ(resolve_devices("host:2", two), d);
  EXPECT_EQ(resolve_devices(" host:1 ", one).ids, std::vector<int>{0});
  d = resolve_devices("cuda:0,2", two);
  EXPECT_EQ(d.kind, DeviceSpec::Kind::kCuda);
  EXPECT_EQ(d.ids, (std::vector<int>{0, 2}));
  EXPECT_EQ(resolve_devices("cuda:4-5", two).ids, (std::vector<int>{4, 5}));
  EXPECT_EQ(resolve_devices("cuda:5", one).ids, std::vector<int>{5});
  EXPECT_EQ(to_string(resolve_devices("cuda:2,0", two)), "cuda:2,0");
  EXPECT_EQ(to_string(resolve_devices("", two)), "host:2");

  auto device_error = [](std::string_view spec, const std::vector<int>& ranks) {
    return config_error([&] { resolve_devices(spec, ranks); });
  };
  EXPECT_EQ(device_error("host:4", two),
            "config: devices host:4 gives 4 devices for 2 local ranks (0,1)");
  EXPECT_EQ(device_error("cuda:0", two),
            "config: devices cuda:0 gives 1 device for 2 local ranks (0,1)");
  EXPECT_THAT(device_error("cuda:0-2", two), HasSubstr("gives 3 devices for 2 local ranks"));
  EXPECT_THAT(device_error("cuda:1,1", two), HasSubstr("\"cuda:1,1\": device 1 is listed twice"));
  EXPECT_THAT(device_error("cuda:", two), HasSubstr("\"cuda:\": empty item"));
  EXPECT_THAT(device_error("cuda", two), HasSubstr("name one CUDA device per local rank"));
  EXPECT_THAT(device_error("cuda:x", two), HasSubstr("'x' is not a device or a range"));
  EXPECT_THAT(device_error("cuda:5000", one), HasSubstr("is not a CUDA device ordinal"));
  EXPECT_THAT(device_error("host:0", two), HasSubstr("\"host:0\": expected host:N"));
  EXPECT_THAT(device_error("host:two", two), HasSubstr("expected host:N"));
  EXPECT_THAT(device_error("gpu:0", two),
              HasSubstr("devices \"gpu:0\": expected host, host:N, null, null:N or cuda:<ids>"));
  EXPECT_THAT(device_error("HOST:2", two),
              HasSubstr("expected host, host:N, null, null:N or cuda:<ids>"));
  EXPECT_THAT(device_error("", {}), HasSubstr("no local ranks"));

  // Through the builder: ranks decide how many devices are needed.
  EXPECT_THAT(config_error([] {
                from_sets({"parallel.tp=4", "devices=cuda:0,1"});
              }),
              HasSubstr("config: --set devices: devices cuda:0,1 gives 2 devices for 4 local "
                        "ranks (0,1,2,3)"));
  EXPECT_EQ(from_sets({"parallel.tp=4", "parallel.ranks=2-3", "devices=cuda:0,1"}).devices.ids,
            (std::vector<int>{0, 1}));
}

LoadConfig every_field_changed() {
  LoadConfig c;
  c.model.path = "/models/a b";
  c.model.load_format = io::LoadFormat::kSafetensors;
  c.model.dtype = DType::kF16;
  c.model.draft = true;
  c.model.switch_w13 = true;
  c.model.eplb_map = "/maps/eplb.json";
  c.model.fuse_shared_experts = true;
  c.model.pad_moe_intermediate_to = 128;
  c.model.unaligned_tp = models::Unaligned::kPad;
  c.parallel.tp = 4;
  c.parallel.ep = 4;  // = tp, as moe_a2a deepep needs
  c.parallel.pp = 2;
  c.parallel.pp_rank = 1;
  c.parallel.pp_partition = {10, 12};
  c.parallel.ranks = {3, 1};
  c.parallel.attn_dp = 2;
  c.parallel.dp_lm_head = true;
  c.parallel.moe_dense_tp = 1;
  c.parallel.moe_a2a_deepep = true;
  c.devices = DeviceSpec{DeviceSpec::Kind::kCuda, {2, 0}};
  c.io.engine = io::Engine::kPread;
  c.io.queue_depth = 64;
  c.io.chunk_bytes = std::size_t{8} << 20;
  c.io.chunk_bytes_auto = false;
  c.io.staging_bytes = std::size_t{24} << 20;
  c.io.read_lanes = 3;
  c.io.direct_to_device = io::DirectToDevice::kOff;
  c.io.direct = true;
  c.io.drop_cache = true;
  c.prefetch.threads = 7;
  c.prefetch.block_bytes = std::size_t{2} << 20;
  c.prefetch.ahead_bytes = 0;
  c.load.strict = true;
  c.load.sort_weight_files = 2;
  c.load.report = "/tmp/report.json";
  c.load.dump_dir = "/tmp/dump";
  c.host.bandwidth_gbps = 12.3;
  c.host.deferred_copies = true;
  c.host.huge_pages = true;
  c.host.narrow_row_bytes = 65536;
  c.io.cancel_timeout_ms = 250;
  c.io.max_metadata_bytes = std::uint64_t{1} << 20;
  c.metrics.listen = "0.0.0.0:9400";
  c.metrics.textfile = "/tmp/metrics.prom";
  c.trace.path = "/tmp/trace.json";
  c.startup.mode = StartupMode::kAuto;
  c.model.dummy_seed = 99;
  c.quantization.requant = models::QuantScheme::Requant::kUe8m0;
  c.quantization.online = QuantizationConfig::Online::kChannel;
  c.postprocess.target = models::QuantScheme::Target::kSm100;
  c.load.layered = true;
  c.load.save_presharded = "/cache/presharded";
  c.load.save_sharded_state = "/cache/sharded_state";
  c.save.max_file_bytes = std::uint64_t{1} << 30;
  c.gguf.dequantize = false;
  c.update.rollback_bytes = 0;
  c.update.rollback = UpdateConfig::Rollback::kSnapshot;
  c.update.tensor_dir = "/tmp/updates";
  c.cache.mode = CacheConfig::Mode::kClient;
  c.cache.fallback_format = io::LoadFormat::kSafetensors;  // model.load_format's
  c.cache.dir = "/run/user/1000/ferry";
  c.cache.watch_ms = 250;
  c.cache.timeout_ms = 1000;
  c.remote.listen = "10.0.0.5:7400";
  c.remote.seed = "[fd00::5]:7401";
  c.remote.token_file = "/etc/ferry/fleet.token";
  c.remote.inflight_bytes = std::uint64_t{64} << 20;
  c.remote.timeout_ms = 2000;
  c.remote.fallback_format = io::LoadFormat::kSafetensors;
  c.remote.transports = "rc,tcp";
  return c;
}

// prefetch.enabled with io.direct is refused (a check across keys), so the one field
// every_field_changed() leaves at its default is changed here, with io.direct back.
LoadConfig the_fields_it_could_not() {
  LoadConfig c = every_field_changed();
  c.io.direct = false;
  c.prefetch.enabled = true;
  // load.verify_checksums needs the presharded format.
  c.model.load_format = io::LoadFormat::kPresharded;
  c.cache.fallback_format = io::LoadFormat::kPresharded;
  c.load.verify_checksums = true;
  return c;
}

TEST(LoadConfigTest, ToJsonRoundTrip) {
  for (const LoadConfig& original :
       {LoadConfig{}, every_field_changed(), the_fields_it_could_not()}) {
    nlohmann::json j = to_json(original);
    ConfigBuilder b;
    b.apply_json(j, "report");
    EXPECT_EQ(b.build(), original) << j.dump();
    // Through text as well, as a report file would be read back.
    EXPECT_EQ(from_json_text(j.dump(2)), original) << j.dump();
  }
  nlohmann::json j = to_json(every_field_changed());
  EXPECT_EQ(j["devices"], "cuda:2,0");
  EXPECT_EQ(j["parallel"]["ranks"], nlohmann::json({3, 1}));
  EXPECT_EQ(j["model"]["dtype"], "f16");
  EXPECT_EQ(j["io"]["chunk_bytes"], 8u << 20);
  EXPECT_EQ(to_json(LoadConfig{})["model"]["dtype"], "auto");
  EXPECT_EQ(to_json(LoadConfig{})["model"]["fuse_shared_experts"], "auto");
  EXPECT_EQ(j["model"]["fuse_shared_experts"], true);
  EXPECT_EQ(j["model"]["unaligned_tp"], "pad");

  // Every field differs from its default in every_field_changed() or in
  // the_fields_it_could_not(), so the round trips above read each key; a key to_json
  // writes but build() ignored would show here.
  nlohmann::json defaults = to_json(LoadConfig{});
  const nlohmann::json other = to_json(the_fields_it_could_not());
  for (const auto& [section, value] : defaults.items()) {
    if (value.is_object()) {
      for (const auto& [key, unused] : value.items()) {
        EXPECT_TRUE(j[section][key] != value[key] || other[section][key] != value[key])
            << section << "." << key;
      }
    } else {
      EXPECT_NE(j[section], value) << section;
    }
  }
}

TEST(LoadConfigTest, EveryReportedKeyCanBeSetFromEverySource) {
  for (const LoadConfig& expected : {every_field_changed(), the_fields_it_could_not()}) {
    nlohmann::json j = to_json(expected);
    // Each key alone, on top of the rest from a file, via --set, the environment and a
    // flag.
    for (const auto& [section, value] : j.items()) {
      std::vector<std::pair<std::string, nlohmann::json>> keys;
      if (value.is_object()) {
        for (const auto& [key, v] : value.items()) {
          keys.emplace_back(section + "." + key, v);
        }
      } else {
        keys.emplace_back(section, value);
      }
      for (const auto& [key, v] : keys) {
        nlohmann::json rest = j;
        std::string env_name = "FERRY_";
        if (auto dot = key.find('.'); dot != std::string::npos) {
          rest[section].erase(key.substr(dot + 1));
          env_name += key.substr(0, dot) + "__" + key.substr(dot + 1);
        } else {
          rest.erase(key);
          env_name += key;
        }
        for (char& ch : env_name) {
          ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
        }
        ConfigBuilder by_set;
        by_set.apply_json(rest, "rest");
        by_set.apply_set(key + "=" + v.dump());
        EXPECT_EQ(by_set.build(), expected) << key;
        ConfigBuilder by_env;
        by_env.apply_json(rest, "rest");
        by_env.apply_env(Env{{env_name, v.dump()}});
        EXPECT_EQ(by_env.build(), expected) << env_name;
        ConfigBuilder by_flag;
        by_flag.apply_json(rest, "rest");
        by_flag.apply_flag("--flag", key, v.dump());
        EXPECT_EQ(by_flag.build(), expected) << key;
      }
    }
  }
}

// ---- found by fuzzing (fuzz/, docs/FUZZING.md) ------------------------------

// fuzz_config: a config file holding a number beyond a double made nlohmann throw
// out_of_range out of apply_json_text, another exception than ferry::Error. The
// file's text as the fuzzer found it.
TEST(FuzzFindings, ConfigNumberPastADoubleIsAConfigError) {
  ConfigBuilder b;
  try {
    b.apply_json_text("3.279E088887\xed", "c.json");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kConfig);
    EXPECT_EQ(e.file(), "c.json");
    EXPECT_THAT(e.rule(), HasSubstr("not valid JSON"));
  }
}

// fuzz_config: a --set value that is not UTF-8 was taken as it was; nlohmann throws
// type_error when it writes such a string (to_json(config).dump(), and the errors
// that quote a refused value with dump()). Text from the environment and the
// command line must be UTF-8, as a JSON file's strings are. The fuzzer's --set.
TEST(FuzzFindings, TextValuesMustBeUtf8) {
  ConfigBuilder b;
  b.apply_set("metrics.listen=127.0.0.1:9400");
  try {
    b.apply_set("trace.path=/tmp/t." + std::string(41, '\xff') + "json");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kConfig);
    EXPECT_EQ(e.file(), "--set trace.path");
    EXPECT_THAT(e.rule(), HasSubstr("not valid UTF-8"));
  }
  EXPECT_THROW(ConfigBuilder().apply_env(Env{{"FERRY_IO__QUEUE_DEPTH", "\xff"}}), Error);
  EXPECT_THROW(ConfigBuilder().apply_flag("--model", "model.path", "/m/\xc3"), Error);
  // Overlong, a surrogate, past U+10FFFF, cut short.
  for (const char* bad : {"\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82"}) {
    EXPECT_THROW(ConfigBuilder().apply_set(std::string("trace.path=") + bad), Error) << bad;
  }
  ConfigBuilder ok;
  ok.apply_set("trace.path=/tmp/\xc3\xa9t\xc3\xa9-\xf0\x9f\x9a\xa2.json");
  EXPECT_EQ(ok.build().trace.path, "/tmp/\xc3\xa9t\xc3\xa9-\xf0\x9f\x9a\xa2.json");
}

}  // namespace
}  // namespace ferry::runtime
