#include "io/pickle.hpp"

#include <array>
#include <cstdio>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "common/error.hpp"

namespace ferry::io {
namespace {

// What an allowed global is, once named.
enum class Global : std::uint8_t {
  kOrderedDict,
  kRebuildV2,
  kRebuildV3,
  kRebuildParameter,
  kDevice,
  kTypedStorage,    // torch.FloatStorage, ...: `dtype` says which
  kUntypedStorage,  // torch.storage.UntypedStorage
  kDType,           // torch.float16, ...: `dtype` says which
};

enum class Kind : std::uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kTuple,
  kList,
  kDict,
  kGlobal,
  kStorage,
  kTensor,
  kDevice,
};

struct Value;
using Ref = std::shared_ptr<Value>;

struct Value {
  Kind kind = Kind::kNone;
  // Inside another object (or given to a call): it may not change any more, which
  // is what keeps the object graph a tree of bounded depth, free of cycles.
  bool frozen = false;
  int depth = 1;
  std::int64_t integer = 0;
  std::string text;  // a string; a global's "module.name"
  Global global = Global::kOrderedDict;
  DType dtype = DType::kU8;  // of a storage type, a dtype object, a storage, a tensor
  std::vector<Ref> items;    // a tuple or list; a dict as key, value, key, value, ...
  // A storage's key and numel, or a whole tensor: apart, since most values are
  // numbers and strings and torch's pickler keeps every one in its memo.
  std::unique_ptr<PickledTensor> tensor;
};

struct AllowedGlobal {
  std::string_view module;
  std::string_view name;
  Global global;
  DType dtype;
};

// torch.load(weights_only=True)'s allow-list, as far as a state dict of weights
// uses it (torch/_weights_only_unpickler.py), each storage type and dtype object
// with the ferry dtype it stands for.
constexpr std::array kAllowed{
    AllowedGlobal{"collections", "OrderedDict", Global::kOrderedDict, DType::kU8},
    AllowedGlobal{"torch._utils", "_rebuild_tensor_v2", Global::kRebuildV2, DType::kU8},
    AllowedGlobal{"torch._utils", "_rebuild_tensor_v3", Global::kRebuildV3, DType::kU8},
    AllowedGlobal{"torch._utils", "_rebuild_parameter", Global::kRebuildParameter, DType::kU8},
    AllowedGlobal{"torch", "device", Global::kDevice, DType::kU8},
    AllowedGlobal{"torch.storage", "UntypedStorage", Global::kUntypedStorage, DType::kU8},
    AllowedGlobal{"torch", "UntypedStorage", Global::kUntypedStorage, DType::kU8},
    AllowedGlobal{"torch", "BoolStorage", Global::kTypedStorage, DType::kBool},
    AllowedGlobal{"torch", "ByteStorage", Global::kTypedStorage, DType::kU8},
    AllowedGlobal{"torch", "CharStorage", Global::kTypedStorage, DType::kI8},
    AllowedGlobal{"torch", "ShortStorage", Global::kTypedStorage, DType::kI16},
    AllowedGlobal{"torch", "IntStorage", Global::kTypedStorage, DType::kI32},
    AllowedGlobal{"torch", "LongStorage", Global::kTypedStorage, DType::kI64},
    AllowedGlobal{"torch", "HalfStorage", Global::kTypedStorage, DType::kF16},
    AllowedGlobal{"torch", "BFloat16Storage", Global::kTypedStorage, DType::kBF16},
    AllowedGlobal{"torch", "FloatStorage", Global::kTypedStorage, DType::kF32},
    AllowedGlobal{"torch", "DoubleStorage", Global::kTypedStorage, DType::kF64},
    AllowedGlobal{"torch", "bool", Global::kDType, DType::kBool},
    AllowedGlobal{"torch", "uint8", Global::kDType, DType::kU8},
    AllowedGlobal{"torch", "int8", Global::kDType, DType::kI8},
    AllowedGlobal{"torch", "uint16", Global::kDType, DType::kU16},
    AllowedGlobal{"torch", "int16", Global::kDType, DType::kI16},
    AllowedGlobal{"torch", "uint32", Global::kDType, DType::kU32},
    AllowedGlobal{"torch", "int32", Global::kDType, DType::kI32},
    AllowedGlobal{"torch", "uint64", Global::kDType, DType::kU64},
    AllowedGlobal{"torch", "int64", Global::kDType, DType::kI64},
    AllowedGlobal{"torch", "float16", Global::kDType, DType::kF16},
    AllowedGlobal{"torch", "bfloat16", Global::kDType, DType::kBF16},
    AllowedGlobal{"torch", "float32", Global::kDType, DType::kF32},
    AllowedGlobal{"torch", "float64", Global::kDType, DType::kF64},
    AllowedGlobal{"torch", "float8_e4m3fn", Global::kDType, DType::kF8E4M3},
    AllowedGlobal{"torch", "float8_e5m2", Global::kDType, DType::kF8E5M2},
    AllowedGlobal{"torch", "float8_e8m0fnu", Global::kDType, DType::kF8E8M0},
};

// Opcodes a state dict never needs, by name, so that the error says what was met.
std::string_view opcode_name(unsigned char op) {
  switch (op) {
    case 'i':
      return "INST";
    case 'o':
      return "OBJ";
    case 0x81:
      return "NEWOBJ";
    case 0x92:
      return "NEWOBJ_EX";
    case 0x93:
      return "STACK_GLOBAL";
    case 'P':
      return "PERSID";
    case 'I':
      return "INT";
    case 'L':
      return "LONG";
    case 'F':
      return "FLOAT";
    case 'S':
      return "STRING";
    case 'V':
      return "UNICODE";
    case 'g':
      return "GET";
    case 'p':
      return "PUT";
    case 0x82:
      return "EXT1";
    case 0x83:
      return "EXT2";
    case 0x84:
      return "EXT4";
    case 'B':
      return "BINBYTES";
    case 'C':
      return "SHORT_BINBYTES";
    case 0x8c:
      return "SHORT_BINUNICODE";
    case 0x8d:
      return "BINUNICODE8";
    case 0x8e:
      return "BINBYTES8";
    case 0x8f:
      return "EMPTY_SET";
    case 0x90:
      return "ADDITEMS";
    case 0x91:
      return "FROZENSET";
    case 0x94:
      return "MEMOIZE";
    case 0x95:
      return "FRAME";
    case 0x96:
      return "BYTEARRAY8";
    case 0x97:
      return "NEXT_BUFFER";
    case 0x98:
      return "READONLY_BUFFER";
    default:
      return "";
  }
}

std::string_view kind_name(Kind kind) {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "a bool";
    case Kind::kInt:
      return "an int";
    case Kind::kFloat:
      return "a float";
    case Kind::kString:
      return "a string";
    case Kind::kTuple:
      return "a tuple";
    case Kind::kList:
      return "a list";
    case Kind::kDict:
      return "a dict";
    case Kind::kGlobal:
      return "a global";
    case Kind::kStorage:
      return "a storage";
    case Kind::kTensor:
      return "a tensor";
    case Kind::kDevice:
      return "a device";
  }
  return "a value";
}

