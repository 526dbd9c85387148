// safetensors header validation: every rule of the reference implementation, on a
// corpus of malformed files built here, plus the real files in ../shared/data.
#include "io/safetensors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "common/error.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::io {
namespace {

using ferry::testing::safetensors_bytes;
using ferry::testing::TempDir;
using ferry::testing::write_file;
using ::testing::HasSubstr;

// Writes `header` + `data` as a safetensors file and parses it back.
SafetensorsHeader parse_file(const TempDir& dir, std::string_view header, std::string_view data,
                             const std::string& name = "t.safetensors") {
  write_file(dir.file(name), safetensors_bytes(header, data));
  return read_safetensors_header(dir.file(name), name);
}

// Expects a header error whose message contains every fragment.
void expect_header_error(std::string_view header, std::string_view data,
                         std::vector<std::string> fragments) {
  TempDir dir;
  try {
    parse_file(dir, header, data);
    ADD_FAILURE() << "accepted: " << header;
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kHeader) << e.what();
    EXPECT_THAT(e.what(), HasSubstr("t.safetensors")) << e.what();
    for (const auto& f : fragments) {
      EXPECT_THAT(e.what(), HasSubstr(f));
    }
  }
}

TEST(SafetensorsHeaderTest, ParsesTensorsSortedByOffsetWithAbsoluteOffsets) {
  TempDir dir;
  std::string header =
      R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
      R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"__metadata__":{"format":"pt"}})";
  auto h = parse_file(dir, header, std::string(12, 'x'));
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "a");
  EXPECT_EQ(h.tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(h.tensors[0].offset, 8 + header.size());
  EXPECT_EQ(h.tensors[0].nbytes, 4u);
  EXPECT_EQ(h.tensors[1].name, "b");
  EXPECT_EQ(h.tensors[1].offset, 8 + header.size() + 4);
  EXPECT_EQ(h.header_bytes, 8 + header.size());
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(SafetensorsHeaderTest, AcceptsTrailingSpacesRankZeroAndEmptyTensors) {
  TempDir dir;
  std::string header = R"({"scalar":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
                       R"("empty":{"dtype":"F16","shape":[0,4],"data_offsets":[8,8]},)"
                       R"("e2":{"dtype":"I8","shape":[3,0],"data_offsets":[8,8]}})"
                       "      ";
  auto h = parse_file(dir, header, std::string(8, '\0'));
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "scalar");
  EXPECT_EQ(h.tensors[0].elements(), 1u);
  EXPECT_EQ(h.tensors[1].nbytes, 0u);
}

TEST(SafetensorsHeaderTest, AcceptsEveryDtypeOfTheFormat) {
  TempDir dir;
  const std::pair<const char*, int> dtypes[] = {
      {"BOOL", 1}, {"U8", 1},      {"I8", 1},      {"U16", 2},    {"I16", 2},  {"U32", 4},
      {"I32", 4},  {"U64", 8},     {"I64", 8},     {"F16", 2},    {"BF16", 2}, {"F32", 4},
      {"F64", 8},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}};
  std::string header = "{";
  std::size_t off = 0;
  for (auto [name, size] : dtypes) {
    if (off)
      header += ",";
    header += std::string("\"t_") + name + "\":{\"dtype\":\"" + name +
              "\",\"shape\":[3],\"data_offsets\":[" + std::to_string(off) + "," +
              std::to_string(off + 3 * size) + "]}";
    off += 3 * size;
  }
  header += "}";
  auto h = parse_file(dir, header, std::string(off, '\1'));
  EXPECT_EQ(h.tensors.size(), 16u);
}

TEST(SafetensorsHeaderTest, RejectsFileShorterThanLengthPrefix) {
  TempDir dir;
  write_file(dir.file("short.safetensors"), "abc");
  try {
    read_safetensors_header(dir.file("short.safetensors"), "short.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("short.safetensors"));
    EXPECT_THAT(e.what(), HasSubstr("too short"));
  }
}

TEST(SafetensorsHeaderTest, RejectsTruncatedData) {
  // The header promises 8 bytes; only 4 are there.
  expect_header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234",
                      {"tensor 'a'", "past the end of the file"});
}

