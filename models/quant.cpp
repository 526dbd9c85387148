#include "models/quant.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <stdexcept>

#include "common/enum_name.hpp"
#include "common/error.hpp"
#include "common/fp8.hpp"
#include "models/hf_config.hpp"
#include "models/module_regex.hpp"
#include "models/postprocess.hpp"

namespace ferry::models {
namespace {

constexpr std::string_view kField = "quantization_config";
using Method = QuantScheme::Method;
using Format = QuantScheme::Format;
using IgnoreMatch = QuantScheme::IgnoreMatch;

[[noreturn]] void bad_field(const std::string& rule) {
  throw Error(Stage::kConfig, kConfigFile, "", std::string(kField) + "." + rule);
}

[[noreturn]] void unsupported(const std::string& rule) {
  throw Error(Stage::kMapping, kConfigFile, "", rule);
}

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

// `obj`'s string field, "" when absent or null; anything else is malformed.
std::string string_field(const nlohmann::json& obj, const char* field, const std::string& where) {
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) {
    return "";
  }
  if (!it->is_string()) {
    bad_field(where + field + " must be a string, got " + it->dump());
  }
  return it->get<std::string>();
}

std::vector<std::string> string_list(const nlohmann::json& q, const char* field,
                                     const std::string& where = "") {
  std::vector<std::string> out;
  auto it = q.find(field);
  if (it == q.end() || it->is_null()) {
    return out;
  }
  if (!it->is_array()) {
    bad_field(where + field + " must be a list of module names");
  }
  for (const nlohmann::json& v : *it) {
    if (!v.is_string()) {
      bad_field(where + field + " must be a list of module names");
    }
    out.push_back(v.get<std::string>());
  }
  return out;
}

bool positive_integer(const nlohmann::json& v) {
  return v.is_number_integer() && v.get<std::int64_t>() > 0;
}

// weight_block_size / block_structure: [bn, bk] (or "NxM", as vLLM also reads
// compressed-tensors' block_structure).
void parse_block(const nlohmann::json& block, const std::string& field, QuantScheme& s) {
  if (block.is_string()) {
    const std::string text = block.get<std::string>();
    const std::size_t x = text.find('x');
    try {
      if (x != std::string::npos) {
        std::size_t used_n = 0;
        std::size_t used_k = 0;
        const std::uint64_t n = std::stoull(text.substr(0, x), &used_n);
        const std::uint64_t k = std::stoull(text.substr(x + 1), &used_k);
        if (used_n == x && used_k == text.size() - x - 1 && n > 0 && k > 0) {
          s.block_n = n;
          s.block_k = k;
          return;
        }
      }
    } catch (const std::exception&) {
    }
  } else if (block.is_array() && block.size() == 2 && positive_integer(block[0]) &&
             positive_integer(block[1])) {
    s.block_n = block[0].get<std::uint64_t>();
    s.block_k = block[1].get<std::uint64_t>();
    return;
  }
  bad_field(field + " must be two positive integers [block_n, block_k], got " + block.dump());
}

// quant_method "fp8" (SGLang's Fp8Config): block scales with weight_block_size, else
// one scale per tensor.
QuantScheme parse_fp8(const nlohmann::json& q) {
  QuantScheme s;
  s.format = Format::kFp8;
  const std::string activation = string_field(q, "activation_scheme", "");
  auto block = q.find("weight_block_size");
  if (block != q.end() && !block->is_null()) {
    s.method = Method::kFp8Block;
    s.scale_suffix = "weight_scale_inv";
    parse_block(*block, "weight_block_size", s);
    // SGLang's Fp8Config: block-wise quantization needs dynamic activation scales.
    if (q.contains("activation_scheme") && activation != "dynamic") {
      bad_field("activation_scheme is " + q["activation_scheme"].dump() +
                "; block-wise FP8 quantization only supports the dynamic activation scheme");
    }
  } else {
    s.method = Method::kFp8Tensor;
    s.scale_suffix = "weight_scale";
    if (activation != "dynamic" && activation != "static") {
      bad_field("activation_scheme must be \"dynamic\" or \"static\" for per-tensor FP8, got " +
                (q.contains("activation_scheme") ? q["activation_scheme"].dump() : "nothing"));
    }
    s.input_scales = activation == "static";
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
  s.ignore_match = IgnoreMatch::kModule;
  return s;
}

// One config group's weights / input_activations, as compressed-tensors writes them
// (QuantizationArgs): only what decides the layout is kept.
struct CtArgs {
  std::string strategy;
  nlohmann::json block;
  bool input_static = false;
  bool operator==(const CtArgs&) const = default;
};

CtArgs parse_ct_group(const std::string& name, const nlohmann::json& group) {
  const std::string where = "config_groups." + name + ".";
  if (!group.is_object()) {
    bad_field(where.substr(0, where.size() - 1) + " must be an object");
  }
  auto weights = group.find("weights");
  if (weights == group.end() || !weights->is_object()) {
    unsupported("compressed-tensors " + where +
                "weights is missing: a group that quantizes no weights is not supported");
  }
  const std::string type = string_field(*weights, "type", where + "weights.");
  auto bits = weights->find("num_bits");
  if (type != "float" || bits == weights->end() || *bits != 8) {
    unsupported("compressed-tensors " + where + "weights are " +
                (type.empty() ? std::string("untyped") : type) + " with num_bits " +
                (bits == weights->end() ? std::string("unset") : bits->dump()) +
                "; ferry loads compressed-tensors FP8 (type float, num_bits 8) only");
  }
  if (weights->value("symmetric", true) == false) {
    unsupported("compressed-tensors " + where +
                "weights.symmetric is false; asymmetric FP8 weights have no scheme in SGLang");
  }
  if (weights->value("dynamic", false) == true) {
    unsupported("compressed-tensors " + where +
                "weights.dynamic is true; FP8 weights must be stored quantized");
  }
  CtArgs args;
  args.strategy = string_field(*weights, "strategy", where + "weights.");
  if (args.strategy != "tensor" && args.strategy != "channel" && args.strategy != "block") {
    unsupported("compressed-tensors " + where + "weights.strategy \"" + args.strategy +
                "\" is not supported; ferry loads FP8 with strategy tensor, channel or block");
  }
  if (args.strategy == "block") {
    args.block = weights->value("block_structure", nlohmann::json());
    if (args.block.is_null()) {
      bad_field(where + "weights.block_structure must be set for strategy block");
    }
  }
  auto input = group.find("input_activations");
  if (input != group.end() && !input->is_null()) {
    if (!input->is_object()) {
      bad_field(where + "input_activations must be an object or null");
    }
    const std::string itype = string_field(*input, "type", where + "input_activations.");
    if (itype != "float" || input->value("num_bits", nlohmann::json()) != 8) {
      unsupported("compressed-tensors " + where +
                  "input_activations are not FP8 (type float, num_bits 8); not supported");
    }
    args.input_static = input->value("dynamic", false) != true;
    if (args.input_static &&
        string_field(*input, "strategy", where + "input_activations.") != "tensor") {
      unsupported("compressed-tensors " + where +
                  "input_activations are static but not per-tensor; SGLang has no FP8 scheme "
                  "for static per-token or per-channel activation scales");
    }
    if (args.input_static && args.strategy == "block") {
      unsupported("compressed-tensors " + where +
                  "static input scales are not supported for block quantization (as SGLang "
                  "asserts)");
    }
  }
  return args;
}

// quant_method "compressed-tensors" (llm-compressor), FP8 formats only.
QuantScheme parse_compressed_tensors(const nlohmann::json& q) {
  QuantScheme s;
  s.format = Format::kCompressedTensors;
  s.scale_suffix = "weight_scale";
  const std::string format = string_field(q, "format", "");
  if (format != "float-quantized" && format != "naive-quantized") {
    unsupported("compressed-tensors format \"" + format +
                "\" is not supported; ferry loads float-quantized FP8 (format "
                "float-quantized or naive-quantized)");
  }
  if (auto sp = q.find("sparsity_config"); sp != q.end() && !sp->is_null() && !sp->empty()) {
    const std::string sformat = sp->is_object() ? sp->value("format", std::string()) : "";
    if (sformat != "dense") {
      unsupported("compressed-tensors sparsity_config (" + sp->dump() +
                  ") is not supported; ferry loads dense FP8 weights");
    }
  }
  auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object() || groups->empty()) {
    bad_field("config_groups must be an object with at least one group");
  }
  std::optional<CtArgs> args;
  bool linear = false;
  for (const auto& [name, group] : groups->items()) {
    CtArgs a = parse_ct_group(name, group);
    if (args && !(a == *args)) {
      unsupported(
          "compressed-tensors config_groups give different schemes to different layers "
          "(" +
          name + " differs); ferry loads one FP8 scheme for every linear layer");
    }
    args = a;
    for (const std::string& target : string_list(group, "targets", "config_groups." + name + ".")) {
      linear = linear || target == "Linear";
    }
  }
  if (!linear) {
    unsupported(
        "compressed-tensors config_groups do not target \"Linear\"; ferry loads one FP8 "
        "scheme applied to every linear layer");
  }
  if (args->strategy == "block") {
    s.method = Method::kFp8Block;
    parse_block(args->block, "config_groups.*.weights.block_structure", s);
  } else {
    s.method = args->strategy == "channel" ? Method::kFp8Channel : Method::kFp8Tensor;
  }
  s.input_scales = args->input_static;
  s.ignored = string_list(q, "ignore");
  s.ignore_match = IgnoreMatch::kSubstringOrRegex;
  static_cast<void>(ExcludedModules(s));  // a "re:" entry that is no regex fails here
  return s;
}

// quant_method "modelopt" / "modelopt_fp8" / "modelopt_fp4": hf_quant_config.json's
// nested form ({"producer", "quantization": {...}}) or config.json's flat one.
QuantScheme parse_modelopt(const nlohmann::json& q, const std::string& method) {
  QuantScheme s;
  s.format = Format::kModelOpt;
  s.scale_suffix = "weight_scale";
  s.ignore_match = IgnoreMatch::kGlob;
  const nlohmann::json* body = &q;
  std::string where;
  if (auto nested = q.find("quantization"); nested != q.end()) {
    if (!nested->is_object()) {
      bad_field("quantization must be an object (hf_quant_config.json)");
    }
    if (auto producer = q.find("producer"); producer != q.end() && producer->is_object() &&
                                            producer->value("name", std::string()) != "modelopt") {
      unsupported("unsupported quantization config found for modelopt: producer " +
                  producer->dump() + " (hf_quant_config.json must come from modelopt)");
    }
    body = &*nested;
    where = "quantization.";
  }
  std::string algo = string_field(*body, "quant_algo", where);
  if (algo.empty()) {
    algo = method == "modelopt_fp8" ? "FP8" : method == "modelopt_fp4" ? "NVFP4" : "";
  }
  if (algo == "FP8") {
    s.method = Method::kFp8Tensor;
  } else if (algo == "NVFP4") {
    s.method = Method::kNvfp4;
  } else if (algo.empty()) {
    bad_field(where +
              "quant_algo is missing: cannot find 'quant_algo' in the model's ModelOpt "
              "quantization config");
  } else {
    unsupported("ModelOpt quant_algo \"" + algo +
                "\" is not supported; ferry loads ModelOpt FP8 and NVFP4");
  }
  // ModelOpt's activation scales are always static.
  s.input_scales = true;
  std::string kv = string_field(*body, "kv_cache_quant_algo", where);
  if (auto scheme = body->find("kv_cache_scheme"); scheme != body->end() && !scheme->is_null()) {
    kv = scheme->is_object() && scheme->value("type", std::string()) == "float" &&
                 scheme->value("num_bits", nlohmann::json()) == 8
             ? "FP8"
             : scheme->dump();
  }
  if (kv == "FP8") {
    s.kv_cache_scales = true;
  } else if (!kv.empty()) {
    unsupported("ModelOpt KV cache quantization " + kv +
                " is not supported; ferry loads FP8 "
                "KV cache scales (or none)");
  }
  if (s.method == Method::kNvfp4) {
    nlohmann::json group = body->value("group_size", q.value("group_size", nlohmann::json()));
    if (group.is_null()) {
      if (auto groups = body->find("config_groups"); groups != body->end() && groups->is_object()) {
        for (const auto& [name, g] : groups->items()) {
          if (g.is_object() && g.contains("weights") && g["weights"].is_object()) {
            group = g["weights"].value("group_size", nlohmann::json());
          }
        }
      }
    }
    if (!positive_integer(group)) {
      bad_field(where + "group_size must be a positive integer for NVFP4 (got " + group.dump() +
                ")");
    }
    s.group_size = group.get<std::uint64_t>();
  }
  s.ignored = string_list(*body, "exclude_modules", where);
  for (std::string& name : string_list(*body, "ignore", where)) {
    s.ignored.push_back(std::move(name));
  }
  return s;
}

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

// `pattern` ("*" any run of characters, everything else literal) over all of `text`.
bool glob_match(std::string_view pattern, std::string_view text) {
  std::size_t p = 0;
  std::size_t t = 0;
  std::size_t star = std::string_view::npos;
  std::size_t mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') {
    ++p;
  }
  return p == pattern.size();
}

