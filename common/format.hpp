// Human-readable numbers for CLI output and reports.
#pragma once

#include <cstdint>
#include <string>

namespace ferry {

// "512 B", "1.5 MiB", "2.0 GiB": binary units, one decimal above bytes.
std::string human_bytes(std::uint64_t n);

}  // namespace ferry
