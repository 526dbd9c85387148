// `ferry synth`: argument parsing and the summary line around synth::synthesize.
// Usage errors exit 2; failures while writing are ferry::Error, which main()
// prints and turns into exit 1.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/format.hpp"
#include "synth/synth.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"

namespace ferry::tools {
namespace {

constexpr const char kDescription[] =
    "Writes a synthetic Hugging Face checkpoint into DIR: config.json,\n"
    "model.safetensors.index.json and model-0000i-of-0000N.safetensors shards with the\n"
    "family's real tensor names (glm4_moe also writes its MTP layer to an unindexed\n"
    "mtp.safetensors, as the real GLM-4.5 checkpoints do). Element i of tensor T is a\n"
    "function of (seed, T, i), a multiple of 1/128 in [-127/128, 127/128], so readers\n"
    "can check what they load. --format bin writes PyTorch shards instead,\n"
    "pytorch_model-0000i-of-0000N.bin (each byte for byte what torch.save writes) and\n"
    "pytorch_model.bin.index.json, with the same tensors, values and shard plan.\n"
    "--format gguf writes one file, model.gguf, as llama.cpp's convert_hf_to_gguf.py\n"
    "would convert that checkpoint (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe,\n"
    "deepseek_v2, deepseek_v3; the GGUF metadata carries the config, so no config.json).\n"
    "The model is either --family F --preset P (toy sizes) or --from-config FILE: a real\n"
    "model's config.json, whose architectures[0] names the family and whose fields give\n"
    "every size, so the checkpoint has the real model's tensors and shapes (DeepSeek-V3:\n"
    "46183 tensors, 1.37 TB in bf16). Its config.json is FILE's, less\n"
    "quantization_config, except that --sparse at real sizes keeps an FP8 block\n"
    "config's layout (DeepSeek-V3: 91991 tensors, 689 GB; --dtype bf16 strips it).\n"
    "Add --sparse to write such a checkpoint in seconds (data\n"
    "regions are holes: zeros that take no disk, so the (seed, T, i) values do not\n"
    "apply), or --scale-dims H for the real tensor set at a fraction of the size.";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "ferry synth: %s\n(see ferry synth --help)\n", message.c_str());
  return 2;
}

std::optional<std::uint64_t> parse_uint(std::string_view text) {
  if (text.empty() || text.size() > 20) {
    return std::nullopt;
  }
  std::uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') {
      return std::nullopt;
    }
    std::uint64_t digit = static_cast<std::uint64_t>(c - '0');
    if (value > (UINT64_MAX - digit) / 10) {
      return std::nullopt;
    }
    value = value * 10 + digit;
  }
  return value;
}

// "4096", "512K", "16M", "1G", also "16MiB" / "16MB" (all binary).
std::optional<std::uint64_t> parse_size(std::string_view text) {
  std::uint64_t scale = 1;
  for (std::string_view suffix : {"iB", "B"}) {
    if (text.size() > suffix.size() && text.ends_with(suffix)) {
      text.remove_suffix(suffix.size());
      break;
    }
  }
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
      case 'k':
        scale = std::uint64_t{1} << 10;
        break;
      case 'M':
      case 'm':
        scale = std::uint64_t{1} << 20;
        break;
      case 'G':
      case 'g':
        scale = std::uint64_t{1} << 30;
        break;
      default:
        break;
    }
    if (scale != 1) {
      text.remove_suffix(1);
    }
  }
  std::optional<std::uint64_t> n = parse_uint(text);
  if (!n || *n > UINT64_MAX / scale) {
    return std::nullopt;
  }
  return *n * scale;
}

// The flags whose values are not SynthOptions fields as given, and the options
// the checks after parsing ask about.
struct SynthFlags {
  std::string dtype = "bf16";
  std::string shard_bytes;
  std::string quant = "auto";
  std::string format = "safetensors";
  std::string gguf_type = "f16";
  std::uint64_t quant_block = 0;
  bool no_fsync = false;
  std::vector<std::string> dense;
  std::vector<std::string> moe;
  CLI::Option* family = nullptr;
  CLI::Option* preset = nullptr;
  CLI::Option* from_config = nullptr;
  CLI::Option* dtype_option = nullptr;
  CLI::Option* gguf_type_option = nullptr;
  CLI::Option* shard_bytes_option = nullptr;
};

