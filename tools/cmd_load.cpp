// `ferry load`: loads a checkpoint onto devices with ferry::Runtime, prints a short
// report, and optionally writes the JSON report and a dump of every local rank's
// parameters (DIR/rank-<tp rank>.safetensors; nothing is written when the load fails).
// Its model and parallel flags are `ferry plan`'s too, and all its configuration flags
// `ferry config --show`'s (tools/cli.cpp).
//
// `--startup MODE` (or startup.mode overlap/auto from any config source) boots the
// way an engine does: prepare(), a stand-in graph capture of `--capture-seconds S`
// (a sleep), commit(); the report then says which path ran and the time to ready.
// One mode per process: a benchmark compares separate runs.
//
// `--then-update DIR` updates the loaded model in place from DIR after the load
// (Runtime::update, optionally only `--update-names`'s tensors): the report and the
// dump are the update's; a failed update says whether the old weights were restored.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "common/format.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/load_config.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"
#include "tools/progress.hpp"

namespace ferry::tools {
namespace {

constexpr const char kDescription[] =
    "Loads the checkpoint in DIR onto one device per local rank and prints a report.\n"
    "`ferry plan` takes the same model and parallel flags and shows where every tensor\n"
    "would go without reading tensor data.";

// Ctrl-C cancels the running load (it then ends with a "cancelled" error and frees
// everything); a second Ctrl-C kills the process as usual (SA_RESETHAND).
std::atomic<runtime::Runtime*> g_running{nullptr};

std::atomic<bool> g_holding{false};  // --hold: cleared by Ctrl-C

extern "C" void cancel_on_sigint(int) {
  g_holding.store(false);
  if (runtime::Runtime* rt = g_running.load()) {
    rt->cancel();  // an atomic store: safe in a signal handler
  }
}

// prepare(), then a stand-in capture of `capture_seconds` (cut short when Ctrl-C
// cancels the prepared startup), then commit().
runtime::LoadResult boot(runtime::Runtime& rt, double capture_seconds,
                         const runtime::LoadCallbacks& callbacks) {
  runtime::LoadResult prepared = rt.prepare(callbacks).wait();
  if (!prepared) {
    return prepared;
  }
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(capture_seconds);
  while (std::chrono::steady_clock::now() < until &&
         rt.state() == runtime::RuntimeState::kPrepared) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return rt.commit(callbacks).wait();
}

}  // namespace

int cmd_load(const Args& args) {
  CLI::App app(kDescription, "ferry load");
  ConfigArgs config_args;
  add_config_options(app, config_args, load_config_flags());
  double capture_seconds = 0;
  CLI::Option* capture =
      app.add_option("--capture-seconds", capture_seconds,
                     "with --startup: how long the stand-in graph capture between prepare() and "
                     "commit() lasts (default 0)")
          ->check(CLI::Range(0.0, 86400.0));
  bool quiet = false;
  app.add_flag("--quiet", quiet, "no progress on standard error");
  double hold_seconds = 0;
  app.add_option("--hold", hold_seconds,
                 "after the load, hold the model this long, as an engine would (Ctrl-C ends it); "
                 "an attached weight cache's daemon that dies meanwhile ends the process with "
                 "status 3")
      ->check(CLI::Range(0.0, 1e9));
  std::string then_update;
  app.add_option("--then-update", then_update,
                 "after the load, update the loaded model in place from this checkpoint folder "
                 "(Runtime::update); the report and the dump are then the update's")
      ->check(CLI::ExistingDirectory);
  std::string update_format;
  app.add_option("--update-format", update_format,
                 "with --then-update: read the folder as this model.load_format (default: the "
                 "load's own)");
  std::vector<std::string> update_names;
  app.add_option("--update-names", update_names,
                 "with --then-update: only the folder's tensors whose name matches one of these "
                 "shell globs");
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  std::optional<runtime::LoadConfig> maybe_config = config_from_args(config_args, "load");
  if (!maybe_config) {
    return 2;
  }
  const runtime::LoadConfig& config = *maybe_config;
  if ((!update_names.empty() || !update_format.empty()) && then_update.empty()) {
    std::fprintf(stderr,
                 "ferry load: error: --update-names and --update-format need --then-update\n");
    return 2;
  }
  const bool startup = app.count("--startup") > 0 || capture->count() > 0 ||
                       config.startup.mode != runtime::StartupMode::kSerial;

  runtime::Runtime rt(to_config(config));
  struct sigaction action {};
  struct sigaction previous {};
  action.sa_handler = cancel_on_sigint;
  action.sa_flags = SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  g_running.store(&rt);
  sigaction(SIGINT, &action, &previous);
  ProgressPrinter progress(stderr, isatty(fileno(stderr)) != 0);
  runtime::LoadCallbacks callbacks = quiet ? runtime::LoadCallbacks{} : progress.callbacks();
  callbacks.on_cache_lost = [](const std::string& why) {
    std::fprintf(stderr, "ferry load: %s\n", why.c_str());
    std::fflush(stderr);
    std::_Exit(3);
  };
  runtime::LoadResult result =
      startup ? boot(rt, capture_seconds, callbacks) : rt.start(callbacks).wait();
  if (result && !then_update.empty()) {
    // The loaded model's summary, then the update's.
    progress.finish();
    std::fputs(result.model->report().summary().c_str(), stdout);
    runtime::LoadResult loaded = result;  // held: update() writes the model it keeps
    result = rt.start_update({then_update, {}, update_names, update_format}, callbacks).wait();
  }
  progress.finish();
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
  if (hold_seconds > 0) {
    // Ctrl-C ends the hold (the load is over: cancel() does nothing now).
    std::printf("holding the model for %g s\n", hold_seconds);
    std::fflush(stdout);
    g_holding.store(true);
    sigaction(SIGINT, &action, &previous);
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(hold_seconds);
    while (g_holding.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    sigaction(SIGINT, &previous, nullptr);
  }
  try {
    if (!config.load.report.empty()) {
      // As every output: a regular file is replaced whole or left as it was (a full
      // disk leaves no empty report), a FIFO or /dev/stdout is written in place.
      write_file_replacing(config.load.report, report.json(2) + "\n", "load.report");
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
