// The GGUF format (llama.cpp's single-file checkpoints): the header's typed
// metadata and tensor infos, parsed and validated so that each tensor becomes a
// byte range of the file (name, ggml type, absolute offset, nbytes), as a
// safetensors header's entries do (io/safetensors.hpp). A pure library: which file
// is GGUF, and what a load does with its tensors, is decided elsewhere.
//
// Layout (little-endian; versions 2 and 3 are the same bytes, 3 added big-endian
// files, which ferry refuses):
//   "GGUF" u32 version, u64 tensor_count, u64 kv_count,
//   kv_count x (string key, u32 value type, value),
//   tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset),
//   padding to general.alignment (u32, a power of two, 32 when absent), tensor data.
// A string is a u64 length and that many bytes (no terminator); an array is a u32
// element type, a u64 count and the elements.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/small_file.hpp"
#include "io/file.hpp"
#include "io/gguf_types.hpp"
#include "io/safetensors.hpp"

namespace ferry::io {

enum class GgufValueType : std::uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

// "u32", "string", "array": how errors and dumps name a value type.
std::string_view gguf_value_type_name(GgufValueType type);

// One metadata value. Scalars are widened into one field per kind (unsigned,
// signed, floating, text) with `type` saying which the file held. An array keeps
// its element type and count always, and its elements only when it is short
// (GgufParseOptions::max_kept_array), so a tokenizer's 128,000 tokens cost nothing.
struct GgufValue {
  GgufValueType type = GgufValueType::kU8;
  std::uint64_t u = 0;  // kU8, kU16, kU32, kU64, kBool (0 or 1)
  std::int64_t i = 0;   // kI8, kI16, kI32, kI64
  double f = 0;         // kF32 (exactly), kF64
  std::string s;        // kString: the bytes as stored (GGUF says UTF-8; not checked)

  GgufValueType element_type = GgufValueType::kU8;  // kArray
  std::uint64_t count = 0;                          // kArray: elements in the file
  bool kept = false;                                // kArray: `elements` holds them all
  std::vector<GgufValue> elements;

  bool is_array() const { return type == GgufValueType::kArray; }
  // An unsigned integer: any integer type holding a value >= 0 (a bool is not one).
  std::optional<std::uint64_t> as_uint() const;
  // A number: any integer or float type, as a double.
  std::optional<double> as_double() const;
  std::optional<bool> as_bool() const;
  std::optional<std::string_view> as_string() const;
  // "u32 4096", "string \"llama\"", "array of 128256 string": for messages and dumps
  // (strings cut to 60 bytes, arrays never listed).
  std::string describe() const;

  // Builders, for the writer and tests.
  static GgufValue of_u32(std::uint32_t v) { return of_uint(GgufValueType::kU32, v); }
  static GgufValue of_u64(std::uint64_t v) { return of_uint(GgufValueType::kU64, v); }
  static GgufValue of_i32(std::int32_t v) { return of_int(GgufValueType::kI32, v); }
  // kU8, kU16, kU32 or kU64 (the writer refuses a value the type cannot hold).
  static GgufValue of_uint(GgufValueType type, std::uint64_t v);
  // kI8, kI16, kI32 or kI64.
  static GgufValue of_int(GgufValueType type, std::int64_t v);
  static GgufValue of_f32(float v);
  static GgufValue of_f64(double v);
  static GgufValue of_bool(bool v);
  static GgufValue of_string(std::string v);
  // An array of `elements`, each of `element_type` (an array of arrays when kArray).
  static GgufValue array(GgufValueType element_type, std::vector<GgufValue> elements);
};

struct GgufTensorInfo {
  std::string name;
  // ggml order: dims[0] is the fastest-varying, the length of a row. A torch or
  // Hugging Face tensor of the same data has shape() (dims reversed).
  std::vector<std::uint64_t> dims;
  GgmlType type = GgmlType::kF32;
  std::uint64_t relative_offset = 0;  // as stored: from the start of the data section
  std::uint64_t offset = 0;           // absolute byte offset of the data in the file
  std::uint64_t nbytes = 0;