// What to write: a family and preset, or a real config (scaled); where; the seed.
void add_model_options(CLI::App& app, synth::SynthOptions& options, SynthFlags& f) {
  for (const auto& family : synth::synth_families()) {
    (synth::synth_family_has_experts(family) ? f.moe : f.dense).push_back(family);
  }
  const std::string families = "dense: " + join_list(f.dense) + "\nMoE: " + join_list(f.moe);
  f.family = app.add_option("--family", options.family, families)
                 ->type_name("F")
                 ->check(one_of(synth::synth_families(), "family"));
  f.preset = app.add_option("--preset", options.preset,
                            "tiny (a few MiB) | small (tens of MiB) | medium (2-3 GiB in bf16)")
                 ->type_name("P")
                 ->check(one_of(synth::synth_presets(), "preset"));
  f.from_config =
      app.add_option("--from-config", options.from_config,
                     "a real model's config.json instead of --family and --preset:\n"
                     "architectures[0] gives the family (LlamaForCausalLM, Qwen2ForCausalLM,\n"
                     "MistralForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM,\n"
                     "Qwen2MoeForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM,\n"
                     "Glm4MoeForCausalLM), its fields every size; values the family\n"
                     "cannot write (Qwen-MoE mlp_only_layers, DeepSeek moe_layer_freq\n"
                     "> 1, ...) are errors")
          ->type_name("FILE")
          ->excludes(f.family)
          ->excludes(f.preset);
  app.add_option("--scale-dims", options.scale_hidden,
                 "with --from-config: the same tensors (layers, experts, heads, vocab)\n"
                 "with hidden_size H and every other width scaled by H / hidden_size,\n"
                 "rounded up to a multiple of 8 (DeepSeek-V3 at 64: about 220 MB);\n"
                 "H is a multiple of 8 below hidden_size")
      ->type_name("H")
      ->needs(f.from_config)
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            std::optional<std::uint64_t> h = parse_uint(text);
            return h && *h > 0 && *h % 8 == 0
                       ? ""
                       : "expected a positive multiple of 8 such as 64, not '" + text + "'";
          },
          "", "multiple of 8"));
  app.add_option("--out", options.out,
                 "folder to create (written beside it, then renamed into place)")
      ->type_name("DIR")
      ->required();
  app.add_option("--seed", options.seed, "value seed")
      ->type_name("N")
      ->check(whole_number())
      ->capture_default_str();
}

