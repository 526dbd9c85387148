#include "common/format.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.hpp"
#include "testing/temp_dir.hpp"

namespace ferry {
namespace {

TEST(FormatTest, HumanBytesUsesBinaryUnits) {
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(1023), "1023 B");
  EXPECT_EQ(human_bytes(1536), "1.5 KiB");
  EXPECT_EQ(human_bytes(std::uint64_t{3} << 30), "3.0 GiB");
}

TEST(FormatTest, JoinListSeparatesItemsInOrder) {
  EXPECT_EQ(join_list({}), "");
  EXPECT_EQ(join_list({"a"}), "a");
  EXPECT_EQ(join_list({"b", "a", "c"}), "b, a, c");
  EXPECT_EQ(join_list({"x", "y"}, "|"), "x|y");
}

TEST(FormatTest, FixedRoundsToTheDigitsAsked) {
  EXPECT_EQ(fixed(1.23456, 2), "1.23");
  EXPECT_EQ(fixed(2.0, 0), "2");
  EXPECT_EQ(fixed(0.0005, 3), "0.001");
}

TEST(FormatTest, WriteFileReplacingLeavesNoTemporaryAndNamesTheSettingOnFailure) {
  testing::TempDir dir;
  const std::string path = dir.file("m.prom");
  write_file_replacing(path, "one\n", "metrics.textfile");
  write_file_replacing(path, "two\n", "metrics.textfile");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "two\n");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  try {
    write_file_replacing(dir.file("missing/m.prom"), "x", "trace.path");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kOutput);
    EXPECT_NE(std::string(e.what()).find("trace.path: cannot write"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace ferry
