// A streaming writer for one PyTorch checkpoint file, byte for byte what torch.save
// of an OrderedDict state dict writes (PyTorch 2.x): a ZIP archive of stored
// members, each member's data at a 64-byte aligned offset, a protocol-2 pickle
// (data.pkl) that names one storage record (data/<k>) per tensor. Declare every
// tensor first, then stream the data bytes in declaration order, as with
// io::SafetensorsWriter; nothing but a small coalescing buffer, the pickle and one
// central-directory record per tensor is held, so files of any size are written in
// constant memory. The CRC-32 each ZIP member needs is computed as the bytes pass.
//
// The archive, as PyTorch's writer (caffe2's PyTorchStreamWriter over miniz) lays it
// out, under the archive name A (the file name's stem: pytorch_model-00001-of-00002.bin
// gives pytorch_model-00001-of-00002):
//   A/data.pkl, A/.format_version "1", A/.storage_alignment "64", A/byteorder "little",
//   A/data/0 ... A/data/<n-1> (the tensors' raw little-endian bytes), A/version "3\n",
//   A/.data/serialization_id (40 digits torch derives from the record names and
//   CRCs, reproduced exactly; left out where the standard library is not libstdc++,
//   whose std::hash and std::unordered_set order it depends on).
// Every member is stored (method 0) with general-purpose flags 0x0808 (UTF-8 name,
// data descriptor): its local header carries CRC and sizes 0, a data descriptor
// follows its data and the central directory has the real values. An empty member
// has flags 0x0800 and no descriptor, as miniz writes it. Each local header ends
// with an extra field 0x4246 ("FB") of 'Z's that pads its data to a multiple of 64.
// ZIP64, as miniz writes it: a member of 0xFFFFFFFF bytes or more, or whose local
// header starts at 0xFFFFFFFF or beyond, carries a ZIP64 extra field (0x0001; in the
// local header the size, a compressed size 0 and the offset, in the central
// directory the sizes and the offset, each only where it passes the limit) and a
// data descriptor with 64-bit sizes; the archive always ends with a ZIP64 end of
// central directory record and its locator before the classic record, whose counts
// and offsets saturate at 0xFFFF and 0xFFFFFFFF.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/output_file.hpp"

namespace ferry::io {

struct TorchEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::uint64_t> shape;
};

// data.pkl exactly as torch.save's pickler writes it for an OrderedDict of
// contiguous CPU tensors `entries`, storage k holding entry k: protocol 2, each
// tensor rebuilt by torch._utils._rebuild_tensor_v2 from a typed storage
// (torch.BFloat16Storage, ...), or for F8_E4M3, F8_E5M2, F8_E8M0, U16, U32 and U64
// (which have no typed storage) by _rebuild_tensor_v3 from a
// torch.storage.UntypedStorage of bytes plus the dtype (torch.float8_e4m3fn, ...).
// Memo puts and gets, integer opcodes and the batching of SETITEMS as CPython's
// pickle module. Throws ferry::Error(Stage::kSynth, `file`, name) for an empty or
// duplicate name, a name that is not UTF-8, or a size or stride that does not fit
// torch's 64-bit sizes.
std::string torch_state_dict_pickle(const std::vector<TorchEntry>& entries,
                                    const std::string& file);

// The archive name torch gives a file written at `path`: its last path component
// less the last extension ("pytorch_model.bin" -> "pytorch_model"); "archive", the
// name torch gives an archive written to a stream, when that leaves nothing (".bin").
std::string torch_archive_name(const std::string& path);

struct TorchWriterOptions {
  // Test only: every member, and the end of the archive, in its ZIP64 form as if
  // every size, offset and count were past its 32- or 16-bit limit (the classic
  // fields read 0xFFFFFFFF / 0xFFFF, the values are in the ZIP64 records), so tests
  // cover the records a > 4 GiB file needs without writing 4 GiB.
  bool force_zip64 = false;
};

