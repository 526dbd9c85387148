// How every verb of `ferry` reads its arguments: one CLI11 app per verb, whose
// definitions both parse the words and generate the verb's --help. Usage errors
// (an unknown flag, a missing value, a bad number) get CLI11's message naming the
// flag and exit status 2; --help prints to standard output and exits 0.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tools/commands.hpp"

namespace ferry::tools {

// Parses `args` (the words after the verb, in order) with `app`, whose name is the
// verb as typed ("ferry load"). Returns the exit status when parsing ends the verb
// (0 after printing the help, 2 after printing the error and a pointer to --help on
// standard error), nullopt when the verb goes on with what the app stored.
std::optional<int> parse_verb(CLI::App& app, const Args& args);

// A whole number that fits 64 bits: digits only, no sign, fraction or exponent.
// CLI11 alone would read "-1" as 2^64 - 1 for an unsigned option.
const CLI::Validator& whole_number();

// A value `accepts` takes; anything else is "unknown WHAT 'VALUE' (CHOICES)".
CLI::Validator known_value(std::function<bool(const std::string&)> accepts, const std::string& what,
                           const std::string& choices);

// One of `names`; anything else is "unknown WHAT 'VALUE' (a, b, c)".
CLI::Validator one_of(std::vector<std::string> names, const std::string& what);

// A switch that takes no value ("--json"; "--json=yes" is an error).
CLI::Option* add_switch(CLI::App& app, const std::string& name, bool& value,
                        const std::string& help);

// The configuration options of `ferry load`, `ferry plan` and `ferry config`: --config FILE,
// --set KEY=VALUE (repeatable, in order), the shared flags and `verb_flags`.
// --config and --set land in out.sources; config_from_args adds the flags given.
// `out` must outlive the parse and `app`.
void add_config_options(CLI::App& app, ConfigArgs& out, std::span<const ConfigFlag> verb_flags);

}  // namespace ferry::tools
