// A compiled regular expression over module names: compressed-tensors'
// quantization_config.ignore entries "re:<pattern>" (SGLang's should_ignore_layer
// matches them with Python's re.match, from the start of the name). The one place
// in ferry that instantiates <regex> (module_regex.cpp says why that matters).
#pragma once

#include <memory>
#include <string>

namespace ferry::models {

class ModuleRegex {
 public:
  // ECMAScript syntax. Throws std::invalid_argument carrying the library's reason
  // for a pattern that is not a regular expression.
  explicit ModuleRegex(const std::string& pattern);
  // Whether the pattern matches a prefix of `name` (re.match).
  bool matches_from_start(const std::string& name) const;

 private:
  struct Compiled;
  std::shared_ptr<const Compiled> compiled_;
};

}  // namespace ferry::models
