// Test helper: runs a command line, capturing exit status, stdout and stderr.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "testing/temp_dir.hpp"

namespace ferry::testing {

struct RunResult {
  int status = -1;  // exit status, or -1 when killed
  std::string out;
  std::string err;
};

// Quotes one shell word.
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

inline RunResult run(const std::vector<std::string>& argv) {
  TempDir dir;
  std::string cmd;
  for (const auto& a : argv) {
    cmd += shell_quote(a) + " ";
  }
  cmd += ">" + shell_quote(dir.file("out")) + " 2>" + shell_quote(dir.file("err"));
  int raw = std::system(cmd.c_str());
  RunResult r;
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = read_file(dir.file("out"));
  r.err = read_file(dir.file("err"));
  return r;
}

}  // namespace ferry::testing
