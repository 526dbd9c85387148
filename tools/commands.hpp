// The verbs of the `ferry` command line. Each takes the arguments after the verb
// and returns the process exit status; errors are printed to standard error.
#pragma once

#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/load_config.hpp"

namespace CLI {
class Option;
}  // namespace CLI

namespace ferry::tools {

using Args = std::vector<std::string>;

int cmd_synth(const Args& args);     // tools/cmd_synth.cpp
int cmd_inspect(const Args& args);   // tools/cmd_inspect.cpp
int cmd_demo(const Args& args);      // tools/cmd_demo.cpp
int cmd_load(const Args& args);      // tools/cmd_load.cpp
int cmd_serve(const Args& args);     // tools/cmd_serve.cpp
int cmd_plan(const Args& args);      // tools/cmd_plan.cpp
int cmd_save(const Args& args);      // tools/cmd_save.cpp
int cmd_selftest(const Args& args);  // tools/cmd_selftest.cpp
int cmd_bench(const Args& args);     // tools/cmd_bench.cpp
int cmd_config(const Args& args);    // tools/cmd_config.cpp

// ---- configuration flags shared by `ferry load`, `ferry plan` and `ferry config`
// (tools/cli.cpp)

// A dedicated flag that sets a configuration key. Its value is read as --set reads
// values, so the configuration checks it and names the flag in errors.
struct ConfigFlag {
  enum class Kind {
    kText,    // "--model DIR"
    kNumber,  // "--tp 2": a whole number, checked by the parser before the config sees it
    kSwitch,  // "--draft" sets "true"; "--draft=false" names the value
  };
  const char* flag;  // "--tp"
  const char* key;   // "parallel.tp"
  Kind kind;
  const char* value_name;  // "N" in the help ("" for a switch)
  const char* help;
};

// The flags both verbs accept, so that `ferry plan` shows what `ferry load` with the
// same arguments would do: --model, --tp, --ep, --pp, --pp-rank, --ranks, --draft.
std::span<const ConfigFlag> shared_config_flags();

// The flags only `ferry load` (and `ferry config --show`, which shows what `ferry load`
// would use) adds to those: --devices, --dump-dir, --report, --trace, --startup.
std::span<const ConfigFlag> load_config_flags();

// What the configuration options of a verb collect (tools/cli.hpp add_config_options).
struct ConfigArgs {
  runtime::ConfigSources sources;  // --config and --set; flags are added by config_from_args
  struct Given {
    const ConfigFlag* flag;
    const CLI::Option* option;  // counts how often it was given
    const std::string* value;   // the last value given
  };
  std::vector<Given> flags;        // every ConfigFlag the verb has, in table order
  std::deque<std::string> values;  // storage the options write (stable addresses)
};

// The sources `args` collected: --config (else the embedded config/default.json),
// --set and the flags given.
runtime::ConfigSources sources_from_args(const ConfigArgs& args);

// The LoadConfig of `args` over the embedded config/default.json and the
// environment. Returns nullopt after printing the error (or, when no model path is
// set anywhere, what is missing) to standard error; the verb then exits with 2.
std::optional<runtime::LoadConfig> config_from_args(const ConfigArgs& args, const char* verb);

}  // namespace ferry::tools