class Unpickler {
 public:
  Unpickler(std::string_view bytes, const std::string& display) : in_(bytes), display_(display) {}

  std::vector<PickledTensor> run() {
    bool stopped = false;
    while (!stopped) {
      if (pos_ >= in_.size()) {
        fail("the pickle ends without STOP");
      }
      op_at_ = pos_;
      const auto op = static_cast<unsigned char>(in_[pos_++]);
      stopped = step(op);
    }
    if (pos_ != in_.size()) {
      fail(std::to_string(in_.size() - pos_) + " bytes follow STOP");
    }
    if (stack_.size() != 1 || !marks_.empty()) {
      fail("STOP leaves " + std::to_string(stack_.size()) + " values and " +
           std::to_string(marks_.size()) + " marks on the stack, not one value");
    }
    return state_dict(*stack_.back());
  }

 private:
  [[noreturn]] void fail(const std::string& rule, const std::string& key = {}) const {
    throw Error(Stage::kHeader, display_, key,
                "pickle byte " + std::to_string(op_at_) + ": " + rule);
  }

  // ---- reading the stream -----------------------------------------------------

  std::uint64_t take_le(std::size_t n) {
    if (in_.size() - pos_ < n) {
      fail("the pickle ends inside an argument");
    }
    std::uint64_t v = 0;
    for (std::size_t i = n; i-- > 0;) {
      v = (v << 8) | static_cast<unsigned char>(in_[pos_ + i]);
    }
    pos_ += n;
    return v;
  }
  std::string_view take_bytes(std::uint64_t n) {
    if (in_.size() - pos_ < n) {
      fail("a string of " + std::to_string(n) + " bytes runs past the end of the pickle");
    }
    std::string_view s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::string_view take_line() {
    const std::size_t end = in_.find('\n', pos_);
    if (end == std::string_view::npos) {
      fail("a GLOBAL name runs past the end of the pickle");
    }
    std::string_view s = in_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }
  // A little-endian two's complement integer of `n` bytes (LONG1, LONG4).
  std::int64_t take_long(std::uint64_t n) {
    if (n > 8) {
      fail("an integer of " + std::to_string(n) + " bytes is wider than 64 bits");
    }
    if (n == 0) {
      return 0;
    }
    std::uint64_t v = take_le(static_cast<std::size_t>(n));
    if (n < 8 && (v >> (8 * n - 1)) != 0) {
      v |= ~std::uint64_t{0} << (8 * n);  // sign-extend
    }
    return static_cast<std::int64_t>(v);
  }

  // ---- the stack -------------------------------------------------------------

  Ref make(Kind kind) {
    auto v = std::make_shared<Value>();
    v->kind = kind;
    return v;
  }
  void push(Ref v) { stack_.push_back(std::move(v)); }
  Ref pop() {
    const std::size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) {
      fail("pops an empty stack (or past a MARK)");
    }
    Ref v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  Ref& top() {
    const std::size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) {
      fail("needs a value on the stack");
    }
    return stack_.back();
  }
  // The values above the last MARK, which is removed.
  std::vector<Ref> pop_mark() {
    if (marks_.empty()) {
      fail("no MARK to pop to");
    }
    const std::size_t at = marks_.back();
    marks_.pop_back();
    std::vector<Ref> items(std::make_move_iterator(stack_.begin() + static_cast<long>(at)),
                           std::make_move_iterator(stack_.end()));
    stack_.resize(at);
    return items;
  }
  // `item` goes inside `into`: it is frozen, and `into` gets deeper.
  void nest(Value& into, const Ref& item) {
    if (item.get() == &into) {
      fail("puts an object inside itself");
    }
    item->frozen = true;
    if (item->depth + 1 > kMaxPickleDepth) {
      fail("objects nest deeper than " + std::to_string(kMaxPickleDepth));
    }
    into.depth = std::max(into.depth, item->depth + 1);
  }
  Ref tuple(std::vector<Ref> items) {
    Ref t = make(Kind::kTuple);
    for (const Ref& item : items) {
      nest(*t, item);
    }
    t->items = std::move(items);
    return t;
  }
  Value& mutable_container(Kind kind, std::string_view op) {
    Value& c = *top();
    if (c.kind != kind) {
      fail(std::string(op) + " on " + std::string(kind_name(c.kind)) + ", not " +
           std::string(kind_name(kind)));
    }
    if (c.frozen) {
      fail(std::string(op) + " changes an object already inside another (or given to a call)");
    }
    return c;
  }
  void add_items(Value& c, std::vector<Ref> items) {
    for (const Ref& item : items) {
      nest(c, item);
    }
    c.items.insert(c.items.end(), std::make_move_iterator(items.begin()),
                   std::make_move_iterator(items.end()));
  }

