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

#include "tools/cli.hpp"
#include "tools/commands.hpp"
#include "tools/synth.hpp"

namespace ferry::tools {
namespace {

constexpr const char kDescription[] =
    "Writes a synthetic Hugging Face checkpoint into DIR: config.json,\n"
    "model.safetensors.index.json and model-0000i-of-0000N.safetensors shards with the\n"
    "family's real tensor names (glm4_moe also writes its MTP layer to an unindexed\n"
    "mtp.safetensors, as the real GLM-4.5 checkpoints do). Element i of tensor T is a\n"
    "function of (seed, T, i), a multiple of 1/128 in [-127/128, 127/128], so readers\n"
    "can check what they load.";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "ferry synth: %s\n(see ferry synth --help)\n", message.c_str());
  return 2;
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
  CLI::App app(kDescription, "ferry synth");
  SynthOptions options;
  std::string dtype = "bf16";
  std::string shard_bytes;
  std::vector<std::string> dense;
  std::vector<std::string> moe;
  for (const auto& family : synth_families()) {
    (synth_family_has_experts(family) ? moe : dense).push_back(family);
  }
  app.add_option("--family", options.family, "dense: " + joined(dense) + "\nMoE: " + joined(moe))
      ->type_name("F")
      ->required()
      ->check(one_of(synth_families(), "family"));
  app.add_option("--preset", options.preset,
                 "tiny (a few MiB) | small (tens of MiB) | medium (2-3 GiB in bf16)")
      ->type_name("P")
      ->required()
      ->check(one_of(synth_presets(), "preset"));
  app.add_option("--out", options.out,
                 "folder to create (written beside it, then renamed into place)")
      ->type_name("DIR")
      ->required();
  app.add_option("--seed", options.seed, "value seed")
      ->type_name("N")
      ->check(whole_number())
      ->capture_default_str();
  app.add_option("--dtype", dtype, "bf16 | f16 | f32")
      ->type_name("D")
      ->check(one_of({"bf16", "f16", "f32", "BF16", "F16", "F32"}, "dtype"))
      ->capture_default_str();
  app.add_option("--shard-bytes", shard_bytes,
                 "shard size; suffixes K, M, G (binary) allowed\n"
                 "(default: tiny 512K, small 16M, medium 512M)")
      ->type_name("N")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            std::optional<std::uint64_t> bytes = parse_size(text);
            return bytes && *bytes > 0
                       ? ""
                       : "expected a positive size such as 1048576 or 512M, not '" + text + "'";
          },
          "", "size"));
  add_switch(app, "--tie-embeddings", options.tie_embeddings,
             "no lm_head.weight; config says tie_word_embeddings");
  add_switch(app, "--fused-experts", options.fused_experts,
             "MoE families: each layer's routed experts as two 3-D tensors,\n"
             "experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and\n"
             "experts.down_proj [E, H, I], instead of one set per expert");
  add_switch(app, "--force", options.force,
             "replace DIR if it holds a checkpoint (*.safetensors, *.json only)");
  bool no_fsync = false;
  add_switch(app, "--no-fsync", no_fsync, "skip fsync before the rename (faster, not crash-safe)");
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  options.fsync = !no_fsync;
  options.dtype = *parse_synth_dtype(dtype);  // checked by one_of above
  if (!shard_bytes.empty()) {
    options.shard_bytes = *parse_size(shard_bytes);  // checked by the validator above
  }
  if (options.fused_experts && !synth_family_has_experts(options.family)) {
    return usage_error("--fused-experts needs a family with routed experts; '" + options.family +
                       "' is dense (" + joined(moe) + ")");
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
