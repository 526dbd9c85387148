// SafetensorsWriter: header layout as the reference implementation writes it,
// data streamed through a small coalescing buffer into an OutputFile.
#include "io/safetensors_writer.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "common/error.hpp"

namespace ferry::io {
namespace {

// Small tensors (norms, biases) would otherwise cost one system call each.
constexpr std::size_t kBufferBytes = std::size_t{1} << 20;
constexpr std::uint64_t kAlignment = 8;

[[noreturn]] void fail(const std::string& file, const std::string& tensor, std::string rule) {
  throw Error(Stage::kSynth, file, tensor, std::move(rule));
}

// Data bytes of one tensor; throws when elements × dtype size overflows 64 bits.
std::uint64_t tensor_bytes(const SafetensorsEntry& entry, const std::string& file) {
  std::uint64_t n = dtype_size(entry.dtype);
  for (std::uint64_t dim : entry.shape) {
    if (dim != 0 && n > std::numeric_limits<std::uint64_t>::max() / dim) {
      fail(file, entry.name, "byte size of the shape overflows 64 bits");
    }
    n *= dim;
  }
  return n;
}

std::uint64_t checked_add(std::uint64_t a, std::uint64_t b, const std::string& file,
                          const std::string& tensor) {
  if (a > std::numeric_limits<std::uint64_t>::max() - b) {
    fail(file, tensor, "data offsets overflow 64 bits");
  }
  return a + b;
}

void check_name(const std::string& name, const std::string& file) {
  if (name.empty()) {
    fail(file, "", "tensor names must not be empty");
  }
  if (name == "__metadata__") {
    fail(file, name, "'__metadata__' is reserved for the metadata map");
  }
}

}  // namespace

std::string safetensors_header_text(const std::vector<SafetensorsEntry>& entries,
                                    const std::map<std::string, std::string>& metadata,
                                    const std::string& file, std::uint64_t alignment) {
  // Metadata first, then the tensors in declaration order, which is also offset
  // order (the reference writes tensors sorted by offset). The object is written
  // entry by entry: an ordered_json built with operator[] searches its keys on
  // every insert, which took 20 s for a 46,000-tensor header.
  std::string text = "{";
  try {
    if (!metadata.empty()) {
      text += "\"__metadata__\":" + nlohmann::json(metadata).dump();
    }
    std::set<std::string_view> seen;
    std::uint64_t offset = 0;
    for (const auto& entry : entries) {
      check_name(entry.name, file);
      if (!seen.insert(entry.name).second) {
        fail(file, entry.name, "tensor declared twice");
      }
      std::uint64_t end = checked_add(offset, tensor_bytes(entry, file), file, entry.name);
      nlohmann::ordered_json value = {{"dtype", std::string(dtype_name(entry.dtype))},
                                      {"shape", entry.shape},
                                      {"data_offsets", {offset, end}}};
      text += text.size() > 1 ? "," : "";
      text += nlohmann::json(entry.name).dump() + ":" + value.dump();
      offset = end;
    }
  } catch (const nlohmann::json::exception& e) {
    // The only way dump() fails is a string that is not valid UTF-8.
    fail(file, "", std::string("header is not valid UTF-8: ") + e.what());
  }
  text += "}";
  // The data region starts at 8 + the text's length.
  const std::uint64_t align = std::max(alignment, kAlignment);
  text.append((align - (8 + text.size()) % align) % align, ' ');
  return text;
}

SafetensorsWriter::SafetensorsWriter(std::string path, Stage stage, std::string what)
    : path_(std::move(path)), stage_(stage), what_(std::move(what)) {}

// file_'s destructor removes an unfinished file's temporary.
SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::fail(const std::string& tensor, std::string rule) const {
  throw Error(stage_, path_, tensor, what_.empty() ? std::move(rule) : what_ + ": " + rule);
}

void SafetensorsWriter::set_data_alignment(std::uint64_t alignment, std::string tag) {
  if (state_ != State::kDeclaring || !entries_.empty()) {
    fail("", "set_data_alignment() after add() or begin()");
  }
  if (alignment < kAlignment || alignment > (std::uint64_t{1} << 20) ||
      (alignment & (alignment - 1)) != 0) {
    fail("",
         "data alignment " + std::to_string(alignment) + " is not a power of two from 8 to 1 MiB");
  }
  alignment_ = alignment;
  pad_tag_ = std::move(tag);
}

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<std::uint64_t> shape) {
  if (state_ != State::kDeclaring) {
    fail(name, "add() after begin(): every tensor must be declared before data is written");
  }
  check_name(name, path_);
  if (names_.count(name) != 0) {
    fail(name, "tensor declared twice");
  }
  if (alignment_ != 0 && name.starts_with(kPadTensorPrefix)) {
    fail(name, "names starting with \"" + std::string(kPadTensorPrefix) +
                   "\" are the padding's in an aligned file");
  }
  SafetensorsEntry entry{std::move(name), dtype, std::move(shape)};
  const std::uint64_t bytes = tensor_bytes(entry, path_);
  if (const std::uint64_t gap =
          alignment_ == 0 ? 0 : (alignment_ - data_bytes_ % alignment_) % alignment_;
      bytes != 0 && gap != 0) {
    SafetensorsEntry pad{
        std::string(kPadTensorPrefix) + pad_tag_ + std::to_string(pads_++), DType::kU8, {gap}};
    names_.insert(pad.name);
    entries_.push_back(std::move(pad));
    pad_.push_back(true);
    data_bytes_ = checked_add(data_bytes_, gap, path_, entry.name);
    ends_.push_back(data_bytes_);
    padding_bytes_ += gap;
  }
  std::uint64_t end = checked_add(data_bytes_, bytes, path_, entry.name);
  names_.insert(entry.name);
  entries_.push_back(std::move(entry));
  pad_.push_back(false);
  ends_.push_back(end);
  data_bytes_ = end;
}

