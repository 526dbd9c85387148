// SafetensorsWriter: header layout (length prefix, 8-byte padding, key order,
// offsets), streamed data, misuse and short/long writes, and interoperability with
// ferry's own parser and the official Python library.
#include "io/safetensors_writer.hpp"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/safetensors.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

using ferry::testing::read_file;
using ferry::testing::TempDir;

std::uint64_t le64(const std::string& bytes) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) {
    n = (n << 8) | static_cast<unsigned char>(bytes.at(static_cast<std::size_t>(i)));
  }
  return n;
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  }
  return out;
}

// Runs `script` with python3 and returns its standard output; empty optional
// when python3 or the safetensors/numpy modules are missing.
std::optional<std::string> run_python(const TempDir& dir, const std::string& script,
                                      const std::string& arg) {
  if (std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") != 0) {
    return std::nullopt;
  }
  std::string path = dir.file("check.py");
  ferry::testing::write_file(path, script);
  std::string cmd = "python3 " + path + " " + arg + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    return std::nullopt;
  }
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) {
    out.append(buf, n);
  }
  int status = ::pclose(pipe);
  EXPECT_EQ(status, 0) << out;
  return out;
}

TEST(SafetensorsWriter, WritesLengthPaddedHeaderOffsetsAndData) {
  TempDir dir;
  std::string path = dir.file("a.safetensors");
  SafetensorsWriter w(path);
  w.add("b.weight", DType::kBF16, {2, 3});
  w.add("a.bias", DType::kF32, {4});
  w.set_metadata({{"format", "pt"}});
  EXPECT_EQ(w.data_bytes(), 12u + 16u);
  w.begin();
  auto data = pattern(28, 7);
  w.write(std::span(data).first(5));
  w.write(std::span(data).subspan(5));
  EXPECT_EQ(w.written(), 28u);
  w.finish();

  std::string bytes = read_file(path);
  std::uint64_t n = le64(bytes);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(w.header_bytes(), 8 + n);
  ASSERT_EQ(bytes.size(), 8 + n + 28);
  std::string text = bytes.substr(8, n);
  // The reference pads with spaces; the JSON itself is compact.
  std::string trimmed = text.substr(0, text.find_last_not_of(' ') + 1);
  EXPECT_LT(text.size() - trimmed.size(), 8u);
  EXPECT_EQ(text.rfind("{\"__metadata__\":{\"format\":\"pt\"},\"b.weight\":", 0), 0u) << text;
  EXPECT_LT(text.find("\"b.weight\""), text.find("\"a.bias\""));  // declaration order

  auto j = nlohmann::json::parse(trimmed);
  EXPECT_EQ(j["b.weight"]["dtype"], "BF16");
  EXPECT_EQ(j["b.weight"]["shape"], nlohmann::json({2, 3}));
  EXPECT_EQ(j["b.weight"]["data_offsets"], nlohmann::json({0, 12}));
  EXPECT_EQ(j["a.bias"]["dtype"], "F32");
  EXPECT_EQ(j["a.bias"]["data_offsets"], nlohmann::json({12, 28}));
  EXPECT_EQ(bytes.substr(8 + n), std::string(reinterpret_cast<const char*>(data.data()), 28));
  EXPECT_EQ(text, safetensors_header_text(w.entries(), {{"format", "pt"}}, path));
}

TEST(SafetensorsWriter, HeaderIsPaddedToEightForEveryLength) {
  for (std::size_t len = 1; len <= 17; ++len) {
    std::string name(len, 'x');
    std::string text = safetensors_header_text({{name, DType::kU8, {3}}}, {}, "f");
    EXPECT_EQ(text.size() % 8, 0u) << len;
    EXPECT_EQ(text.find("__metadata__"), std::string::npos);
    auto j = nlohmann::json::parse(text);  // trailing spaces are valid JSON
    EXPECT_EQ(j[name]["data_offsets"], nlohmann::json({0, 3}));
  }
  EXPECT_EQ(safetensors_header_text({}, {}, "f"), "{}      ");
}

