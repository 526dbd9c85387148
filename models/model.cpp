#include "models/model.hpp"

#include <algorithm>
#include <array>

#include "common/enum_name.hpp"
#include "common/error.hpp"
#include "common/format.hpp"
#include "models/family.hpp"
#include "models/hf_config.hpp"
#include "models/online_quant.hpp"
#include "models/postprocess.hpp"
#include "models/quant.hpp"
#include "models/requant.hpp"
#include "models/table_model.hpp"

namespace ferry::models {
namespace {

// Options the family does not take are refused by name rather than ignored.
void refuse_options(const FamilyDescriptor& d, const ParallelLayout& layout,
                    const ModelOptions& options) {
  auto refuse = [&](const std::string& option, const std::string& why) {
    throw Error(Stage::kConfig, kConfigFile, "",
                option + ": " + d.architecture + " " + why + ", so the option does not apply");
  };
  if (!d.takes(kTakesDraft) && options.draft) {
    refuse("model.draft", "has no MTP (NextN) layers and no draft model");
  }
  if (!d.takes(kTakesExperts)) {
    if (options.eplb) {
      refuse("model.eplb_map", "has no experts to place");
    }
    if (options.switch_w13) {
      refuse("model.switch_w13", "has no fused expert weights (w13)");
    }
    if (options.pad_moe_intermediate_to != 0) {
      refuse("model.pad_moe_intermediate_to", "has no MoE intermediate size");
    }
    if (layout.ep != 1) {
      throw Error(Stage::kConfig, "", "",
                  "parallel layout: ep " + std::to_string(layout.ep) +
                      " needs a mixture-of-experts model; " + d.architecture +
                      " has no experts (use ep 1)");
    }
  }
  if (!d.takes(kTakesSharedExpertFusion) && options.fuse_shared_experts.value_or(false)) {
    refuse("model.fuse_shared_experts", "has no shared experts");
  }
  // SGLang's DeepSeek deployment layouts: refused where ferry does not know the
  // family's placement under them.
  auto refuse_layout = [&](const std::string& key, bool set, const std::string& who) {
    if (set) {
      throw Error(
          Stage::kConfig, "", "",
          key + ": ferry places it for " + who + " only; " + d.architecture + " does not take it");
    }
  };
  // Attention data parallelism: the families SGLang 0.5.23 builds a layout for (the
  // descriptor's attention_dp); the others are refused by name.
  if (layout.attn_dp != 1 && !d.attention_dp) {
    throw Error(Stage::kConfig, "", "",
                "parallel.attn_dp " + std::to_string(layout.attn_dp) + ": " + d.architecture +
                    " (family " + d.family +
                    ") has no layout under attention data parallelism: SGLang 0.5.23's model "
                    "for it splits nothing over the attention tp group (use attn_dp 1)");
  }
  if (layout.dp_lm_head && d.attention_dp && !d.attention_dp->dp_lm_head) {
    throw Error(Stage::kConfig, "", "",
                "parallel.dp_lm_head: " + d.architecture + " (family " + d.family +
                    ") builds its lm_head over all tp ranks whatever enable_dp_lm_head says "
                    "(SGLang 0.5.23: its ParallelLMHead takes no use_attn_tp_group), so the "
                    "option does not apply");
  }
  refuse_layout("parallel.moe_dense_tp 1", !d.takes(kTakesMoeDenseTp) && layout.moe_dense_tp == 1,
                "DeepSeek and GLM-4 MoE (SGLang's DeepseekV2ForCausalLM, Glm4MoeForCausalLM)");
  refuse_layout("parallel.moe_a2a deepep",
                !d.takes(kTakesDeepep) && layout.moe_a2a == ParallelLayout::MoeA2a::kDeepep,
                "DeepSeek's MLA families (SGLang's DeepseekV2ForCausalLM)");
}

}  // namespace

std::string format_shape(const Shape& shape) {
  return format_dims(shape);
}

std::uint64_t Piece::dst_bytes() const {
  return rows * width_elems * dtype_size(dst_dtype);
}

std::uint64_t Piece::src_end() const {
  if (kind == Kind::kZero || rows == 0) {
    return 0;
  }
  return src_offset + (rows - 1) * src_pitch + src_row_bytes();
}

std::uint64_t Piece::src_row_bytes() const {
  return src_blocks != GgmlBlocks::kNone ? ggml_row_bytes(src_blocks, width_elems)
                                         : width_elems * dtype_size(src_dtype);
}

std::string_view to_string(RouteKind kind) {
  static constexpr std::array<std::string_view, 3> kNames{"placed", "dropped", "unmapped"};
  static_assert(kNames.size() == static_cast<std::size_t>(RouteKind::kUnmapped) + 1);
  return enum_name(kind, kNames);
}

std::vector<std::string> Model::notes() const {
  return {};
}

std::byte* HookContext::reallocate(std::size_t param) {
  throw Error(Stage::kPostProcess, "", "",
              "a post-load hook asked to reallocate param " + std::to_string(param) +
                  ", which this context cannot do");
}

std::byte* HookContext::scratch(std::size_t bytes) {
  if (bytes == 0) {
    return nullptr;
  }
  throw Error(Stage::kPostProcess, "", "",
              "a post-load hook asked for " + std::to_string(bytes) +
                  " bytes of device scratch, which this context does not have");
}

std::vector<PostLoadHook> Model::hooks() const {
  return {};
}

std::optional<DType> parse_model_dtype(std::string_view text) {
  if (text == "auto") {
    return std::nullopt;
  }
  if (text == "bfloat16" || text == "bf16" || text == "BF16") {
    return DType::kBF16;
  }
  if (text == "float16" || text == "half" || text == "fp16" || text == "f16" || text == "F16") {
    return DType::kF16;
  }
  if (text == "float32" || text == "float" || text == "fp32" || text == "f32" || text == "F32") {
    return DType::kF32;
  }
  throw Error(
      Stage::kConfig, "", "",
      "model dtype \"" + std::string(text) + "\" is not one of auto, bfloat16, float16, float32");
}

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const FamilyDescriptor& d : family_descriptors()) {
      out.push_back(d.architecture);
    }
    std::sort(out.begin(), out.end());
    return out;
  }();
  return names;
}

