// GGUF files through the whole runtime (issue 37): a synthetic model written as
// safetensors and as the GGUF llama.cpp's converter would make of it (`ferry synth
// --format gguf`: llama.cpp's names, Q/K rows permuted, experts stacked, the config
// as metadata and no config.json) loads to the same params, byte for byte, at tp 1, 2
// and 4 and with expert parallelism: F32 and BF16 tensors, cast to the safetensors'
// BF16 where they are F32. The config comes from the metadata; model.path may name
// the file. Q8_0 files dequantize on the device (gguf.dequantize) to what the host
// reference makes of the same blocks. What is not loaded yet is refused by name,
// nothing handed over.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "common/float_bits.hpp"
#include "ferry/runtime.hpp"
#include "io/gguf_types.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::Sets;
using testing::TempDir;
using testing::with;

std::string write(const std::string& dir, const std::string& family, synth::SynthFormat format,
                  io::GgmlType type = io::GgmlType::kF32) {
  synth::SynthOptions o;
  o.family = family;
  o.preset = "tiny";
  o.out = dir;
  o.fsync = false;
  o.format = format;
  o.gguf_type = type;
  synth::synthesize(o);
  return dir;
}

struct GgufCase {
  const char* family;
  io::GgmlType type;
  Sets sets;
};

class GgufLoad : public ::testing::TestWithParam<GgufCase> {};

TEST_P(GgufLoad, LoadsAsTheSafetensorsCheckpointDoes) {
  const GgufCase& c = GetParam();
  TempDir dir;
  const std::string st = write(dir.file("st"), c.family, synth::SynthFormat::kSafetensors);
  const std::string gguf = write(dir.file("gguf"), c.family, synth::SynthFormat::kGguf, c.type);
  ASSERT_FALSE(fs::exists(gguf + "/config.json"));
  const LoadResult want = testing::load_with(st, c.sets);
  ASSERT_TRUE(want) << want.error->message;
  // The GGUF's own dtype is F32 or BF16; the params are the safetensors' BF16.
  const LoadResult got = testing::load_with(gguf, with(c.sets, {"model.dtype=bf16"}));
  ASSERT_TRUE(got) << got.error->message;
  testing::expect_same_model(*want.model, *got.model);
}

std::string gguf_case_name(const ::testing::TestParamInfo<GgufCase>& info) {
  std::string name =
      std::string(info.param.family) + "_" + std::string(io::ggml_type_name(info.param.type));
  for (const std::string& s : info.param.sets) {
    name += "_" + s.substr(s.find('.') + 1);
  }
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) {
      ch = '_';
    }
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, GgufLoad,
    ::testing::Values(GgufCase{"llama", io::GgmlType::kF32, {"parallel.tp=1"}},
                      GgufCase{"llama", io::GgmlType::kBF16, {"parallel.tp=2"}},
                      GgufCase{"llama", io::GgmlType::kF32, {"parallel.tp=4"}},
                      GgufCase{"mistral", io::GgmlType::kBF16, {"parallel.tp=2"}},
                      GgufCase{"qwen3_moe", io::GgmlType::kBF16, {"parallel.tp=2"}},
                      GgufCase{
                          "qwen3_moe", io::GgmlType::kF32, {"parallel.tp=2", "parallel.ep=2"}}),
    gguf_case_name);

TEST(GgufLoadEdges, ModelPathNamesTheFileAndTheConfigIsItsMetadata) {
  TempDir dir;
  const std::string st = write(dir.file("st"), "llama", synth::SynthFormat::kSafetensors);
  const std::string gguf =
      write(dir.file("gguf"), "llama", synth::SynthFormat::kGguf, io::GgmlType::kBF16);
  const LoadResult want = testing::load_with(st, {"parallel.tp=2"});
  ASSERT_TRUE(want) << want.error->message;
  const LoadResult got = testing::load_with(gguf + "/model.gguf", {"parallel.tp=2"});
  ASSERT_TRUE(got) << got.error->message;
  testing::expect_same_model(*want.model, *got.model);
  // The null device reads the same bytes and keeps none.
  const LoadResult null = testing::load_with(gguf, {"parallel.tp=2", "devices=null:2"});
  ASSERT_TRUE(null) << null.error->message;
  EXPECT_EQ(null.model->report().bytes_read, got.model->report().bytes_read);
}

// `bf16` (a row-major BF16 param whose rows are `row` elements) with every run of 32
// elements along a row put through Q8_0 and back on the host (io::quantize_q8_0, the
// encoder checked byte for byte against gguf-py in interop.gguf, then
// io::dequantize) and rounded to BF16: what a Q8_0 GGUF made from those values holds.
std::vector<std::byte> q8_0_round_trip(const std::vector<std::byte>& bf16, std::uint64_t row) {
  const std::size_t n = bf16.size() / 2;
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t bits = 0;
    std::memcpy(&bits, &bf16[2 * i], 2);
    x[i] = io::bf16_to_float(bits);
  }
  std::vector<std::byte> blocks(n / 32 * 34);
  io::quantize_q8_0(x, blocks);
  std::vector<float> y(n);
  io::dequantize(io::GgmlType::kQ8_0, blocks, y);
  std::vector<std::byte> out(bf16.size());
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t bits = float_to_bf16_bits(y[i]);
    std::memcpy(&out[2 * i], &bits, 2);
  }
  EXPECT_EQ(row % 32, 0u);
  return out;
}

