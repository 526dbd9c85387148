// TorchWriter: data.pkl as CPython's pickler writes torch.save's state dict, the ZIP
// records as miniz writes them for PyTorch's stream writer, the tensors' data
// streamed through a small coalescing buffer into an OutputFile with a running CRC.
#include "io/torch_writer.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/crc32.hpp"
#include "common/error.hpp"

namespace ferry::io {
namespace {

// Small members and headers would otherwise cost one system call each.
constexpr std::size_t kBufferBytes = std::size_t{1} << 20;
// PyTorch aligns every record's data to 64 bytes (its .storage_alignment).
constexpr std::uint64_t kAlignment = 64;
constexpr std::uint64_t kMax32 = 0xFFFFFFFFu;
constexpr std::uint64_t kMaxTorchSize =
    static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
// CPython's pickle writes a dict's items in batches of this many (BATCHSIZE).
constexpr std::size_t kPickleBatch = 1000;

constexpr std::uint32_t kLocalHeaderSig = 0x04034b50;
constexpr std::uint32_t kDataDescriptorSig = 0x08074b50;
constexpr std::uint32_t kCentralHeaderSig = 0x02014b50;
constexpr std::uint32_t kZip64EndSig = 0x06064b50;
constexpr std::uint32_t kZip64LocatorSig = 0x07064b50;
constexpr std::uint32_t kEndSig = 0x06054b50;
constexpr std::uint16_t kFlagDescriptor = 0x0008;
constexpr std::uint16_t kFlagUtf8 = 0x0800;
constexpr std::uint16_t kZip64ExtraId = 0x0001;
constexpr std::uint16_t kPaddingExtraId = 0x4246;  // "FB", PyTorch's alignment padding
constexpr std::size_t kLocalHeaderBytes = 30;

[[noreturn]] void fail(const std::string& file, const std::string& tensor, std::string rule) {
  throw Error(Stage::kSynth, file, tensor, std::move(rule));
}

void put16(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 2; ++i) {
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
}
void put32(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 4; ++i) {
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
}
void put64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
}

std::span<const std::byte> as_bytes(std::string_view text) {
  return std::as_bytes(std::span<const char>(text.data(), text.size()));
}

std::uint32_t le32(const std::byte* p) {
  return std::to_integer<std::uint32_t>(p[0]) | (std::to_integer<std::uint32_t>(p[1]) << 8) |
         (std::to_integer<std::uint32_t>(p[2]) << 16) |
         (std::to_integer<std::uint32_t>(p[3]) << 24);
}

// c10::hash_combine, which PyTorch's writer folds its serialization id with.
std::uint64_t hash_combine(std::uint64_t seed, std::uint64_t value) {
  return seed ^ (value + 0x9e3779b9 + (seed << 6) + (seed >> 2));
}

// ---- what torch calls each dtype ------------------------------------------------

struct TorchType {
  // The typed storage class of torch's module (_rebuild_tensor_v2), or empty.
  std::string_view storage;
  // torch.<dtype> for the dtypes without one (_rebuild_tensor_v3 over an
  // UntypedStorage of bytes).
  std::string_view dtype;
};

TorchType torch_type(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return {"BoolStorage", {}};
    case DType::kU8:
      return {"ByteStorage", {}};
    case DType::kI8:
      return {"CharStorage", {}};
    case DType::kI16:
      return {"ShortStorage", {}};
    case DType::kI32:
      return {"IntStorage", {}};
    case DType::kI64:
      return {"LongStorage", {}};
    case DType::kF16:
      return {"HalfStorage", {}};
    case DType::kBF16:
      return {"BFloat16Storage", {}};
    case DType::kF32:
      return {"FloatStorage", {}};
    case DType::kF64:
      return {"DoubleStorage", {}};
    case DType::kF8E4M3:
      return {{}, "float8_e4m3fn"};
    case DType::kF8E5M2:
      return {{}, "float8_e5m2"};
    case DType::kF8E8M0:
      return {{}, "float8_e8m0fnu"};
    case DType::kU16:
      return {{}, "uint16"};
    case DType::kU32:
      return {{}, "uint32"};
    case DType::kU64:
      return {{}, "uint64"};
  }
  return {};
}

