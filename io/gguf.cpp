// GGUF header parsing: a buffered cursor over bounded reads, the typed metadata,
// the tensor infos and every rule io/gguf.hpp lists. Each count is checked against
// the bytes that are left before anything is allocated for it, so a hostile header
// costs at most what its own bytes (capped by max_metadata_bytes) can describe.
#include "io/gguf.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "common/format.hpp"
#include "io/read_fully.hpp"

namespace ferry::io {
namespace {

constexpr std::uint64_t kPreambleBytes = 24;  // magic, version, two counts
constexpr std::size_t kChunk = 64 * 1024;     // the most one read asks for
// The fewest bytes an entry can take: a key/value is an empty key (8), a type (4)
// and a one-byte value; a tensor info a one-byte name (9), n_dims (4), one dim (8),
// a type (4) and an offset (8).
constexpr std::uint64_t kMinKvBytes = 13;
constexpr std::uint64_t kMinTensorInfoBytes = 33;
// ggml's GGML_MAX_NAME (names are stored in a char[64] with its terminator) and
// GGML_MAX_DIMS.
constexpr std::uint64_t kMaxNameBytes = 63;
constexpr std::uint32_t kMaxDims = 4;

[[noreturn]] void header_error(const std::string& file, const std::string& tensor,
                               const std::string& rule) {
  throw Error(Stage::kHeader, file, tensor, rule);
}

bool known_value_type(std::uint32_t t) {
  return t <= 12;
}

// Bytes of one element of a fixed-size type; 0 for strings and arrays.
std::uint64_t fixed_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kU16:
    case GgufValueType::kI16:
      return 2;
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kF32:
      return 4;
    case GgufValueType::kU64:
    case GgufValueType::kI64:
    case GgufValueType::kF64:
      return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray:
      return 0;
  }
  return 0;
}

// The fewest bytes a value of type `t` takes: what bounds an array's count.
std::uint64_t min_size(GgufValueType t) {
  if (t == GgufValueType::kString) {
    return 8;
  }
  if (t == GgufValueType::kArray) {
    return 12;
  }
  return fixed_size(t);
}

std::string quoted(std::string_view s) {
  std::string out = "'";
  for (char c : s.substr(0, 80)) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    } else {
      out += c;
    }
  }
  if (s.size() > 80) {
    out += "...";
  }
  return out + "'";
}

// Reads a source front to back through one buffer of at most kChunk bytes. Every
// read is checked against the file's end and the metadata cap first, so the
// messages say which: a truncated file, or a header too large.
class Cursor {
 public:
  Cursor(const GgufReadAt& read_at, std::uint64_t file_size, const std::string& display,
         std::uint64_t cap)
      : read_at_(read_at), file_size_(file_size), display_(display), cap_(cap) {}

  std::uint64_t pos() const { return pos_; }
  // Bytes the file still holds from here.
  std::uint64_t left() const { return file_size_ - pos_; }
  // Bytes the header may still take from here (the file's end or the cap).
  std::uint64_t header_left() const {
    const std::uint64_t end = std::min(file_size_, cap_);
    return end > pos_ ? end - pos_ : 0;
  }
  std::uint64_t cap() const { return cap_; }

  // Checks that `n` more bytes exist and are inside the cap.
  void need(std::uint64_t n, const std::string& what) const {
    if (n > left()) {
      header_error(display_, tensor_,
                   what + " at offset " + std::to_string(pos_) + " needs " + std::to_string(n) +
                       " bytes, but the file ends at " + std::to_string(file_size_) +
                       " (truncated?)");
    }
    if (n > cap_ - std::min(cap_, pos_)) {
      cap_error(what);
    }
  }
  [[noreturn]] void cap_error(const std::string& what) const {
    header_error(display_, tensor_,
                 what + " at offset " + std::to_string(pos_) +
                     " runs past io.max_metadata_bytes (" + std::to_string(cap_) +
                     " bytes for the metadata and tensor infos together)");
  }

