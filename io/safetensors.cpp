// safetensors header and index parsing, validated with the reference
// implementation's rules, and the cross-file CheckpointIndex.
#include "io/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <unordered_set>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/json_depth.hpp"
#include "io/read_fully.hpp"
#include "io/safetensors_internal.hpp"

namespace ferry::io {
namespace {

using nlohmann::json;

[[noreturn]] void header_error(const std::string& file, const std::string& tensor,
                               const std::string& rule) {
  throw Error(Stage::kHeader, file, tensor, rule);
}

// nlohmann's own DOM builder driven through SAX, counting the object keys it sees
// (and, when `names` is set, keeping each open object's keys to name a duplicate).
// A DOM callback would do the same check, but nlohmann's callback parser walks the
// parent object at every object end, which made a 16,000-tensor header take 25 s.
class KeyCountingSax {
 public:
  KeyCountingSax(json& doc, bool names) : dom_(doc, /*allow_exceptions=*/true), names_(names) {}

  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(json::number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& text) {
    return dom_.number_float(v, text);
  }
  bool string(json::string_t& v) { return dom_.string(v); }
  bool binary(json::binary_t& v) { return dom_.binary(v); }
  bool start_object(std::size_t n) {
    if (names_) {
      open_.emplace_back();
    }
    return dom_.start_object(n);
  }
  bool key(json::string_t& k) {
    ++keys_;
    if (names_ && !open_.back().insert(k).second && duplicate_.empty()) {
      duplicate_ = k;
    }
    return dom_.key(k);
  }
  bool end_object() {
    if (names_) {
      open_.pop_back();
    }
    return dom_.end_object();
  }
  bool start_array(std::size_t n) { return dom_.start_array(n); }
  bool end_array() { return dom_.end_array(); }
  template <class Exception>
  bool parse_error(std::size_t position, const std::string& token, const Exception& e) {
    return dom_.parse_error(position, token, e);  // throws e
  }

  std::uint64_t keys() const { return keys_; }
  const std::string& duplicate() const { return duplicate_; }

