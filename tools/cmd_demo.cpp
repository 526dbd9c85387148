// Placeholder until the verb lands.
#include <cstdio>

#include "tools/commands.hpp"

namespace ferry::tools {
int cmd_demo(const Args&) {
  std::fputs("ferry demo: not built yet\n", stderr);
  return 1;
}
}  // namespace ferry::tools
