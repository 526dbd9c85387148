// The open-file limit (RLIMIT_NOFILE) against the descriptors a load keeps: one per
// weight file from the moment its header is read (io::CheckpointFile::file), so
// that a shard renamed over later still loads the file its header came from. A
// checkpoint of thousands of shards needs more than the usual soft limit of 1024:
// the runtime raises the soft limit at the start of its first load, and
// build_checkpoint_index makes room for its files, or fails before opening one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ferry::io {

struct OpenFileLimit {
  std::uint64_t soft = 0;
  std::uint64_t hard = 0;
};

// getrlimit(RLIMIT_NOFILE) now (RLIM_INFINITY as UINT64_MAX).
OpenFileLimit open_file_limit();

// Descriptors open in this process now (the entries of /proc/self/fd).
std::size_t open_descriptors();

// Descriptors a load holds beside one per weight file: the read lanes' rings, an
// O_DIRECT second descriptor per file being read, the prefetch threads' files, the
// actor system's and the metrics endpoint's. An allowance, not a count.
inline constexpr std::uint64_t kLoadDescriptorReserve = 64;

// The most raise_open_file_limit() raises the soft limit to: some containers give a
// hard limit of a billion, and programs that close every possible descriptor
// before exec (ferry's children, an engine's) crawl under such a soft limit.
inline constexpr std::uint64_t kSoftLimitCeiling = std::uint64_t{1} << 20;

// Raises the soft limit to the hard limit (at most kSoftLimitCeiling), as many
// servers do at start, once per process: later calls do nothing. Logs the old and
// new soft limits at info (at warn when the kernel refuses). Never throws.
void raise_open_file_limit();

// Makes room for `files` descriptors kept at once, on top of those open now and
// kLoadDescriptorReserve: raises the soft limit when that fits under the hard limit
// (logged at info). Throws ferry::Error(Stage::kDiscovery, folder) naming the hard
// limit and the count needed when it does not.
void reserve_descriptors(std::size_t files, const std::string& folder);

}  // namespace ferry::io
