// The verbs of the `ferry` command line. Each takes the arguments after the verb
// and returns the process exit status; errors are printed to standard error.
#pragma once

#include <string>
#include <vector>

namespace ferry::tools {

using Args = std::vector<std::string>;

int cmd_synth(const Args& args);    // tools/cmd_synth.cpp
int cmd_inspect(const Args& args);  // tools/cmd_inspect.cpp
int cmd_demo(const Args& args);     // tools/cmd_demo.cpp
int cmd_load(const Args& args);     // tools/cmd_load.cpp
int cmd_selftest(const Args& args); // tools/cmd_selftest.cpp

}  // namespace ferry::tools
