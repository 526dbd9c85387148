// Hostile inputs (the hardening issue, §2): each gets a clear error naming the file
// and, where there is one, the tensor; never a crash. Run through the CLI in a
// child process bounded in time, so that a regression shows as a crash or a
// timeout instead of killing the test binary.
//
// JSON nested far deeper than any checkpoint needs: before
// the depth guard, a safetensors header nested 100,000 deep parsed, then crashed
// `ferry inspect` with SIGSEGV while an error message printed it. Every JSON ferry
// reads from a checkpoint or a config now refuses such text before parsing, with
// a clear error naming the file; the CLI cases run in a child process, bounded in
// time, so a regression shows as a crash or a timeout instead of killing the suite.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

#include "common/error.hpp"
#include "common/json_depth.hpp"
#include "io/safetensors.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

std::string nested(std::size_t depth) {
  return "{\"a\":" + std::string(depth, '[') + std::string(depth, ']') + "}";
}

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A safetensors file whose header is `header`, followed by `data`; the length
// field says `length` (the header's size by default).
void write_safetensors(const std::string& path, const std::string& header,
                       std::optional<std::uint64_t> length = std::nullopt,
                       const std::string& data = "") {
  std::string bytes(8, '\0');
  std::uint64_t n = length.value_or(header.size());
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  }
  write(path, bytes + header + data);
}

TEST(JsonDepth, CountsNestingOutsideStringsAndStopsPastTheLimit) {
  EXPECT_EQ(json_depth("{}"), 1u);
  EXPECT_EQ(json_depth("1"), 0u);
  EXPECT_EQ(json_depth(R"({"a":{"b":[1,[2]]}})"), 4u);
  EXPECT_EQ(json_depth(R"({"[[[[": "{{{\"[[[", "b": []})"), 2u);  // brackets in strings
  EXPECT_EQ(json_depth(R"(["\\", [[]]])"), 3u);                   // an escaped backslash
  EXPECT_EQ(json_depth("]]]{"), 1u);                              // malformed: the parser's
  EXPECT_EQ(json_depth(nested(100000)), kMaxJsonDepth + 1);       // stops once past
  EXPECT_EQ(json_depth(nested(63)), 64u);
  EXPECT_EQ(json_too_deep_rule(), "JSON nests deeper than 64 levels");
}

TEST(HostileJson, ADeepHeaderOrIndexIsAClearErrorBeforeParsing) {
  EXPECT_THAT([] { io::parse_safetensors_header(nested(100000), 1 << 20, "deep.safetensors"); },
              ThrowsMessage<Error>(AllOf(HasSubstr("deep.safetensors"),
                                         HasSubstr("JSON nests deeper than 64 levels"))));
  try {
    io::parse_safetensors_header(nested(100000), 1 << 20, "deep.safetensors");
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kHeader);
  }
  EXPECT_THAT([] { io::parse_weight_index(nested(65), "model.safetensors.index.json"); },
              ThrowsMessage<Error>(HasSubstr("JSON nests deeper than 64 levels")));
  // 63 levels below the top object is allowed by the guard; the header is then
  // refused for what it is (not a tensor entry), not for its depth.
  EXPECT_THAT([] { io::parse_safetensors_header(nested(63), 1 << 20, "ok.safetensors"); },
              ThrowsMessage<Error>(::testing::Not(HasSubstr("nests deeper"))));
}

// Runs `ferry ARGS...` in a child bounded to 60 s; returns the result.
testing::RunResult run_ferry(std::vector<std::string> args) {
  args.insert(args.begin(), {"timeout", "60", FERRY_BINARY});
  return testing::run(args);
}

TEST(HostileJson, TheCliRefusesDeepJsonWithoutCrashing) {
  testing::TempDir dir;
  write_safetensors(dir.file("deep.safetensors"), nested(100000));
  testing::RunResult r = run_ferry({"inspect", dir.file("deep.safetensors")});
  EXPECT_EQ(r.status, 1) << r.err;  // not 139 (SIGSEGV), not 124 (timeout)
  EXPECT_THAT(r.err, HasSubstr("deep.safetensors"));
  EXPECT_THAT(r.err, HasSubstr("nests deeper than 64 levels"));

  // A checkpoint whose config.json, then whose index, nests 100,000 deep.
  testing::Checkpoint ck = testing::synth_checkpoint(dir.file("ck"), "llama");
  const std::string config = ck.dir + "/config.json";
  std::ifstream in(config);
  const std::string original((std::istreambuf_iterator<char>(in)), {});
  write(config, nested(100000));
  r = run_ferry({"load", "--model", ck.dir, "--quiet"});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("config.json"));
  EXPECT_THAT(r.err, HasSubstr("nests deeper than 64 levels"));
  write(config, original);
  write(ck.dir + "/model.safetensors.index.json", nested(100000));
  r = run_ferry({"load", "--model", ck.dir, "--quiet"});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("model.safetensors.index.json"));
  EXPECT_THAT(r.err, HasSubstr("nests deeper than 64 levels"));

  // A config file and a --set value.
  write(dir.file("deep-config.json"), nested(100000));
  r = run_ferry({"load", "--model", ck.dir, "--config", dir.file("deep-config.json")});
  EXPECT_EQ(r.status, 2) << r.err;  // a usage error, as every bad config is
  EXPECT_THAT(r.err, HasSubstr("nests deeper than 64 levels"));
}

TEST(HostileHeader, EachCaseIsAClearErrorNamingTheFileAndTensor) {
  testing::TempDir dir;
  struct Case {
    const char* file;
    std::string header;
    std::optional<std::uint64_t> length;
    std::string data;
    const char* rule;
  };
  const std::string f32 = R"("dtype":"F32","shape":[1],"data_offsets":[0,4])";
  const std::vector<Case> cases = {
      {"len2p63.safetensors", "{}", std::uint64_t{1} << 63, "",
       "header length 9223372036854775808 exceeds the limit"},
      {"lenmax.safetensors", "{}", ~std::uint64_t{0}, "",
       "header length 18446744073709551615 exceeds the limit"},
      {"offsets-past-2-64.safetensors",
       R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551624]}})",
       {},
       "",
       "tensor 't': data_offsets end"},
      {"offsets-near-2-64.safetensors",
       R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551600,18446744073709551608]}})",
       {},
       "",
       "tensor 't'"},
      {"shape-overflow.safetensors",
       R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}})",
       {},
       "",
       "tensor 't': element count of shape [4294967296,4294967296,16] overflows 64 bits"},
      {"nul-name.safetensors",
       R"({"a\u0000b":{)" + f32 + "}}",
       {},
       std::string(4, '\0'),
       "tensor 'a?b': tensor name has a NUL byte (at 1)"},
      {"bad-utf8.safetensors",
       "{\"a\xff\xfe\":{" + f32 + "}}",
       {},
       std::string(4, '\0'),
       "JSON is not valid UTF-8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file);
    write_safetensors(dir.file(c.file), c.header, c.length, c.data);
    testing::RunResult r = run_ferry({"inspect", dir.file(c.file)});
    EXPECT_EQ(r.status, 1) << r.err;  // a clean refusal: not a signal, not a timeout
    EXPECT_THAT(r.err, HasSubstr(std::string("header: ") + c.file + ": "));
    EXPECT_THAT(r.err, HasSubstr(c.rule));
  }
}

}  // namespace
}  // namespace ferry::runtime
