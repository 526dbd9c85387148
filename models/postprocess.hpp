// postprocess.target: the FP8 layouts SGLang 0.5.23's process_weights_after_loading
// leaves on an NVIDIA GPU with default server options, produced after loading by
// post-load hooks on the device. SGLang runs that step after its weight loaders and
// the model's post_load_weights (DefaultModelLoader.load_weights_and_postprocess),
// so these hooks run after every hook that reads a weight as loaded (the MLA split,
// the V3.2 indexer fusion).
//
// Targets: kLoader (the weight loaders' state, no change), kSm90 (Hopper), kSm100
// (Blackwell). What changes, per method (dense linear layers and fused experts):
//
// FP8 per tensor (QuantScheme::kFp8Tensor), dense, N output rows in shards of
// widths w_0..w_{S-1} (q, k, v / gate, up; one for the others), S loaded scales:
//   fp8 (Fp8LinearMethod, cutlass_fp8_supported on both targets):
//     weight_scale F32 [N, 1]: row r holds its shard's scale (convert_to_channelwise);
//     the weight is unchanged.
//   compressed-tensors (CompressedTensorsW8A8Fp8, strategy tensor):
//     every shard requantized to s = max of the S scales (requantize_with_max_scale):
//       x = f16(f32(q) * s_i)             per_tensor_dequantize: an F16 tensor times
//                                         the scale, rounded once to F16
//       q' = e4m3(f32(x) * (1 / s))       scaled_fp8_quant with a static scale
//     weight_scale F32 [] holding s.
//   ModelOpt (ModelOptFp8LinearMethod): requantized as compressed-tensors; then
//     weight_scale F32 [] when N and K are multiples of 16 (FlashInfer's bmm_fp8
//     runs it: _can_use_flashinfer_bmm), else F32 [N, 1] with s in every row.
// FP8 per tensor, fused experts [E, 2I, K] with w13 scales [E, 2] (Fp8MoEMethod,
// CompressedTensorsW8A8Fp8MoEMethod, ModelOptFp8MoEMethod): each expert's w1 and
// w3 requantized to the larger of its two scales as above; w13_weight_scale F32 [E].
// w2_weight_scale [E] is unchanged.
// Static input scales (every FP8 method that has them, dense and experts): the
// largest of them, F32 [] (input_scale.max()).
// FP8 per channel: unchanged (but a static input_scale, as above).
// FP8 blocks: unchanged on kSm90; on kSm100 DeepGEMM's UE8M0 repack
// (models/requant.hpp) of each weight converts_ue8m0 accepts
// (requant_block_scale_ue8m0_for_deepgemm / should_deepgemm_weight_requant_ue8m0).
// KV-cache scales (BaseKVCacheMethod.process_weights_after_loading): each attention
// SGLang gives a KV-cache method holds k_scale and v_scale, F32 []; both > 0: kept;
// both <= 0 (or not in the checkpoint, SGLang's -1.0): 1.0 each; one > 0: the larger
// in both (one kv_scale loaded as k_scale). fp8 checkpoints have them on every
// attention (Fp8KVCacheMethod), ModelOpt ones with an FP8 KV cache or NVFP4 too; MLA on
// attn_mqa (loaded) and attn_mha (1.0).
//
// Every per-tensor FP8 weight SGLang keeps is its transposed view (weight.t()):
// the same storage, which ferry keeps as loaded ([N, K] row-major); an engine binds
// it transposed. Where a scale changes shape, the checkpoint's values load into a
// transient "<w>weight_scale_loaded" / "<w>input_scale_loaded" of the loaded shape
// that the hook reads; the model keeps the served shape under SGLang's name.
//
// NVFP4 (ModelOptFp4LinearMethod), dense, on kSm100: SGLang 0.5.23's default FP4
// GEMM backend there is flashinfer_cutedsl (fp4_utils.initialize_fp4_gemm_config),
// W4A4 unless SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16 is set, so
// process_weights_after_loading leaves:
//   alpha F32 [] = f32(input_scale.max() * weight_scale_2.max());
//   input_scale_inv F32 [] = 1 / input_scale.max();
//   the weight [N, K/2] U8 as loaded, or where N or K is not a multiple of 32
//     pad_nvfp4_weight's [N', K'/2] (both rounded up to 32, zeros after each row
//     and below; copy_or_rebind_param rebinds it): the checkpoint's bytes load into
//     the transient twin "<w>weight_loaded", which a hook copies in (nvfp4_pads);
//   the E4M3 block scales [M, C] (M = N, C = K/16) zero-padded to [M', C'] (M' =
//     M rounded up to 128, C' = C to 4) and swizzled: viewed as [M'/128, 4, 32,
//     C'/4, 4] and permuted (0, 3, 2, 1, 4) (swizzle_blockscale). Where [M', C'] is
//     [M, C], alias_or_bind_derived_param writes them over weight_scale (the
//     checkpoint's scales load into the transient twin "<w>weight_scale_loaded",
//     ScaleForm::kSwizzled); else weight_scale stays as loaded and a new
//     weight_scale_interleaved [M', C'] holds them.
//   input_scale and weight_scale_2 [S] as loaded.
// The swizzle runs on the device as two batched transposes of 4-byte groups.
//
// NVFP4, dense, on kSm90: the default FP4 GEMM backend below sm100 is marlin, so
// process_weights_after_loading leaves what prepare_nvfp4_layer_for_marlin
// (marlin_utils_fp4.py) makes, with N and K padded to (N', K') =
// marlin_padded_shape (zeros):
//   weight I32 [K'/16, 2N']: gptq_marlin_repack of the padded weight
//     (Stream::repack_marlin_fp4, gpu/marlin.hpp);
//   weight_scale E4M3 [K'/16, N']: the padded scales transposed, permuted and coded
//     (marlin_permute_scales, nvfp4_marlin_process_scales: Stream::marlin_fp4_scales);
//   weight_global_scale [1] in the model dtype: weight_scale_2.max() in it, times
//     2^(2^(e-1) - 2 - 7) (e: its exponent bits; nvfp4_marlin_process_global_scale);
//   input_global_scale F32 [] = input_scale.max(); alpha and input_scale_inv as on
//     kSm100; input_scale and weight_scale_2 [S] as loaded;
//   a bias [N'] zero-padded and permuted by marlin_permute_bias (in each run of 32,
//     the 4 x 4 pairs of elements transposed), from its twin "<w>bias_loaded".
// The checkpoint's weight and scales load into the transient twins
// "<w>weight_loaded" and "<w>weight_scale_loaded" (ScaleForm::kMarlin): for the load,
// the device holds both forms of every NVFP4 weight (the twins are freed with it).
// NVFP4 fused experts [E, N, K] on kSm90 (the Marlin branch of
// ModelOptNvFp4FusedMoEMethod.process_weights_after_loading, SGLang's default MoE
// runner below sm100, prepare_moe_nvfp4_layer_for_marlin): each expert as a dense
// weight, unpadded (gated experts: N % 64 and K % 16 must be 0, else Stage::kPlacement):
// weight I32 [E, K/16, 2N], weight_scale E4M3 [E, K/16, N], weight_scale_2 [E] in
// the model dtype (w13: w1's column of the loaded [E, 2], which loads into the twin
// "<w>weight_scale_2_loaded"), processed as the dense global scale; input scales
// as loaded.
//
// NVFP4 fused experts [E, N, K] on kSm100. SGLang 0.5.23's MoE runner there is
// flashinfer_trtllm for the DeepSeek family, Qwen3-MoE and GLM-4 MoE without an
// all-to-all backend (QuantScheme::trtllm_experts, trtllm_runner below: the server
// argument overrides set the global runner); for every other model the global
// runner stays auto, and ModelOptNvFp4FusedMoEMethod, which reads it, takes its
// CUTLASS branch:
//   default (CUTLASS branch): each expert's block scales swizzled as a dense
//     weight's, over w13_weight_scale / w2_weight_scale from the twin where the
//     padded shape is the loaded one, else into <layer>.w13_blockscale_swizzled /
//     w2_blockscale_swizzled [E, M', C'] beside them; per expert, F32 [E]:
//     g1_alphas = x[e] * w13_weight_scale_2[e][0], g1_alphas_up = x[e] * [e][1]
//     (x[e] = w13_input_scale.max(dim=-1)[e]), w13_input_scale_quant = 1 / x[e],
//     g2_alphas = w2_input_scale[e] * w2_weight_scale_2[e], w2_input_scale_quant =
//     1 / w2_input_scale[e] (_compute_gemm1_alphas). A gated w13 whose rows would pad
//     (I % 64 != 0) is refused (SGLang asserts), as is ep > 1 (the global [E] input
//     scales times the local [E / ep] second scales fail to broadcast: Stage::kConfig).
//   flashinfer_trtllm (align_fp4_moe_weights_for_flashinfer_trtllm): the weights and
//     block scales keep their shapes; SGLang loads w13 up rows first
//     (load_up_proj_weight_first), reorders them for the gated activation
//     (reorder_rows_for_gated_act_gemm: up row j to 2j, gate row j to 2j + 1) and
//     shuffles every expert's rows (shuffle_matrix_a, epilogue_tile_m 128: in each
//     block of 32 rows, row 4a + b to 8b + a), the scales' rows alike, then swizzles
//     the scales (nvfp4_block_scale_interleave: swizzle_blockscale's layout). ferry
//     loads as the loader target does and rewrites weight and scales in place, expert
//     by expert through device scratch (two pitched copies and four transposes), so
//     the device holds no second copy of the experts. One input scale for all experts
//     (the max over all of them): g1_alphas, g1_alphas_up, g2_alphas as above with it,
//     w13_input_scale_quant and w2_input_scale_quant F32 [], and g1_scale_c [E] =
//     w2_input_scale_quant * g1_alphas_up (_compute_g1_scale_c). A rank's share of
//     the intermediate size is padded to 64 with zeros and the padded size sharded
//     (create_weights, narrow_padded_param_and_loaded_weight; models/experts.hpp); a
//     hidden size not a multiple of 128 is refused (Stage::kPlacement). Under expert
//     parallelism the max runs over every global expert: the input scales hold them
//     all on each rank (below).
//   input scales and weight_scale_2 stay as loaded on both. The input scales are
//     [P (+1), 2] / [P (+1)], every global expert on each rank, as SGLang keeps them
//     (_sglang_require_global_experts; TableModel::set_global_experts).
// Block FP8 fused experts under flashinfer_trtllm (Fp8MoEMethod; DeepSeek, Qwen3-MoE):
// FusedMoE._weight_loader_impl loads w1 as w3 and w3 as w1, so w13 holds the up rows
// first, its block scales alike (ModelOptions::switch_w13 made so by make_model);
// process_weights_after_loading_block_quant leaves them (DeepGEMM does not run them,
// no UE8M0). A rank's share of the intermediate size is padded to 128 as above.
//
// Per-tensor FP8 fused experts under flashinfer_trtllm (Fp8MoEMethod with static
// activations, ModelOptFp8MoEMethod: align_fp8_moe_weights_for_flashinfer_trtllm):
// the share padded to 128 as above; w13 up rows first (Fp8MoEMethod loads them so;
// ModelOpt flips its [gate | up] after requantizing, swap_w13_halves), each expert
// requantized to its larger scale, reordered for the gated activation and shuffled
// (shuffle_matrix_a), w2's rows shuffled alike, in place; the input scales their
// max; F32 [E] output1_scales_scalar = w13_weight_scale * in13 * (1 / in2),
// output1_scales_gate_scalar = w13_weight_scale * in13, output2_scales_scalar = in2 *
// w2_weight_scale (trtllm_fp8_scalars). Dynamic activations are refused (SGLang
// asserts the input scales), as is a hidden size not a multiple of 32 (kPlacement).
// Unquantized BF16 experts under it: the block layout (TableModel::serve_as).
//
// Refused (make_model, Stage::kConfig, naming the reason): on kSm90 NVFP4 with
// group_size other than 16 or an F32 model (SGLang's Marlin refuses both); on kSm100
// quantization.online's FP8 experts under flashinfer_trtllm, and unquantized ones of
// an F16 or F32 model there; and any target but kLoader together with
// quantization.requant.
//
// The hooks rewrite weights in place and write outputs declared at their final
// size: nothing is reallocated, and each depends only on the loaded weights and the
// transient loaded scales, which it never writes, so a capture-safe startup can run
// them twice (PostLoadHook::idempotent).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "models/model.hpp"

