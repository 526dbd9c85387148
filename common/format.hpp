// Human-readable numbers for CLI output and reports.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

// "512 B", "1.5 MiB", "2.0 GiB": binary units, one decimal above bytes.
std::string human_bytes(std::uint64_t n);

// `v` with `digits` digits after the point: fixed(1.23456, 2) == "1.23".
std::string fixed(double v, int digits);

// Writes `text` to `path` through `path`.tmp renamed into place, so that a reader
// never sees half a file. Throws ferry::Error(Stage::kConfig, path) saying "`what`:
// cannot write/rename ..." (`what` names the setting, e.g. "trace.path").
void write_file_replacing(const std::string& path, const std::string& text,
                          const std::string& what);

// "a, b, c": the items in order, separated by `separator`.
std::string join_list(const std::vector<std::string>& items, const char* separator = ", ");

}  // namespace ferry
