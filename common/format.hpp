// Human-readable numbers for CLI output and reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

// "512 B", "1.5 MiB", "2.0 GiB": binary units, `digits` decimals above bytes.
std::string human_bytes(std::uint64_t n, int digits = 1);

// `v` with `digits` digits after the point: fixed(1.23456, 2) == "1.23".
std::string fixed(double v, int digits);

// Writes `text` to `path` as OutputFile does (common/output_file.hpp): a regular file
// (or a symlink's target) through a temporary renamed into place, so that a reader
// never sees half a file; a FIFO or a character device in place. Throws
// ferry::Error(Stage::kOutput, path) saying "`what`: cannot write ..." (`what` names
// the setting, e.g. "trace.path"), leaving no temporary behind.
void write_file_replacing(const std::string& path, const std::string& text,
                          const std::string& what);

// "a, b, c": the items in order, separated by `separator`.
std::string join_list(const std::vector<std::string>& items, const char* separator = ", ");

// "a, b, c and 7 more": the first `limit` items, then how many were left out.
std::string join_first(const std::vector<std::string>& items, std::size_t limit);

// "[4096, 128]": a shape's dimensions.
std::string format_dims(const std::vector<std::uint64_t>& dims);

}  // namespace ferry