TEST(SafetensorsWriter, ZeroSizedTensorsTakeNoBytes) {
  TempDir dir;
  SafetensorsWriter w(dir.file("z.safetensors"));
  w.add("empty", DType::kF16, {0, 5});
  w.add("scalar", DType::kF32, {});
  w.begin();
  float one = 1.0f;
  w.write(std::as_bytes(std::span(&one, 1)));
  w.finish();
  std::string bytes = read_file(dir.file("z.safetensors"));
  auto j = nlohmann::json::parse(bytes.substr(8, le64(bytes)));
  EXPECT_EQ(j["empty"]["data_offsets"], nlohmann::json({0, 0}));
  EXPECT_EQ(j["scalar"]["shape"], nlohmann::json::array());
  EXPECT_EQ(j["scalar"]["data_offsets"], nlohmann::json({0, 4}));
}

TEST(SafetensorsWriter, StreamsLargeAndSmallWritesInOrder) {
  // Mixes writes below, at and above the internal buffer size.
  TempDir dir;
  std::string path = dir.file("big.safetensors");
  const std::size_t total = (3u << 20) + 12345;
  auto data = pattern(total, 3);
  SafetensorsWriter w(path);
  w.add("t", DType::kU8, {total});
  w.begin();
  std::size_t pos = 0;
  for (std::size_t step : {std::size_t{1}, std::size_t{1000}, std::size_t{2} << 20,
                           std::size_t{1} << 20, std::size_t{7}}) {
    w.write(std::span(data).subspan(pos, step));
    pos += step;
  }
  w.write(std::span(data).subspan(pos));
  w.finish(SafetensorsWriter::Sync::kFsync);
  std::string bytes = read_file(path);
  std::uint64_t start = 8 + le64(bytes);
  ASSERT_EQ(bytes.size(), start + total);
  EXPECT_EQ(bytes.compare(start, total, reinterpret_cast<const char*>(data.data()), total), 0);
}

TEST(SafetensorsWriter, WritingPastTheDeclaredTotalIsAnErrorNamingTheTensor) {
  TempDir dir;
  std::string path = dir.file("x.safetensors");
  SafetensorsWriter w(path);
  w.add("first", DType::kU8, {2});
  w.add("second", DType::kU8, {2});
  w.begin();
  auto data = pattern(8, 1);
  w.write(std::span(data).first(3));
  try {
    w.write(std::span(data).first(2));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_EQ(e.file(), path);
    EXPECT_EQ(e.tensor(), "second");
    EXPECT_NE(e.rule().find("exceeds the declared 4 data bytes"), std::string::npos) << e.what();
  }
  // Nothing of the refused write went in: the file can still be completed.
  w.write(std::span(data).subspan(3, 1));
  w.finish();
  std::string bytes = read_file(path);
  EXPECT_EQ(bytes.substr(8 + le64(bytes)),
            std::string(reinterpret_cast<const char*>(data.data()), 4));
}

TEST(SafetensorsWriter, FinishingShortIsAnErrorAndLeavesNoFile) {
  TempDir dir;
  std::string path = dir.file("short.safetensors");
  {
    SafetensorsWriter w(path);
    w.add("a", DType::kF32, {2});
    w.add("b", DType::kF32, {2});
    w.begin();
    auto data = pattern(10, 1);
    w.write(data);
    try {
      w.finish();
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kSynth);
      EXPECT_EQ(e.tensor(), "b");
      EXPECT_NE(e.rule().find("only 10 of 16"), std::string::npos) << e.what();
      EXPECT_NE(e.rule().find("2 of 8"), std::string::npos) << e.what();
    }
    // Nothing stands at the path before finish() renames the whole file there.
    EXPECT_FALSE(std::filesystem::exists(path));
  }
  // A truncated file would look like a checkpoint with a lying header; its
  // temporary is gone too.
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SafetensorsWriter, AnOutputsFailureCarriesTheStageAndSettingItWasGiven) {
  TempDir dir;
  const std::string full = dir.file("rank-0.safetensors");
  // A twin of /dev/full: written in place (never replaced), every write ENOSPC.
  if (::mknod(full.c_str(), S_IFCHR | 0666, makedev(1, 7)) != 0) {
    GTEST_SKIP() << "mknod is not permitted here; CI runs as root and makes the node";
  }
  SafetensorsWriter w(full, Stage::kOutput, "dump");
  w.add("a", DType::kU8, {1});
  w.begin();
  auto one = pattern(1, 0);
  w.write(one);
  try {
    w.finish();  // the header and the byte reach the device here
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kOutput) << e.what();
    EXPECT_EQ(e.file(), full);
    EXPECT_NE(e.rule().find("dump: cannot write: " + errno_text(ENOSPC)), std::string::npos)
        << e.what();
  }
  struct stat st {};
  ASSERT_EQ(::lstat(full.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));  // neither replaced nor removed
}

