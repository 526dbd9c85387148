// FP8 E4M3 ("float8_e4m3fn", safetensors F8_E4M3) elements on the host: 1 sign, 4
// exponent (bias 7) and 3 mantissa bits, no infinities, 0x7F / 0xFF NaN, largest
// finite 448. Used where the host must read or write FP8 weights (the synthetic
// checkpoints, the MLA split's dequantization on the host).
#pragma once

#include <cstdint>

namespace ferry {

// Exact value of an E4M3 byte (NaN for 0x7F / 0xFF).
float e4m3_to_float(std::uint8_t bits);
// Nearest E4M3 value, ties to the even code; beyond +-448 saturates to +-448 (as
// SGLang's quantizers clamp before they cast); NaN becomes 0x7F.
std::uint8_t float_to_e4m3(float value);

}  // namespace ferry
