// CLI11 glue shared by the verbs (tools/cli.hpp), and the configuration flags that
// `ferry load`, `ferry plan` and `ferry config --show` share (tools/commands.hpp).
#include "tools/cli.hpp"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "common/format.hpp"
#include "embedded_config.hpp"

extern char** environ;

namespace ferry::tools {
namespace {

using Kind = ConfigFlag::Kind;

constexpr ConfigFlag kSharedFlags[] = {
    {"--model", "model.path", Kind::kText, "DIR", "the checkpoint folder (or one of its files)"},
    {"--tp", "parallel.tp", Kind::kNumber, "N", "tensor-parallel ranks"},
    {"--ep", "parallel.ep", Kind::kNumber, "N", "expert-parallel ranks (divides --tp)"},
    {"--pp", "parallel.pp", Kind::kNumber, "N", "pipeline stages"},
    {"--pp-rank", "parallel.pp_rank", Kind::kNumber, "R",
     "the pipeline stage this process loads (default 0)"},
    {"--ranks", "parallel.ranks", Kind::kText, "LIST",
     "tensor-parallel ranks this process serves (\"0,2\", \"0-3\"); default all"},
    {"--draft", "model.draft", Kind::kSwitch, "",
     "load the draft (MTP) model's weights instead of the target model's"},
};

// The flags only `ferry load` has, and `ferry config --show` with it.
constexpr ConfigFlag kLoadFlags[] = {
    {"--devices", "devices", Kind::kText, "SPEC",
     "one device per local rank, in order: host:N | cuda:0,1,... | null:N (keeps nothing, counts "
     "bytes); default host:<local ranks>"},
    {"--dump-dir", "load.dump_dir", Kind::kText, "DIR",
     "write each local rank's parameters to DIR/rank-<r>.safetensors"},
    {"--report", "load.report", Kind::kText, "FILE", "write the load report as JSON"},
    {"--trace", "trace.path", Kind::kText, "FILE",
     "write a Chrome trace of the load (open it in Perfetto or chrome://tracing)"},
    {"--startup", "startup.mode", Kind::kText, "MODE",
     "boot as an engine does: prepare(), a stand-in capture (--capture-seconds), commit(); "
     "serial | overlap | auto"},
};

}  // namespace

std::span<const ConfigFlag> shared_config_flags() {
  return kSharedFlags;
}

std::span<const ConfigFlag> load_config_flags() {
  return kLoadFlags;
}

std::optional<int> parse_verb(CLI::App& app, const Args& args) {
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 pops from the back
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::fflush(stdout);
    std::cout << app.help() << std::flush;
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fflush(stdout);
    std::cerr << app.get_name() << ": " << e.what() << "\n(see " << app.get_name() << " --help)\n"
              << std::flush;
    return 2;
  }
  return std::nullopt;
}

const CLI::Validator& whole_number() {
  static const CLI::Validator validator(
      [](std::string& text) -> std::string {
        std::uint64_t value = 0;
        const char* end = text.data() + text.size();
        auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (text.empty() || ec != std::errc() || ptr != end) {
          return "expected a whole number, not '" + text + "'";
        }
        return "";
      },
      "", "whole number");
  return validator;
}

CLI::Validator known_value(std::function<bool(const std::string&)> accepts, const std::string& what,
                           const std::string& choices) {
  return CLI::Validator(
      [accepts = std::move(accepts), what, choices](std::string& text) -> std::string {
        return accepts(text) ? "" : "unknown " + what + " '" + text + "' (" + choices + ")";
      },
      "", what);
}

CLI::Validator one_of(std::vector<std::string> names, const std::string& what) {
  const std::string choices = join_list(names);
  return known_value(
      [names = std::move(names)](const std::string& text) {
        return std::find(names.begin(), names.end(), text) != names.end();
      },
      what, choices);
}

CLI::Option* add_switch(CLI::App& app, const std::string& name, bool& value,
                        const std::string& help) {
  return app.add_flag(name, value, help)->disable_flag_override();
}

void add_config_options(CLI::App& app, ConfigArgs& out, std::span<const ConfigFlag> verb_flags) {
  app.add_option("--config", out.sources.config_file,
                 "a JSON config file instead of the embedded config/default.json")
      ->type_name("FILE")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--set", out.sources.sets,
                 "set any configuration key (repeatable; later wins; flags win over --set)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  for (std::span<const ConfigFlag> flags : {shared_config_flags(), verb_flags}) {
    for (const ConfigFlag& f : flags) {
      const std::string help = std::string(f.help) + " [" + f.key + "]";
      std::string& value = out.values.emplace_back();
      // A switch stores "true" when given bare and its value when given one
      // ("--draft=false"); the configuration reads it and names the flag if it is bad.
      CLI::Option* option = f.kind == Kind::kSwitch ? app.add_flag(f.flag, value, help)
                                                    : app.add_option(f.flag, value, help);
      option->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
      if (f.kind != Kind::kSwitch) {
        option->type_name(f.value_name);
      }
      if (f.kind == Kind::kNumber) {
        option->check(whole_number());
      }
      out.flags.push_back({&f, option, &value});
    }
  }
  app.footer(
      "Precedence, lowest first: in-code defaults < config file < environment < --set < flags.\n"
      "Every configuration key (`ferry config --list`) can be set with --set KEY=VALUE or the\n"
      "environment: FERRY_ and the key in upper case with __ for each dot\n"
      "(FERRY_IO__CHUNK_BYTES=8MiB sets io.chunk_bytes; FERRY_DEVICES sets devices).");
}

runtime::ConfigSources sources_from_args(const ConfigArgs& args) {
  runtime::ConfigSources sources = args.sources;
  for (const ConfigArgs::Given& given : args.flags) {
    if (given.option->count() > 0) {
      sources.flags.push_back({given.flag->flag, given.flag->key, *given.value});
    }
  }
  sources.default_json = kEmbeddedDefaultConfig;
  sources.default_json_name = "embedded config/default.json";
  return sources;
}

std::optional<runtime::LoadConfig> config_from_args(const ConfigArgs& args, const char* verb) {
  runtime::LoadConfig config;
  try {
    config = runtime::load_config(sources_from_args(args), environ);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry %s: error: %s\n", verb, e.what());
    return std::nullopt;
  }
  if (config.model.path.empty()) {
    std::fprintf(stderr,
                 "ferry %s: --model DIR is required (or model.path from --config, --set or "
                 "FERRY_MODEL__PATH)\n(see ferry %s --help)\n",
                 verb, verb);
    return std::nullopt;
  }
  return config;
}

}  // namespace ferry::tools
