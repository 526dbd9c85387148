// The load report: its JSON form (`ferry load --report FILE`) and the few human
// lines the CLI prints.
#include <cstdio>
#include <string>

#include "common/format.hpp"
#include "runtime/runtime.hpp"

namespace ferry::runtime {
nlohmann::json LoadReport::to_json() const {
  nlohmann::json refusals = nlohmann::json::array();
  for (const StartupRefusal& r : startup_refusals) {
    refusals.push_back({{"code", r.code}, {"message", r.message}});
  }
  return nlohmann::json{
      {"bytes_read", bytes_read},
      {"bytes_skipped", bytes_skipped},
      {"bytes_skipped_by_reason", bytes_skipped_by_reason},
      {"bytes_copied", bytes_copied},
      {"bytes_prefetched", bytes_prefetched},
      {"seconds", seconds},
      {"phases",
       {{"resolve", phases.resolve},
        {"plan", phases.plan},
        {"allocate", phases.allocate},
        {"stream", phases.stream},
        {"postprocess", phases.postprocess},
        {"verify", phases.verify}}},
      {"gbps", gbps},
      {"peak_rss_bytes", peak_rss_bytes},
      {"host_bytes_owned", host_bytes_owned},
      {"host_bytes_owned_by", host_bytes_owned_by},
      {"staging_high_water_bytes", staging_high_water_bytes},
      {"staging_bytes", staging_bytes},
      {"read_lanes", read_lanes},
      {"read_paths",
       {{"direct_to_device", read_paths.direct_to_device}, {"staged", read_paths.staged}}},
      {"files", files},
      {"tensors",
       {{"placed", tensors.placed}, {"dropped", tensors.dropped}, {"unmapped", tensors.unmapped}}},
      {"warnings", warnings},
      {"hooks_skipped", hooks_skipped},
      {"startup_mode", startup_mode},
      {"startup_refusals", refusals},
      {"startup",
       {{"prepare", startup.prepare},
        {"sentinel", startup.sentinel},
        {"capture", startup.capture},
        {"commit", startup.commit},
        {"time_to_ready", startup.time_to_ready},
        {"bytes_prefetched", startup.bytes_prefetched}}},
  };
}

std::string LoadReport::summary() const {
  std::string s;
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
  if (!hooks_skipped.empty()) {
    s += "post-load hooks skipped (their devices keep no data): " +
         std::to_string(hooks_skipped.size()) + "\n";
  }
  if (startup_mode != "load") {
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
