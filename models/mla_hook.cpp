#include "models/mla_hook.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/error.hpp"
#include "common/fp8.hpp"
#include "gpu/device.hpp"
#include "gpu/kernels_host.hpp"
#include "models/hooks.hpp"
#include "models/placement.hpp"
#include "models/quant.hpp"

namespace ferry::models {
namespace {

[[noreturn]] void bad_split(const std::string& param, const std::string& rule) {
  throw Error(Stage::kPostProcess, "", param, "MLA kv_b_proj split: " + rule);
}

// w_kc and w_vc from a dequantized kv_b_proj (`kv_b`, in the outputs' dtype, on the
// device): a batched transpose for w_kc, a pitched device copy for w_vc.
void split_on_device(gpu::Stream& stream, const MlaDims& dims, std::size_t es,
                     const std::byte* kv_b, std::byte* w_kc, std::byte* w_vc) {
  const std::uint64_t head_rows = dims.qk_nope + dims.v_head;
  const std::size_t row_bytes = dims.kv_lora_rank * es;
  const std::size_t head_bytes = head_rows * row_bytes;
  // w_kc: per head, the dn key rows of kv_b (each kv_lora_rank long), transposed
  // into kv_lora_rank rows of dn: one batched transpose, a batch per head.
  stream.transpose(w_kc, dims.kv_lora_rank * dims.qk_nope * es, kv_b, head_bytes, es, dims.qk_nope,
                   dims.kv_lora_rank, dims.heads);
  // w_vc: each head's dv value rows, already in storage order: one pitched
  // device copy with a row per head (skipping the head's dn key rows).
  const std::size_t vc_head_bytes = dims.v_head * row_bytes;
  stream.copy_d2d_2d(w_vc, vc_head_bytes, kv_b + dims.qk_nope * row_bytes, head_bytes,
                     vc_head_bytes, dims.heads);
}

// The quantized form of the split (see make_mla_split_hook). FP8: dequantized on
// the device into the hook's scratch, then split there as an unquantized kv_b_proj
// is. NVFP4: dequantized and split on the host (the device has no E2M1 kernel),
// then both outputs written.
PostLoadHook dequant_split_hook(const RankShell& shell, std::size_t local_rank,
                                const std::string& attn_prefix, const MlaDims& dims,
                                std::size_t kv_b, std::size_t w_kc, std::size_t w_vc,
                                const QuantScheme& quant) {
  const QuantizedInputs in = quantized_inputs(quant, shell, kv_b);
  const DType out_dtype = shell.params[w_kc].dtype;
  const MlaSplitForm form = mla_split_form(quant, true);
  const bool fp8_out = form == MlaSplitForm::kFp8Tensor;
  for (std::size_t out : {w_kc, w_vc}) {
    const DType d = shell.params[out].dtype;
    const bool fits = fp8_out ? d == DType::kF8E4M3
                      : form == MlaSplitForm::kBf16
                          ? d == DType::kBF16
                          : d == DType::kBF16 || d == DType::kF16 || d == DType::kF32;
    if (d != out_dtype || !fits) {
      bad_split(shell.params[out].name,
                "parameter is " + std::string(dtype_name(d)) + "; the split of a " + describe(quant) +
                    " kv_b_proj leaves w_kc and w_vc " +
                    (fp8_out                          ? "F8_E4M3"
                     : form == MlaSplitForm::kBf16 ? "BF16"
                                                      : "of one of BF16, F16, F32"));
    }
  }
  std::size_t w_scale = 0;
  if (fp8_out) {
    const std::string attn = shell.params[w_kc].name.substr(0, shell.params[w_kc].name.size() - 4);
    auto it = shell.by_name.find(attn + "w_scale");
    if (it == shell.by_name.end() || shell.params[it->second].dtype != DType::kF32 ||
        shell.params[it->second].shape != Shape{1}) {
      bad_split(attn + "w_scale", "the split of a " + describe(quant) +
                                      " kv_b_proj needs an F32 [1] parameter w_scale");
    }
    w_scale = it->second;
  }
  PostLoadHook hook;
  hook.name = "mla_dequant_split_kv_b:" + attn_prefix + "kv_b_proj (tp rank " +
              std::to_string(shell.tp_rank) + ")";
  hook.local_rank = local_rank;
  hook.inputs = {kv_b, in.scale};
  if (in.scale_2) {
    hook.inputs.push_back(*in.scale_2);
  }
  hook.outputs = {w_kc, w_vc};
  const std::uint64_t weight_bytes = shell.params[kv_b].nbytes;
  const std::uint64_t scale_bytes = shell.params[in.scale].nbytes;
  if (fp8_out) {
    hook.outputs.push_back(w_scale);
    const gpu::Fp8Scales scales = fp8_scales(quant);
    const std::uint64_t n = dims.heads * (dims.qk_nope + dims.v_head) * dims.kv_lora_rank;
    const std::uint64_t rows = dims.heads * (dims.qk_nope + dims.v_head);
    // F32 values, then their one-scale E4M3 requantization, split from there.
    hook.scratch_bytes = n * 4 + n;
    hook.run = [dims, kv_b, in, w_kc, w_vc, w_scale, scales, rows, n](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      std::byte* values = ctx.scratch(n * 4 + n);
      std::byte* requantized = values + n * 4;
      stream.dequantize_fp8(values, DType::kF32, ctx.param_data(kv_b), ctx.param_data(in.scale),
                            scales, rows, dims.kv_lora_rank, 1);
      stream.quantize_fp8(requantized, ctx.param_data(w_scale), values, DType::kF32,
                          gpu::Fp8Scales{gpu::Fp8Granularity::kTensor, 0, 0, 1},
                          gpu::Fp8ScaleRule::kAmax, rows, dims.kv_lora_rank, 1);
      split_on_device(stream, dims, 1, requantized, ctx.param_data(w_kc), ctx.param_data(w_vc));
    };
    return hook;
  }
  if (quant.method != QuantScheme::Method::kNvfp4) {
    const gpu::Fp8Scales scales = fp8_scales(quant);
    const std::uint64_t rows = dims.heads * (dims.qk_nope + dims.v_head);
    const std::size_t es = dtype_size(out_dtype);
    hook.scratch_bytes = rows * dims.kv_lora_rank * es;
    hook.run = [dims, kv_b, in, w_kc, w_vc, scales, rows, es, out_dtype](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      std::byte* dequantized = ctx.scratch(rows * dims.kv_lora_rank * es);
      stream.dequantize_fp8(dequantized, out_dtype, ctx.param_data(kv_b), ctx.param_data(in.scale),
                            scales, rows, dims.kv_lora_rank, 1);
      split_on_device(stream, dims, es, dequantized, ctx.param_data(w_kc), ctx.param_data(w_vc));
    };
    return hook;
  }
  hook.run = [dims, kv_b, in, w_kc, w_vc, quant, weight_bytes, scale_bytes,
              out_dtype](HookContext& ctx) {
    gpu::Stream& stream = ctx.stream();
    const std::uint64_t head_rows = dims.qk_nope + dims.v_head;
    const std::uint64_t r = dims.kv_lora_rank;
    std::vector<std::uint8_t> w(weight_bytes);
    std::vector<std::byte> s(scale_bytes);
    float scale_2 = 1.0f;
    stream.copy_d2h(reinterpret_cast<std::byte*>(w.data()), ctx.param_data(kv_b), w.size());
    stream.copy_d2h(s.data(), ctx.param_data(in.scale), s.size());
    if (in.scale_2) {
      stream.copy_d2h(reinterpret_cast<std::byte*>(&scale_2), ctx.param_data(*in.scale_2),
                      sizeof scale_2);
    }
    stream.synchronize();
    const QuantizedMatrix kv{&quant, dims.heads * head_rows, r, w.data(), s.data(), scale_2};
    // Storage order of each output (mla_w_kc_strides, mla_w_vc_strides).
    std::vector<float> kc(dims.heads * dims.qk_nope * r);
    std::vector<float> vc(dims.heads * r * dims.v_head);
    for (std::uint64_t h = 0; h < dims.heads; ++h) {
      for (std::uint64_t i = 0; i < dims.qk_nope; ++i) {
        for (std::uint64_t c = 0; c < r; ++c) {
          kc[h * r * dims.qk_nope + c * dims.qk_nope + i] = kv.at(h * head_rows + i, c);
        }
      }
      for (std::uint64_t k = 0; k < dims.v_head; ++k) {
        for (std::uint64_t c = 0; c < r; ++c) {
          vc[h * dims.v_head * r + k * r + c] = kv.at(h * head_rows + dims.qk_nope + k, c);
        }
      }
    }
    const std::size_t es = dtype_size(out_dtype);
    std::vector<std::byte> kc_out(kc.size() * es);
    std::vector<std::byte> vc_out(vc.size() * es);
    gpu::host::cast(kc_out.data(), out_dtype, reinterpret_cast<const std::byte*>(kc.data()),
                    DType::kF32, kc.size());
    gpu::host::cast(vc_out.data(), out_dtype, reinterpret_cast<const std::byte*>(vc.data()),
                    DType::kF32, vc.size());
    stream.copy_h2d(ctx.param_data(w_kc), kc_out.data(), kc_out.size());
    stream.copy_h2d(ctx.param_data(w_vc), vc_out.data(), vc_out.size());
    stream.synchronize();  // the host buffers die with this call
  };
  return hook;
}

}  // namespace

MlaSplitForm mla_split_form(const QuantScheme& quant, bool kv_b_quantized) {
  using Method = QuantScheme::Method;
  if (!kv_b_quantized || !quant.quantized()) {
    return MlaSplitForm::kAsLoaded;
  }
  if (quant.method == Method::kNvfp4) {
    return MlaSplitForm::kDequantized;
  }
  if (quant.method == Method::kFp8Block && quant.block_n == 128 && quant.block_k == 128) {
    return MlaSplitForm::kBf16;
  }
  return MlaSplitForm::kFp8Tensor;
}

Shape mla_w_kc_shape(const MlaDims& d) {
  return {d.heads, d.qk_nope, d.kv_lora_rank};
}

std::vector<std::uint64_t> mla_w_kc_strides(const MlaDims& d) {
  return {d.kv_lora_rank * d.qk_nope, 1, d.qk_nope};
}

Shape mla_w_vc_shape(const MlaDims& d) {
  return {d.heads, d.kv_lora_rank, d.v_head};
}

std::vector<std::uint64_t> mla_w_vc_strides(const MlaDims& d) {
  return {d.v_head * d.kv_lora_rank, 1, d.kv_lora_rank};
}

PostLoadHook make_mla_split_hook(const Model& model, std::size_t local_rank,
                                 const std::string& attn_prefix, const MlaDims& dims,
                                 const QuantScheme& quant) {
  if (local_rank >= model.shells().size()) {
    bad_split(attn_prefix, "local rank " + std::to_string(local_rank) + " has no shell");
  }
  const RankShell& shell = model.shells()[local_rank];
  auto find = [&](const std::string& name, const Shape& want) {
    auto it = shell.by_name.find(name);
    if (it == shell.by_name.end()) {
      bad_split(name, "the model declares no such parameter");
    }
    const ParamSpec& p = shell.params[it->second];
    if (p.shape != want) {
      bad_split(name, "parameter is " + format_shape(p.shape) + ", expected " + format_shape(want) +
                          " for " + std::to_string(dims.heads) + " local heads, qk_nope_head_dim " +
                          std::to_string(dims.qk_nope) + ", v_head_dim " +
                          std::to_string(dims.v_head) + ", kv_lora_rank " +
                          std::to_string(dims.kv_lora_rank));
    }
    return it->second;
  };
  // A quantized kv_b_proj is F8_E4M3, or NVFP4's packed bytes (half the columns).
  // Quantized while loading (quantization.online), it is split from the full
  // precision it was loaded in, as SGLang's post_load_weights runs before the
  // quantization.
  // Served in Marlin's layout (postprocess.target=sm90), it is split from the weight
  // as loaded, as post_load_weights runs before process_weights_after_loading.
  const std::string kv_b_name = as_loaded_name(shell, attn_prefix + "kv_b_proj.weight");
  auto kv_b_it = shell.by_name.find(kv_b_name);
  const bool quantized = quant.quantized() && kv_b_it != shell.by_name.end() &&
                         (shell.params[kv_b_it->second].dtype == DType::kF8E4M3 ||
                          shell.params[kv_b_it->second].dtype == DType::kU8);
  const bool packed = quantized && quant.method == QuantScheme::Method::kNvfp4;
  const std::size_t kv_b =
      find(kv_b_name, Shape{dims.heads * (dims.qk_nope + dims.v_head),
                            packed ? dims.kv_lora_rank / 2 : dims.kv_lora_rank});
  const std::size_t w_kc = find(attn_prefix + "w_kc", mla_w_kc_shape(dims));
  const std::size_t w_vc = find(attn_prefix + "w_vc", mla_w_vc_shape(dims));
  if (quantized) {
    return dequant_split_hook(shell, local_rank, attn_prefix, dims, kv_b, w_kc, w_vc, quant);
  }
  const DType dtype = shell.params[kv_b].dtype;
  for (std::size_t out : {w_kc, w_vc}) {
    if (shell.params[out].dtype != dtype) {
      bad_split(shell.params[out].name, "parameter is " +
                                            std::string(dtype_name(shell.params[out].dtype)) +
                                            " but kv_b_proj is " + std::string(dtype_name(dtype)));
    }
  }

  PostLoadHook hook;
  hook.name =
      "mla_split_kv_b:" + attn_prefix + "kv_b_proj (tp rank " + std::to_string(shell.tp_rank) + ")";
  hook.local_rank = local_rank;
  hook.inputs = {kv_b};
  hook.outputs = {w_kc, w_vc};
  const std::size_t es = dtype_size(dtype);
  // Both outputs are written on the device, in the copy worker's stream order: no
  // round trip through host memory, no wait until the worker's own synchronize.
  hook.run = [dims, es, kv_b, w_kc, w_vc](HookContext& ctx) {
    split_on_device(ctx.stream(), dims, es, ctx.param_data(kv_b), ctx.param_data(w_kc),
                    ctx.param_data(w_vc));
  };
  return hook;
}

}  // namespace ferry::models
