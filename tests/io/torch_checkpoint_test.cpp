// torch.save archives read without executing them (io/pickle.hpp, io/zip_archive.hpp,
// io/torch_checkpoint.hpp): state dicts as torch 2.x pickles them, and the hostile
// ones: globals that run code, opcodes outside protocol 2, deep nesting, huge
// integers, cycles, compressed and overlapping members.
#include "io/torch_checkpoint.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/pickle.hpp"
#include "io/zip_archive.hpp"

namespace ferry::io {
namespace {

// ---- a pickle, opcode by opcode ---------------------------------------------

struct Pickle {
  std::string bytes;

  Pickle& op(unsigned char c) {
    bytes += static_cast<char>(c);
    return *this;
  }
  Pickle& raw(std::string_view s) {
    bytes += s;
    return *this;
  }
  Pickle& le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) {
      bytes += static_cast<char>((v >> (8 * i)) & 0xff);
    }
    return *this;
  }
  Pickle& proto() { return op(0x80).op(2); }
  Pickle& global(std::string_view module, std::string_view name) {
    return op('c').raw(module).raw("\n").raw(name).raw("\n");
  }
  Pickle& str(std::string_view s) { return op('X').le(s.size(), 4).raw(s); }
  Pickle& integer(std::uint64_t v) {
    if (v < 256) {
      return op('K').le(v, 1);
    }
    if (v < 65536) {
      return op('M').le(v, 2);
    }
    return op(0x8a).le(8, 1).le(v, 8);
  }
  Pickle& mark() { return op('('); }
  Pickle& tuple() { return op('t'); }
  Pickle& reduce() { return op('R'); }
  Pickle& ordered_dict() { return global("collections", "OrderedDict").op(')').reduce(); }
  Pickle& dims(const std::vector<std::uint64_t>& d) {
    mark();
    for (std::uint64_t v : d) {
      integer(v);
    }
    return tuple();
  }
  // A tensor as torch 2.x pickles it: _rebuild_tensor_v2 over a typed storage.
  Pickle& tensor_v2(std::string_view storage, std::string_view key, std::uint64_t numel,
                    std::uint64_t offset, const std::vector<std::uint64_t>& shape,
                    const std::vector<std::uint64_t>& stride) {
    global("torch._utils", "_rebuild_tensor_v2").mark();
    mark().str("storage").global("torch", storage).str(key).str("cpu").integer(numel).tuple();
    op('Q').integer(offset).dims(shape).dims(stride).op(0x89).ordered_dict();
    return tuple().reduce();
  }
  Pickle& tensor_v3(std::string_view key, std::uint64_t nbytes, std::string_view dtype,
                    const std::vector<std::uint64_t>& shape,
                    const std::vector<std::uint64_t>& stride) {
    global("torch._utils", "_rebuild_tensor_v3").mark();
    mark().str("storage").global("torch.storage", "UntypedStorage").str(key).str("cpu");
    integer(nbytes).tuple();
    op('Q').integer(0).dims(shape).dims(stride).op(0x89).ordered_dict().global("torch", dtype);
    return tuple().reduce();
  }
  Pickle& stop() { return op('.'); }
};

std::vector<PickledTensor> parse(const Pickle& p) {
  return parse_state_dict_pickle(p.bytes, "x.bin (x/data.pkl)");
}

// The error parse() throws, or "" when it parses.
std::string refusal(const Pickle& p) {
  try {
    parse(p);
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kHeader);
    return e.what();
  }
  return "";
}

// ---- a zip archive of stored members, 64-byte aligned as torch writes --------

struct Member {
  std::string name;
  std::string data;
  std::uint16_t method = 0;
  std::uint64_t claimed = 0;  // the sizes the directory gives, when not 0
};

void put_le(std::string& out, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) {
    out += static_cast<char>((v >> (8 * i)) & 0xff);
  }
}

