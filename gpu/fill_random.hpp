// The element function of Stream::fill_random, shared by the host twin
// (gpu/kernels_host.cpp) and the CUDA kernel (gpu/cuda/cuda_kernels.cu), so that both
// backends compute the same F32 value for every element from nothing but (seed,
// index): a counter-based generator, no state between elements or launches.
//
//   bits  = splitmix64(seed + i)
//   u     = (bits >> 40) * 2^-24                 exact, in [0, 1)
//   value = low + (high - low) * u               two F32 operations, each rounded
//                                                 to nearest (never fused)
//
// The value is then stored in the element's dtype by the backend's own F32
// conversion (round to nearest even; FP8 E4M3 saturating at +-448,
// common/fp8.hpp's e4m3_from_f32_bits); a U8 element is the top byte of `bits`.
#pragma once

#include <cstdint>

#include "common/fp8.hpp"
#include "common/hash.hpp"

namespace ferry::gpu::random_fill {

using ferry::splitmix64;

// Element i's F32 value; `span` is high - low, computed once in F32 by the caller.
FERRY_HOST_DEVICE inline float value(std::uint64_t bits, float low, float span) {
  const float u = static_cast<float>(bits >> 40) * 5.9604644775390625e-8f;  // 2^-24
#ifdef __CUDA_ARCH__
  return __fadd_rn(low, __fmul_rn(span, u));
#else
  const float scaled = span * u;  // a statement of its own: never contracted into an FMA
  return low + scaled;
#endif
}

using ferry::e4m3_from_f32_bits;

}  // namespace ferry::gpu::random_fill