TEST(SafetensorsHeaderTest, RejectsHeaderLengthPastTheEnd) {
  TempDir dir;
  std::string bytes = safetensors_bytes("{}", "");
  bytes[0] = 100;  // claims a 100-byte header in a 10-byte file
  write_file(dir.file("t.safetensors"), bytes);
  EXPECT_THAT([&] { read_safetensors_header(dir.file("t.safetensors"), "t.safetensors"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("runs past the end of the file")));
}

TEST(SafetensorsHeaderTest, RejectsOversizedHeader) {
  TempDir dir;
  std::string bytes = safetensors_bytes("{}", "");
  std::uint64_t n = kMaxHeaderBytes + 1;
  std::memcpy(bytes.data(), &n, 8);  // little-endian host
  write_file(dir.file("t.safetensors"), bytes);
  EXPECT_THAT([&] { read_safetensors_header(dir.file("t.safetensors"), "t.safetensors"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("exceeds the limit of 100000000 bytes")));
  // The in-memory parser applies the same limit.
  std::string big(kMaxHeaderBytes + 1, ' ');
  EXPECT_THROW(parse_safetensors_header(big, big.size() + 8, "x"), Error);
}

TEST(SafetensorsHeaderTest, RejectsJsonThatIsNotAnObject) {
  expect_header_error("[1,2,3]", "", {"not an object"});
  expect_header_error("\"text\"", "", {"not an object"});
}

TEST(SafetensorsHeaderTest, RejectsJsonThatDoesNotParse) {
  expect_header_error(R"({"a":)", "", {"does not parse"});
  expect_header_error(std::string_view("{}\0\0", 4), "", {"does not parse"});
}

TEST(SafetensorsHeaderTest, RejectsInvalidUtf8) {
  expect_header_error("{\"\xff\xfe\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "x",
                      {"UTF-8"});
}

TEST(SafetensorsHeaderTest, RejectsUnknownDtypeByName) {
  expect_header_error(R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", "x",
                      {"tensor 'a'", "unknown dtype 'F4'"});
  expect_header_error(R"({"a":{"dtype":"bf16","shape":[1],"data_offsets":[0,2]}})", "xx",
                      {"unknown dtype 'bf16'"});
}

TEST(SafetensorsHeaderTest, RejectsNegativeFractionalAndOverflowingShapes) {
  expect_header_error(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "x",
                      {"tensor 'a'", "negative"});
  expect_header_error(R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", "x",
                      {"not an integer"});
  expect_header_error(R"({"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,1]}})",
                      "x", {"does not fit in 64 bits"});
  expect_header_error(
      R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", "x",
      {"overflows 64 bits"});
  expect_header_error(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,1]}})",
                      "x", {"overflows 64 bits"});
  expect_header_error(R"({"a":{"dtype":"U8","shape":["1"],"data_offsets":[0,1]}})", "x",
                      {"not a number"});
}

TEST(SafetensorsHeaderTest, RejectsMalformedEntries) {
  expect_header_error(R"({"a":5})", "", {"tensor 'a'", "not an object"});
  expect_header_error(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", "x", {"dtype"});
  expect_header_error(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", "x", {"shape"});
  expect_header_error(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "x",
                      {"data_offsets"});
  expect_header_error(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", "x",
                      {"before begin"});
  expect_header_error(R"({"__metadata__":{"k":1}})", "", {"__metadata__", "strings"});
  expect_header_error(R"({"__metadata__":[1]})", "", {"__metadata__"});
}

TEST(SafetensorsHeaderTest, RejectsSizeMismatch) {
  expect_header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,6]}})", "123456",
                      {"tensor 'a'", "span 6 bytes", "needs 8"});
}

TEST(SafetensorsHeaderTest, RejectsGap) {
  expect_header_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
                      "12345", {"tensor 'b'", "gap of 1 bytes"});
  expect_header_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", "123",
                      {"tensor 'a'", "gap"});
}

TEST(SafetensorsHeaderTest, RejectsOverlap) {
  expect_header_error(R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                      "1234", {"tensor 'b'", "overlaps tensor 'a'"});
}

TEST(SafetensorsHeaderTest, RejectsOffsetsPastTheFile) {
  expect_header_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                      "1234", {"tensor 'b'", "past the end of the file"});
}

TEST(SafetensorsHeaderTest, RejectsTrailingBytes) {
  expect_header_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "1234",
                      {"2 trailing bytes"});
}

TEST(SafetensorsHeaderTest, RejectsDuplicateKeys) {
  expect_header_error(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                      R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                      "12", {"duplicate key 'a'"});
  expect_header_error(R"({"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}})", "1",
                      {"duplicate key 'dtype'"});
}