  void read(void* dst, std::size_t n, const std::string& what) {
    need(n, what);
    auto* out = static_cast<std::byte*>(dst);
    while (n > 0) {
      if (pos_ < buf_start_ || pos_ >= buf_start_ + buf_.size()) {
        fill();
      }
      const std::size_t at = static_cast<std::size_t>(pos_ - buf_start_);
      const std::size_t take = std::min(n, buf_.size() - at);
      std::memcpy(out, buf_.data() + at, take);
      out += take;
      n -= take;
      pos_ += take;
    }
  }

  void skip(std::uint64_t n, const std::string& what) {
    need(n, what);
    pos_ += n;
  }

  template <class T>
  T get(const std::string& what) {
    std::byte b[sizeof(T)];
    read(b, sizeof(T), what);
    std::uint64_t v = 0;
    for (std::size_t i = sizeof(T); i-- > 0;) {
      v = (v << 8) | std::to_integer<std::uint64_t>(b[i]);
    }
    return static_cast<T>(v);
  }

  // A string's u64 length, checked against the file and the cap before its bytes.
  std::uint64_t string_length(const std::string& what) {
    const std::uint64_t n = get<std::uint64_t>(what + " (its length)");
    if (n > left()) {
      header_error(display_, tensor_,
                   what + ": length " + std::to_string(n) + " at offset " +
                       std::to_string(pos_ - 8) + " runs past the end of the file (" +
                       std::to_string(file_size_) + " bytes)");
    }
    return n;
  }

  std::string string(const std::string& what) {
    const std::uint64_t n = string_length(what);
    need(n, what);
    std::string s(static_cast<std::size_t>(n), '\0');
    read(s.data(), s.size(), what);
    return s;
  }

  void skip_string(const std::string& what) { skip(string_length(what), what); }

  // The tensor later messages name (empty for the metadata).
  void set_tensor(std::string name) { tensor_ = std::move(name); }

 private:
  void fill() {
    buf_start_ = pos_;
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, left()));
    buf_.resize(n);
    const std::size_t got = read_at_(pos_, std::span<std::byte>(buf_.data(), n));
    if (got != n) {
      header_error(display_, tensor_,
                   "read " + std::to_string(got) + " of " + std::to_string(n) +
                       " bytes at offset " + std::to_string(pos_) +
                       ": the file is shorter than its size said (" + std::to_string(file_size_) +
                       " bytes)");
    }
  }

  const GgufReadAt& read_at_;
  std::uint64_t file_size_;
  const std::string& display_;
  std::uint64_t cap_;
  std::uint64_t pos_ = 0;
  std::uint64_t buf_start_ = 0;
  std::vector<std::byte> buf_;
  std::string tensor_;
};

class Parser {
 public:
  Parser(Cursor& in, const std::string& display, const GgufParseOptions& options)
      : in_(in), display_(display), options_(options), kept_left_(options.max_kept_elements) {}

  GgufHeader parse(std::uint64_t file_size) {
    GgufHeader h;
    h.file = display_;
    h.file_size = file_size;
    if (file_size < kPreambleBytes) {
      header_error(display_, "",
                   "file is " + std::to_string(file_size) +
                       " bytes, too short for GGUF's 24-byte preamble (magic, version, counts)");
    }
    char magic[4];
    in_.read(magic, 4, "the magic");
    if (std::memcmp(magic, "GGUF", 4) != 0) {
      header_error(
          display_, "",
          "not a GGUF file: it starts with " + quoted(std::string_view(magic, 4)) + ", not 'GGUF'");
    }
    h.version = in_.get<std::uint32_t>("the version");
    check_version(h.version);
    const auto tensor_count = in_.get<std::uint64_t>("the tensor count");
    const auto kv_count = in_.get<std::uint64_t>("the metadata key count");
    check_counts(tensor_count, kv_count);

    for (std::uint64_t k = 0; k < kv_count; ++k) {
      read_kv(h);
    }
    h.alignment = alignment_of(h);
    read_tensor_infos(h, tensor_count);
    h.header_bytes = in_.pos();
    // header_bytes < 2^63 (it is inside the file) and alignment <= 2^31: no overflow.
    h.data_offset = (h.header_bytes + h.alignment - 1) / h.alignment * h.alignment;
    place_tensors(h);
    return h;
  }

