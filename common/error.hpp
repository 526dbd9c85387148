// The public header (include/ferry/error.hpp) is the definition; ferry's own code
// includes it by this name.
#pragma once

#include "ferry/error.hpp"
