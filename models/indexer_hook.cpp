#include "models/indexer_hook.hpp"

#include <vector>

#include "common/error.hpp"
#include "gpu/device.hpp"
#include "gpu/kernels_host.hpp"
#include "models/quant.hpp"

namespace ferry::models {
namespace {

[[noreturn]] void bad(const std::string& param, const std::string& rule) {
  throw Error(Stage::kPostProcess, "", param, "indexer wk / weights_proj fusion: " + rule);
}

}  // namespace

PostLoadHook make_indexer_fuse_hook(const Model& model, std::size_t local_rank,
                                    const std::string& indexer_prefix, const QuantScheme& quant) {
  if (local_rank >= model.shells().size()) {
    bad(indexer_prefix, "local rank " + std::to_string(local_rank) + " has no shell");
  }
  const RankShell& shell = model.shells()[local_rank];
  auto find = [&](const std::string& name) {
    auto it = shell.by_name.find(name);
    if (it == shell.by_name.end()) {
      bad(name, "the model declares no such parameter");
    }
    return it->second;
  };
  // Quantized while loading (quantization.online): the full precision it was loaded
  // in; served in Marlin's layout (postprocess.target=sm90): the weight as loaded.
  const std::size_t wk = find(as_loaded_name(shell, indexer_prefix + "wk.weight"));
  const std::size_t proj = find(indexer_prefix + "weights_proj.weight");
  const std::size_t fused = find(indexer_prefix + "wk_weights_proj.weight");
  const ParamSpec& out = shell.params[fused];
  const ParamSpec& w = shell.params[wk];
  const ParamSpec& p = shell.params[proj];
  const DType dtype = out.dtype;
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32) {
    bad(out.name, "parameter is " + std::string(dtype_name(dtype)) +
                      "; the fused indexer projection is BF16, F16 or F32");
  }
  const bool quantized = w.dtype == DType::kF8E4M3 || w.dtype == DType::kU8;
  if (out.shape.size() != 2 || p.shape.size() != 2 || w.shape.size() != 2 ||
      p.shape[1] != out.shape[1] || w.shape[0] + p.shape[0] != out.shape[0] ||
      (!quantized && w.shape[1] != out.shape[1]) || p.dtype != dtype ||
      (!quantized && w.dtype != dtype)) {
    bad(out.name, "parameter is " + std::string(dtype_name(dtype)) + " " + format_shape(out.shape) +
                      ", which is not wk " + std::string(dtype_name(w.dtype)) + " " +
                      format_shape(w.shape) + " then weights_proj " +
                      std::string(dtype_name(p.dtype)) + " " + format_shape(p.shape));
  }
  const std::uint64_t cols = out.shape[1];
  const std::uint64_t wk_rows = w.shape[0];
  const std::size_t es = dtype_size(dtype);
  PostLoadHook hook;
  hook.name = "indexer_fuse_wk_weights_proj:" + indexer_prefix + " (tp rank " +
              std::to_string(shell.tp_rank) + ")";
  hook.local_rank = local_rank;
  hook.inputs = {wk, proj};
  hook.outputs = {fused};
  const std::size_t proj_bytes = p.nbytes;
  if (!quantized) {
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      const std::size_t wk_bytes = wk_rows * cols * es;
      stream.copy_d2d_2d(ctx.param_data(fused), wk_bytes, ctx.param_data(wk), wk_bytes, wk_bytes,
                         1);
      stream.copy_d2d_2d(ctx.param_data(fused) + wk_bytes, proj_bytes, ctx.param_data(proj),
                         proj_bytes, proj_bytes, 1);
    };
    return hook;
  }
  const QuantizedInputs in = quantized_inputs(quant, shell, wk);
  hook.inputs.push_back(in.scale);
  if (in.scale_2) {
    hook.inputs.push_back(*in.scale_2);
  }
  if (quant.method != QuantScheme::Method::kNvfp4) {
    // FP8: wk dequantized on the device straight into the fused param's first rows.
    const gpu::Fp8Scales scales = fp8_scales(quant);
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      stream.dequantize_fp8(ctx.param_data(fused), dtype, ctx.param_data(wk),
                            ctx.param_data(in.scale), scales, wk_rows, cols, 1);
      const std::size_t wk_bytes = wk_rows * cols * es;
      stream.copy_d2d_2d(ctx.param_data(fused) + wk_bytes, proj_bytes, ctx.param_data(proj),
                         proj_bytes, proj_bytes, 1);
    };
    return hook;
  }
  // NVFP4: on the host (the device has no E2M1 kernel).
  const std::size_t weight_bytes = w.nbytes;
  const std::size_t scale_bytes = shell.params[in.scale].nbytes;
  hook.run = [=](HookContext& ctx) {
    gpu::Stream& stream = ctx.stream();
    std::vector<std::uint8_t> q(weight_bytes);
    std::vector<std::byte> s(scale_bytes);
    float scale_2 = 1.0f;
    stream.copy_d2h(reinterpret_cast<std::byte*>(q.data()), ctx.param_data(wk), q.size());
    stream.copy_d2h(s.data(), ctx.param_data(in.scale), s.size());
    if (in.scale_2) {
      stream.copy_d2h(reinterpret_cast<std::byte*>(&scale_2), ctx.param_data(*in.scale_2),
                      sizeof scale_2);
    }
    stream.synchronize();
    const QuantizedMatrix m{&quant, wk_rows, cols, q.data(), s.data(), scale_2};
    std::vector<float> values(wk_rows * cols);
    for (std::uint64_t r = 0; r < wk_rows; ++r) {
      for (std::uint64_t c = 0; c < cols; ++c) {
        values[r * cols + c] = m.at(r, c);
      }
    }
    std::vector<std::byte> rows(values.size() * es);
    gpu::host::cast(rows.data(), dtype, reinterpret_cast<const std::byte*>(values.data()),
                    DType::kF32, values.size());
    stream.copy_h2d(ctx.param_data(fused), rows.data(), rows.size());
    stream.copy_d2d_2d(ctx.param_data(fused) + rows.size(), proj_bytes, ctx.param_data(proj),
                       proj_bytes, proj_bytes, 1);
    stream.synchronize();  // the host buffers die with this call
  };
  return hook;
}

}  // namespace ferry::models
