// GGUF v3 writing: the header laid out once (gguf_header_bytes), then the data
// streamed through a coalescing buffer with the padding the writer owns.
#include "io/gguf_writer.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "common/format.hpp"

namespace ferry::io {
namespace {

constexpr std::size_t kBufferBytes = 1 << 20;
constexpr std::uint64_t kMaxAlignment = std::uint64_t{1} << 31;

class HeaderText {
 public:
  HeaderText(const std::string& file, Stage stage) : file_(file), stage_(stage) {}

  [[noreturn]] void fail(const std::string& tensor, const std::string& rule) const {
    throw Error(stage_, file_, tensor, rule);
  }

  void le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i, v >>= 8) {
      out_.push_back(static_cast<char>(v & 0xff));
    }
  }
  void str(std::string_view s) {
    le(s.size(), 8);
    out_.append(s);
  }

  void value(const GgufValue& v, const std::string& key) {
    const auto fits = [&](std::uint64_t max) {
      if (v.u > max) {
        fail("", "metadata key '" + key + "': " + std::to_string(v.u) + " does not fit a " +
                     std::string(gguf_value_type_name(v.type)));
      }
    };
    const auto fits_signed = [&](std::int64_t lo, std::int64_t hi) {
      if (v.i < lo || v.i > hi) {
        fail("", "metadata key '" + key + "': " + std::to_string(v.i) + " does not fit an " +
                     std::string(gguf_value_type_name(v.type)));
      }
    };
    switch (v.type) {
      case GgufValueType::kU8:
        fits(0xff);
        le(v.u, 1);
        break;
      case GgufValueType::kU16:
        fits(0xffff);
        le(v.u, 2);
        break;
      case GgufValueType::kU32:
        fits(0xffffffffu);
        le(v.u, 4);
        break;
      case GgufValueType::kU64:
        le(v.u, 8);
        break;
      case GgufValueType::kI8:
        fits_signed(-128, 127);
        le(static_cast<std::uint64_t>(v.i), 1);
        break;
      case GgufValueType::kI16:
        fits_signed(-32768, 32767);
        le(static_cast<std::uint64_t>(v.i), 2);
        break;
      case GgufValueType::kI32:
        fits_signed(std::numeric_limits<std::int32_t>::min(),
                    std::numeric_limits<std::int32_t>::max());
        le(static_cast<std::uint64_t>(v.i), 4);
        break;
      case GgufValueType::kI64:
        le(static_cast<std::uint64_t>(v.i), 8);
        break;
      case GgufValueType::kBool:
        le(v.u != 0 ? 1 : 0, 1);
        break;
      case GgufValueType::kF32: {
        const float f = static_cast<float>(v.f);
        std::uint32_t bits = 0;
        std::memcpy(&bits, &f, 4);
        le(bits, 4);
        break;
      }
      case GgufValueType::kF64: {
        std::uint64_t bits = 0;
        std::memcpy(&bits, &v.f, 8);
        le(bits, 8);
        break;
      }
      case GgufValueType::kString:
        str(v.s);
        break;
      case GgufValueType::kArray:
        if (!v.kept || v.elements.size() != v.count) {
          fail("",
               "metadata key '" + key + "': an array read without its elements cannot be written");
        }
        le(static_cast<std::uint32_t>(v.element_type), 4);
        le(v.count, 8);
        for (const GgufValue& e : v.elements) {
          if (e.type != v.element_type) {
            fail("", "metadata key '" + key + "': an element of type " +
                         std::string(gguf_value_type_name(e.type)) + " in an array of " +
                         std::string(gguf_value_type_name(v.element_type)));
          }
          value(e, key);
        }
        break;
    }
  }

  void pad(std::uint64_t alignment) {
    while (out_.size() % alignment != 0) {
      out_.push_back('\0');
    }
  }

  std::string& text() { return out_; }

 private:
  const std::string& file_;
  Stage stage_;
  std::string out_;
};

std::uint64_t padded(std::uint64_t n, std::uint64_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

}  // namespace

