// The load report: its JSON form (`ferry load --report FILE`) and the few human
// lines the CLI prints.
#include <cstdio>
#include <string>

#include "common/format.hpp"
#include "runtime/api_internal.hpp"

namespace ferry::runtime {
nlohmann::json to_json(const LoadReport& r) {
  nlohmann::json refusals = nlohmann::json::array();
  for (const StartupRefusal& x : r.startup_refusals) {
    refusals.push_back({{"code", x.code}, {"message", x.message}});
  }
  nlohmann::json j{
      {"bytes_read", r.bytes_read},
      {"bytes_skipped", r.bytes_skipped},
      {"bytes_skipped_by_reason", r.bytes_skipped_by_reason},
      {"bytes_copied", r.bytes_copied},
      {"bytes_prefetched", r.bytes_prefetched},
      {"seconds", r.seconds},
      {"phases",
       {{"resolve", r.phases.resolve},
        {"plan", r.phases.plan},
        {"allocate", r.phases.allocate},
        {"stream", r.phases.stream},
        {"postprocess", r.phases.postprocess},
        {"verify", r.phases.verify}}},
      {"gbps", r.gbps},
      {"peak_rss_bytes", r.peak_rss_bytes},
      {"host_bytes_owned", r.host_bytes_owned},
      {"host_bytes_owned_by", r.host_bytes_owned_by},
      {"staging_high_water_bytes", r.staging_high_water_bytes},
      {"staging_bytes", r.staging_bytes},
      {"read_lanes", r.read_lanes},
      {"read_paths",
       {{"direct_to_device", r.read_paths.direct_to_device}, {"staged", r.read_paths.staged}}},
      {"files", r.files},
      {"tensors",
       {{"placed", r.tensors.placed},
        {"dropped", r.tensors.dropped},
        {"unmapped", r.tensors.unmapped}}},
      {"warnings", r.warnings},
      {"hooks_skipped", r.hooks_skipped},
      {"load_format", r.load_format},
      {"postprocess_target", r.postprocess_target},
      {"presharded",
       {{"read", r.presharded_read},
        {"checksums_verified", r.checksums_verified},
        {"saved", r.presharded_saved}}},
      {"sharded_state", {{"read", r.sharded_state_read}, {"saved", r.sharded_state_saved}}},
      {"peak_device_bytes", r.peak_device_bytes},
      {"startup_mode", r.startup_mode},
      {"startup_refusals", refusals},
      {"startup",
       {{"prepare", r.startup.prepare},
        {"sentinel", r.startup.sentinel},
        {"capture", r.startup.capture},
        {"commit", r.startup.commit},
        {"time_to_ready", r.startup.time_to_ready},
        {"bytes_prefetched", r.startup.bytes_prefetched}}},
  };
  if (r.cache.mode != "off") {
    j["cache"] = {{"mode", r.cache.mode},
                  {"attached", r.cache.attached},
                  {"socket", r.cache.socket},
                  {"fingerprint", r.cache.fingerprint},
                  {"daemon_pid", r.cache.daemon_pid},
                  {"fallback", r.cache.fallback},
                  {"storages", r.cache.storages},
                  {"bytes_mapped", r.cache.bytes_mapped}};
  }
  if (!r.remote.seed.empty()) {
    j["remote"] = {{"seed", r.remote.seed},
                   {"pulled", r.remote.pulled},
                   {"fingerprint", r.remote.fingerprint},
                   {"transports", r.remote.transports},
                   {"bytes", r.remote.bytes},
                   {"params", r.remote.params},
                   {"seconds", r.remote.seconds},
                   {"gbps", r.remote.gbps},
                   {"staged", r.remote.staged},
                   {"fallback", r.remote.fallback}};
  }
  if (r.update.ran) {
    j["update"] = {{"source", r.update.source},
                   {"params_written", r.update.params_written},
                   {"params_unchanged", r.update.params_unchanged},
                   {"bytes_written", r.update.bytes_written},
                   {"hooks_rerun", r.update.hooks_rerun},
                   {"rollback", r.update.rollback},
                   {"snapshot_bytes", r.update.snapshot_bytes}};
  }
  return j;
}

std::string LoadReport::json(int indent) const {
  return to_json(*this).dump(indent);
}

std::string LoadReport::summary() const {
  std::string s;
  if (load_format == "dummy") {
    s += "dummy load: every parameter filled with deterministic random values (nothing read)\n";
  }
  if (!presharded_read.empty()) {
    s += "presharded: read " + presharded_read +
         (checksums_verified ? " (every param's XXH3-128 checked)" : "") + "\n";
  }
  if (!presharded_saved.empty()) {
    s += "presharded: saved " + presharded_saved + "\n";
  }
  if (!sharded_state_read.empty()) {
    s += "sharded_state: read " + sharded_state_read + "\n";
  }
  if (!sharded_state_saved.empty()) {
    s += "sharded_state: saved " + sharded_state_saved + "\n";
  }
  s += "loaded " + std::to_string(tensors.placed) + " tensors from " + std::to_string(files) +
       " file(s) in " + fixed(seconds, 3) + " s (" + std::to_string(tensors.dropped) +
       " dropped, " + std::to_string(tensors.unmapped) + " unmapped)\n";
  s += "read " + human_bytes(bytes_read) + " at " + fixed(gbps, 2) + " GB/s, skipped " +
       human_bytes(bytes_skipped) + ", copied " + human_bytes(bytes_copied) + " to devices";
  if (bytes_prefetched > 0) {
    s += ", prefetched " + human_bytes(bytes_prefetched);
  }
  s += "\n";
  s += "phases: resolve " + fixed(phases.resolve, 3) + " s, plan " + fixed(phases.plan, 3) +
       " s, allocate " + fixed(phases.allocate, 3) + " s, stream " + fixed(phases.stream, 3) +
       " s, postprocess " + fixed(phases.postprocess, 3) + " s, verify " + fixed(phases.verify, 3) +
       " s\n";
  s += "reads: " + std::to_string(read_lanes) + " lane(s), " +
       human_bytes(read_paths.direct_to_device) + " straight into parameters, " +
       human_bytes(read_paths.staged) + " through staging\n";
  s += "host memory: staging " + human_bytes(staging_bytes) + ", high water " +
       human_bytes(staging_high_water_bytes) + ", peak RSS " + human_bytes(peak_rss_bytes) + "\n";
  if (!peak_device_bytes.empty()) {
    std::string peaks;
    for (const auto& [device, bytes] : peak_device_bytes) {
      peaks += (peaks.empty() ? "" : ", ") + device + " " + human_bytes(bytes);
    }
    s += "device memory peak: " + peaks + "\n";
  }
  if (!hooks_skipped.empty()) {
    s += "post-load hooks skipped (their devices keep no data): " +
         std::to_string(hooks_skipped.size()) + "\n";
  }
  if (cache.attached) {
    s += "attached to weight-cache daemon pid " + std::to_string(cache.daemon_pid) + " (" +
         cache.socket + "): " + std::to_string(cache.storages) + " shared block(s), " +
         human_bytes(cache.bytes_mapped) + " mapped\n";
  } else if (!cache.fallback.empty()) {
    s += "no weight-cache daemon: read from disk (" + cache.fallback + ")\n";
  }
  if (remote.pulled) {
    s += "pulled from seed " + remote.seed + ": " + std::to_string(remote.params) + " param(s), " +
         human_bytes(remote.bytes) + " in " + fixed(remote.seconds, 2) + " s (" +
         fixed(remote.gbps, 2) + " GB/s, UCX " + remote.transports +
         (remote.staged ? ", staged through host memory" : "") + ")\n";
  } else if (!remote.fallback.empty()) {
    s += "seed unreachable: read from disk (" + remote.fallback + ")\n";
  }
  if (update.ran) {
    s += "update from " + update.source + ": " + std::to_string(update.params_written) +
         " param(s) written (" + human_bytes(update.bytes_written) + "), " +
         std::to_string(update.params_unchanged) + " unchanged, " +
         std::to_string(update.hooks_rerun.size()) + " hook(s) run again; rollback " +
         update.rollback +
         (update.snapshot_bytes > 0 ? " (" + human_bytes(update.snapshot_bytes) + ")" : "") + "\n";
  }
  if (startup_mode != "load" && startup_mode != "update") {
    s += "startup " + startup_mode + ": ready " + fixed(startup.time_to_ready, 3) +
         " s after prepare() (prepare " + fixed(startup.prepare, 3) + " s, capture " +
         fixed(startup.capture, 3) + " s, commit " + fixed(startup.commit, 3) + " s)\n";
  }
  for (const StartupRefusal& r : startup_refusals) {
    s += "startup overlap refused: " + r.code + ": " + r.message + "\n";
  }
  for (const std::string& w : warnings) {
    s += "warning: " + w + "\n";
  }
  return s;
}

}  // namespace ferry::runtime
