#include "synth/cli_util.hpp"

#include <gtest/gtest.h>

#include "tools/commands.hpp"

namespace ferry::synth {

int run_cli(const std::vector<std::string>& args, std::string* out, std::string* err) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  int rc = 0;
  try {
    rc = tools::cmd_synth(args);
  } catch (...) {
    // Stop capturing before the error reaches the test.
    ::testing::internal::GetCapturedStdout();
    ::testing::internal::GetCapturedStderr();
    throw;
  }
  std::string o = ::testing::internal::GetCapturedStdout();
  std::string e = ::testing::internal::GetCapturedStderr();
  if (out != nullptr) {
    *out = o;
  }
  if (err != nullptr) {
    *err = e;
  }
  return rc;
}

}  // namespace ferry::synth
