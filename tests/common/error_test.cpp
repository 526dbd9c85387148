#include "common/error.hpp"

#include <cerrno>

#include <gtest/gtest.h>

#include "common/dtype.hpp"

namespace ferry {
namespace {

TEST(ErrorTest, MessageNamesStageFileTensorAndRule) {
  Error e(Stage::kHeader, "model-00001.safetensors", "lm_head.weight", "size mismatch");
  EXPECT_STREQ(e.what(), "header: model-00001.safetensors: tensor 'lm_head.weight': size mismatch");
  EXPECT_EQ(e.stage(), Stage::kHeader);
  EXPECT_EQ(e.file(), "model-00001.safetensors");
  EXPECT_EQ(e.tensor(), "lm_head.weight");
}

TEST(ErrorTest, EmptyPartsAreLeftOut) {
  EXPECT_EQ(format_error(Stage::kDiscovery, "", "", "no weights"), "discovery: no weights");
}

TEST(ErrorTest, ThrowErrnoCarriesStrerror) {
  try {
    throw_errno(Stage::kRead, "a.safetensors", "pread", ENOENT);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.rule(), "pread: No such file or directory");
  }
}

TEST(DTypeTest, NamesAndSizesRoundTrip) {
  for (const char* name : {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16",
                           "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"}) {
    auto d = parse_dtype(name);
    ASSERT_TRUE(d.has_value()) << name;
    EXPECT_EQ(dtype_name(*d), name);
  }
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF64), 8u);
  EXPECT_EQ(dtype_size(DType::kF8E8M0), 1u);
  EXPECT_FALSE(parse_dtype("F4").has_value());
  EXPECT_FALSE(parse_dtype("bf16").has_value());
}

}  // namespace
}  // namespace ferry
