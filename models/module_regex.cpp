// GCC 12 at -O2 or above with -fsanitize=address reports -Wmaybe-uninitialized in
// libstdc++'s <regex> (the std::function inside each NFA state it copies), a false
// positive in library code that made a RelWithDebInfo ASan build with -Werror fail.
// This file is the only one that instantiates <regex>, so the warning is off here
// alone, from before any header brings std::function in.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "models/module_regex.hpp"

#include <regex>
#include <stdexcept>

namespace ferry::models {

struct ModuleRegex::Compiled {
  std::regex regex;
};

ModuleRegex::ModuleRegex(const std::string& pattern) {
  try {
    compiled_ = std::make_shared<const Compiled>(Compiled{std::regex(pattern)});
  } catch (const std::regex_error& e) {
    throw std::invalid_argument(e.what());
  }
}

bool ModuleRegex::matches_from_start(const std::string& name) const {
  return std::regex_search(name, compiled_->regex, std::regex_constants::match_continuous);
}

}  // namespace ferry::models