 private:
  void check_version(std::uint32_t v) const {
    if (v == 2 || v == 3) {
      return;
    }
    if ((v & 0xffffu) == 0 && v != 0) {
      header_error(display_, "",
                   "the version reads " + std::to_string(v) + " (0x" + hex32(v) +
                       "): a big-endian GGUF file; ferry reads little-endian files only");
    }
    if (v == 1) {
      header_error(display_, "",
                   "GGUF version 1 is not supported (its counts and lengths were 32-bit; "
                   "ferry reads versions 2 and 3)");
    }
    header_error(
        display_, "",
        "GGUF version " + std::to_string(v) + " is not supported (ferry reads versions 2 and 3)");
  }

  static std::string hex32(std::uint32_t v) {
    static const char* kHex = "0123456789abcdef";
    std::string s(8, '0');
    for (int i = 7; i >= 0; --i, v >>= 4) {
      s[static_cast<std::size_t>(i)] = kHex[v & 15];
    }
    return s;
  }

  // Each entry takes a minimum of bytes, so counts the rest of the header cannot
  // hold are refused here, before any entry is read or allocated.
  void check_counts(std::uint64_t tensors, std::uint64_t kvs) const {
    const std::uint64_t file_left = in_.left();
    const std::uint64_t header_left = in_.header_left();
    const auto too_many = [&](std::uint64_t count, std::uint64_t each, std::uint64_t budget) {
      return count > budget / each;
    };
    for (const auto& [budget, past_cap] :
         {std::pair{file_left, false}, std::pair{header_left, true}}) {
      std::string where = past_cap ? "io.max_metadata_bytes leaves " : "the file has ";
      if (too_many(kvs, kMinKvBytes, budget)) {
        header_error(display_, "",
                     "metadata key count " + std::to_string(kvs) + " needs at least " +
                         std::to_string(kMinKvBytes) + " bytes each, but " + where +
                         std::to_string(budget) + " bytes after the preamble");
      }
      const std::uint64_t after_kvs = budget - kvs * kMinKvBytes;
      if (too_many(tensors, kMinTensorInfoBytes, after_kvs)) {
        header_error(display_, "",
                     "tensor count " + std::to_string(tensors) + " needs at least " +
                         std::to_string(kMinTensorInfoBytes) + " bytes each, but " + where +
                         std::to_string(after_kvs) + " bytes after the metadata's minimum");
      }
    }
  }

  GgufValueType value_type(std::uint32_t raw, const std::string& what) const {
    if (!known_value_type(raw)) {
      header_error(
          display_, "",
          what + ": unknown GGUF value type " + std::to_string(raw) + " (known: 0-12, u8 to f64)");
    }
    return static_cast<GgufValueType>(raw);
  }

  void read_kv(GgufHeader& h) {
    const std::uint64_t at = in_.pos();
    std::string key = in_.string("a metadata key");
    const std::string what = "metadata key " + quoted(key);
    const GgufValueType type = value_type(in_.get<std::uint32_t>(what + " (its type)"), what);
    GgufValue value = read_value(type, 0, what, /*keep=*/true);
    auto [it, fresh] = h.metadata.emplace(std::move(key), std::move(value));
    if (!fresh) {
      header_error(display_, "",
                   what + " appears twice (again at offset " + std::to_string(at) + ")");
    }
  }

