// quantization.requant: an FP8 block-scaled checkpoint's weights and scales converted
// after loading, for kernels that want other scales than the checkpoint's (SGLang's
// process_weights_after_loading, python/sglang/srt/layers/quantization/fp8_utils.py).
//
// ue8m0 (requant_weight_ue8m0, what SGLang does for DeepGEMM on Blackwell), for
// 128 x 128 blocks, per weight matrix W [N, K] with block scales S:
//   x     = bf16(f32(W) * S[i/128][j/128])         dequantized, rounded once to BF16
//   amax  = max |x| over each 128 x 128 tile, at least 1e-4
//   sf    = ceil_to_ue8m0(amax / 448)             the power of two at or above it
//                                                 (exponent clamped to [1, 254])
//   W'    = e4m3(x * (1 / sf))                     round to nearest even
// W and S are rewritten in place (S, the transient <w>weight_scale_inv_f32 the
// checkpoint's scales load into, holds sf), and <w>weight_scale_inv holds the same
// scales packed as DeepGEMM reads them (transform_scale_ue8m0; SGLang 0.5.23's
// requant_weight_ue8m0_inplace replaces weight_scale_inv with them, so no F32 copy is
// left after the load): one row per output row (block row r / 128),
// each scale's exponent byte (F32 bits >> 23), four to an I32 little-endian (column
// blocks 4j..4j+3, zero past the last), MN-major: logical [N, ceil(Kb / 4)] with
// strides (1, N), so N must be a multiple of 4 (TMA alignment).
//
// tensor (block_quant_to_tensor_quant, as scaled_fp8_quant on CUDA), per weight
// matrix (per expert of fused experts):
//   x     = f32(W) * S[i/bn][j/bk]                 in F32
//   s     = max |x| / 448                          (1 for an all-zero matrix)
//   W'    = e4m3(clamp(x * (1 / s), -448, 448))    round to nearest even
// W is rewritten, S holds s in every block, and <w>weight_scale (F32 [1], or [E] for
// fused experts) holds s.
//
// The hooks run after every hook that reads the same weight first (the MLA split of
// kv_b_proj, the V3.2 indexer's fusion of wk), as SGLang's post_load_weights runs
// before process_weights_after_loading. They run on the device (gpu::Stream's FP8
// operations), one weight matrix at a time through the hook's device scratch
// (scratch_bytes: a matrix's BF16 values for ue8m0, F32 for tensor): dequantize,
// requantize into W and S with the rule above, then pack (ue8m0) or gather the
// tensor scales; nothing comes back to the host. requant_ue8m0 and requant_tensor
// below are the same conversions on host memory: the definition the device path is
// tested against.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "models/model.hpp"

namespace ferry::models {

// The conversions, on one [rows, cols] matrix of F8_E4M3 bytes with F32 block scales
// [ceil(rows / bn), ceil(cols / bk)] (both rewritten in place). requant_ue8m0 needs
// 128 x 128 blocks and rows % 4 == 0, and writes `packed` (ceil(Kb / 4) * rows I32,
// MN-major); requant_tensor returns the tensor scale.
void requant_ue8m0(std::uint8_t* weight, float* scale, std::int32_t* packed, std::uint64_t rows,
                   std::uint64_t cols);
float requant_tensor(std::uint8_t* weight, float* scale, std::uint64_t rows, std::uint64_t cols,
                     std::uint64_t block_n, std::uint64_t block_k);

// ceil_to_ue8m0 of SGLang's fp8_utils: the smallest power of two >= |x| (the
// exponent rounded up when the mantissa is nonzero), exponent clamped to [1, 254].
float ceil_to_ue8m0(float x);

// The requant hooks of every FP8 block-quantized param of `model` (whose shells
// already declare the outputs, with the packed ue8m0 scales' MN-major strides:
// TableModel::apply_quant), ordered after `model`'s hooks that read the weights as
// loaded. Throws Error(Stage::kPostProcess) naming a param whose scale or output is
// missing or misshapen.
std::vector<PostLoadHook> make_requant_hooks(const Model& model, const QuantScheme& quant);

}  // namespace ferry::models
