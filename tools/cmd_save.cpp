// `ferry save --format presharded --out ROOT`: loads the checkpoint with the usual
// model and parallel flags and saves every rank's parameters as the load left them
// (after the hooks and postprocess.target) under ROOT, in the layout's folder
// (runtime/presharded.hpp). With pp > 1 every pipeline stage is loaded and saved in
// turn, so host or device memory holds one stage at a time. A later
// `ferry load --model ROOT --set model.load_format=presharded` with the same flags
// reads it back with nothing to slice, convert or post-process.
//
// `--format sharded_state` writes SGLang's sharded_state files instead
// (runtime/sharded_state.hpp): model-rank-<r>-part-<p>.safetensors in ROOT, which
// SGLang's --load-format sharded_state and ferry's model.load_format=sharded_state
// read.
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "runtime/api_internal.hpp"
#include "runtime/load_config.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"
#include "tools/progress.hpp"

namespace ferry::tools {
namespace {

constexpr const char kDescription[] =
    "Loads the checkpoint in DIR as `ferry load` with the same flags would, then saves every\n"
    "rank's parameters as the load left them under --out, in a folder for the layout, so\n"
    "that `ferry load --set model.load_format=presharded` reads them back as they are.\n"
    "--format sharded_state writes SGLang's model-rank-<r>-part-<p>.safetensors instead.\n"
    "Every pipeline stage is saved in turn (one at a time in memory).";

}  // namespace

int cmd_save(const Args& args) {
  CLI::App app(kDescription, "ferry save");
  ConfigArgs config_args;
  add_config_options(app, config_args, load_config_flags());
  std::string format = "presharded";
  app.add_option("--format", format,
                 "what to write: presharded (ferry's, a folder per layout) or sharded_state "
                 "(SGLang's per-rank files)")
      ->check(CLI::IsMember({"presharded", "sharded_state"}));
  std::string out;
  app.add_option("--out", out, "the root folder (e.g. the checkpoint's presharded/)")->required();
  bool quiet = false;
  app.add_flag("--quiet", quiet, "no progress on standard error");
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  std::optional<runtime::LoadConfig> maybe_config = config_from_args(config_args, "save");
  if (!maybe_config) {
    return 2;
  }
  runtime::LoadConfig config = *maybe_config;
  if (config.model.load_format == io::LoadFormat::kPresharded ||
      config.model.load_format == io::LoadFormat::kShardedState ||
      config.model.load_format == io::LoadFormat::kDummy) {
    std::fprintf(stderr,
                 "ferry save: error: model.load_format=%s: save reads a checkpoint's weight "
                 "files (auto, safetensors, mistral or pt)\n",
                 std::string(io::to_string(config.model.load_format)).c_str());
    return 2;
  }
  if (config.devices.kind == runtime::DeviceSpec::Kind::kNull) {
    std::fprintf(stderr, "ferry save: error: null devices keep no parameter data to save\n");
    return 2;
  }
  const bool presharded = format == "presharded";
  const std::string key = presharded ? "load.save_presharded:" : "load.save_sharded_state:";
  (presharded ? config.load.save_presharded : config.load.save_sharded_state) = out;
  for (int stage = 0; stage < config.parallel.pp; ++stage) {
    config.parallel.pp_rank = stage;
    runtime::Runtime rt(runtime::to_config(config));
    ProgressPrinter progress(stderr, false);
    const runtime::LoadResult result =
        rt.start(quiet ? runtime::LoadCallbacks{} : progress.callbacks()).wait();
    progress.finish();
    if (!result) {
      std::fprintf(stderr, "ferry save: error: pipeline stage %d: %s\n", stage,
                   result.error->message.c_str());
      return 1;
    }
    const runtime::LoadReport& report = result.model->report();
    for (const std::string& w : report.warnings) {
      if (w.rfind(key, 0) == 0) {
        std::fprintf(stderr, "ferry save: error: pipeline stage %d: %s\n", stage, w.c_str());
        return 1;
      }
    }
    if (!presharded) {
      std::printf("pipeline stage %d: saved %zu rank(s) to %s\n", stage,
                  result.model->ranks().size(), report.sharded_state_saved.c_str());
    } else if (report.presharded_saved.empty()) {
      std::printf("pipeline stage %d: already saved under %s (left as it is)\n", stage,
                  out.c_str());
    } else {
      std::printf("pipeline stage %d: saved %zu rank(s) to %s\n", stage,
                  result.model->ranks().size(), report.presharded_saved.c_str());
    }
  }
  return 0;
}

}  // namespace ferry::tools
