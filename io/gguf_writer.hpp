// Writing GGUF v3 files: metadata of the common value types and tensors of any
// ggml type (the caller gives the bytes: F32, F16, BF16 as they are, Q8_0 from
// io/gguf_types.hpp's quantize_q8_0), laid out as gguf-py's GGUFWriter lays them
// out: tensor infos in declaration order, each tensor's data at a multiple of the
// alignment, zero padding after each (the last one included). For the tests and
// for `ferry synth --format gguf`; streaming, so a file of any size costs a small
// buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/output_file.hpp"
#include "io/gguf.hpp"
#include "io/gguf_types.hpp"

namespace ferry::io {

struct GgufWriterTensor {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<std::uint64_t> dims;    // ggml order: dims[0] is the row length
  std::uint64_t nbytes = 0;           // set by the writer
  std::uint64_t relative_offset = 0;  // set by the writer: from the data section
};

using GgufMetadata = std::vector<std::pair<std::string, GgufValue>>;

// The bytes before the data section exactly as GgufWriter writes them: preamble,
// `metadata` in order (general.alignment added last when `alignment` is not 32),
// the tensor infos with their offsets, zero padding to the alignment. Fills in each
// tensor's nbytes and relative_offset. Throws ferry::Error(stage, file, tensor, rule)
// for what the parser would refuse: an empty, duplicate or 64-byte name, 0 or more
// than 4 dims, a dimension of 0, a row that is not whole blocks, sizes past 64 bits,
// a duplicate key, general.alignment among the metadata (the writer owns it), an
// alignment that is not a power of two up to 2^31, an integer the value type cannot
// hold, an array whose elements are not all kept and of its element type.
std::string gguf_header_bytes(const GgufMetadata& metadata, std::vector<GgufWriterTensor>& tensors,
                              std::uint64_t alignment, const std::string& file,
                              Stage stage = Stage::kSynth);

// Call order: set_alignment()? add_metadata()... add_tensor()... begin() write()...
// finish(). Not thread-safe. Each misuse or failed system call throws
// ferry::Error(stage, path, tensor, rule). Files are written through OutputFile
// (common/output_file.hpp): a temporary renamed into place by finish(), removed by
// the destructor of a writer that did not finish.
class GgufWriter {
 public:
  explicit GgufWriter(std::string path, Stage stage = Stage::kSynth, std::string what = {});
  ~GgufWriter();
  GgufWriter(const GgufWriter&) = delete;
  GgufWriter& operator=(const GgufWriter&) = delete;

  // A power of two from 1 to 2^31 (GGUF stores it as a u32); 32 by default, which
  // is written as no key at all, as gguf-py does.
  void set_alignment(std::uint64_t alignment);
  void add_metadata(std::string key, GgufValue value);
  void add_tensor(std::string name, GgmlType type, std::vector<std::uint64_t> dims);

  // Creates the file and writes everything before the data section.
  void begin();
  // The next data bytes, in declaration order, without padding (the writer adds
  // it). Writing past the declared total is an error.
  void write(std::span<const std::byte> bytes);
  enum class Sync { kNone, kFsync };
  // Checks every declared byte was written, pads the end, optionally fsyncs, closes.
  void finish(Sync sync = Sync::kNone);

  const std::vector<GgufWriterTensor>& tensors() const { return tensors_; }
  // Where the data section starts (valid after begin()).
  std::uint64_t data_offset() const { return data_offset_; }

 private:
  void put(std::span<const std::byte> bytes);
  void pad_to(std::uint64_t relative);
  void flush();
  void abandon() noexcept;
  [[noreturn]] void fail(const std::string& tensor, const std::string& rule) const;

  std::string path_;
  Stage stage_;
  std::string what_;
  std::uint64_t alignment_ = 32;
  GgufMetadata metadata_;
  std::vector<GgufWriterTensor> tensors_;
  std::uint64_t data_offset_ = 0;
  std::uint64_t written_ = 0;  // data-section bytes so far, padding included
  std::size_t cursor_ = 0;     // the tensor receiving bytes
  std::uint64_t in_tensor_ = 0;
  std::uint64_t declared_ = 0;  // the tensors' bytes, padding left out
  std::uint64_t accepted_ = 0;
  std::vector<std::byte> buffer_;
  std::optional<OutputFile> file_;
  enum class State { kDeclaring, kWriting, kFinished, kFailed } state_ = State::kDeclaring;
};

// A whole file's bytes in memory (header, data, padding), for tests and the fuzz
// corpus: `data[i]` holds tensor i's bytes (their sizes are checked).
std::vector<std::byte> gguf_file_bytes(const GgufMetadata& metadata,
                                       std::vector<GgufWriterTensor> tensors,
                                       const std::vector<std::span<const std::byte>>& data,
                                       std::uint64_t alignment = 32);

}  // namespace ferry::io
