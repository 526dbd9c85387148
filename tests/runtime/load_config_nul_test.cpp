// A NUL inside a string value of the configuration (hardening round two, item 9):
// refused for every string key, naming the key, wherever the value came from (a
// config file's "\u0000", a --set or a Python dict's text). Before, a report path
// "rep.json\u0000.evil" wrote rep.json and a model.path with a NUL gave a message
// cut at the NUL.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "runtime/load_config.hpp"

namespace ferry::runtime {
namespace {

// The keys whose default value is a string, as "model.path" (every path key is one,
// and so are the "auto" sizes).
std::vector<std::string> string_keys() {
  std::vector<std::string> keys;
  const nlohmann::json flat = to_json(LoadConfig{}).flatten();  // outlives the loop
  for (const auto& [pointer, value] : flat.items()) {
    if (value.is_string()) {
      std::string key = pointer.substr(1);
      for (char& c : key) {
        c = c == '/' ? '.' : c;
      }
      keys.push_back(key);
    }
  }
  return keys;
}

TEST(LoadConfigNul, ANulInAnyStringKeyOfAConfigFileIsRefusedNamingTheKey) {
  const std::vector<std::string> keys = string_keys();
  for (const char* path_key : {"model.path", "model.eplb_map", "load.report", "load.dump_dir",
                               "metrics.textfile", "trace.path"}) {
    EXPECT_NE(std::find(keys.begin(), keys.end(), path_key), keys.end()) << path_key;
  }
  for (const std::string& key : keys) {
    SCOPED_TRACE(key);
    std::string pointer = "/" + key;
    for (char& c : pointer) {
      c = c == '.' ? '/' : c;
    }
    nlohmann::json flat;
    flat[pointer] = std::string("rep.json") + '\0' + ".evil";
    const std::string text = flat.unflatten().dump();
    ASSERT_NE(text.find("\\u0000"), std::string::npos) << text;
    try {
      ConfigBuilder b;
      b.apply_json_text(text, "config.json");
      b.build();
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kConfig);
      EXPECT_EQ(e.file(), "config.json");
      EXPECT_NE(e.rule().find(key + ": contains a NUL byte"), std::string::npos) << e.what();
      // The whole value, not a message cut short at the NUL.
      EXPECT_NE(e.rule().find("rep.json\\u0000.evil"), std::string::npos) << e.what();
    }
  }
}

TEST(LoadConfigNul, ANulInASetsTextIsRefusedToo) {
  ConfigBuilder b;
  b.apply_set(std::string("load.report=rep.json") + '\0' + ".evil");
  try {
    b.build();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.rule().find("load.report: contains a NUL byte"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ferry::runtime