namespace ferry::models {

class TableModel;

// "loader", "sm90", "sm100".
std::string_view to_string(QuantScheme::Target target);
// "loader", "sm90", "sm100"; nullopt for anything else ("auto" is the runtime's).
std::optional<QuantScheme::Target> parse_target(std::string_view text);

// How a quantized weight's scale leaves process_weights_after_loading under the
// scheme's target (`weight` is the local shape: [N, K] or experts [E, N, K],
// `shards` the fused shards of its scale).
enum class ScaleForm {
  kAsLoaded,     // unchanged
  kChannelwise,  // [N, 1], each row its shard's scale
  kMaxScalar,    // requantized to the max; []
  kMaxRows,      // requantized to the max; [N, 1] all holding it
  kMaxExperts,   // experts: each expert's w1 / w3 requantized to its max; [E]
  kSwizzled,     // NVFP4 on kSm100: swizzled over weight_scale, same shape
  kMarlin,       // NVFP4 on kSm90: Marlin's [K'/16, N'] (nvfp4_marlin_shape)
};
ScaleForm scale_form(const QuantScheme& scheme, const Shape& weight, std::uint64_t shards);
// The served shape of that scale.
Shape served_scale_shape(ScaleForm form, const Shape& weight);
// NVFP4 on kSm100 (`weight` the logical [N, K]): whether process_weights_after_loading
// runs the dense FP4 path on it (alpha, input_scale_inv, swizzled scales), and the
// shape of its swizzled scales, [N rounded up to 128, K / group rounded up to 4].
bool nvfp4_served(const QuantScheme& scheme, const Shape& weight);
Shape nvfp4_swizzled_shape(const Shape& weight, std::uint64_t group_size);
// NVFP4 fused experts on kSm100: the F32 params process_weights_after_loading adds
// for `weight` (experts.w13_weight or experts.w2_weight), each with whether it is a
// scalar [] (else [E]); none for a dense weight (`experts` false).
std::vector<std::pair<std::string, bool>> nvfp4_expert_scalars(const QuantScheme& scheme,
                                                               std::string_view weight,
                                                               bool experts);
// "<layer>.<name>" for a fused experts' weight "<layer>.w13_weight".
std::string experts_param(std::string_view weight, std::string_view name);
// NVFP4 on kSm90 (`weight` the logical [N, K]): whether the Marlin path runs on it,
// and the padded [N', K'] it works on: the smaller (by N' * K', then N' + K') of (N
// to 64, K to 128) and (N to 128, K to 64), as prepare_nvfp4_layer_for_marlin picks.
bool nvfp4_marlin(const QuantScheme& scheme, const Shape& weight);
Shape marlin_padded_shape(const Shape& weight);
// Its served weight (I32 [K'/16, 2N']) and scales (E4M3 [K'/16, N']).
Shape marlin_weight_shape(const Shape& weight);
Shape marlin_scale_shape(const Shape& weight, std::uint64_t group_size);
// "<w>weight_loaded": the transient the checkpoint's weight loads into;
// "<w>weight_scale_2_loaded": fused experts' second scales as loaded.
std::string loaded_weight_name(std::string_view weight);
std::string loaded_scale_2_name(std::string_view weight);
// "<w>bias_loaded": a Marlin linear's bias as loaded.
std::string loaded_bias_name(std::string_view weight);
// Fused experts `weight` ([E, N, K]) gptq_marlin_repack cannot take (N % 64 or K %
// 16 not 0): the reason; empty where it can.
std::string marlin_experts_unaligned(const Shape& weight);

// Fused experts `param` ([E, N, K], logical) on kSm100 that SGLang 0.5.23 pads or
// refuses there (NVFP4 experts, and block FP8 ones for flashinfer_trtllm): the
// reason, naming the sizes; empty where they are served as they are.
std::string sm100_experts_unaligned(const QuantScheme& scheme, std::string_view param,
                                   const Shape& weight);

// Dense NVFP4 on kSm100 (`weight` the logical [N, K]): whether pad_nvfp4_weight pads
// it for the FP4 GEMM (N or K not a multiple of 32), and the packed U8 [N', K' / 2]
// it leaves, N and K rounded up to 32 with zeros (copy_or_rebind_param).
bool nvfp4_pads(const Shape& weight);
Shape nvfp4_padded_weight(const Shape& weight);

// Whether a static input scale of this weight becomes its max ([]): every target
// but kLoader.
bool input_scale_max(const QuantScheme& scheme);

// Whether every attention holds BaseKVCacheMethod's k_scale / v_scale (F32 []) under
// the target: fp8 checkpoints (Fp8KVCacheMethod on each RadixAttention), ModelOpt
// ones with an FP8 KV cache, and ModelOpt NVFP4 ones with none (ModelOptFp4Config's
// from_config reads a missing kv_cache_quant_algo as "auto"), on every target but
// kLoader; MLA has them on attn_mqa and attn_mha.
bool kv_scales_served(const QuantScheme& scheme);
// Whether the checkpoint feeds the k_scale / v_scale of attention module `attn`
// ("attn", "attn_mqa", "attn_mha"): ModelOpt's FP8 KV cache, for attn and attn_mqa.
bool kv_scales_loaded(const QuantScheme& scheme, std::string_view attn);

// Whether DeepGEMM's UE8M0 repack converts this FP8 block weight: always under
// quantization.requant=ue8m0; under kSm100 when the blocks are 128 x 128, N % 64 ==
// 0 and K % 128 == 0, and QuantScheme::ue8m0_dense (2-D) or ue8m0_experts (3-D)
// says DeepGEMM runs it.
bool converts_ue8m0(const QuantScheme& scheme, const Shape& weight);

// The transient twins the checkpoint's scales load into where their served shape
// differs: "<w>weight_scale_loaded", "<w>input_scale_loaded".
std::string loaded_tensor_scale_name(std::string_view weight);
std::string loaded_input_scale_name(std::string_view weight);

// The hooks of every param `model`'s shells give a twin (above), ordered after the
// model's hooks that read the weight or its scales as loaded. Throws
// Error(Stage::kPostProcess) naming a param whose output is missing or misshapen.
// The shard widths of a dense weight come from TableModel::shard_starts.
std::vector<PostLoadHook> make_postprocess_hooks(const TableModel& model,
                                                 const QuantScheme& scheme);

// compressed-tensors' fused experts with static input scales: w1's input_scale loads
// into this transient ("<experts>.w13_input_scale_w1", [E]) instead of being dropped,
// and make_input_scale_checks refuses, as SGLang 0.5.23's FusedMoE.weight_loader does
// for compressed-tensors, an expert whose w1 scale is not 1 and differs from w3's
// (the one the slot keeps) by more than 1e-5: Error(Stage::kPostProcess) naming the
// param, the expert and both values. (Every target, loader included: it is the
// weight loader's rule.) Two scalars an expert are read back to the host.
std::string input_scale_w1_name(std::string_view weight);
std::vector<PostLoadHook> make_input_scale_checks(const Model& model);

// make_model's refusals (above), naming the target and the reason:
// Error(Stage::kConfig).
void check_target(const QuantScheme& scheme, const std::string& architecture, bool has_experts,
                  const ParallelLayout& layout);
// Whether SGLang 0.5.23's global MoE runner is flashinfer_trtllm for this model
// (QuantScheme::trtllm_experts): on kSm100 without an all-to-all backend, for the
// DeepSeek family (quantization fp8, modelopt_fp8, modelopt_fp4 or none:
// overrides.py _deepseek_moe_quant_resolution), Qwen3-MoE (fp8, modelopt_fp4, none:
// model_overrides/qwen3_moe.py) and GLM-4 MoE (modelopt_fp4, none:
// model_overrides/glm4_moe.py); the quantization as those overrides see it is
// QuantScheme::config_method (none for a ModelOpt hf_quant_config.json).
bool trtllm_runner(const QuantScheme& scheme, const std::string& architecture, bool has_experts,
                   const ParallelLayout& layout);
// Whether w13 loads up rows first under flashinfer_trtllm: FusedMoE._weight_loader_impl
// swaps w1 and w3 for an Fp8MoEMethod or an UnquantizedFusedMoEMethod (block and
// per-tensor FP8 of quant_method fp8, unquantized), not for ModelOpt's methods.
bool trtllm_loads_up_first(const QuantScheme& scheme);
// Per-tensor FP8 fused experts under flashinfer_trtllm: the F32 [E] params
// align_fp8_moe_weights_for_flashinfer_trtllm adds for `weight` (experts.w13_weight:
// output1_scales_scalar, output1_scales_gate_scalar, output2_scales_scalar); none
// for anything else.
std::vector<std::string> trtllm_fp8_scalars(const QuantScheme& scheme, std::string_view weight,
                                            bool experts);

}  // namespace ferry::models