 private:
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  bool names_;
  std::uint64_t keys_ = 0;
  std::vector<std::unordered_set<std::string>> open_;
  std::string duplicate_;
};

// Members of every object in `doc`, walked without recursion (a hostile header may
// nest deeper than the stack allows).
std::uint64_t object_members(const json& doc) {
  std::uint64_t members = 0;
  std::vector<const json*> todo{&doc};
  while (!todo.empty()) {
    const json* v = todo.back();
    todo.pop_back();
    if (v->is_object()) {
      members += v->size();
    }
    if (v->is_structured()) {
      for (const json& child : *v) {
        if (child.is_structured()) {
          todo.push_back(&child);
        }
      }
    }
  }
  return members;
}

}  // namespace

namespace detail {

// Parses JSON text rejecting duplicate keys at every depth (nlohmann keeps the last
// one silently; the reference implementation refuses them), in time linear in the
// text up to the log factor of nlohmann's std::map objects: a document has a
// duplicate exactly when its objects hold fewer members than keys were parsed, and
// only then is it parsed again, keeping names, to say which key it was.
json parse_json_no_duplicates(std::string_view text, Stage stage, const std::string& file) {
  // nlohmann stops at a NUL byte as if the input ended there; JSON never contains
  // a raw NUL, so refuse it rather than accept "{}\0garbage".
  if (auto nul = text.find('\0'); nul != std::string_view::npos) {
    throw Error(stage, file, "",
                "JSON does not parse (NUL byte at offset " + std::to_string(nul) + ")");
  }
  if (json_depth(text) > kMaxJsonDepth) {
    throw Error(stage, file, "", json_too_deep_rule() + " (a header or index needs 3)");
  }
  json doc;
  try {
    KeyCountingSax sax(doc, /*names=*/false);
    json::sax_parse(text.begin(), text.end(), &sax);
    if (object_members(doc) != sax.keys()) {
      json again;
      KeyCountingSax named(again, /*names=*/true);
      json::sax_parse(text.begin(), text.end(), &named);
      throw Error(stage, file, "", "duplicate key '" + named.duplicate() + "' in JSON");
    }
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number beyond a double ("1e400"), which
    // nlohmann reports by throwing from the parser.
    std::string what = e.what();
    // nlohmann reports ill-formed UTF-8 as a lexer error; say so plainly.
    if (what.find("UTF-8") != std::string::npos || what.find("utf-8") != std::string::npos) {
      throw Error(stage, file, "", "JSON is not valid UTF-8 (" + what + ")");
    }
    throw Error(stage, file, "", "JSON does not parse (" + what + ")");
  }
  return doc;
}

std::string describe(const json& v) {
  std::string s = v.dump();
  if (s.size() > 40) {
    s = s.substr(0, 37) + "...";
  }
  return s;
}

}  // namespace detail

namespace {

using detail::describe;
using detail::parse_json_no_duplicates;

// A non-negative integer that fits in 64 bits, or an error naming what it is.
std::uint64_t unsigned_field(const json& v, const std::string& file, const std::string& tensor,
                             const std::string& what) {
  if (v.is_number_unsigned()) {
    return v.get<std::uint64_t>();
  }
  if (v.is_number_integer()) {
    header_error(file, tensor, what + " " + describe(v) + " is negative");
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && d >= 0) {
      header_error(file, tensor, what + " " + describe(v) + " does not fit in 64 bits");
    }
    header_error(file, tensor, what + " " + describe(v) + " is not an integer");
  }
  header_error(file, tensor, what + " " + describe(v) + " is not a number");
}

bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

// One tensor entry as the three parsers read it: 48 bytes and no allocation of its
// own, its name and shape held in its Entries' arena and dimension pool. A header
// of a million entries is read into a few large buffers instead of millions of
// small strings and vectors (issue 31, item 13); the TensorInfo records are made
// once, at the end, from these.
struct RawEntry {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t nbytes = 0;
  std::uint32_t name_at = 0;  // in Entries::names
  std::uint32_t name_size = 0;
  std::uint32_t dims_at = 0;  // in Entries::dims
  std::uint32_t dims_size = 0;
  DType dtype = DType::kU8;
};

// Offsets fit the 32-bit fields: names and dimensions are each fewer than the
// header's bytes.
static_assert(kMaxHeaderBytes < 0xffffffffu);

// A header's entries: the records, every name back to back in one arena, every
// shape back to back in one pool, and the metadata.
struct Entries {
  std::vector<RawEntry> list;
  std::string names;
  std::vector<std::uint64_t> dims;
  std::map<std::string, std::string> metadata;

