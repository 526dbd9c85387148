// `ferry load`: loads a checkpoint onto devices with ferry::Runtime, prints a short
// report, and optionally writes the JSON report and a dump of every local rank's
// parameters (DIR/rank-<tp rank>.safetensors; nothing is written when the load fails).
// It also owns the flag parsing `ferry plan` shares (tools/commands.hpp), so both
// verbs map the same flags to the same configuration keys.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "embedded_config.hpp"
#include "runtime/load_config.hpp"
#include "runtime/runtime.hpp"
#include "tools/commands.hpp"

extern char** environ;

namespace ferry::tools {
namespace {

constexpr const char kUsage[] =
    "usage: ferry load --model DIR [--config FILE] [--set key=value]...\n"
    "                  [--devices host:N | cuda:0,1,...] [--tp N] [--ep N] [--ranks LIST]\n"
    "                  [--pp N] [--pp-rank R] [--draft] [--dump-dir DIR] [--report FILE]\n"
    "  Loads the checkpoint in DIR onto one device per local rank and prints a report.\n"
    "  --ranks      tensor-parallel ranks this process serves (\"0,2\", \"0-3\"); default all\n"
    "  --pp         pipeline stages; --pp-rank is the stage this process loads (default 0)\n"
    "  --draft      load the draft (MTP) model's weights instead of the target model's\n"
    "  --devices    one device per local rank, in order; default host:<local ranks>\n"
    "  --dump-dir   write each local rank's parameters to DIR/rank-<r>.safetensors\n"
    "  --report     write the load report as JSON\n"
    "  `ferry plan` takes the same model and parallel flags and shows where every tensor\n"
    "  would go without reading tensor data.\n"
    "  Every configuration key can be set with --set (e.g. --set io.chunk_bytes=8MiB)\n"
    "  or the environment (FERRY_IO__CHUNK_BYTES=8MiB).\n";

// Ctrl-C cancels the running load (it then ends with a "cancelled" error and frees
// everything); a second Ctrl-C kills the process as usual (SA_RESETHAND).
std::atomic<runtime::Runtime*> g_running{nullptr};

extern "C" void cancel_on_sigint(int) {
  if (runtime::Runtime* rt = g_running.load()) {
    rt->cancel();  // an atomic store: safe in a signal handler
  }
}

// The flags only `ferry load` has.
constexpr ConfigFlag kLoadFlags[] = {
    {"--devices", "devices", nullptr},
    {"--dump-dir", "load.dump_dir", nullptr},
    {"--report", "load.report", nullptr},
};

// shared_config_flags(): what `ferry plan` accepts too.
constexpr ConfigFlag kSharedFlags[] = {
    {"--model", "model.path", nullptr},         {"--tp", "parallel.tp", nullptr},
    {"--ep", "parallel.ep", nullptr},           {"--pp", "parallel.pp", nullptr},
    {"--pp-rank", "parallel.pp_rank", nullptr}, {"--ranks", "parallel.ranks", nullptr},
    {"--draft", "model.draft", "true"},
};

}  // namespace

std::span<const ConfigFlag> shared_config_flags() {
  return kSharedFlags;
}

std::optional<ParsedArgs> parse_config_args(const Args& args, const char* verb,
                                            std::span<const ConfigFlag> verb_flags,
                                            std::span<const char* const> verb_switches,
                                            const char* usage) {
  ParsedArgs out;
  out.sources.default_json = kEmbeddedDefaultConfig;
  out.sources.default_json_name = "embedded config/default.json";
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      out.help = true;  // as before: help wins over whatever follows
      return out;
    }
    std::string name = a;
    std::string value;
    bool has_value = false;
    if (std::size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
      has_value = true;
    }
    auto take = [&]() -> bool {
      if (has_value) {
        return true;
      }
      if (i + 1 >= args.size()) {
        std::fprintf(stderr, "ferry %s: %s needs a value\n%s", verb, name.c_str(), usage);
        return false;
      }
      value = args[++i];
      return true;
    };
    auto find_flag = [&](std::span<const ConfigFlag> flags) -> const ConfigFlag* {
      for (const ConfigFlag& f : flags) {
        if (name == f.flag) {
          return &f;
        }
      }
      return nullptr;
    };
    if (name == "--config" || name == "--set") {
      if (!take()) {
        return std::nullopt;
      }
      if (name == "--config") {
        out.sources.config_file = value;
      } else {
        out.sources.sets.push_back(value);
      }
      continue;
    }
    const ConfigFlag* flag = find_flag(shared_config_flags());
    if (flag == nullptr) {
      flag = find_flag(verb_flags);
    }
    if (flag != nullptr) {
      if (flag->implied != nullptr && !has_value) {
        value = flag->implied;
      } else if (!take()) {
        return std::nullopt;
      }
      out.sources.flags.push_back({flag->flag, flag->key, value});
      continue;
    }
    if (!has_value &&
        std::find(verb_switches.begin(), verb_switches.end(), name) != verb_switches.end()) {
      out.switches.push_back(name);
      continue;
    }
    std::fprintf(stderr, "ferry %s: unexpected argument '%s'\n%s", verb, a.c_str(), usage);
    return std::nullopt;
  }
  return out;
}

std::optional<runtime::LoadConfig> config_from_args(const ParsedArgs& parsed, const char* verb,
                                                    const char* usage) {
  runtime::LoadConfig config;
  try {
    config = runtime::load_config(parsed.sources, environ);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry %s: error: %s\n", verb, e.what());
    return std::nullopt;
  }
  if (config.model.path.empty()) {
    std::fprintf(stderr, "ferry %s: --model DIR is required\n%s", verb, usage);
    return std::nullopt;
  }
  return config;
}

int cmd_load(const Args& args) {
  std::optional<ParsedArgs> parsed = parse_config_args(args, "load", kLoadFlags, {}, kUsage);
  if (!parsed) {
    return 2;
  }
  if (parsed->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::optional<runtime::LoadConfig> maybe_config = config_from_args(*parsed, "load", kUsage);
  if (!maybe_config) {
    return 2;
  }
  const runtime::LoadConfig& config = *maybe_config;

  runtime::Runtime rt(config);
  struct sigaction action {};
  struct sigaction previous {};
  action.sa_handler = cancel_on_sigint;
  action.sa_flags = SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  g_running.store(&rt);
  sigaction(SIGINT, &action, &previous);
  runtime::LoadResult result = rt.load();
  sigaction(SIGINT, &previous, nullptr);
  g_running.store(nullptr);
  if (!result) {
    std::fprintf(stderr, "ferry load: error: %s\n", result.error->message.c_str());
    return 1;
  }
  const runtime::LoadReport& report = result.model->report();
  std::fputs(report.summary().c_str(), stdout);
  for (const runtime::LoadedRank& rank : result.model->ranks()) {
    std::printf("tp rank %d on %s: %zu parameters\n", rank.tp_rank, rank.device.c_str(),
                rank.params.size());
  }
  try {
    if (!config.load.report.empty()) {
      std::ofstream out(config.load.report, std::ios::trunc);
      out << report.to_json().dump(2) << "\n";
      if (!out) {
        throw Error(Stage::kConfig, config.load.report, "", "cannot write the report");
      }
    }
    if (!config.load.dump_dir.empty()) {
      result.model->dump(config.load.dump_dir);
      std::printf("dumped %zu rank(s) to %s\n", result.model->ranks().size(),
                  config.load.dump_dir.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry load: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace ferry::tools
