#include "common/error.hpp"

#include <cstring>

namespace ferry {

std::string_view to_string(Stage stage) {
  switch (stage) {
    case Stage::kConfig: return "config";
    case Stage::kDiscovery: return "discovery";
    case Stage::kHeader: return "header";
    case Stage::kIndex: return "index";
    case Stage::kRead: return "read";
    case Stage::kPrefetch: return "prefetch";
    case Stage::kStaging: return "staging";
    case Stage::kSynth: return "synth";
    case Stage::kMapping: return "mapping";
    case Stage::kPlacement: return "placement";
    case Stage::kCopy: return "copy";
    case Stage::kPostProcess: return "post-process";
    case Stage::kVerify: return "verify";
    case Stage::kCancelled: return "cancelled";
    case Stage::kResources: return "resources";
    case Stage::kOutput: return "output";
    case Stage::kCache:
      return "cache";
    case Stage::kRemote:
      return "remote";
  }
  return "unknown";
}

std::string format_error(Stage stage, std::string_view file, std::string_view tensor,
                         std::string_view rule) {
  std::string out(to_string(stage));
  out += ": ";
  if (!file.empty()) {
    out += file;
    out += ": ";
  }
  if (!tensor.empty()) {
    out += "tensor '";
    out += tensor;
    out += "': ";
  }
  out += rule;
  return out;
}

Error::Error(Stage stage, std::string file, std::string tensor, std::string rule)
    : std::runtime_error(format_error(stage, file, tensor, rule)),
      stage_(stage),
      file_(std::move(file)),
      tensor_(std::move(tensor)),
      rule_(std::move(rule)) {}

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (which may not be buf).
  return strerror_r(err, buf, sizeof buf);
}

void throw_errno(Stage stage, const std::string& file, const std::string& what, int err) {
  throw Error(stage, file, "", what + ": " + errno_text(err));
}

}  // namespace ferry
