// The public header (include/ferry/log.hpp) is the definition; ferry's own code
// includes it by this name.
#pragma once

#include "ferry/log.hpp"
