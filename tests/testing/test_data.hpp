// Where tests find the real configs, indexes and safetensors files of shared/data,
// which sits beside the checkout only in our own CI and work trees. A test that reads
// them starts with FERRY_NEED_TEST_DATA(): with the folder present it runs; without
// it, it is skipped with a message naming where it looked, or fails when
// FERRY_REQUIRE_TEST_DATA=1 (as .ci/run sets it, so CI never skips them by mistake).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

namespace ferry::testing {

struct TestDataLocation {
  std::string dir;                     // where the data is, or would be
  std::optional<std::string> missing;  // why it is not usable there; nullopt when it is
};

// The rule, apart from the process environment so that it can be tested:
// `from_env` (FERRY_TEST_DATA) when set and not empty, else `fallback` (../shared/data
// beside the source tree, compiled in). The folder must hold models/ and
// safetensors/ to be usable.
inline TestDataLocation locate_test_data(const char* from_env, const std::string& fallback) {
  const bool env_set = from_env != nullptr && *from_env != '\0';
  TestDataLocation out;
  out.dir = env_set ? std::string(from_env) : fallback;
  std::error_code ec;
  const std::filesystem::path dir(out.dir);
  if (std::filesystem::is_directory(dir / "models", ec) &&
      std::filesystem::is_directory(dir / "safetensors", ec)) {
    return out;
  }
  const std::string place =
      env_set ? "FERRY_TEST_DATA=" + out.dir : "FERRY_TEST_DATA is not set and " + fallback;
  out.missing = "no test data: " + place +
                " has no models/ and safetensors/ folders; set FERRY_TEST_DATA to a copy of "
                "shared/data, or put one at " +
                fallback;
  return out;
}

// The location for this process.
inline const TestDataLocation& test_data() {
  static const TestDataLocation location =
      locate_test_data(std::getenv("FERRY_TEST_DATA"), FERRY_SHARED_DATA);
  return location;
}

// True when FERRY_REQUIRE_TEST_DATA asks for the data to be there ("1", or any value
// other than "" and "0").
inline bool test_data_required() {
  const char* v = std::getenv("FERRY_REQUIRE_TEST_DATA");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

// A path inside the test data folder ("models/qwen2.5-7b/config.json").
inline std::string test_data_path(const std::string& relative) {
  return (std::filesystem::path(test_data().dir) / relative).string();
}

}  // namespace ferry::testing

// Skips the calling test (or fails it under FERRY_REQUIRE_TEST_DATA) when the test
// data is not there. Use at the top of a test body; it returns from that function.
#define FERRY_NEED_TEST_DATA()                                                               \
  do {                                                                                       \
    if (const auto& ferry_data_missing = ::ferry::testing::test_data().missing) {            \
      if (::ferry::testing::test_data_required()) {                                          \
        FAIL() << *ferry_data_missing << " (FERRY_REQUIRE_TEST_DATA is set, so this fails)"; \
      }                                                                                      \
      GTEST_SKIP() << *ferry_data_missing;                                                   \
    }                                                                                        \
  } while (false)
