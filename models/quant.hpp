// Quantized checkpoints: what config.json's quantization_config (or a ModelOpt
// hf_quant_config.json) says, which params it quantizes, and how a weight's scales
// follow the weight's placement. ferry delivers the layout SGLang's weight loaders
// leave before its process_weights_after_loading (no transposes, no max-merged
// shard scales, no backend swizzles), so every scale keeps the meaning it has on
// disk.
//
// Supported (the Method of QuantScheme, models/model.hpp):
// - kFp8Block: quant_method "fp8" with weight_block_size [bn, bk] (DeepSeek-V3/R1,
//   Qwen3-*-FP8), and compressed-tensors with strategy "block". A weight W [N, K]
//   is F8_E4M3 with F32 [ceil(N / bn), ceil(K / bk)] scales, <module>.weight_scale_inv
//   (fp8) or <module>.weight_scale (compressed-tensors): element (i, j) of W means
//   f32(W[i, j]) * scale[i / bn][j / bk] (a multiplier, despite the name). A
//   rank's scale holds the blocks of its share of the weight, so a share must be
//   whole blocks (SGLang's validate_block_quant_shapes, quantization/fp8.py).
// - kFp8Channel: compressed-tensors strategy "channel": F32 weight_scale [N, 1], a
//   row's scale going wherever the row goes (a row-parallel param keeps all N).
// - kFp8Tensor: quant_method "fp8" without blocks (per-tensor serialized FP8),
//   compressed-tensors strategy "tensor", ModelOpt quant_algo "FP8": one F32 scalar
//   weight_scale per checkpoint tensor; a param fused from several (qkv_proj,
//   gate_up_proj, w13) holds one per shard, in the order its shards' rows lie in
//   it (SGLang's PerTensorScaleParameter: [3] for qkv, [2] for gate_up, [1] for
//   o_proj; experts [E, 2] for w13 and [E] for w2).
// - kNvfp4: ModelOpt quant_algo "NVFP4": a weight's E2M1 values packed two a byte
//   along K (U8 [N, K / 2], element 2i in the low nibble), F8_E4M3 weight_scale
//   [N, K / group_size] (a [1, group_size] block scale), and F32 weight_scale_2 per
//   shard; K of every rank's share must be a multiple of group_size (SGLang:
//   "Unsupported model when in features size is not multiple of 16").
// Static activation scales (ModelOpt, and fp8 / compressed-tensors with a static
// scheme) give each quantized module an F32 input_scale per shard. Fused experts
// follow SGLang 0.5.23's FusedMoE create_weights: a one-shard scale is [E] (w2's
// weight_scale, weight_scale_2 and input_scale), w13's per-shard scales [E, 2]; the
// FP8 methods' w13_input_scale is [E], one element that w1 and then w3 write
// (FusedMoE._load_single_value), so ferry reads w3's and drops w1's unread
// ("overwritten_scale"; compressed-tensors reads w1's into a transient
// w13_input_scale_w1 to refuse unequal ones, models/postprocess.hpp); NVFP4's w13_input_scale stays
// [E, 2], both elements of an expert's row holding w3's (the same loader writes a scalar to the
// whole row). A ModelOpt FP8 KV cache gives each attention module F32 scalars
// self_attn.attn.k_scale / v_scale, read from self_attn.k_proj.k_scale (or self_attn.k_scale) as
// SGLang's maybe_remap_kv_scale_name renames them; MLA's are self_attn.attn_mqa.k_scale / v_scale
// (SGLang 0.5.23's DeepSeek loader).
//
// Which params are quantized: SGLang's quantized linear layers, i.e. params named
// *_proj.weight (qkv_proj, o_proj, gate_up_proj, down_proj, q_a_proj, q_b_proj,
// kv_a_proj_with_mqa, fused_qkv_a_proj_with_mqa, kv_b_proj, q_proj, shared
// experts'), the fused experts w13_weight / w2_weight, and DeepSeek-V3.2's indexer
// wq_b and wk (not its weights_proj, built in the model dtype). Not quantized: the
// embedding and lm_head, norms, the router (mlp.gate, a ReplicatedLinear built
// without a quant_config), e_score_correction_bias (F32) and the MTP layer's
// eh_proj (a plain nn.Linear in SGLang's deepseek_nextn.py). Excluded modules
// (QuantScheme::ignored) stay in the model's dtype.
//
// Anything else (GPTQ, AWQ, bitsandbytes, GGUF, compressed-tensors INT or NVFP4,
// ModelOpt MIXED_PRECISION, ...) is refused, naming the method.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/fp8.hpp"
#include "models/model.hpp"
#include "models/placement.hpp"