// How it is written: quantization, dtype, shards, the switches.
void add_layout_options(CLI::App& app, synth::SynthOptions& options, SynthFlags& f) {
  app.add_option("--quant", f.quant,
                 "the quantized linear weights (<w> is a weight's name less 'weight'):\n"
                 "  fp8-block     F8_E4M3, F32 <w>weight_scale_inv [ceil(N/b), ceil(K/b)]\n"
                 "                (quantization_config quant_method fp8)\n"
                 "  fp8-channel   F8_E4M3, F32 <w>weight_scale [N, 1] (compressed-tensors,\n"
                 "                dynamic per-token activations)\n"
                 "  fp8-tensor    F8_E4M3, F32 scalars <w>weight_scale, <w>input_scale\n"
                 "                (compressed-tensors, static per-tensor activations)\n"
                 "  modelopt-fp8  F8_E4M3, scalars <w>weight_scale, <w>input_scale, the\n"
                 "                attention's k_scale / v_scale (hf_quant_config.json)\n"
                 "  nvfp4         U8 [N, K/2] (two E2M1 a byte), F8_E4M3 <w>weight_scale\n"
                 "                [N, K/16], scalars <w>weight_scale_2, <w>input_scale\n"
                 "                (ModelOpt NVFP4, hf_quant_config.json)\n"
                 "  none, or auto: with --from-config --sparse (real sizes) and no --dtype,\n"
                 "                the config's own FP8 block layout, its quantization_config\n"
                 "                kept; otherwise none")
      ->type_name("Q")
      ->check(CLI::IsMember(
          {"none", "fp8-block", "fp8-channel", "fp8-tensor", "modelopt-fp8", "nvfp4", "auto"}))
      ->capture_default_str();
  app.add_option("--quant-block", f.quant_block,
                 "b of fp8-block (default 128, or the config's weight_block_size)")
      ->type_name("N")
      ->check(CLI::PositiveNumber);
  f.dtype_option =
      app.add_option("--dtype", f.dtype,
                     "bf16 | f16 | f32 (with --from-config too, whatever its torch_dtype;\n"
                     "the written config.json says this one)")
          ->type_name("D")
          ->check(known_value(
              [](const std::string& text) { return synth::parse_synth_dtype(text).has_value(); },
              "dtype", "bf16, f16, f32"))
          ->capture_default_str();
  f.shard_bytes_option =
      app.add_option("--shard-bytes", f.shard_bytes,
                     "shard size; suffixes K, M, G (binary) allowed\n"
                     "(default: tiny 512K, small 16M, medium 512M, --from-config 5G)")
          ->type_name("N")
          ->check(CLI::Validator(
              [](std::string& text) -> std::string {
                std::optional<std::uint64_t> bytes = parse_size(text);
                return bytes && *bytes > 0
                           ? ""
                           : "expected a positive size such as 1048576 or 512M, not '" + text + "'";
              },
              "", "size"));
  app.add_option("--format", f.format,
                 "safetensors | bin | gguf\n"
                 "  bin   PyTorch shards, pytorch_model-0000i-of-0000N.bin as torch.save\n"
                 "        writes them, and pytorch_model.bin.index.json (as\n"
                 "        save_pretrained(safe_serialization=False)); not with --sparse,\n"
                 "        nor for glm4_moe, whose MTP layer goes to an unindexed file\n"
                 "  gguf  model.gguf alone, as convert_hf_to_gguf.py converts the\n"
                 "        safetensors checkpoint: llama.cpp's names (llama, mistral and\n"
                 "        mixtral as 'llama', qwen2, qwen3, qwen3_moe as 'qwen3moe',\n"
                 "        deepseek_v2/v3 as 'deepseek2'), q_proj/k_proj rows permuted for\n"
                 "        the llama architecture, experts stacked into ffn_*_exps,\n"
                 "        DeepSeek's kv_b_proj split into attn_k_b/attn_v_b and its MTP\n"
                 "        layer left out, the config as {arch}.* metadata; no tokenizer.\n"
                 "        Not with --sparse, --quant or --fused-experts")
      ->type_name("F")
      ->check(CLI::IsMember({"safetensors", "bin", "gguf"}))
      ->capture_default_str();
  f.gguf_type_option =
      app.add_option("--gguf-type", f.gguf_type,
                     "with --format gguf, the converter's --outtype: f32 | f16 | bf16 | q8_0.\n"
                     "As convert_hf_to_gguf.py, 1-D tensors (norms, biases), every\n"
                     "*_norm.weight and the MoE router (ffn_gate_inp) stay F32 whatever the\n"
                     "type; q8_0 quantizes every other weight whose rows are a multiple of\n"
                     "32 long as gguf-py does (byte for byte) and writes the rest (DeepSeek\n"
                     "attn_k_b with qk_nope_head_dim 16, say) as F16, as the converter falls\n"
                     "back. --dtype names the checkpoint it is converted from; synth values\n"
                     "are exact in every dtype, so it changes no value")
          ->type_name("T")
          ->check(known_value(
              [](const std::string& text) {
                return synth::parse_synth_gguf_type(text).has_value();
              },
              "GGUF type", "f32, f16, bf16, q8_0"))
          ->capture_default_str();
  add_switch(app, "--tie-embeddings", options.tie_embeddings,
             "no lm_head.weight; config says tie_word_embeddings\n"
             "(with --from-config, the config's tie_word_embeddings decides)")
      ->excludes(f.from_config);
  add_switch(app, "--fused-experts", options.fused_experts,
             "MoE families: each layer's routed experts as two 3-D tensors,\n"
             "experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and\n"
             "experts.down_proj [E, H, I], instead of one set per expert");
  add_switch(app, "--sparse", options.sparse,
             "every shard a sparse file: real header, the data region a hole\n"
             "(reads as zeros, takes no disk; a full-size DeepSeek-V3 in seconds).\n"
             "Values are all zero, not the (seed, T, i) function, so checks\n"
             "against it do not apply");
  add_switch(app, "--force", options.force,
             "replace DIR if it holds a checkpoint (*.safetensors, *.bin, *.gguf, *.json\n"
             "only)");
  add_switch(app, "--no-fsync", f.no_fsync,
             "skip fsync before the rename (faster, not crash-safe)");
}

