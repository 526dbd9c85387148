// Quantized checkpoints: the quantized linear layers' weights in each layout, their
// companions, and the config that says so.
#include <array>
#include <utility>

#include "common/enum_name.hpp"
#include "common/error.hpp"
#include "synth/family.hpp"
#include "synth/synth.hpp"

namespace ferry::synth {
namespace {

// Whether `name` is the weight of one of SGLang's quantized linear layers, as synth
// writes them: *_proj.weight (and kv_a_proj_with_mqa) but the MTP layer's eh_proj and
// the indexer's weights_proj (plain layers in SGLang), Mixtral's experts' w1/w2/w3, and
// DeepSeek-V3.2's indexer wq_b and wk. Synth's own rule, not models/'s: the loader is
// checked against it.
bool quantized_weight(std::string_view name) {
  constexpr std::array<std::string_view, 2> kPlain{"eh_proj.weight", "weights_proj.weight"};
  constexpr std::array<std::string_view, 2> kLinear{"_proj.weight", "_proj_with_mqa.weight"};
  constexpr std::array<std::string_view, 3> kExperts{".w1.weight", ".w2.weight", ".w3.weight"};
  constexpr std::array<std::string_view, 2> kIndexer{".indexer.wq_b.weight", ".indexer.wk.weight"};
  auto any_end = [&](const auto& suffixes) {
    for (std::string_view s : suffixes) {
      if (name.ends_with(s)) {
        return true;
      }
    }
    return false;
  };
  if (any_end(kPlain)) {
    return false;
  }
  return any_end(kLinear) || any_end(kIndexer) ||
         (name.find(".experts.") != std::string_view::npos && any_end(kExperts));
}

// "<module>.weight" with `suffix` for "weight": "<module>.weight_scale".
std::string companion_of(const std::string& weight, std::string_view suffix) {
  return weight.substr(0, weight.size() - std::string_view("weight").size()) + std::string(suffix);
}

}  // namespace

std::optional<SynthQuant> parse_synth_quant(std::string_view text) {
  static const std::array<std::pair<std::string_view, SynthQuant>, 6> kNames{{
      {"none", SynthQuant::kNone},
      {"fp8-block", SynthQuant::kFp8Block},
      {"fp8-channel", SynthQuant::kFp8Channel},
      {"fp8-tensor", SynthQuant::kFp8Tensor},
      {"modelopt-fp8", SynthQuant::kModelOptFp8},
      {"nvfp4", SynthQuant::kNvfp4},
  }};
  for (const auto& [name, quant] : kNames) {
    if (name == text) {
      return quant;
    }
  }
  return std::nullopt;
}

std::string_view to_string(SynthQuant quant) {
  static constexpr std::array<std::string_view, 6> kNames{
      "none", "fp8-block", "fp8-channel", "fp8-tensor", "modelopt-fp8", "nvfp4"};
  static_assert(kNames.size() == static_cast<std::size_t>(SynthQuant::kNvfp4) + 1);
  return enum_name(quant, kNames);
}

std::string synth_value_name(SynthQuant quant, std::string_view name) {
  std::string out(name);
  if (quant != SynthQuant::kFp8Tensor || out.find(".experts.") == std::string::npos) {
    return out;
  }
  for (const auto& [up, gate] : {std::pair<std::string_view, std::string_view>{
                                     ".up_proj.input_scale", ".gate_proj.input_scale"},
                                 {".w3.input_scale", ".w1.input_scale"}}) {
    if (out.ends_with(up)) {
      return out.substr(0, out.size() - up.size()) + std::string(gate);
    }
  }
  return out;
}

void synth_quantize(std::vector<SynthTensor>& tensors, SynthQuant quant, std::uint64_t block) {
  if (quant == SynthQuant::kNone) {
    return;
  }
  if (quant == SynthQuant::kFp8Block && block == 0) {
    fail("", "the FP8 block size must be positive");
  }
  const bool per_tensor = quant == SynthQuant::kFp8Tensor || quant == SynthQuant::kModelOptFp8 ||
                          quant == SynthQuant::kNvfp4;
  const bool input_scales = per_tensor;
  std::vector<SynthTensor> out;
  out.reserve(tensors.size() * 3);
  for (SynthTensor& t : tensors) {
    if (!quantized_weight(t.name)) {
      out.push_back(std::move(t));
      continue;
    }
    if (t.name.ends_with("self_attn.qkv_proj.weight") ||
        t.name.ends_with("mlp.gate_up_proj.weight")) {
      throw Error(Stage::kSynth, "", t.name,
                  "no quantized layout of a checkpoint that stores qkv_proj / gate_up_proj "
                  "fused (Phi-3) is written");
    }
    if (t.shape.size() != 2) {
      throw Error(Stage::kSynth, "", t.name,
                  "quantized weights are written for 2-D weights only; this one is " +
                      std::to_string(t.shape.size()) + "-D (fused experts are not quantized)");
    }
    const std::uint64_t n = t.shape[0];
    const std::uint64_t k = t.shape[1];
    const std::string name = t.name;
    const std::string file = t.file;
    auto companion = [&](std::string_view suffix) { return companion_of(name, suffix); };
    std::vector<SynthTensor> extra;
    switch (quant) {
      case SynthQuant::kFp8Block:
        t.dtype = DType::kF8E4M3;
        extra.emplace_back(
            companion("weight_scale_inv"), DType::kF32,
            std::vector<std::uint64_t>{(n + block - 1) / block, (k + block - 1) / block}, file);
        break;
      case SynthQuant::kFp8Channel:
        t.dtype = DType::kF8E4M3;
        extra.emplace_back(companion("weight_scale"), DType::kF32, std::vector<std::uint64_t>{n, 1},
                           file);
        break;
      case SynthQuant::kFp8Tensor:
      case SynthQuant::kModelOptFp8:
        t.dtype = DType::kF8E4M3;
        extra.emplace_back(companion("weight_scale"), DType::kF32, std::vector<std::uint64_t>{},
                           file);
        break;
      case SynthQuant::kNvfp4:
        if (k % kSynthNvfp4Group != 0) {
          throw Error(Stage::kSynth, "", name,
                      "NVFP4 needs input features in whole groups of " +
                          std::to_string(kSynthNvfp4Group) + "; this weight has " +
                          std::to_string(k));
        }
        t.dtype = DType::kU8;
        t.shape = {n, k / 2};
        extra.emplace_back(companion("weight_scale"), DType::kF8E4M3,
                           std::vector<std::uint64_t>{n, k / kSynthNvfp4Group}, file);
        extra.emplace_back(companion("weight_scale_2"), DType::kF32, std::vector<std::uint64_t>{},
                           file);
        break;
      case SynthQuant::kNone:
        break;
    }
    if (input_scales) {
      extra.emplace_back(companion("input_scale"), DType::kF32, std::vector<std::uint64_t>{}, file);
      const std::string source = synth_value_name(quant, extra.back().name);
      if (source != extra.back().name) {
        extra.back().value_name = source;
      }
    }
    // ModelOpt's FP8 KV cache: the attention's k / v scales, self_attn.k_proj.k_scale
    // and v_proj.v_scale, under those names even for MLA, which has no k_proj (SGLang
    // 0.5.23's DeepSeek loader renames k_proj to attn_mqa for them).
    if (quant == SynthQuant::kModelOptFp8) {
      const std::size_t at = name.find("self_attn.");
      if (at != std::string::npos) {
        const std::string attn = name.substr(0, at + 10);
        const std::string leaf = name.substr(at + 10);
        if (leaf == "k_proj.weight" || leaf == "v_proj.weight") {
          const std::string s(1, leaf[0]);
          extra.emplace_back(attn + s + "_proj." + s + "_scale", DType::kF32,
                             std::vector<std::uint64_t>{}, file);
        } else if (leaf == "kv_b_proj.weight") {
          for (const char* s : {"k_proj.k_scale", "v_proj.v_scale"}) {
            extra.emplace_back(attn + s, DType::kF32, std::vector<std::uint64_t>{}, file);
          }
        }
      }
    }
    out.push_back(std::move(t));
    for (SynthTensor& e : extra) {
      out.push_back(std::move(e));
    }
  }
  tensors = std::move(out);
}

nlohmann::json synth_quant_config(SynthQuant quant, std::uint64_t block) {
  auto ct = [](const std::string& strategy, bool static_input) {
    nlohmann::json input = {{"dynamic", !static_input},
                            {"num_bits", 8},
                            {"strategy", static_input ? "tensor" : "token"},
                            {"symmetric", true},
                            {"type", "float"}};
    return nlohmann::json{{"quant_method", "compressed-tensors"},
                          {"format", "float-quantized"},
                          {"quantization_status", "compressed"},
                          {"ignore", {"lm_head"}},
                          {"config_groups",
                           {{"group_0",
                             {{"targets", {"Linear"}},
                              {"weights",
                               {{"dynamic", false},
                                {"num_bits", 8},
                                {"strategy", strategy},
                                {"symmetric", true},
                                {"type", "float"}}},
                              {"input_activations", input}}}}}};
  };
  switch (quant) {
    case SynthQuant::kFp8Block:
      return {{"activation_scheme", "dynamic"},
              {"fmt", "e4m3"},
              {"quant_method", "fp8"},
              {"weight_block_size", {block, block}}};
    case SynthQuant::kFp8Channel:
      return ct("channel", false);
    case SynthQuant::kFp8Tensor:
      return ct("tensor", true);
    case SynthQuant::kNone:
    case SynthQuant::kModelOptFp8:
    case SynthQuant::kNvfp4:
      break;
  }
  return nullptr;
}

nlohmann::json synth_hf_quant_config(SynthQuant quant) {
  if (quant != SynthQuant::kModelOptFp8 && quant != SynthQuant::kNvfp4) {
    return nullptr;
  }
  nlohmann::json q = {{"quant_algo", quant == SynthQuant::kNvfp4 ? "NVFP4" : "FP8"},
                      {"kv_cache_quant_algo",
                       quant == SynthQuant::kNvfp4 ? nlohmann::json() : nlohmann::json("FP8")},
                      {"exclude_modules", {"lm_head"}}};
  if (quant == SynthQuant::kNvfp4) {
    q["group_size"] = kSynthNvfp4Group;
  }
  return {{"producer", {{"name", "modelopt"}, {"version", "0.29.0"}}}, {"quantization", q}};
}

}  // namespace ferry::synth