std::string zip(const std::vector<Member>& members) {
  std::string out;
  std::string dir;
  for (const Member& m : members) {
    const std::uint64_t at = out.size();
    std::uint64_t pad = (64 - (at + 30 + m.name.size() + 4) % 64) % 64;
    put_le(out, 0x04034b50, 4);
    put_le(out, 20, 2);
    put_le(out, 0, 2);
    put_le(out, m.method, 2);
    put_le(out, 0, 4);  // time, date
    put_le(out, 0, 4);  // crc
    put_le(out, m.data.size(), 4);
    put_le(out, m.data.size(), 4);
    put_le(out, m.name.size(), 2);
    put_le(out, pad + 4, 2);
    out += m.name;
    put_le(out, 0x4246, 2);
    put_le(out, pad, 2);
    out.append(pad, 'Z');
    out += m.data;
    put_le(dir, 0x02014b50, 4);
    put_le(dir, 20, 2);
    put_le(dir, 20, 2);
    put_le(dir, 0, 2);
    put_le(dir, m.method, 2);
    put_le(dir, 0, 4);
    put_le(dir, 0, 4);
    put_le(dir, m.claimed ? m.claimed : m.data.size(), 4);
    put_le(dir, m.claimed ? m.claimed : m.data.size(), 4);
    put_le(dir, m.name.size(), 2);
    put_le(dir, 0, 2);
    put_le(dir, 0, 2);
    put_le(dir, 0, 2);
    put_le(dir, 0, 2);
    put_le(dir, 0, 4);
    put_le(dir, at, 4);
    dir += m.name;
  }
  const std::uint64_t dir_at = out.size();
  out += dir;
  put_le(out, 0x06054b50, 4);
  put_le(out, 0, 4);
  put_le(out, members.size(), 2);
  put_le(out, members.size(), 2);
  put_le(out, dir.size(), 4);
  put_le(out, dir_at, 4);
  put_le(out, 0, 2);
  return out;
}

ReadAt over(const std::string& bytes) {
  return [&bytes](std::uint64_t offset, std::span<std::byte> into) {
    if (offset > bytes.size() || into.size() > bytes.size() - offset) {
      throw Error(Stage::kHeader, "mem", "", "read past the end");
    }
    std::memcpy(into.data(), bytes.data() + offset, into.size());
  };
}

SafetensorsHeader index_of(const std::string& archive) {
  return parse_torch_checkpoint(over(archive), archive.size(), "x.bin", 1 << 20);
}

std::string archive_refusal(const std::string& archive) {
  try {
    index_of(archive);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A two-tensor state dict and its storages: w BF16 [2, 3], b F32 [4].
Pickle two_tensors() {
  Pickle p;
  p.proto().ordered_dict().mark();
  p.str("w").tensor_v2("BFloat16Storage", "0", 6, 0, {2, 3}, {3, 1});
  p.str("b").tensor_v2("FloatStorage", "1", 4, 0, {4}, {1});
  return p.op('u');
}

std::vector<Member> members_for(const Pickle& p, std::string w = std::string(12, 'w'),
                                std::string b = std::string(16, 'b')) {
  return {{"x/data.pkl", p.bytes},
          {"x/byteorder", "little"},
          {"x/data/0", std::move(w)},
          {"x/data/1", std::move(b)},
          {"x/version", "3\n"}};
}

TEST(TorchPickle, ReadsAStateDictAsTorchPicklesIt) {
  Pickle p = two_tensors();
  // A module's state_dict() carries _metadata, set by BUILD after the items.
  p.op('}').str("_metadata").ordered_dict().mark().str("").op('}').str("version").integer(1);
  p.op('s').op('u').op('s').op('b').stop();
  const std::vector<PickledTensor> t = parse(p);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].name, "w");
  EXPECT_EQ(t[0].dtype, DType::kBF16);
  EXPECT_EQ(t[0].storage_key, "0");
  EXPECT_EQ(t[0].storage_numel, 6u);
  EXPECT_EQ(t[0].shape, (std::vector<std::uint64_t>{2, 3}));
  EXPECT_EQ(t[0].stride, (std::vector<std::uint64_t>{3, 1}));
  EXPECT_EQ(t[1].name, "b");
  EXPECT_EQ(t[1].dtype, DType::kF32);
}

TEST(TorchPickle, ReadsV3TensorsParametersAndMemoReferences) {
  Pickle p;
  p.proto().op('}').op('q').le(0, 1).mark();
  p.str("f8").tensor_v3("0", 4, "float8_e4m3fn", {2, 2}, {2, 1});
  p.op('q').le(1, 1);
  p.str("tied").op('h').le(1, 1);  // the same tensor object again: tied weights
  p.str("p").global("torch._utils", "_rebuild_parameter").mark();
  p.tensor_v2("HalfStorage", "1", 3, 0, {3}, {1}).op(0x88).ordered_dict().tuple().reduce();
  p.op('u').stop();
  const std::vector<PickledTensor> t = parse(p);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].dtype, DType::kF8E4M3);
  EXPECT_TRUE(t[0].untyped_storage);
  EXPECT_EQ(t[1].name, "tied");
  EXPECT_EQ(t[1].storage_key, "0");
  EXPECT_EQ(t[2].name, "p");
  EXPECT_EQ(t[2].dtype, DType::kF16);
}