// `module` equals `entry` or lies under it ("a.b.c" under "a.b").
bool under(std::string_view module, std::string_view entry) {
  return module == entry || (module.size() > entry.size() && starts_with(module, entry) &&
                             module[entry.size()] == '.');
}

// *_proj.weight and *_proj_with_mqa.weight (DeepSeek's kv_a_proj_with_mqa and the
// fused q_a / kv_a param), but the MTP layer's eh_proj and the V3.2 indexer's
// weights_proj (and its fused wk_weights_proj), which SGLang builds unquantized.
bool linear_name(std::string_view name) {
  return (ends_with(name, "_proj.weight") || ends_with(name, "_proj_with_mqa.weight")) &&
         !ends_with(name, "eh_proj.weight") && !ends_with(name, "weights_proj.weight");
}

// DeepSeek-V3.2's indexer: wq_b and wk are quantized ReplicatedLinears (weights_proj
// is built in the model dtype).
bool indexer_linear(std::string_view name) {
  return ends_with(name, ".indexer.wq_b.weight") || ends_with(name, ".indexer.wk.weight");
}

std::string_view format_name(Format f) {
  static constexpr std::array<std::string_view, 4> kNames{"none", "fp8", "compressed-tensors",
                                                          "modelopt"};
  static_assert(kNames.size() == static_cast<std::size_t>(Format::kModelOpt) + 1);
  return enum_name(f, kNames, "none");
}

