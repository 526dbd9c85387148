// Loads a checkpoint through the installed libferry.so with the engine's own
// prometheus registry (ferry/metrics.hpp), then checks what an engine relies on:
// ferry's families landed in that registry beside the engine's own, the report
// and its JSON, the parameters, a refused key as a catchable ferry::Error naming
// it, and a failed load as an error with its stage.
//   metrics_consumer CHECKPOINT_DIR
#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include <cstdio>
#include <ferry/ferry.hpp>
#include <ferry/metrics.hpp>
#include <memory>
#include <string>

namespace {

int fail(const std::string& what) {
  std::fprintf(stderr, "metrics_consumer: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: metrics_consumer CHECKPOINT_DIR\n");
    return 2;
  }
  auto registry = std::make_shared<prometheus::Registry>();
  // (a family with no metric is not collected, so it gets one)
  prometheus::BuildCounter()
      .Name("engine_requests_total")
      .Help("the engine's own")
      .Register(*registry)
      .Add({})
      .Increment();

  ferry::runtime::Config config;
  config.set("model.path", argv[1]).set("parallel.tp=2");
  try {
    ferry::runtime::Config bad = config;
    bad.set("io.no_such_key=1");
    return fail("an unknown key was accepted");
  } catch (const ferry::Error& e) {
    if (e.stage() != ferry::Stage::kConfig ||
        std::string(e.what()).find("io.no_such_key") == std::string::npos) {
      return fail(std::string("the refusal does not name the key: ") + e.what());
    }
  }

  ferry::runtime::Runtime runtime(config);
  ferry::runtime::use_registry(runtime, registry);
  ferry::runtime::LoadResult r = runtime.load();
  if (!r) {
    return fail("load: " + r.error->message);
  }
  std::size_t ferry_families = 0;
  bool engine_family = false;
  for (const prometheus::MetricFamily& f : registry->Collect()) {
    ferry_families += f.name.rfind("ferry_", 0) == 0 ? 1 : 0;
    engine_family = engine_family || f.name == "engine_requests_total";
  }
  if (ferry_families == 0 || !engine_family) {
    return fail("the registry holds " + std::to_string(ferry_families) +
                " ferry families; the engine's own is " + (engine_family ? "there" : "gone"));
  }
  const std::string json = r.model->report().json(-1);
  if (json.find("\"bytes_read\"") == std::string::npos) {
    return fail("the report's JSON has no bytes_read: " + json);
  }
  std::size_t params = 0;
  for (const ferry::runtime::LoadedRank& rank : r.model->ranks()) {
    params += rank.params.size();
  }
  if (r.model->ranks().size() != 2 || params == 0) {
    return fail("expected 2 ranks with parameters");
  }

  ferry::runtime::Config missing;
  missing.set("model.path", std::string(argv[1]) + "/not-there");
  ferry::runtime::LoadResult f = ferry::runtime::Runtime(missing).load();
  if (f || f.error->stage != ferry::Stage::kDiscovery) {
    return fail("a missing checkpoint did not fail at discovery");
  }
  std::printf(
      "metrics_consumer: ok: ferry %s, %zu ferry families beside the engine's, %zu params, "
      "%s\n",
      std::string(ferry::version()).c_str(), ferry_families, params,
      std::string(ferry::to_string(f.error->stage)).c_str());
  return 0;
}