  // Starts an entry named `name`; its dimensions follow with add_dim.
  RawEntry& start(std::string_view name) {
    RawEntry& e = list.emplace_back();
    e.name_at = static_cast<std::uint32_t>(names.size());
    e.name_size = static_cast<std::uint32_t>(name.size());
    e.dims_at = static_cast<std::uint32_t>(dims.size());
    names.append(name);
    return e;
  }
  // A dimension of the entry started last.
  void add_dim(std::uint64_t d) {
    dims.push_back(d);
    ++list.back().dims_size;
  }
  std::string_view name(const RawEntry& e) const {
    return std::string_view(names).substr(e.name_at, e.name_size);
  }
  std::string name_string(const RawEntry& e) const { return std::string(name(e)); }
  std::vector<std::uint64_t> shape(const RawEntry& e) const {
    return std::vector<std::uint64_t>(dims.begin() + e.dims_at,
                                      dims.begin() + e.dims_at + e.dims_size);
  }
};

void parse_entry(Entries& out, const std::string& name, const json& v, const std::string& file) {
  if (!v.is_object()) {
    header_error(file, name, "entry is not an object (got " + describe(v) + ")");
  }
  RawEntry& e = out.start(name);
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) {
    header_error(file, name, "missing or non-string \"dtype\"");
  }
  auto parsed = parse_dtype(dt->get<std::string>());
  if (!parsed) {
    header_error(file, name, "unknown dtype '" + dt->get<std::string>() + "'");
  }
  e.dtype = *parsed;
  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) {
    header_error(file, name, "missing or non-array \"shape\"");
  }
  std::uint64_t elements = 1;
  for (const auto& d : *sh) {
    std::uint64_t dim = unsigned_field(d, file, name, "shape dimension");
    out.add_dim(dim);
    if (mul_overflows(elements, dim, &elements)) {
      header_error(file, name, "element count of shape " + describe(*sh) + " overflows 64 bits");
    }
  }
  std::uint64_t nbytes = 0;
  if (mul_overflows(elements, dtype_size(e.dtype), &nbytes)) {
    header_error(file, name, "byte size of shape " + describe(*sh) + " overflows 64 bits");
  }
  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2) {
    header_error(file, name, "missing \"data_offsets\" or not a [begin, end] pair");
  }
  e.begin = unsigned_field((*off)[0], file, name, "data_offsets begin");
  e.end = unsigned_field((*off)[1], file, name, "data_offsets end");
  if (e.end < e.begin) {
    header_error(file, name,
                 "data_offsets end " + std::to_string(e.end) + " is before begin " +
                     std::to_string(e.begin));
  }
  if (e.end - e.begin != nbytes) {
    header_error(file, name,
                 "data_offsets span " + std::to_string(e.end - e.begin) + " bytes but " +
                     std::string(dtype_name(e.dtype)) + " x " + format_dims(out.shape(e)) +
                     " needs " + std::to_string(nbytes));
  }
  e.nbytes = nbytes;
}

// The document path's parse_entry rules for an entry the fast paths read (the last
// one started): all three fields, end not before begin, and a span of exactly the
// shape's bytes. Sets nbytes; false when a rule is broken (the caller then leaves
// the header to the next path, whose errors name the rule).
bool complete_entry(Entries& entries, bool all_fields) {
  RawEntry& e = entries.list.back();
  if (!all_fields || e.end < e.begin) {
    return false;
  }
  std::uint64_t n = dtype_size(e.dtype);
  for (std::uint32_t i = 0; i < e.dims_size; ++i) {
    if (mul_overflows(n, entries.dims[e.dims_at + i], &n)) {
      return false;
    }
  }
  if (e.end - e.begin != n) {
    return false;
  }
  e.nbytes = n;
  return true;
}

// The common case without a document: a SAX pass that fills the entries straight
// from a well-formed header. It accepts only what the document path below accepts
// and yields the same entries; at the first thing it does not expect (a duplicate
// key, a negative or fractional number, a bad dtype or span, malformed JSON), it
// gives up and the document path runs instead, so every error keeps its words. An
// entry field the format does not define is skipped, as the document path ignores
// it, checking only that its objects repeat no key: a valid header never builds a
// document (which cost about 1 KiB per entry, issue 31 item 13).
class HeaderSax {
 public:
  Entries entries;