namespace ferry::models {

// QuantScheme (quantization_config, parsed) is declared in models/model.hpp.

// Reads config.json's quantization_config (absent or null: kNone). A ModelOpt
// hf_quant_config.json reaches it as quantization_config {"quant_method":
// "modelopt", ...the file's fields} (runtime/plan_report.cpp merges it so, as
// SGLang does). Throws ferry::Error(Stage::kMapping) naming the method for one ferry
// does not load (GPTQ, AWQ, ..., or an unknown name), and Error(Stage::kConfig)
// naming the field for a malformed one.
QuantScheme parse_quant_scheme(const nlohmann::json& hf_config);

// config.json with a ModelOpt hf_quant_config.json found beside it: when config.json
// has no quantization_config, the file's fields become one, with quant_method
// "modelopt" (as SGLang's _parse_quant_hf_config does); otherwise config.json wins
// as it is. Throws Error(Stage::kConfig) naming hf_quant_config.json when it is not
// a JSON object.
nlohmann::json with_hf_quant_config(nlohmann::json hf_config, const nlohmann::json& hf_quant);

// "fp8 block [128, 128]", "fp8 per-channel (compressed-tensors)", "nvfp4 group 16
// (modelopt)" for messages and reports; "none" when not quantized.
std::string describe(const QuantScheme& scheme);

// Whether SGLang quantizes the param (see above); the name alone decides.
bool quantized_linear_param(std::string_view param);
// Whether a checkpoint tensor is the weight of a quantized linear layer
// (*_proj.weight but eh_proj, Mixtral's experts.<e>.w1/w2/w3.weight).
bool quantized_linear_tensor(std::string_view tensor);

// Whether `module` (a param or tensor name less ".weight", or the fused experts'
// "....experts") is excluded by `scheme.ignored`, as `scheme.ignore_match` reads
// an entry. `shards` are the checkpoint modules a fused param is made of (q_proj,
// k_proj, v_proj for qkv_proj): when the fused name itself is not excluded, the
// param is skipped when all shards are; some but not all is an error (SGLang's
// is_layer_skipped: "all shards of fused layers must have the same precision").
// The entries are read (regexes compiled) once, for every module a model asks about.
// Throws Error(Stage::kConfig) for a "re:" entry that is not a regular expression.
class ExcludedModules {
 public:
  explicit ExcludedModules(const QuantScheme& scheme);
  bool skipped(const std::string& module, const std::vector<std::string>& shards = {}) const;

 private:
  bool listed(const std::string& module) const;
  bool module_listed(const std::string& module) const;
  bool ct_listed(const std::string& module) const;
  bool glob_listed(const std::string& module) const;

