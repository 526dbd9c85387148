#include "models/quant_traits.hpp"

#include <array>

#include "common/error.hpp"

namespace ferry::models {
namespace {

using Method = QuantScheme::Method;

// In the order of QuantScheme::Method (checked below).
constexpr std::array<QuantTraits, 5> kTraits{{
    // method, name, weight dtype, values a byte, scale dtype, grain,
    // group blocks, second scale, merged expert input
    {Method::kNone, "none", DType::kBF16, 1, DType::kF32, ScaleGrain::kNone, false, false, false},
    {Method::kFp8Block, "FP8 block", DType::kF8E4M3, 1, DType::kF32, ScaleGrain::kBlock, false,
     false, true},
    {Method::kFp8Channel, "FP8 channel", DType::kF8E4M3, 1, DType::kF32, ScaleGrain::kChannel,
     false, false, true},
    {Method::kFp8Tensor, "FP8 tensor", DType::kF8E4M3, 1, DType::kF32, ScaleGrain::kShard, false,
     false, true},
    {Method::kNvfp4, "NVFP4", DType::kU8, 2, DType::kF8E4M3, ScaleGrain::kBlock, true, true,
     false},
}};

constexpr bool rows_in_enum_order() {
  for (std::size_t i = 0; i < kTraits.size(); ++i) {
    if (static_cast<std::size_t>(kTraits[i].method) != i) {
      return false;
    }
  }
  return true;
}
static_assert(rows_in_enum_order(), "kTraits must follow QuantScheme::Method's order");

}  // namespace

const QuantTraits& quant_traits(QuantScheme::Method method) {
  const auto i = static_cast<std::size_t>(method);
  if (i >= kTraits.size()) {
    throw Error(Stage::kMapping, "", "",
                "internal: no QuantTraits row for quantization method " + std::to_string(i));
  }
  return kTraits[i];
}

}  // namespace ferry::models
