// `ferry config`: the configuration keys and the effective configuration, both read
// off the key table (runtime/config_keys.hpp).
//
//   ferry config --list [--json]                every key: type, default, doc, variable
//   ferry config --show [load flags...] [--json]  every key's effective value and where
//                                                 it came from (default, file,
//                                                 environment, --set, flag)
//
// --show takes `ferry load`'s configuration options (tools/cli.cpp) and reads the
// same sources in the same order, so it shows what `ferry load` with the same
// arguments would use. It needs no model path.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/log.hpp"
#include "runtime/config_keys.hpp"
#include "runtime/load_config.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"

extern char** environ;

namespace ferry::tools {
namespace {

constexpr const char kDescription[] =
    "Lists the configuration keys (--list), or shows the configuration `ferry load` would use\n"
    "with the same options and where each value came from (--show).";

// Rows of text in columns as wide as their widest cell (the last one unpadded).
std::string columns(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()));
    for (std::size_t i = 0; i < row.size(); ++i) {
      width[i] = std::max(width[i], row[i].size());
    }
  }
  std::string out;
  for (const auto& row : rows) {
    for (std::size_t i = 0; i < row.size(); ++i) {
      out += row[i];
      if (i + 1 < row.size()) {
        out += std::string(width[i] - row[i].size() + 2, ' ');
      }
    }
    out += '\n';
  }
  return out;
}

int list_keys(bool json) {
  nlohmann::json keys = nlohmann::json::array();
  std::vector<std::vector<std::string>> rows = {{"KEY", "TYPE", "DEFAULT", "WHAT IT DOES"}};
  for (const runtime::ConfigKey& key : runtime::config_keys()) {
    keys.push_back({{"key", key.name},
                    {"section", key.section()},
                    {"type", key.type()},
                    {"default", key.default_value()},
                    {"env", key.env_name()},
                    {"doc", key.doc}});
    rows.push_back(
        {std::string(key.name), key.type(), key.default_value().dump(), std::string(key.doc)});
  }
  if (json) {
    std::cout << keys.dump(2) << "\n";
  } else {
    std::cout << columns(rows)
              << "\nEach key is also the variable FERRY_ and the key in upper case with __ for "
                 "each dot\n(FERRY_IO__CHUNK_BYTES); docs/OPERATING.md says more of each.\n";
  }
  return 0;
}

int show_config(const ConfigArgs& args, bool json) {
  runtime::LoadConfig config;
  runtime::ConfigBuilder builder;
  try {
    builder = runtime::apply_sources(sources_from_args(args), runtime::env_map(environ));
    for (const std::string& w : builder.warnings()) {
      log::warn("config: " + w);
    }
    config = builder.build();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry config: error: %s\n", e.what());
    return 2;
  }
  nlohmann::json keys = nlohmann::json::object();
  std::vector<std::vector<std::string>> rows = {{"KEY", "VALUE", "FROM"}};
  for (const runtime::ConfigKey& key : runtime::config_keys()) {
    const runtime::KeyOrigin origin = builder.origin(key.name);
    const std::string layer(to_string(origin.layer));
    const nlohmann::json value = key.write(config);
    keys[std::string(key.name)] = {{"value", value}, {"from", layer}, {"source", origin.source}};
    std::string from = layer;
    if (origin.layer == runtime::ConfigLayer::kFile ||
        origin.layer == runtime::ConfigLayer::kFlag) {
      from += " " + origin.source;
    } else if (origin.layer != runtime::ConfigLayer::kDefault) {
      from = origin.source;  // "environment FERRY_X", "--set key"
    }
    rows.push_back({std::string(key.name), value.dump(), from});
  }
  std::cout << (json ? keys.dump(2) + "\n" : columns(rows));
  return 0;
}

}  // namespace

int cmd_config(const Args& args) {
  CLI::App app(kDescription, "ferry config");
  bool list = false;
  bool show = false;
  bool json = false;
  add_switch(app, "--list", list, "every key with its type, default and what it does");
  add_switch(app, "--show", show,
             "the effective configuration of the options given (those of ferry load) and where "
             "each value came from");
  add_switch(app, "--json", json, "print JSON instead of a table");
  ConfigArgs config_args;
  add_config_options(app, config_args, load_config_flags());
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  bool configured = !config_args.sources.config_file.empty() || !config_args.sources.sets.empty();
  for (const ConfigArgs::Given& given : config_args.flags) {
    configured = configured || given.option->count() > 0;
  }
  std::string usage;
  if (list == show) {
    usage = "give one of --list and --show";
  } else if (list && configured) {
    usage = "--list takes no configuration options (--show does)";
  }
  if (!usage.empty()) {
    std::fprintf(stderr, "ferry config: %s\n(see ferry config --help)\n", usage.c_str());
    return 2;
  }
  return list ? list_keys(json) : show_config(config_args, json);
}

}  // namespace ferry::tools
