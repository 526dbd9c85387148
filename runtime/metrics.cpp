#include "runtime/metrics.hpp"

#include <prometheus/text_serializer.h>

#include <utility>
#include <vector>

#include "common/format.hpp"

namespace ferry::runtime {
namespace {

// Latency buckets from 10 us to 10 s: a page-cache read of a few KiB up to a
// network read of a large window.
prometheus::Histogram::BucketBoundaries latency_buckets() {
  return {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10};
}

}  // namespace

LoadMetrics::LoadMetrics(std::shared_ptr<prometheus::Registry> registry)
    : registry_(std::move(registry)),
      load_seconds_(prometheus::BuildGauge()
                        .Name("ferry_load_seconds")
                        .Help("Seconds the last load took, from start to ready")
                        .Register(*registry_)),
      phase_seconds_(prometheus::BuildGauge()
                         .Name("ferry_load_phase_seconds")
                         .Help("Seconds of each phase of the last load (they add up to "
                               "ferry_load_seconds)")
                         .Register(*registry_)),
      bytes_read_(prometheus::BuildCounter()
                      .Name("ferry_bytes_read_total")
                      .Help("Bytes read from weight files (headers and tensor data)")
                      .Register(*registry_)),
      bytes_skipped_(prometheus::BuildCounter()
                         .Name("ferry_bytes_skipped_total")
                         .Help("Tensor bytes never read, by why")
                         .Register(*registry_)),
      bytes_copied_(prometheus::BuildCounter()
                        .Name("ferry_bytes_copied_total")
                        .Help("Bytes copied host-to-device, by device")
                        .Register(*registry_)),
      tensors_(prometheus::BuildCounter()
                   .Name("ferry_tensors_total")
                   .Help("Checkpoint tensors routed, by route (placed, dropped, unmapped)")
                   .Register(*registry_)),
      throughput_(prometheus::BuildGauge()
                      .Name("ferry_load_throughput_bytes_per_second")
                      .Help("Bytes read per second of the last load's stream phase")
                      .Register(*registry_)),
      staging_in_use_(prometheus::BuildGauge()
                          .Name("ferry_staging_buffers_in_use")
                          .Help("Staging buffers leased now")
                          .Register(*registry_)),
      reader_in_flight_(prometheus::BuildGauge()
                            .Name("ferry_reader_inflight")
                            .Help("Reads submitted and not yet completed")
                            .Register(*registry_)),
      read_seconds_(prometheus::BuildHistogram()
                        .Name("ferry_read_seconds")
                        .Help("Seconds from submitting a read to its completion")
                        .Register(*registry_)),
      copy_seconds_(prometheus::BuildHistogram()
                        .Name("ferry_copy_seconds")
                        .Help("Seconds a host-to-device copy call took, by device (CUDA: the "
                              "enqueue)")
                        .Register(*registry_)),
      prefetch_bytes_(prometheus::BuildCounter()
                          .Name("ferry_prefetch_bytes_total")
                          .Help("Bytes the page-cache prefetch read")
                          .Register(*registry_)),
      read_path_bytes_(prometheus::BuildCounter()
                           .Name("ferry_read_path_bytes_total")
                           .Help("Tensor bytes read, by path: direct_to_device (straight into "
                                 "parameters, not in ferry_bytes_copied_total) or staged")
                           .Register(*registry_)),
      updates_(prometheus::BuildCounter()
                   .Name("ferry_updates_total")
                   .Help("In-place updates (Runtime::update), by outcome: applied, rolled_back "
                         "(failed, old weights restored), invalid (failed, not restored) or "
                         "refused (nothing written)")
                   .Register(*registry_)),
      update_seconds_(prometheus::BuildGauge()
                          .Name("ferry_update_seconds")
                          .Help("Seconds the last applied update took")
                          .Register(*registry_)),
      update_bytes_(prometheus::BuildCounter()
                        .Name("ferry_update_bytes_total")
                        .Help("Parameter bytes applied updates wrote")
                        .Register(*registry_)),
      errors_(prometheus::BuildCounter()
                  .Name("ferry_load_errors_total")
                  .Help("Loads that failed, by the stage of the error")
                  .Register(*registry_)),
      remote_bytes_(
          prometheus::BuildCounter()
              .Name("ferry_remote_bytes_pulled_total")
              .Help("Bytes pulled from a seed over UCX (model.load_format remote_instance)")
              .Register(*registry_)),
      remote_rate_(prometheus::BuildGauge()
                       .Name("ferry_remote_pull_bytes_per_second")
                       .Help("Bytes per second of the last pull from a seed")
                       .Register(*registry_)) {
  // Present from the start, so a scrape before the first load sees them.
  staging_in_use_.Add({}).Set(0);
  reader_in_flight_.Add({}).Set(0);
  // Every stage at 0, so rate() over errors works before the first one.
  for (int stage = 0; stage <= static_cast<int>(Stage::kCache); ++stage) {  // kCache: the last
    errors_.Add({{"stage", std::string(to_string(static_cast<Stage>(stage)))}});
  }
}

io::ReadObserver LoadMetrics::read_observer() {
  io::ReadObserver o;
  prometheus::Gauge* in_flight = &reader_in_flight_.Add({});
  prometheus::Histogram* latency = &read_seconds_.Add({}, latency_buckets());
  o.on_in_flight = [in_flight](std::size_t n) { in_flight->Set(static_cast<double>(n)); };
  o.on_read = [latency](const io::ReadOp&, std::chrono::steady_clock::time_point submitted,
                        std::chrono::steady_clock::time_point completed, bool failed) {
    if (!failed) {
      latency->Observe(std::chrono::duration<double>(completed - submitted).count());
    }
  };
  return o;
}

gpu::CopyObserver LoadMetrics::copy_observer() {
  gpu::CopyObserver o;
  o.on_op = [this](const gpu::DeviceOp& op) {
    if (op.op == "copy") {
      bytes_copied_.Add({{"device", *op.device}}).Increment(static_cast<double>(op.bytes));
      copy_seconds_.Add({{"device", *op.device}}, latency_buckets()).Observe(op.seconds());
    }
  };
  return o;
}

std::function<void(std::size_t)> LoadMetrics::staging_observer() {
  prometheus::Gauge* gauge = &staging_in_use_.Add({});
  return [gauge](std::size_t in_use) { gauge->Set(static_cast<double>(in_use)); };
}

void LoadMetrics::record_load(const LoadReport& r, const std::string& model) {
  const prometheus::Labels labels{{"model", model}, {"startup_mode", r.startup_mode}};
  const double total =
      r.startup_mode == "load" ? r.seconds : r.startup.time_to_ready;  // start .. ready
  load_seconds_.Add(labels).Set(total);
  const std::vector<std::pair<const char*, double>> phases = {
      {"resolve", r.phases.resolve},         {"plan", r.phases.plan},
      {"allocate", r.phases.allocate},       {"stream", r.phases.stream},
      {"postprocess", r.phases.postprocess}, {"verify", r.phases.verify}};
  double sum = 0;
  for (const auto& [phase, seconds] : phases) {
    prometheus::Labels l = labels;
    l["phase"] = phase;
    phase_seconds_.Add(l).Set(seconds);
    sum += seconds;
  }
  if (r.startup_mode != "load") {
    // prepare()/commit(): what is not a load phase (the sentinel, the engine's
    // capture, the final checks) makes the phases add up to the total.
    prometheus::Labels l = labels;
    l["phase"] = "startup_other";
    phase_seconds_.Add(l).Set(total > sum ? total - sum : 0);
  }
  bytes_read_.Add({{"model", model}}).Increment(static_cast<double>(r.bytes_read));
  for (const auto& [reason, bytes] : r.bytes_skipped_by_reason) {
    bytes_skipped_.Add({{"model", model}, {"reason", reason}})
        .Increment(static_cast<double>(bytes));
  }
  tensors_.Add({{"model", model}, {"route", "placed"}})
      .Increment(static_cast<double>(r.tensors.placed));
  tensors_.Add({{"model", model}, {"route", "dropped"}})
      .Increment(static_cast<double>(r.tensors.dropped));
  tensors_.Add({{"model", model}, {"route", "unmapped"}})
      .Increment(static_cast<double>(r.tensors.unmapped));
  throughput_.Add({{"model", model}}).Set(r.gbps * 1e9);
  prefetch_bytes_.Add({{"model", model}}).Increment(static_cast<double>(r.bytes_prefetched));
  read_path_bytes_.Add({{"model", model}, {"path", "direct_to_device"}})
      .Increment(static_cast<double>(r.read_paths.direct_to_device));
  read_path_bytes_.Add({{"model", model}, {"path", "staged"}})
      .Increment(static_cast<double>(r.read_paths.staged));
  if (r.remote.pulled) {
    remote_bytes_.Add({{"model", model}, {"seed", r.remote.seed}})
        .Increment(static_cast<double>(r.remote.bytes));
    remote_rate_.Add({{"model", model}, {"seed", r.remote.seed}}).Set(r.remote.gbps * 1e9);
  }
}

void LoadMetrics::record_update(const std::string& outcome, const LoadReport* report) {
  updates_.Add({{"outcome", outcome}}).Increment();
  if (report != nullptr) {
    update_seconds_.Add({}).Set(report->seconds);
    update_bytes_.Add({}).Increment(static_cast<double>(report->update.bytes_written));
  }
}

void LoadMetrics::record_error(Stage stage) {
  errors_.Add({{"stage", std::string(to_string(stage))}}).Increment();
}

std::string LoadMetrics::text() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

void LoadMetrics::write_textfile(const std::string& path) const {
  write_file_replacing(path, text(), "metrics.textfile");
}

}  // namespace ferry::runtime
