// PyTorch checkpoints (`*.bin`, `*.pt`) as an index of byte ranges, like a
// safetensors header, without executing their pickle. A torch.save file since
// PyTorch 1.6 is a zip archive (io/zip_archive.hpp) of stored members:
// `<archive>/data.pkl`, the state dict pickled with every storage a persistent id,
// and `<archive>/data/<key>`, each storage's raw little-endian bytes. The pickle is
// read by io/pickle.hpp; each tensor is then the range of its storage member that
// its offset, shape and dtype cover. From there on the load is a safetensors load.
#pragma once

#include <cstdint>
#include <string>

#include "io/file.hpp"
#include "io/safetensors.hpp"
#include "io/zip_archive.hpp"

namespace ferry::io {

// The tensors of the torch.save archive `read` reads (`file_size` bytes), as a
// SafetensorsHeader (sorted by offset; header_bytes is what was read to learn
// them; no metadata). Throws ferry::Error(Stage::kHeader) naming `display` (and
// the tensor) for everything io/zip_archive.hpp and io/pickle.hpp refuse, and for:
// the legacy pre-1.6 format (a bare pickle stream) or anything else that is not a
// zip; no single `<archive>/data.pkl`; a compressed member; byteorder other than
// "little"; a data.pkl larger than `max_pickle_bytes`; a storage member that is
// missing or whose size is not what the pickle says; a dtype ferry has not; a
// tensor past its storage; strides that are not the contiguous row-major ones
// (size-1 dimensions excepted); two tensors whose bytes overlap unless they are the
// very same view (same offset, dtype and shape: tied weights, kept as two names of
// one range).
SafetensorsHeader parse_torch_checkpoint(const ReadAt& read, std::uint64_t file_size,
                                         const std::string& display,
                                         std::uint64_t max_pickle_bytes);
// The same over an open file, with its identity.
SafetensorsHeader read_torch_checkpoint(const File& file, std::uint64_t max_pickle_bytes);

}  // namespace ferry::io
