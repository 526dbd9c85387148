// The config builder (runtime::ConfigBuilder), fed all three of its text sources
// at once: a config file's JSON text, environment variables and `--set` strings,
// applied in the CLI's order (file < environment < --set), then build().
//
// Input (FuzzedDataProvider): from the end, the count of environment variables and
// of --set strings (0-6 each), then per variable whether its name gets the FERRY_
// prefix; from the front, the JSON text, then each variable's name and value, then
// each --set string (ConsumeRandomLengthString: a backslash and another byte end
// one, "\\" is a backslash).
//
// Asserted, for every config that builds:
//  - the effective configuration round-trips (as load_config.hpp promises):
//    to_json(config), applied to an empty builder as a JSON object and again as
//    JSON text, builds an equal LoadConfig, and to_json names the same keys as
//    to_json(LoadConfig{});
//  - build() is a pure function of the layers (twice, the same config);
//  - the values keep their documented ranges: tp, ep, pp >= 1, ep divides tp,
//    pp_rank < pp, pp_partition empty or pp entries, ranks unique and in [0, tp),
//    one device per rank, distinct device ids, chunk_bytes > 0.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "fuzz/fuzz_check.hpp"
#include "runtime/load_config.hpp"

namespace {

using ferry::runtime::ConfigBuilder;
using ferry::runtime::LoadConfig;
using nlohmann::json;

std::set<std::string> leaf_keys(const json& j, const std::string& prefix = "") {
  std::set<std::string> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object()) {
      for (const std::string& k : leaf_keys(*it, key)) {
        out.insert(k);
      }
    } else {
      out.insert(key);
    }
  }
  return out;
}

void check_ranges(const LoadConfig& c) {
  const auto& p = c.parallel;
  FUZZ_CHECK(p.tp >= 1 && p.ep >= 1 && p.pp >= 1);
  FUZZ_CHECK(p.tp % p.ep == 0, "ep does not divide tp");
  FUZZ_CHECK(p.pp_rank >= 0 && p.pp_rank < p.pp);
  FUZZ_CHECK(p.pp_partition.empty() || p.pp_partition.size() == static_cast<std::size_t>(p.pp));
  FUZZ_CHECK(!p.ranks.empty());
  std::set<int> ranks;
  for (int r : p.ranks) {
    FUZZ_CHECK(r >= 0 && r < p.tp, "a rank outside [0, tp)");
    FUZZ_CHECK(ranks.insert(r).second, "a duplicate rank");
  }
  FUZZ_CHECK(c.devices.ids.size() == p.ranks.size(), "not one device per rank");
  FUZZ_CHECK(
      std::set<int>(c.devices.ids.begin(), c.devices.ids.end()).size() == c.devices.ids.size(),
      "a duplicate device");
  FUZZ_CHECK(c.io.chunk_bytes > 0);
}

// How many inputs build, printed at exit when FERRY_FUZZ_STATS is set.
std::uint64_t g_built = 0;
std::uint64_t g_refused = 0;

void print_stats() {
  std::fprintf(stderr, "fuzz_config: %llu configs refused, %llu built and checked\n",
               static_cast<unsigned long long>(g_refused),
               static_cast<unsigned long long>(g_built));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ferry::log::set_level(ferry::log::Level::kError);  // keep the run's output short
  if (std::getenv("FERRY_FUZZ_STATS") != nullptr) {
    std::atexit(print_stats);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int env_count = in.ConsumeIntegralInRange(0, 6);
  const int set_count = in.ConsumeIntegralInRange(0, 6);
  const std::string file_text = in.ConsumeRandomLengthString(4096);
  std::map<std::string, std::string> env;
  for (int i = 0; i < env_count; ++i) {
    const bool prefixed = in.ConsumeBool();
    std::string name = (prefixed ? "FERRY_" : "") + in.ConsumeRandomLengthString(64);
    env[std::move(name)] = in.ConsumeRandomLengthString(256);
  }
  std::vector<std::string> sets;
  for (int i = 0; i < set_count; ++i) {
    sets.push_back(in.ConsumeRandomLengthString(256));
  }

  ConfigBuilder builder;
  LoadConfig config;
  try {
    builder.apply_json_text(file_text, "fuzz.json");
    builder.apply_env(env);
    for (const std::string& s : sets) {
      builder.apply_set(s);
    }
    config = builder.build();
  } catch (const ferry::Error&) {
    ++g_refused;
    return 0;
  }
  ++g_built;
  FUZZ_CHECK(builder.build() == config, "build() is not deterministic");
  check_ranges(config);

  const json effective = ferry::runtime::to_json(config);
  FUZZ_CHECK(leaf_keys(effective) == leaf_keys(ferry::runtime::to_json(LoadConfig{})),
             "to_json's keys changed: " + effective.dump());
  try {
    ConfigBuilder again;
    again.apply_json(effective, "round trip");
    FUZZ_CHECK(again.build() == config, "to_json does not round-trip: " + effective.dump());
    ConfigBuilder text;
    text.apply_json_text(effective.dump(), "round trip text");
    FUZZ_CHECK(text.build() == config, "to_json's text does not round-trip: " + effective.dump());
  } catch (const ferry::Error& e) {
    FUZZ_CHECK(false, std::string("the effective config is refused: ") + e.what() + "\n  " +
                          effective.dump());
  }
  return 0;
}