// ---- checks and sizes --------------------------------------------------------------

// Whether `text` is UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF), as a pickle's BINUNICODE must be.
bool is_utf8(std::string_view text) {
  for (std::size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    std::size_t n = 0;
    std::uint32_t cp = 0;
    std::uint32_t min = 0;
    if (b < 0x80) {
      n = 1, cp = b;
    } else if ((b & 0xE0) == 0xC0) {
      n = 2, cp = b & 0x1F, min = 0x80;
    } else if ((b & 0xF0) == 0xE0) {
      n = 3, cp = b & 0x0F, min = 0x800;
    } else if ((b & 0xF8) == 0xF0) {
      n = 4, cp = b & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (i + n > text.size()) {
      return false;
    }
    for (std::size_t k = 1; k < n; ++k) {
      const auto c = static_cast<unsigned char>(text[i + k]);
      if ((c & 0xC0) != 0x80) {
        return false;
      }
      cp = (cp << 6) | (c & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n;
  }
  return true;
}

void check_name(const std::string& name, const std::string& file) {
  if (name.empty()) {
    fail(file, "", "tensor names must not be empty");
  }
  if (!is_utf8(name)) {
    fail(file, name, "the tensor name is not valid UTF-8 (a pickle's str is)");
  }
}

std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const TorchEntry& entry,
                          const std::string& file) {
  if (b != 0 && a > kMaxTorchSize / b) {
    fail(file, entry.name, "the shape's sizes overflow torch's 64-bit signed sizes");
  }
  return a * b;
}

// Elements, with every dimension and the byte size checked against int64 (a
// dimension of 0 makes it 0, however large the others).
std::uint64_t element_count(const TorchEntry& entry, const std::string& file) {
  for (std::uint64_t dim : entry.shape) {
    if (dim > kMaxTorchSize) {
      fail(file, entry.name, "dimension " + std::to_string(dim) + " does not fit torch's int64");
    }
  }
  if (std::find(entry.shape.begin(), entry.shape.end(), 0) != entry.shape.end()) {
    return 0;
  }
  std::uint64_t n = 1;
  for (std::uint64_t dim : entry.shape) {
    n = checked_mul(n, dim, entry, file);
  }
  checked_mul(n, dtype_size(entry.dtype), entry, file);
  return n;
}

// The contiguous row-major strides torch gives the shape: a dimension of size 0
// counts as 1 (torch.zeros(3, 0, 2).stride() == (2, 2, 1)).
std::vector<std::uint64_t> contiguous_strides(const TorchEntry& entry, const std::string& file) {
  std::vector<std::uint64_t> strides(entry.shape.size());
  std::uint64_t s = 1;
  for (std::size_t d = entry.shape.size(); d-- > 0;) {
    strides[d] = s;
    s = d > 0 ? checked_mul(s, std::max<std::uint64_t>(entry.shape[d], 1), entry, file) : s;
  }
  return strides;
}

// ---- the pickle ------------------------------------------------------------------

// The opcodes of protocol 2 that torch.save's state dict uses.
namespace op {
constexpr char kProto = '\x80';
constexpr char kGlobal = 'c';
constexpr char kBinput = 'q';
constexpr char kLongBinput = 'r';
constexpr char kBinget = 'h';
constexpr char kLongBinget = 'j';
constexpr char kEmptyTuple = ')';
constexpr char kReduce = 'R';
constexpr char kMark = '(';
constexpr char kBinunicode = 'X';
constexpr char kBinint1 = 'K';
constexpr char kBinint2 = 'M';
constexpr char kBinint = 'J';
constexpr char kLong1 = '\x8a';
constexpr char kTuple = 't';
constexpr char kTuple1 = '\x85';
constexpr char kTuple2 = '\x86';
constexpr char kTuple3 = '\x87';
constexpr char kBinpersid = 'Q';
constexpr char kNewfalse = '\x89';
constexpr char kSetitem = 's';
constexpr char kSetitems = 'u';
constexpr char kStop = '.';
}  // namespace op

// CPython's pickler memoizes by object identity. Which of torch.save's objects are
// one object: each class and dtype (a GLOBAL), and the constants 'storage' and 'cpu'
// of torch's code. Every other string (a tensor named "1" and storage key '1' too,
// as torch 2.14 under CPython 3.11 writes them) and tuple is a new object; ints and
// the empty tuple are never memoized.
class Pickler {
 public:
  void op(char c) { out_.push_back(c); }

  void global(std::string_view module, std::string_view name) {
    std::string key = std::string(module) + "\n" + std::string(name);
    if (auto it = globals_.find(key); it != globals_.end()) {
      get(it->second);
      return;
    }
    op(op::kGlobal);
    out_ += key;
    out_.push_back('\n');
    globals_.emplace(std::move(key), put());
  }

  // A str of the state dict (a tensor name, a storage key): a new object each time.
  void string(std::string_view text) { unicode(text); }

  // A str constant of torch's code: one object however often it is pickled.
  void constant(std::string_view text, std::optional<std::uint32_t>& memo) {
    if (memo) {
      get(*memo);
    } else {
      memo = unicode(text);
    }
  }

  // As save_long: BININT1, BININT2 or BININT while it fits a signed 32-bit int,
  // else LONG1 of the two's complement bytes, one more than the bit length needs.
  void integer(std::uint64_t v) {
    if (v < 0x100) {
      op(op::kBinint1);
      out_.push_back(static_cast<char>(v));
    } else if (v < 0x10000) {
      op(op::kBinint2);
      put16(out_, v);
    } else if (v <= 0x7FFFFFFF) {
      op(op::kBinint);
      put32(out_, v);
    } else {
      const auto bits = static_cast<std::size_t>(std::bit_width(v));
      const std::size_t n = bits / 8 + 1;
      op(op::kLong1);
      out_.push_back(static_cast<char>(n));
      for (std::size_t i = 0; i < n; ++i) {
        out_.push_back(static_cast<char>(i < 8 ? (v >> (8 * i)) & 0xff : 0));
      }
    }
  }

  // A tuple of ints: EMPTY_TUPLE, TUPLE1-3, or MARK ... TUPLE; memoized when not empty.
  void tuple(const std::vector<std::uint64_t>& values) {
    if (values.empty()) {
      op(op::kEmptyTuple);
      return;
    }
    if (values.size() > 3) {
      op(op::kMark);
    }
    for (std::uint64_t v : values) {
      integer(v);
    }
    static constexpr char kSmall[] = {op::kTuple1, op::kTuple2, op::kTuple3};
    op(values.size() > 3 ? op::kTuple : kSmall[values.size() - 1]);
    put();
  }

  std::uint32_t put() {
    const std::uint32_t index = next_++;
    if (index < 0x100) {
      op(op::kBinput);
      out_.push_back(static_cast<char>(index));
    } else {
      op(op::kLongBinput);
      put32(out_, index);
    }
    return index;
  }

  std::string take() { return std::move(out_); }

 private:
  std::uint32_t unicode(std::string_view text) {
    op(op::kBinunicode);
    put32(out_, text.size());
    out_ += text;
    return put();
  }

  void get(std::uint32_t index) {
    if (index < 0x100) {
      op(op::kBinget);
      out_.push_back(static_cast<char>(index));
    } else {
      op(op::kLongBinget);
      put32(out_, index);
    }
  }

  std::string out_;
  std::uint32_t next_ = 0;
  std::map<std::string, std::uint32_t> globals_;
};

// One item of the state dict: name, then the tensor as Tensor.__reduce_ex__ gives
// it, (_rebuild_tensor_v2, (storage, 0, size, stride, False, OrderedDict())), the
// storage a persistent id ('storage', type, key, 'cpu', numel); v3 appends the dtype
// and takes an UntypedStorage whose numel is the byte count.
void pickle_tensor(Pickler& p, const TorchEntry& entry, std::size_t key,
                   std::optional<std::uint32_t>& storage_memo,
                   std::optional<std::uint32_t>& cpu_memo, const std::string& file) {
  const TorchType type = torch_type(entry.dtype);
  const std::uint64_t elements = element_count(entry, file);
  const std::vector<std::uint64_t> strides = contiguous_strides(entry, file);
  const bool v3 = type.storage.empty();
  p.string(entry.name);
  p.global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  p.op(op::kMark);
  p.op(op::kMark);
  p.constant("storage", storage_memo);
  if (v3) {
    p.global("torch.storage", "UntypedStorage");
  } else {
    p.global("torch", type.storage);
  }
  p.string(std::to_string(key));
  p.constant("cpu", cpu_memo);
  p.integer(v3 ? elements * dtype_size(entry.dtype) : elements);
  p.op(op::kTuple);
  p.put();
  p.op(op::kBinpersid);
  p.integer(0);  // storage offset
  p.tuple(entry.shape);
  p.tuple(strides);
  p.op(op::kNewfalse);  // requires_grad
  // backward_hooks: an empty OrderedDict (its class is always memo 0).
  p.global("collections", "OrderedDict");
  p.op(op::kEmptyTuple);
  p.op(op::kReduce);
  p.put();
  if (v3) {
    p.global("torch", type.dtype);
  }
  p.op(op::kTuple);
  p.put();
  p.op(op::kReduce);
  p.put();
}

}  // namespace

std::string torch_state_dict_pickle(const std::vector<TorchEntry>& entries,
                                    const std::string& file) {
  std::unordered_set<std::string_view> seen;
  for (const auto& entry : entries) {
    check_name(entry.name, file);
    if (!seen.insert(entry.name).second) {
      fail(file, entry.name, "tensor declared twice");
    }
  }
  Pickler p;
  p.op(op::kProto);
  p.op('\x02');
  p.global("collections", "OrderedDict");
  p.op(op::kEmptyTuple);
  p.op(op::kReduce);
  p.put();
  std::optional<std::uint32_t> storage_memo;
  std::optional<std::uint32_t> cpu_memo;
  // As _batch_setitems: MARK ... SETITEMS per batch of up to 1000 items, but a
  // batch of one item is written as a lone SETITEM.
  for (std::size_t first = 0; first < entries.size(); first += kPickleBatch) {
    const std::size_t end = std::min(entries.size(), first + kPickleBatch);
    if (end - first > 1) {
      p.op(op::kMark);
    }
    for (std::size_t i = first; i < end; ++i) {
      pickle_tensor(p, entries[i], i, storage_memo, cpu_memo, file);
    }
    p.op(end - first > 1 ? op::kSetitems : op::kSetitem);
  }
  p.op(op::kStop);
  return p.take();
}

std::string torch_archive_name(const std::string& path) {
  // As caffe2's basename(): after the last '/' or '\', less the last extension.
  const std::size_t slash = path.find_last_of("/\\");
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (const std::size_t dot = name.find_last_of('.'); dot != std::string::npos) {
    name.resize(dot);
  }
  return name.empty() ? "archive" : name;
}

// ---- the writer --------------------------------------------------------------------

TorchWriter::TorchWriter(std::string path, Stage stage, std::string what,
                         TorchWriterOptions options)
    : path_(std::move(path)),
      stage_(stage),
      what_(std::move(what)),
      options_(options),
      archive_(torch_archive_name(path_)) {}

// file_'s destructor removes an unfinished file's temporary.
TorchWriter::~TorchWriter() = default;

void TorchWriter::fail(const std::string& tensor, std::string rule) const {
  throw Error(stage_, path_, tensor, what_.empty() ? std::move(rule) : what_ + ": " + rule);
}

void TorchWriter::add(std::string name, DType dtype, std::vector<std::uint64_t> shape) {
  if (state_ != State::kDeclaring) {
    fail(name, "add() after begin(): every tensor must be declared before data is written");
  }
  if (names_.count(name) != 0) {
    fail(name, "tensor declared twice");
  }
  TorchEntry entry{std::move(name), dtype, std::move(shape)};
  std::uint64_t bytes = 0;
  try {
    check_name(entry.name, path_);
    bytes = element_count(entry, path_) * dtype_size(dtype);
    contiguous_strides(entry, path_);
  } catch (const Error& e) {
    fail(e.tensor(), e.rule());  // with this writer's stage and setting
  }
  if (bytes > std::numeric_limits<std::uint64_t>::max() - data_bytes_) {
    fail(entry.name, "data bytes overflow 64 bits");
  }
  data_bytes_ += bytes;
  sizes_.push_back(bytes);
  names_.insert(entry.name);
  entries_.push_back(std::move(entry));
}

bool TorchWriter::zip64_size(std::uint64_t size) const {
  return options_.force_zip64 || size >= kMax32;
}

bool TorchWriter::zip64_offset(std::uint64_t offset) const {
  return options_.force_zip64 || offset >= kMax32;
}

void TorchWriter::begin() {
  if (state_ != State::kDeclaring) {
    fail("", "begin() called twice");
  }
  const std::string pickle = torch_state_dict_pickle(entries_, path_);
  file_.emplace(path_, stage_, what_);
  state_ = State::kWriting;
  buffer_.reserve(kBufferBytes);
  members_.reserve(entries_.size() + 6);
  const std::string prefix = archive_ + "/";
  put_member(prefix + "data.pkl", as_bytes(pickle));
  put_member(prefix + ".format_version", as_bytes("1"));
  put_member(prefix + ".storage_alignment", as_bytes(std::to_string(kAlignment)));
  put_member(prefix + "byteorder", as_bytes("little"));
  advance();
}

void TorchWriter::advance() {
  while (tensor_left_ == 0) {
    if (tensor_open_) {
      close_member();  // the tensor just completed, or an empty one
      tensor_open_ = false;
      ++tensor_;
    }
    if (tensor_ == entries_.size()) {
      return;
    }
    open_member(archive_ + "/data/" + std::to_string(tensor_), sizes_[tensor_]);
    tensor_open_ = true;
    tensor_left_ = sizes_[tensor_];
  }
}

void TorchWriter::put_member(std::string name, std::span<const std::byte> bytes) {
  open_member(std::move(name), bytes.size());
  members_.back().crc = crc32(0, bytes);
  take_head(bytes);
  emit(bytes);
  close_member();
}

void TorchWriter::take_head(std::span<const std::byte> bytes) {
  const std::size_t n = std::min(bytes.size(), head_.size() - head_size_);
  std::copy_n(bytes.begin(), n, head_.begin() + static_cast<std::ptrdiff_t>(head_size_));
  head_size_ += n;
  // PyTorch's writer takes any write of 8 bytes or more that starts with the data
  // descriptor's signature for a descriptor, and folds the "CRC" after it into the
  // id: miniz writes a member's data in one call, so data that starts that way does.
  if (n > 0 && head_size_ == head_.size() && le32(head_.data()) == kDataDescriptorSig) {
    combined_crc_ = hash_combine(combined_crc_, le32(head_.data() + 4));
  }
}

void TorchWriter::open_member(std::string name, std::uint64_t size) {
  Member m{std::move(name), offset_, size, 0};
  head_size_ = 0;
  std::string extra;
  const bool big_size = zip64_size(size);
  const bool big_offset = zip64_offset(m.offset);
  if (big_size || big_offset) {
    // miniz's local ZIP64 field: the size and a compressed size of 0 (the data
    // descriptor has it), and the header's own offset.
    put16(extra, kZip64ExtraId);
    put16(extra, (big_size ? 16 : 0) + (big_offset ? 8 : 0));
    if (big_size) {
      put64(extra, size);
      put64(extra, 0);
    }
    if (big_offset) {
      put64(extra, m.offset);
    }
  }
  const std::uint64_t start = m.offset + kLocalHeaderBytes + m.name.size() + extra.size() + 4;
  const std::uint64_t pad = (kAlignment - start % kAlignment) % kAlignment;
  put16(extra, kPaddingExtraId);
  put16(extra, pad);
  extra.append(pad, 'Z');

  std::string header;
  header.reserve(kLocalHeaderBytes + m.name.size() + extra.size());
  put32(header, kLocalHeaderSig);
  put16(header, 0);  // version needed, as miniz writes for stored members
  put16(header, kFlagUtf8 | (size > 0 ? kFlagDescriptor : 0));
  put16(header, 0);  // stored
  put16(header, 0);  // time
  put16(header, 0);  // date
  put32(header, 0);  // CRC, sizes: in the data descriptor
  put32(header, 0);
  put32(header, 0);
  put16(header, m.name.size());
  put16(header, extra.size());
  header += m.name;
  header += extra;
  members_.push_back(std::move(m));
  emit(header);
}

void TorchWriter::close_member() {
  const Member& m = members_.back();
  if (m.size == 0) {
    return;  // miniz writes no descriptor (and no flag for one) for an empty member
  }
  std::string dd;
  put32(dd, kDataDescriptorSig);
  put32(dd, m.crc);
  combined_crc_ = hash_combine(combined_crc_, m.crc);
  if (zip64_size(m.size) || zip64_offset(m.offset)) {
    put64(dd, m.size);
    put64(dd, m.size);
  } else {
    put32(dd, m.size);
    put32(dd, m.size);
  }
  emit(dd);
}

void TorchWriter::write(std::span<const std::byte> bytes) {
  if (state_ != State::kWriting) {
    fail("", state_ == State::kDeclaring ? "write() before begin()"
                                         : "write() after finish() or a failed write");
  }
  if (bytes.size() > data_bytes_ - written_) {
    fail(tensor_ < entries_.size() ? entries_[tensor_].name : "",
         "write of " + std::to_string(bytes.size()) + " bytes at data offset " +
             std::to_string(written_) + " exceeds the declared " + std::to_string(data_bytes_) +
             " data bytes");
  }
  while (!bytes.empty()) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(bytes.size(), tensor_left_));
    members_.back().crc = crc32(members_.back().crc, bytes.first(n));
    take_head(bytes.first(n));
    emit(bytes.first(n));
    written_ += n;
    tensor_left_ -= n;
    bytes = bytes.subspan(n);
    advance();
  }
}

