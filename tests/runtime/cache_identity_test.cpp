// The weight cache's fingerprint (runtime/cache_identity.cpp): what decides the
// bytes is in it and what does not is not; every section of the key table is
// classified, so a new section has to be placed before it builds green.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "io/gguf_types.hpp"
#include "runtime/cache.hpp"
#include "runtime/config_keys.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Sets;
using testing::TempDir;

CacheIdentity identity(const std::string& dir, const Sets& sets) {
  return cache_identity(disk_config(testing::make_config(dir, sets)));
}

TEST(CacheFingerprint, EverySectionIsClassified) {
  // Sections that cannot change a parameter's bytes: where they come from and how
  // (io, prefetch, devices, host emulation), what is written beside (load, save,
  // metrics, trace), when (startup), updates, the cache itself, and the seed a
  // remote_instance load pulls from (its bytes are the layout's).
  const std::set<std::string> not_bytes = {"",        "io",     "prefetch", "load",
                                           "save",    "host",   "metrics",  "trace",
                                           "startup", "update", "cache",    "remote"};
  std::set<std::string> in(std::begin(kFingerprintSections), std::end(kFingerprintSections));
  for (const ConfigKey& key : config_keys()) {
    const std::string section(key.section());
    EXPECT_TRUE(in.count(section) + not_bytes.count(section) == 1)
        << key.name << ": place its section in kFingerprintSections or here";
  }
  for (const char* excluded : kFingerprintExcluded) {
    EXPECT_NE(find_config_key(excluded), nullptr) << excluded;
  }
}

TEST(CacheFingerprint, WhatDecidesTheBytesAndWhatDoesNot) {
  TempDir dir;
  const std::string ck = testing::synth_checkpoint(dir.file("ck"), "llama").dir;
  const Sets base = {"parallel.tp=2"};
  const CacheIdentity a = identity(ck, base);
  EXPECT_EQ(a.fingerprint.size(), 64U);
  EXPECT_EQ(a.model, std::filesystem::canonical(ck).string());
  // Not in it: the ranks a process holds (data-parallel replicas share), devices,
  // I/O, the cache's own keys.
  for (const Sets& same : std::vector<Sets>{{"parallel.ranks=[1]"},
                                            {"devices=host:2"},
                                            {"io.engine=pread"},
                                            {"io.chunk_bytes=4194304"},
                                            {"cache.mode=client", "cache.dir=/x"},
                                            {"load.strict=true"},
                                            {"host.deferred_copies=true"}}) {
    EXPECT_EQ(identity(ck, testing::with(base, same)).fingerprint, a.fingerprint) << same[0];
  }
  // In it: the layout, dtype, quantization, model options, post-processing target.
  for (const Sets& other : std::vector<Sets>{{"parallel.tp=4"},
                                             {"model.dtype=f32"},
                                             {"parallel.pp=2"},
                                             {"model.switch_w13=true"},
                                             {"quantization.online=fp8_channel"},
                                             {"postprocess.target=sm90"},
                                             {"model.pad_moe_intermediate_to=512"}}) {
    const CacheIdentity b = identity(ck, testing::with(base, other));
    EXPECT_NE(b.fingerprint, a.fingerprint) << other[0];
    const std::vector<std::string> diff = identity_differences(a.identity, b.identity);
    ASSERT_FALSE(diff.empty()) << other[0];
  }
  EXPECT_NE(identity_differences(a.identity, identity(ck, {"parallel.tp=4"}).identity)[0].find(
                "parallel.tp: the daemon's 2, this load's 4"),
            std::string::npos);
  // The files: a weight file touched, a weight file added, config.json changed.
  const std::string shard = ck + "/model-00001-of-00004.safetensors";
  std::filesystem::last_write_time(
      shard, std::filesystem::last_write_time(shard) + std::chrono::seconds(3));
  const CacheIdentity touched = identity(ck, base);
  EXPECT_NE(touched.fingerprint, a.fingerprint);
  EXPECT_NE(identity_differences(a.identity, touched.identity)[0].find("files["),
            std::string::npos);
  testing::write_file(ck + "/extra.safetensors", "x");
  EXPECT_NE(identity(ck, base).fingerprint, touched.fingerprint);
  std::filesystem::remove(ck + "/extra.safetensors");
  EXPECT_EQ(identity(ck, base).fingerprint, touched.fingerprint);  // the same files again
  testing::write_file(ck + "/README.md", "not a weight file");
  EXPECT_EQ(identity(ck, base).fingerprint, touched.fingerprint);
  nlohmann::json config = nlohmann::json::parse(testing::read_file(ck + "/config.json"));
  config["rms_norm_eps"] = 1e-3;
  testing::write_file(ck + "/config.json", config.dump());
  EXPECT_NE(identity(ck, base).fingerprint, touched.fingerprint);
}

// A GGUF without config.json: the identity reads the config from the file's metadata
// and stamps the .gguf; gguf.dequantize is in it.
TEST(CacheFingerprint, AGgufFileIsStampedAndItsConfigIsItsMetadata) {
  TempDir dir;
  synth::SynthOptions o;
  o.family = "llama";
  o.preset = "tiny";
  o.out = dir.file("gguf");
  o.fsync = false;
  o.format = synth::SynthFormat::kGguf;
  o.gguf_type = io::GgmlType::kBF16;  // gguf.dequantize=false loads it too
  synth::synthesize(o);
  const std::string file = o.out + "/model.gguf";
  ASSERT_FALSE(std::filesystem::exists(o.out + "/config.json"));
  for (const std::string& path : {o.out, file}) {
    const CacheIdentity a = identity(path, {"parallel.tp=2"});
    EXPECT_EQ(a.hf_config["hidden_size"], 128) << a.hf_config;
    EXPECT_NE(a.identity.dump().find("model.gguf"), std::string::npos) << a.identity;
    EXPECT_NE(identity(path, {"parallel.tp=2", "gguf.dequantize=false"}).fingerprint,
              a.fingerprint);
  }
  const CacheIdentity before = identity(o.out, {});
  std::filesystem::last_write_time(
      file, std::filesystem::last_write_time(file) + std::chrono::seconds(3));
  EXPECT_NE(identity(o.out, {}).fingerprint, before.fingerprint);
}

}  // namespace
}  // namespace ferry::runtime