  std::uint64_t elements() const;
  std::vector<std::uint64_t> shape() const;  // dims reversed (row-major)
  std::uint64_t rows() const;                // elements / dims[0]
  std::uint64_t row_bytes() const { return nbytes / rows(); }
};

struct GgufHeader {
  std::string file;  // display name
  std::uint64_t file_size = 0;
  std::uint32_t version = 0;
  std::uint64_t alignment = 32;
  std::uint64_t header_bytes = 0;  // where the tensor infos end
  std::uint64_t data_offset = 0;   // header_bytes rounded up to the alignment
  std::map<std::string, GgufValue, std::less<>> metadata;
  std::vector<GgufTensorInfo> tensors;  // sorted by offset
  FileIdentity identity;                // of the file read (read_gguf_header)

  const GgufValue* find(std::string_view key) const;
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  // general.architecture, or empty when absent or not a string.
  std::string architecture() const;
};

struct GgufParseOptions {
  // io.max_metadata_bytes: the key/values and tensor infos together (everything
  // before the data section) may not be longer. A real Llama-3 GGUF holds ~30 MB
  // of tokenizer arrays there; a header past the cap is refused as soon as the
  // cursor crosses it, before its arrays are walked.
  std::uint64_t max_metadata_bytes = kDefaultMaxMetadataBytes;
  // Arrays of at most this many elements keep their elements (rope sections,
  // per-layer head counts); longer ones keep type and count, their bytes skipped.
  std::uint64_t max_kept_array = 64;
  // Elements kept over all arrays of the header: what bounds memory for a header of
  // a million short arrays (each GgufValue is ~100 bytes, an element in the file 1).
  std::uint64_t max_kept_elements = 65536;
  // Arrays nested in arrays, at most this deep (1: arrays of scalars only).
  std::uint32_t max_array_depth = 3;
};

// Reads `into.size()` bytes at `offset` into `into` and returns how many it read:
// fewer only where the source ends. May throw ferry::Error (a failed pread).
using GgufReadAt = std::function<std::size_t(std::uint64_t offset, std::span<std::byte> into)>;

// Parses the header of a GGUF source of `file_size` bytes through `read_at`
// (bounded reads of at most 64 KiB through one buffer, never past file_size).
// Every rule broken throws ferry::Error(Stage::kHeader, display, tensor, rule), the
// tensor named when the rule is a tensor's and the key in the rule when it is a
// key's: bad magic, a version other than 2 or 3 (big-endian files included),
// counts that the bytes left cannot hold, a string running past the end of the
// file, a header past max_metadata_bytes, unknown value types, arrays nested past
// max_array_depth, duplicate keys, general.alignment not a u32 power of two, unknown
// ggml type numbers, n_dims 0 or above 4, a dimension of 0, elements overflowing 64
// bits, dims[0] not a whole number of blocks, an offset not a multiple of the
// alignment, bytes overflowing 64 bits or past the end of the file, two tensors
// whose bytes overlap, duplicate or empty tensor names, names of 64 bytes or more
// (ggml's GGML_MAX_NAME: llama.cpp refuses them too).
GgufHeader parse_gguf_header(const GgufReadAt& read_at, std::uint64_t file_size,
                             const std::string& display, const GgufParseOptions& options = {});
// The same over a whole file in memory: what the fuzz target drives.
GgufHeader parse_gguf_header(std::span<const std::byte> bytes, const std::string& display,
                             const GgufParseOptions& options = {});
// The header of a file already open; its identity is the file's as of open().
GgufHeader read_gguf_header(const File& file, const GgufParseOptions& options = {});
// Opens `path` (a regular file) and reads its header.
GgufHeader read_gguf_header(const std::string& path, const std::string& display,
                            const GgufParseOptions& options = {});

// Whether `prefix` (the first bytes of a file) starts with GGUF's magic.
bool has_gguf_magic(std::span<const std::byte> prefix);

// A GGUF tensor as the byte range a loader reads, in safetensors' terms: a plain
// type (ggml_dtype) keeps its dtype and shape(); a quantized one is U8 with the
// shape gguf-py's reader gives it (shape() with the last dimension in bytes:
// dims[0] / block_size * type_size).
TensorInfo to_tensor_info(const GgufTensorInfo& tensor, const std::string& file);

}  // namespace ferry::io
