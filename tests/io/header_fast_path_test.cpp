// The header's SAX fast path against the document path it falls back to: a field
// the fast path does not expect (here an unknown key in the first entry, which the
// document path ignores) sends the same header down the document path, and both
// must give the same tensors, in the same order, and the same metadata.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/safetensors.hpp"

namespace ferry::io {
namespace {

using ::testing::HasSubstr;

struct Header {
  std::string text;  // with {EXTRA} where the first entry may get an unknown field
  std::uint64_t data_bytes = 0;
};

// Random valid headers: names in random order, some zero-sized tensors sharing an
// offset, optional metadata, shapes of rank 0 to 3.
Header random_header(std::mt19937_64& rng) {
  const char* dtypes[] = {"BF16", "F32", "U8", "I64", "F16"};
  const std::uint64_t sizes[] = {2, 4, 1, 8, 2};
  const int count = 1 + static_cast<int>(rng() % 40);
  std::vector<int> order(count);
  for (int i = 0; i < count; ++i) {
    order[i] = i;
  }
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::string> entries(count);
  std::uint64_t offset = 0;
  for (int i = 0; i < count; ++i) {
    const int d = static_cast<int>(rng() % 5);
    std::vector<std::uint64_t> shape(rng() % 4);
    std::uint64_t n = sizes[d];
    for (auto& dim : shape) {
      dim = rng() % 4 == 0 ? 0 : 1 + rng() % 5;
      n *= dim;
    }
    std::string shape_text = "[";
    for (std::size_t k = 0; k < shape.size(); ++k) {
      shape_text += (k ? "," : "") + std::to_string(shape[k]);
    }
    shape_text += "]";
    entries[i] = "\"t" + std::to_string(order[i]) + "\":{\"dtype\":\"" + dtypes[d] +
                 "\",\"shape\":" + shape_text + ",\"data_offsets\":[" + std::to_string(offset) +
                 "," + std::to_string(offset + n) + "]{EXTRA}}";
    offset += n;
  }
  std::shuffle(entries.begin(), entries.end(), rng);
  Header h;
  h.text = "{";
  if (rng() % 2 == 0) {
    h.text += R"("__metadata__":{"format":"pt","b":"x"},)";
  }
  for (int i = 0; i < count; ++i) {
    h.text += (i ? "," : "") + entries[i];
  }
  h.text += "}";
  h.data_bytes = offset;
  return h;
}

std::string with_extra(std::string text, const std::string& extra) {
  const std::string mark = "{EXTRA}";
  std::size_t at = text.find(mark);
  text.replace(at, mark.size(), extra);
  for (at = text.find(mark); at != std::string::npos; at = text.find(mark)) {
    text.replace(at, mark.size(), "");
  }
  return text;
}

void expect_same(const SafetensorsHeader& a, const SafetensorsHeader& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    SCOPED_TRACE(a.tensors[i].name);
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
    EXPECT_EQ(a.tensors[i].dtype, b.tensors[i].dtype);
    EXPECT_EQ(a.tensors[i].shape, b.tensors[i].shape);
    EXPECT_EQ(a.tensors[i].offset, b.tensors[i].offset);
    EXPECT_EQ(a.tensors[i].nbytes, b.tensors[i].nbytes);
    EXPECT_EQ(a.tensors[i].file, b.tensors[i].file);
  }
  EXPECT_EQ(a.metadata, b.metadata);
  EXPECT_EQ(a.header_bytes, b.header_bytes);
}

TEST(HeaderFastPath, AgreesWithTheDocumentPathOnRandomHeaders) {
  std::mt19937_64 rng(20261130);
  for (int round = 0; round < 300; ++round) {
    SCOPED_TRACE(round);
    Header h = random_header(rng);
    const std::string fast = with_extra(h.text, "");
    // Same length, so that the data region starts at the same offset.
    const std::string slow = with_extra(h.text, ",\"x\":0");
    const std::string fast_padded = fast + std::string(slow.size() - fast.size(), ' ');
    SafetensorsHeader a =
        parse_safetensors_header(fast_padded, 8 + slow.size() + h.data_bytes, "f");
    SafetensorsHeader b = parse_safetensors_header(slow, 8 + slow.size() + h.data_bytes, "f");
    expect_same(a, b);
    if (HasFailure()) {
      ADD_FAILURE() << fast;
      return;
    }
  }
}

TEST(HeaderFastPath, ZeroSizedTensorsAtOneOffsetAreInNameOrder) {
  const std::string text = R"({"b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                           R"("a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                           R"("c":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  SafetensorsHeader h = parse_safetensors_header(text, 8 + text.size() + 2, "f");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "a");
  EXPECT_EQ(h.tensors[1].name, "b");
  EXPECT_EQ(h.tensors[2].name, "c");
}

TEST(HeaderFastPath, WhatItDoesNotExpectKeepsTheDocumentPathsErrors) {
  struct Case {
    std::string text;
    std::string says;
  };
  const std::vector<Case> cases = {
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "duplicate key 'a'"},
      {R"({"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "duplicate key 'dtype'"},
      {R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", "unknown dtype 'Q4'"},
      {R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "is negative"},
      {R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "is not an integer"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", "needs 4"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "is before begin"},
      {R"({"a":{"dtype":"F32","shape":[1]}})", "data_offsets"},
      {R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "__metadata__ must map strings to strings"},
      {R"([1,2])", "not an object"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", "does not parse"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    EXPECT_THAT([&] { parse_safetensors_header(c.text, 8 + c.text.size() + 4, "f"); },
                ::testing::ThrowsMessage<Error>(HasSubstr(c.says)));
  }
}

TEST(IndexFastPath, AgreesWithTheDocumentPathOnRandomIndexes) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    SCOPED_TRACE(round);
    std::string map;
    const int count = static_cast<int>(rng() % 50);
    std::vector<int> order(count);
    for (int i = 0; i < count; ++i) {
      order[i] = i;
    }
    std::shuffle(order.begin(), order.end(), rng);
    for (int i = 0; i < count; ++i) {
      map += (i ? ",\"w" : "\"w") + std::to_string(order[i]) + "\":\"model-0000" +
             std::to_string(1 + rng() % 3) + "-of-00003.safetensors\"";
    }
    std::string metadata;
    switch (rng() % 4) {
      case 0:
        metadata = R"("metadata":{"total_size":12345},)";
        break;
      case 1:
        metadata = R"("metadata":{"total_size":1.0e3,"format":"pt"},)";
        break;
      case 2:
        metadata = R"("metadata":{"total_size":-4,"note":null},)";
        break;
      default:
        break;
    }
    const std::string fast = "{" + metadata + "\"weight_map\":{" + map + "}}";
    // Another top-level key is not the fast path's: the document path reads it.
    const std::string slow = "{" + metadata + "\"weight_map\":{" + map + "},\"extra\":[1]}";
    WeightIndex a = parse_weight_index(fast, "i");
    WeightIndex b = parse_weight_index(slow, "i");
    EXPECT_EQ(a.weight_map, b.weight_map);
    EXPECT_EQ(a.total_size, b.total_size);
    EXPECT_EQ(a.file, b.file);
  }
  EXPECT_THAT([] { parse_weight_index(R"({"weight_map":{"a":"x","a":"y"}})", "i"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("duplicate key 'a'")));
  EXPECT_THAT([] { parse_weight_index(R"({"weight_map":{"a":1}})", "i"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("is not a file name")));
  EXPECT_THAT([] { parse_weight_index(R"({"metadata":{}})", "i"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no \"weight_map\" object")));
}

}  // namespace
}  // namespace ferry::io
