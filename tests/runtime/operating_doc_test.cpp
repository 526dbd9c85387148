// docs/OPERATING.md lists every configuration key with its default: the table must
// name exactly the keys of the key table (runtime/config_keys.hpp), each once, in the
// table's order, with the default its row writes (to_json's), and every metric family
// ferry registers.
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/config_keys.hpp"
#include "runtime/load_config.hpp"
#include "runtime/metrics.hpp"

namespace ferry::runtime {
namespace {

std::string doc() {
  std::ifstream in(std::string(FERRY_SOURCE_DIR) + "/docs/OPERATING.md");
  EXPECT_TRUE(in) << "docs/OPERATING.md";
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Rows "| `key` | `default` | ..." -> key -> default text; `order` gets the keys in
// the order of the rows.
std::map<std::string, std::string> documented_keys(const std::string& text,
                                                   std::vector<std::string>* order = nullptr) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("| `", 0) != 0) {
      continue;
    }
    const std::size_t key_end = line.find('`', 3);
    const std::size_t def_begin = line.find("| `", key_end);
    if (key_end == std::string::npos || def_begin == std::string::npos) {
      continue;
    }
    const std::size_t def_end = line.find("` |", def_begin + 3);
    if (def_end == std::string::npos) {
      continue;
    }
    const std::string key = line.substr(3, key_end - 3);
    EXPECT_FALSE(out.count(key)) << "documented twice: " << key;
    out[key] = line.substr(def_begin + 3, def_end - def_begin - 3);
    if (order != nullptr && key.rfind("ferry_", 0) != 0) {
      order->push_back(key);
    }
  }
  return out;
}

TEST(OperatingDoc, EveryConfigKeyIsDocumentedOnceWithItsDefault) {
  std::map<std::string, std::string> documented = documented_keys(doc());
  std::set<std::string> code;
  const nlohmann::json defaults = to_json(LoadConfig{});  // outlives the loop
  for (const auto& [section, value] : defaults.items()) {
    if (value.is_object()) {
      for (const auto& [key, v] : value.items()) {
        const std::string name = section + "." + key;
        code.insert(name);
        ASSERT_TRUE(documented.count(name)) << "not in docs/OPERATING.md: " << name;
        EXPECT_EQ(documented[name], v.dump()) << name;
      }
    } else {
      code.insert(section);
      ASSERT_TRUE(documented.count(section)) << "not in docs/OPERATING.md: " << section;
      EXPECT_EQ(documented[section], value.dump()) << section;
    }
  }
  for (const auto& [key, unused] : documented) {
    if (key.rfind("ferry_", 0) != 0) {  // the metrics table shares the row shape
      EXPECT_TRUE(code.count(key)) << "documented but not a key: " << key;
    }
  }
}

TEST(OperatingDoc, TheKeyTableFollowsTheTableOfKeysRowByRow) {
  std::vector<std::string> order;
  std::map<std::string, std::string> documented = documented_keys(doc(), &order);
  std::vector<std::string> rows;
  for (const ConfigKey& key : config_keys()) {
    rows.emplace_back(key.name);
    EXPECT_EQ(documented[std::string(key.name)], key.default_value().dump()) << key.name;
  }
  EXPECT_EQ(order, rows);  // the same keys in the same order: neither can drift
}

TEST(OperatingDoc, EveryMetricFamilyIsDocumented) {
  const std::string text = doc();
  auto registry = std::make_shared<prometheus::Registry>();
  LoadMetrics metrics(registry);
  std::size_t families = 0;
  for (const auto& family : registry->Collect()) {
    ++families;
    EXPECT_NE(text.find("| `" + family.name), std::string::npos)
        << "not in docs/OPERATING.md: " << family.name;
  }
  EXPECT_GE(families, 3u);  // the ones present before a load: gauges and error counts
  for (const char* name :
       {"ferry_load_seconds", "ferry_load_phase_seconds", "ferry_bytes_read_total",
        "ferry_bytes_skipped_total", "ferry_bytes_copied_total", "ferry_tensors_total",
        "ferry_load_throughput_bytes_per_second", "ferry_read_seconds", "ferry_copy_seconds",
        "ferry_prefetch_bytes_total"}) {
    EXPECT_NE(text.find(std::string("| `") + name), std::string::npos) << name;
  }
}

}  // namespace
}  // namespace ferry::runtime