std::string gguf_header_bytes(const GgufMetadata& metadata, std::vector<GgufWriterTensor>& tensors,
                              std::uint64_t alignment, const std::string& file, Stage stage) {
  HeaderText h(file, stage);
  if (alignment == 0 || alignment > kMaxAlignment || (alignment & (alignment - 1)) != 0) {
    h.fail("", "alignment " + std::to_string(alignment) +
                   " is not a power of two from 1 to 2^31 (GGUF stores it as a u32)");
  }
  std::set<std::string_view> keys;
  for (const auto& [key, value] : metadata) {
    if (key == "general.alignment") {
      h.fail("", "metadata key 'general.alignment' is the writer's (set_alignment)");
    }
    if (!keys.insert(key).second) {
      h.fail("", "metadata key '" + key + "' given twice");
    }
  }
  std::set<std::string_view> names;
  std::uint64_t offset = 0;
  for (GgufWriterTensor& t : tensors) {
    if (t.name.empty() || t.name.size() > 63) {
      h.fail(t.name, "tensor names must be 1 to 63 bytes (ggml's GGML_MAX_NAME)");
    }
    if (!names.insert(t.name).second) {
      h.fail(t.name, "tensor declared twice");
    }
    if (t.dims.empty() || t.dims.size() > 4 ||
        std::find(t.dims.begin(), t.dims.end(), 0) != t.dims.end()) {
      h.fail(t.name, "dims " + format_dims(t.dims) + ": 1 to 4 dimensions, none of them 0");
    }
    const GgmlTypeTraits& traits = ggml_traits(t.type);
    std::uint64_t rows = 1;
    for (std::size_t d = 1; d < t.dims.size(); ++d) {
      if (__builtin_mul_overflow(rows, t.dims[d], &rows)) {
        h.fail(t.name, "dims " + format_dims(t.dims) + " overflow 64 bits");
      }
    }
    const std::optional<std::uint64_t> row = ggml_row_bytes(t.type, t.dims[0]);
    if (!row) {
      h.fail(t.name, "dims[0] " + std::to_string(t.dims[0]) + " is not whole blocks of " +
                         std::string(traits.name) + " (" + std::to_string(traits.block_size) +
                         " elements)");
    }
    if (__builtin_mul_overflow(*row, rows, &t.nbytes) || padded(t.nbytes, alignment) < t.nbytes) {
      h.fail(t.name, "dims " + format_dims(t.dims) + " overflow 64 bits of bytes");
    }
    t.relative_offset = offset;
    if (__builtin_add_overflow(offset, padded(t.nbytes, alignment), &offset)) {
      h.fail(t.name, "the data section overflows 64 bits");
    }
  }

  h.text() = "GGUF";
  h.le(3, 4);
  h.le(tensors.size(), 8);
  h.le(metadata.size() + (alignment != 32 ? 1 : 0), 8);
  for (const auto& [key, value] : metadata) {
    h.str(key);
    h.le(static_cast<std::uint32_t>(value.type), 4);
    h.value(value, key);
  }
  if (alignment != 32) {
    h.str("general.alignment");
    h.le(static_cast<std::uint32_t>(GgufValueType::kU32), 4);
    h.le(alignment, 4);
  }
  for (const GgufWriterTensor& t : tensors) {
    h.str(t.name);
    h.le(t.dims.size(), 4);
    for (std::uint64_t d : t.dims) {
      h.le(d, 8);
    }
    h.le(static_cast<std::uint32_t>(t.type), 4);
    h.le(t.relative_offset, 8);
  }
  h.pad(alignment);
  return std::move(h.text());
}

GgufWriter::GgufWriter(std::string path, Stage stage, std::string what)
    : path_(std::move(path)), stage_(stage), what_(std::move(what)) {}

GgufWriter::~GgufWriter() = default;  // an unfinished OutputFile removes its temporary

void GgufWriter::fail(const std::string& tensor, const std::string& rule) const {
  throw Error(stage_, path_, tensor, what_.empty() ? rule : what_ + ": " + rule);
}

void GgufWriter::set_alignment(std::uint64_t alignment) {
  if (state_ != State::kDeclaring) {
    fail("", "set_alignment() after begin()");
  }
  alignment_ = alignment;  // checked by gguf_header_bytes at begin()
}

void GgufWriter::add_metadata(std::string key, GgufValue value) {
  if (state_ != State::kDeclaring) {
    fail("", "add_metadata() after begin()");
  }
  metadata_.emplace_back(std::move(key), std::move(value));
}

void GgufWriter::add_tensor(std::string name, GgmlType type, std::vector<std::uint64_t> dims) {
  if (state_ != State::kDeclaring) {
    fail(name, "add_tensor() after begin()");
  }
  GgufWriterTensor t;
  t.name = std::move(name);
  t.type = type;
  t.dims = std::move(dims);
  tensors_.push_back(std::move(t));
}

