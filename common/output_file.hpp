// OutputFile: how ferry writes every file it produces (the trace, the metrics
// textfile, the report, the dump, bench results, synthetic checkpoints), so that
// whatever stands at the path is treated by its kind and never clobbered:
//
//   absent or a regular file   written to a fresh temporary beside it (created with
//                              O_EXCL, never through a link) that commit() renames over
//                              it: a reader never sees half a file, and a failed write
//                              (a full disk) leaves the old file, or none, and no
//                              temporary. A replaced file keeps its mode.
//   a symlink                  followed, every hop (a relative target against the
//                              link's folder), and its final target replaced as above,
//                              the temporary beside the target; the link itself stays.
//   a FIFO or a character      written in place: never truncated, renamed or removed
//   device                     (`--report /dev/stdout`, `--trace >(gzip >t.gz)`,
//                              /dev/null), also through links the kernel follows
//                              (a pipe at /proc/PID/fd/N). A FIFO with no reader is refused rather than
//                              waited for, and a reader that goes away gives an error
//                              (EPIPE), not SIGPIPE.
//   /dev/stdout, /dev/stderr,  this process's descriptor N, written where it stands
//   /dev/fd/N, /proc/self/fd/N (`--report /dev/stdout >out.txt` adds to out.txt).
//   anything else              refused (a folder, a block device, a socket).
//
// Not thread-safe. Every failure throws ferry::Error(stage, path, "", "WHAT: cannot
// write: ...") where WHAT names the setting (e.g. "trace.path"; left out when empty),
// after closing the file and removing the temporary.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "common/error.hpp"

namespace ferry {

class OutputFile {
 public:
  // Resolves `path` and opens the temporary (or the FIFO / device) for writing.
  OutputFile(std::string path, Stage stage, std::string what);
  // Not committed: closes and removes the temporary; the target is left as it was.
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  // Appends all of `bytes` (short writes and EINTR are retried).
  void write(std::span<const std::byte> bytes);
  void write(std::string_view text);
  // fsync(2): the bytes are on disk before commit() renames them into place.
  void sync();
  // Closes and renames the temporary over the target (in place: closes).
  void commit();

  // The path as given, and the file written after following symlinks.
  const std::string& path() const { return path_; }
  const std::string& target() const { return target_; }
  // True for a FIFO or a character device, written where it stands.
  bool in_place() const { return in_place_; }

 private:
  [[noreturn]] void fail(const std::string& detail, int err = 0);
  void abandon() noexcept;

  std::string path_;
  Stage stage_;
  std::string what_;
  std::string target_;
  std::string tmp_;  // empty when written in place
  int fd_ = -1;
  bool in_place_ = false;
  bool committed_ = false;
};

// fsync(2) of the folder `dir`, so that the names of what was written in it are on
// disk too (after OutputFile::commit renamed a file into it, or a rename of the
// folder's own entries). Throws Error(stage, dir, "", "WHAT: cannot sync the folder: ...").
void sync_folder(const std::string& dir, Stage stage, std::string_view what);

}  // namespace ferry
