// `ferry synth` in-process for the synth suites: tools::cmd_synth with its standard
// output and error captured.
#pragma once

#include <string>
#include <vector>

namespace ferry::synth {

// Runs cmd_synth(args); its exit status, and what it printed into `out` and `err`
// when given. An exception reaches the caller, capture stopped.
int run_cli(const std::vector<std::string>& args, std::string* out = nullptr,
            std::string* err = nullptr);

}  // namespace ferry::synth
