// `ferry load`: loads a checkpoint onto devices with ferry::Runtime, prints a short
// report, and optionally writes the JSON report and a dump of every local rank's
// parameters (DIR/rank-<tp rank>.safetensors; nothing is written when the load fails).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
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
    "                  [--dump-dir DIR] [--report FILE]\n"
    "  Loads the checkpoint in DIR onto one device per local rank and prints a report.\n"
    "  --ranks      tensor-parallel ranks this process serves (\"0,2\", \"0-3\"); default all\n"
    "  --devices    one device per local rank, in order; default host:<local ranks>\n"
    "  --dump-dir   write each local rank's parameters to DIR/rank-<r>.safetensors\n"
    "  --report     write the load report as JSON\n"
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

// The dedicated flags and the configuration keys they set.
struct FlagKey {
  const char* flag;
  const char* key;
};
constexpr FlagKey kFlags[] = {
    {"--model", "model.path"},   {"--devices", "devices"},      {"--tp", "parallel.tp"},
    {"--ep", "parallel.ep"},     {"--ranks", "parallel.ranks"}, {"--dump-dir", "load.dump_dir"},
    {"--report", "load.report"},
};


}  // namespace

int cmd_load(const Args& args) {
  runtime::ConfigSources sources;
  sources.default_json = kEmbeddedDefaultConfig;
  sources.default_json_name = "embedded config/default.json";
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
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
        std::fprintf(stderr, "ferry load: %s needs a value\n%s", name.c_str(), kUsage);
        return false;
      }
      value = args[++i];
      return true;
    };
    bool known = false;
    if (name == "--config") {
      if (!take()) {
        return 2;
      }
      sources.config_file = value;
      known = true;
    } else if (name == "--set") {
      if (!take()) {
        return 2;
      }
      sources.sets.push_back(value);
      known = true;
    } else {
      for (const FlagKey& f : kFlags) {
        if (name == f.flag) {
          if (!take()) {
            return 2;
          }
          sources.flags.push_back({f.flag, f.key, value});
          known = true;
        }
      }
    }
    if (!known) {
      std::fprintf(stderr, "ferry load: unexpected argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }

  runtime::LoadConfig config;
  try {
    config = runtime::load_config(sources, environ);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry load: error: %s\n", e.what());
    return 2;
  }
  if (config.model.path.empty()) {
    std::fprintf(stderr, "ferry load: --model DIR is required\n%s", kUsage);
    return 2;
  }

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
