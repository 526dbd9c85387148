// A streaming writer for one safetensors file: declare every tensor first, then
// stream the data bytes in declaration order. Nothing but a small coalescing buffer
// is held in memory, so files of any size (the medium synthetic preset is > 2 GiB)
// are written in constant memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/output_file.hpp"

namespace ferry::io {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::uint64_t> shape;
};

// The header exactly as the writer lays it out: the JSON text padded with spaces
// to a multiple of 8 bytes (as the reference implementation does, so the data
// region starts 8-aligned), "__metadata__" first when `metadata` is not empty,
// then the tensors in the given order with consecutive data offsets.
// Throws ferry::Error(Stage::kSynth) naming `file` and the tensor for an empty or
// duplicate name, or a byte size that overflows 64 bits.
// `alignment` (a power of two, at least 8): the header is padded so that the data
// region starts at a multiple of it in the file.
std::string safetensors_header_text(const std::vector<SafetensorsEntry>& entries,
                                    const std::map<std::string, std::string>& metadata,
                                    const std::string& file, std::uint64_t alignment = 8);

// The names set_data_alignment's padding tensors take: "__pad__.<tag><n>".
inline constexpr std::string_view kPadTensorPrefix = "__pad__.";

// Call order: add()... set_metadata()? begin() write()... finish().
// Not thread-safe. Every misuse and every failed system call throws
// ferry::Error(stage, path, tensor, rule), `stage` and `what` as given to the
// constructor: Stage::kSynth for `ferry synth`, the setting's stage and name for
// an output such as the dump ("load.dump_dir: cannot write: No space left ...").
//
// The file is written as every ferry output is (common/output_file.hpp): a regular
// file (or a symlink's target) through a temporary that finish() renames into place,
// a FIFO or a character device in place.
class SafetensorsWriter {
 public:
  // Nothing is created before begin().
  explicit SafetensorsWriter(std::string path, Stage stage = Stage::kSynth,
                             std::string what = {});
  // An unfinished file has a header promising bytes it does not hold: the
  // destructor removes its temporary, so no truncated file is left behind and a
  // file that stood at the path stays as it was.
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Every tensor's data starts at a multiple of `alignment` bytes in the file (a
  // power of two from 8 to 1 MiB; 4096 lets a reader use O_DIRECT straight into its
  // destination): the header is padded to it, and a U8 padding tensor
  // "__pad__.<n>" of zeros (kPadTensorPrefix) fills each gap before a tensor, so the
  // file stays a valid safetensors file for any reader. Call before add(); names
  // starting with "__pad__." are then refused for the caller's tensors. write()
  // takes the caller's tensors' bytes only and writes the padding itself.
  // `tag` goes into the padding's names ("__pad__.<tag><n>"), so that the padding of
  // several files of one checkpoint has names no two files share.
  void set_data_alignment(std::uint64_t alignment, std::string tag = {});
  // Declares the next tensor; its data follows the previous tensor's.
  void add(std::string name, DType dtype, std::vector<std::uint64_t> shape);
  // Replaces the "__metadata__" string map (none is written when empty).
  void set_metadata(std::map<std::string, std::string> metadata);

  // Creates the file and writes the 8-byte little-endian length and the header.
  void begin();
  // Appends data bytes. Writing past the declared total is an error (nothing of
  // the offending call is written).
  void write(std::span<const std::byte> bytes);
  // Checks that every declared byte was written, optionally fsyncs, and closes.
  enum class Sync { kNone, kFsync };
  void finish(Sync sync = Sync::kNone);

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // Sum of the declared tensors' data bytes.
  std::uint64_t data_bytes() const { return data_bytes_; }
  // 8 + padded JSON length: where the data region starts (valid after begin()).
  std::uint64_t header_bytes() const { return header_bytes_; }
  // Data bytes in the file so far (padding included).
  std::uint64_t written() const { return written_; }
  // Entry i's (entries()) data offset in the data region; its file offset is
  // header_bytes() + this.
  std::uint64_t data_begin(std::size_t i) const { return i == 0 ? 0 : ends_.at(i - 1); }
  bool is_padding(std::size_t i) const { return pad_.at(i); }

 private:
  enum class State { kDeclaring, kWriting, kFinished, kFailed };

  void flush_buffer();
  void write_all(const std::byte* data, std::size_t size);
  void append(std::span<const std::byte> bytes);
  // Writes the zeros of padding entries that start at the current offset.
  void fill_padding();
  // The tensor whose data holds data offset `offset` (for error messages).
  std::string tensor_at(std::uint64_t offset) const;
  void fail_and_close();
  [[noreturn]] void fail(const std::string& tensor, std::string rule) const;

  std::string path_;
  Stage stage_;
  std::string what_;
  std::vector<SafetensorsEntry> entries_;
  std::vector<std::uint64_t> ends_;  // end data offset of each entry
  std::vector<bool> pad_;            // entry is set_data_alignment's padding
  std::uint64_t alignment_ = 0;      // 0: unaligned tensors, the header to 8
  std::uint64_t pads_ = 0;
  std::string pad_tag_;
  std::uint64_t padding_bytes_ = 0;  // of all padding entries
  std::uint64_t real_written_ = 0;   // the caller's bytes accepted so far
  std::size_t cursor_ = 0;           // the entry holding data offset written_
  std::unordered_set<std::string> names_;
  std::map<std::string, std::string> metadata_;
  std::uint64_t data_bytes_ = 0;
  std::uint64_t header_bytes_ = 0;
  std::uint64_t written_ = 0;
  std::vector<std::byte> buffer_;  // coalesces small writes into large ones
  std::optional<OutputFile> file_;  // from begin() to finish()
  State state_ = State::kDeclaring;
};

}  // namespace ferry::io