void TorchWriter::finish(Sync sync) {
  if (state_ != State::kWriting) {
    fail("", state_ == State::kDeclaring ? "finish() before begin()"
                                         : "finish() after finish() or a failed write");
  }
  if (written_ != data_bytes_) {
    const std::uint64_t size = sizes_[tensor_];
    fail(entries_[tensor_].name,
         "only " + std::to_string(written_) + " of " + std::to_string(data_bytes_) +
             " declared data bytes were written (this tensor has " +
             std::to_string(size - tensor_left_) + " of " + std::to_string(size) + ")");
  }
  put_member(archive_ + "/version", as_bytes("3\n"));
  if (std::optional<std::string> id = serialization_id()) {
    put_member(archive_ + "/.data/serialization_id", as_bytes(*id));
  }
  put_central_directory();
  try {
    flush_buffer();
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

std::optional<std::string> TorchWriter::serialization_id() const {
#if defined(__GLIBCXX__)
  // PyTorch's writer folds the std::hash of every record name (less the archive
  // name) in the iteration order of its std::unordered_set of them, then prints it
  // and the folded CRCs as two 20-digit numbers. The same container and hash of the
  // same standard library give the same order and values.
  static_assert(sizeof(std::size_t) == 8, "torch's id is folded in 64 bits");
  std::unordered_set<std::string> records;
  for (const Member& m : members_) {
    records.insert(m.name.substr(archive_.size() + 1));
  }
  std::uint64_t names = 0;
  for (const std::string& record : records) {
    names = hash_combine(names, std::hash<std::string>{}(record));
  }
  char id[41];
  std::snprintf(id, sizeof id, "%020llu%020llu", static_cast<unsigned long long>(names),
                static_cast<unsigned long long>(combined_crc_));
  return std::string(id, 40);
#else
  // Another standard library's hash and container order would give another id than
  // torch's; torch.load only logs it, so the record is left out.
  return std::nullopt;
#endif
}

void TorchWriter::put_central_directory() {
  const std::uint64_t directory = offset_;
  for (const Member& m : members_) {
    const bool big_size = zip64_size(m.size);
    const bool big_offset = zip64_offset(m.offset);
    std::string extra;
    if (big_size || big_offset) {
      put16(extra, kZip64ExtraId);
      put16(extra, (big_size ? 16 : 0) + (big_offset ? 8 : 0));
      if (big_size) {
        put64(extra, m.size);  // uncompressed, then compressed
        put64(extra, m.size);
      }
      if (big_offset) {
        put64(extra, m.offset);
      }
    }
    std::string record;
    put32(record, kCentralHeaderSig);
    put16(record, 0);  // version made by, as miniz
    put16(record, 0);  // version needed
    put16(record, kFlagUtf8 | (m.size > 0 ? kFlagDescriptor : 0));
    put16(record, 0);  // stored
    put16(record, 0);  // time
    put16(record, 0);  // date
    put32(record, m.crc);
    put32(record, big_size ? kMax32 : m.size);
    put32(record, big_size ? kMax32 : m.size);
    put16(record, m.name.size());
    put16(record, extra.size());
    put16(record, 0);  // comment
    put16(record, 0);  // disk
    put16(record, 0);  // internal attributes
    put32(record, 0);  // external attributes
    put32(record, big_offset ? kMax32 : m.offset);
    record += m.name;
    record += extra;
    emit(record);
  }
  const std::uint64_t directory_bytes = offset_ - directory;
  const std::uint64_t count = members_.size();
  const bool force = options_.force_zip64;

  // PyTorch's writer is always in ZIP64 mode: these two records end every archive.
  const std::uint64_t zip64_end = offset_;
  std::string end;
  put32(end, kZip64EndSig);
  put64(end, 44);      // the record's size after this field
  put16(end, 0x031E);  // made by: Unix, 3.0 (miniz's)
  put16(end, 45);      // needed: 4.5, ZIP64
  put32(end, 0);       // this disk
  put32(end, 0);       // the directory's disk
  put64(end, count);
  put64(end, count);
  put64(end, directory_bytes);
  put64(end, directory);
  put32(end, kZip64LocatorSig);
  put32(end, 0);  // the ZIP64 record's disk
  put64(end, zip64_end);
  put32(end, 1);  // disks
  put32(end, kEndSig);
  put16(end, 0);
  put16(end, 0);
  put16(end, force ? 0xFFFF : std::min<std::uint64_t>(count, 0xFFFF));
  put16(end, force ? 0xFFFF : std::min<std::uint64_t>(count, 0xFFFF));
  put32(end, force ? kMax32 : std::min(directory_bytes, kMax32));
  put32(end, force ? kMax32 : std::min(directory, kMax32));
  put16(end, 0);  // comment
  emit(end);
}

void TorchWriter::emit(const std::string& bytes) {
  emit(as_bytes(bytes));
}

void TorchWriter::emit(std::span<const std::byte> bytes) {
  if (buffer_.size() + bytes.size() > kBufferBytes) {
    flush_buffer();
  }
  if (bytes.size() >= kBufferBytes) {
    write_all(bytes);
  } else {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  }
  offset_ += bytes.size();
}

void TorchWriter::flush_buffer() {
  if (!buffer_.empty()) {
    write_all(buffer_);
    buffer_.clear();
  }
}

void TorchWriter::write_all(std::span<const std::byte> bytes) {
  try {
    file_->write(bytes);
  } catch (const Error&) {
    fail_and_close();
    throw;
  }
}

void TorchWriter::fail_and_close() {
  state_ = State::kFailed;
  buffer_.clear();
  file_.reset();  // closes, removes the temporary
}

}  // namespace ferry::io