  bool null() { return skipped_scalar(); }
  bool boolean(bool) { return skipped_scalar(); }
  bool number_integer(json::number_integer_t) { return skipped_scalar(); }
  bool number_float(json::number_float_t, const json::string_t&) { return skipped_scalar(); }
  bool binary(json::binary_t&) { return false; }
  bool number_unsigned(json::number_unsigned_t v) {
    if (state_ == State::kShape) {
      entries.add_dim(v);
      return true;
    }
    if (state_ == State::kOffsets && offsets_ < 2) {
      RawEntry& e = entries.list.back();
      (offsets_++ == 0 ? e.begin : e.end) = v;
      return true;
    }
    return skipped_scalar();
  }
  bool string(json::string_t& v) {
    if (state_ == State::kMetaValue) {
      state_ = State::kMetaKey;
      return entries.metadata.emplace(std::move(key_), std::move(v)).second;
    }
    if (state_ == State::kDtype) {
      std::optional<DType> dtype = parse_dtype(v);
      if (!dtype) {
        return false;
      }
      entries.list.back().dtype = *dtype;
      state_ = State::kEntryKey;
      return true;
    }
    return skipped_scalar();
  }
  bool start_object(std::size_t) {
    switch (state_) {
      case State::kStart:
        state_ = State::kTopKey;
        return true;
      case State::kMetaStart:
        state_ = State::kMetaKey;
        return true;
      case State::kEntryStart:
        entries.start(key_);
        seen_ = 0;
        unknown_keys_.clear();
        state_ = State::kEntryKey;
        return true;
      case State::kSkip:
        skip_keys_.emplace_back();
        skip_object_.push_back(true);
        return true;
      default:
        return false;
    }
  }
  bool key(json::string_t& k) {
    switch (state_) {
      case State::kTopKey:
        if (k == "__metadata__") {
          if (have_metadata_) {
            return false;
          }
          have_metadata_ = true;
          state_ = State::kMetaStart;
        } else {
          key_ = std::move(k);
          state_ = State::kEntryStart;
        }
        return true;
      case State::kMetaKey:
        key_ = std::move(k);
        state_ = State::kMetaValue;
        return true;
      case State::kEntryKey:
        return entry_key(k);
      case State::kSkip:
        return skip_keys_.back().insert(std::move(k)).second;
      default:
        return false;
    }
  }
  bool end_object() {
    switch (state_) {
      case State::kTopKey:
        state_ = State::kDone;
        return true;
      case State::kMetaKey:
        state_ = State::kTopKey;
        return true;
      case State::kEntryKey:
        state_ = State::kTopKey;
        return finish_entry();
      case State::kSkip:
        skip_keys_.pop_back();
        return end_skipped();
      default:
        return false;
    }
  }
  bool start_array(std::size_t) {
    if (state_ == State::kShapeStart) {
      state_ = State::kShape;
      return true;
    }
    if (state_ == State::kOffsetsStart) {
      state_ = State::kOffsets;
      offsets_ = 0;
      return true;
    }
    if (state_ == State::kSkip) {
      skip_object_.push_back(false);
      return true;
    }
    return false;
  }
  bool end_array() {
    if (state_ == State::kShape || (state_ == State::kOffsets && offsets_ == 2)) {
      state_ = State::kEntryKey;
      return true;
    }
    if (state_ == State::kSkip) {
      return end_skipped();
    }
    return false;
  }
  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception&) {
    return false;
  }

  // True when the whole text was one well-formed header this reader accepts.
  bool done() const { return state_ == State::kDone; }

 private:
  enum class State {
    kStart, kTopKey, kMetaStart, kMetaKey, kMetaValue, kEntryStart, kEntryKey, kDtype,
    kShapeStart, kShape, kOffsetsStart, kOffsets, kSkip, kDone
  };
  static constexpr unsigned kSeenDtype = 1, kSeenShape = 2, kSeenOffsets = 4;

  bool entry_key(json::string_t& k) {
    unsigned field = 0;
    if (k == "dtype") {
      field = kSeenDtype;
      state_ = State::kDtype;
    } else if (k == "shape") {
      field = kSeenShape;
      state_ = State::kShapeStart;
    } else if (k == "data_offsets") {
      field = kSeenOffsets;
      state_ = State::kOffsetsStart;
    } else {
      // A field the format does not define: its value is skipped, once.
      if (std::find(unknown_keys_.begin(), unknown_keys_.end(), k) != unknown_keys_.end()) {
        return false;
      }
      unknown_keys_.push_back(std::move(k));
      state_ = State::kSkip;
      return true;
    }
    if ((seen_ & field) != 0) {
      return false;  // a repeated field: the document path names the duplicate
    }
    seen_ |= field;
    return true;
  }

  // A scalar: the whole value of a skipped field, or a part of one.
  bool skipped_scalar() {
    if (state_ != State::kSkip) {
      return false;
    }
    if (skip_object_.empty()) {
      state_ = State::kEntryKey;
    }
    return true;
  }
  bool end_skipped() {
    skip_object_.pop_back();
    if (skip_object_.empty()) {
      state_ = State::kEntryKey;
    }
    return true;
  }

  // The document path's parse_entry rules; false sends the header there.
  bool finish_entry() {
    return complete_entry(entries, seen_ == (kSeenDtype | kSeenShape | kSeenOffsets));
  }

  State state_ = State::kStart;
  bool have_metadata_ = false;
  std::string key_;
  unsigned seen_ = 0;
  int offsets_ = 0;
  std::vector<std::string> unknown_keys_;  // of the entry being read
  // Inside a skipped value: whether each open container is an object, and each open
  // object's keys (a duplicate at any depth is the document path's error).
  std::vector<bool> skip_object_;
  std::vector<std::unordered_set<std::string>> skip_keys_;
};

