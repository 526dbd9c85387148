// Names of an enum's values from one table in the enum's order, as ggml names its
// types: a value's name is one row, not one case of a switch per to_string.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

namespace ferry {

// The name of `value` in `names`, whose row i names the enumerator with value i
// (enumerators 0, 1, ... without gaps); `outside` for a value past the table.
// Callers pin the table to the enum with a static_assert on its last enumerator.
template <typename Enum, std::size_t N>
constexpr std::string_view enum_name(Enum value, const std::array<std::string_view, N>& names,
                                     std::string_view outside = "?") {
  const auto i = static_cast<std::size_t>(value);
  return i < N ? names[i] : outside;
}

}  // namespace ferry
