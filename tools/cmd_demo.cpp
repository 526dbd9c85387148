// `ferry demo [--config FILE] [--cache DIR]`: the README's first command. Synthesizes
// a tiny DeepSeek-V3-shaped checkpoint into a cache folder next to the binary unless
// it is already there, then loads it with `ferry load --ep 2` on the embedded default
// configuration (config/default.json, compiled in: tensor parallelism 2 on two
// emulated host devices; expert parallelism is a flag of the demo, not of the
// default, which every model must accept) and prints the load report.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "synth/synth.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"

namespace ferry::tools {
namespace {

namespace fs = std::filesystem;

// The demo checkpoint: small enough to synthesize in a moment, shaped like the
// real thing (MLA with the w_kc / w_vc hook, dense and MoE layers, shared experts,
// an MTP layer the target model drops, several shards).
constexpr const char kDemoFamily[] = "deepseek_v3";
constexpr const char kDemoPreset[] = "tiny";
constexpr std::uint64_t kDemoSeed = 1;

constexpr const char kDescription[] =
    "Synthesizes a tiny DeepSeek-V3 checkpoint into the cache folder unless it is already\n"
    "there, then runs `ferry load --ep 2` on it with the embedded default configuration (or\n"
    "FILE) and prints the report.";

fs::path executable_dir() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::current_path() : exe.parent_path();
}

}  // namespace

int cmd_demo(const Args& args) {
  CLI::App app(kDescription, "ferry demo");
  std::string config_file;
  std::string cache;
  app.add_option("--config", config_file,
                 "a JSON config file instead of the embedded config/default.json")
      ->type_name("FILE");
  app.add_option("--cache", cache,
                 "where the checkpoint is kept (default: cache/ next to the "
                 "ferry binary)")
      ->type_name("DIR");
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  synth::SynthOptions synth;
  synth.family = kDemoFamily;
  synth.preset = kDemoPreset;
  synth.seed = kDemoSeed;
  fs::path dir = cache.empty() ? executable_dir() / "cache" : fs::path(cache);
  dir /= synth.family + "-" + synth.preset + "-seed" + std::to_string(synth.seed);
  synth.out = dir.string();
  if (fs::exists(dir / "model.safetensors.index.json")) {
    std::printf("using the cached checkpoint %s\n", synth.out.c_str());
  } else {
    fs::create_directories(dir.parent_path());
    synth::SynthResult r = synth::synthesize(synth);
    std::printf("synthesized %s %s (seed %llu): %zu tensors, %llu bytes in %zu shards -> %s\n",
                synth.family.c_str(), synth.preset.c_str(),
                static_cast<unsigned long long>(synth.seed), r.tensors,
                static_cast<unsigned long long>(r.total_bytes), r.shards, synth.out.c_str());
  }
  std::fflush(stdout);
  Args load_args = {"--model", synth.out, "--ep", "2"};
  if (!config_file.empty()) {
    load_args.push_back("--config");
    load_args.push_back(config_file);
  }
  return cmd_load(load_args);
}

}  // namespace ferry::tools
