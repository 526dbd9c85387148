// Quantized checkpoints: what config.json's quantization_config says, which params
// it quantizes, and how a weight's block scales follow the weight's placement.
//
// Supported: FP8 with block scales (quant_method "fp8" with weight_block_size
// [bn, bk], as DeepSeek-V3/R1 and the Qwen3 FP8 releases ship). Each quantized
// linear weight W [N, K] is F8_E4M3 and comes with W_scale_inv, F32
// [ceil(N / bn), ceil(K / bk)]: element (i, j) of W means f32(W[i, j]) *
// scale[i / bn][j / bk] (a multiplier, despite the name). ferry keeps both as they
// are on the device; each rank's scale holds the block rows and columns of its
// share of the weight, so a share must be made of whole blocks (SGLang's
// validate_block_quant_shapes in python/sglang/srt/layers/quantization/fp8.py).
//
// Which params are quantized: SGLang's quantized linear layers, i.e. params named
// *_proj.weight (qkv_proj, o_proj, gate_up_proj, down_proj, q_a_proj, q_b_proj,
// kv_a_proj_with_mqa, fused_qkv_a_proj_with_mqa, kv_b_proj, q_proj, shared
// experts') and the fused experts w13_weight / w2_weight. Not quantized: the
// embedding and lm_head, norms, the router (mlp.gate, a ReplicatedLinear built
// without a quant_config), e_score_correction_bias (F32) and the MTP layer's
// eh_proj (a plain nn.Linear in SGLang's deepseek_nextn.py). Modules named in
// modules_to_not_convert / ignored_layers stay in the model's dtype.
//
// Anything else (per-tensor FP8, compressed-tensors, ModelOpt, GPTQ, AWQ,
// bitsandbytes, GGUF, ...) is refused, naming the method.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "models/model.hpp"
#include "models/placement.hpp"

namespace ferry::models {

// QuantScheme (quantization_config, parsed) is declared in models/model.hpp.

// Reads config.json's quantization_config (absent or null: kNone). Throws
// ferry::Error(Stage::kMapping) naming the method for one ferry does not load
// (GPTQ, AWQ, ..., or an unknown name), and Error(Stage::kConfig) naming the field
// for a malformed one (weight_block_size not two positive integers, an
// activation_scheme other than dynamic with block scales, a missing quant_method).
QuantScheme parse_quant_scheme(const nlohmann::json& hf_config);

// "fp8 block [128, 128]" for messages and reports; "none" when not quantized.
std::string describe(const QuantScheme& scheme);

// Whether SGLang quantizes the param (see above); the name alone decides.
bool quantized_linear_param(std::string_view param);
// Whether a checkpoint tensor is the weight of a quantized linear layer
// (*_proj.weight but eh_proj, Mixtral's experts.<e>.w1/w2/w3.weight).
bool quantized_linear_tensor(std::string_view tensor);

// Whether `module` (a param or tensor name less ".weight", or the fused experts'
// "....experts") is excluded by `scheme.ignored`: an entry equal to it or to one
// of its parents, with or without the leading "model.". `shards` are the checkpoint
// modules a fused param is made of (q_proj, k_proj, v_proj for qkv_proj): the
// param is skipped when all are; some but not all is an error (SGLang's
// is_layer_skipped: "all shards of fused layers must have the same precision").
bool module_skipped(const QuantScheme& scheme, const std::string& module,
                    const std::vector<std::string>& shards = {});

// The scale's name: <weight>_scale_inv ("...qkv_proj.weight_scale_inv",
// "...experts.w13_weight_scale_inv").
std::string scale_inv_name(std::string_view weight);

// The block-scale shape of a weight shape (its last two dims N, K become
// ceil(N / bn), ceil(K / bk); leading dims, such as experts, stay).
Shape block_scale_shape(const Shape& weight, std::uint64_t block_n, std::uint64_t block_k);

// Checks that a weight copy block is made of whole scale blocks on both sides:
// its starts are multiples of the block size of its axis (axis 0 of the
// two inner dims: block_n, axis 1: block_k) and so is its length, unless the
// block takes the whole source dim and ends the destination's (an unsplit last
// slot of a merged param, SGLang's exception). `src_inner` / `dst_inner` are the
// two dims after the block's fixed indices. Throws Error(Stage::kPlacement)
// naming `tensor` and `param`, with SGLang's wording ("Weight
// output_partition_size = 96 is not divisible by weight quantization block_n =
// 128").
void check_block_aligned(const Block& block, const Shape& src_inner, const Shape& dst_inner,
                         std::uint64_t block_n, std::uint64_t block_k, const std::string& tensor,
                         const std::string& param, int tp_rank, int tp);

// The scale block of a checked weight block: the same fixed indices and axis,
// starts divided by the block size, length rounded up to whole blocks.
Block scale_block(const Block& weight_block, std::uint64_t block_n, std::uint64_t block_k);

}  // namespace ferry::models