  // One value of `type`; `depth` counts the arrays it is inside. With `keep` false
  // (inside an array whose elements are not kept) its bytes are only walked.
  GgufValue read_value(GgufValueType type, std::uint32_t depth, const std::string& what,
                       bool keep) {
    GgufValue v;
    v.type = type;
    switch (type) {
      case GgufValueType::kU8:
        v.u = in_.get<std::uint8_t>(what);
        break;
      case GgufValueType::kU16:
        v.u = in_.get<std::uint16_t>(what);
        break;
      case GgufValueType::kU32:
        v.u = in_.get<std::uint32_t>(what);
        break;
      case GgufValueType::kU64:
        v.u = in_.get<std::uint64_t>(what);
        break;
      case GgufValueType::kI8:
        v.i = in_.get<std::int8_t>(what);
        break;
      case GgufValueType::kI16:
        v.i = in_.get<std::int16_t>(what);
        break;
      case GgufValueType::kI32:
        v.i = in_.get<std::int32_t>(what);
        break;
      case GgufValueType::kI64:
        v.i = in_.get<std::int64_t>(what);
        break;
      case GgufValueType::kBool:
        v.u = in_.get<std::uint8_t>(what) != 0 ? 1 : 0;
        break;
      case GgufValueType::kF32: {
        const auto bits = in_.get<std::uint32_t>(what);
        float f = 0;
        std::memcpy(&f, &bits, 4);
        v.f = f;
        break;
      }
      case GgufValueType::kF64: {
        const auto bits = in_.get<std::uint64_t>(what);
        std::memcpy(&v.f, &bits, 8);
        break;
      }
      case GgufValueType::kString:
        if (keep) {
          v.s = in_.string(what);
        } else {
          in_.skip_string(what);
        }
        break;
      case GgufValueType::kArray:
        read_array(v, depth, what, keep);
        break;
    }
    return v;
  }

  void read_array(GgufValue& v, std::uint32_t depth, const std::string& what, bool keep) {
    if (depth + 1 > options_.max_array_depth) {
      header_error(
          display_, "",
          what + ": arrays nested more than " + std::to_string(options_.max_array_depth) + " deep");
    }
    v.element_type = value_type(in_.get<std::uint32_t>(what + " (its element type)"), what);
    v.count = in_.get<std::uint64_t>(what + " (its element count)");
    const std::uint64_t each = min_size(v.element_type);
    if (v.count > in_.left() / each) {
      header_error(display_, "",
                   what + ": " + std::to_string(v.count) + " elements of " +
                       std::string(gguf_value_type_name(v.element_type)) + " need at least " +
                       std::to_string(each) + " bytes each, but the file " + "has " +
                       std::to_string(in_.left()) + " bytes left");
    }
    if (v.count > in_.header_left() / each) {
      in_.cap_error(what + " (" + std::to_string(v.count) + " elements)");
    }
    v.kept = keep && v.count <= options_.max_kept_array && v.count <= kept_left_;
    if (v.kept) {
      kept_left_ -= v.count;
      v.elements.reserve(static_cast<std::size_t>(v.count));
      for (std::uint64_t e = 0; e < v.count; ++e) {
        v.elements.push_back(read_value(v.element_type, depth + 1, what, true));
      }
      return;
    }
    if (const std::uint64_t size = fixed_size(v.element_type); size != 0) {
      in_.skip(v.count * size, what);  // count * size <= bytes left, checked above
      return;
    }
    for (std::uint64_t e = 0; e < v.count; ++e) {
      (void)read_value(v.element_type, depth + 1, what, false);
    }
  }

  std::uint64_t alignment_of(const GgufHeader& h) const {
    const GgufValue* a = h.find("general.alignment");
    if (a == nullptr) {
      return 32;
    }
    if (a->type != GgufValueType::kU32) {
      header_error(display_, "",
                   "metadata key 'general.alignment' must be a u32, not " + a->describe());
    }
    if (a->u == 0 || (a->u & (a->u - 1)) != 0) {
      header_error(
          display_, "",
          "metadata key 'general.alignment' is " + std::to_string(a->u) + ": not a power of two");
    }
    return a->u;
  }