// The E2M1 value of a 4-bit code (sign in bit 3).
float e2m1_value(std::uint8_t code) {
  static constexpr std::array<float, 8> kMagnitude{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[code & 0x7];
  return (code & 0x8) != 0 ? -m : m;
}

float f32_at(const std::byte* base, std::uint64_t index) {
  float v = 0;
  std::memcpy(&v, base + index * sizeof(float), sizeof(float));
  return v;
}

}  // namespace

QuantScheme parse_quant_scheme(const nlohmann::json& hf_config) {
  auto it = hf_config.find(kField);
  if (it == hf_config.end() || it->is_null()) {
    return {};
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
  if (method == "fp8" || method == "compressed-tensors") {
    QuantScheme s = method == "fp8" ? parse_fp8(q) : parse_compressed_tensors(q);
    s.config_method = method;
    return s;
  }
  if (method == "modelopt" || method == "modelopt_fp8" || method == "modelopt_fp4") {
    QuantScheme s = parse_modelopt(q, method);
    // hf_quant_config.json's nested form: config.json names no method.
    s.config_method = q.contains("quantization") ? "" : method;
    return s;
  }
  constexpr std::array<std::string_view, 10> kKnown{
      "gptq", "awq",   "awq_marlin", "gptq_marlin", "bitsandbytes",
      "gguf", "mxfp4", "w8a8_int8",  "w8a8_fp8",    "fbgemm_fp8"};
  const bool known = std::find(kKnown.begin(), kKnown.end(), method) != kKnown.end();
  unsupported(std::string(known ? "" : "unknown ") + "quantization method \"" + method +
              "\" (quantization_config.quant_method) is not supported; ferry loads fp8 "
              "(block or per-tensor scales), compressed-tensors FP8 and ModelOpt FP8 / NVFP4");
}

nlohmann::json with_hf_quant_config(nlohmann::json hf_config, const nlohmann::json& hf_quant) {
  if (!hf_quant.is_object()) {
    throw Error(Stage::kConfig, "hf_quant_config.json", "",
                "must hold a JSON object (ModelOpt's producer and quantization)");
  }
  auto it = hf_config.find(kField);
  if (it != hf_config.end() && !it->is_null()) {
    return hf_config;
  }
  nlohmann::json q = hf_quant;
  q["quant_method"] = "modelopt";
  hf_config[kField] = std::move(q);
  return hf_config;
}

std::string describe(const QuantScheme& s) {
  std::string out;
  switch (s.method) {
    case Method::kNone:
      return "none";
    case Method::kFp8Block:
      out = "fp8 block [" + std::to_string(s.block_n) + ", " + std::to_string(s.block_k) + "]";
      break;
    case Method::kFp8Channel:
      out = "fp8 per-channel";
      break;
    case Method::kFp8Tensor:
      out = "fp8 per-tensor";
      break;
    case Method::kNvfp4:
      out = "nvfp4 group " + std::to_string(s.group_size);
      break;
  }
  if (s.format != Format::kFp8) {
    out += " (" + std::string(format_name(s.format)) + ")";
  }
  if (!s.scale_fmt.empty()) {
    out += " scale_fmt " + s.scale_fmt;
  }
  if (s.input_scales) {
    out += ", static input scales";
  }
  if (s.kv_cache_scales) {
    out += ", fp8 kv cache scales";
  }
  return out;
}

bool quantized_linear_param(std::string_view param) {
  if (ends_with(param, "experts.w13_weight") || ends_with(param, "experts.w2_weight")) {
    return true;
  }
  return linear_name(param) || indexer_linear(param);
}

bool quantized_linear_tensor(std::string_view tensor) {
  if (tensor.find(".experts.") != std::string_view::npos &&
      (ends_with(tensor, ".w1.weight") || ends_with(tensor, ".w2.weight") ||
       ends_with(tensor, ".w3.weight"))) {
    return true;
  }
  return linear_name(tensor) || indexer_linear(tensor);
}

struct ExcludedModules::Regexes {
  std::vector<ModuleRegex> list;
};

ExcludedModules::ExcludedModules(const QuantScheme& s)
    : match_(s.ignore_match), entries_(s.ignored) {
  if (match_ != IgnoreMatch::kSubstringOrRegex) {
    return;
  }
  auto regexes = std::make_shared<Regexes>();
  regexes_ = regexes;
  for (const std::string& entry : entries_) {
    if (starts_with(entry, "re:")) {
      try {
        regexes->list.emplace_back(entry.substr(3));
      } catch (const std::invalid_argument& e) {
        throw Error(Stage::kConfig, kConfigFile, "",
                    "quantization_config.ignore entry \"" + entry +
                        "\" is not a regular expression: " + e.what());
      }
    } else {
      substrings_.push_back(lower(entry));
    }
  }
}

bool ExcludedModules::listed(const std::string& module) const {
  switch (match_) {
    case IgnoreMatch::kModule:
      return module_listed(module);
    case IgnoreMatch::kSubstringOrRegex:
      return ct_listed(module);
    case IgnoreMatch::kGlob:
      return glob_listed(module);
  }
  return false;
}

// fp8: the module or one of its parents, with and without the leading "model.".
bool ExcludedModules::module_listed(const std::string& module) const {
  auto matches = [&](std::string_view name) {
    return std::any_of(entries_.begin(), entries_.end(),
                       [&](const std::string& e) { return !e.empty() && under(name, e); });
  };
  constexpr std::string_view kModel = "model.";
  if (matches(module)) {
    return true;
  }
  return starts_with(module, kModel) ? matches(std::string_view(module).substr(kModel.size()))
                                     : matches(std::string(kModel) + module);
}

// compressed-tensors (SGLang's should_ignore_layer with check_contains): an entry is
// a case-insensitive substring of the name; "re:" entries match from its start.
bool ExcludedModules::ct_listed(const std::string& module) const {
  const std::string name = lower(module);
  for (const std::string& s : substrings_) {
    if (!s.empty() && name.find(s) != std::string::npos) {
      return true;
    }
  }
  return std::any_of(regexes_->list.begin(), regexes_->list.end(),
                     [&](const ModuleRegex& r) { return r.matches_from_start(module); });
}

// ModelOpt (is_layer_excluded and is_layer_skipped's path match): a wildcard pattern
// over the whole name (also less a "language_model." prefix) or over one of its
// dotted parts, the module lying under the entry, or an MLA projection named inside
// a fused one (kv_a_proj_with_mqa in fused_qkv_a_proj_with_mqa).
bool ExcludedModules::glob_listed(const std::string& module) const {
  constexpr std::string_view kLm = "language_model.";
  std::vector<std::string_view> parts;
  std::string_view rest = module;
  for (std::size_t dot = rest.find('.'); dot != std::string_view::npos; dot = rest.find('.')) {
    parts.push_back(rest.substr(0, dot));
    rest = rest.substr(dot + 1);
  }
  parts.push_back(rest);
  const std::string_view leaf = parts.back();
  static const std::array<std::string_view, 4> kMla{"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                    "kv_b_proj"};
  for (const std::string& e : entries_) {
    if (e.empty()) {
      continue;
    }
    if (glob_match(e, module) ||
        (starts_with(module, kLm) && glob_match(e, std::string_view(module).substr(kLm.size()))) ||
        under(module, e) || ("." + module + ".").find("." + e + ".") != std::string::npos) {
      return true;
    }
    if (std::any_of(parts.begin(), parts.end(),
                    [&](std::string_view part) { return glob_match(e, part); })) {
      return true;
    }
    // An MLA projection inside the fused one: the entry with its last part replaced
    // by the module's matches the module.
    const std::size_t dot = e.rfind('.');
    const std::string_view e_leaf = std::string_view(e).substr(dot + 1);
    if (std::find(kMla.begin(), kMla.end(), e_leaf) != kMla.end() &&
        leaf.find(e_leaf) != std::string_view::npos &&
        glob_match(e.substr(0, dot + 1) + std::string(leaf), module)) {
      return true;
    }
  }
  return false;
}

bool ExcludedModules::skipped(const std::string& module,
                              const std::vector<std::string>& shards) const {
  if (entries_.empty()) {
    return false;
  }
  if (listed(module)) {
    return true;
  }
  if (shards.empty()) {
    return false;
  }
  std::size_t skipped = 0;
  for (const std::string& shard : shards) {
    skipped += listed(shard) ? 1 : 0;
  }
  if (skipped != 0 && skipped != shards.size()) {
    throw Error(Stage::kMapping, kConfigFile, module,
                "quantization_config excludes some but not all shards of " + module +
                    " from quantization; all shards of a fused layer must have the same "
                    "precision (as SGLang requires)");
  }
  return skipped == shards.size();
}

bool module_skipped(const QuantScheme& scheme, const std::string& module,
                    const std::vector<std::string>& shards) {
  return ExcludedModules(scheme).skipped(module, shards);
}

std::string companion_name(std::string_view weight, std::string_view suffix) {
  constexpr std::string_view kWeight = "weight";
  if (!ends_with(weight, kWeight)) {
    throw Error(Stage::kPlacement, "", std::string(weight),
                "internal: a quantized weight's name must end with \"weight\"");
  }
  return std::string(weight.substr(0, weight.size() - kWeight.size())) + std::string(suffix);
}

std::string weight_scale_name(const QuantScheme& scheme, std::string_view weight) {
  return companion_name(weight, scheme.scale_suffix);
}

std::string loaded_scale_name(const QuantScheme& scheme, std::string_view weight, bool ue8m0) {
  return ue8m0 ? companion_name(weight, scheme.scale_suffix + "_f32")
               : weight_scale_name(scheme, weight);
}

std::string loaded_scale_name(const QuantScheme& scheme, std::string_view weight,
                              const Shape& shape) {
  return loaded_scale_name(scheme, weight, converts_ue8m0(scheme, shape));
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
                            "; a block-scaled weight splits only into whole " +
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

namespace {

// `rule`'s blocks, each through `f`.
ZeroRule each_block(ZeroRule rule, std::function<Block(const Block&)> f) {
  return [rule = std::move(rule), f = std::move(f)](int rank) {
    std::vector<Block> out;
    for (const Block& b : rule(rank)) {
      out.push_back(f(b));
    }
    return out;
  };
}

}  // namespace

ZeroRule packed_fill(ZeroRule zero, std::uint64_t values_per_byte) {
  return each_block(std::move(zero), [values_per_byte](const Block& b) {
    Block out = b;
    if (b.axis == 2 && values_per_byte > 1) {
      out.dst_start = b.dst_start / values_per_byte;
      out.length = b.length / values_per_byte;
    }
    return out;
  });
}

ZeroRule scale_fill(ZeroRule zero, std::uint64_t block_n, std::uint64_t block_k) {
  return each_block(std::move(zero), [block_n, block_k](const Block& b) {
    const std::uint64_t size = b.axis == 2 ? block_k : block_n;
    const std::uint64_t begin = (b.dst_start + size - 1) / size;
    const std::uint64_t end = (b.dst_start + b.length) / size;
    Block out = b;
    out.dst_start = begin;
    out.length = end > begin ? end - begin : 0;
    return out;
  });
}

float QuantizedMatrix::at(std::uint64_t row, std::uint64_t col) const {
  switch (scheme->method) {
    case Method::kFp8Block: {
      const std::uint64_t scale_cols = (cols + scheme->block_k - 1) / scheme->block_k;
      return e4m3_to_float(weight[row * cols + col]) *
             f32_at(scale, (row / scheme->block_n) * scale_cols + col / scheme->block_k);
    }
    case Method::kFp8Channel:
      return e4m3_to_float(weight[row * cols + col]) * f32_at(scale, row);
    case Method::kFp8Tensor:
      return e4m3_to_float(weight[row * cols + col]) * f32_at(scale, 0);
    case Method::kNvfp4: {
      const std::uint8_t byte = weight[(row * cols + col) / 2];
      const std::uint8_t code = col % 2 == 0 ? (byte & 0xF) : (byte >> 4);
      const std::uint64_t groups = cols / scheme->group_size;
      const auto s = static_cast<std::uint8_t>(scale[row * groups + col / scheme->group_size]);
      return e2m1_value(code) * e4m3_to_float(s) * scale_2;
    }
    case Method::kNone:
      break;
  }
  throw Error(Stage::kPostProcess, "", "", "internal: reading a weight that is not quantized");
}

gpu::Fp8Scales fp8_scales(const QuantScheme& scheme) {
  switch (scheme.method) {
    case Method::kFp8Block:
      return {gpu::Fp8Granularity::kBlock, scheme.block_n, scheme.block_k, 1};
    case Method::kFp8Channel:
      return {gpu::Fp8Granularity::kRow, 0, 0, 1};
    case Method::kFp8Tensor:
      return {gpu::Fp8Granularity::kTensor, 0, 0, 1};
    case Method::kNvfp4:
    case Method::kNone:
      break;
  }
  throw Error(Stage::kPostProcess, "", "",
              "internal: " + describe(scheme) + " has no FP8 scales for the device");
}

std::string as_loaded_name(const RankShell& shell, const std::string& weight) {
  for (const char* twin : {"weight_unquantized", "weight_loaded"}) {
    std::string name = companion_name(weight, twin);
    if (shell.by_name.count(name) != 0) {
      return name;
    }
  }
  return weight;
}

QuantizedInputs quantized_inputs(const QuantScheme& scheme, const RankShell& shell,
                                 std::size_t weight) {
  ParamSpec w = shell.params.at(weight);
  // postprocess.target=sm90's NVFP4 weights load into "<w>weight_loaded"
  // (models/postprocess.hpp): its scales are the weight's.
  constexpr std::string_view kLoaded = "_loaded";
  if (ends_with(w.name, "weight_loaded")) {
    w.name.resize(w.name.size() - kLoaded.size());
  }
  auto find = [&](const std::string& name, DType dtype, const Shape& shape) {
    auto it = shell.by_name.find(name);
    if (it == shell.by_name.end()) {
      throw Error(Stage::kPostProcess, "", name,
                  w.name + " is quantized (" + describe(scheme) +
                      ") but the model declares no such parameter for it");
    }
    const ParamSpec& p = shell.params[it->second];
    if (p.dtype != dtype || p.shape != shape) {
      throw Error(Stage::kPostProcess, "", name,
                  "parameter is " + std::string(dtype_name(p.dtype)) + " " + format_shape(p.shape) +
                      ", expected " + std::string(dtype_name(dtype)) + " " + format_shape(shape) +
                      " for " + w.name + " (" + describe(scheme) + ")");
    }
    return it->second;
  };
  if (w.shape.size() != 2) {
    throw Error(Stage::kPostProcess, "", w.name,
                "a quantized weight read on the host must be 2-D, not " + format_shape(w.shape));
  }
  const std::uint64_t rows = w.shape[0];
  QuantizedInputs out;
  // A per-tensor scale postprocess.target serves in another shape loads into a twin.
  const std::string twin = loaded_tensor_scale_name(w.name);
  const std::string scale =
      shell.by_name.count(twin) != 0 ? twin : loaded_scale_name(scheme, w.name, w.shape);
  switch (scheme.method) {
    case Method::kFp8Block:
      out.scale =
          find(scale, DType::kF32, block_scale_shape(w.shape, scheme.block_n, scheme.block_k));
      break;
    case Method::kFp8Channel:
      out.scale = find(scale, DType::kF32, Shape{rows, 1});
      break;
    case Method::kFp8Tensor:
      out.scale = find(scale, DType::kF32, Shape{1});
      break;
    case Method::kNvfp4: {
      const std::uint64_t cols = w.shape[1] * 2;
      out.scale = find(scale, DType::kF8E4M3, Shape{rows, cols / scheme.group_size});
      out.scale_2 = find(companion_name(w.name, "weight_scale_2"), DType::kF32, Shape{1});
      break;
    }
    case Method::kNone:
      throw Error(Stage::kPostProcess, "", w.name, "internal: the model is not quantized");
  }
  return out;
}

DummyRange dummy_range(const ParamSpec& p) {
  constexpr double kWeight = 1e-3;  // SGLang's initialize_dummy_weights bound
  const bool fp8_scale = ends_with(p.name, "weight_scale") ||
                         ends_with(p.name, "weight_scale_inv") ||
                         ends_with(p.name, "weight_scale_loaded");
  switch (p.dtype) {
    case DType::kU8:
      return {0, 255, true};
    case DType::kF8E4M3:
      return fp8_scale ? DummyRange{224, 448, true} : DummyRange{-448, 448, true};
    case DType::kBF16:
    case DType::kF16:
    case DType::kF32:
      break;
    default:
      return {0, 0, false};
  }
  if (ends_with(p.name, "input_scale_w1")) {
    // SGLang's dummy loader runs no weight loader, so no w1 / w3 check: 1.0 is the
    // value make_input_scale_checks lets through.
    return {1.0, 1.0, true};
  }
  if (ends_with(p.name, "weight_scale_2")) {
    return {0.5 * kWeight / (6 * 448), kWeight / (6 * 448), true};
  }
  if (fp8_scale) {
    return {0.5 * kWeight / 448, kWeight / 448, true};
  }
  if (ends_with(p.name, "input_scale") || ends_with(p.name, "k_scale") ||
      ends_with(p.name, "v_scale")) {
    return {1e-3, 1e-2, true};
  }
  return {-kWeight, kWeight, true};
}

}  // namespace ferry::models