std::unique_ptr<Model> make_model(const nlohmann::json& hf_config, const ParallelLayout& layout,
                                  const ModelOptions& options) {
  if (!hf_config.is_object()) {
    throw Error(Stage::kConfig, kConfigFile, "", "config must be a JSON object");
  }
  auto arch = hf_config.find("architectures");
  if (arch == hf_config.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    throw Error(Stage::kConfig, kConfigFile, "",
                "field 'architectures' must be a non-empty list of names");
  }
  const std::string architecture = (*arch)[0].get<std::string>();
  const FamilyDescriptor* family = find_family(architecture);
  if (family == nullptr) {
    std::string known;
    for (const std::string& name : supported_architectures()) {
      known += (known.empty() ? "" : ", ") + name;
    }
    throw Error(Stage::kMapping, kConfigFile, "",
                "architecture " + architecture + " is not supported (supported: " + known + ")");
  }
  ModelOptions with_quant = options;
  with_quant.quant = parse_quant_scheme(hf_config);
  QuantScheme& q = with_quant.quant;
  q.requant = options.requant;
  if (q.requant != QuantScheme::Requant::kNone) {
    if (q.method != QuantScheme::Method::kFp8Block) {
      throw Error(Stage::kConfig, kConfigFile, "",
                  "quantization.requant converts FP8 block scales; this checkpoint's "
                  "quantization is " +
                      describe(q));
    }
    if (q.requant == QuantScheme::Requant::kUe8m0 && (q.block_n != 128 || q.block_k != 128)) {
      throw Error(Stage::kConfig, kConfigFile, "",
                  "quantization.requant=ue8m0 needs 128 x 128 blocks, as SGLang's "
                  "requant_weight_ue8m0 and DeepGEMM do; this checkpoint's are " +
                      describe(q));
    }
  }
  q.online = options.online;
  if (q.online != QuantScheme::Online::kNone && q.quantized()) {
    throw Error(Stage::kConfig, kConfigFile, "",
                "quantization.online quantizes a full-precision checkpoint while loading; this "
                "one is already quantized (" +
                    describe(q) + ")");
  }
  DType dtype = resolve_dtype(hf_config, options.dtype);
  ParallelLayout normalized = normalize_layout(layout);
  // postprocess.target (models/postprocess.hpp). On sm100 DeepGEMM runs block FP8
  // linears whose output is BF16 (should_deepgemm_weight_requant_ue8m0), and the
  // experts only under DeepEP (Fp8MoEMethod.is_deepgemm_moe_runner_backend_enabled).
  q.target = options.target;
  q.ue8m0_dense = q.target == QuantScheme::Target::kSm100 && dtype == DType::kBF16;
  q.ue8m0_experts = q.ue8m0_dense && normalized.moe_a2a == ParallelLayout::MoeA2a::kDeepep;
  q.params_dtype = dtype;
  const bool has_experts = hf_config.contains("n_routed_experts") ||
                           hf_config.contains("num_experts") ||
                           hf_config.contains("num_local_experts");
  q.trtllm_experts = trtllm_runner(q, architecture, has_experts, normalized);
  check_target(q, architecture, has_experts, normalized);
  // flashinfer_trtllm's FP8 and BF16 experts: FusedMoE._weight_loader_impl loads w1
  // as w3 and w3 as w1 for an Fp8MoEMethod or an UnquantizedFusedMoEMethod, scales
  // included (up rows first).
  with_quant.switch_w13 = options.switch_w13 || trtllm_loads_up_first(q);
  refuse_options(*family, normalized, with_quant);
  for (const std::string& field : family->required_fields) {
    config_positive(hf_config, field);
  }
  const FamilyInput in{hf_config, *family, normalized, dtype, with_quant};
  std::unique_ptr<TableModel> model = family->build(in);
  // The one place hooks are registered: the family's, then the quantization's
  // (which order themselves after the family's that read the weights as loaded).
  for (const HookRule& rule : family->hooks) {
    model->add_hooks(rule(*model, in));
  }
  if (q.online != QuantScheme::Online::kNone) {
    model->add_hooks(make_online_quant_hooks(*model, q));
  }
  if (q.requant != QuantScheme::Requant::kNone || q.target == QuantScheme::Target::kSm100) {
    model->add_hooks(make_requant_hooks(*model, q));
  }
  model->add_hooks(make_input_scale_checks(*model));
  model->add_hooks(make_postprocess_hooks(*model, q));
  return model;
}

}  // namespace ferry::models