TEST(TorchPickle, RefusesGlobalsThatRunCode) {
  // What `class A: __reduce__ = lambda self: (os.system, ("id",))` pickles to.
  Pickle os_system;
  os_system.proto().global("posix", "system").str("id").op(0x85).reduce().stop();
  EXPECT_NE(refusal(os_system).find("global posix.system is not allowed"), std::string::npos);
  Pickle unknown;
  unknown.proto().global("numpy.core.multiarray", "_reconstruct").stop();
  EXPECT_NE(refusal(unknown).find("numpy.core.multiarray._reconstruct"), std::string::npos);
  Pickle builtins_eval;  // STACK_GLOBAL of builtins.eval, the protocol 4 way
  builtins_eval.str("builtins").str("eval").op(0x93).str("1+1").op(0x85).reduce().stop();
  EXPECT_NE(refusal(builtins_eval).find("opcode STACK_GLOBAL (0x93) is not allowed"),
            std::string::npos);
  Pickle proto4;
  proto4.op(0x80).op(4).stop();
  EXPECT_NE(refusal(proto4).find("pickle protocol 4"), std::string::npos);
  Pickle inst;  // INST calls a class by name (protocol 0)
  inst.mark().raw("ios\nsystem\n").stop();
  EXPECT_NE(refusal(inst).find("INST"), std::string::npos);
  Pickle call_storage;  // an allowed global that is not a function
  call_storage.proto().global("torch", "FloatStorage").op(')').reduce().stop();
  EXPECT_NE(refusal(call_storage).find("torch.FloatStorage cannot be called"), std::string::npos);
}

TEST(TorchPickle, RefusesDeepNestingHugeIntegersAndCycles) {
  Pickle deep;
  deep.proto();
  for (int i = 0; i < 100000; ++i) {
    deep.op(']');
  }
  for (int i = 0; i < 100000; ++i) {
    deep.op('a');
  }
  EXPECT_NE(refusal(deep.stop()).find("nest deeper than 32"), std::string::npos);
  Pickle marks;  // a million MARKs: memory in proportion to the bytes, then an error
  marks.proto().raw(std::string(1'000'000, '(')).stop();
  EXPECT_NE(refusal(marks).find("marks on the stack"), std::string::npos);
  Pickle long4;  // LONG4 of 2^31 bytes: refused before reading them
  long4.proto().op(0x8b).le(0x7fffffff, 4).stop();
  EXPECT_NE(refusal(long4).find("wider than 64 bits"), std::string::npos);
  Pickle self;  // a list appended to itself
  self.proto().op(']').op('2').op('a').stop();
  EXPECT_NE(refusal(self).find("inside itself"), std::string::npos);
  Pickle late;  // a list changed after it went into a tuple: how a cycle would be made
  late.proto().op(']').op('q').le(0, 1).op(0x85).op('h').le(0, 1).op('N').op('a').stop();
  EXPECT_NE(refusal(late).find("already inside another"), std::string::npos);
}

TEST(TorchPickle, RefusesWhatIsNotAStateDictOfTensors) {
  Pickle list;
  list.proto().op(']').stop();
  EXPECT_NE(refusal(list).find("not a state dict"), std::string::npos);
  Pickle number;
  number.proto().op('}').str("step").integer(7).op('s').stop();
  EXPECT_NE(refusal(number).find("its value is an int, not a tensor"), std::string::npos);
  Pickle twice = two_tensors();
  twice.str("w").tensor_v2("FloatStorage", "2", 1, 0, {1}, {1}).op('s').stop();
  EXPECT_NE(refusal(twice).find("sets this key twice"), std::string::npos);
  Pickle trailing = two_tensors();
  trailing.stop().raw("junk");
  EXPECT_NE(refusal(trailing).find("4 bytes follow STOP"), std::string::npos);
  Pickle unended = two_tensors();
  EXPECT_NE(refusal(unended).find("without STOP"), std::string::npos);
  Pickle bad_pid;
  bad_pid.proto().op('}').str("w").str("not a tuple").op('Q').op('s').stop();
  EXPECT_NE(refusal(bad_pid).find("persistent id"), std::string::npos);
  Pickle v2_untyped;
  v2_untyped.proto().op('}').str("w").global("torch._utils", "_rebuild_tensor_v2").mark();
  v2_untyped.mark().str("storage").global("torch.storage", "UntypedStorage").str("0").str("cpu");
  v2_untyped.integer(4).tuple().op('Q').integer(0).dims({4}).dims({1}).op(0x89).ordered_dict();
  v2_untyped.tuple().reduce().op('s').stop();
  EXPECT_NE(refusal(v2_untyped).find("untyped storage"), std::string::npos);
}