// Fills `into` from `off`: false when the file ends first; a failed pread is an
// error at the header stage.
bool read_header_bytes(int fd, std::span<std::byte> into, std::uint64_t off,
                       const std::string& display) {
  const ReadFullyResult r = read_fully(fd, into, off);
  if (r.error != 0) {
    throw_errno(Stage::kHeader, display, "pread", r.error);
  }
  return r.bytes == into.size();
}

// The plainest headers, the ones writers produce, without any JSON library: a
// byte scanner for {"__metadata__": {str: str}, name: {"dtype": str, "shape":
// [uint...], "data_offsets": [uint, uint]}, ...} whose strings hold printable
// ASCII without escapes and whose numbers are plain digits. It accepts a strict
// subset of what HeaderSax accepts, with the same rules (finish_entry's), and gives
// up at anything else (an escape, a non-ASCII byte, a sign, a fraction, an unknown
// key, a duplicate field), so the SAX pass, and past it the document path with its
// errors, takes over. nlohmann's lexer reads a character at a time through an
// input adapter and copies every string; this reads the bytes in place
// (docs/PERFORMANCE.md, "Header parsing", has the times).
class PlainHeaderScanner {
 public:
  explicit PlainHeaderScanner(std::string_view text) : p_(text.data()), end_(p_ + text.size()) {}

  Entries entries;

  bool scan() {
    if (!expect('{')) {
      return false;
    }
    if (peek() == '}') {
      ++p_;
      return rest_is_space();
    }
    bool have_metadata = false;
    while (true) {
      std::string_view key;
      if (!string(key) || !expect(':')) {
        return false;
      }
      if (key == "__metadata__") {
        if (have_metadata || !metadata_object()) {
          return false;
        }
        have_metadata = true;
      } else if (!entry(key)) {
        return false;
      }
      const char c = next();
      if (c == '}') {
        return rest_is_space();
      }
      if (c != ',') {
        return false;
      }
    }
  }

