// The verbs of the `ferry` command line. Each takes the arguments after the verb
// and returns the process exit status; errors are printed to standard error.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/load_config.hpp"

namespace ferry::tools {

using Args = std::vector<std::string>;

int cmd_synth(const Args& args);     // tools/cmd_synth.cpp
int cmd_inspect(const Args& args);   // tools/cmd_inspect.cpp
int cmd_demo(const Args& args);      // tools/cmd_demo.cpp
int cmd_load(const Args& args);      // tools/cmd_load.cpp
int cmd_plan(const Args& args);      // tools/cmd_plan.cpp
int cmd_selftest(const Args& args);  // tools/cmd_selftest.cpp

// ---- configuration flags shared by `ferry load` and `ferry plan` (tools/cmd_load.cpp)

// A dedicated flag that sets a configuration key. Without `implied` it takes a
// value ("--tp 2" or "--tp=2"); with it, it is a switch ("--draft" sets model.draft
// to "true"; "--draft=false" still names a value).
struct ConfigFlag {
  const char* flag;
  const char* key;
  const char* implied = nullptr;
};

// The flags both verbs accept, so that `ferry plan` shows what `ferry load` with the
// same arguments would do: --model, --tp, --ep, --pp, --pp-rank, --ranks, --draft.
std::span<const ConfigFlag> shared_config_flags();

struct ParsedArgs {
  runtime::ConfigSources sources;     // --config, --set and every ConfigFlag given
  std::vector<std::string> switches;  // the verb's own switches given (e.g. "--json")
  bool help = false;                  // -h / --help
};

// Parses `args` of `verb` ("load", "plan"): --config FILE, --set key=value, the
// shared flags, `verb_flags`, and `verb_switches` (flags without a value that set no
// key). Returns nullopt after printing the problem and `usage` to standard error;
// the verb then exits with 2.
std::optional<ParsedArgs> parse_config_args(const Args& args, const char* verb,
                                            std::span<const ConfigFlag> verb_flags,
                                            std::span<const char* const> verb_switches,
                                            const char* usage);

// The LoadConfig of `parsed` over the embedded config/default.json and the
// environment. Returns nullopt after printing the error (or, without --model, the
// usage) to standard error; the verb then exits with 2.
std::optional<runtime::LoadConfig> config_from_args(const ParsedArgs& parsed, const char* verb,
                                                    const char* usage);

}  // namespace ferry::tools
