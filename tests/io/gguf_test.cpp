// The GGUF header parser (io/gguf.hpp) and writer (io/gguf_writer.hpp): round trips
// of every value type and of F32/F16/BF16/Q8_0 tensors through a file and through
// memory, and every hostile header the parser refuses, each with its message, in
// bounded time and memory (huge counts, lengths past the file, unknown types,
// overlapping and misaligned tensors, a small file truncated at every byte).
#include "io/gguf.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/gguf_types.hpp"
#include "io/gguf_writer.hpp"
#include "testing/error_of.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

using ferry::testing::error_of;
using ferry::testing::TempDir;

// Raw GGUF bytes, for headers the writer would never make.
struct Raw {
  std::string b;
  Raw& u8(std::uint8_t v) {
    b.push_back(static_cast<char>(v));
    return *this;
  }
  Raw& u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i, v >>= 8) {
      b.push_back(static_cast<char>(v & 0xff));
    }
    return *this;
  }
  Raw& u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) {
      b.push_back(static_cast<char>(v & 0xff));
    }
    return *this;
  }
  Raw& str(std::string_view s) {
    u64(s.size());
    b.append(s);
    return *this;
  }
  Raw& preamble(std::uint64_t tensors, std::uint64_t kvs, std::uint32_t version = 3) {
    b = "GGUF";
    return u32(version).u64(tensors).u64(kvs);
  }
  Raw& kv_u32(std::string_view key, std::uint32_t v) { return str(key).u32(4).u32(v); }
  Raw& tensor(std::string_view name, std::vector<std::uint64_t> dims, std::uint32_t type,
              std::uint64_t offset) {
    str(name).u32(static_cast<std::uint32_t>(dims.size()));
    for (std::uint64_t d : dims) {
      u64(d);
    }
    return u32(type).u64(offset);
  }
  Raw& pad(std::size_t alignment = 32) {
    while (b.size() % alignment != 0) {
      b.push_back('\0');
    }
    return *this;
  }
  Raw& zeros(std::size_t n) {
    b.append(n, '\0');
    return *this;
  }
};

std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

GgufHeader parse(const std::string& s, const GgufParseOptions& o = {}) {
  return parse_gguf_header(bytes_of(s), "t.gguf", o);
}

std::string refusal(const std::string& s, const GgufParseOptions& o = {}) {
  return error_of(Stage::kHeader, [&] { parse(s, o); });
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  }
  return out;
}

GgufMetadata every_type() {
  using T = GgufValueType;
  GgufMetadata m;
  m.emplace_back("general.architecture", GgufValue::of_string("llama"));
  m.emplace_back("t.u8", GgufValue::of_uint(T::kU8, 200));
  m.emplace_back("t.i8", GgufValue::of_int(T::kI8, -100));
  m.emplace_back("t.u16", GgufValue::of_uint(T::kU16, 60000));
  m.emplace_back("t.i16", GgufValue::of_int(T::kI16, -30000));
  m.emplace_back("t.u32", GgufValue::of_u32(4000000000u));
  m.emplace_back("t.i32", GgufValue::of_i32(-2000000000));
  m.emplace_back("t.f32", GgufValue::of_f32(1e-5f));
  m.emplace_back("t.bool", GgufValue::of_bool(true));
  m.emplace_back("t.string", GgufValue::of_string("h\xc3\xa9llo"));
  m.emplace_back("t.u64", GgufValue::of_u64(0xfedcba9876543210ull));
  m.emplace_back("t.i64", GgufValue::of_int(T::kI64, -(std::int64_t{1} << 62)));
  m.emplace_back("t.f64", GgufValue::of_f64(500000.25));
  m.emplace_back("t.sections",
                 GgufValue::array(T::kI32, {GgufValue::of_i32(24), GgufValue::of_i32(20),
                                            GgufValue::of_i32(-1)}));
  m.emplace_back("t.words", GgufValue::array(
                                T::kString, {GgufValue::of_string("a"), GgufValue::of_string("")}));
  m.emplace_back(
      "t.nested",
      GgufValue::array(T::kArray, {GgufValue::array(T::kU8, {GgufValue::of_uint(T::kU8, 7)}),
                                   GgufValue::array(T::kF64, {})}));
  return m;
}

