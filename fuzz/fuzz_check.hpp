// What the fuzz targets share: FUZZ_CHECK, which reports a broken invariant and
// aborts (libFuzzer saves the input as a crash), and helpers to compare results.
// A ferry::Error is a clean refusal and never a finding; anything else that escapes
// a target (another exception, a sanitizer report, a timeout) is.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#define FUZZ_CHECK(cond, ...)                                                              \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ::ferry::fuzz::report(std::string(__VA_ARGS__));                                     \
      std::abort();                                                                        \
    }                                                                                      \
  } while (false)

namespace ferry::fuzz {

inline void report(const std::string& detail) {
  if (!detail.empty()) {
    std::fprintf(stderr, "  %s\n", detail.c_str());
  }
}

}  // namespace ferry::fuzz
