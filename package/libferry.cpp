// libferry.so's own translation unit: the library's version. Everything else in it
// comes from the static libraries it is linked from (package/CMakeLists.txt).
#include "ferry/version.hpp"

namespace ferry {

std::string_view version() {
  return FERRY_VERSION_STRING;
}

}  // namespace ferry