// Real counts: a state dict of 100,000 tensors (a DeepSeek-V3-sized checkpoint has
// 92k), each in its own storage, memoized as torch's pickler does.
TEST(TorchPickle, ReadsAHundredThousandTensors) {
  Pickle p;
  p.proto().ordered_dict().mark();
  for (int i = 0; i < 100000; ++i) {
    p.str("model.layers." + std::to_string(i / 1000) + ".mlp.experts." + std::to_string(i % 1000) +
          ".down_proj.weight");
    p.op('r').le(static_cast<std::uint64_t>(2 * i + 10), 4);
    p.tensor_v2("BFloat16Storage", std::to_string(i), 7168 * 2048, 0, {7168, 2048}, {2048, 1});
    p.op('r').le(static_cast<std::uint64_t>(2 * i + 11), 4);
  }
  p.op('u').stop();
  const std::vector<PickledTensor> t = parse(p);
  ASSERT_EQ(t.size(), 100000u);
  EXPECT_EQ(t.back().storage_key, "99999");
  EXPECT_EQ(t.back().shape, (std::vector<std::uint64_t>{7168, 2048}));
}

// Any byte string ends in a result or a ferry::Error, quickly: opcode soup.
TEST(TorchPickle, OpcodeSoupEndsInAnError) {
  std::mt19937_64 rng(37);
  const std::string alphabet = "(.012NJKMGXTU)t]}ldaesucRbQhjqr\x80\x85\x86\x87\x88\x89\x8a\x8b";
  for (int round = 0; round < 3000; ++round) {
    Pickle p;
    p.proto();
    const int n = static_cast<int>(rng() % 200);
    for (int i = 0; i < n; ++i) {
      p.op(static_cast<unsigned char>(rng() % 3 == 0 ? rng() % 256
                                                     : alphabet[rng() % alphabet.size()]));
    }
    try {
      parse(p);
    } catch (const Error&) {
    }
  }
}

TEST(TorchCheckpoint, MapsEachTensorToItsStorageBytes) {
  Pickle p = two_tensors();
  const std::string archive = zip(members_for(p.stop()));
  const SafetensorsHeader h = index_of(archive);
  ASSERT_EQ(h.tensors.size(), 2u);
  for (const TensorInfo& t : h.tensors) {
    EXPECT_EQ(t.offset % 64, 0u) << t.name;
    const std::string bytes = archive.substr(t.offset, t.nbytes);
    EXPECT_EQ(bytes, std::string(t.nbytes, t.name == "w" ? 'w' : 'b')) << t.name;
  }
  EXPECT_EQ(h.tensors[0].name, "w");  // sorted by offset: data/0 comes first
  EXPECT_EQ(h.tensors[0].nbytes, 12u);
  EXPECT_EQ(h.tensors[1].nbytes, 16u);
  EXPECT_GT(h.header_bytes, p.bytes.size());
}

TEST(TorchCheckpoint, KeepsTiedViewsAndSlicesOfOneStorage) {
  Pickle p;
  p.proto().op('}').mark();
  p.str("embed").tensor_v2("FloatStorage", "0", 8, 0, {2, 2}, {2, 1}).op('q').le(9, 1);
  p.str("lm_head").op('h').le(9, 1);
  p.str("upper").tensor_v2("FloatStorage", "0", 8, 4, {4}, {1});  // the storage's second half
  p.op('u').stop();
  const std::string archive = zip({{"x/data.pkl", p.bytes}, {"x/data/0", std::string(32, 's')}});
  const SafetensorsHeader h = index_of(archive);
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].offset, h.tensors[1].offset);
  EXPECT_EQ(h.tensors[2].offset, h.tensors[0].offset + 16);
}