  // ---- globals, calls and storages -------------------------------------------

  Ref global(std::string_view module, std::string_view name) {
    for (const AllowedGlobal& g : kAllowed) {
      if (g.module == module && g.name == name) {
        Ref v = make(Kind::kGlobal);
        v->global = g.global;
        v->dtype = g.dtype;
        v->text = std::string(module) + "." + std::string(name);
        return v;
      }
    }
    fail("global " + std::string(module) + "." + std::string(name) +
         " is not allowed: a state dict of weights needs only collections.OrderedDict, "
         "torch._utils's tensor rebuilders, torch storage types and dtypes (as "
         "torch.load(weights_only=True)); ferry executes nothing");
  }

  static bool is_int(const Ref& v) { return v->kind == Kind::kInt || v->kind == Kind::kBool; }

  std::vector<std::uint64_t> dims(const Ref& v, std::string_view what) {
    if (v->kind != Kind::kTuple) {
      fail(std::string(what) + " is " + std::string(kind_name(v->kind)) + ", not a tuple");
    }
    std::vector<std::uint64_t> out;
    out.reserve(v->items.size());
    for (const Ref& d : v->items) {
      if (d->kind != Kind::kInt || d->integer < 0) {
        fail(std::string(what) + " holds " +
             (d->kind == Kind::kInt ? "a negative number" : std::string(kind_name(d->kind))));
      }
      out.push_back(static_cast<std::uint64_t>(d->integer));
    }
    return out;
  }

  // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])
  // and _v3(..., hooks, dtype[, metadata]).
  Ref rebuild_tensor(const std::vector<Ref>& args, bool v3) {
    const std::size_t need = v3 ? 7 : 6;
    if (args.size() != need && args.size() != need + 1) {
      fail(std::string(v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2") + " takes " +
           std::to_string(need) + " or " + std::to_string(need + 1) + " arguments, not " +
           std::to_string(args.size()));
    }
    const Ref& storage = args[0];
    if (storage->kind != Kind::kStorage) {
      fail("a tensor's storage is " + std::string(kind_name(storage->kind)));
    }
    if (args[1]->kind != Kind::kInt || args[1]->integer < 0) {
      fail("a tensor's storage offset is not a non-negative int");
    }
    Ref t = make(Kind::kTensor);
    t->tensor = std::make_unique<PickledTensor>(*storage->tensor);  // key, numel, untyped
    t->tensor->dtype = storage->dtype;
    t->tensor->storage_offset = static_cast<std::uint64_t>(args[1]->integer);
    t->tensor->shape = dims(args[2], "a tensor's size");
    t->tensor->stride = dims(args[3], "a tensor's stride");
    if (t->tensor->shape.size() != t->tensor->stride.size()) {
      fail("a tensor's size has " + std::to_string(t->tensor->shape.size()) +
           " dimensions but its stride " + std::to_string(t->tensor->stride.size()));
    }
    if (!is_int(args[4])) {
      fail("a tensor's requires_grad is " + std::string(kind_name(args[4]->kind)));
    }
    if (args[5]->kind != Kind::kDict) {
      fail("a tensor's backward hooks are " + std::string(kind_name(args[5]->kind)) +
           ", not an OrderedDict");
    }
    if (v3) {
      const Ref& dtype = args[6];
      if (dtype->kind != Kind::kGlobal || dtype->global != Global::kDType) {
        fail("_rebuild_tensor_v3's dtype is not a torch dtype");
      }
      if (!storage->tensor->untyped_storage && storage->dtype != dtype->dtype) {
        fail("a " + std::string(dtype_name(storage->dtype)) + " storage is rebuilt as " +
             std::string(dtype_name(dtype->dtype)));
      }
      t->tensor->dtype = dtype->dtype;
    } else if (storage->tensor->untyped_storage) {
      fail("_rebuild_tensor_v2 over an untyped storage (no dtype)");
    }
    return t;
  }

  Ref call(const Ref& callable, const Ref& args_tuple) {
    if (callable->kind != Kind::kGlobal) {
      fail("REDUCE calls " + std::string(kind_name(callable->kind)));
    }
    if (args_tuple->kind != Kind::kTuple) {
      fail("REDUCE's arguments are " + std::string(kind_name(args_tuple->kind)) + ", not a tuple");
    }
    const std::vector<Ref>& args = args_tuple->items;
    switch (callable->global) {
      case Global::kOrderedDict:
        if (!args.empty()) {
          fail("collections.OrderedDict is called with arguments (a state dict's are empty)");
        }
        return make(Kind::kDict);
      case Global::kRebuildV2:
        return rebuild_tensor(args, false);
      case Global::kRebuildV3:
        return rebuild_tensor(args, true);
      case Global::kRebuildParameter:
        if (args.size() != 3 || args[0]->kind != Kind::kTensor) {
          fail("_rebuild_parameter takes (tensor, requires_grad, hooks)");
        }
        return args[0];
      case Global::kDevice:
        if (args.empty() || args.size() > 2 || args[0]->kind != Kind::kString ||
            (args.size() == 2 && args[1]->kind != Kind::kInt)) {
          fail("torch.device takes (type[, index])");
        }
        return make(Kind::kDevice);
      case Global::kTypedStorage:
      case Global::kUntypedStorage:
      case Global::kDType:
        break;
    }
    fail(callable->text + " cannot be called here");
  }

  // BINPERSID: ('storage', storage type, key, location, numel).
  Ref storage(const Ref& pid) {
    const std::vector<Ref>& p = pid->items;
    if (pid->kind != Kind::kTuple || p.size() != 5 || p[0]->kind != Kind::kString ||
        p[0]->text != "storage") {
      fail("a persistent id is not ('storage', type, key, location, numel)");
    }
    if (p[1]->kind != Kind::kGlobal ||
        (p[1]->global != Global::kTypedStorage && p[1]->global != Global::kUntypedStorage)) {
      fail("a persistent id's storage type is not a torch storage type");
    }
    if (p[2]->kind != Kind::kString || p[2]->text.empty()) {
      fail("a persistent id's storage key is not a string");
    }
    if (p[3]->kind != Kind::kString && p[3]->kind != Kind::kDevice) {
      fail("a persistent id's location is not a string");
    }
    if (p[4]->kind != Kind::kInt || p[4]->integer < 0) {
      fail("a persistent id's element count is not a non-negative int");
    }
    Ref s = make(Kind::kStorage);
    s->tensor = std::make_unique<PickledTensor>();
    s->dtype = p[1]->dtype;
    s->tensor->storage_key = p[2]->text;
    s->tensor->storage_numel = static_cast<std::uint64_t>(p[4]->integer);
    s->tensor->untyped_storage = p[1]->global == Global::kUntypedStorage;
    return s;
  }

  // ---- one opcode ------------------------------------------------------------

  void memo_put(std::uint64_t at) {
    if (memo_.size() >= in_.size()) {
      fail("more memo entries than pickle bytes");
    }
    memo_[at] = top();
  }
  void memo_get(std::uint64_t at) {
    auto it = memo_.find(at);
    if (it == memo_.end()) {
      fail("memo entry " + std::to_string(at) + " was never put");
    }
    push(it->second);
  }

  // Returns true at STOP.
  bool step(unsigned char op) {
    switch (op) {
      case 0x80: {  // PROTO
        const std::uint64_t version = take_le(1);
        if (version > 2) {
          fail("pickle protocol " + std::to_string(version) +
               " (a state dict from torch.save uses protocol 2)");
        }
        return false;
      }
      case '.':
        return true;  // STOP
      case '(':
        marks_.push_back(stack_.size());
        return false;
      case '0':
        pop();
        return false;
      case '1':
        pop_mark();
        return false;
      case '2':
        push(top());
        return false;
      case 'N':
        push(make(Kind::kNone));
        return false;
      case 0x88:
      case 0x89: {
        Ref v = make(Kind::kBool);
        v->integer = op == 0x88 ? 1 : 0;
        push(std::move(v));
        return false;
      }
      case 'J':
      case 'K':
      case 'M': {
        Ref v = make(Kind::kInt);
        if (op == 'J') {
          v->integer = static_cast<std::int32_t>(static_cast<std::uint32_t>(take_le(4)));
        } else {
          v->integer = static_cast<std::int64_t>(take_le(op == 'K' ? 1 : 2));
        }
        push(std::move(v));
        return false;
      }
      case 0x8a:
      case 0x8b: {  // LONG1, LONG4: the length first, refused past 8 before any byte is read
        const std::uint64_t n = take_le(op == 0x8a ? 1 : 4);
        Ref v = make(Kind::kInt);
        v->integer = take_long(n);
        push(std::move(v));
        return false;
      }
      case 'G': {  // BINFLOAT: big-endian
        const std::string_view b = take_bytes(8);
        std::uint64_t bits = 0;
        for (char c : b) {
          bits = (bits << 8) | static_cast<unsigned char>(c);
        }
        Ref v = make(Kind::kFloat);
        v->integer = static_cast<std::int64_t>(bits);
        push(std::move(v));
        return false;
      }
      case 'X':
      case 'T':
      case 'U': {  // BINUNICODE, BINSTRING, SHORT_BINSTRING
        const std::uint64_t n = take_le(op == 'U' ? 1 : 4);
        Ref v = make(Kind::kString);
        v->text = std::string(take_bytes(n));
        push(std::move(v));
        return false;
      }
      case ')':
        push(make(Kind::kTuple));
        return false;
      case 't':
        push(tuple(pop_mark()));
        return false;
      case 0x85:
      case 0x86:
      case 0x87: {
        std::vector<Ref> items(op - 0x84);
        for (std::size_t i = items.size(); i-- > 0;) {
          items[i] = pop();
        }
        push(tuple(std::move(items)));
        return false;
      }
      case ']':
      case '}':
        push(make(op == ']' ? Kind::kList : Kind::kDict));
        return false;
      case 'l':
      case 'd': {
        std::vector<Ref> items = pop_mark();
        if (op == 'd' && items.size() % 2 != 0) {
          fail("DICT over an odd number of values");
        }
        Ref c = make(op == 'l' ? Kind::kList : Kind::kDict);
        add_items(*c, std::move(items));
        push(std::move(c));
        return false;
      }
      case 'a': {
        Ref item = pop();
        add_items(mutable_container(Kind::kList, "APPEND"), {std::move(item)});
        return false;
      }
      case 'e': {
        std::vector<Ref> items = pop_mark();
        add_items(mutable_container(Kind::kList, "APPENDS"), std::move(items));
        return false;
      }
      case 's': {
        Ref value = pop();
        Ref key = pop();
        add_items(mutable_container(Kind::kDict, "SETITEM"), {std::move(key), std::move(value)});
        return false;
      }
      case 'u': {
        std::vector<Ref> items = pop_mark();
        if (items.size() % 2 != 0) {
          fail("SETITEMS over an odd number of values");
        }
        add_items(mutable_container(Kind::kDict, "SETITEMS"), std::move(items));
        return false;
      }
      case 'c': {
        const std::string_view module = take_line();
        const std::string_view name = take_line();
        push(global(module, name));
        return false;
      }
      case 'R': {
        Ref args = pop();
        Ref callable = pop();
        args->frozen = true;
        push(call(callable, args));
        return false;
      }
      case 'b': {  // BUILD: only an OrderedDict's state (a state dict's `_metadata`), dropped
        Ref state = pop();
        Value& target = mutable_container(Kind::kDict, "BUILD");
        if (state->kind != Kind::kDict && state->kind != Kind::kTuple &&
            state->kind != Kind::kNone) {
          fail("BUILD sets a dict's state from " + std::string(kind_name(state->kind)));
        }
        nest(target, state);  // checked for depth, then dropped: it holds no weights
        return false;
      }
      case 'Q':
        push(storage(pop()));
        return false;
      case 'h':
        memo_get(take_le(1));
        return false;
      case 'j':
        memo_get(take_le(4));
        return false;
      case 'q':
        memo_put(take_le(1));
        return false;
      case 'r':
        memo_put(take_le(4));
        return false;
      default:
        break;
    }
    const std::string_view name = opcode_name(op);
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", op);
    fail("opcode " + (name.empty() ? std::string(hex) : std::string(name) + " (" + hex + ")") +
         " is not allowed in a state dict");
  }

  std::vector<PickledTensor> state_dict(const Value& top) const {
    if (top.kind != Kind::kDict) {
      fail("the pickle holds " + std::string(kind_name(top.kind)) +
           ", not a state dict (a dict of name to tensor)");
    }
    std::vector<PickledTensor> out;
    out.reserve(top.items.size() / 2);
    std::unordered_set<std::string_view> seen;
    seen.reserve(top.items.size() / 2);
    for (std::size_t i = 0; i < top.items.size(); i += 2) {
      const Value& key = *top.items[i];
      const Value& value = *top.items[i + 1];
      if (key.kind != Kind::kString) {
        fail("a state dict key is " + std::string(kind_name(key.kind)) + ", not a string");
      }
      if (!seen.insert(key.text).second) {
        fail("the state dict sets this key twice", key.text);
      }
      if (value.kind != Kind::kTensor) {
        fail("its value is " + std::string(kind_name(value.kind)) +
                 ", not a tensor (SGLang's pt_weights_iterator would hand it to the model "
                 "as a weight)",
             key.text);
      }
      out.push_back(*value.tensor);
      out.back().name = key.text;
    }
    return out;
  }

  std::string_view in_;
  const std::string& display_;
  std::size_t pos_ = 0;
  std::size_t op_at_ = 0;
  std::vector<Ref> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, Ref> memo_;
};

}  // namespace

std::vector<PickledTensor> parse_state_dict_pickle(std::string_view bytes,
                                                   const std::string& display) {
  return Unpickler(bytes, display).run();
}

}  // namespace ferry::io