  void read_tensor_infos(GgufHeader& h, std::uint64_t count) {
    // The count is bounded by the bytes left (check_counts), which bounds this too.
    h.tensors.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(count, 1u << 16)));
    for (std::uint64_t k = 0; k < count; ++k) {
      in_.set_tensor("");
      const std::string what = "tensor info " + std::to_string(k);
      GgufTensorInfo t;
      t.name = in_.string(what + " (its name)");
      in_.set_tensor(t.name);
      if (t.name.empty()) {
        header_error(display_, "", what + ": empty tensor name");
      }
      if (t.name.size() > kMaxNameBytes) {
        header_error(display_, t.name,
                     "name is " + std::to_string(t.name.size()) +
                         " bytes; ggml's limit is 63 (GGML_MAX_NAME)");
      }
      const auto n_dims = in_.get<std::uint32_t>("n_dims");
      if (n_dims == 0 || n_dims > kMaxDims) {
        header_error(display_, t.name,
                     "n_dims is " + std::to_string(n_dims) + ": must be 1 to 4 (GGML_MAX_DIMS)");
      }
      t.dims.resize(n_dims);
      for (std::uint64_t& d : t.dims) {
        d = in_.get<std::uint64_t>("a dimension");
      }
      const auto raw_type = in_.get<std::uint32_t>("the ggml type");
      const GgmlTypeTraits* traits = find_ggml_type(raw_type);
      if (traits == nullptr) {
        header_error(display_, t.name,
                     "unknown ggml type number " + std::to_string(raw_type) +
                         " (a type ggml removed, or one newer than ferry)");
      }
      t.type = traits->type;
      t.relative_offset = in_.get<std::uint64_t>("the data offset");
      size_tensor(t, *traits);
      h.tensors.push_back(std::move(t));
    }
    in_.set_tensor("");
  }

  void size_tensor(GgufTensorInfo& t, const GgmlTypeTraits& traits) const {
    std::uint64_t elements = 1;
    for (std::uint64_t d : t.dims) {
      if (d == 0) {
        header_error(display_, t.name, "has a dimension of 0 in " + format_dims(t.dims));
      }
      if (__builtin_mul_overflow(elements, d, &elements)) {
        header_error(display_, t.name,
                     "dims " + format_dims(t.dims) + " overflow 64 bits of elements");
      }
    }
    if (t.dims[0] % traits.block_size != 0) {
      header_error(display_, t.name,
                   "dims[0] (the row length) is " + std::to_string(t.dims[0]) +
                       ", not a multiple of " + std::string(traits.name) + "'s block of " +
                       std::to_string(traits.block_size) + " elements");
    }
    const std::uint64_t row_blocks = t.dims[0] / traits.block_size;
    std::uint64_t row_bytes = 0;
    if (__builtin_mul_overflow(row_blocks, std::uint64_t{traits.type_size}, &row_bytes) ||
        __builtin_mul_overflow(row_bytes, elements / t.dims[0], &t.nbytes)) {
      header_error(display_, t.name,
                   "dims " + format_dims(t.dims) + " of " + std::string(traits.name) +
                       " overflow 64 bits of bytes");
    }
  }

  void place_tensors(GgufHeader& h) const {
    for (GgufTensorInfo& t : h.tensors) {
      if (t.relative_offset % h.alignment != 0) {
        header_error(display_, t.name,
                     "data offset " + std::to_string(t.relative_offset) +
                         " is not a multiple of the alignment (" + std::to_string(h.alignment) +
                         ")");
      }
      std::uint64_t end = 0;
      if (__builtin_add_overflow(h.data_offset, t.relative_offset, &t.offset) ||
          __builtin_add_overflow(t.offset, t.nbytes, &end) || end > h.file_size) {
        header_error(display_, t.name,
                     "bytes [data + " + std::to_string(t.relative_offset) + ", +" +
                         std::to_string(t.nbytes) + ") run past the end of the file (" +
                         std::to_string(h.file_size) + " bytes, data section at " +
                         std::to_string(h.data_offset) + ")");
      }
    }
    // Duplicate names, found by sorting positions by name (no second copy of them).
    std::vector<std::uint32_t> by_name(h.tensors.size());
    std::iota(by_name.begin(), by_name.end(), 0u);
    std::sort(by_name.begin(), by_name.end(), [&](std::uint32_t a, std::uint32_t b) {
      return h.tensors[a].name < h.tensors[b].name;
    });
    for (std::size_t i = 1; i < by_name.size(); ++i) {
      if (h.tensors[by_name[i]].name == h.tensors[by_name[i - 1]].name) {
        header_error(display_, h.tensors[by_name[i]].name,
                     "two tensors have this name (tensor infos " +
                         std::to_string(std::min(by_name[i], by_name[i - 1])) + " and " +
                         std::to_string(std::max(by_name[i], by_name[i - 1])) + ")");
      }
    }
    std::stable_sort(
        h.tensors.begin(), h.tensors.end(),
        [](const GgufTensorInfo& a, const GgufTensorInfo& b) { return a.offset < b.offset; });
    for (std::size_t i = 1; i < h.tensors.size(); ++i) {
      const GgufTensorInfo& prev = h.tensors[i - 1];
      const GgufTensorInfo& t = h.tensors[i];
      if (t.offset < prev.offset + prev.nbytes) {
        header_error(display_, t.name,
                     "bytes [" + std::to_string(t.offset) + ", " +
                         std::to_string(t.offset + t.nbytes) + ") overlap tensor '" + prev.name +
                         "' [" + std::to_string(prev.offset) + ", " +
                         std::to_string(prev.offset + prev.nbytes) + ")");
      }
    }
  }

  Cursor& in_;
  const std::string& display_;
  const GgufParseOptions& options_;
  std::uint64_t kept_left_;
};

}  // namespace