// Call order: add()... begin() write()... finish().
// Not thread-safe. Every misuse and every failed system call throws
// ferry::Error(stage, path, tensor, rule), `stage` and `what` as given to the
// constructor (Stage::kSynth for `ferry synth`).
//
// The file is written as every ferry output is (common/output_file.hpp): a regular
// file (or a symlink's target) through a temporary that finish() renames into place,
// a FIFO or a character device in place (the format needs no seek).
class TorchWriter {
 public:
  // Nothing is created before begin().
  explicit TorchWriter(std::string path, Stage stage = Stage::kSynth, std::string what = {},
                       TorchWriterOptions options = {});
  // An unfinished archive has no central directory: the destructor removes its
  // temporary, so no truncated file is left behind and a file that stood at the path
  // stays as it was.
  ~TorchWriter();
  TorchWriter(const TorchWriter&) = delete;
  TorchWriter& operator=(const TorchWriter&) = delete;

  // Declares the next tensor (storage data/<k>, k counting from 0); its data
  // follows the previous tensor's.
  void add(std::string name, DType dtype, std::vector<std::uint64_t> shape);

  // Creates the file and writes everything before the first tensor's data.
  void begin();
  // Appends data bytes, in declaration order across tensors. Writing past the
  // declared total is an error (nothing of the offending call is written).
  void write(std::span<const std::byte> bytes);
  // Checks that every declared byte was written, writes the last data descriptor,
  // the version record and the central directory, optionally fsyncs, and closes.
  enum class Sync { kNone, kFsync };
  void finish(Sync sync = Sync::kNone);

  const std::string& path() const { return path_; }
  const std::vector<TorchEntry>& entries() const { return entries_; }
  // The members' prefix (torch_archive_name(path)).
  const std::string& archive_name() const { return archive_; }
  // Sum of the declared tensors' data bytes.
  std::uint64_t data_bytes() const { return data_bytes_; }
  // Tensor data bytes written so far.
  std::uint64_t written() const { return written_; }

 private:
  enum class State { kDeclaring, kWriting, kFinished, kFailed };
  struct Member {
    std::string name;          // the full member name, "A/data/0"
    std::uint64_t offset = 0;  // of its local header in the file
    std::uint64_t size = 0;
    std::uint32_t crc = 0;
  };

  // A whole member whose bytes are at hand (data.pkl, the small records).
  void put_member(std::string name, std::span<const std::byte> bytes);
  // The local header of the next member, of `size` bytes.
  void open_member(std::string name, std::uint64_t size);
  // Its data descriptor (none for an empty member).
  void close_member();
  // Keeps the first 8 data bytes of the open member (see serialization_id()).
  void take_head(std::span<const std::byte> bytes);
  // The .data/serialization_id torch derives from the records written so far.
  std::optional<std::string> serialization_id() const;
  // While the current tensor takes no more bytes: closes its member, opens the
  // next tensor's (empty ones are opened and closed at once).
  void advance();
  void put_central_directory();
  bool zip64_size(std::uint64_t size) const;
  bool zip64_offset(std::uint64_t offset) const;

  void emit(std::span<const std::byte> bytes);
  void emit(const std::string& bytes);
  void flush_buffer();
  void write_all(std::span<const std::byte> bytes);
  void fail_and_close();
  [[noreturn]] void fail(const std::string& tensor, std::string rule) const;

  std::string path_;
  Stage stage_;
  std::string what_;
  TorchWriterOptions options_;
  std::string archive_;
  std::vector<TorchEntry> entries_;
  std::vector<std::uint64_t> sizes_;  // data bytes of each entry
  std::unordered_set<std::string> names_;
  std::vector<Member> members_;
  std::size_t tensor_ = 0;         // the entry whose bytes write() takes next
  bool tensor_open_ = false;       // its member's local header is written
  std::uint64_t tensor_left_ = 0;  // its bytes still to come
  std::uint64_t data_bytes_ = 0;
  std::uint64_t written_ = 0;
  std::uint64_t offset_ = 0;         // bytes of the file emitted so far (buffered included)
  std::uint64_t combined_crc_ = 0;   // the second half of the serialization id
  std::array<std::byte, 8> head_{};  // the open member's first data bytes
  std::size_t head_size_ = 0;
  std::vector<std::byte> buffer_;   // coalesces small writes into large ones
  std::optional<OutputFile> file_;  // from begin() to finish()
  State state_ = State::kDeclaring;
};

}  // namespace ferry::io
