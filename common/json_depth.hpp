// A guard run on JSON text before it is parsed: how deeply its arrays and objects
// nest. nlohmann parses any depth without recursion, but walking, printing or
// destroying the result recurses, so a hostile file nested 100,000 deep (a few
// hundred KiB) would overflow the stack after parsing. Every JSON ferry reads from
// a checkpoint or a config is checked against kMaxJsonDepth first.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ferry {

// Real configs nest up to 4 levels (quantization_config.config_groups....),
// safetensors headers and indexes 3.
inline constexpr std::size_t kMaxJsonDepth = 64;

// The deepest nesting of arrays and objects in `text`, counted outside strings
// (escapes honoured), stopping once it passes `limit` (so the scan costs at most
// one pass). Not a validator: malformed text is the parser's to refuse.
std::size_t json_depth(std::string_view text, std::size_t limit = kMaxJsonDepth);

// "JSON nests deeper than 64 levels": the rule of every error for such text.
std::string json_too_deep_rule();

}  // namespace ferry
