// `ferry synth`: argument parsing and the summary line around tools::synthesize.
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

#include "tools/commands.hpp"
#include "tools/synth.hpp"

namespace ferry::tools {
namespace {

constexpr const char kSynthUsage[] =
    "usage: ferry synth --family FAMILY --preset PRESET --out DIR [options]\n"
    "\n"
    "Writes a synthetic Hugging Face checkpoint into DIR: config.json,\n"
    "model.safetensors.index.json and model-0000i-of-0000N.safetensors shards with the\n"
    "family's real tensor names (glm4_moe also writes its MTP layer to an unindexed\n"
    "mtp.safetensors, as the real GLM-4.5 checkpoints do). Element i of tensor T is a\n"
    "function of (seed, T, i), a multiple of 1/128 in [-127/128, 127/128], so readers\n"
    "can check what they load.\n"
    "\n"
    "  --family F         dense: llama | qwen2 | mistral\n"
    "                     MoE:   mixtral | qwen3_moe | qwen2_moe | deepseek_v2 |\n"
    "                            deepseek_v3 | glm4_moe\n"
    "  --preset P         tiny (a few MiB) | small (tens of MiB) | medium (2-3 GiB in bf16)\n"
    "  --out DIR          folder to create (written beside it, then renamed into place)\n"
    "  --seed N           value seed (default 1)\n"
    "  --dtype D          bf16 | f16 | f32 (default bf16)\n"
    "  --shard-bytes N    shard size; suffixes K, M, G (binary) allowed\n"
    "                     (default: tiny 512K, small 16M, medium 512M)\n"
    "  --tie-embeddings   no lm_head.weight; config says tie_word_embeddings\n"
    "  --fused-experts    MoE families: each layer's routed experts as two 3-D tensors,\n"
    "                     experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and\n"
    "                     experts.down_proj [E, H, I], instead of one set per expert\n"
    "  --force            replace DIR if it holds a checkpoint (*.safetensors, *.json only)\n"
    "  --no-fsync         skip fsync before the rename (faster, not crash-safe)\n"
    "  -h, --help         this text\n";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "ferry synth: %s\n(see ferry synth --help)\n", message.c_str());
  return 2;
}

bool is_switch(std::string_view flag) {
  return flag == "--tie-embeddings" || flag == "--fused-experts" || flag == "--force" ||
         flag == "--no-fsync";
}

bool takes_value(std::string_view flag) {
  for (std::string_view f :
       {"--family", "--preset", "--out", "--seed", "--dtype", "--shard-bytes"}) {
    if (flag == f) {
      return true;
    }
  }
  return false;
}

bool known(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) {
    out += out.empty() ? "" : ", ";
    out += n;
  }
  return out;
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

std::string human_bytes(std::uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace

int cmd_synth(const Args& args) {
  SynthOptions options;
  bool have_dtype_error = false;
  std::string dtype_text;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kSynthUsage, stdout);
      return 0;
    }
    if (!arg.starts_with("--")) {
      return usage_error("unexpected argument '" + std::string(arg) + "'");
    }
    // --flag, --flag value or --flag=value
    auto eq = arg.find('=');
    std::string flag(arg.substr(0, eq));
    if (is_switch(flag)) {
      if (eq != std::string_view::npos) {
        return usage_error(flag + " takes no value");
      }
      if (flag == "--tie-embeddings") {
        options.tie_embeddings = true;
      } else if (flag == "--fused-experts") {
        options.fused_experts = true;
      } else if (flag == "--force") {
        options.force = true;
      } else {
        options.fsync = false;
      }
      continue;
    }
    if (!takes_value(flag)) {
      return usage_error("unknown option '" + flag + "'");
    }
    std::string value;
    if (eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return usage_error(flag + " needs a value");
    }
    if (flag == "--family") {
      options.family = value;
    } else if (flag == "--preset") {
      options.preset = value;
    } else if (flag == "--out") {
      options.out = value;
    } else if (flag == "--seed") {
      auto seed = parse_uint(value);
      if (!seed) {
        return usage_error("--seed takes a non-negative integer, not '" + value + "'");
      }
      options.seed = *seed;
    } else if (flag == "--dtype") {
      auto dtype = parse_synth_dtype(value);
      have_dtype_error = !dtype;
      dtype_text = value;
      if (dtype) {
        options.dtype = *dtype;
      }
    } else if (flag == "--shard-bytes") {
      auto bytes = parse_size(value);
      if (!bytes || *bytes == 0) {
        return usage_error("--shard-bytes takes a positive size such as 1048576 or 512M, not '" +
                           value + "'");
      }
      options.shard_bytes = *bytes;
    }
  }

  if (options.family.empty()) {
    return usage_error("--family is required");
  }
  if (!known(synth_families(), options.family)) {
    return usage_error("unknown family '" + options.family + "' (" + joined(synth_families()) +
                       ")");
  }
  if (options.fused_experts && !synth_family_has_experts(options.family)) {
    std::vector<std::string> moe;
    for (const auto& family : synth_families()) {
      if (synth_family_has_experts(family)) {
        moe.push_back(family);
      }
    }
    return usage_error("--fused-experts needs a family with routed experts; '" + options.family +
                       "' is dense (" + joined(moe) + ")");
  }
  if (options.preset.empty()) {
    return usage_error("--preset is required");
  }
  if (!known(synth_presets(), options.preset)) {
    return usage_error("unknown preset '" + options.preset + "' (" + joined(synth_presets()) + ")");
  }
  if (have_dtype_error) {
    return usage_error("unknown dtype '" + dtype_text + "' (bf16, f16, f32)");
  }
  if (options.out.empty()) {
    return usage_error("--out is required");
  }

  // A large preset takes seconds; say how far it got when someone is watching.
  if (::isatty(STDERR_FILENO) != 0) {
    options.progress = [](std::uint64_t done, std::uint64_t total) {
      std::fprintf(stderr, "\rferry synth: %s of %s", human_bytes(done).c_str(),
                   human_bytes(total).c_str());
      if (done == total) {
        std::fputc('\n', stderr);
      }
      std::fflush(stderr);
    };
  }

  SynthResult result = synthesize(options);
  std::printf(
      "ferry synth: %s/%s%s seed %llu -> %s: %zu files (%zu shards), %zu tensors, "
      "%llu bytes (%s) of tensor data\n",
      options.family.c_str(), options.preset.c_str(), options.fused_experts ? " fused-experts" : "",
      static_cast<unsigned long long>(options.seed), options.out.c_str(), result.files.size(),
      result.shards, result.tensors, static_cast<unsigned long long>(result.total_bytes),
      human_bytes(result.total_bytes).c_str());
  return 0;
}

}  // namespace ferry::tools
