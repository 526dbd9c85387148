#include "models/online_quant.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/error.hpp"
#include "common/fp8.hpp"
#include "gpu/device.hpp"
#include "gpu/kernels_host.hpp"
#include "models/quant.hpp"

namespace ferry::models {
namespace {

constexpr float kFp8Max = 448.0f;

float max_abs(const float* x, std::uint64_t count) {
  float amax = 0;
  for (std::uint64_t i = 0; i < count; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
  }
  return amax;
}

void quantize_span(const float* x, std::uint64_t count, float mul, std::uint8_t* q) {
  scale_to_e4m3(x, count, mul, q);
}

// The stored scale and the multiplier the values are quantized with.
struct Scale {
  float scale = 0;
  float mul = 0;
};
// amax / 448 (SGLang's per-token kernel and scaled_fp8_quant); a zero amax
// quantizes to zeros.
Scale amax_scale(float amax) {
  const float s = amax / kFp8Max;
  return {s, s > 0 ? 1.0f / s : 0.0f};
}
// input_to_float8: amax at least 1e-12, the multiplier 448 / amax, its reciprocal
// stored.
Scale input_to_float8_scale(float amax) {
  const float mul = kFp8Max / std::max(amax, 1e-12f);
  return {1.0f / mul, mul};
}

[[noreturn]] void bad(const std::string& param, const std::string& rule) {
  throw Error(Stage::kPostProcess, "", param, "quantization.online: " + rule);
}

}  // namespace

void online_quant_per_channel(const float* x, std::uint64_t rows, std::uint64_t cols,
                              std::uint8_t* q, float* scales) {
  for (std::uint64_t r = 0; r < rows; ++r) {
    const Scale s = amax_scale(max_abs(x + r * cols, cols));
    quantize_span(x + r * cols, cols, s.mul, q + r * cols);
    scales[r] = s.scale;
  }
}

float online_quant_per_tensor(const float* x, std::uint64_t count, std::uint8_t* q) {
  const Scale s = input_to_float8_scale(max_abs(x, count));
  quantize_span(x, count, s.mul, q);
  return s.scale;
}

float online_quant_per_expert(const float* x, std::uint64_t count, std::uint8_t* q) {
  const Scale s = amax_scale(max_abs(x, count));
  quantize_span(x, count, s.mul, q);
  return s.scale;
}

std::vector<PostLoadHook> make_online_quant_hooks(const Model& model, const QuantScheme& quant) {
  std::vector<PostLoadHook> out;
  const bool channel = quant.online == QuantScheme::Online::kChannel;
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    const RankShell& shell = model.shells()[r];
    for (std::size_t w = 0; w < shell.params.size(); ++w) {
      const ParamSpec& weight = shell.params[w];
      if (weight.dtype != DType::kF8E4M3) {
        continue;
      }
      auto find = [&](const std::string& name) {
        auto it = shell.by_name.find(name);
        if (it == shell.by_name.end()) {
          bad(name, "the model declares no such parameter for " + weight.name);
        }
        return it->second;
      };
      const std::size_t t = find(companion_name(weight.name, "weight_unquantized"));
      const std::size_t s = find(companion_name(weight.name, "weight_scale"));
      const ParamSpec& full = shell.params[t];
      if (full.shape != weight.shape || !full.transient) {
        bad(full.name, "expected a transient " + format_shape(weight.shape) + " parameter");
      }
      const bool experts = weight.shape.size() == 3;
      const std::uint64_t rows = weight.shape[weight.shape.size() - 2];
      const std::uint64_t cols = weight.shape.back();
      const std::uint64_t matrices = experts ? weight.shape[0] : 1;
      const Shape scale_shape = experts ? Shape{matrices} : channel ? Shape{rows, 1} : Shape{1};
      if (shell.params[s].shape != scale_shape || shell.params[s].dtype != DType::kF32) {
        bad(shell.params[s].name, "parameter is " + format_shape(shell.params[s].shape) +
                                      ", expected F32 " + format_shape(scale_shape));
      }
      PostLoadHook hook;
      hook.name =
          "online_quant_fp8:" + weight.name + " (tp rank " + std::to_string(shell.tp_rank) + ")";
      hook.local_rank = r;
      hook.inputs = {t};
      hook.outputs = {w, s};
      const DType dtype = full.dtype;
      // On the device, from the transient straight into the weight and its scale:
      // per row (kAmax), per matrix (input_to_float8), or per expert (kAmax).
      const gpu::Fp8Scales scales{
          channel && !experts ? gpu::Fp8Granularity::kRow : gpu::Fp8Granularity::kTensor, 0, 0, 1};
      const gpu::Fp8ScaleRule rule =
          experts || channel ? gpu::Fp8ScaleRule::kAmax : gpu::Fp8ScaleRule::kInputToFloat8;
      hook.run = [=](HookContext& ctx) {
        ctx.stream().quantize_fp8(ctx.param_data(w), ctx.param_data(s), ctx.param_data(t), dtype,
                                  scales, rule, rows, cols, matrices);
      };
      out.push_back(std::move(hook));
    }
  }
  return out;
}

}  // namespace ferry::models
