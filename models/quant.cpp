#include "models/quant.hpp"

#include <array>

#include "common/error.hpp"
#include "models/hf_config.hpp"

namespace ferry::models {
namespace {

constexpr std::string_view kField = "quantization_config";

[[noreturn]] void bad_field(const std::string& rule) {
  throw Error(Stage::kConfig, kConfigFile, "", std::string(kField) + "." + rule);
}

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

std::vector<std::string> string_list(const nlohmann::json& q, const char* field) {
  std::vector<std::string> out;
  auto it = q.find(field);
  if (it == q.end() || it->is_null()) {
    return out;
  }
  if (!it->is_array()) {
    bad_field(std::string(field) + " must be a list of module names");
  }
  for (const nlohmann::json& v : *it) {
    if (!v.is_string()) {
      bad_field(std::string(field) + " must be a list of module names");
    }
    out.push_back(v.get<std::string>());
  }
  return out;
}

// `module` or one of its parents ("a.b.c": "a.b.c", "a.b", "a"), with and without
// the leading "model.".
bool listed(const std::vector<std::string>& ignored, const std::string& module) {
  auto matches = [&](std::string_view name) {
    for (const std::string& entry : ignored) {
      std::string_view e = entry;
      auto hit = [&](std::string_view x) {
        return name == x ||
               (name.size() > x.size() && name.substr(0, x.size()) == x && name[x.size()] == '.');
      };
      if (!e.empty() && hit(e)) {
        return true;
      }
    }
    return false;
  };
  constexpr std::string_view kModel = "model.";
  if (matches(module)) {
    return true;
  }
  std::string_view m = module;
  if (m.substr(0, kModel.size()) == kModel) {
    return matches(m.substr(kModel.size()));
  }
  return matches(std::string(kModel) + module);
}

// *_proj.weight and *_proj_with_mqa.weight (DeepSeek's kv_a_proj_with_mqa and the
// fused q_a / kv_a param), but the MTP layer's eh_proj.
bool linear_name(std::string_view name) {
  return (ends_with(name, "_proj.weight") || ends_with(name, "_proj_with_mqa.weight")) &&
         !ends_with(name, "eh_proj.weight");
}

}  // namespace

QuantScheme parse_quant_scheme(const nlohmann::json& hf_config) {
  QuantScheme s;
  auto it = hf_config.find(kField);
  if (it == hf_config.end() || it->is_null()) {
    return s;
  }
  const nlohmann::json& q = *it;
  if (!q.is_object()) {
    throw Error(Stage::kConfig, kConfigFile, "", std::string(kField) + " must be an object");
  }
  auto m = q.find("quant_method");
  if (m == q.end() || !m->is_string()) {
    bad_field("quant_method must name the quantization method");
  }
  const std::string method = m->get<std::string>();
  if (method != "fp8") {
    constexpr std::array<std::string_view, 14> kKnown{
        "gptq",     "awq",          "awq_marlin", "gptq_marlin", "bitsandbytes",
        "gguf",     "mxfp4",        "w8a8_int8",  "w8a8_fp8",    "compressed-tensors",
        "modelopt", "modelopt_fp4", "fbgemm_fp8", "marlin"};
    bool known = false;
    for (std::string_view k : kKnown) {
      known = known || k == method;
    }
    throw Error(Stage::kMapping, kConfigFile, "",
                std::string(known ? "" : "unknown ") + "quantization method \"" + method +
                    "\" (quantization_config.quant_method) is not supported; ferry loads "
                    "quant_method fp8 with weight_block_size (FP8 block scales)");
  }
  auto block = q.find("weight_block_size");
  if (block == q.end() || block->is_null()) {
    throw Error(Stage::kMapping, kConfigFile, "",
                "quant_method fp8 without weight_block_size (per-tensor FP8 scales) is not "
                "supported; ferry loads FP8 with block scales");
  }
  auto positive = [](const nlohmann::json& v) {
    return v.is_number_integer() && v.get<std::int64_t>() > 0;
  };
  if (!block->is_array() || block->size() != 2 || !positive((*block)[0]) ||
      !positive((*block)[1])) {
    bad_field("weight_block_size must be two positive integers [block_n, block_k], got " +
              block->dump());
  }
  s.method = QuantScheme::Method::kFp8Block;
  s.block_n = (*block)[0].get<std::uint64_t>();
  s.block_k = (*block)[1].get<std::uint64_t>();
  // SGLang's Fp8Config: block-wise quantization needs dynamic activation scales.
  if (auto a = q.find("activation_scheme"); a != q.end() && !a->is_null()) {
    if (!a->is_string() || a->get<std::string>() != "dynamic") {
      bad_field("activation_scheme is " + a->dump() +
                "; block-wise FP8 quantization only supports the dynamic activation scheme");
    }
  }
  if (auto f = q.find("scale_fmt"); f != q.end() && !f->is_null()) {
    if (!f->is_string() || f->get<std::string>() != "ue8m0") {
      bad_field("scale_fmt is " + f->dump() + "; only ue8m0 (or none) is known");
    }
    s.scale_fmt = "ue8m0";
  }
  s.ignored = string_list(q, "modules_to_not_convert");
  for (std::string& name : string_list(q, "ignored_layers")) {
    s.ignored.push_back(std::move(name));
  }
  return s;
}

std::string describe(const QuantScheme& scheme) {
  if (!scheme.quantized()) {
    return "none";
  }
  std::string out =
      "fp8 block [" + std::to_string(scheme.block_n) + ", " + std::to_string(scheme.block_k) + "]";
  if (!scheme.scale_fmt.empty()) {
    out += " scale_fmt " + scheme.scale_fmt;
  }
  return out;
}

bool quantized_linear_param(std::string_view param) {
  if (ends_with(param, "experts.w13_weight") || ends_with(param, "experts.w2_weight")) {
    return true;
  }
  return linear_name(param);
}

bool quantized_linear_tensor(std::string_view tensor) {
  if (tensor.find(".experts.") != std::string_view::npos &&
      (ends_with(tensor, ".w1.weight") || ends_with(tensor, ".w2.weight") ||
       ends_with(tensor, ".w3.weight"))) {
    return true;
  }
  return linear_name(tensor);
}

bool module_skipped(const QuantScheme& scheme, const std::string& module,
                    const std::vector<std::string>& shards) {
  if (scheme.ignored.empty()) {
    return false;
  }
  if (listed(scheme.ignored, module)) {
    return true;
  }
  if (shards.empty()) {
    return false;
  }
  std::size_t skipped = 0;
  for (const std::string& shard : shards) {
    skipped += listed(scheme.ignored, shard) ? 1 : 0;
  }
  if (skipped != 0 && skipped != shards.size()) {
    throw Error(Stage::kMapping, kConfigFile, module,
                "quantization_config excludes some but not all shards of " + module +
                    " from quantization; all shards of a fused layer must have the same "
                    "precision (as SGLang requires)");
  }
  return skipped == shards.size();
}

std::string scale_inv_name(std::string_view weight) {
  return std::string(weight) + "_scale_inv";
}

Shape block_scale_shape(const Shape& weight, std::uint64_t block_n, std::uint64_t block_k) {
  Shape out = weight;
  if (out.size() < 2) {
    throw Error(Stage::kPlacement, "", "",
                "internal: a block-scaled weight needs two dims, got " + format_shape(weight));
  }
  out[out.size() - 2] = (out[out.size() - 2] + block_n - 1) / block_n;
  out[out.size() - 1] = (out[out.size() - 1] + block_k - 1) / block_k;
  return out;
}

void check_block_aligned(const Block& block, const Shape& src_inner, const Shape& dst_inner,
                         std::uint64_t block_n, std::uint64_t block_k, const std::string& tensor,
                         const std::string& param, int tp_rank, int tp) {
  if (block.length == 0) {
    return;
  }
  if (block.axis > 1 || src_inner.size() != 2 || dst_inner.size() != 2) {
    throw Error(Stage::kPlacement, "", tensor,
                "internal: a block-scaled weight's share must narrow one of its two inner dims");
  }
  const bool rows = block.axis == 0;
  const std::uint64_t b = rows ? block_n : block_k;
  const std::string where = " (" + tensor + " into " + param + ", tp rank " +
                            std::to_string(tp_rank) + " of " + std::to_string(tp) +
                            "; an FP8 block-scaled weight splits only into whole " +
                            std::to_string(block_n) + " x " + std::to_string(block_k) +
                            " blocks, as SGLang's validate_block_quant_shapes requires)";
  const bool whole = block.src_start == 0 && block.length == src_inner[block.axis] &&
                     block.dst_start + block.length == dst_inner[block.axis];
  if (block.length % b != 0 && !whole) {
    throw Error(Stage::kPlacement, "", tensor,
                std::string(rows ? "Weight output_partition_size = "
                                 : "Weight input_size_per_partition = ") +
                    std::to_string(block.length) + " is not divisible by weight quantization " +
                    (rows ? "block_n = " : "block_k = ") + std::to_string(b) + where);
  }
  if (block.src_start % b != 0 || block.dst_start % b != 0) {
    throw Error(Stage::kPlacement, "", tensor,
                std::string("the share starts at ") + (rows ? "row " : "column ") +
                    std::to_string(block.src_start) + " of the tensor and " +
                    std::to_string(block.dst_start) + " of the parameter, not a multiple of " +
                    (rows ? "block_n = " : "block_k = ") + std::to_string(b) + where);
  }
}

Block scale_block(const Block& weight_block, std::uint64_t block_n, std::uint64_t block_k) {
  const std::uint64_t b = weight_block.axis == 0 ? block_n : block_k;
  Block out = weight_block;
  out.src_start = weight_block.src_start / b;
  out.dst_start = weight_block.dst_start / b;
  out.length = (weight_block.length + b - 1) / b;
  return out;
}

}  // namespace ferry::models