TEST(Gguf, EveryValueTypeRoundTripsThroughTheWriter) {
  std::vector<GgufWriterTensor> tensors;
  const std::vector<std::byte> none;
  const std::vector<std::byte> file = gguf_file_bytes(every_type(), tensors, {});
  const GgufHeader h = parse_gguf_header(file, "m.gguf");
  EXPECT_EQ(h.version, 3u);
  EXPECT_EQ(h.alignment, 32u);
  EXPECT_EQ(h.metadata.size(), every_type().size());
  EXPECT_EQ(h.architecture(), "llama");
  EXPECT_EQ(h.find("t.u8")->as_uint(), 200u);
  EXPECT_EQ(h.find("t.i8")->i, -100);
  EXPECT_EQ(h.find("t.i8")->as_uint(), std::nullopt);
  EXPECT_EQ(h.find("t.u16")->u, 60000u);
  EXPECT_EQ(h.find("t.i16")->i, -30000);
  EXPECT_EQ(h.find("t.u32")->u, 4000000000u);
  EXPECT_EQ(h.find("t.i32")->i, -2000000000);
  EXPECT_EQ(h.find("t.f32")->f, static_cast<double>(1e-5f));
  EXPECT_EQ(h.find("t.bool")->as_bool(), true);
  EXPECT_EQ(h.find("t.string")->as_string(), "h\xc3\xa9llo");
  EXPECT_EQ(h.find("t.u64")->u, 0xfedcba9876543210ull);
  EXPECT_EQ(h.find("t.i64")->i, -(std::int64_t{1} << 62));
  EXPECT_EQ(h.find("t.f64")->as_double(), 500000.25);
  const GgufValue& sections = *h.find("t.sections");
  ASSERT_TRUE(sections.is_array());
  EXPECT_TRUE(sections.kept);
  EXPECT_EQ(sections.element_type, GgufValueType::kI32);
  ASSERT_EQ(sections.elements.size(), 3u);
  EXPECT_EQ(sections.elements[2].i, -1);
  EXPECT_EQ(h.find("t.words")->elements[0].s, "a");
  const GgufValue& nested = *h.find("t.nested");
  ASSERT_EQ(nested.elements.size(), 2u);
  EXPECT_EQ(nested.elements[0].elements[0].u, 7u);
  EXPECT_EQ(nested.elements[1].count, 0u);
  EXPECT_EQ(h.find("t.nested")->describe(), "array of 2 array");
  EXPECT_EQ(h.find("t.u32")->describe(), "u32 4000000000");
  EXPECT_TRUE(h.tensors.empty());
}

TEST(Gguf, TensorsRoundTripThroughAFileAtEachAlignment) {
  TempDir dir;
  for (std::uint64_t alignment : {std::uint64_t{32}, std::uint64_t{1}, std::uint64_t{4096}}) {
    const std::string path = dir.file("m" + std::to_string(alignment) + ".gguf");
    GgufWriter w(path);
    w.set_alignment(alignment);
    w.add_metadata("general.architecture", GgufValue::of_string("llama"));
    w.add_tensor("a", GgmlType::kF32, {3, 2});
    w.add_tensor("b", GgmlType::kF16, {5});
    w.add_tensor("c", GgmlType::kBF16, {4, 1, 3});
    w.add_tensor("d", GgmlType::kQ8_0, {64, 2});
    const std::vector<std::vector<std::byte>> data = {pattern(24, 1), pattern(10, 2),
                                                      pattern(24, 3), pattern(136, 4)};
    w.begin();
    for (const auto& d : data) {
      // In two pieces, so a tensor's bytes may arrive across calls.
      w.write(std::span(d).first(d.size() / 2));
      w.write(std::span(d).subspan(d.size() / 2));
    }
    w.finish();

    const GgufHeader h = read_gguf_header(path, "m.gguf");
    EXPECT_EQ(h.alignment, alignment);
    EXPECT_EQ(h.data_offset, w.data_offset());
    EXPECT_EQ(h.data_offset % alignment, 0u);
    EXPECT_TRUE(h.identity.known());
    ASSERT_EQ(h.tensors.size(), 4u);
    const std::string file = testing::read_file(path);
    EXPECT_EQ(file.size() % alignment, 0u);  // the last tensor is padded too
    const char* names[] = {"a", "b", "c", "d"};
    const std::uint64_t nbytes[] = {24, 10, 24, 136};
    for (std::size_t i = 0; i < 4; ++i) {
      const GgufTensorInfo& t = h.tensors[i];
      EXPECT_EQ(t.name, names[i]);
      EXPECT_EQ(t.nbytes, nbytes[i]);
      EXPECT_EQ(t.offset % alignment, 0u);
      EXPECT_EQ(t.offset, h.data_offset + t.relative_offset);
      EXPECT_EQ(std::memcmp(file.data() + t.offset, data[i].data(), t.nbytes), 0) << t.name;
    }
    EXPECT_EQ(h.tensors[2].shape(), (std::vector<std::uint64_t>{3, 1, 4}));
    EXPECT_EQ(h.tensors[3].rows(), 2u);
    EXPECT_EQ(h.tensors[3].row_bytes(), 68u);
    if (alignment != 32) {
      EXPECT_EQ(h.find("general.alignment")->type, GgufValueType::kU32);
    } else {
      EXPECT_EQ(h.find("general.alignment"), nullptr);
    }
    // The same bytes parsed from memory give the same header.
    const GgufHeader m = parse(file);
    ASSERT_EQ(m.tensors.size(), 4u);
    EXPECT_EQ(m.tensors[3].offset, h.tensors[3].offset);
    EXPECT_EQ(m.data_offset, h.data_offset);
  }
}