TEST(SafetensorsWriter, AFileAtThePathIsReplacedOnlyByAFinishedOne) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  ferry::testing::write_file(path, "old");
  {
    SafetensorsWriter w(path);
    w.add("a", DType::kU8, {4});
    w.begin();
    auto two = pattern(2, 0);
    w.write(two);
  }  // abandoned short
  EXPECT_EQ(read_file(path), "old");
  SafetensorsWriter w(path);
  w.add("a", DType::kU8, {1});
  w.begin();
  auto one = pattern(1, 0);
  w.write(one);
  w.finish();
  EXPECT_EQ(read_safetensors_header(path, path).tensors.size(), 1u);
  EXPECT_EQ(std::vector<std::string>{"x.safetensors"},
            [&] {
              std::vector<std::string> names;
              for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
                names.push_back(e.path().filename().string());
              }
              return names;
            }());
}

TEST(SafetensorsWriter, RejectsMisuse) {
  TempDir dir;
  std::string path = dir.file("m.safetensors");
  SafetensorsWriter w(path);
  EXPECT_THROW(w.add("", DType::kU8, {1}), Error);
  EXPECT_THROW(w.add("__metadata__", DType::kU8, {1}), Error);
  w.add("a", DType::kU8, {1});
  EXPECT_THROW(w.add("a", DType::kU8, {1}), Error);
  EXPECT_THROW(w.add("huge", DType::kF32, {std::uint64_t{1} << 40, std::uint64_t{1} << 30}), Error);
  auto one = pattern(1, 0);
  EXPECT_THROW(w.write(one), Error);  // before begin
  EXPECT_THROW(w.finish(), Error);    // before begin
  w.begin();
  EXPECT_THROW(w.begin(), Error);
  EXPECT_THROW(w.add("b", DType::kU8, {1}), Error);
  EXPECT_THROW(w.set_metadata({{"k", "v"}}), Error);
  w.write(one);
  w.finish();
  EXPECT_THROW(w.write(one), Error);
  EXPECT_THROW(w.finish(), Error);
  EXPECT_TRUE(std::filesystem::exists(path));  // a finished file stays
}

TEST(SafetensorsWriter, DuplicateAndOverflowInHeaderTextNameTheTensor) {
  try {
    safetensors_header_text({{"a", DType::kU8, {1}}, {"a", DType::kU8, {1}}}, {}, "f.st");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.tensor(), "a");
    EXPECT_EQ(e.file(), "f.st");
  }
  std::uint64_t big = std::uint64_t{1} << 62;
  EXPECT_THROW(safetensors_header_text({{"a", DType::kU8, {big}},
                                        {"b", DType::kU8, {big}},
                                        {"c", DType::kU8, {big}},
                                        {"d", DType::kU8, {big}}},
                                       {}, "f"),
               Error);
  EXPECT_THROW(safetensors_header_text({{"bad\xff", DType::kU8, {1}}}, {}, "f"), Error);
}

TEST(SafetensorsWriter, CannotCreateTheFileNamesThePath) {
  TempDir dir;
  std::string path = dir.file("missing/folder/x.safetensors");
  SafetensorsWriter w(path);
  w.add("a", DType::kU8, {1});
  try {
    w.begin();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_EQ(e.file(), path);
  }
}

