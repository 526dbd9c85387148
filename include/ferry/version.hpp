// The version of the ferry library an engine runs against.
#pragma once

#include <string_view>

#include "ferry/export.hpp"

namespace ferry {

// "MAJOR.MINOR.PATCH", the version libferry.so was built as.
FERRY_API std::string_view version();

}  // namespace ferry
