// Human-readable numbers for CLI output and reports.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

// "512 B", "1.5 MiB", "2.0 GiB": binary units, one decimal above bytes.
std::string human_bytes(std::uint64_t n);

// "a, b, c": the items in order, separated by `separator`.
std::string join_list(const std::vector<std::string>& items, const char* separator = ", ");

}  // namespace ferry