TEST(Gguf, TensorInfoForALoaderKeepsPlainTypesAndGivesQuantizedOnesInBytes) {
  std::vector<GgufWriterTensor> ts = {{"w", GgmlType::kBF16, {8, 3}},
                                      {"q", GgmlType::kQ4_K, {512, 2}}};
  const std::vector<std::byte> a = pattern(48, 0), b = pattern(2 * 288, 1);
  const GgufHeader h = parse_gguf_header(gguf_file_bytes({}, ts, {a, b}), "m.gguf");
  const TensorInfo w = to_tensor_info(h.tensors[0], "m.gguf");
  EXPECT_EQ(w.dtype, DType::kBF16);
  EXPECT_EQ(w.shape, (std::vector<std::uint64_t>{3, 8}));
  EXPECT_EQ(w.nbytes, 48u);
  const TensorInfo q = to_tensor_info(h.tensors[1], "m.gguf");
  EXPECT_EQ(q.dtype, DType::kU8);
  EXPECT_EQ(q.shape, (std::vector<std::uint64_t>{2, 288}));
  EXPECT_EQ(q.offset, h.tensors[1].offset);
  EXPECT_EQ(q.elements(), q.nbytes);
}

TEST(Gguf, LongArraysKeepTypeAndCountOnly) {
  Raw r;
  r.preamble(0, 3);
  r.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(100000);
  for (int i = 0; i < 100000; ++i) {
    r.str("tok" + std::to_string(i));
  }
  r.str("tokenizer.ggml.scores").u32(9).u32(6).u64(100000).zeros(400000);
  r.str("short").u32(9).u32(4).u64(2).u32(1).u32(2);
  const GgufHeader h = parse(r.b);
  const GgufValue& tokens = *h.find("tokenizer.ggml.tokens");
  EXPECT_FALSE(tokens.kept);
  EXPECT_EQ(tokens.count, 100000u);
  EXPECT_EQ(tokens.element_type, GgufValueType::kString);
  EXPECT_TRUE(tokens.elements.empty());
  EXPECT_EQ(h.find("tokenizer.ggml.scores")->count, 100000u);
  EXPECT_TRUE(h.find("short")->kept);
  // Past the budget of kept elements, short arrays keep only their count too.
  GgufParseOptions o;
  o.max_kept_elements = 1;
  EXPECT_FALSE(parse(r.b, o).find("short")->kept);
}

TEST(Gguf, RefusesBadPreambles) {
  EXPECT_NE(refusal("GGUF").find("too short for GGUF's 24-byte preamble"), std::string::npos);
  Raw r;
  r.preamble(0, 0);
  r.b[0] = 'X';
  EXPECT_NE(refusal(r.b).find("not a GGUF file"), std::string::npos);
  EXPECT_NE(refusal(Raw().preamble(0, 0, 1).b).find("GGUF version 1 is not supported"),
            std::string::npos);
  EXPECT_NE(refusal(Raw().preamble(0, 0, 4).b).find("GGUF version 4 is not supported"),
            std::string::npos);
  EXPECT_NE(refusal(Raw().preamble(0, 0, 0x03000000).b).find("big-endian"), std::string::npos);
  EXPECT_EQ(parse(Raw().preamble(0, 0, 2).b).version, 2u);
}

