// QuantTraits: one row per quantization method, what models/quant.hpp says each
// stores (the contract tests of every quantized layout run through apply_quant,
// which reads these rows).
#include "models/quant_traits.hpp"

#include <gtest/gtest.h>

#include "common/error.hpp"

namespace ferry::models {
namespace {

using Method = QuantScheme::Method;

TEST(QuantTraits, EachMethodsRowSaysWhatItStores) {
  const QuantTraits& block = quant_traits(Method::kFp8Block);
  EXPECT_EQ(block.weight_dtype, DType::kF8E4M3);
  EXPECT_EQ(block.scale_dtype, DType::kF32);
  EXPECT_EQ(block.grain, ScaleGrain::kBlock);
  EXPECT_FALSE(block.group_blocks);
  EXPECT_TRUE(block.merged_expert_input);

  EXPECT_EQ(quant_traits(Method::kFp8Channel).grain, ScaleGrain::kChannel);
  EXPECT_EQ(quant_traits(Method::kFp8Tensor).grain, ScaleGrain::kShard);

  const QuantTraits& nvfp4 = quant_traits(Method::kNvfp4);
  EXPECT_EQ(nvfp4.weight_dtype, DType::kU8);  // E2M1 pairs
  EXPECT_EQ(nvfp4.values_per_byte, 2u);
  EXPECT_EQ(nvfp4.scale_dtype, DType::kF8E4M3);
  EXPECT_EQ(nvfp4.grain, ScaleGrain::kBlock);
  EXPECT_TRUE(nvfp4.group_blocks);
  EXPECT_TRUE(nvfp4.second_scale);
  EXPECT_FALSE(nvfp4.merged_expert_input);

  EXPECT_EQ(quant_traits(Method::kNone).grain, ScaleGrain::kNone);
  for (Method m : {Method::kNone, Method::kFp8Block, Method::kFp8Channel, Method::kFp8Tensor,
                   Method::kNvfp4}) {
    EXPECT_EQ(quant_traits(m).method, m);
    EXPECT_EQ(quant_traits(m).second_scale, m == Method::kNvfp4);
    EXPECT_EQ(quant_traits(m).values_per_byte, m == Method::kNvfp4 ? 2u : 1u);
  }
}

TEST(QuantTraits, AMethodWithoutARowIsAnInternalError) {
  EXPECT_THROW(quant_traits(static_cast<Method>(99)), Error);
}

}  // namespace
}  // namespace ferry::models