class GgufQ8Load : public ::testing::TestWithParam<GgufCase> {};

// A Q8_0 GGUF (every matrix in Q8_0 blocks, norms and the router F32) dequantized on
// the device equals the safetensors load with each matrix's rows quantized and
// dequantized on the host: byte for byte, at tp 1, 2 and 4 and with experts.
TEST_P(GgufQ8Load, DequantizesOnTheDeviceAsTheReferenceOnTheHost) {
  const GgufCase& c = GetParam();
  TempDir dir;
  const std::string st = write(dir.file("st"), c.family, synth::SynthFormat::kSafetensors);
  const std::string gguf = write(dir.file("gguf"), c.family, synth::SynthFormat::kGguf, c.type);
  const LoadResult want = testing::load_with(st, c.sets);
  ASSERT_TRUE(want) << want.error->message;
  const LoadResult got = testing::load_with(gguf, with(c.sets, {"model.dtype=bf16"}));
  ASSERT_TRUE(got) << got.error->message;
  std::size_t quantized = 0;
  for (std::size_t r = 0; r < want.model->ranks().size(); ++r) {
    for (const LoadedParam& p : want.model->ranks()[r].params) {
      ASSERT_EQ(p.dtype, DType::kBF16) << p.name;
      const std::vector<std::byte> bytes = want.model->read_param(r, p.name);
      const bool matrix = p.shape.size() >= 2 && p.name.find("norm") == std::string::npos &&
                          !p.name.ends_with("mlp.gate.weight");
      const std::vector<std::byte> expect = matrix ? q8_0_round_trip(bytes, p.shape.back()) : bytes;
      quantized += matrix && expect != bytes ? 1 : 0;
      EXPECT_TRUE(got.model->read_param(r, p.name) == expect) << "rank " << r << " " << p.name;
    }
  }
  EXPECT_GT(quantized, 3u);  // Q8_0 changed the matrices: the check compared something
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, GgufQ8Load,
    ::testing::Values(GgufCase{"llama", io::GgmlType::kQ8_0, {"parallel.tp=1"}},
                      GgufCase{"llama", io::GgmlType::kQ8_0, {"parallel.tp=2"}},
                      GgufCase{"llama", io::GgmlType::kQ8_0, {"parallel.tp=4"}},
                      GgufCase{"qwen3", io::GgmlType::kQ8_0, {"parallel.tp=2"}},
                      GgufCase{
                          "qwen3_moe", io::GgmlType::kQ8_0, {"parallel.tp=2", "parallel.ep=2"}}),
    gguf_case_name);

TEST(GgufLoadEdges, WhatIsNotLoadedYetIsRefusedByName) {
  TempDir dir;
  const std::string q8 =
      write(dir.file("q8"), "llama", synth::SynthFormat::kGguf, io::GgmlType::kQ8_0);
  // The null device takes the dequantizing copies too, and reads what a host device reads.
  const LoadResult host = testing::load_with(q8, {"parallel.tp=2"});
  ASSERT_TRUE(host) << host.error->message;
  const LoadResult null = testing::load_with(q8, {"parallel.tp=2", "devices=null:2"});
  ASSERT_TRUE(null) << null.error->message;
  EXPECT_EQ(null.model->report().bytes_read, host.model->report().bytes_read);
  // tp 8 cuts o_proj's rows of 128 into 16 elements: half a Q8_0 block. Refused, and
  // nothing is handed over.
  const LoadResult cut_block = testing::load_with(q8, {"parallel.tp=8"});
  ASSERT_FALSE(cut_block);
  EXPECT_THAT(cut_block.error->message, HasSubstr("o_proj.weight"));
  EXPECT_THAT(cut_block.error->message,
              HasSubstr("not a multiple of the Q8_0 block's 32 elements"));
  EXPECT_EQ(cut_block.error->stage, Stage::kPlacement);
  // gguf.dequantize off: the GGML blocks would stay for GGUF kernels, not built.
  const LoadResult kept = testing::load_with(q8, {"gguf.dequantize=false"});
  ASSERT_FALSE(kept);
  EXPECT_THAT(kept.error->message, HasSubstr("model.gguf"));
  EXPECT_THAT(kept.error->message,
              HasSubstr("GGML type Q8_0 is quantized and gguf.dequantize is off"));
  const std::string ds =
      write(dir.file("ds"), "deepseek_v3", synth::SynthFormat::kGguf, io::GgmlType::kBF16);
  const LoadResult mla = testing::load_with(ds, {});
  ASSERT_FALSE(mla);
  EXPECT_THAT(mla.error->message, HasSubstr("attn_k_b"));
  // A truncated file: its tensors run past the end, said with the file's name.
  const std::string cut =
      write(dir.file("cut"), "llama", synth::SynthFormat::kGguf, io::GgmlType::kBF16);
  fs::resize_file(cut + "/model.gguf", fs::file_size(cut + "/model.gguf") / 2);
  const LoadResult truncated = testing::load_with(cut, {});
  ASSERT_FALSE(truncated);
  EXPECT_THAT(truncated.error->message, HasSubstr("model.gguf"));
}

}  // namespace
}  // namespace ferry::runtime