TEST(TorchCheckpoint, RefusesLayoutsItCannotReadAsRanges) {
  Pickle transposed;
  transposed.proto().op('}').str("w").tensor_v2("FloatStorage", "0", 6, 0, {2, 3}, {1, 2});
  transposed.op('s').stop();
  EXPECT_NE(
      archive_refusal(zip({{"x/data.pkl", transposed.bytes}, {"x/data/0", std::string(24, 0)}}))
          .find("not contiguous"),
      std::string::npos);
  Pickle overlap;
  overlap.proto().op('}').mark();
  overlap.str("a").tensor_v2("FloatStorage", "0", 6, 0, {2, 3}, {3, 1});
  overlap.str("b").tensor_v2("FloatStorage", "0", 6, 0, {3, 2}, {2, 1});
  overlap.op('u').stop();
  const std::string why =
      archive_refusal(zip({{"x/data.pkl", overlap.bytes}, {"x/data/0", std::string(24, 0)}}));
  EXPECT_NE(why.find("overlap tensor a with another layout"), std::string::npos) << why;
  EXPECT_NE(why.find("pt_weights_iterator"), std::string::npos);
  Pickle past;
  past.proto().op('}').str("w").tensor_v2("FloatStorage", "0", 6, 4, {4}, {1}).op('s').stop();
  EXPECT_NE(archive_refusal(zip({{"x/data.pkl", past.bytes}, {"x/data/0", std::string(24, 0)}}))
                .find("runs past its storage"),
            std::string::npos);
  Pickle p = two_tensors();
  p.stop();
  EXPECT_NE(archive_refusal(zip(members_for(p, std::string(10, 'w')))).find("holds 10 bytes"),
            std::string::npos);
  std::vector<Member> missing = members_for(p);
  missing.erase(missing.begin() + 3);
  EXPECT_NE(archive_refusal(zip(missing)).find("x/data/1 is not in the archive"),
            std::string::npos);
  std::vector<Member> big_endian = members_for(p);
  big_endian[1].data = "big";
  EXPECT_NE(archive_refusal(zip(big_endian)).find("byteorder is 'big'"), std::string::npos);
}

TEST(TorchCheckpoint, RefusesZipBombsAndWhatIsNotAnArchive) {
  Pickle p = two_tensors();
  p.stop();
  std::vector<Member> deflated = members_for(p);
  deflated[2].method = 8;
  EXPECT_NE(archive_refusal(zip(deflated)).find("x/data/0 is compressed (method 8)"),
            std::string::npos);
  // A member whose data takes in the next member (header and all): the overlap the
  // non-recursive zip bombs are made of.
  std::vector<Member> overlapping = members_for(p);
  overlapping[2].claimed = 64 + 64;
  EXPECT_NE(archive_refusal(zip(overlapping)).find("its bytes overlap member x/data/0"),
            std::string::npos);
  // A directory entry pointing at another member's local header.
  std::string archive = zip(members_for(p));
  const std::size_t dir = archive.rfind(std::string("\x50\x4b\x01\x02", 4));
  ASSERT_NE(dir, std::string::npos);
  std::memcpy(&archive[dir + 42], "\0\0\0\0", 4);  // the last entry now points at data.pkl's
  EXPECT_NE(archive_refusal(archive).find("local header names another member"), std::string::npos);
  // An end record that counts 65535 entries in a small directory.
  std::string counted = zip(members_for(p));
  std::memcpy(&counted[counted.size() - 14], "\xfe\xff\xfe\xff", 4);
  EXPECT_NE(archive_refusal(counted).find("counts 65534 entries"), std::string::npos);
  std::string legacy = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.";
  EXPECT_NE(archive_refusal(legacy).find("legacy torch.save file"), std::string::npos);
  EXPECT_NE(archive_refusal("safetensors?").find("not a torch.save zip archive"),
            std::string::npos);
  std::string truncated = zip(members_for(p));
  truncated.resize(truncated.size() - 5);
  EXPECT_NE(archive_refusal(truncated).find("no end-of-central-directory record"),
            std::string::npos);
  EXPECT_NE(archive_refusal(zip({{"x/version", "3\n"}})).find("no <archive>/data.pkl"),
            std::string::npos);
}

}  // namespace
}  // namespace ferry::io