TEST(Gguf, RefusesCountsTheFileCannotHoldBeforeAllocating) {
  const auto start = std::chrono::steady_clock::now();
  const std::string kvs = refusal(Raw().preamble(0, ~0ull).b);
  EXPECT_NE(kvs.find("metadata key count 18446744073709551615 needs at least 13 bytes each"),
            std::string::npos)
      << kvs;
  const std::string tensors = refusal(Raw().preamble(std::uint64_t{1} << 62, 0).zeros(64).b);
  EXPECT_NE(tensors.find("tensor count 4611686018427387904 needs at least 33 bytes each"),
            std::string::npos)
      << tensors;
  // An array of 2^40 u8 in a small file.
  const std::string array =
      refusal(Raw().preamble(0, 1).str("k").u32(9).u32(0).u64(std::uint64_t{1} << 40).b);
  EXPECT_NE(array.find("metadata key 'k': 1099511627776 elements of u8 need at least 1 bytes"),
            std::string::npos)
      << array;
  // An array of 2^59 strings: each needs its 8-byte length.
  const std::string strings =
      refusal(Raw().preamble(0, 1).str("k").u32(9).u32(8).u64(std::uint64_t{1} << 59).zeros(64).b);
  EXPECT_NE(strings.find("elements of string need at least 8 bytes each"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST(Gguf, RefusesStringsPastTheEndOfTheFile) {
  const std::string key = refusal(Raw().preamble(0, 1).u64(std::uint64_t{1} << 60).zeros(8).b);
  EXPECT_NE(key.find("a metadata key: length 1152921504606846976 at offset 24 runs past the end "
                     "of the file"),
            std::string::npos)
      << key;
  const std::string value = refusal(Raw().preamble(0, 1).str("k").u32(8).u64(1000).b);
  EXPECT_NE(value.find("metadata key 'k': length 1000"), std::string::npos) << value;
  const std::string name = refusal(Raw().preamble(1, 0).u64(77).zeros(40).b);
  EXPECT_NE(name.find("tensor info 0 (its name): length 77"), std::string::npos) << name;
}

TEST(Gguf, RefusesAHeaderPastTheMetadataCap) {
  Raw r;
  r.preamble(0, 1).str("chat_template").u32(8).str(std::string(5000, 'x'));
  GgufParseOptions o;
  o.max_metadata_bytes = 4096;
  const std::string e = refusal(r.b, o);
  EXPECT_NE(e.find("metadata key 'chat_template' at offset 57 runs past io.max_metadata_bytes "
                   "(4096 bytes"),
            std::string::npos)
      << e;
  o.max_metadata_bytes = 8192;
  EXPECT_EQ(parse(r.b, o).find("chat_template")->s.size(), 5000u);
  // A count the cap cannot hold is refused before any entry is read.
  Raw many;
  many.preamble(0, 1000).zeros(20000);
  o.max_metadata_bytes = 1000;
  EXPECT_NE(refusal(many.b, o).find("io.max_metadata_bytes leaves"), std::string::npos);
}

TEST(Gguf, RefusesUnknownValueTypesDeepArraysAndDuplicateKeys) {
  EXPECT_NE(refusal(Raw().preamble(0, 1).str("k").u32(13).u64(0).b)
                .find("metadata key 'k': unknown GGUF value type 13"),
            std::string::npos);
  EXPECT_NE(refusal(Raw().preamble(0, 1).str("k").u32(9).u32(77).u64(0).b)
                .find("metadata key 'k': unknown GGUF value type 77"),
            std::string::npos);
  Raw deep;
  deep.preamble(0, 1).str("k").u32(9);
  for (int i = 0; i < 3; ++i) {
    deep.u32(9).u64(1);
  }
  deep.u32(4).u64(0).zeros(8);
  EXPECT_NE(refusal(deep.b).find("metadata key 'k': arrays nested more than 3 deep"),
            std::string::npos);
  EXPECT_NE(refusal(Raw().preamble(0, 2).kv_u32("k", 1).kv_u32("k", 2).b)
                .find("metadata key 'k' appears twice"),
            std::string::npos);
}

TEST(Gguf, RefusesBadAlignments) {
  EXPECT_NE(refusal(Raw().preamble(0, 1).str("general.alignment").u32(10).u64(64).b)
                .find("'general.alignment' must be a u32, not u64 64"),
            std::string::npos);
  EXPECT_NE(refusal(Raw().preamble(0, 1).kv_u32("general.alignment", 48).b)
                .find("'general.alignment' is 48: not a power of two"),
            std::string::npos);
  EXPECT_NE(refusal(Raw().preamble(0, 1).kv_u32("general.alignment", 0).b)
                .find("is 0: not a power of two"),
            std::string::npos);
}

// One tensor info with the rest of a valid file around it.
std::string one_tensor(std::vector<std::uint64_t> dims, std::uint32_t type, std::uint64_t offset,
                       std::size_t data = 64, std::string_view name = "w") {
  Raw r;
  r.preamble(1, 0).tensor(name, std::move(dims), type, offset).pad().zeros(data);
  return r.b;
}

TEST(Gguf, RefusesBadTensorInfos) {
  const auto says = [](const std::string& file, const std::string& words) {
    const std::string e = refusal(file);
    EXPECT_NE(e.find(words), std::string::npos) << e;
  };
  says(one_tensor({4}, 31, 0), "tensor 'w': unknown ggml type number 31");
  says(one_tensor({4}, 4, 0), "unknown ggml type number 4");
  says(one_tensor({4}, 1000, 0), "unknown ggml type number 1000");
  says(one_tensor({}, 0, 0), "n_dims is 0: must be 1 to 4");
  says(one_tensor({1, 1, 1, 1, 1}, 0, 0), "n_dims is 5");
  says(one_tensor({4, 0}, 0, 0), "has a dimension of 0 in [4, 0]");
  says(one_tensor({std::uint64_t{1} << 32, std::uint64_t{1} << 32}, 0, 0),
       "overflow 64 bits of elements");
  says(one_tensor({std::uint64_t{1} << 62}, 0, 0), "overflow 64 bits of bytes");
  says(one_tensor({33}, 8, 0),
       "dims[0] (the row length) is 33, not a multiple of Q8_0's block "
       "of 32 elements");
  says(one_tensor({300}, 12, 0), "not a multiple of Q4_K's block of 256");
  says(one_tensor({4}, 0, 16), "data offset 16 is not a multiple of the alignment (32)");
  says(one_tensor({32}, 0, 0), "run past the end of the file");
  says(one_tensor({4}, 0, ~0ull - 31), "run past the end of the file");
  says(one_tensor({4}, 0, 0, 64, ""), "tensor info 0: empty tensor name");
  says(one_tensor({4}, 0, 0, 64, std::string(64, 'n')), "name is 64 bytes; ggml's limit is 63");
  EXPECT_EQ(parse(one_tensor({4}, 0, 0, 64, std::string(63, 'n'))).tensors.size(), 1u);
}

TEST(Gguf, RefusesOverlappingAndDuplicateTensors) {
  Raw overlap;
  overlap.preamble(2, 0).tensor("a", {16}, 0, 0).tensor("b", {8}, 0, 32).pad().zeros(128);
  const std::string e = refusal(overlap.b);
  EXPECT_NE(e.find("tensor 'b': bytes"), std::string::npos) << e;
  EXPECT_NE(e.find("overlap tensor 'a'"), std::string::npos) << e;
  Raw same;
  same.preamble(2, 0).tensor("a", {8}, 0, 32).tensor("b", {8}, 0, 32).pad().zeros(128);
  EXPECT_NE(refusal(same.b).find("overlap"), std::string::npos);
  Raw twice;
  twice.preamble(2, 0).tensor("a", {8}, 0, 0).tensor("a", {8}, 0, 32).pad().zeros(128);
  EXPECT_NE(refusal(twice.b).find("tensor 'a': two tensors have this name (tensor infos 0 and 1)"),
            std::string::npos);
  // Out of order and with gaps is fine: sorted by offset.
  Raw gaps;
  gaps.preamble(2, 0).tensor("late", {8}, 0, 64).tensor("early", {8}, 0, 0).pad().zeros(128);
  const GgufHeader h = parse(gaps.b);
  EXPECT_EQ(h.tensors[0].name, "early");
  EXPECT_EQ(h.tensors[1].name, "late");
}

TEST(Gguf, RefusesATruncatedFileAtEveryByte) {
  std::vector<GgufWriterTensor> ts = {{"a", GgmlType::kF32, {3}}, {"b", GgmlType::kQ8_0, {32}}};
  GgufMetadata m = every_type();
  const std::vector<std::byte> a = pattern(12, 0), b = pattern(34, 1);
  const std::vector<std::byte> file = gguf_file_bytes(m, ts, {a, b});
  const GgufHeader full = parse_gguf_header(file, "m.gguf");
  const std::uint64_t end = full.tensors.back().offset + full.tensors.back().nbytes;
  for (std::size_t n = 0; n < file.size(); ++n) {
    const std::span<const std::byte> prefix(file.data(), n);
    if (n < end) {
      try {
        parse_gguf_header(prefix, "m.gguf");
        ADD_FAILURE() << "a prefix of " << n << " bytes parsed";
      } catch (const Error& e) {
        EXPECT_EQ(e.stage(), Stage::kHeader);
        EXPECT_EQ(e.file(), "m.gguf");
      }
    } else {
      // Cutting only the final padding leaves every tensor's bytes.
      EXPECT_EQ(parse_gguf_header(prefix, "m.gguf").tensors.size(), 2u) << n;
    }
  }
}

TEST(Gguf, AReadThatComesBackShortIsAnError) {
  const std::string file = one_tensor({4}, 0, 0);
  const GgufReadAt short_reads = [&](std::uint64_t offset, std::span<std::byte> into) {
    const std::size_t n =
        std::min<std::size_t>(into.size(), 30 - std::min<std::size_t>(30, offset));
    std::memcpy(into.data(), file.data() + offset, n);
    return n;
  };
  const std::string e =
      error_of(Stage::kHeader, [&] { parse_gguf_header(short_reads, file.size(), "t.gguf"); });
  EXPECT_NE(e.find("the file is shorter than its size said"), std::string::npos) << e;
}

TEST(Gguf, ReadsInBoundedChunks) {
  Raw r;
  r.preamble(0, 1).str("big").u32(8).str(std::string(300000, 'x'));
  std::size_t largest = 0;
  const GgufReadAt read_at = [&](std::uint64_t offset, std::span<std::byte> into) {
    largest = std::max(largest, into.size());
    std::memcpy(into.data(), r.b.data() + offset, into.size());
    return into.size();
  };
  EXPECT_EQ(parse_gguf_header(read_at, r.b.size(), "t.gguf").find("big")->s.size(), 300000u);
  EXPECT_LE(largest, 64u * 1024u);
}

TEST(Gguf, HasGgufMagic) {
  const std::string yes = "GGUF\x03";
  EXPECT_TRUE(has_gguf_magic(bytes_of(yes)));
  EXPECT_FALSE(has_gguf_magic(bytes_of(std::string("GGU"))));
  EXPECT_FALSE(has_gguf_magic(bytes_of(std::string("\x08\0\0\0", 4))));
}

TEST(GgufWriter, RefusesWhatTheParserWouldRefuse) {
  const auto says = [](GgufMetadata m, std::vector<GgufWriterTensor> ts, std::uint64_t alignment,
                       const std::string& words) {
    const std::string e =
        error_of(Stage::kSynth, [&] { gguf_header_bytes(m, ts, alignment, "w.gguf"); });
    EXPECT_NE(e.find(words), std::string::npos) << e;
  };
  says({}, {{"", GgmlType::kF32, {4}}}, 32, "tensor names must be 1 to 63 bytes");
  says({}, {{"a", GgmlType::kF32, {4}}, {"a", GgmlType::kF32, {4}}}, 32, "declared twice");
  says({}, {{"a", GgmlType::kQ8_0, {31}}}, 32, "not whole blocks of Q8_0");
  says({}, {{"a", GgmlType::kF32, {4, 0}}}, 32, "none of them 0");
  says({}, {{"a", GgmlType::kF32, {4}}}, 48, "alignment 48 is not a power of two");
  says({{"general.alignment", GgufValue::of_u32(64)}}, {}, 32, "the writer's (set_alignment)");
  says({{"k", GgufValue::of_u32(1)}, {"k", GgufValue::of_u32(2)}}, {}, 32, "given twice");
  says({{"k", GgufValue::of_uint(GgufValueType::kU8, 256)}}, {}, 32, "256 does not fit a u8");
  says({{"k", GgufValue::array(GgufValueType::kU32, {GgufValue::of_i32(1)})}}, {}, 32,
       "an element of type i32 in an array of u32");
}

TEST(GgufWriter, RefusesMisuseAndLeavesNoFileBehind) {
  TempDir dir;
  const std::string path = dir.file("w.gguf");
  {
    GgufWriter w(path);
    w.add_tensor("a", GgmlType::kF32, {2});
    w.begin();
    const std::vector<std::byte> nine(9);
    EXPECT_NE(error_of(Stage::kSynth, [&] { w.write(nine); }).find("9 bytes given, but only 8"),
              std::string::npos);
    w.write(std::span(nine).first(4));
    EXPECT_NE(error_of(Stage::kSynth, [&] { w.finish(); }).find("only 4 of its 8 bytes"),
              std::string::npos);
  }
  EXPECT_TRUE(testing::names_in(dir.path()).empty());
}

}  // namespace
}  // namespace ferry::io
