#include "models/requant.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/error.hpp"
#include "common/fp8.hpp"
#include "gpu/device.hpp"
#include "gpu/kernels_host.hpp"
#include "models/quant.hpp"

namespace ferry::models {
namespace {

constexpr float kFp8Max = 448.0f;
constexpr std::uint64_t kUe8m0Block = 128;

float bf16_round(float v) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(v);
  return std::bit_cast<float>(static_cast<std::uint32_t>(gpu::host::f32_to_bf16(b)) << 16);
}

[[noreturn]] void bad(const std::string& param, const std::string& rule) {
  throw Error(Stage::kPostProcess, "", param, "quantization.requant: " + rule);
}

}  // namespace

float ceil_to_ue8m0(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(std::fabs(x));
  std::uint32_t e = (b >> 23) & 0xFFu;
  if ((b & 0x7FFFFFu) != 0) {
    ++e;
  }
  e = std::clamp<std::uint32_t>(e, 1, 254);
  return std::bit_cast<float>(e << 23);
}

void requant_ue8m0(std::uint8_t* weight, float* scale, std::int32_t* packed, std::uint64_t rows,
                   std::uint64_t cols) {
  const std::uint64_t b = kUe8m0Block;
  const std::uint64_t nb = (rows + b - 1) / b;
  const std::uint64_t kb = (cols + b - 1) / b;
  std::vector<float> x(rows * cols);
  for (std::uint64_t i = 0; i < rows; ++i) {
    for (std::uint64_t j = 0; j < cols; ++j) {
      x[i * cols + j] =
          bf16_round(e4m3_to_float(weight[i * cols + j]) * scale[(i / b) * kb + j / b]);
    }
  }
  for (std::uint64_t bi = 0; bi < nb; ++bi) {
    for (std::uint64_t bj = 0; bj < kb; ++bj) {
      float amax = 0;
      const std::uint64_t i_end = std::min(rows, (bi + 1) * b);
      const std::uint64_t j_end = std::min(cols, (bj + 1) * b);
      for (std::uint64_t i = bi * b; i < i_end; ++i) {
        for (std::uint64_t j = bj * b; j < j_end; ++j) {
          amax = std::max(amax, std::fabs(x[i * cols + j]));
        }
      }
      const float sf = ceil_to_ue8m0(std::max(amax, 1e-4f) / kFp8Max);
      const float inv = 1.0f / sf;  // exact: sf is a power of two
      for (std::uint64_t i = bi * b; i < i_end; ++i) {
        for (std::uint64_t j = bj * b; j < j_end; ++j) {
          weight[i * cols + j] = float_to_e4m3(x[i * cols + j] * inv);
        }
      }
      scale[bi * kb + bj] = sf;
    }
  }
  // DeepGEMM's layout: a row per output row, four exponent bytes an I32, MN-major.
  const std::uint64_t words = (kb + 3) / 4;
  for (std::uint64_t r = 0; r < rows; ++r) {
    for (std::uint64_t w = 0; w < words; ++w) {
      std::uint32_t word = 0;
      for (std::uint64_t byte = 0; byte < 4; ++byte) {
        const std::uint64_t k = w * 4 + byte;
        if (k < kb) {
          const std::uint32_t e =
              (std::bit_cast<std::uint32_t>(scale[(r / b) * kb + k]) >> 23) & 0xFFu;
          word |= e << (8 * byte);
        }
      }
      packed[w * rows + r] = static_cast<std::int32_t>(word);
    }
  }
}

float requant_tensor(std::uint8_t* weight, float* scale, std::uint64_t rows, std::uint64_t cols,
                     std::uint64_t block_n, std::uint64_t block_k) {
  const std::uint64_t kb = (cols + block_k - 1) / block_k;
  std::vector<float> x(rows * cols);
  float amax = 0;
  for (std::uint64_t i = 0; i < rows; ++i) {
    for (std::uint64_t j = 0; j < cols; ++j) {
      const float v = e4m3_to_float(weight[i * cols + j]) * scale[(i / block_n) * kb + j / block_k];
      x[i * cols + j] = v;
      amax = std::max(amax, std::fabs(v));
    }
  }
  const float s = amax > 0 ? amax / kFp8Max : 1.0f;
  const float inv = 1.0f / s;
  for (std::uint64_t e = 0; e < x.size(); ++e) {
    weight[e] = float_to_e4m3(std::clamp(x[e] * inv, -kFp8Max, kFp8Max));
  }
  std::fill(scale, scale + ((rows + block_n - 1) / block_n) * kb, s);
  return s;
}

