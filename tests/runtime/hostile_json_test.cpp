// JSON nested far deeper than any checkpoint needs (issue: hostile inputs). Before
// the depth guard, a safetensors header nested 100,000 deep parsed, then crashed
// `ferry inspect` with SIGSEGV while an error message printed it. Every JSON ferry
// reads from a checkpoint or a config now refuses such text before parsing, with
// a clear error naming the file; the CLI cases run in a child process, bounded in
// time, so a regression shows as a crash or a timeout instead of killing the suite.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
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

// A safetensors file whose header is `header` (no tensors).
void write_safetensors(const std::string& path, const std::string& header) {
  std::string bytes(8, '\0');
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  }
  write(path, bytes + header);
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

}  // namespace
}  // namespace ferry::runtime