 private:
  void skip_space() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) {
      ++p_;
    }
  }
  char peek() {
    skip_space();
    return p_ < end_ ? *p_ : '\0';
  }
  char next() {
    skip_space();
    return p_ < end_ ? *p_++ : '\0';
  }
  bool expect(char c) { return next() == c; }
  bool rest_is_space() {
    skip_space();
    return p_ == end_;
  }
  // A string of printable ASCII without escapes, as a view into the text.
  bool string(std::string_view& out) {
    if (next() != '"') {
      return false;
    }
    const char* begin = p_;
    while (p_ < end_ && *p_ != '"') {
      const auto c = static_cast<unsigned char>(*p_);
      if (c < 0x20 || c >= 0x7f || c == '\\') {
        return false;
      }
      ++p_;
    }
    if (p_ == end_) {
      return false;
    }
    out = std::string_view(begin, static_cast<std::size_t>(p_ - begin));
    ++p_;
    return true;
  }
  // Plain digits, no leading zero, no sign, fraction or exponent, within 64 bits.
  bool number(std::uint64_t& out) {
    skip_space();
    const char* begin = p_;
    std::uint64_t v = 0;
    while (p_ < end_ && *p_ >= '0' && *p_ <= '9') {
      if (mul_overflows(v, 10, &v) || __builtin_add_overflow(v, std::uint64_t(*p_ - '0'), &v)) {
        return false;
      }
      ++p_;
    }
    if (p_ == begin || (p_ - begin > 1 && *begin == '0')) {
      return false;
    }
    if (p_ < end_ && (*p_ == '.' || *p_ == 'e' || *p_ == 'E')) {
      return false;
    }
    out = v;
    return true;
  }
  bool metadata_object() {
    if (!expect('{')) {
      return false;
    }
    if (peek() == '}') {
      ++p_;
      return true;
    }
    while (true) {
      std::string_view key;
      std::string_view value;
      if (!string(key) || !expect(':') || !string(value) ||
          !entries.metadata.emplace(std::string(key), std::string(value)).second) {
        return false;
      }
      const char c = next();
      if (c == '}') {
        return true;
      }
      if (c != ',') {
        return false;
      }
    }
  }
  bool entry(std::string_view name) {
    if (!expect('{')) {
      return false;
    }
    entries.start(name);
    unsigned seen = 0;
    constexpr unsigned kDtype = 1, kShape = 2, kOffsets = 4;
    while (true) {
      std::string_view key;
      if (!string(key) || !expect(':')) {
        return false;
      }
      if (key == "dtype" && (seen & kDtype) == 0) {
        std::string_view text;
        if (!string(text)) {
          return false;
        }
        std::optional<DType> dtype = parse_dtype(text);
        if (!dtype) {
          return false;
        }
        entries.list.back().dtype = *dtype;
        seen |= kDtype;
      } else if (key == "shape" && (seen & kShape) == 0) {
        if (!expect('[')) {
          return false;
        }
        if (peek() == ']') {
          ++p_;
        } else {
          while (true) {
            std::uint64_t dim = 0;
            if (!number(dim)) {
              return false;
            }
            entries.add_dim(dim);
            const char c = next();
            if (c == ']') {
              break;
            }
            if (c != ',') {
              return false;
            }
          }
        }
        seen |= kShape;
      } else if (key == "data_offsets" && (seen & kOffsets) == 0) {
        RawEntry& e = entries.list.back();
        if (!expect('[') || !number(e.begin) || !expect(',') || !number(e.end) || !expect(']')) {
          return false;
        }
        seen |= kOffsets;
      } else {
        return false;
      }
      const char c = next();
      if (c == '}') {
        break;
      }
      if (c != ',') {
        return false;
      }
    }
    return complete_entry(entries, seen == (kDtype | kShape | kOffsets));
  }

  const char* p_;
  const char* end_;
};

// Tensor names are the top-level keys: the fast paths check them for duplicates
// here, with a table of positions rather than a sort of the names.
bool unique_names(const Entries& entries) {
  NameTable table;
  table.reserve(entries.list.size());
  auto name_of = [&](std::uint32_t i) { return entries.name(entries.list[i]); };
  for (std::size_t i = 0; i < entries.list.size(); ++i) {
    if (table.insert(static_cast<std::uint32_t>(i), name_of)) {
      return false;
    }
  }
  return true;
}

