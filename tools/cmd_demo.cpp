// `ferry demo [--config FILE] [--cache DIR]`: the README's first command. Reads the
// embedded default configuration (config/default.json, compiled in), synthesizes
// its checkpoint into a cache folder next to the binary unless it is already there,
// and inspects it. (The pipeline issue turns this into a real load.)
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "embedded_config.hpp"
#include "tools/commands.hpp"
#include "tools/inspect.hpp"
#include "tools/synth.hpp"

namespace ferry::tools {
namespace {

namespace fs = std::filesystem;

constexpr const char kUsage[] =
    "usage: ferry demo [--config FILE] [--cache DIR]\n"
    "  Synthesizes the configured checkpoint into DIR (default: cache/ next to the\n"
    "  ferry binary) unless it is already there, then inspects it.\n";

fs::path executable_dir() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::current_path() : exe.parent_path();
}

nlohmann::json load_config(const std::string& file) {
  std::string text;
  std::string name = "embedded config/default.json";
  if (file.empty()) {
    text = kEmbeddedDefaultConfig;
  } else {
    std::ifstream in(file);
    if (!in) {
      throw Error(Stage::kConfig, file, "", "cannot open the config file");
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    text = ss.str();
    name = file;
  }
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(Stage::kConfig, name, "", std::string("does not parse: ") + e.what());
  }
  if (!doc.is_object()) {
    throw Error(Stage::kConfig, name, "", "config is not a JSON object");
  }
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (it.key() != "demo") {
      throw Error(Stage::kConfig, name, "", "unknown key '" + it.key() + "'");
    }
  }
  nlohmann::json demo = doc.value("demo", nlohmann::json::object());
  for (auto it = demo.begin(); it != demo.end(); ++it) {
    if (it.key() != "family" && it.key() != "preset" && it.key() != "seed") {
      throw Error(Stage::kConfig, name, "", "unknown key 'demo." + it.key() + "'");
    }
  }
  return demo;
}

}  // namespace

int cmd_demo(const Args& args) {
  std::string config_file;
  std::string cache;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-h" || args[i] == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if ((args[i] == "--config" || args[i] == "--cache") && i + 1 < args.size()) {
      (args[i] == "--config" ? config_file : cache) = args[i + 1];
      ++i;
      continue;
    }
    std::fprintf(stderr, "ferry demo: unexpected argument '%s'\n%s", args[i].c_str(), kUsage);
    return 2;
  }
  nlohmann::json demo = load_config(config_file);
  SynthOptions synth;
  synth.family = demo.value("family", std::string("llama"));
  synth.preset = demo.value("preset", std::string("tiny"));
  synth.seed = demo.value("seed", std::uint64_t{1});
  fs::path dir = cache.empty() ? executable_dir() / "cache" : fs::path(cache);
  dir /= synth.family + "-" + synth.preset + "-seed" + std::to_string(synth.seed);
  synth.out = dir.string();
  if (fs::exists(dir / "model.safetensors.index.json")) {
    std::printf("using the cached checkpoint %s\n", synth.out.c_str());
  } else {
    fs::create_directories(dir.parent_path());
    SynthResult r = synthesize(synth);
    std::printf("synthesized %s %s (seed %llu): %zu tensors, %llu bytes in %zu shards -> %s\n",
                synth.family.c_str(), synth.preset.c_str(),
                static_cast<unsigned long long>(synth.seed), r.tensors,
                static_cast<unsigned long long>(r.total_bytes), r.shards, synth.out.c_str());
  }
  Inspection in = inspect_path(synth.out);
  print_inspection(in, stdout);
  return 0;
}

}  // namespace ferry::tools
