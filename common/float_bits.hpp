// Round-to-nearest-even conversions of a float to BF16 and F16 bits (NaN stays NaN,
// overflow becomes infinity): synth's values, and scalars a loader computes from
// config.json (runtime/sharded_state.hpp).
#pragma once

#include <cstdint>

namespace ferry {

std::uint16_t float_to_bf16_bits(float value);
std::uint16_t float_to_f16_bits(float value);

}  // namespace ferry