// The checks that span flags, after parsing: an exit status (2, a usage error) or
// nullopt with `options` complete.
std::optional<int> finish_options(synth::SynthOptions& options, const SynthFlags& f) {
  options.fsync = !f.no_fsync;
  options.dtype = *synth::parse_synth_dtype(f.dtype);              // checked by the validator above
  options.format = *synth::parse_synth_format(f.format);           // checked by IsMember above
  options.gguf_type = *synth::parse_synth_gguf_type(f.gguf_type);  // checked above
  if (options.format != synth::SynthFormat::kGguf && f.gguf_type_option->count() > 0) {
    return usage_error("--gguf-type needs --format gguf");
  }
  if (options.format == synth::SynthFormat::kGguf && f.shard_bytes_option->count() > 0) {
    return usage_error("--shard-bytes does not apply to --format gguf (one file)");
  }
  if (f.quant != "auto") {
    options.quant = *synth::parse_synth_quant(f.quant);  // checked by IsMember above
  } else {
    // A real FP8 config keeps its layout unless a dtype is asked for explicitly.
    options.quant_from_config = f.from_config->count() > 0 && options.sparse &&
                                options.scale_hidden == 0 && f.dtype_option->count() == 0;
  }
  if (f.quant_block != 0) {
    if (options.quant != synth::SynthQuant::kFp8Block && !options.quant_from_config) {
      return usage_error(
          "--quant-block needs --quant fp8-block (or an FP8 --from-config --sparse)");
    }
    options.quant_block = f.quant_block;
  }
  if (!f.shard_bytes.empty()) {
    options.shard_bytes = *parse_size(f.shard_bytes);  // checked by the validator above
  }
  const bool by_preset = f.family->count() > 0 || f.preset->count() > 0;
  if (!by_preset && f.from_config->count() == 0) {
    return usage_error("no model given: pass --family F --preset P, or --from-config FILE");
  }
  if (by_preset && (f.family->count() == 0 || f.preset->count() == 0)) {
    return usage_error(std::string(f.family->count() == 0 ? "--preset" : "--family") + " needs " +
                       (f.family->count() == 0 ? "--family" : "--preset") +
                       " (or give --from-config FILE instead of both)");
  }
  std::string family_name = options.family;
  if (f.from_config->count() > 0) {
    // Read it now: a bad file is an error of its own (exit 1, naming the file and
    // field), and H is checked against its hidden_size as a usage error.
    synth::SynthSource source = synth::read_synth_source(options.from_config);
    family_name = source.family;
    if (options.scale_hidden >= source.hidden_size) {
      return usage_error("--scale-dims " + std::to_string(options.scale_hidden) +
                         " must be below the hidden_size " + std::to_string(source.hidden_size) +
                         " of " + options.from_config);
    }
  }
  if (options.fused_experts && !synth::synth_family_has_experts(family_name)) {
    return usage_error("--fused-experts needs a family with routed experts; '" + family_name +
                       "' is dense (" + join_list(f.moe) + ")");
  }
  return std::nullopt;
}

void print_summary(const synth::SynthOptions& options, const synth::SynthResult& result) {
  std::string format;
  if (options.format == synth::SynthFormat::kTorchBin) {
    format = " format bin";
  } else if (options.format == synth::SynthFormat::kGguf) {
    format = " format gguf " + std::string(io::ggml_type_name(options.gguf_type));
  }
  std::string model = options.family + "/" + options.preset;
  if (!options.from_config.empty()) {
    model = result.family + " from " + options.from_config;
    if (options.scale_hidden != 0) {
      model += " scaled to hidden " + std::to_string(options.scale_hidden);
    }
  }
  std::printf(
      "ferry synth: %s%s%s%s seed %llu -> %s: %zu files (%zu shards), %zu tensors, "
      "%llu bytes (%s) of tensor data%s\n",
      model.c_str(), options.fused_experts ? " fused-experts" : "", options.sparse ? " sparse" : "",
      format.c_str(), static_cast<unsigned long long>(options.seed), options.out.c_str(),
      result.files.size(), result.shards, result.tensors,
      static_cast<unsigned long long>(result.total_bytes),
      human_bytes(result.total_bytes, 2).c_str(), options.sparse ? " (all zeros, in holes)" : "");
}

}  // namespace

int cmd_synth(const Args& args) {
  CLI::App app(kDescription, "ferry synth");
  synth::SynthOptions options;
  SynthFlags flags;
  add_model_options(app, options, flags);
  add_layout_options(app, options, flags);
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  if (std::optional<int> status = finish_options(options, flags)) {
    return *status;
  }
  // A large preset takes seconds; say how far it got when someone is watching.
  if (::isatty(STDERR_FILENO) != 0) {
    options.progress = [](std::uint64_t done, std::uint64_t total) {
      std::fprintf(stderr, "\rferry synth: %s of %s", human_bytes(done, 2).c_str(),
                   human_bytes(total, 2).c_str());
      if (done == total) {
        std::fputc('\n', stderr);
      }
      std::fflush(stderr);
    };
  }

  print_summary(options, synth::synthesize(options));
  return 0;
}

}  // namespace ferry::tools