// Sorts the entries by offset (ties by name, the document path's order), checks
// that they tile the data region exactly, and makes the header's tensors of them.
SafetensorsHeader tile_entries(SafetensorsHeader h, Entries entries, std::uint64_t n) {
  const std::string& display = h.file;
  const std::uint64_t file_size = h.file_size;
  std::vector<RawEntry>& list = entries.list;
  // "\u0000" is valid JSON, but a name with a NUL byte cannot name a parameter, and
  // every C string it meets (logs, paths, an engine's API) would cut it short.
  if (entries.names.find('\0') != std::string::npos) {
    for (const RawEntry& e : list) {
      if (const auto nul = entries.name(e).find('\0'); nul != std::string_view::npos) {
        std::string shown = entries.name_string(e);
        for (char& c : shown) {
          c = c == '\0' ? '?' : c;
        }
        header_error(display, shown, "tensor name has a NUL byte (at " + std::to_string(nul) + ")");
      }
    }
  }
  std::sort(list.begin(), list.end(), [&](const RawEntry& a, const RawEntry& b) {
    if (a.begin != b.begin) {
      return a.begin < b.begin;
    }
    return a.end != b.end ? a.end < b.end : entries.name(a) < entries.name(b);
  });
  const std::uint64_t data_size = file_size - 8 - n;
  std::uint64_t expected = 0;
  const RawEntry* prev = nullptr;
  for (const RawEntry& e : list) {
    if (e.begin > expected) {
      header_error(display, entries.name_string(e),
                   "gap of " + std::to_string(e.begin - expected) + " bytes before its data (at " +
                       std::to_string(expected) + "): tensors must tile the data region");
    }
    if (e.begin < expected) {
      header_error(display, entries.name_string(e),
                   "data [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                       ") overlaps tensor '" + (prev ? entries.name_string(*prev) : std::string()) +
                       "'");
    }
    if (e.end > data_size) {
      header_error(display, entries.name_string(e),
                   "data_offsets end " + std::to_string(e.end) + " is past the end of the file (" +
                       "data region holds " + std::to_string(data_size) + " bytes)");
    }
    expected = e.end;
    prev = &e;
  }
  if (expected != data_size) {
    header_error(display, "",
                 std::to_string(data_size - expected) +
                     " trailing bytes after the last tensor's data (file is " +
                     std::to_string(file_size) + " bytes, tensors end at " +
                     std::to_string(8 + n + expected) + ")");
  }
  h.metadata = std::move(entries.metadata);
  h.tensors.resize(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    const RawEntry& e = list[i];
    TensorInfo& t = h.tensors[i];
    t.name.assign(entries.name(e));
    t.dtype = e.dtype;
    t.shape.assign(entries.dims.begin() + e.dims_at, entries.dims.begin() + e.dims_at + e.dims_size);
    t.file = display;
    t.offset = h.header_bytes + e.begin;
    t.nbytes = e.nbytes;
  }
  return h;
}

}  // namespace

std::uint64_t TensorInfo::elements() const {
  std::uint64_t n = 1;
  for (auto d : shape) {
    n *= d;
  }
  return n;
}

