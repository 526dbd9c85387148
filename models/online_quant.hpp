// quantization.online: a full-precision (BF16 / F16 / F32) checkpoint quantized to
// FP8 while it loads, as SGLang's Fp8LinearMethod / Fp8MoEMethod
// process_weights_after_loading do for a checkpoint that is not FP8-serialized
// (python/sglang/srt/layers/quantization/fp8.py). Each quantized linear param P
// (models/quant.hpp's quantized_linear_param) is declared F8_E4M3 with an F32
// <P>weight_scale (TableModel::apply_online); the checkpoint's pieces fill a
// transient <P>weight_unquantized in the model dtype, and a hook quantizes it into P:
//
//   per channel (dense linears): s[r] = max_j |x[r][j]| / 448 (SGLang's per-token
//       kernel: no epsilon), q = e4m3(clamp(x * (1 / s[r]), -448, 448)); scale [N, 1]
//       (q = 0 where s = 0)
//   per tensor (dense linears): amax = max(max |x|, 1e-12), m = 448 / amax,
//       q = e4m3(clamp(x * m, -448, 448)), scale [1] = 1 / m (input_to_float8)
//   fused experts, either way: one scale an expert for the whole w13 (gate and up
//       together) and w2, s = max |x| / 448 (scaled_fp8_quant), [E]
//
// rounding to nearest even. The MLA split and the V3.2 indexer fusion read the
// transient too (they run before the quantization in SGLang). The hooks run on the
// device: one gpu::Stream::quantize_fp8 each (kRow with kAmax, kTensor with
// kInputToFloat8, experts kTensor batched with kAmax), its amax reductions on the
// device too; nothing comes back to the host. The functions below are the same
// quantizations on host memory: the definition the device path is tested against.
#pragma once

#include <cstdint>
#include <vector>

#include "models/model.hpp"

namespace ferry::models {

// The quantizations, on one [rows, cols] matrix of F32 values into E4M3 bytes:
// per_channel writes `rows` scales; per_tensor and per_expert return the one scale.
void online_quant_per_channel(const float* x, std::uint64_t rows, std::uint64_t cols,
                              std::uint8_t* q, float* scales);
float online_quant_per_tensor(const float* x, std::uint64_t count, std::uint8_t* q);
float online_quant_per_expert(const float* x, std::uint64_t count, std::uint8_t* q);

// The quantization hook of every param of `model` that has a transient
// <P>weight_unquantized. Throws Error(Stage::kPostProcess) naming a param whose
// transient or scale is missing or misshapen.
std::vector<PostLoadHook> make_online_quant_hooks(const Model& model, const QuantScheme& quant);

}  // namespace ferry::models
