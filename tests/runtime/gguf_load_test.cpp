// GGUF files through the whole runtime (issue 37): a synthetic model written as
// safetensors and as the GGUF llama.cpp's converter would make of it (`ferry synth
// --format gguf`: llama.cpp's names, Q/K rows permuted, experts stacked, the config
// as metadata and no config.json) loads to the same params, byte for byte, at tp 1, 2
// and 4 and with expert parallelism: F32 and BF16 tensors, cast to the safetensors'
// BF16 where they are F32. The config comes from the metadata; model.path may name
// the file. What is not loaded yet is refused by name, nothing handed over.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "ferry/runtime.hpp"
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

TEST(GgufLoadEdges, WhatIsNotLoadedYetIsRefusedByName) {
  TempDir dir;
  const std::string q8 =
      write(dir.file("q8"), "llama", synth::SynthFormat::kGguf, io::GgmlType::kQ8_0);
  const LoadResult quantized = testing::load_with(q8, {});
  ASSERT_FALSE(quantized);
  EXPECT_THAT(quantized.error->message, HasSubstr("model.gguf"));
  EXPECT_THAT(quantized.error->message, HasSubstr("GGML type Q8_0 is quantized"));
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
