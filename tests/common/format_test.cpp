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

}  // namespace
}  // namespace ferry
