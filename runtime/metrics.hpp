// ferry's Prometheus metrics (prometheus-cpp): the families, and the observers
// that the decorators around readers (io::MeteredReader), devices
// (gpu::metered_device) and the staging pool (io::StagingPool::observe) feed while
// a load runs; what is known only at the end (phases, bytes, tensors) is recorded
// from the load report. Internal: engines use runtime/prometheus.hpp.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "common/error.hpp"
#include "gpu/metered_device.hpp"
#include "io/metered_reader.hpp"
#include "runtime/api_internal.hpp"

namespace ferry::runtime {

class LoadMetrics {
 public:
  // Adds ferry's families to `registry` (which may hold an engine's own families).
  explicit LoadMetrics(std::shared_ptr<prometheus::Registry> registry);

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // Observers for one load's decorators. Thread-safe.
  io::ReadObserver read_observer();
  gpu::CopyObserver copy_observer();
  std::function<void(std::size_t in_use)> staging_observer();

  // A load (or commit) that ended well: its report. `model` labels the load-level
  // families (the checkpoint folder's name).
  void record_load(const LoadReport& report, const std::string& model);
  // A load that failed, by the stage of its error.
  void record_error(Stage stage);
  // An update (Runtime::update) by outcome: "applied" (with its report), "rolled_back",
  // "invalid" or "refused".
  void record_update(const std::string& outcome, const LoadReport* report = nullptr);

  // The registry in Prometheus' text format.
  std::string text() const;
  // Writes text() to `path` through `path`.tmp renamed into place, so a collector
  // never reads half a file. Throws ferry::Error(Stage::kConfig) naming the file.
  void write_textfile(const std::string& path) const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Gauge>& load_seconds_;
  prometheus::Family<prometheus::Gauge>& phase_seconds_;
  prometheus::Family<prometheus::Counter>& bytes_read_;
  prometheus::Family<prometheus::Counter>& bytes_skipped_;
  prometheus::Family<prometheus::Counter>& bytes_copied_;
  prometheus::Family<prometheus::Counter>& tensors_;
  prometheus::Family<prometheus::Gauge>& throughput_;
  prometheus::Family<prometheus::Gauge>& staging_in_use_;
  prometheus::Family<prometheus::Gauge>& reader_in_flight_;
  prometheus::Family<prometheus::Histogram>& read_seconds_;
  prometheus::Family<prometheus::Histogram>& copy_seconds_;
  prometheus::Family<prometheus::Counter>& prefetch_bytes_;
  prometheus::Family<prometheus::Counter>& read_path_bytes_;
  prometheus::Family<prometheus::Counter>& updates_;
  prometheus::Family<prometheus::Gauge>& update_seconds_;
  prometheus::Family<prometheus::Counter>& update_bytes_;
  prometheus::Family<prometheus::Counter>& errors_;
  prometheus::Family<prometheus::Counter>& remote_bytes_;
  prometheus::Family<prometheus::Gauge>& remote_rate_;
};

}  // namespace ferry::runtime
