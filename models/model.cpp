#include "models/model.hpp"

#include <functional>
#include <map>

#include "common/error.hpp"
#include "models/deepseek.hpp"
#include "models/dense.hpp"
#include "models/hf_config.hpp"
#include "models/hooks.hpp"
#include "models/mla_hook.hpp"
#include "models/moe.hpp"
#include "models/online_quant.hpp"
#include "models/quant.hpp"
#include "models/requant.hpp"
#include "models/table_model.hpp"

namespace ferry::models {
namespace {

using Factory = std::function<std::unique_ptr<Model>(
    const nlohmann::json&, const std::string&, const ParallelLayout&, DType, const ModelOptions&)>;

std::unique_ptr<Model> dense(const nlohmann::json& config, const std::string& architecture,
                             const ParallelLayout& layout, DType dtype,
                             const ModelOptions& options) {
  return make_dense_model(parse_dense_config(config, architecture), layout, dtype, options);
}

const std::map<std::string, Factory>& factories() {
  static const std::map<std::string, Factory> table{
      {"LlamaForCausalLM", dense},
      {"MistralForCausalLM", dense},
      {"Qwen2ForCausalLM", dense},
      // MoE families (models/moe.hpp) and DeepSeek / GLM-4 MoE (models/deepseek.hpp)
      // are registered below this line, one entry per architecture.
      {"DeepseekV2ForCausalLM", make_deepseek_family},
      {"DeepseekV3ForCausalLM", make_deepseek_family},
      {"DeepseekV32ForCausalLM", make_deepseek_family},
      {"Glm4MoeForCausalLM", make_deepseek_family},
      {"MixtralForCausalLM", make_moe_family},
      {"Qwen2MoeForCausalLM", make_moe_family},
      {"Qwen3MoeForCausalLM", make_moe_family},
  };
  return table;
}

}  // namespace

std::string format_shape(const Shape& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) {
      out += ", ";
    }
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::uint64_t Piece::dst_bytes() const {
  return rows * width_elems * dtype_size(dst_dtype);
}

std::uint64_t Piece::src_end() const {
  if (kind == Kind::kZero || rows == 0) {
    return 0;
  }
  return src_offset + (rows - 1) * src_pitch + width_elems * dtype_size(src_dtype);
}

std::string_view to_string(RouteKind kind) {
  switch (kind) {
    case RouteKind::kPlaced:
      return "placed";
    case RouteKind::kDropped:
      return "dropped";
    case RouteKind::kUnmapped:
      return "unmapped";
  }
  return "?";
}

std::vector<std::string> Model::notes() const {
  return {};
}

std::byte* HookContext::reallocate(std::size_t param) {
  throw Error(Stage::kPostProcess, "", "",
              "a post-load hook asked to reallocate param " + std::to_string(param) +
                  ", which this context cannot do");
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
    for (const auto& [name, factory] : factories()) {
      out.push_back(name);
    }
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
  auto factory = factories().find(architecture);
  if (factory == factories().end()) {
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
  std::unique_ptr<Model> model =
      factory->second(hf_config, architecture, normalized, dtype, with_quant);
  if (q.online != QuantScheme::Online::kNone) {
    std::vector<PostLoadHook> hooks = make_online_quant_hooks(*model, q);
    return with_hooks(std::shared_ptr<const Model>(std::move(model)), std::move(hooks));
  }
  if (q.requant == QuantScheme::Requant::kNone) {
    return model;
  }
  RequantHooks requant = make_requant_hooks(*model, q);
  return with_param_strides(std::shared_ptr<const Model>(std::move(model)), requant.strides,
                            std::move(requant.hooks));
}

}  // namespace ferry::models
