// The public header (include/ferry/dtype.hpp) is the definition; ferry's own code
// includes it by this name.
#pragma once

#include "ferry/dtype.hpp"