TEST(SafetensorsHeaderTest, RejectsDirectoriesAndMissingFiles) {
  TempDir dir;
  EXPECT_THAT([&] { read_safetensors_header(dir.str(), "folder"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("not a regular file")));
  EXPECT_THAT([&] { read_safetensors_header(dir.file("nope"), "nope.safetensors"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("nope.safetensors: open: No such file")));
}

// ---- the real files in ../shared/data/safetensors -------------------------------

std::string shared(const std::string& rel) {
  return ::ferry::testing::test_data_path(rel);
}

TEST(SafetensorsRealDataTest, RejectsTheMalformedSample) {
  FERRY_NEED_TEST_DATA();
  const std::string f = shared("safetensors/malformed/header-length-beyond-file.safetensors");
  EXPECT_THAT([&] { read_safetensors_header(f, "header-length-beyond-file.safetensors"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("runs past the end of the file")));
}

TEST(SafetensorsRealDataTest, ParsesEverySampleWithExactShapesAndDtypes) {
  FERRY_NEED_TEST_DATA();
  // safetensors-samples: one tensor per file of shape [6], holding -3..2.
  const std::pair<const char*, DType> samples[] = {
      {"B", DType::kU8},  {"H", DType::kU16}, {"I", DType::kU32},
      {"b", DType::kI8},  {"d", DType::kF64}, {"e", DType::kF16},
      {"f", DType::kF32}, {"h", DType::kI16}, {"i", DType::kI32}};
  for (auto [name, dtype] : samples) {
    auto h = read_safetensors_header(
        shared(std::string("safetensors/safetensors-samples/") + name + ".safetensors"), name);
    ASSERT_EQ(h.tensors.size(), 1u) << name;
    EXPECT_EQ(h.tensors[0].name, name);
    EXPECT_EQ(h.tensors[0].dtype, dtype);
    EXPECT_EQ(h.tensors[0].shape, std::vector<std::uint64_t>{6});
    EXPECT_EQ(h.tensors[0].offset + h.tensors[0].nbytes, h.file_size);
    EXPECT_EQ(h.metadata.at("test"), "a");
  }
  auto overall =
      read_safetensors_header(shared("safetensors/safetensors-samples/overall.safetensors"), "o");
  EXPECT_EQ(overall.tensors.size(), 9u);
}

TEST(SafetensorsRealDataTest, ParsesJuliaTestdata) {
  FERRY_NEED_TEST_DATA();
  auto h = read_safetensors_header(
      shared("safetensors/safetensors-jl-testdata/non_sharded/model.with_metadata.safetensors"),
      "model.with_metadata.safetensors");
  EXPECT_EQ(h.tensors.size(), 36u);
  EXPECT_EQ(h.metadata.at("version"), "2.2");
  const TensorInfo* t = nullptr;
  for (const auto& x : h.tensors) {
    if (x.name == "int64_357")
      t = &x;
  }
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kI64);
  EXPECT_EQ(t->shape, (std::vector<std::uint64_t>{3, 5, 7}));
  EXPECT_EQ(t->nbytes, 840u);
  EXPECT_EQ(t->offset, 8u + 2576u + 144u);
}

// ---- index files --------------------------------------------------------------

TEST(WeightIndexTest, ParsesWeightMapAndTotalSize) {
  auto idx = parse_weight_index(
      R"({"metadata":{"total_size":12},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})",
      "model.safetensors.index.json");
  EXPECT_EQ(idx.weight_map.size(), 2u);
  EXPECT_EQ(idx.weight_map.at("b"), "s2.safetensors");
  EXPECT_EQ(idx.total_size, 12u);
}

TEST(WeightIndexTest, RejectsBadIndexFilesNamingThem) {
  for (const char* text : {"{", "[]", R"({"metadata":{}})", R"({"weight_map":[]})",
                           R"({"weight_map":{"a":1}})", R"({"weight_map":{"a":"x","a":"y"}})"}) {
    try {
      parse_weight_index(text, "model.safetensors.index.json");
      ADD_FAILURE() << "accepted " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kIndex);
      EXPECT_THAT(e.what(), HasSubstr("model.safetensors.index.json")) << text;
    }
  }
}

TEST(WeightIndexTest, ParsesEveryRealIndexInSharedData) {
  FERRY_NEED_TEST_DATA();
  for (const char* model :
       {"llama-3.2-3b-instruct", "llama3-chinese-8b", "mistral-7b-instruct-v0.3",
        "mixtral-8x7b-v0.1", "sakura-14b-qwen2.5"}) {
    auto idx = read_weight_index(
        shared(std::string("models/") + model + "/model.safetensors.index.json"), model);
    EXPECT_GT(idx.weight_map.size(), 100u) << model;
    EXPECT_TRUE(idx.total_size.has_value()) << model;
  }
}

// ---- CheckpointIndex: cross-file checks ------------------------------------------

// Two shards: a,b in s1; c in s2. Each tensor is 2 bytes of U8.
struct TwoShards {
  TempDir dir;
  ResolvedSource source;
  TwoShards(const std::string& index_json, bool with_extra = false) {
    write_file(dir.file("s1.safetensors"),
               safetensors_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                 R"("b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                                 "aabb"));
    std::string s2 = with_extra ? R"({"c":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                  R"("x":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})"
                                : R"({"c":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
    write_file(dir.file("s2.safetensors"), safetensors_bytes(s2, with_extra ? "ccxx" : "cc"));
    write_file(dir.file("model.safetensors.index.json"), index_json);
    source.folder = dir.str();
    source.index_file = "model.safetensors.index.json";
    for (const char* n : {"s1.safetensors", "s2.safetensors"}) {
      source.files.push_back({dir.file(n), n, "test"});
    }
  }
};

