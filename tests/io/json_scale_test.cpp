// Inputs of real size: a safetensors header of 1,000,000 entries (short names, about
// 75 MB, under the 100 MB limit) and an index of as many names parse correctly, each
// in a child process that must finish within 60 s. nlohmann's DOM-callback parser,
// which ferry used for duplicate keys, took 25 s for 16,000 entries and would take
// hours here; bench/header_bench.py measures the times (docs/PERFORMANCE.md).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <string>

#include "common/error.hpp"
#include "io/safetensors.hpp"

namespace ferry::io {
namespace {

using ::testing::HasSubstr;

constexpr std::uint64_t kEntries = 1'000'000;
constexpr unsigned kChildSeconds = 60;

// Runs `body` in a forked child killed by SIGALRM after kChildSeconds; returns how it
// ended: "ok", "failed: <what body returned>", or "killed by signal N".
std::string in_child(const std::function<std::string()>& body) {
  int fds[2];
  if (pipe(fds) != 0) {
    return "pipe failed";
  }
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    alarm(kChildSeconds);
    std::string what;
    try {
      what = body();
    } catch (const std::exception& e) {
      what = std::string("threw: ") + e.what();
    }
    ssize_t written = write(fds[1], what.data(), what.size());
    _exit(written == static_cast<ssize_t>(what.size()) && what.empty() ? 0 : 1);
  }
  close(fds[1]);
  std::string message;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) {
    message.append(buf, static_cast<std::size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) {
    return "killed by signal " + std::to_string(WTERMSIG(status)) +
           (WTERMSIG(status) == SIGALRM ? " (did not finish in 60 s)" : "");
  }
  return WEXITSTATUS(status) == 0 ? "ok" : "failed: " + message;
}

std::string million_entry_header() {
  std::string text = "{";
  text.reserve(80 * kEntries);
  for (std::uint64_t i = 0; i < kEntries; ++i) {
    text += (i ? ",\"t" : "\"t") + std::to_string(i) +
            R"(":{"dtype":"BF16","shape":[4,4],"data_offsets":[)" + std::to_string(32 * i) + "," +
            std::to_string(32 * (i + 1)) + "]}";
  }
  return text + "}";
}

TEST(JsonScale, AMillionEntryHeaderParsesCorrectlyWithinAMinute) {
  std::string result = in_child([] {
    const std::string text = million_entry_header();
    if (text.size() > kMaxHeaderBytes) {
      return std::string("the header is over the limit: ") + std::to_string(text.size());
    }
    SafetensorsHeader h = parse_safetensors_header(text, 8 + text.size() + 32 * kEntries, "m");
    if (h.tensors.size() != kEntries) {
      return "parsed " + std::to_string(h.tensors.size()) + " tensors";
    }
    for (std::uint64_t i : {std::uint64_t{0}, std::uint64_t{1}, kEntries / 2, kEntries - 1}) {
      const TensorInfo& t = h.tensors[i];  // sorted by offset: t<i> is at 32 i
      if (t.name != "t" + std::to_string(i) || t.offset != h.header_bytes + 32 * i ||
          t.nbytes != 32 || t.shape != std::vector<std::uint64_t>{4, 4} ||
          t.dtype != DType::kBF16) {
        return "entry " + std::to_string(i) + " is " + t.name + " @" + std::to_string(t.offset);
      }
    }
    return std::string();
  });
  EXPECT_EQ(result, "ok");
}

TEST(JsonScale, AMillionNameIndexParsesCorrectlyWithinAMinute) {
  std::string result = in_child([] {
    std::string text = R"({"metadata":{"total_size":1},"weight_map":{)";
    for (std::uint64_t i = 0; i < kEntries; ++i) {
      text += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":\"model-0000" +
              std::to_string(1 + i % 4) + "-of-00004.safetensors\"";
    }
    text += "}}";
    WeightIndex idx = parse_weight_index(text, "model.safetensors.index.json");
    if (idx.weight_map.size() != kEntries) {
      return "parsed " + std::to_string(idx.weight_map.size()) + " names";
    }
    if (idx.weight_map.at("t999999") != "model-00004-of-00004.safetensors") {
      return "t999999 is in " + idx.weight_map.at("t999999");
    }
    return std::string();
  });
  EXPECT_EQ(result, "ok");
}

TEST(JsonScale, ADuplicateAmongManyKeysIsNamedAtAnyDepth) {
  // The fast check compares members with keys parsed; a second pass names the key.
  std::string text = "{";
  for (int i = 0; i < 20000; ++i) {
    text += "\"t" + std::to_string(i) + R"(":{"dtype":"U8","shape":[1],"data_offsets":[)" +
            std::to_string(i) + "," + std::to_string(i + 1) + "]},";
  }
  std::string top = text + R"("t77":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  EXPECT_THAT([&] { parse_safetensors_header(top, 8 + top.size() + 20000, "f"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("duplicate key 't77' in JSON")));
  std::string nested =
      text + R"("t_last":{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[0,1]}})";
  EXPECT_THAT([&] { parse_safetensors_header(nested, 8 + nested.size() + 20000, "f"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("duplicate key 'shape' in JSON")));
  // Objects inside arrays count too.
  std::string in_array =
      R"({"metadata":{"total_size":1},"weight_map":{"a":"x.safetensors"},"extra":[{"k":1,"k":2}]})";
  EXPECT_THAT([&] { parse_weight_index(in_array, "model.safetensors.index.json"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("duplicate key 'k' in JSON")));
}

TEST(JsonScale, DeepNestingIsAnErrorNotACrash) {
  // 1,000,000 nested arrays: nlohmann builds them without recursion and ferry
  // counts object members without it, so this is a header error, not a stack overflow.
  std::string text =
      R"({"__metadata__":)" + std::string(1'000'000, '[') + std::string(1'000'000, ']') + "}";
  EXPECT_THAT([&] { parse_safetensors_header(text, 8 + text.size(), "deep"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("deep")));
}

}  // namespace
}  // namespace ferry::io
