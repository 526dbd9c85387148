// Element types of the safetensors format, spelled as the format spells them.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

#include "ferry/export.hpp"

namespace ferry {

enum class DType {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kU64,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
};

// Bytes per element.
FERRY_API std::size_t dtype_size(DType dtype);
// "BF16", "F8_E4M3", ... exactly as in a safetensors header.
FERRY_API std::string_view dtype_name(DType dtype);
// Parses a safetensors dtype name; nullopt for anything not in the list above.
FERRY_API std::optional<DType> parse_dtype(std::string_view name);

}  // namespace ferry