constexpr const char kGoodIndex[] =
    R"({"metadata":{"total_size":6},"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors"}})";

TEST(CheckpointIndexTest, IndexesEveryTensorWithFileAndRange) {
  TwoShards ck(kGoodIndex);
  auto ci = build_checkpoint_index(ck.source);
  ASSERT_EQ(ci.tensors.size(), 3u);
  EXPECT_EQ(ci.total_bytes, 6u);
  EXPECT_TRUE(ci.warnings.empty());
  const TensorInfo* c = ci.find("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->file, "s2.safetensors");
  EXPECT_EQ(c->file_index, 1u);
  EXPECT_EQ(ci.files[1].tensor_count, 1u);
  EXPECT_EQ(ci.find("zz"), nullptr);
}

TEST(CheckpointIndexTest, TheIndexDiscoveryParsedIsNotReadAgain) {
  TwoShards ck(kGoodIndex);
  ResolvedSource resolved = resolve_source(ck.dir.str());
  ASSERT_NE(resolved.weight_index, nullptr);
  EXPECT_EQ(resolved.weight_index->weight_map.size(), 3u);
  // The file is gone after discovery: the index is built from what discovery read.
  std::filesystem::remove(ck.dir.file("model.safetensors.index.json"));
  auto ci = build_checkpoint_index(resolved);
  EXPECT_EQ(ci.tensors.size(), 3u);
  EXPECT_TRUE(ci.warnings.empty());
  // A hand-made source without the parsed index reads the file (gone here).
  resolved.weight_index.reset();
  EXPECT_THAT([&] { build_checkpoint_index(resolved); },
              ::testing::ThrowsMessage<Error>(HasSubstr("model.safetensors.index.json")));
}

TEST(CheckpointIndexTest, TensorInAnotherShardThanIndexedIsAnError) {
  TwoShards ck(
      R"({"weight_map":{"a":"s1.safetensors","b":"s2.safetensors","c":"s2.safetensors"}})");
  EXPECT_THAT([&] { build_checkpoint_index(ck.source); },
              ::testing::ThrowsMessage<Error>(
                  HasSubstr("tensor 'b': model.safetensors.index.json places it in s2.safetensors "
                            "but it is in s1.safetensors")));
}

TEST(CheckpointIndexTest, IndexedTensorInNoShardIsAnError) {
  TwoShards ck(
      R"({"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors","d":"s2.safetensors"}})");
  EXPECT_THAT([&] { build_checkpoint_index(ck.source); },
              ::testing::ThrowsMessage<Error>(HasSubstr("in no shard: d")));
}

TEST(CheckpointIndexTest, UnlistedTensorWarnsOrFailsWhenStrict) {
  TwoShards ck(kGoodIndex, /*with_extra=*/true);
  auto ci = build_checkpoint_index(ck.source);
  ASSERT_EQ(ci.warnings.size(), 2u);  // unlisted x, and total_size now disagrees
  EXPECT_THAT(ci.warnings[0], HasSubstr("not listed"));
  EXPECT_THAT(ci.warnings[0], HasSubstr("x"));
  EXPECT_THAT(ci.warnings[1], HasSubstr("total_size is 6 but the indexed tensors hold 8"));
  EXPECT_THAT([&] { build_checkpoint_index(ck.source, {.strict = true}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("load.strict")));
}

TEST(CheckpointIndexTest, TotalSizeDisagreementIsAWarning) {
  TwoShards ck(
      R"({"metadata":{"total_size":7},"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors"}})");
  auto ci = build_checkpoint_index(ck.source);
  ASSERT_EQ(ci.warnings.size(), 1u);
  EXPECT_THAT(ci.warnings[0], HasSubstr("total_size is 7"));
}

TEST(CheckpointIndexTest, SameNameInTwoShardsNamesBothFiles) {
  TempDir dir;
  write_file(dir.file("s1.safetensors"),
             safetensors_bytes(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "1"));
  write_file(dir.file("s2.safetensors"),
             safetensors_bytes(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "2"));
  ResolvedSource src;
  src.folder = dir.str();
  src.files = {{dir.file("s1.safetensors"), "s1.safetensors", ""},
               {dir.file("s2.safetensors"), "s2.safetensors", ""}};
  try {
    build_checkpoint_index(src);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor 'w'"));
    EXPECT_THAT(e.what(), HasSubstr("s1.safetensors and s2.safetensors"));
  }
}

TEST(CheckpointIndexTest, PickledWeightsThatAreNotATorchArchiveAreRefusedByName) {
  TempDir dir;
  write_file(dir.file("pytorch_model.bin"), "not really a pickle");
  ResolvedSource src;
  src.folder = dir.str();
  src.format = FileFormat::kPickle;
  src.pattern = "*.bin";
  src.files = {{dir.file("pytorch_model.bin"), "pytorch_model.bin", ""}};
  EXPECT_THAT([&] { build_checkpoint_index(src); },
              ::testing::ThrowsMessage<Error>(::testing::AllOf(
                  HasSubstr("pytorch_model.bin"), HasSubstr("not a torch.save zip archive"))));
}

TEST(CheckpointIndexTest, RealShardedTestdataCrossChecksWithItsIndex) {
  FERRY_NEED_TEST_DATA();
  ResolvedSource src;
  src.folder = shared("safetensors/safetensors-jl-testdata/sharded");
  src.index_file = "model.safetensors.index.json";
  for (int i = 1; i <= 6; ++i) {
    std::string n = "model-0000" + std::to_string(i) + "-of-00006.safetensors";
    src.files.push_back({src.folder + "/" + n, n, ""});
  }
  auto ci = build_checkpoint_index(src);
  EXPECT_EQ(ci.tensors.size(), 36u);
  EXPECT_EQ(ci.find("float8_e5m2_357")->file, "model-00006-of-00006.safetensors");
  EXPECT_EQ(ci.find("bool_357")->dtype, DType::kBool);
}

// ---- found by fuzzing (fuzz/, docs/FUZZING.md) ------------------------------

// fuzz_index: a number beyond a double made nlohmann's parser throw out_of_range,
// which escaped parse_weight_index as another exception than ferry::Error. The
// fuzzer's input, byte for byte.
TEST(FuzzFindings, IndexNumberPastADoubleIsAnIndexError) {
  const std::string input =
      "1e155555555&&&&&5~ 55&\xf3"
      "e";
  try {
    parse_weight_index(input, "model.safetensors.index.json");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kIndex);
    EXPECT_THAT(e.rule(), HasSubstr("number overflow"));
  }
  // Headers share the document path.
  EXPECT_THROW(parse_safetensors_header(R"({"a":1e400})", 100, "h.safetensors"), Error);
}

// fuzz_index: a whole metadata.total_size of 2^64 or more was converted to 64 bits
// (undefined behaviour) by the fast path and the document path; it is no size now,
// as a negative one is. The fuzzer's input (not JSON, refused after the number),
// then the same number in indexes each path accepts.
TEST(FuzzFindings, IndexTotalSizePast64BitsIsNoSize) {
  const std::string input =
      "{\"metadata\":{\"total_size\":1e32,\"nesded\":{\"k\":[1,2]}},\"weighnest~"
      "d\xc3\x84\xdd\x9e\xdd\xc5\xdd\x87\"}}";
  EXPECT_THROW(parse_weight_index(input, "i.json"), Error);
  const WeightIndex fast =
      parse_weight_index(R"({"metadata":{"total_size":1e32},"weight_map":{"a":"x"}})", "i.json");
  EXPECT_FALSE(fast.total_size.has_value());
  const WeightIndex document = parse_weight_index(
      R"({"metadata":{"total_size":1.8446744073709552e19,"n":{"k":[1]}},"weight_map":{"a":"x"}})",
      "i.json");
  EXPECT_FALSE(document.total_size.has_value());
  const WeightIndex largest = parse_weight_index(
      R"({"metadata":{"total_size":1.8446744073709550e19},"weight_map":{"a":"x"}})", "i.json");
  EXPECT_EQ(largest.total_size, std::uint64_t{18446744073709549568u});
}

}  // namespace
}  // namespace ferry::io
