// The header's three paths (io/safetensors_internal.hpp) against each other: the
// plain scanner, the SAX pass and the document path must give the same tensors, in
// the same order, and the same metadata wherever they accept a header. Random
// headers are read by each path directly; an escaped name is the SAX pass's and
// not the scanner's, and an unknown entry field (which the document path ignores)
// is skipped by the SAX pass too, so that no valid header builds a document.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_internal.hpp"

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

// `text` with the first tensor name's leading 't' written as the escape \u0074:
// the same header to a JSON reader, not to the plain scanner.
std::string escaped(std::string text) {
  const std::size_t at = text.find("\"t");
  text.replace(at + 1, 1, "\\u0074");
  return text;
}

TEST(HeaderFastPath, ThePlainScannerTheSaxPassAndTheDocumentPathAgree) {
  std::mt19937_64 rng(20261130);
  for (int round = 0; round < 300; ++round) {
    SCOPED_TRACE(round);
    Header h = random_header(rng);
    // Three spellings of one header, padded with trailing spaces to one length so
    // that the data region starts at one offset.
    std::string plain = with_extra(h.text, "");
    std::string esc = escaped(plain);
    // An unknown field, its value a scalar or nested (a repeated key only inside
    // different objects, which is no duplicate).
    const char* extras[] = {",\"x\":0", R"(,"x":{"k":[1,{"k":-2.5}],"j":null},"y":"s")",
                            R"(,"x":[[],{},true])"};
    std::string doc = with_extra(h.text, extras[round % 3]);
    const std::size_t length = std::max({plain.size(), esc.size(), doc.size()});
    for (std::string* t : {&plain, &esc, &doc}) {
      t->append(length - t->size(), ' ');
    }
    const std::string& plain_padded = plain;
    const std::uint64_t file_size = 8 + doc.size() + h.data_bytes;
    std::optional<SafetensorsHeader> a = detail::parse_header_plain(plain_padded, file_size, "f");
    std::optional<SafetensorsHeader> b = detail::parse_header_sax(plain_padded, file_size, "f");
    ASSERT_TRUE(a.has_value()) << plain;
    ASSERT_TRUE(b.has_value()) << plain;
    SafetensorsHeader c = detail::parse_header_document(plain_padded, file_size, "f");
    expect_same(*a, *b);
    expect_same(*a, c);
    // The escaped name: the scanner declines, the SAX pass and the document agree.
    EXPECT_FALSE(detail::parse_header_plain(esc, file_size, "f").has_value());
    std::optional<SafetensorsHeader> d = detail::parse_header_sax(esc, file_size, "f");
    ASSERT_TRUE(d.has_value());
    expect_same(*a, *d);
    expect_same(*a, detail::parse_header_document(esc, file_size, "f"));
    // The unknown field: the scanner declines, the SAX pass skips it as the
    // document path ignores it, to the same result.
    EXPECT_FALSE(detail::parse_header_plain(doc, file_size, "f").has_value());
    std::optional<SafetensorsHeader> e = detail::parse_header_sax(doc, file_size, "f");
    ASSERT_TRUE(e.has_value()) << doc;
    expect_same(*a, *e);
    expect_same(*a, detail::parse_header_document(doc, file_size, "f"));
    // And the public entry point takes the first path that accepts.
    expect_same(*a, parse_safetensors_header(doc, file_size, "f"));
    if (HasFailure()) {
      ADD_FAILURE() << plain;
      return;
    }
  }
}

// What the plain scanner leaves to the other paths, one case each.
TEST(HeaderFastPath, ThePlainScannerDeclinesAnythingButPlainJson) {
  const std::string good = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  ASSERT_TRUE(detail::parse_header_plain(good, 8 + good.size() + 4, "f").has_value());
  for (
      const std::string text : {
          R"({"\u0061":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",           // escape
          "{\"\xc3\xa9\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",  // UTF-8
          R"({"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})",              // fraction
          R"({"a":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}})",              // exponent
          R"({"a":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}})",  // leading zero
          R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",  // sign
          R"({"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}})",
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})",  // unknown key
          R"({"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          R"({"__metadata__":{"k":"v","k":"w"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})",     // unknown dtype
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})",    // wrong span
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x)",  // trailing bytes
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})",     // unterminated
      }) {
    SCOPED_TRACE(text);
    EXPECT_FALSE(detail::parse_header_plain(text, 8 + text.size() + 4, "f").has_value());
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
      // Inside and among the fields the SAX pass skips, a repeated key is still named.
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1,"x":2}})",
       "duplicate key 'x'"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":[{"k":1,"k":2}]}})",
       "duplicate key 'k'"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{"k":{},"k":[]}}})",
       "duplicate key 'k'"},
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