void GgufWriter::begin() {
  if (state_ != State::kDeclaring) {
    fail("", "begin() twice");
  }
  const std::string header = gguf_header_bytes(metadata_, tensors_, alignment_, path_, stage_);
  data_offset_ = header.size();
  for (const GgufWriterTensor& t : tensors_) {
    declared_ += t.nbytes;  // the offsets did not overflow, so neither does this
  }
  file_.emplace(path_, stage_, what_);
  state_ = State::kWriting;
  try {
    file_->write(std::string_view(header));
  } catch (const Error&) {
    abandon();
    throw;
  }
  buffer_.reserve(kBufferBytes);
}

void GgufWriter::put(std::span<const std::byte> bytes) {
  if (buffer_.size() + bytes.size() > kBufferBytes) {
    flush();
  }
  if (bytes.size() >= kBufferBytes) {
    file_->write(bytes);
  } else {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  }
  written_ += bytes.size();
}

void GgufWriter::pad_to(std::uint64_t relative) {
  static constexpr std::byte kZeros[4096] = {};
  while (written_ < relative) {
    const std::uint64_t n = std::min<std::uint64_t>(sizeof(kZeros), relative - written_);
    put(std::span<const std::byte>(kZeros, static_cast<std::size_t>(n)));
  }
}

void GgufWriter::flush() {
  if (!buffer_.empty()) {
    file_->write(std::span<const std::byte>(buffer_));
    buffer_.clear();
  }
}

void GgufWriter::write(std::span<const std::byte> bytes) {
  if (state_ != State::kWriting) {
    fail("", state_ == State::kDeclaring ? "write() before begin()"
                                         : "write() after finish() or a failed write");
  }
  if (bytes.size() > declared_ - accepted_) {
    fail(cursor_ < tensors_.size() ? tensors_[cursor_].name : "",
         std::to_string(bytes.size()) + " bytes given, but only " +
             std::to_string(declared_ - accepted_) + " of the declared tensors' bytes are left");
  }
  try {
    while (!bytes.empty()) {
      const GgufWriterTensor& t = tensors_[cursor_];
      pad_to(t.relative_offset);
      const std::uint64_t take = std::min<std::uint64_t>(bytes.size(), t.nbytes - in_tensor_);
      put(bytes.first(static_cast<std::size_t>(take)));
      bytes = bytes.subspan(static_cast<std::size_t>(take));
      in_tensor_ += take;
      accepted_ += take;
      if (in_tensor_ == t.nbytes) {
        ++cursor_;
        in_tensor_ = 0;
      }
    }
  } catch (const Error&) {
    abandon();
    throw;
  }
}

void GgufWriter::abandon() noexcept {
  state_ = State::kFailed;
  buffer_.clear();
  file_.reset();  // closes and removes the temporary
}

void GgufWriter::finish(Sync sync) {
  if (state_ != State::kWriting) {
    fail("", state_ == State::kDeclaring ? "finish() before begin()"
                                         : "finish() after finish() or a failed write");
  }
  if (cursor_ < tensors_.size()) {
    fail(tensors_[cursor_].name, "only " + std::to_string(in_tensor_) + " of its " +
                                     std::to_string(tensors_[cursor_].nbytes) +
                                     " bytes were written");
  }
  try {
    if (!tensors_.empty()) {
      const GgufWriterTensor& last = tensors_.back();
      pad_to(last.relative_offset + padded(last.nbytes, alignment_));
    }
    flush();
    if (sync == Sync::kFsync) {
      file_->sync();
    }
    file_->commit();
  } catch (const Error&) {
    abandon();
    throw;
  }
  file_.reset();
  state_ = State::kFinished;
}

std::vector<std::byte> gguf_file_bytes(const GgufMetadata& metadata,
                                       std::vector<GgufWriterTensor> tensors,
                                       const std::vector<std::span<const std::byte>>& data,
                                       std::uint64_t alignment) {
  const std::string header = gguf_header_bytes(metadata, tensors, alignment, "<memory>");
  if (data.size() != tensors.size()) {
    throw Error(Stage::kSynth, "<memory>", "",
                std::to_string(data.size()) + " data buffers for " +
                    std::to_string(tensors.size()) + " tensors");
  }
  std::vector<std::byte> out(reinterpret_cast<const std::byte*>(header.data()),
                             reinterpret_cast<const std::byte*>(header.data()) + header.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (data[i].size() != tensors[i].nbytes) {
      throw Error(
          Stage::kSynth, "<memory>", tensors[i].name,
          std::to_string(data[i].size()) + " bytes given for " + std::to_string(tensors[i].nbytes));
    }
    out.resize(header.size() + tensors[i].relative_offset);
    out.insert(out.end(), data[i].begin(), data[i].end());
    out.resize(header.size() + padded(out.size() - header.size(), alignment));
  }
  return out;
}

}  // namespace ferry::io