TEST(SafetensorsWriter, FerrysParserReadsWhatItWrote) {
  TempDir dir;
  std::string path = dir.file("p.safetensors");
  SafetensorsWriter w(path);
  w.add("x", DType::kF16, {3, 5});
  w.add("y", DType::kI64, {2});
  w.add("z", DType::kBF16, {0});
  w.set_metadata({{"format", "pt"}, {"k", "v"}});
  w.begin();
  auto data = pattern(30 + 16, 9);
  w.write(data);
  w.finish();
  SafetensorsHeader h = read_safetensors_header(path, "p.safetensors");
  EXPECT_EQ(h.header_bytes, w.header_bytes());
  EXPECT_EQ(h.file_size, w.header_bytes() + 46);
  EXPECT_EQ(h.metadata.at("k"), "v");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "x");
  EXPECT_EQ(h.tensors[0].offset, w.header_bytes());
  EXPECT_EQ(h.tensors[0].nbytes, 30u);
  EXPECT_EQ(h.tensors[1].name, "y");
  EXPECT_EQ(h.tensors[1].dtype, DType::kI64);
  EXPECT_EQ(h.tensors[1].offset, w.header_bytes() + 30);
}

// set_data_alignment(4096): every tensor's data at a multiple of 4096 in the file
// (header padded, zero "__pad__.<n>" tensors in the gaps), whatever the caller's
// write sizes; ferry's parser and the official library read it as any file.
TEST(SafetensorsWriter, AlignedDataStartsEveryTensorOnTheBoundary) {
  TempDir dir;
  std::string path = dir.file("aligned.safetensors");
  SafetensorsWriter w(path);
  w.set_data_alignment(4096);
  const std::vector<std::pair<std::string, std::vector<std::uint64_t>>> tensors = {
      {"a", {3, 5}}, {"b", {0}}, {"c", {2048}}, {"d", {4096}}, {"e", {1}}, {"f", {7000}}};
  std::uint64_t total = 0;
  for (const auto& [name, shape] : tensors) {
    w.add(name, DType::kF16, shape);
    total += 2 * (shape[0] * (shape.size() > 1 ? shape[1] : 1));
  }
  w.set_metadata({{"format", "pt"}});
  w.begin();
  const std::vector<std::byte> data = pattern(total, 5);
  // Pieces that straddle tensors: the writer splits them around the padding.
  for (std::size_t at = 0, step = 1000; at < data.size(); at += step) {
    w.write(std::span(data).subspan(at, std::min<std::size_t>(step, data.size() - at)));
  }
  w.finish();
  EXPECT_EQ(w.header_bytes() % 4096, 0u);
  SafetensorsHeader h = read_safetensors_header(path, "aligned.safetensors");
  const std::string bytes = read_file(path);
  std::uint64_t read = 0;
  std::size_t pads = 0;
  for (const TensorInfo& t : h.tensors) {
    if (t.name.starts_with(kPadTensorPrefix)) {
      ++pads;
      EXPECT_EQ(t.dtype, DType::kU8);
      EXPECT_EQ(bytes.substr(t.offset, t.nbytes), std::string(t.nbytes, '\0')) << t.name;
      continue;
    }
    if (t.nbytes != 0) {
      EXPECT_EQ(t.offset % 4096, 0u) << t.name;
    }
    EXPECT_EQ(bytes.substr(t.offset, t.nbytes),
              std::string(reinterpret_cast<const char*>(data.data()) + read, t.nbytes))
        << t.name;
    read += t.nbytes;
  }
  EXPECT_EQ(read, total);
  EXPECT_EQ(pads, 2u);  // before c and f (c and d end on the boundary; b is empty)
  std::size_t i = 0;
  for (; i < w.entries().size() && w.entries()[i].name != "f"; ++i) {
  }
  EXPECT_FALSE(w.is_padding(i));
  EXPECT_TRUE(w.is_padding(i - 1));
  EXPECT_EQ((w.header_bytes() + w.data_begin(i)) % 4096, 0u);

  const std::string script = R"(import sys
from safetensors import safe_open
with safe_open(sys.argv[1], framework="numpy") as f:
    print("keys", sorted(k for k in f.keys() if not k.startswith("__pad__.")))
    print("f", f.get_tensor("f").shape)
)";
  auto out = run_python(dir, script, path);
  if (!out) {
    GTEST_SKIP() << "python3 with safetensors and numpy is not available";
  }
  EXPECT_NE(out->find("keys ['a', 'b', 'c', 'd', 'e', 'f']"), std::string::npos) << *out;
  EXPECT_NE(out->find("f (7000,)"), std::string::npos) << *out;
}

