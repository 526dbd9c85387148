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

std::uint8_t quantize(float v, float mul) {
  return float_to_e4m3(std::clamp(v * mul, -kFp8Max, kFp8Max));
}

float max_abs(const float* x, std::uint64_t count) {
  float amax = 0;
  for (std::uint64_t i = 0; i < count; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
  }
  return amax;
}

[[noreturn]] void bad(const std::string& param, const std::string& rule) {
  throw Error(Stage::kPostProcess, "", param, "quantization.online: " + rule);
}

}  // namespace

void online_quant_per_channel(const float* x, std::uint64_t rows, std::uint64_t cols,
                              std::uint8_t* q, float* scales) {
  for (std::uint64_t r = 0; r < rows; ++r) {
    const float s = max_abs(x + r * cols, cols) / kFp8Max;
    const float inv = s > 0 ? 1.0f / s : 0.0f;
    for (std::uint64_t c = 0; c < cols; ++c) {
      q[r * cols + c] = quantize(x[r * cols + c], inv);
    }
    scales[r] = s;
  }
}

float online_quant_per_tensor(const float* x, std::uint64_t count, std::uint8_t* q) {
  const float amax = std::max(max_abs(x, count), 1e-12f);
  const float mul = kFp8Max / amax;
  for (std::uint64_t i = 0; i < count; ++i) {
    q[i] = quantize(x[i], mul);
  }
  return 1.0f / mul;
}

float online_quant_per_expert(const float* x, std::uint64_t count, std::uint8_t* q) {
  const float s = max_abs(x, count) / kFp8Max;
  const float inv = s > 0 ? 1.0f / s : 0.0f;
  for (std::uint64_t i = 0; i < count; ++i) {
    q[i] = quantize(x[i], inv);
  }
  return s;
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
      const std::uint64_t count = rows * cols * matrices;
      hook.run = [=](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        std::vector<std::byte> raw(count * dtype_size(dtype));
        stream.copy_d2h(raw.data(), ctx.param_data(t), raw.size());
        stream.synchronize();
        std::vector<float> x(count);
        gpu::host::cast(reinterpret_cast<std::byte*>(x.data()), DType::kF32, raw.data(), dtype,
                        count);
        std::vector<std::uint8_t> q(count);
        std::vector<float> scales(experts ? matrices : channel ? rows : 1);
        if (experts) {
          for (std::uint64_t e = 0; e < matrices; ++e) {
            scales[e] = online_quant_per_expert(x.data() + e * rows * cols, rows * cols,
                                                q.data() + e * rows * cols);
          }
        } else if (channel) {
          online_quant_per_channel(x.data(), rows, cols, q.data(), scales.data());
        } else {
          scales[0] = online_quant_per_tensor(x.data(), count, q.data());
        }
        stream.copy_h2d(ctx.param_data(w), reinterpret_cast<const std::byte*>(q.data()), q.size());
        stream.copy_h2d(ctx.param_data(s), reinterpret_cast<const std::byte*>(scales.data()),
                        scales.size() * sizeof(float));
        stream.synchronize();  // the host buffers die with this call
      };
      out.push_back(std::move(hook));
    }
  }
  return out;
}

}  // namespace ferry::models
