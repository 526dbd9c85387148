// The safetensors format: header parsing and validation with the reference
// implementation's rules, the sharded index file, and the CheckpointIndex that
// maps every tensor of a checkpoint to its file, dtype, shape and byte range.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/dtype.hpp"
#include "common/ggml_blocks.hpp"
#include "common/small_file.hpp"
#include "io/discover.hpp"
#include "io/file.hpp"
#include "io/name_table.hpp"

namespace ferry::io {

inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::uint64_t> shape;
  std::string file;              // the file's name as shown to the user
  std::uint32_t file_index = 0;  // index into CheckpointIndex::files (0 for one header)
  std::uint64_t offset = 0;      // absolute byte offset of the data in the file
  std::uint64_t nbytes = 0;
  // Not 0: the rows (shape[0]) are stored in llama.cpp's rope order within each of
  // this many heads (convert_hf_to_gguf.py LlamaModel.permute: GGUF row h*d + 2j + k
  // holds row h*d + k*d/2 + j, d the rows per head); placement reads them back in
  // the Hugging Face order (models/row_order.hpp). GGUF's llama attn_q / attn_k.
  std::uint32_t interleaved_heads = 0;
  // Not kNone: the data is GGML blocks of this format (a quantized GGUF tensor read
  // with gguf.dequantize), `dtype` is F32, the type each element dequantizes to, and
  // nbytes counts the blocks. Placement cuts only whole blocks (models/row_order.hpp)
  // and the copy dequantizes on the device (gpu::Stream::dequantize_ggml_2d).
  GgmlBlocks blocks = GgmlBlocks::kNone;

  std::uint64_t elements() const;
};

struct SafetensorsHeader {
  std::string file;  // display name
  std::uint64_t file_size = 0;
  std::uint64_t header_bytes = 0;  // 8 + JSON length: where the data region starts
  std::map<std::string, std::string> metadata;
  std::vector<TensorInfo> tensors;  // sorted by offset
  FileIdentity identity;            // of the file read (read_safetensors_header)
};

// Validates a header's JSON text for a file of `file_size` bytes whose JSON is
// `json.size()` bytes long. Throws ferry::Error(Stage::kHeader) naming `display`,
// the tensor when there is one, and the rule broken.
SafetensorsHeader parse_safetensors_header(std::string_view json, std::uint64_t file_size,
                                           const std::string& display);

// Reads (8 + n bytes with pread) and validates the header of the file at `path`.
SafetensorsHeader read_safetensors_header(const std::string& path, const std::string& display);
// The same from a file already open (its display name in errors); the header's
// identity is the file's as of its open().
SafetensorsHeader read_safetensors_header(const File& file);

// model.safetensors.index.json (or consolidated.safetensors.index.json).
struct WeightIndex {
  std::string file;                               // display name
  std::map<std::string, std::string> weight_map;  // tensor -> shard name
  std::optional<std::uint64_t> total_size;        // metadata.total_size when present
};

// Throws ferry::Error(Stage::kIndex) naming the file when it does not parse, is not an
// object, has no `weight_map` object, or maps a tensor to something not a string.
WeightIndex parse_weight_index(std::string_view json, const std::string& display);
// Reads the index through read_small_file: a regular file of at most `max_bytes`
// (io.max_metadata_bytes), else ferry::Error(Stage::kIndex) naming it.
WeightIndex read_weight_index(const std::string& path, const std::string& display,
                              std::uint64_t max_bytes = kDefaultMaxMetadataBytes);

struct CheckpointFile {
  std::string path;
  std::string name;  // relative to the folder
  std::string reason;
  std::uint64_t size = 0;
  std::uint64_t header_bytes = 0;
  std::size_t tensor_count = 0;
  std::map<std::string, std::string> metadata;
  // The file its header was read from: the reader refuses a file that is no longer
  // it (rewritten or truncated) before reading a byte with the old offsets.
  FileIdentity identity;
  // The descriptor that header was read from, kept open for as long as the index
  // lives (build_checkpoint_index opens it), so the load reads that very file even
  // when its path is renamed over later. Null for an index made by hand: readers
  // then open `path` and compare identities. The runtime lets go of it, once
  // planned, for the files its plan reads nothing of.
  std::shared_ptr<const File> file;
};

// Every tensor of a checkpoint, validated across files.
struct CheckpointIndex {
  std::vector<CheckpointFile> files;
  // A GGUF file's metadata as a Hugging Face config.json (io/gguf_config.hpp), for a
  // folder that has no config.json; null for the other formats.
  std::shared_ptr<const nlohmann::json> embedded_config;
  std::vector<TensorInfo> tensors;  // file order, then offset order
  std::vector<std::string> warnings;
  std::uint64_t total_bytes = 0;  // sum of tensor data bytes
  std::uint64_t header_bytes_read = 0;

  const TensorInfo* find(std::string_view name) const;
  // Adds tensors[position] to the names find() knows. When a tensor of that name is
  // there already, adds nothing and returns that one's position. An index made by
  // hand calls this for each tensor it pushes.
  std::optional<std::size_t> add_name(std::size_t position);

  // Positions in `tensors` by name; the names stay in the tensors (io/name_table.hpp).
  NameTable by_name;

  // Host memory this index holds, as ferry counts it: the vectors' capacity, every
  // string's heap bytes (short names live inside the string), the name table's
  // slots. An estimate from the containers' sizes, not from the allocator, so that
  // it means the same inside any process.
  std::uint64_t bytes_owned() const;
};

struct IndexOptions {
  bool strict = false;  // a tensor the index does not list is an error, not a warning
  // io.max_metadata_bytes: the cap on the index, when discovery did not read it.
  std::uint64_t max_metadata_bytes = kDefaultMaxMetadataBytes;
  // The same tensor name may be in two files, each file being one rank's state
  // (sharded_state: every rank stores its own model.norm.weight); find() then gives
  // the first. Off: such a pair is an error (one checkpoint's shards).
  bool names_per_file = false;
  // gguf.dequantize: quantized GGML tensors are indexed as blocks to dequantize on the
  // device (TensorInfo::blocks). Off: they are refused by name.
  bool gguf_dequantize = true;
};

// Reads every chosen file's header and cross-checks them with the index. Errors
// (Stage::kHeader / kIndex) name the files and tensors involved. torch.save files
// (FileFormat::kPickle) are indexed by io/torch_checkpoint.hpp, never executed.
CheckpointIndex build_checkpoint_index(const ResolvedSource& source,
                                       const IndexOptions& options = {});

}  // namespace ferry::io
