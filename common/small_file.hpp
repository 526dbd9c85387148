// Reading the small files ferry takes metadata from (config.json,
// hf_quant_config.json, the safetensors index, ferry's own config file, an EPLB map,
// a bench experiment) with the rules weight files already get: a regular file once
// symbolic links are followed, its size known and capped, read in bounded time.
// Before, these were read with ifstream to the end: a link to /dev/zero grew memory
// without bound, and a FIFO blocked the open forever (hardening round two, item 2).
#pragma once

#include <cstdint>
#include <string>

#include "common/error.hpp"

namespace ferry {

// The default cap: far above any real config or index (a 1,000,000-tensor index is
// about 60 MB), far below what would hurt. The config key io.max_metadata_bytes
// sets it for a load; ferry's own config file is read with this default, since the
// key is not known before the file is read.
inline constexpr std::uint64_t kDefaultMaxMetadataBytes = std::uint64_t{64} << 20;

// The whole of the file at `path`. Opened O_RDONLY | O_NONBLOCK | O_NOCTTY |
// O_CLOEXEC (a FIFO's open returns at once instead of waiting for a writer); refused
// unless it is a regular file (symbolic links followed; checked with stat before the
// open, so device nodes are not even opened, and with fstat after it); refused when
// its size is above `max_bytes`; at most max_bytes + 1 bytes are read, so a file that
// grows while it is read is refused too rather than read without end. Every failure
// throws ferry::Error(stage) naming `display` (the path when empty), with `what` (how
// the message calls the file, e.g. "the config file") and, for the size, the size and
// the cap.
std::string read_small_file(const std::string& path, Stage stage, std::uint64_t max_bytes,
                            const std::string& what, const std::string& display = {});

}  // namespace ferry
