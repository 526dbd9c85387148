// Helpers of the postprocess.target load tests (postprocess_load_test.cpp,
// postprocess_experts_load_test.cpp): checkpoint surgery on scalars, a plain and a
// target load of one checkpoint, SGLang 0.5.23's reference arithmetic they compare
// with, and the capture-safe startup / dummy format check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "synth/synth.hpp"
#include "testing/dtype_codec.hpp"

namespace ferry::runtime::postprocess_testing {

using testing::make_config;

// The checkpoint's quantization_config replaced by quant_method fp8 with static
// per-tensor activation scales (the tensors are the same as compressed-tensors').
inline void as_fp8_format(const std::string& ck) {
  nlohmann::json c = nlohmann::json::parse(std::ifstream(ck + "/config.json"));
  c["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"}};
  std::ofstream(ck + "/config.json") << c.dump();
}

// Sets the F32 scalars whose names end with `suffix` in every shard of `ck` (the
// first `values.size()` of them in name order take values[i], the rest the last).
inline void set_scalars(const std::string& ck, const std::string& suffix,
                        std::vector<float> values) {
  std::vector<std::pair<std::string, io::TensorInfo>> found;
  for (const auto& entry : std::filesystem::directory_iterator(ck)) {
    if (entry.path().extension() != ".safetensors") {
      continue;
    }
    const io::SafetensorsHeader h =
        io::read_safetensors_header(entry.path().string(), entry.path().string());
    for (const io::TensorInfo& t : h.tensors) {
      if (t.name.ends_with(suffix) && t.dtype == DType::kF32 && t.nbytes == 4) {
        found.emplace_back(entry.path().string(), t);
      }
    }
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.second.name < b.second.name; });
  ASSERT_FALSE(found.empty()) << suffix;
  for (std::size_t i = 0; i < found.size(); ++i) {
    const float v = values[std::min(i, values.size() - 1)];
    std::fstream f(found[i].first, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(found[i].second.offset));
    f.write(reinterpret_cast<const char*>(&v), 4);
  }
}

inline std::vector<float> floats(const std::vector<std::byte>& b) {
  std::vector<float> out(b.size() / 4);
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

inline float f16(float v) {
  return testing::half_to_float(synth::float_to_f16_bits(v));
}

// per_tensor_dequantize (an F16 tensor times the F32 scale, rounded once to F16),
// then scaled_fp8_quant with the static scale s (x * (1 / s), clamped, E4M3).
inline float requant_value(std::uint8_t q, float own, float s) {
  const float x = f16(testing::e4m3_value(q) * own);
  return testing::round_to_e4m3(std::clamp(x * (1.0f / s), -448.0f, 448.0f));
}

struct Loads {
  LoadResult plain;
  LoadResult target;
};

inline Loads load_both(const std::string& ck, const std::string& target,
                       std::vector<std::string> sets = {"parallel.tp=2"}) {
  Runtime plain_rt(to_config(make_config(ck, sets)));
  Loads out{plain_rt.load(), {}};
  sets.push_back("postprocess.target=" + target);
  Runtime rt(to_config(make_config(ck, sets)));
  out.target = rt.load();
  return out;
}

// The capture-safe startup (the hooks run again on the real weights) leaves the bytes
// of `want` (a serial load at tp 2 with `target`); the dummy format, its params.
// A capture-safe startup (startup.mode=overlap) of `ck` with `sets`: prepare(), then
// commit(); the prepare's error when it fails. The model outlives its Runtime.
inline LoadResult committed_overlap(const std::string& ck, std::vector<std::string> sets) {
  sets.push_back("startup.mode=overlap");
  Runtime overlap(to_config(make_config(ck, sets)));
  LoadResult prepared = overlap.prepare().wait();
  if (!prepared) {
    return prepared;
  }
  return overlap.commit().wait();
}

inline void overlap_and_dummy_match(const std::string& ck, const std::string& target,
                                    const LoadResult& want) {
  const std::vector<std::string> sets = {"parallel.tp=2", "postprocess.target=" + target};
  LoadResult committed = committed_overlap(ck, sets);
  ASSERT_TRUE(committed) << committed.error->message;
  std::vector<std::string> dummy_sets = sets;
  dummy_sets.push_back("model.load_format=dummy");
  Runtime dummy(to_config(make_config(ck, dummy_sets)));
  LoadResult d = dummy.load();
  ASSERT_TRUE(d) << d.error->message;
  for (std::size_t r = 0; r < 2; ++r) {
    const std::vector<LoadedParam>& params = want.model->ranks()[r].params;
    ASSERT_EQ(d.model->ranks()[r].params.size(), params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(committed.model->read_param(r, params[i].name),
                want.model->read_param(r, params[i].name))
          << params[i].name;
      EXPECT_EQ(d.model->ranks()[r].params[i].name, params[i].name);
      EXPECT_EQ(d.model->ranks()[r].params[i].dtype, params[i].dtype) << params[i].name;
      EXPECT_EQ(d.model->ranks()[r].params[i].shape, params[i].shape) << params[i].name;
    }
  }
}

// SGLang 0.5.23's swizzle_blockscale (quantization/utils.py) of E4M3 scales [m, c]:
// zero-padded to [m', c'] (128 rows, 4 columns), viewed as [m'/128, 4, 32, c'/4, 4]
// and permuted (0, 3, 2, 1, 4); each output byte from its index.
inline std::vector<std::byte> swizzle_blockscale(const std::vector<std::byte>& scale,
                                                 std::uint64_t m, std::uint64_t c) {
  const std::uint64_t mp = (m + 127) / 128 * 128;
  const std::uint64_t cp = (c + 3) / 4 * 4;
  std::vector<std::byte> out(mp * cp);
  std::size_t i = 0;
  for (std::uint64_t b = 0; b < mp / 128; ++b) {
    for (std::uint64_t k4 = 0; k4 < cp / 4; ++k4) {
      for (std::uint64_t r32 = 0; r32 < 32; ++r32) {
        for (std::uint64_t r4 = 0; r4 < 4; ++r4) {
          for (std::uint64_t c4 = 0; c4 < 4; ++c4) {
            const std::uint64_t row = b * 128 + r4 * 32 + r32;
            const std::uint64_t col = k4 * 4 + c4;
            out[i++] = row < m && col < c ? scale[row * c + col] : std::byte{0};
          }
        }
      }
    }
  }
  return out;
}

}  // namespace ferry::runtime::postprocess_testing
