// The three ways a safetensors header is read, exposed for the differential tests
// (tests/io/header_fast_path_test.cpp). parse_safetensors_header tries them in this
// order; each accepts a subset of what the next accepts and, where it accepts,
// gives the same result:
//   - parse_header_plain: a byte scanner for plain headers (printable ASCII strings
//     without escapes, plain digits); nullopt at anything else;
//   - parse_header_sax: nlohmann's SAX lexer, no document; nullopt at anything a
//     well-formed header does not hold;
//   - parse_header_document: the document path, whose errors name every rule.
// All three throw for the length checks (and, past parsing, for tensors that do
// not tile the data region), with the same words.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/error.hpp"
#include "io/safetensors.hpp"

namespace ferry::io::detail {

std::optional<SafetensorsHeader> parse_header_plain(std::string_view text, std::uint64_t file_size,
                                                    const std::string& display);
std::optional<SafetensorsHeader> parse_header_sax(std::string_view text, std::uint64_t file_size,
                                                  const std::string& display);
SafetensorsHeader parse_header_document(std::string_view text, std::uint64_t file_size,
                                        const std::string& display);

// Shared by the header (safetensors.cpp) and the index (checkpoint_index.cpp).
// JSON text as a document, refusing duplicate keys at every depth, a NUL byte and
// more nesting than common/json_depth.hpp allows: errors at `stage` name `file`.
nlohmann::json parse_json_no_duplicates(std::string_view text, Stage stage,
                                        const std::string& file);
// A JSON value as an error message quotes it: its text, cut to 40 characters.
std::string describe(const nlohmann::json& v);

}  // namespace ferry::io::detail