std::string_view gguf_value_type_name(GgufValueType type) {
  switch (type) {
    case GgufValueType::kU8:
      return "u8";
    case GgufValueType::kI8:
      return "i8";
    case GgufValueType::kU16:
      return "u16";
    case GgufValueType::kI16:
      return "i16";
    case GgufValueType::kU32:
      return "u32";
    case GgufValueType::kI32:
      return "i32";
    case GgufValueType::kF32:
      return "f32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kU64:
      return "u64";
    case GgufValueType::kI64:
      return "i64";
    case GgufValueType::kF64:
      return "f64";
  }
  return "unknown";
}

std::optional<std::uint64_t> GgufValue::as_uint() const {
  switch (type) {
    case GgufValueType::kU8:
    case GgufValueType::kU16:
    case GgufValueType::kU32:
    case GgufValueType::kU64:
      return u;
    case GgufValueType::kI8:
    case GgufValueType::kI16:
    case GgufValueType::kI32:
    case GgufValueType::kI64:
      if (i >= 0) {
        return static_cast<std::uint64_t>(i);
      }
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

std::optional<double> GgufValue::as_double() const {
  switch (type) {
    case GgufValueType::kF32:
    case GgufValueType::kF64:
      return f;
    case GgufValueType::kI8:
    case GgufValueType::kI16:
    case GgufValueType::kI32:
    case GgufValueType::kI64:
      return static_cast<double>(i);
    case GgufValueType::kU8:
    case GgufValueType::kU16:
    case GgufValueType::kU32:
    case GgufValueType::kU64:
      return static_cast<double>(u);
    default:
      return std::nullopt;
  }
}

std::optional<bool> GgufValue::as_bool() const {
  if (type != GgufValueType::kBool) {
    return std::nullopt;
  }
  return u != 0;
}

std::optional<std::string_view> GgufValue::as_string() const {
  if (type != GgufValueType::kString) {
    return std::nullopt;
  }
  return std::string_view(s);
}

std::string GgufValue::describe() const {
  const std::string name(gguf_value_type_name(type));
  switch (type) {
    case GgufValueType::kString:
      return name + " " + quoted(s.substr(0, 60));
    case GgufValueType::kArray:
      return "array of " + std::to_string(count) + " " +
             std::string(gguf_value_type_name(element_type));
    case GgufValueType::kBool:
      return u != 0 ? "bool true" : "bool false";
    case GgufValueType::kF32:
    case GgufValueType::kF64: {
      std::string text = std::to_string(f);
      return name + " " + text;
    }
    case GgufValueType::kI8:
    case GgufValueType::kI16:
    case GgufValueType::kI32:
    case GgufValueType::kI64:
      return name + " " + std::to_string(i);
    default:
      return name + " " + std::to_string(u);
  }
}

GgufValue GgufValue::of_uint(GgufValueType type, std::uint64_t v) {
  GgufValue out;
  out.type = type;
  out.u = v;
  return out;
}

GgufValue GgufValue::of_int(GgufValueType type, std::int64_t v) {
  GgufValue out;
  out.type = type;
  out.i = v;
  return out;
}

GgufValue GgufValue::of_f32(float v) {
  GgufValue out;
  out.type = GgufValueType::kF32;
  out.f = v;
  return out;
}

GgufValue GgufValue::of_f64(double v) {
  GgufValue out;
  out.type = GgufValueType::kF64;
  out.f = v;
  return out;
}

GgufValue GgufValue::of_bool(bool v) {
  GgufValue out;
  out.type = GgufValueType::kBool;
  out.u = v ? 1 : 0;
  return out;
}

GgufValue GgufValue::of_string(std::string v) {
  GgufValue out;
  out.type = GgufValueType::kString;
  out.s = std::move(v);
  return out;
}

GgufValue GgufValue::array(GgufValueType element_type, std::vector<GgufValue> elements) {
  GgufValue out;
  out.type = GgufValueType::kArray;
  out.element_type = element_type;
  out.count = elements.size();
  out.kept = true;
  out.elements = std::move(elements);
  return out;
}

std::uint64_t GgufTensorInfo::elements() const {
  std::uint64_t n = 1;
  for (std::uint64_t d : dims) {
    n *= d;  // checked against overflow when the header was parsed
  }
  return n;
}

std::vector<std::uint64_t> GgufTensorInfo::shape() const {
  return std::vector<std::uint64_t>(dims.rbegin(), dims.rend());
}

std::uint64_t GgufTensorInfo::rows() const {
  return dims.empty() ? 0 : elements() / dims[0];
}

const GgufValue* GgufHeader::find(std::string_view key) const {
  auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufHeader::find_tensor(std::string_view name) const {
  for (const GgufTensorInfo& t : tensors) {
    if (t.name == name) {
      return &t;
    }
  }
  return nullptr;
}

std::string GgufHeader::architecture() const {
  const GgufValue* v = find("general.architecture");
  if (v == nullptr || v->type != GgufValueType::kString) {
    return {};
  }
  return v->s;
}

GgufHeader parse_gguf_header(const GgufReadAt& read_at, std::uint64_t file_size,
                             const std::string& display, const GgufParseOptions& options) {
  Cursor cursor(read_at, file_size, display, options.max_metadata_bytes);
  Parser parser(cursor, display, options);
  return parser.parse(file_size);
}

GgufHeader parse_gguf_header(std::span<const std::byte> bytes, const std::string& display,
                             const GgufParseOptions& options) {
  const GgufReadAt read_at = [&](std::uint64_t offset, std::span<std::byte> into) {
    if (offset >= bytes.size()) {
      return std::size_t{0};
    }
    const std::size_t n = std::min<std::size_t>(into.size(), bytes.size() - offset);
    std::memcpy(into.data(), bytes.data() + offset, n);
    return n;
  };
  return parse_gguf_header(read_at, bytes.size(), display, options);
}

GgufHeader read_gguf_header(const File& file, const GgufParseOptions& options) {
  const GgufReadAt read_at = [&](std::uint64_t offset, std::span<std::byte> into) {
    const ReadFullyResult r = read_fully(file.fd(), into, offset);
    if (r.error != 0) {
      throw_errno(Stage::kHeader, file.display(),
                  "pread at offset " + std::to_string(offset + r.bytes), r.error);
    }
    return r.bytes;
  };
  GgufHeader h = parse_gguf_header(read_at, file.size(), file.display(), options);
  h.identity = file.identity();
  return h;
}

GgufHeader read_gguf_header(const std::string& path, const std::string& display,
                            const GgufParseOptions& options) {
  const File file = File::open(path, /*direct=*/false, display);
  return read_gguf_header(file, options);
}

bool has_gguf_magic(std::span<const std::byte> prefix) {
  return prefix.size() >= 4 && std::memcmp(prefix.data(), "GGUF", 4) == 0;
}

TensorInfo to_tensor_info(const GgufTensorInfo& tensor, const std::string& file) {
  TensorInfo t;
  t.name = tensor.name;
  t.file = file;
  t.offset = tensor.offset;
  t.nbytes = tensor.nbytes;
  t.shape = tensor.shape();
  if (const std::optional<DType> dtype = ggml_dtype(tensor.type)) {
    t.dtype = *dtype;
  } else {
    t.dtype = DType::kU8;
    t.shape.back() = tensor.row_bytes();
  }
  return t;
}

}  // namespace ferry::io