TEST(SafetensorsWriter, AlignmentMisuseIsRefused) {
  TempDir dir;
  SafetensorsWriter late(dir.file("late.safetensors"));
  late.add("a", DType::kU8, {1});
  EXPECT_THROW(late.set_data_alignment(4096), Error);
  for (std::uint64_t bad : {0ULL, 4ULL, 100ULL, 3ULL << 20}) {
    SafetensorsWriter w(dir.file("bad.safetensors"));
    EXPECT_THROW(w.set_data_alignment(bad), Error) << bad;
  }
  SafetensorsWriter w(dir.file("reserved.safetensors"));
  w.set_data_alignment(4096);
  EXPECT_THROW(w.add("__pad__.0", DType::kU8, {1}), Error);
  // Writing more than the caller's tensors hold is refused (padding is not theirs).
  w.add("a", DType::kU8, {10});
  w.add("b", DType::kU8, {10});
  w.begin();
  EXPECT_THROW(w.write(pattern(21, 1)), Error);
}

TEST(SafetensorsWriter, OfficialPythonLibraryReadsIt) {
  TempDir dir;
  std::string path = dir.file("py.safetensors");
  SafetensorsWriter w(path);
  std::vector<float> f32{1.5f, -2.0f, 0.25f, 8.0f, -0.125f, 3.0f};
  std::vector<std::uint16_t> f16{0x3c00, 0xc000, 0x3800};  // 1, -2, 0.5
  std::vector<std::int32_t> i32{7, -9};
  w.add("layer.f32", DType::kF32, {2, 3});
  w.add("layer.f16", DType::kF16, {3});
  w.add("layer.bf16", DType::kBF16, {1, 1});
  w.add("layer.i32", DType::kI32, {2});
  w.set_metadata({{"format", "pt"}, {"origin", "ferry"}});
  w.begin();
  w.write(std::as_bytes(std::span(f32)));
  w.write(std::as_bytes(std::span(f16)));
  std::uint16_t bf = 0x3fc0;  // 1.5
  w.write(std::as_bytes(std::span(&bf, 1)));
  w.write(std::as_bytes(std::span(i32)));
  w.finish();

  const std::string script = R"(import sys
from safetensors import safe_open
with safe_open(sys.argv[1], framework="numpy") as f:
    print("meta", sorted(f.metadata().items()))
    for k in f.keys():
        s = f.get_slice(k)
        print("tensor", k, s.get_dtype(), list(s.get_shape()))
    print("f32", f.get_tensor("layer.f32").flatten().tolist())
    print("f16", f.get_tensor("layer.f16").tolist())
    print("i32", f.get_tensor("layer.i32").tolist())
)";
  auto out = run_python(dir, script, path);
  if (!out) {
    GTEST_SKIP() << "python3 with safetensors and numpy is not available";
  }
  EXPECT_NE(out->find("meta [('format', 'pt'), ('origin', 'ferry')]"), std::string::npos) << *out;
  EXPECT_NE(out->find("tensor layer.f32 F32 [2, 3]"), std::string::npos) << *out;
  EXPECT_NE(out->find("tensor layer.f16 F16 [3]"), std::string::npos) << *out;
  EXPECT_NE(out->find("tensor layer.bf16 BF16 [1, 1]"), std::string::npos) << *out;
  EXPECT_NE(out->find("tensor layer.i32 I32 [2]"), std::string::npos) << *out;
  EXPECT_NE(out->find("f32 [1.5, -2.0, 0.25, 8.0, -0.125, 3.0]"), std::string::npos) << *out;
  EXPECT_NE(out->find("f16 [1.0, -2.0, 0.5]"), std::string::npos) << *out;
  EXPECT_NE(out->find("i32 [7, -9]"), std::string::npos) << *out;
}

}  // namespace
}  // namespace ferry::io
