// The table of configuration keys: one row per key, as RocksDB's OptionTypeInfo
// tables are. A row names the key, says in one line what it does, and holds the
// functions that read a value into its LoadConfig member (checking its type and
// range) and write the member back as the key spells it. The row drives
// ConfigBuilder::build (every source: file, environment, --set, flags), to_json,
// the environment names, `ferry config --list` and the docs/OPERATING.md check.
// A key's default is its member's in-code default (LoadConfig{}), written by the row.
//
// Adding a key is the struct member (runtime/load_config.hpp) and one row in
// runtime/config_keys.cpp; a check that spans several keys goes in
// ConfigBuilder::build (runtime/load_config.cpp).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "runtime/load_config.hpp"

namespace ferry::runtime {

// A key's value as the last layer that set it gave it: the JSON, and the raw text
// where the layer read it from text (--set, the environment, flags), so that a
// string key given `model.path=2024` keeps the text.
struct KeyInput {
  const nlohmann::json& value;
  const std::optional<std::string>& text;
};

struct ConfigKey {
  std::string_view name;  // "io.chunk_bytes": section, dot, leaf; "devices" has no section
  std::string_view doc;   // one line; docs/OPERATING.md has the long form
  // What the key takes, for `ferry config --list`: "bool", "integer 1..4096",
  // "size 4096..1073741824", "auto|bf16|f16|f32", ...
  std::string (*type)();
  // Reads `input` into the row's member of `config`. `input` is nullptr when no layer
  // set the key: the member keeps its default, or is derived from the rows above it
  // (parallel.ranks from parallel.tp, devices from the ranks). Throws
  // Error(Stage::kConfig) whose rule says what was expected; build() names the key
  // and the source.
  void (*read)(const KeyInput* input, LoadConfig& config);
  // The member as the key spells it (to_json, defaults, `ferry config`).
  nlohmann::json (*write)(const LoadConfig& config);

  std::string_view section() const;  // "io"; "" for a key without one
  std::string_view leaf() const;     // "chunk_bytes"
  std::string env_name() const;      // FERRY_IO__CHUNK_BYTES, FERRY_DEVICES
  nlohmann::json default_value() const;
};

// Every key, in the order build() reads them (a row may use the rows above it) and
// docs/OPERATING.md lists them.
std::span<const ConfigKey> config_keys();

// The row of `name` ("io.direct"), or nullptr.
const ConfigKey* find_config_key(std::string_view name);

// The rule a row's reader throws with: Error(Stage::kConfig) with no file.
[[noreturn]] void config_rule(std::string rule);

// Helpers the rows and the builder share.
std::string json_quoted(std::string_view text);      // "\"text\"", escaped as JSON
std::string_view trim_space(std::string_view text);  // without surrounding whitespace

}  // namespace ferry::runtime
