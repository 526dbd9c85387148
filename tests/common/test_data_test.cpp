// The test-data rule every test that reads shared/data goes through
// (tests/testing/test_data.hpp): FERRY_TEST_DATA, else ../shared/data; skip when
// neither holds the data, fail instead under FERRY_REQUIRE_TEST_DATA.
#include "testing/test_data.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(TestData, EnvironmentFirstThenTheFolderBesideTheCheckout) {
  TempDir data;
  std::filesystem::create_directories(data.path() / "models");
  std::filesystem::create_directories(data.path() / "safetensors");
  TempDir empty;
  const std::string fallback = data.str();

  TestDataLocation from_env = locate_test_data(data.str().c_str(), "/nonexistent/shared/data");
  EXPECT_EQ(from_env.dir, data.str());
  EXPECT_FALSE(from_env.missing.has_value());

  for (const char* unset : {static_cast<const char*>(nullptr), ""}) {
    TestDataLocation beside = locate_test_data(unset, fallback);
    EXPECT_EQ(beside.dir, fallback);
    EXPECT_FALSE(beside.missing.has_value());
  }

  // Set but without the data: it is not silently replaced by the fallback.
  TestDataLocation wrong = locate_test_data(empty.str().c_str(), fallback);
  EXPECT_EQ(wrong.dir, empty.str());
  ASSERT_TRUE(wrong.missing.has_value());
  EXPECT_THAT(*wrong.missing, HasSubstr("FERRY_TEST_DATA=" + empty.str()));
  EXPECT_THAT(*wrong.missing, HasSubstr(fallback));

  TestDataLocation neither = locate_test_data(nullptr, "/nonexistent/shared/data");
  ASSERT_TRUE(neither.missing.has_value());
  EXPECT_THAT(*neither.missing, HasSubstr("FERRY_TEST_DATA is not set"));
  EXPECT_THAT(*neither.missing, HasSubstr("/nonexistent/shared/data"));

  // models/ alone is not the data.
  TempDir half;
  std::filesystem::create_directories(half.path() / "models");
  EXPECT_TRUE(locate_test_data(half.str().c_str(), fallback).missing.has_value());
}

// Used by the next test through a child process; in a plain run it checks that the
// data it was promised is there.
TEST(TestData, NeededHere) {
  FERRY_NEED_TEST_DATA();
  EXPECT_TRUE(std::filesystem::is_directory(test_data_path("models"))) << test_data().dir;
}

TEST(TestData, MissingDataSkipsUnlessRequired) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string filter = "--gtest_filter=TestData.NeededHere";
  RunResult skipped = run({"env", "-u", "FERRY_REQUIRE_TEST_DATA",
                           "FERRY_TEST_DATA=/nonexistent/ferry-data", self, filter});
  EXPECT_EQ(skipped.status, 0) << skipped.out << skipped.err;
  EXPECT_THAT(skipped.out, HasSubstr("[  SKIPPED ] TestData.NeededHere"));
  EXPECT_THAT(skipped.out, HasSubstr("FERRY_TEST_DATA=/nonexistent/ferry-data"));

  RunResult required = run({"env", "FERRY_REQUIRE_TEST_DATA=1",
                            "FERRY_TEST_DATA=/nonexistent/ferry-data", self, filter});
  EXPECT_NE(required.status, 0) << required.out;
  EXPECT_THAT(required.out, HasSubstr("[  FAILED  ] TestData.NeededHere"));
  EXPECT_THAT(required.out, HasSubstr("FERRY_REQUIRE_TEST_DATA is set"));

  RunResult zero = run({"env", "FERRY_REQUIRE_TEST_DATA=0",
                        "FERRY_TEST_DATA=/nonexistent/ferry-data", self, filter});
  EXPECT_EQ(zero.status, 0) << zero.out;
  EXPECT_THAT(zero.out, Not(HasSubstr("[  FAILED  ]")));
}

}  // namespace
}  // namespace ferry::testing
