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
#include "models/postprocess.hpp"
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
  if (q.requant == QuantScheme::Requant::kNone && q.target != QuantScheme::Target::kSm100) {
    return out;
  }
  const std::vector<PostLoadHook> existing = model.hooks();
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    const RankShell& shell = model.shells()[r];
    for (std::size_t w = 0; w < shell.params.size(); ++w) {
      const ParamSpec& weight = shell.params[w];
      if (weight.dtype != DType::kF8E4M3 || !quantized_linear_param(weight.name) ||
          weight.transient || q.method != QuantScheme::Method::kFp8Block) {
        continue;
      }
      // ue8m0: quantization.requant=ue8m0, or postprocess.target=sm100 where DeepGEMM
      // runs the weight (converts_ue8m0); tensor: quantization.requant=tensor.
      const bool ue8m0 = converts_ue8m0(q, weight.shape);
      if (!ue8m0 && q.requant != QuantScheme::Requant::kTensor) {
        continue;
      }
      const std::string scale_name = loaded_scale_name(q, weight.name, ue8m0);
      auto sit = shell.by_name.find(scale_name);
      const Shape scale_shape = block_scale_shape(weight.shape, q.block_n, q.block_k);
      if (sit == shell.by_name.end() || shell.params[sit->second].shape != scale_shape ||
          shell.params[sit->second].dtype != DType::kF32) {
        bad(scale_name, "no F32 " + format_shape(scale_shape) + " block scale for " + weight.name);
      }
      const std::string out_name =
          ue8m0 ? weight_scale_name(q, weight.name) : companion_name(weight.name, "weight_scale");
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
      const std::uint64_t per_scale =
          shell.params[scale].nbytes / sizeof(float) / std::max<std::uint64_t>(matrices, 1);
      const std::uint64_t bn = ue8m0 ? kUe8m0Block : q.block_n;
      const std::uint64_t bk = ue8m0 ? kUe8m0Block : q.block_k;
      // One matrix at a time through device scratch: its dequantized values (BF16
      // for ue8m0, rounded once as SGLang's requant_weight_ue8m0 does; exact F32 for
      // the tensor scale), then requantized from there into the weight and scale.
      const std::size_t value_bytes = ue8m0 ? 2 : 4;
      hook.scratch_bytes = rows * cols * value_bytes;
      hook.run = [=](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        std::byte* values = ctx.scratch(rows * cols * value_bytes);
        std::byte* weight_data = ctx.param_data(w);
        std::byte* scale_data = ctx.param_data(scale);
        const DType value_dtype = ue8m0 ? DType::kBF16 : DType::kF32;
        const gpu::Fp8Scales blocks{gpu::Fp8Granularity::kBlock, bn, bk, 1};
        // block_quant_to_tensor_quant: the one scale in every block of S.
        const gpu::Fp8Scales target =
            ue8m0 ? blocks : gpu::Fp8Scales{gpu::Fp8Granularity::kTensor, 0, 0, per_scale};
        const gpu::Fp8ScaleRule rule =
            ue8m0 ? gpu::Fp8ScaleRule::kUe8m0 : gpu::Fp8ScaleRule::kAmaxOrOne;
        for (std::uint64_t e = 0; e < matrices; ++e) {
          std::byte* m = weight_data + e * rows * cols;
          std::byte* ms = scale_data + e * per_scale * sizeof(float);
          stream.dequantize_fp8(values, value_dtype, m, ms, blocks, rows, cols, 1);
          stream.quantize_fp8(m, ms, values, value_dtype, target, rule, rows, cols, 1);
        }
        if (ue8m0) {
          stream.pack_ue8m0(ctx.param_data(output), scale_data, rows, kUe8m0Block, kb, matrices);
        } else {
          // <w>weight_scale: each matrix's scale, the first of its blocks.
          stream.copy_d2d_2d(ctx.param_data(output), sizeof(float), scale_data,
                             per_scale * sizeof(float), sizeof(float), matrices);
        }
      };
      out.push_back(std::move(hook));
    }
  }
  return out;
}

}  // namespace ferry::models