namespace detail {

// The checks every path shares: the header's length against the limit and the file.
SafetensorsHeader header_frame(std::string_view text, std::uint64_t file_size,
                               const std::string& display) {
  const std::uint64_t n = text.size();
  if (n > kMaxHeaderBytes) {
    header_error(display, "",
                 "header length " + std::to_string(n) + " exceeds the limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (8 + n > file_size) {
    header_error(display, "",
                 "header length " + std::to_string(n) + " runs past the end of the file (" +
                     std::to_string(file_size) + " bytes)");
  }
  SafetensorsHeader h;
  h.file = display;
  h.file_size = file_size;
  h.header_bytes = 8 + n;
  return h;
}

// A fast path's entries as the header: nullopt for a duplicate name (the document
// path names it), else tiled like the document path's.
static std::optional<SafetensorsHeader> fast_header(SafetensorsHeader h, Entries entries,
                                                    std::uint64_t n) {
  if (!unique_names(entries)) {
    return std::nullopt;
  }
  return tile_entries(std::move(h), std::move(entries), n);
}

std::optional<SafetensorsHeader> parse_header_plain(std::string_view text, std::uint64_t file_size,
                                                    const std::string& display) {
  SafetensorsHeader h = header_frame(text, file_size, display);
  PlainHeaderScanner scanner(text);
  if (!scanner.scan()) {
    return std::nullopt;
  }
  return fast_header(std::move(h), std::move(scanner.entries), text.size());
}

std::optional<SafetensorsHeader> parse_header_sax(std::string_view text, std::uint64_t file_size,
                                                  const std::string& display) {
  SafetensorsHeader h = header_frame(text, file_size, display);
  if (text.find('\0') != std::string_view::npos) {
    return std::nullopt;
  }
  HeaderSax sax;
  if (!json::sax_parse(text.begin(), text.end(), &sax) || !sax.done()) {
    return std::nullopt;
  }
  return fast_header(std::move(h), std::move(sax.entries), text.size());
}

SafetensorsHeader parse_header_document(std::string_view text, std::uint64_t file_size,
                                        const std::string& display) {
  SafetensorsHeader h = header_frame(text, file_size, display);
  const std::uint64_t n = text.size();
  Entries entries;
  json doc = parse_json_no_duplicates(text, Stage::kHeader, display);
  if (!doc.is_object()) {
    header_error(display, "", "header JSON is not an object (got " + describe(doc) + ")");
  }
  entries.list.reserve(doc.size());
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) {
        header_error(display, "", "__metadata__ is not an object of strings");
      }
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          header_error(display, "",
                       "__metadata__ must map strings to strings (key '" + m.key() + "' is " +
                           describe(*m) + ")");
        }
        entries.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    parse_entry(entries, it.key(), *it, display);
  }
  return tile_entries(std::move(h), std::move(entries), n);
}

}  // namespace detail

SafetensorsHeader parse_safetensors_header(std::string_view text, std::uint64_t file_size,
                                           const std::string& display) {
  // The plain scanner, then the SAX pass, then the document path with its errors:
  // each accepts a subset of the next and gives the same result where it accepts.
  if (auto h = detail::parse_header_plain(text, file_size, display)) {
    return std::move(*h);
  }
  if (auto h = detail::parse_header_sax(text, file_size, display)) {
    return std::move(*h);
  }
  return detail::parse_header_document(text, file_size, display);
}

namespace {

// The header of the open file `fd`, `file_size` bytes long: 8 + n bytes with pread.
SafetensorsHeader read_header_at(int fd, std::uint64_t file_size, const FileIdentity& identity,
                                 const std::string& display) {
  std::byte len_bytes[8];
  if (file_size < 8 || !read_header_bytes(fd, len_bytes, 0, display)) {
    header_error(display, "",
                 "file is " + std::to_string(file_size) +
                     " bytes, too short for the 8-byte header length");
  }
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) {
    n = (n << 8) | std::to_integer<std::uint64_t>(len_bytes[i]);
  }
  if (n > kMaxHeaderBytes) {
    header_error(display, "",
                 "header length " + std::to_string(n) + " exceeds the limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (n > file_size - 8) {
    header_error(display, "",
                 "header length " + std::to_string(n) + " runs past the end of the file (" +
                     std::to_string(file_size) + " bytes)");
  }
  std::string text(n, '\0');
  if (!read_header_bytes(fd, std::as_writable_bytes(std::span(text.data(), text.size())), 8,
                         display)) {
    header_error(display, "", "file ended while reading the header (truncated)");
  }
  SafetensorsHeader h = parse_safetensors_header(text, file_size, display);
  h.identity = identity;
  return h;
}

}  // namespace

SafetensorsHeader read_safetensors_header(const std::string& path, const std::string& display) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw_errno(Stage::kHeader, display, "open", errno);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    throw_errno(Stage::kHeader, display, "fstat", errno);
  }
  if (!S_ISREG(st.st_mode)) {
    header_error(display, "", "not a regular file");
  }
  return read_header_at(fd, static_cast<std::uint64_t>(st.st_size), identity_of(&st), display);
}

SafetensorsHeader read_safetensors_header(const File& file) {
  return read_header_at(file.fd(), file.size(), file.identity(), file.display());
}

}  // namespace ferry::io