  QuantScheme::IgnoreMatch match_;
  std::vector<std::string> entries_;
  std::vector<std::string> substrings_;  // compressed-tensors, lower-cased
  struct Regexes;                        // compressed-tensors "re:" entries, compiled
  std::shared_ptr<const Regexes> regexes_;
};

// ExcludedModules(scheme).skipped(module, shards), for one question.
bool module_skipped(const QuantScheme& scheme, const std::string& module,
                    const std::vector<std::string>& shards = {});

// A quantized weight's companion: "<module>.weight" + suffix "input_scale" is
// "<module>.input_scale", "...experts.w13_weight" is "...experts.w13_input_scale".
// `weight` must end with "weight".
std::string companion_name(std::string_view weight, std::string_view suffix);
// The block (or channel, or tensor) scale of a weight: companion_name(weight,
// scheme.scale_suffix), e.g. "...qkv_proj.weight_scale_inv".
std::string weight_scale_name(const QuantScheme& scheme, std::string_view weight);
// The param the checkpoint's scales of `weight` (local shape `shape`) load into:
// weight_scale_name, except
// where DeepGEMM's UE8M0 repack converts the weight (converts_ue8m0:
// quantization.requant=ue8m0, or postprocess.target=sm100), whose packed I32 scales
// take that name (as in SGLang) while the F32 scales load into a transient
// "<w>weight_scale_inv_f32" that the requant hook reads and the load then frees.
// (A per-tensor scale postprocess.target serves in another shape loads into
// "<w>weight_scale_loaded" instead: models/postprocess.hpp.)
std::string loaded_scale_name(const QuantScheme& scheme, std::string_view weight,
                              const Shape& shape);
// The first case alone, given whether the repack converts the weight.
std::string loaded_scale_name(const QuantScheme& scheme, std::string_view weight, bool ue8m0);

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
// The zero fill of fused experts' padded rows (axis 1) or columns (axis 2, the last)
// of [E, N, K] (a Block::Kind::kZero without fixed indices), as it lands on the
// weight stored `values_per_byte` to a byte along K (NVFP4: 2; the fill's columns
// even), and on its [bn, bk]-block scales: the blocks wholly inside the padding
// (one that holds real rows keeps its loaded scale, as SGLang's padded load does);
// length 0 where there are none.
// (Per tp rank, as TableModel's fill rules are.)
using ZeroRule = std::function<std::vector<Block>(int tp_rank)>;
ZeroRule packed_fill(ZeroRule zero, std::uint64_t values_per_byte);
ZeroRule scale_fill(ZeroRule zero, std::uint64_t block_n, std::uint64_t block_k);

// ---- reading quantized weights on the host ------------------------------------------

// The bytes of one quantized linear param's local share (a 2-D [rows, cols]
// matrix; `cols` counts logical elements, not packed bytes) and of its scales, as
// a post-load hook reads them back from the device, and what each element means.
// kFp8Block: scale is F32 block_scale_shape; kFp8Channel: F32 [rows, 1];
// kFp8Tensor: F32, scale[0] (a single-shard param); kNvfp4: scale is F8_E4M3
// [rows, cols / group_size] and scale_2 one F32.
struct QuantizedMatrix {
  const QuantScheme* scheme = nullptr;
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
  const std::uint8_t* weight = nullptr;  // F8_E4M3 bytes, or packed E2M1 (kNvfp4)
  const std::byte* scale = nullptr;
  float scale_2 = 1.0f;  // kNvfp4's weight_scale_2

  // f32(W[row][col]) * its scale (kNvfp4: e2m1 * f32(e4m3 scale) * scale_2), in F32.
  float at(std::uint64_t row, std::uint64_t col) const;
};

// How an FP8 scheme's F32 weight scales map onto a 2-D weight, for the device's
// FP8 operations (gpu::Stream::dequantize_fp8): kFp8Block a block_n x block_k tile,
// kFp8Channel a row, kFp8Tensor the matrix (a single-shard param). Throws
// Error(Stage::kPostProcess) for kNvfp4 and kNone (not FP8-scaled).
gpu::Fp8Scales fp8_scales(const QuantScheme& scheme);

// What a quantized linear param's host reading needs besides the weight: its
// weight scale and (kNvfp4) weight_scale_2, as indices into `shell`, checked
// against the weight's local shape. Throws Error(Stage::kPostProcess) naming the
// param when one is missing, misshapen, or the param holds more than one shard of
// per-tensor scales.
struct QuantizedInputs {
  std::size_t scale = 0;
  std::optional<std::size_t> scale_2;
};
// The param a hook reading `weight` as the checkpoint has it reads: its twin where
// the load keeps one, "<w>weight_unquantized" (quantization.online) or
// "<w>weight_loaded" (postprocess.target=sm90's Marlin), else `weight` itself.
std::string as_loaded_name(const RankShell& shell, const std::string& weight);

QuantizedInputs quantized_inputs(const QuantScheme& scheme, const RankShell& shell,
                                 std::size_t weight);

// ---- the dummy load format ----------------------------------------------------------

// What a param holds under model.load_format=dummy (SGLang's DummyModelLoader, with
// ranges that keep every format's dequantized weights where the BF16 ones are):
//   F8_E4M3 weights             uniform in [-448, 448] (every E4M3 magnitude)
//   F32 weight scales           uniform in [0.5, 1] * 1e-3 / 448 (*_weight_scale,
//                               *_weight_scale_inv), so weights dequantize into
//                               [-1e-3, 1e-3]
//   NVFP4 F8_E4M3 group scales  uniform in [224, 448], and F32 weight_scale_2 in
//                               [0.5, 1] * 1e-3 / (6 * 448): e2m1 (<= 6) * both
//                               stays within 1e-3
//   U8 (packed NVFP4 pairs)     any byte
//   activation scales           uniform in [1e-3, 1e-2] (input_scale, k_scale,
//                               v_scale: positive, as a calibration leaves them)
//   anything else floating      uniform in [-1e-3, 1e-3] (SGLang's range)
//   other dtypes                zeros (random = false)
struct DummyRange {
  double low = 0;
  double high = 0;
  bool random = true;
};
DummyRange dummy_range(const ParamSpec& param);

}  // namespace ferry::models