void SafetensorsWriter::set_metadata(std::map<std::string, std::string> metadata) {
  if (state_ != State::kDeclaring) {
    fail("", "set_metadata() after begin(): the header is already written");
  }
  metadata_ = std::move(metadata);
}

void SafetensorsWriter::begin() {
  if (state_ != State::kDeclaring) {
    fail("", "begin() called twice");
  }
  std::string text = safetensors_header_text(entries_, metadata_, path_, alignment_);
  file_.emplace(path_, stage_, what_);
  state_ = State::kWriting;
  buffer_.reserve(kBufferBytes);
  std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) {
    buffer_.push_back(static_cast<std::byte>((n >> (8 * i)) & 0xff));
  }
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  if (text.size() > kBufferBytes) {
    flush_buffer();
    write_all(p, text.size());
  } else {
    buffer_.insert(buffer_.end(), p, p + text.size());
  }
  header_bytes_ = 8 + n;
}

void SafetensorsWriter::write(std::span<const std::byte> bytes) {
  if (state_ != State::kWriting) {
    fail("",
         state_ == State::kDeclaring ? "write() before begin()"
                                     : "write() after finish() or a failed write");
  }
  const std::uint64_t real = data_bytes_ - padding_bytes_;
  if (bytes.size() > real - real_written_) {
    fail(tensor_at(written_), "write of " + std::to_string(bytes.size()) +
                                  " bytes at data offset " + std::to_string(written_) +
                                  " exceeds the declared " + std::to_string(real) + " data bytes");
  }
  real_written_ += bytes.size();
  if (padding_bytes_ == 0) {
    append(bytes);
    return;
  }
  // Each piece up to the end of the tensor it lands in, padding between.
  fill_padding();
  while (!bytes.empty()) {
    const auto n =
        static_cast<std::size_t>(std::min<std::uint64_t>(bytes.size(), ends_[cursor_] - written_));
    append(bytes.first(n));
    bytes = bytes.subspan(n);
    fill_padding();
  }
}

void SafetensorsWriter::fill_padding() {
  static constexpr std::byte kZeros[4096] = {};
  while (cursor_ < entries_.size() && (written_ == ends_[cursor_] || pad_[cursor_])) {
    if (written_ == ends_[cursor_]) {
      ++cursor_;
      continue;
    }
    const auto n = static_cast<std::size_t>(
        std::min<std::uint64_t>(sizeof(kZeros), ends_[cursor_] - written_));
    append(std::span<const std::byte>(kZeros, n));
  }
}

void SafetensorsWriter::append(std::span<const std::byte> bytes) {
  if (buffer_.size() + bytes.size() > kBufferBytes) {
    flush_buffer();
  }
  if (bytes.size() >= kBufferBytes) {
    write_all(bytes.data(), bytes.size());
  } else {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  }
  written_ += bytes.size();
}

void SafetensorsWriter::finish(Sync sync) {
  if (state_ != State::kWriting) {
    fail("",
         state_ == State::kDeclaring ? "finish() before begin()"
                                     : "finish() after finish() or a failed write");
  }
  if (padding_bytes_ != 0) {
    fill_padding();
  }
  if (written_ != data_bytes_) {
    std::size_t i = static_cast<std::size_t>(
        std::upper_bound(ends_.begin(), ends_.end(), written_) - ends_.begin());
    std::uint64_t begin = i == 0 ? 0 : ends_[i - 1];
    fail(entries_[i].name,
         "only " + std::to_string(written_) + " of " + std::to_string(data_bytes_) +
             " declared data bytes were written (this tensor has " +
             std::to_string(written_ - begin) + " of " + std::to_string(ends_[i] - begin) + ")");
  }
  flush_buffer();
  try {
    if (sync == Sync::kFsync) {
      file_->sync();
    }
    file_->commit();
  } catch (const Error&) {
    fail_and_close();
    throw;
  }
  file_.reset();
  state_ = State::kFinished;
}

void SafetensorsWriter::flush_buffer() {
  if (!buffer_.empty()) {
    write_all(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
}

void SafetensorsWriter::write_all(const std::byte* data, std::size_t size) {
  try {
    file_->write(std::span<const std::byte>(data, size));
  } catch (const Error&) {
    fail_and_close();
    throw;
  }
}

std::string SafetensorsWriter::tensor_at(std::uint64_t offset) const {
  auto it = std::upper_bound(ends_.begin(), ends_.end(), offset);
  if (it == ends_.end()) {
    return {};
  }
  return entries_[static_cast<std::size_t>(it - ends_.begin())].name;
}

void SafetensorsWriter::fail_and_close() {
  state_ = State::kFailed;
  buffer_.clear();
  file_.reset();  // closes, removes the temporary
}

}  // namespace ferry::io
