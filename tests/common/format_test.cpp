#include "common/format.hpp"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace ferry
