// The two hashes ferry derives deterministic values from: splitmix64 (a counter's
// mixer: synthetic checkpoints' values, the dummy format's random fill, on the host
// and in the CUDA kernel alike) and FNV-1a over a name (a tensor's or a param's
// seed). Header-only so that device code can use splitmix64.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/host_device_macro.hpp"

namespace ferry {

FERRY_HOST_DEVICE constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

constexpr std::uint64_t fnv1a64(std::string_view text) {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001B3ULL;
  }
  return h;
}

}  // namespace ferry