std::vector<PostLoadHook> make_requant_hooks(const Model& model, const QuantScheme& q) {
  std::vector<PostLoadHook> out;
  if (q.requant == QuantScheme::Requant::kNone) {
    return out;
  }
  const bool ue8m0 = q.requant == QuantScheme::Requant::kUe8m0;
  const std::vector<PostLoadHook> existing = model.hooks();
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    const RankShell& shell = model.shells()[r];
    for (std::size_t w = 0; w < shell.params.size(); ++w) {
      const ParamSpec& weight = shell.params[w];
      if (weight.dtype != DType::kF8E4M3 || !quantized_linear_param(weight.name)) {
        continue;
      }
      const std::string scale_name = weight_scale_name(q, weight.name);
      auto sit = shell.by_name.find(scale_name);
      const Shape scale_shape = block_scale_shape(weight.shape, q.block_n, q.block_k);
      if (sit == shell.by_name.end() || shell.params[sit->second].shape != scale_shape ||
          shell.params[sit->second].dtype != DType::kF32) {
        bad(scale_name, "no F32 " + format_shape(scale_shape) + " block scale for " + weight.name);
      }
      const std::string out_name =
          companion_name(weight.name, ue8m0 ? "weight_scale_ue8m0" : "weight_scale");
      auto it = shell.by_name.find(out_name);
      if (it == shell.by_name.end()) {
        bad(out_name, "the model declares no such parameter for " + weight.name);
      }
      const std::size_t output = it->second;
      const std::uint64_t rows = weight.shape[weight.shape.size() - 2];
      const std::uint64_t cols = weight.shape.back();
      const std::uint64_t matrices = weight.shape.size() == 3 ? weight.shape[0] : 1;
      const std::uint64_t kb = (cols + q.block_k - 1) / q.block_k;
      const std::uint64_t words = (kb + 3) / 4;
      if (ue8m0) {
        Shape want = weight.shape;
        want.back() = words;
        if (shell.params[output].shape != want || shell.params[output].dtype != DType::kI32) {
          bad(out_name, "parameter is " + format_shape(shell.params[output].shape) +
                            ", expected I32 " + format_shape(want));
        }
      }
      PostLoadHook hook;
      hook.name = std::string(ue8m0 ? "requant_ue8m0:" : "requant_tensor:") + weight.name +
                  " (tp rank " + std::to_string(shell.tp_rank) + ")";
      hook.local_rank = r;
      hook.rewrites = {w, sit->second};
      hook.outputs = {output};
      // After every hook that reads this weight or its scale as it was loaded.
      for (const PostLoadHook& h : existing) {
        if (h.local_rank == r && !h.outputs.empty() &&
            std::any_of(h.inputs.begin(), h.inputs.end(),
                        [&](std::size_t p) { return p == w || p == sit->second; })) {
          hook.inputs.push_back(h.outputs.front());
        }
      }
      const std::size_t scale = sit->second;
      const std::uint64_t weight_bytes = weight.nbytes;
      const std::uint64_t scale_elems = shell.params[scale].nbytes / sizeof(float);
      const std::uint64_t out_bytes = shell.params[output].nbytes;
      const std::uint64_t bn = q.block_n;
      const std::uint64_t bk = q.block_k;
      hook.run = [=](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        std::vector<std::uint8_t> wq(weight_bytes);
        std::vector<float> s(scale_elems);
        std::vector<std::byte> result(out_bytes);
        stream.copy_d2h(reinterpret_cast<std::byte*>(wq.data()), ctx.param_data(w), wq.size());
        stream.copy_d2h(reinterpret_cast<std::byte*>(s.data()), ctx.param_data(scale),
                        s.size() * sizeof(float));
        stream.synchronize();
        const std::uint64_t per_scale = scale_elems / matrices;
        for (std::uint64_t e = 0; e < matrices; ++e) {
          std::uint8_t* m = wq.data() + e * rows * cols;
          float* ms = s.data() + e * per_scale;
          if (ue8m0) {
            requant_ue8m0(m, ms, reinterpret_cast<std::int32_t*>(result.data()) + e * words * rows,
                          rows, cols);
          } else {
            const float t = requant_tensor(m, ms, rows, cols, bn, bk);
            std::memcpy(result.data() + e * sizeof(float), &t, sizeof t);
          }
        }
        stream.copy_h2d(ctx.param_data(w), reinterpret_cast<const std::byte*>(wq.data()),
                        wq.size());
        stream.copy_h2d(ctx.param_data(scale), reinterpret_cast<const std::byte*>(s.data()),
                        s.size() * sizeof(float));
        stream.copy_h2d(ctx.param_data(output), result.data(), result.size());
        stream.synchronize();  // the host buffers die with this call
      };
      out.push_back(std::move(hook));
    }
  }
  return out;
}

}  // namespace ferry::models
