#include "common/ggml_blocks.hpp"

#include <array>

#include "common/enum_name.hpp"

namespace ferry {

std::string_view ggml_blocks_name(GgmlBlocks b) {
  static constexpr std::array<std::string_view, 11> kNames{
      "none", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
  static_assert(kNames.size() == static_cast<std::size_t>(GgmlBlocks::kQ6_K) + 1);
  return enum_name(b, kNames, "none");
}

}  // namespace ferry
