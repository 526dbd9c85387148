// ferry's error type. Inside the library, failures are thrown as ferry::Error and
// caught at the edges (the CLI's main, later the Runtime API), so nothing throws
// across the embedding API. Every error names the stage that failed, the file and
// the tensor when there is one, and the rule that was broken.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "ferry/export.hpp"

namespace ferry {

// The stage of a load that failed: the troubleshooting vocabulary of the field.
enum class Stage {
  kConfig,
  kDiscovery,
  kHeader,
  kIndex,
  kRead,
  kPrefetch,
  kStaging,
  kSynth,
  kMapping,
  kPlacement,
  kCopy,
  kPostProcess,
  kVerify,
  kCancelled,
  // The process could not get what the load needs from the system: a thread that
  // could not be started (EAGAIN under RLIMIT_AS, RLIMIT_NPROC or threads-max), or
  // more weight files than the hard RLIMIT_NOFILE lets it hold open.
  kResources,
  // Writing a file the caller asked for after the load (the report, the trace, the
  // metrics textfile, a dump): the load itself may have succeeded. Appended, so that the
  // values above keep their numbers.
  kOutput,
  // The weight cache (`ferry serve` and model.load_format ipc_cache): its registry,
  // its socket, its protocol, or a daemon that does not hold what the load needs.
  kCache,
  // remote_instance: a seed's control port (`ferry serve --remote`), its
  // authentication, its table, or the UCX transfer that pulls its parameters.
  kRemote,
};

FERRY_API std::string_view to_string(Stage stage);

class FERRY_API Error : public std::runtime_error {
 public:
  // `file` and `tensor` may be empty; `rule` says what was expected.
  Error(Stage stage, std::string file, std::string tensor, std::string rule);

  Stage stage() const { return stage_; }
  const std::string& file() const { return file_; }
  const std::string& tensor() const { return tensor_; }
  const std::string& rule() const { return rule_; }

 private:
  Stage stage_;
  std::string file_;
  std::string tensor_;
  std::string rule_;
};

// Formats "stage: file: tensor 'name': rule" leaving out the empty parts.
FERRY_API std::string format_error(Stage stage, std::string_view file, std::string_view tensor,
                                   std::string_view rule);

// strerror(err), thread-safe (strerror_r): "No such file or directory".
FERRY_API std::string errno_text(int err);

// Throws an Error whose rule ends with strerror(err).
[[noreturn]] FERRY_API void throw_errno(Stage stage, const std::string& file,
                                        const std::string& what, int err);

}  // namespace ferry
