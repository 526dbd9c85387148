// The rules of postprocess.target that decide shapes, names and refusals
// (models/postprocess.hpp): which path SGLang 0.5.23's process_weights_after_loading
// takes for a weight on each target, the shapes it leaves, and make_model's checks.
// The hooks that produce those layouts are in postprocess.cpp.
#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "common/enum_name.hpp"
#include "common/error.hpp"
#include "models/postprocess.hpp"
#include "models/quant.hpp"

namespace ferry::models {
namespace {

using Method = QuantScheme::Method;
using Format = QuantScheme::Format;
using Target = QuantScheme::Target;

}  // namespace

std::string_view to_string(QuantScheme::Target target) {
  static constexpr std::array<std::string_view, 3> kNames{"loader", "sm90", "sm100"};
  static_assert(kNames.size() == static_cast<std::size_t>(Target::kSm100) + 1);
  return enum_name(target, kNames, "loader");
}

std::optional<QuantScheme::Target> parse_target(std::string_view text) {
  for (Target t : {Target::kLoader, Target::kSm90, Target::kSm100}) {
    if (text == to_string(t)) {
      return t;
    }
  }
  return std::nullopt;
}

bool nvfp4_served(const QuantScheme& q, const Shape& weight) {
  return q.target == Target::kSm100 && q.method == Method::kNvfp4 &&
         (weight.size() == 2 || weight.size() == 3);
}

Shape nvfp4_swizzled_shape(const Shape& weight, std::uint64_t group_size) {
  const std::uint64_t group = std::max<std::uint64_t>(1, group_size);
  const std::uint64_t cols = (weight.back() + group - 1) / group;
  Shape out{(weight[weight.size() - 2] + 127) / 128 * 128, (cols + 3) / 4 * 4};
  if (weight.size() == 3) {
    out.insert(out.begin(), weight[0]);
  }
  return out;
}

std::string experts_param(std::string_view weight, std::string_view name) {
  const std::size_t dot = weight.rfind('.');
  return std::string(weight.substr(0, dot == std::string_view::npos ? 0 : dot + 1)) +
         std::string(name);
}

std::vector<std::pair<std::string, bool>> nvfp4_expert_scalars(const QuantScheme& q,
                                                               std::string_view weight,
                                                               bool experts) {
  if (!experts || !nvfp4_served(q, Shape{1, 1, 1})) {
    return {};
  }
  const bool trtllm = q.trtllm_experts;
  if (weight.ends_with("w13_weight")) {
    std::vector<std::pair<std::string, bool>> out = {
        {experts_param(weight, "g1_alphas"), false},
        {experts_param(weight, "g1_alphas_up"), false},
        {companion_name(weight, "input_scale_quant"), trtllm}};
    if (trtllm) {
      out.emplace_back(experts_param(weight, "g1_scale_c"), false);
    }
    return out;
  }
  return {{experts_param(weight, "g2_alphas"), false},
          {companion_name(weight, "input_scale_quant"), trtllm}};
}

bool nvfp4_marlin(const QuantScheme& q, const Shape& weight) {
  return q.target == Target::kSm90 && q.method == Method::kNvfp4 &&
         (weight.size() == 2 || weight.size() == 3);
}

Shape marlin_padded_shape(const Shape& weight) {
  if (weight.size() == 3) {
    return Shape{weight[1], weight[2]};  // experts: not padded (gated)
  }
  auto up = [](std::uint64_t x, std::uint64_t m) { return (x + m - 1) / m * m; };
  const Shape a{up(weight[0], 64), up(weight[1], 128)};
  const Shape b{up(weight[0], 128), up(weight[1], 64)};
  auto key = [](const Shape& s) { return std::make_pair(s[0] * s[1], s[0] + s[1]); };
  return key(b) < key(a) ? b : a;
}

namespace {

// [K' / per_row, N' * cols_per_n] of the padded [N', K'], after the experts' dim.
Shape marlin_shape(const Shape& weight, std::uint64_t per_row, std::uint64_t cols_per_n) {
  const Shape p = marlin_padded_shape(weight);
  Shape out{p[1] / std::max<std::uint64_t>(1, per_row), p[0] * cols_per_n};
  if (weight.size() == 3) {
    out.insert(out.begin(), weight[0]);
  }
  return out;
}

}  // namespace

Shape marlin_weight_shape(const Shape& weight) {
  return marlin_shape(weight, 16, 2);
}

Shape marlin_scale_shape(const Shape& weight, std::uint64_t group_size) {
  return marlin_shape(weight, group_size, 1);
}

std::string marlin_experts_unaligned(const Shape& weight) {
  if (weight.size() != 3 || (weight[1] % 64 == 0 && weight[2] % 16 == 0)) {
    return "";
  }
  return "its experts are " + format_shape(weight) +
         " and gptq_marlin_repack needs N % 64 == 0 and K % 16 == 0 (SGLang 0.5.23 pads only "
         "ungated experts' intermediate size)";
}

std::string sm100_experts_unaligned(const QuantScheme& q, std::string_view param,
                                    const Shape& weight) {
  if (q.target != Target::kSm100 || weight.size() != 3 ||
      (q.method != Method::kNvfp4 && !(q.trtllm_experts && q.method == Method::kFp8Block))) {
    return "";
  }
  const bool w13 = param.ends_with("w13_weight");
  const std::uint64_t inter = w13 ? weight[1] / 2 : weight[2];
  const std::uint64_t hidden = w13 ? weight[2] : weight[1];
  const std::string dims = "its experts are " + format_shape(weight) +
                           " (intermediate size per partition " + std::to_string(inter) +
                           ", hidden size " + std::to_string(hidden) + ")";
  if (!q.trtllm_experts) {
    // The CUTLASS branch of ModelOptNvFp4FusedMoEMethod.process_weights_after_loading:
    // swizzle_blockscale pads w13's rows to 128, which a gated layer asserts against.
    return !w13 || inter % 64 == 0
               ? ""
               : dims +
                     ", and SGLang 0.5.23 cannot pad a gated layer's w13 block scales to "
                     "128 rows (ModelOptNvFp4FusedMoEMethod.process_weights_after_loading)";
  }
  // (The intermediate size a rank is already padded as flashinfer_trtllm pads it:
  // add_moe_experts.)
  if (q.method == Method::kNvfp4 && hidden % 128 != 0) {
    return dims +
           ", and flashinfer_trtllm's shuffles need the hidden size to be a multiple of "
           "128 (get_shuffle_matrix_sf_a_row_indices)";
  }
  return "";
}

std::string loaded_bias_name(std::string_view weight) {
  return companion_name(weight, "bias_loaded");
}

std::string loaded_scale_2_name(std::string_view weight) {
  return companion_name(weight, "weight_scale_2_loaded");
}

std::string loaded_weight_name(std::string_view weight) {
  return companion_name(weight, "weight_loaded");
}

bool nvfp4_pads(const Shape& weight) {
  return weight.size() == 2 && (weight[0] % 32 != 0 || weight[1] % 32 != 0);
}

Shape nvfp4_padded_weight(const Shape& weight) {
  auto up = [](std::uint64_t x) { return (x + 31) / 32 * 32; };
  return Shape{up(weight[0]), up(weight[1]) / 2};
}

ScaleForm scale_form(const QuantScheme& q, const Shape& weight, std::uint64_t shards) {
  if (nvfp4_marlin(q, weight)) {
    return ScaleForm::kMarlin;
  }
  if (nvfp4_served(q, weight)) {
    if (weight.size() == 3 && q.trtllm_experts) {
      return ScaleForm::kAsLoaded;  // shuffled in place (add_trtllm_experts)
    }
    const Shape scale = block_scale_shape(weight, 1, std::max<std::uint64_t>(1, q.group_size));
    return nvfp4_swizzled_shape(weight, q.group_size) == scale ? ScaleForm::kSwizzled
                                                               : ScaleForm::kAsLoaded;
  }
  if (q.target == Target::kLoader || q.method != Method::kFp8Tensor || weight.size() < 2) {
    return ScaleForm::kAsLoaded;
  }
  if (weight.size() == 3) {
    // Fp8MoEMethod, CompressedTensorsW8A8Fp8MoEMethod, ModelOptFp8MoEMethod:
    // w13_weight_scale.max(dim=1) where w13 has two shards.
    return shards == 2 ? ScaleForm::kMaxExperts : ScaleForm::kAsLoaded;
  }
  switch (q.format) {
    case Format::kFp8:
      return ScaleForm::kChannelwise;  // Fp8LinearMethod: convert_to_channelwise
    case Format::kCompressedTensors:
      return ScaleForm::kMaxScalar;  // CompressedTensorsW8A8Fp8: requantize_with_max_scale
    case Format::kModelOpt: {
      // ModelOptFp8LinearMethod: the max scale, kept scalar where FlashInfer's bmm_fp8
      // runs (K and N multiples of 16), else convert_to_channelwise.
      const std::uint64_t n = weight[0];
      const std::uint64_t k = weight[1];
      return n % 16 == 0 && k % 16 == 0 ? ScaleForm::kMaxScalar : ScaleForm::kMaxRows;
    }
    case Format::kNone:
      break;
  }
  return ScaleForm::kAsLoaded;
}

Shape served_scale_shape(ScaleForm form, const Shape& weight) {
  switch (form) {
    case ScaleForm::kChannelwise:
    case ScaleForm::kMaxRows:
      return Shape{weight[weight.size() - 2], 1};
    case ScaleForm::kMaxScalar:
      return Shape{};
    case ScaleForm::kMaxExperts:
      return Shape{weight[0]};
    case ScaleForm::kAsLoaded:
    case ScaleForm::kSwizzled:  // the block scales' shape (nvfp4_swizzled_shape)
    case ScaleForm::kMarlin:    // marlin_scale_shape
      break;
  }
  return weight;  // not asked for
}

bool input_scale_max(const QuantScheme& q) {
  return q.target != Target::kLoader && q.input_scales &&
         (q.method == Method::kFp8Tensor || q.method == Method::kFp8Channel ||
          q.method == Method::kFp8Block);
}

bool kv_scales_served(const QuantScheme& q) {
  // ModelOptFp4Config reads a missing kv_cache_quant_algo as "auto", so every
  // attention gets a ModelOptFp8KVCacheMethod; ModelOptFp8Config reads it as None.
  const bool modelopt_fp4 = q.format == Format::kModelOpt && q.method == Method::kNvfp4;
  return q.target != Target::kLoader && q.kv_cache_params &&
         (q.format == Format::kFp8 || q.kv_cache_scales || modelopt_fp4);
}

bool kv_scales_loaded(const QuantScheme& q, std::string_view attn) {
  return q.kv_cache_scales && (attn == "attn" || attn == "attn_mqa");
}

bool converts_ue8m0(const QuantScheme& q, const Shape& weight) {
  if (q.method != Method::kFp8Block || weight.size() < 2) {
    return false;
  }
  if (q.requant == QuantScheme::Requant::kUe8m0) {
    return true;
  }
  if (q.target != Target::kSm100 || q.block_n != 128 || q.block_k != 128) {
    return false;
  }
  const bool runs = weight.size() == 3 ? q.ue8m0_experts : q.ue8m0_dense;
  const std::uint64_t n = weight[weight.size() - 2];
  const std::uint64_t k = weight.back();
  return runs && n % 64 == 0 && k % 128 == 0;
}

std::string loaded_tensor_scale_name(std::string_view weight) {
  return companion_name(weight, "weight_scale_loaded");
}

std::string loaded_input_scale_name(std::string_view weight) {
  return companion_name(weight, "input_scale_loaded");
}

void check_target(const QuantScheme& q, const std::string& architecture, bool has_experts,
                  const ParallelLayout& layout) {
  if (q.target == Target::kLoader) {
    return;
  }
  const std::string key = "postprocess.target=" + std::string(to_string(q.target));
  auto refuse = [&](const std::string& why) {
    throw Error(Stage::kConfig, "config.json", "", key + ": " + why);
  };
  if (q.requant != QuantScheme::Requant::kNone) {
    refuse(
        "quantization.requant converts scales by hand; the target already gives the scales "
        "SGLang's kernels read there (use one or the other)");
  }
  if (q.method == Method::kNvfp4 && has_experts && q.target == Target::kSm100 &&
      !q.trtllm_experts && layout.ep > 1) {
    refuse(
        "SGLang 0.5.23 cannot serve NVFP4 fused experts under expert parallelism with its "
        "default MoE runner there: ModelOptNvFp4FusedMoEMethod.process_weights_after_loading "
        "multiplies the global experts' input scales by the local experts' weight_scale_2 "
        "(_compute_gemm1_alphas), which fails for ep " +
        std::to_string(layout.ep) + "; use postprocess.target=loader");
  }
  if (q.method == Method::kNvfp4 && q.target == Target::kSm90) {
    if (q.group_size != 16) {
      refuse(
          "SGLang 0.5.23 serves NVFP4 on Hopper through Marlin, which requires group_size "
          "16 (prepare_nvfp4_layer_for_marlin); this checkpoint's is " +
          std::to_string(q.group_size));
    }
    if (q.params_dtype != DType::kBF16 && q.params_dtype != DType::kF16) {
      refuse(
          "SGLang 0.5.23 serves NVFP4 on Hopper through Marlin, which requires an FP16 or "
          "BF16 model (prepare_nvfp4_layer_for_marlin); this one is " +
          std::string(dtype_name(q.params_dtype)));
    }
  }
  // The flashinfer_trtllm runner: ferry lays out block FP8 experts (swapped
  // halves), per-tensor FP8 ones (requantized, shuffled, output scales), NVFP4
  // experts (shuffled) and BF16 experts (blocks) for it.
  const std::string runner = "SGLang 0.5.23 runs " + architecture +
                             "'s experts with the flashinfer_trtllm MoE runner on sm100 by "
                             "default (_deepseek_moe_quant_resolution, model_overrides); ";
  const bool unquantized = !q.quantized() && q.online == QuantScheme::Online::kNone;
  const bool served = q.method == Method::kFp8Block || q.method == Method::kFp8Tensor ||
                      q.method == Method::kNvfp4 || unquantized;
  if (q.trtllm_experts && !served) {
    refuse(runner +
           "ferry produces its layouts for block FP8, per-tensor FP8, NVFP4 and BF16 experts, "
           "not for " +
           (q.quantized() ? "these (" + describe(q) + ")"
                          : std::string("quantization.online's FP8 experts")) +
           "; use postprocess.target=loader, or parallel.moe_a2a=deepep");
  }
  if (q.trtllm_experts && q.method == Method::kFp8Tensor && !q.input_scales) {
    refuse(runner +
           "its per-tensor FP8 experts need static input scales "
           "(align_fp8_moe_weights_for_flashinfer_trtllm asserts w13_input_scale and "
           "w2_input_scale to make output1_scales_scalar), and this checkpoint has none "
           "(dynamic activations); use postprocess.target=loader, or parallel.moe_a2a=deepep");
  }
  if (q.trtllm_experts && unquantized && q.params_dtype != DType::kBF16) {
    refuse(runner +
           "its unquantized experts' block layout views them as BF16 "
           "(UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout), which a " +
           std::string(dtype_name(q.params_dtype)) +
           " model's are not; use model.dtype=bf16, postprocess.target=loader, or "
           "parallel.moe_a2a=deepep");
  }
}

bool trtllm_loads_up_first(const QuantScheme& q) {
  return q.trtllm_experts && q.method != Method::kNvfp4 && q.format != Format::kModelOpt;
}

std::vector<std::string> trtllm_fp8_scalars(const QuantScheme& q, std::string_view weight,
                                            bool experts) {
  if (!experts || !q.trtllm_experts || q.method != Method::kFp8Tensor ||
      !weight.ends_with("w13_weight")) {
    return {};
  }
  return {experts_param(weight, "output1_scales_scalar"),
          experts_param(weight, "output1_scales_gate_scalar"),
          experts_param(weight, "output2_scales_scalar")};
}

bool trtllm_runner(const QuantScheme& q, const std::string& architecture, bool has_experts,
                   const ParallelLayout& layout) {
  if (q.target != Target::kSm100 || !has_experts ||
      layout.moe_a2a != ParallelLayout::MoeA2a::kNone) {
    return false;
  }
  // SGLang 0.5.23 sets moe_runner_backend=flashinfer_trtllm on sm100, without an
  // all-to-all backend, for these architectures when the server's quantization, as
  // its overrides see it (config.json's quant_method, none for a ModelOpt
  // hf_quant_config.json or an unquantized checkpoint), is one of:
  //   arg_groups/overrides.py _deepseek_moe_quant_resolution: the DeepSeek family,
  //     fp8, modelopt_fp8, modelopt_fp4, none;
  //   arg_groups/model_overrides/qwen3_moe.py: Qwen3-MoE, fp8, modelopt_fp4, none;
  //   arg_groups/model_overrides/glm4_moe.py: GLM-4 MoE, modelopt_fp4, none.
  // (modelopt_mixed, also listed, is a format ferry does not load.)
  static const std::map<std::string, std::set<std::string>> kRunner = {
      {"DeepseekV3ForCausalLM", {"fp8", "modelopt_fp8", "modelopt_fp4", ""}},
      {"DeepseekV32ForCausalLM", {"fp8", "modelopt_fp8", "modelopt_fp4", ""}},
      {"Qwen3MoeForCausalLM", {"fp8", "modelopt_fp4", ""}},
      {"Glm4MoeForCausalLM", {"modelopt_fp4", ""}}};
  auto it = kRunner.find(architecture);
  return it != kRunner.end() && it->second.count(q.config_method) != 0;
}

}  // namespace ferry::models
