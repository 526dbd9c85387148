#include "models/online_quant.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
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

// Runs fn(begin, end) over [0, count) in contiguous parts, a thread each (up to the
// cores, parts of at least `grain`): a hook quantizes a whole weight on the host.
void parallel_for(std::uint64_t count, std::uint64_t grain,
                  const std::function<void(std::uint64_t, std::uint64_t)>& fn) {
  const std::uint64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const std::uint64_t parts =
      std::clamp<std::uint64_t>(count / std::max<std::uint64_t>(grain, 1), 1, cores);
  if (parts == 1) {
    fn(0, count);
    return;
  }
  std::vector<std::thread> threads;
  const std::uint64_t per = (count + parts - 1) / parts;
  for (std::uint64_t b = per; b < count; b += per) {
    threads.emplace_back(fn, b, std::min(count, b + per));
  }
  fn(0, std::min(count, per));
  for (std::thread& t : threads) {
    t.join();
  }
}

// Elements [begin, begin + n) of a model-dtype weight as F32 into out[0, n) (BF16:
// a shift, the hot case).
void widen(const std::byte* raw, DType dtype, std::uint64_t begin, std::uint64_t n, float* out) {
  if (dtype == DType::kBF16) {
    const std::byte* src = raw + 2 * begin;
    for (std::uint64_t i = 0; i < n; ++i) {
      std::uint16_t b = 0;
      std::memcpy(&b, src + 2 * i, 2);
      out[i] = std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
    }
    return;
  }
  gpu::host::cast(reinterpret_cast<std::byte*>(out), DType::kF32, raw + begin * dtype_size(dtype),
                  dtype, n);
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
      const std::uint64_t count = rows * cols * matrices;
      hook.run = [=](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        std::vector<std::byte> raw(count * dtype_size(dtype));
        stream.copy_d2h(raw.data(), ctx.param_data(t), raw.size());
        stream.synchronize();
        // Quantized a chunk (a row, per channel) at a time through a small F32 buffer
        // per thread: nothing the size of the weight but its bytes in and out.
        std::vector<std::uint8_t> q(count);
        std::vector<float> scales(experts ? matrices : channel ? rows : 1);
        const std::uint64_t matrix = rows * cols;
        constexpr std::uint64_t kChunk = 1 << 16;
        auto amax_of = [&](std::uint64_t begin, std::uint64_t end) {
          std::vector<float> buf(std::min(kChunk, end - begin));
          float amax = 0;
          for (std::uint64_t b = begin; b < end; b += kChunk) {
            const std::uint64_t n = std::min(kChunk, end - b);
            widen(raw.data(), dtype, b, n, buf.data());
            amax = std::max(amax, max_abs(buf.data(), n));
          }
          return amax;
        };
        auto quantize_range = [&](std::uint64_t begin, std::uint64_t end, float mul) {
          std::vector<float> buf(std::min(kChunk, end - begin));
          for (std::uint64_t b = begin; b < end; b += kChunk) {
            const std::uint64_t n = std::min(kChunk, end - b);
            widen(raw.data(), dtype, b, n, buf.data());
            quantize_span(buf.data(), n, mul, q.data() + b);
          }
        };
        if (channel && !experts) {
          parallel_for(rows, kChunk / std::max<std::uint64_t>(cols, 1),
                       [&](std::uint64_t b, std::uint64_t e) {
                         for (std::uint64_t row = b; row < e; ++row) {
                           const Scale sc = amax_scale(amax_of(row * cols, (row + 1) * cols));
                           quantize_range(row * cols, (row + 1) * cols, sc.mul);
                           scales[row] = sc.scale;
                         }
                       });
        } else {
          // One scale a matrix: its amax in parallel parts, then its quantization.
          for (std::uint64_t m = 0; m < matrices; ++m) {
            const std::uint64_t base = m * matrix;
            std::vector<float> part_max(std::max(1u, std::thread::hardware_concurrency()), 0.0f);
            std::atomic<std::size_t> next{0};
            parallel_for(matrix, kChunk, [&](std::uint64_t b, std::uint64_t e) {
              part_max[next.fetch_add(1)] = amax_of(base + b, base + e);
            });
            const float amax = *std::max_element(part_max.begin(), part_max.end());
            const Scale sc = experts ? amax_scale(amax) : input_to_float8_scale(amax);
            parallel_for(matrix, kChunk, [&](std::uint64_t b, std::uint64_t e) {
              quantize_range(base + b, base + e, sc.mul);
            });
            scales[m] = sc.scale;
          }
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
