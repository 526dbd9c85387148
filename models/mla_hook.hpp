// Multi-head latent attention (DeepSeek-V2/V3) after loading: kv_b_proj is split
// per head into the two matrices the absorbed attention kernels read, w_kc and w_vc,
// in the storage layouts SGLang's post_load_weights leaves them in. Also a Model
// decorator that gives params non-contiguous strides, which w_kc and w_vc need
// (TableModel declares every param contiguous).
//
// kv_b_proj (a rank's share, column-parallel by heads) is [H * (dn + dv), r] with
// H local heads, dn = qk_nope_head_dim, dv = v_head_dim, r = kv_lora_rank. As in
// the DeepSeek-V2 paper, its output rows stack the up-projections of the compressed
// KV latent head by head: head h owns rows [h*(dn+dv), (h+1)*(dn+dv)), of which the
// first dn are W^UK (the key's non-rotary part) and the last dv are W^UV (the
// value). (Not "all key rows, then all value rows": SGLang unflattens the rows into
// [H, dn + dv] before splitting.) So, with kv_b[row][c]:
//
//   w_kc[h, i, c] = kv_b[h*(dn+dv) + i][c]        logical [H, dn, r]
//                 stored at h*r*dn + c*dn + i     strides (r*dn, 1, dn): per head,
//                                                 W^UK transposed ([r][dn] rows)
//   w_vc[h, c, k] = kv_b[h*(dn+dv) + dn + k][c]   logical [H, r, dv]
//                 stored at h*dv*r + k*r + c      strides (dv*r, 1, r): per head,
//                                                 W^UV's rows as they are
//
// Device work: one batched transpose (w_kc) and one pitched device-to-device copy
// (w_vc) on the copy worker's stream; nothing comes back to the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/model.hpp"

namespace ferry::models {

struct MlaDims {
  std::uint64_t heads = 0;         // local heads H (num_attention_heads / tp, padded up)
  std::uint64_t qk_nope = 0;       // dn, qk_nope_head_dim
  std::uint64_t v_head = 0;        // dv, v_head_dim
  std::uint64_t kv_lora_rank = 0;  // r
};

// Logical shapes and storage strides (elements) of the two hook outputs.
Shape mla_w_kc_shape(const MlaDims& d);                         // [H, dn, r]
std::vector<std::uint64_t> mla_w_kc_strides(const MlaDims& d);  // (r*dn, 1, dn)
Shape mla_w_vc_shape(const MlaDims& d);                         // [H, r, dv]
std::vector<std::uint64_t> mla_w_vc_strides(const MlaDims& d);  // (dv*r, 1, r)

// The hook of one attention module on local rank `local_rank` of `model`:
// input <attn_prefix>kv_b_proj.weight, outputs <attn_prefix>w_kc and
// <attn_prefix>w_vc (attn_prefix e.g. "model.layers.3.self_attn."). Throws
// Error(Stage::kPostProcess) naming the param when one is missing or its shape or
// dtype does not fit `dims`.
//
// A quantized kv_b_proj (F8_E4M3 or NVFP4's packed U8, with the scales `quant` gives
// it, models/quant.hpp) is first converted as SGLang 0.5.23's post_load_weights
// (deepseek_common/deepseek_weight_loader.py) does on CUDA, per format
// (mla_split_form):
// - FP8 with 128 x 128 blocks: dequantized to BF16, whatever the model dtype
//   (block_quant_dequant): element (row, c) is f32(kv_b[row][c]) times its block
//   scale, rounded once to BF16; w_kc / w_vc are BF16.
// - FP8 with other blocks, per-channel or per-tensor scales: dequantized to F32 and
//   requantized with one scale (block_quant_to_tensor_quant,
//   channel_quant_to_tensor_quant: scaled_fp8_quant, s = amax / 448); w_kc / w_vc
//   are F8_E4M3 and <attn>w_scale (F32 [1]) holds s.
// - NVFP4: dequantized to the model dtype. (SGLang 0.5.23 has no NVFP4 case there:
//   it would split the packed bytes; ModelOpt's NVFP4 DeepSeek checkpoints leave
//   kv_b_proj unquantized. ferry's is a deliberate difference.)
// Then split as above. The hook's inputs are kv_b_proj and its scales. FP8 is
// converted on the device (gpu::Stream::dequantize_fp8, quantize_fp8) in the hook's
// device scratch, then split from there: no host round trip. NVFP4 stays on the host
// (the device has no E2M1 kernel): the hook reads kv_b_proj and its scales back,
// dequantizes and splits there, writes w_kc and w_vc with one host-to-device copy
// each and synchronizes before returning. kv_b_proj keeps its quantized bytes and
// scales.
// What the split of a kv_b_proj leaves (see make_mla_split_hook). kAsLoaded: w_kc /
// w_vc in kv_b_proj's own dtype (not quantized, or quantized only after the split
// by quantization.online).
enum class MlaSplitForm { kAsLoaded, kBf16, kFp8Tensor, kDequantized };
MlaSplitForm mla_split_form(const QuantScheme& quant, bool kv_b_quantized);

PostLoadHook make_mla_split_hook(const Model& model, std::size_t local_rank,
                                 const std::string& attn_prefix, const MlaDims& dims,
                                 const QuantScheme& quant = {});

}  // namespace ferry::models
