// TorchWriter: the file byte for byte as torch.save writes it (a small file and a
// pickle that PyTorch 2.14 wrote, embedded below), its ZIP structure read back by an
// independent reader written here (alignment, CRCs, descriptors, the central
// directory against the local headers, the ZIP64 records), the pickle's opcodes
// where CPython's pickler changes them (integer widths, memo indices, SETITEMS
// batches), forced ZIP64, every misuse, and nothing left behind on failure. Python's
// zipfile and torch.load read the files when an interpreter has them
// ($FERRY_TORCH_PYTHON, else python3).
#include "io/torch_writer.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

using ferry::testing::read_file;
using ferry::testing::TempDir;

// Generated once with PyTorch 2.14.1 (CPython 3.11):
//
//   import collections, torch, zipfile
//   sd = collections.OrderedDict()
//   sd["model.embed_tokens.weight"] = torch.zeros((4, 3), dtype=torch.bfloat16)
//   sd["1"] = torch.zeros((), dtype=torch.float32)
//   sd["norm"] = torch.zeros((0, 4), dtype=torch.float16)
//   sd["big"] = torch.zeros((3, 100), dtype=torch.int64)
//   sd["scale"] = torch.zeros((2, 2), dtype=torch.float8_e4m3fn)
//   sd["u"] = torch.zeros((1, 2, 3, 4), dtype=torch.uint16)
//   sd["b"] = torch.zeros((5,), dtype=torch.bfloat16)
//   sd["\u00e9"] = torch.zeros((1,), dtype=torch.uint8)
//   sd["z"] = torch.zeros((3, 0, 2), dtype=torch.float32)
//   sd["mask"] = torch.zeros((2,), dtype=torch.bool)
//   torch.save(sd, "rich.bin")
//   print(zipfile.ZipFile("rich.bin").read("rich/data.pkl").hex())
//
// v2 and v3 rebuilds, every tuple opcode, BININT2, memo gets of a storage class,
// rank 0, empty tensors, a UTF-8 name, and a name "1" that is not storage key '1'.
constexpr const char* kRichPickle =
    "800263636f6c6c656374696f6e730a4f726465726564446963740a7100295271012858190000006d6f64656c2e"
    "656d6265645f746f6b656e732e776569676874710263746f7263682e5f7574696c730a5f72656275696c645f74"
    "656e736f725f76320a71032828580700000073746f72616765710463746f7263680a42466c6f6174313653746f"
    "726167650a71055801000000307106580300000063707571074b0c747108514b004b044b038671094b034b0186"
    "710a8968002952710b74710c52710d580100000031710e68032828680463746f7263680a466c6f617453746f72"
    "6167650a710f580100000031711068074b01747111514b0029298968002952711274711352711458040000006e"
    "6f726d711568032828680463746f7263680a48616c6653746f726167650a7116580100000032711768074b0074"
    "7118514b004b004b048671194b044b0186711a8968002952711b74711c52711d5803000000626967711e680328"
    "28680463746f7263680a4c6f6e6753746f726167650a711f580100000033712068074d2c01747121514b004b03"
    "4b648671224b644b018671238968002952712474712552712658050000007363616c65712763746f7263682e5f"
    "7574696c730a5f72656275696c645f74656e736f725f76330a71282828680463746f7263682e73746f72616765"
    "0a556e747970656453746f726167650a7129580100000034712a68074b0474712b514b004b024b0286712c4b02"
    "4b0186712d8968002952712e63746f7263680a666c6f6174385f65346d33666e0a712f74713052713158010000"
    "007571326828282868046829580100000035713368074b30747134514b00284b014b024b034b04747135284b18"
    "4b0c4b044b017471368968002952713763746f7263680a75696e7431360a713874713952713a58010000006271"
    "3b6803282868046805580100000036713c68074b0574713d514b004b0585713e4b0185713f8968002952714074"
    "71415271425802000000c3a9714368032828680463746f7263680a4279746553746f726167650a714458010000"
    "0037714568074b01747146514b004b018571474b018571488968002952714974714a52714b58010000007a714c"
    "680328286804680f580100000038714d68074b0074714e514b004b034b004b0287714f4b024b024b0187715089"
    "68002952715174715252715358040000006d61736b715468032828680463746f7263680a426f6f6c53746f7261"
    "67650a7155580100000039715668074b02747157514b004b028571584b018571598968002952715a74715b5271"
    "5c752e";

// The whole file of
//
//   t = collections.OrderedDict()
//   t["w"] = torch.arange(6, dtype=torch.float32).reshape(2, 3)
//   t["e"] = torch.zeros((0,), dtype=torch.bfloat16)
//   t["s"] = torch.tensor(7, dtype=torch.int32)
//   t["pk"] = torch.tensor([0x50, 0x4b, 7, 8, 1, 2, 3, 4, 5], dtype=torch.uint8)
//   torch.save(t, "tiny.bin")
//
// "pk" starts with a data descriptor's signature, which torch folds into its
// serialization id.
constexpr const char* kTinyFile =
    "504b0304000008080000000000000000000000000000000000000d00150074696e792f646174612e706b6c4642"
    "11005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a800263636f6c6c656374696f6e730a4f72646572656444696374"
    "0a71002952710128580100000077710263746f7263682e5f7574696c730a5f72656275696c645f74656e736f72"
    "5f76320a71032828580700000073746f72616765710463746f7263680a466c6f617453746f726167650a710558"
    "01000000307106580300000063707571074b06747108514b004b024b038671094b034b0186710a896800295271"
    "0b74710c52710d580100000065710e68032828680463746f7263680a42466c6f6174313653746f726167650a71"
    "0f580100000031711068074b00747111514b004b008571124b0185711389680029527114747115527116580100"
    "000073711768032828680463746f7263680a496e7453746f726167650a7118580100000032711968074b017471"
    "1a514b0029298968002952711b74711c52711d5802000000706b711e68032828680463746f7263680a42797465"
    "53746f726167650a711f580100000033712068074b09747121514b004b098571224b0185712389680029527124"
    "747125527126752e504b07081f61fcee8a0100008a010000504b03040000080800000000000000000000000000"
    "00000000001400340074696e792f2e666f726d61745f76657273696f6e464230005a5a5a5a5a5a5a5a5a5a5a5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a31504b0708b7efdc83"
    "0100000001000000504b03040000080800000000000000000000000000000000000017003a0074696e792f2e73"
    "746f726167655f616c69676e6d656e74464236005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a3634504b07083f7771e9020000000200"
    "0000504b0304000008080000000000000000000000000000000000000e00420074696e792f627974656f726465"
    "7246423e005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a6c6974746c65504b0708853de319060000000600000050"
    "4b0304000008080000000000000000000000000000000000000b00410074696e792f646174612f3046423d005a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a000000000000803f0000004000004040000080400000a040504b07081790"
    "e7911800000018000000504b0304000000080000000000000000000000000000000000000b002f0074696e792f"
    "646174612f3146422b005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
    "5a5a5a5a5a5a5a5a504b0304000008080000000000000000000000000000000000000b00170074696e792f6461"
    "74612f32464213005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a07000000504b0708a5e793bc040000000400"
    "0000504b0304000008080000000000000000000000000000000000000b00430074696e792f646174612f334642"
    "3f005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a504b07080102030405504b0708695971480900000009000000"
    "504b0304000008080000000000000000000000000000000000000c003d0074696e792f76657273696f6e464239"
    "005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a330a504b0708d19e67550200000002000000504b030400000808000000000000"
    "0000000000000000000000001b00350074696e792f2e646174612f73657269616c697a6174696f6e5f69644642"
    "31005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
    "5a5a5a5a5a5a313037373836323732393739393835343136323530343833383934303436383233303232323739"
    "33504b07087f779d592800000028000000504b01020000000008080000000000001f61fcee8a0100008a010000"
    "0d000000000000000000000000000000000074696e792f646174612e706b6c504b010200000000080800000000"
    "0000b7efdc8301000000010000001400000000000000000000000000da01000074696e792f2e666f726d61745f"
    "76657273696f6e504b01020000000008080000000000003f7771e9020000000200000017000000000000000000"
    "000000005102000074696e792f2e73746f726167655f616c69676e6d656e74504b010200000000080800000000"
    "0000853de31906000000060000000e00000000000000000000000000d202000074696e792f627974656f726465"
    "72504b01020000000008080000000000001790e79118000000180000000b000000000000000000000000005603"
    "000074696e792f646174612f30504b01020000000000080000000000000000000000000000000000000b000000"
    "00000000000000000000e803000074696e792f646174612f31504b0102000000000808000000000000a5e793bc"
    "04000000040000000b000000000000000000000000004004000074696e792f646174612f32504b010200000000"
    "08080000000000006959714809000000090000000b000000000000000000000000009404000074696e792f6461"
    "74612f33504b0102000000000808000000000000d19e675502000000020000000c000000000000000000000000"
    "001905000074696e792f76657273696f6e504b01020000000008080000000000007f779d592800000028000000"
    "1b000000000000000000000000009205000074696e792f2e646174612f73657269616c697a6174696f6e5f6964"
    "504b06062c000000000000001e032d0000000000000000000a000000000000000a000000000000006502000000"
    "0000003806000000000000504b0607000000009d0800000000000001000000504b0506000000000a000a006502"
    "0000380600000000";

std::string unhex(std::string_view hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

std::string str(std::span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  }
  return out;
}

// Bit by bit, independent of common/crc32.
std::uint32_t reference_crc32(std::string_view data) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) {
    c ^= b;
    for (int k = 0; k < 8; ++k) {
      c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
  }
  return ~c;
}

// ---- an independent ZIP reader --------------------------------------------------

std::uint64_t le(const std::string& b, std::uint64_t at, int n) {
  if (at + static_cast<std::uint64_t>(n) > b.size()) {
    throw std::runtime_error("read past the end at " + std::to_string(at));
  }
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) {
    v = (v << 8) | static_cast<unsigned char>(b[at + static_cast<std::uint64_t>(i)]);
  }
  return v;
}

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::runtime_error(what);
  }
}

struct Extra {
  std::uint16_t id = 0;
  std::string data;
};

std::vector<Extra> parse_extras(const std::string& bytes) {
  std::vector<Extra> out;
  std::size_t at = 0;
  while (at < bytes.size()) {
    require(at + 4 <= bytes.size(), "truncated extra field");
    const auto len = static_cast<std::size_t>(le(bytes, at + 2, 2));
    require(at + 4 + len <= bytes.size(), "extra field past its block");
    out.push_back({static_cast<std::uint16_t>(le(bytes, at, 2)), bytes.substr(at + 4, len)});
    at += 4 + len;
  }
  return out;
}

const Extra* find_extra(const std::vector<Extra>& extras, std::uint16_t id) {
  for (const auto& e : extras) {
    if (e.id == id) {
      return &e;
    }
  }
  return nullptr;
}

struct ZipMember {
  std::string name;
  // Central directory, the 32-bit fields as written.
  std::uint64_t made_by = 0, needed = 0, flags = 0, method = 0, time = 0, date = 0, crc = 0;
  std::uint64_t raw_compressed = 0, raw_size = 0, raw_offset = 0, attributes = 0;
  std::vector<Extra> central_extras;
  // Resolved through the ZIP64 field.
  std::uint64_t size = 0, compressed = 0, offset = 0;
  // Local header.
  std::uint64_t local_needed = 0, local_flags = 0, local_method = 0, local_crc = 0;
  std::uint64_t local_compressed = 0, local_size = 0;
  std::vector<Extra> local_extras;
  std::uint64_t data_offset = 0;
  std::string data;
  // Data descriptor.
  bool descriptor = false;
  std::uint64_t dd_crc = 0, dd_compressed = 0, dd_size = 0;
  std::uint64_t end = 0;  // after data and descriptor
};

struct ZipArchive {
  std::vector<ZipMember> members;
  std::uint64_t entries = 0, directory_offset = 0, directory_size = 0;
  std::uint64_t end_entries = 0, end_size = 0, end_offset = 0;  // the classic record's
  bool zip64 = false;
  std::uint64_t zip64_offset = 0;
};

ZipArchive read_zip(const std::string& b) {
  ZipArchive z;
  require(b.size() >= 22, "too short for an end record");
  const std::uint64_t eocd = b.size() - 22;  // no comment
  require(le(b, eocd, 4) == 0x06054b50, "no end of central directory record at the end");
  require(le(b, eocd + 4, 4) == 0, "multi-disk end record");
  require(le(b, eocd + 8, 2) == le(b, eocd + 10, 2), "entries on this disk != total");
  z.end_entries = z.entries = le(b, eocd + 10, 2);
  z.end_size = z.directory_size = le(b, eocd + 12, 4);
  z.end_offset = z.directory_offset = le(b, eocd + 16, 4);
  if (eocd >= 20 && le(b, eocd - 20, 4) == 0x07064b50) {
    z.zip64 = true;
    require(le(b, eocd - 16, 4) == 0 && le(b, eocd - 4, 4) == 1, "ZIP64 locator: one disk");
    z.zip64_offset = le(b, eocd - 12, 8);
    const std::uint64_t r = z.zip64_offset;
    require(le(b, r, 4) == 0x06064b50, "no ZIP64 end record where the locator points");
    require(le(b, r + 4, 8) == 44 && le(b, r + 14, 2) == 45, "ZIP64 end record size, version");
    require(r + 56 == eocd - 20, "the ZIP64 end record does not precede its locator");
    require(le(b, r + 24, 8) == le(b, r + 32, 8), "ZIP64 entries on this disk != total");
    z.entries = le(b, r + 32, 8);
    z.directory_size = le(b, r + 40, 8);
    z.directory_offset = le(b, r + 48, 8);
  }
  std::uint64_t at = z.directory_offset;
  for (std::uint64_t i = 0; i < z.entries; ++i) {
    ZipMember m;
    require(le(b, at, 4) == 0x02014b50, "central header " + std::to_string(i));
    m.made_by = le(b, at + 4, 2);
    m.needed = le(b, at + 6, 2);
    m.flags = le(b, at + 8, 2);
    m.method = le(b, at + 10, 2);
    m.time = le(b, at + 12, 2);
    m.date = le(b, at + 14, 2);
    m.crc = le(b, at + 16, 4);
    m.raw_compressed = le(b, at + 20, 4);
    m.raw_size = le(b, at + 24, 4);
    const std::uint64_t n = le(b, at + 28, 2), x = le(b, at + 30, 2), c = le(b, at + 32, 2);
    require(le(b, at + 34, 2) == 0, "disk number");
    m.attributes = le(b, at + 36, 2) | le(b, at + 38, 4);
    m.raw_offset = le(b, at + 42, 4);
    m.name = b.substr(at + 46, n);
    m.central_extras = parse_extras(b.substr(at + 46 + n, x));
    at += 46 + n + x + c;
    // The ZIP64 field holds, in this order, the values whose fields read 0xFFFFFFFF.
    m.size = m.raw_size;
    m.compressed = m.raw_compressed;
    m.offset = m.raw_offset;
    if (const Extra* e = find_extra(m.central_extras, 1)) {
      std::size_t k = 0;
      for (std::uint64_t* v : {&m.size, &m.compressed, &m.offset}) {
        if (*v == 0xFFFFFFFFu) {
          *v = le(e->data, k, 8);
          k += 8;
        }
      }
      require(k == e->data.size(), m.name + ": ZIP64 field of another length than it needs");
    }
    const std::uint64_t lo = m.offset;
    require(le(b, lo, 4) == 0x04034b50, m.name + ": no local header at its offset");
    m.local_needed = le(b, lo + 4, 2);
    m.local_flags = le(b, lo + 6, 2);
    m.local_method = le(b, lo + 8, 2);
    m.local_crc = le(b, lo + 14, 4);
    m.local_compressed = le(b, lo + 18, 4);
    m.local_size = le(b, lo + 22, 4);
    const std::uint64_t ln = le(b, lo + 26, 2), lx = le(b, lo + 28, 2);
    require(b.substr(lo + 30, ln) == m.name, m.name + ": the local header names another");
    m.local_extras = parse_extras(b.substr(lo + 30 + ln, lx));
    m.data_offset = lo + 30 + ln + lx;
    require(m.data_offset + m.size <= b.size(), m.name + ": data past the end");
    m.data = b.substr(m.data_offset, m.size);
    m.end = m.data_offset + m.size;
    m.descriptor = (m.local_flags & 8) != 0;
    if (m.descriptor) {
      require(le(b, m.end, 4) == 0x08074b50, m.name + ": no data descriptor after the data");
      m.dd_crc = le(b, m.end + 4, 4);
      const int w = find_extra(m.local_extras, 1) != nullptr ? 8 : 4;
      m.dd_compressed = le(b, m.end + 8, w);
      m.dd_size = le(b, m.end + 8 + static_cast<std::uint64_t>(w), w);
      m.end += 8 + 2 * static_cast<std::uint64_t>(w);
    }
    z.members.push_back(std::move(m));
  }
  require(at == z.directory_offset + z.directory_size, "the directory's size is not its records'");
  return z;
}

// Everything torch's layout promises, for a file written with or without force_zip64.
void check_layout(const ZipArchive& z, const std::string& bytes, bool force) {
  ASSERT_TRUE(z.zip64) << "torch's writer always ends with the ZIP64 records";
  ASSERT_FALSE(z.members.empty());
  const std::uint64_t kMax = 0xFFFFFFFFu;
  std::uint64_t expect_offset = 0;
  for (const ZipMember& m : z.members) {
    SCOPED_TRACE(m.name);
    EXPECT_EQ(m.offset, expect_offset) << "members follow each other without gaps";
    expect_offset = m.end;
    EXPECT_EQ(m.method, 0u);
    EXPECT_EQ(m.local_method, 0u);
    EXPECT_EQ(m.made_by, 0u);
    EXPECT_EQ(m.needed, 0u);
    EXPECT_EQ(m.local_needed, 0u);
    EXPECT_EQ(m.time | m.date | m.attributes, 0u);
    EXPECT_EQ(m.flags, m.size > 0 ? 0x0808u : 0x0800u);
    EXPECT_EQ(m.local_flags, m.flags);
    EXPECT_EQ(m.local_crc | m.local_compressed | m.local_size, 0u);
    EXPECT_EQ(m.data_offset % 64, 0u);
    EXPECT_EQ(m.compressed, m.size);
    EXPECT_EQ(m.crc, reference_crc32(m.data));
    EXPECT_EQ(m.descriptor, m.size > 0);
    if (m.descriptor) {
      EXPECT_EQ(m.dd_crc, m.crc);
      EXPECT_EQ(m.dd_size, m.size);
      EXPECT_EQ(m.dd_compressed, m.size);
    }
    // The padding field ends the local extras: "FB", 0-63 'Z's.
    ASSERT_FALSE(m.local_extras.empty());
    const Extra& pad = m.local_extras.back();
    EXPECT_EQ(pad.id, 0x4246u);
    EXPECT_LT(pad.data.size(), 64u);
    EXPECT_EQ(pad.data, std::string(pad.data.size(), 'Z'));
    // ZIP64 fields exactly where a size or offset passes 32 bits (or all, forced).
    const bool big_size = force || m.size >= kMax;
    const bool big_offset = force || m.offset >= kMax;
    const Extra* local64 = find_extra(m.local_extras, 1);
    const Extra* central64 = find_extra(m.central_extras, 1);
    EXPECT_EQ(local64 != nullptr, big_size || big_offset);
    EXPECT_EQ(central64 != nullptr, big_size || big_offset);
    EXPECT_EQ(m.raw_size == kMax, big_size);
    EXPECT_EQ(m.raw_offset == kMax, big_offset);
    if (local64 != nullptr) {
      std::string want;
      auto put64 = [&](std::uint64_t v) {
        for (int i = 0; i < 8; ++i) {
          want.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
        }
      };
      if (big_size) {
        put64(m.size);
        put64(0);  // the compressed size is the descriptor's
      }
      if (big_offset) {
        put64(m.offset);
      }
      EXPECT_EQ(local64->data, want);
      EXPECT_EQ(m.local_extras.size(), 2u);
    }
  }
  EXPECT_EQ(z.directory_offset, expect_offset);
  EXPECT_EQ(z.zip64_offset, z.directory_offset + z.directory_size);
  EXPECT_EQ(bytes.size(), z.zip64_offset + 56 + 20 + 22);
  EXPECT_EQ(z.end_entries, force ? 0xFFFFu : std::min<std::uint64_t>(z.entries, 0xFFFF));
  EXPECT_EQ(z.end_size, force ? kMax : z.directory_size);
  EXPECT_EQ(z.end_offset, force ? kMax : z.directory_offset);
}

std::vector<std::string> names(const ZipArchive& z) {
  std::vector<std::string> out;
  for (const auto& m : z.members) {
    out.push_back(m.name);
  }
  return out;
}

// ---- a pickle opcode walker ---------------------------------------------------------

// Counts the opcodes of a protocol-2 pickle by name, for those torch.save uses.
std::map<std::string, int> count_ops(const std::string& p) {
  struct Op {
    const char* name;
    int arg;  // bytes after the opcode; -1: GLOBAL, BINUNICODE and LONG1 say their own
  };
  const std::map<char, Op> ops = {
      {'\x80', {"PROTO", 1}},    {'c', {"GLOBAL", -1}},     {'q', {"BINPUT", 1}},
      {'r', {"LONG_BINPUT", 4}}, {'h', {"BINGET", 1}},      {'j', {"LONG_BINGET", 4}},
      {'X', {"BINUNICODE", -1}}, {'K', {"BININT1", 1}},     {'M', {"BININT2", 2}},
      {'J', {"BININT", 4}},      {'\x8a', {"LONG1", -1}},   {'(', {"MARK", 0}},
      {'t', {"TUPLE", 0}},       {')', {"EMPTY_TUPLE", 0}}, {'\x85', {"TUPLE1", 0}},
      {'\x86', {"TUPLE2", 0}},   {'\x87', {"TUPLE3", 0}},   {'R', {"REDUCE", 0}},
      {'Q', {"BINPERSID", 0}},   {'\x89', {"NEWFALSE", 0}}, {'s', {"SETITEM", 0}},
      {'u', {"SETITEMS", 0}},    {'.', {"STOP", 0}},
  };
  std::map<std::string, int> counts;
  std::size_t at = 0;
  while (at < p.size()) {
    const auto it = ops.find(p[at++]);
    require(it != ops.end(), "unexpected opcode at " + std::to_string(at - 1));
    const Op& op = it->second;
    std::size_t arg = static_cast<std::size_t>(std::max(op.arg, 0));
    if (op.arg < 0 && p[at - 1] == 'c') {
      const std::size_t second = p.find('\n', p.find('\n', at) + 1);
      require(second != std::string::npos, "GLOBAL without its two lines");
      arg = second + 1 - at;
    } else if (op.arg < 0) {
      const bool unicode = p[at - 1] == 'X';
      arg = unicode ? 4 + static_cast<std::size_t>(le(p, at, 4))
                    : 1 + static_cast<unsigned char>(p.at(at));
    }
    require(at + arg <= p.size(), std::string("truncated ") + op.name);
    at += arg;
    ++counts[op.name];
    require(std::string(op.name) != "STOP" || at == p.size(), "bytes after STOP");
  }
  return counts;
}

std::vector<TorchEntry> rich_entries() {
  return {{"model.embed_tokens.weight", DType::kBF16, {4, 3}},
          {"1", DType::kF32, {}},
          {"norm", DType::kF16, {0, 4}},
          {"big", DType::kI64, {3, 100}},
          {"scale", DType::kF8E4M3, {2, 2}},
          {"u", DType::kU16, {1, 2, 3, 4}},
          {"b", DType::kBF16, {5}},
          {"\xc3\xa9", DType::kU8, {1}},
          {"z", DType::kF32, {3, 0, 2}},
          {"mask", DType::kBool, {2}}};
}

// Entry `seed`'s data: pattern bytes (BOOL ones 0 or 1, so that torch reads them).
std::string tensor_data(const TorchEntry& entry, unsigned seed) {
  std::uint64_t n = dtype_size(entry.dtype);
  for (std::uint64_t d : entry.shape) {
    n *= d;
  }
  std::string out = str(pattern(n, seed));
  if (entry.dtype == DType::kBool) {
    for (char& c : out) {
      c = static_cast<char>(c & 1);
    }
  }
  return out;
}

// Writes `entries`, entry i's data tensor_data(entry, i), in one call per tensor.
void write_file(const std::string& path, const std::vector<TorchEntry>& entries,
                TorchWriterOptions options = {}) {
  TorchWriter w(path, Stage::kSynth, {}, options);
  for (const auto& e : entries) {
    w.add(e.name, e.dtype, e.shape);
  }
  w.begin();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::string data = tensor_data(entries[i], static_cast<unsigned>(i));
    w.write(std::as_bytes(std::span(data.data(), data.size())));
  }
  w.finish();
}

// Runs `script` with $FERRY_TORCH_PYTHON (else python3) when it can import
// `modules`; nullopt when it cannot.
std::optional<std::string> run_python(const TempDir& dir, const std::string& modules,
                                      const std::string& script, const std::string& arg) {
  const char* env = std::getenv("FERRY_TORCH_PYTHON");
  const std::string python = env != nullptr && *env != '\0' ? env : "python3";
  if (std::system((python + " -c 'import " + modules + "' >/dev/null 2>&1").c_str()) != 0) {
    return std::nullopt;
  }
  const std::string path = dir.file("check.py");
  ferry::testing::write_file(path, script);
  const std::string cmd = "PYTHONIOENCODING=utf-8 " + python + " " + path + " " + arg + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    return std::nullopt;
  }
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) {
    out.append(buf, n);
  }
  EXPECT_EQ(::pclose(pipe), 0) << out;
  return out;
}

// ---- torch's bytes ----------------------------------------------------------------

TEST(TorchWriter, WritesTheFileTorchSaveWrites) {
  TempDir dir;
  const std::string path = dir.file("tiny.bin");
  TorchWriter w(path);
  w.add("w", DType::kF32, {2, 3});
  w.add("e", DType::kBF16, {0});
  w.add("s", DType::kI32, {});
  w.add("pk", DType::kU8, {9});
  EXPECT_EQ(w.archive_name(), "tiny");
  w.begin();
  for (int i = 0; i < 6; ++i) {
    const float f = static_cast<float>(i);
    w.write(std::as_bytes(std::span(&f, 1)));
  }
  const std::int32_t s = 7;
  const unsigned char pk[] = {0x50, 0x4b, 7, 8, 1, 2, 3, 4, 5};
  w.write(std::as_bytes(std::span(&s, 1)));
  w.write(std::as_bytes(std::span(pk)));
  w.finish();
  const std::string bytes = read_file(path);
  EXPECT_EQ(bytes, unhex(kTinyFile));
  check_layout(read_zip(bytes), bytes, false);
}

TEST(TorchWriter, PickleIsTorchsByteForByte) {
  EXPECT_EQ(torch_state_dict_pickle(rich_entries(), "rich.bin"), unhex(kRichPickle));
  // An empty state dict: the OrderedDict alone (torch.save(collections.OrderedDict())).
  static constexpr char kEmpty[] =
      "\x80\x02"
      "ccollections\nOrderedDict\nq\x00)Rq\x01.";
  EXPECT_EQ(torch_state_dict_pickle({}, "f"), std::string(kEmpty, sizeof kEmpty - 1));
  // The writer's data.pkl is that pickle.
  TempDir dir;
  const std::string path = dir.file("rich.bin");
  write_file(path, rich_entries());
  const ZipArchive z = read_zip(read_file(path));
  EXPECT_EQ(z.members.at(0).name, "rich/data.pkl");
  EXPECT_EQ(z.members.at(0).data, unhex(kRichPickle));
}

TEST(TorchWriter, IntegersTakeThePicklersWidths) {
  // Sizes as pickle.dumps(n, 2) writes them: BININT1, BININT2, BININT, then LONG1
  // with one byte more than the bit length needs.
  const std::vector<std::pair<std::uint64_t, std::string>> cases = {
      {255, "4bff"},
      {256, "4d0001"},
      {65535, "4dffff"},
      {65536, "4a00000100"},
      {2147483647, "4affffff7f"},
      {2147483648, "8a050000008000"},
      {std::uint64_t{1} << 40, "8a06000000000001"},
      {0x7FFFFFFFFFFFFFFF, "8a08ffffffffffffff7f"},
  };
  for (const auto& [n, hex] : cases) {
    // U8 [n]: the storage's numel, then the shape (n,) as BINPUT-ed TUPLE1.
    const std::string p = torch_state_dict_pickle({{"t", DType::kU8, {n}}}, "f");
    const std::string want = unhex(hex);
    EXPECT_NE(p.find(want + "t"), std::string::npos) << n << " as the storage's numel";
    EXPECT_NE(p.find(std::string("QK\0", 3) + want + "\x85"), std::string::npos)
        << n << " in the shape";
  }
}

TEST(TorchWriter, MemoAndBatchesAsCPythonsPickler) {
  // Counts from torch.save of OrderedDicts of N torch.zeros(1) named t0, t1, ...
  struct Case {
    std::size_t n;
    int setitems, setitem, long_binput, long_binget;
  };
  for (const Case& c : {Case{0, 0, 0, 0, 0}, Case{1, 0, 1, 0, 0}, Case{1000, 1, 0, 7750, 0},
                        Case{1001, 1, 1, 7758, 0}, Case{2001, 2, 1, 15758, 0}}) {
    std::vector<TorchEntry> entries;
    for (std::size_t i = 0; i < c.n; ++i) {
      entries.push_back({"t" + std::to_string(i), DType::kF32, {1}});
    }
    auto ops = count_ops(torch_state_dict_pickle(entries, "f"));
    EXPECT_EQ(ops["SETITEMS"], c.setitems) << c.n;
    EXPECT_EQ(ops["SETITEM"], c.setitem) << c.n;
    EXPECT_EQ(ops["LONG_BINPUT"], c.long_binput) << c.n;
    EXPECT_EQ(ops["LONG_BINGET"], c.long_binget) << c.n;
    EXPECT_EQ(ops["STOP"], 1);
  }
  // Classes first met past memo 255 are got back with LONG_BINGET: torch.save of 300
  // F32, two BF16 and two F8_E5M2 tensors.
  std::vector<TorchEntry> entries;
  for (int i = 0; i < 300; ++i) {
    entries.push_back({"t" + std::to_string(i), DType::kF32, {1}});
  }
  entries.push_back({"x", DType::kBF16, {1}});
  entries.push_back({"y", DType::kBF16, {1}});
  entries.push_back({"y8", DType::kF8E5M2, {1}});
  entries.push_back({"y9", DType::kF8E5M2, {1}});
  auto ops = count_ops(torch_state_dict_pickle(entries, "f"));
  EXPECT_EQ(ops["SETITEMS"], 1);
  EXPECT_EQ(ops["SETITEM"], 0);
  EXPECT_EQ(ops["LONG_BINPUT"], 2186);
  EXPECT_EQ(ops["LONG_BINGET"], 4);
  EXPECT_EQ(ops["BINGET"], 1510);
  EXPECT_EQ(ops["BINPUT"], 256);
  EXPECT_EQ(ops["MARK"], 609);
}

// ---- the ZIP structure ---------------------------------------------------------------

TEST(TorchWriter, LaysOutTorchsMembersAlignedWithTheirCrcs) {
  TempDir dir;
  const std::string path = dir.file("pytorch_model-00001-of-00002.bin");
  write_file(path, rich_entries());
  const std::string bytes = read_file(path);
  const ZipArchive z = read_zip(bytes);
  check_layout(z, bytes, false);
  const std::string a = "pytorch_model-00001-of-00002/";
  std::vector<std::string> want = {a + "data.pkl", a + ".format_version", a + ".storage_alignment",
                                   a + "byteorder"};
  for (int k = 0; k < 10; ++k) {
    want.push_back(a + "data/" + std::to_string(k));
  }
  want.push_back(a + "version");
  want.push_back(a + ".data/serialization_id");
  EXPECT_EQ(names(z), want);
  EXPECT_EQ(z.members[1].data, "1");
  EXPECT_EQ(z.members[2].data, "64");
  EXPECT_EQ(z.members[3].data, "little");
  EXPECT_EQ(z.members[14].data, "3\n");
  EXPECT_EQ(z.members[15].data.size(), 40u);
  EXPECT_EQ(z.members[15].data.find_first_not_of("0123456789"), std::string::npos);
  const auto entries = rich_entries();
  for (std::size_t k = 0; k < entries.size(); ++k) {
    EXPECT_EQ(z.members[4 + k].data, tensor_data(entries[k], static_cast<unsigned>(k))) << k;
  }
}

TEST(TorchWriter, ForcedZip64HasEveryZip64RecordAndTheSameData) {
  TempDir dir;
  const std::string plain = dir.file("m.bin");
  const std::string forced = dir.file("sub/m.bin");
  std::filesystem::create_directories(dir.file("sub"));
  write_file(plain, rich_entries());
  write_file(forced, rich_entries(), {.force_zip64 = true});
  const std::string bytes = read_file(forced);
  const ZipArchive z = read_zip(bytes);
  check_layout(z, bytes, true);
  const ZipArchive p = read_zip(read_file(plain));
  ASSERT_EQ(names(z), names(p));
  for (std::size_t i = 0; i < z.members.size(); ++i) {
    EXPECT_EQ(z.members[i].data, p.members[i].data) << z.members[i].name;
    EXPECT_EQ(z.members[i].crc, p.members[i].crc) << z.members[i].name;
    // Every central record holds size, compressed size and offset in its field.
    const Extra* e = find_extra(z.members[i].central_extras, 1);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->data.size(), 24u);
  }
}

TEST(TorchWriter, PythonsZipfileReadsPlainAndForcedZip64) {
  TempDir dir;
  write_file(dir.file("plain.bin"), rich_entries());
  write_file(dir.file("forced.bin"), rich_entries(), {.force_zip64 = true});
  const std::string script = R"(import sys, zipfile
for name in ("plain", "forced"):
    z = zipfile.ZipFile(sys.argv[1] + "/" + name + ".bin")
    assert z.testzip() is None
    print(name, len(z.infolist()), z.read(name + "/byteorder").decode(), len(z.read(name + "/data/3")))
)";
  const auto out = run_python(dir, "zipfile", script, dir.str());
  if (!out) {
    GTEST_SKIP() << "no Python interpreter";
  }
  EXPECT_NE(out->find("plain 16 little 2400"), std::string::npos) << *out;
  EXPECT_NE(out->find("forced 16 little 2400"), std::string::npos) << *out;
}

TEST(TorchWriter, TorchLoadsPlainAndForcedZip64) {
  TempDir dir;
  write_file(dir.file("plain.bin"), rich_entries());
  write_file(dir.file("forced.bin"), rich_entries(), {.force_zip64 = true});
  const std::string script = R"(import sys, torch
for name in ("plain", "forced"):
    for mmap in (False, True):
        sd = torch.load(sys.argv[1] + "/" + name + ".bin", weights_only=True, mmap=mmap)
        print(name, mmap, " ".join(f"{k}:{str(v.dtype)[6:]}:{list(v.shape)}" for k, v in sd.items()))
        print(name, mmap, "big", sd["big"].flatten()[:3].tolist(), "mask", sd["mask"].tolist())
)";
  const auto out = run_python(dir, "torch", script, dir.str());
  if (!out) {
    GTEST_SKIP() << "no Python with torch (set FERRY_TORCH_PYTHON)";
  }
  const std::string tensors =
      "model.embed_tokens.weight:bfloat16:[4, 3] 1:float32:[] norm:float16:[0, 4] "
      "big:int64:[3, 100] scale:float8_e4m3fn:[2, 2] u:uint16:[1, 2, 3, 4] b:bfloat16:[5] "
      "\xc3\xa9:uint8:[1] z:float32:[3, 0, 2] mask:bool:[2]";
  // pattern(2400, 3) as int64: bytes 3, 134, 9, ... little-endian.
  std::vector<std::byte> big = pattern(24, 3);
  std::vector<std::int64_t> first(3);
  std::memcpy(first.data(), big.data(), 24);
  const std::string values = "big [" + std::to_string(first[0]) + ", " + std::to_string(first[1]) +
                             ", " + std::to_string(first[2]) + "] mask [True, False]";
  for (const char* name : {"plain", "forced"}) {
    for (const char* mmap : {"False", "True"}) {
      const std::string head = std::string(name) + " " + mmap + " ";
      EXPECT_NE(out->find(head + tensors), std::string::npos) << *out;
      EXPECT_NE(out->find(head + values), std::string::npos) << *out;
    }
  }
}

TEST(TorchWriter, StreamingInAnyPiecesGivesTheSameFile) {
  TempDir dir;
  const auto entries = rich_entries();
  write_file(dir.file("one.bin"), entries);
  // The same bytes in uneven pieces that cross tensor boundaries.
  std::string all;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    all += tensor_data(entries[i], static_cast<unsigned>(i));
  }
  TorchWriter w(dir.file("sub/one.bin"));
  std::filesystem::create_directories(dir.file("sub"));
  for (const auto& e : entries) {
    w.add(e.name, e.dtype, e.shape);
  }
  w.begin();
  const auto* p = reinterpret_cast<const std::byte*>(all.data());
  for (std::size_t at = 0, piece = 1; at < all.size(); piece = piece * 7 % 61 + 1) {
    const std::size_t n = std::min(piece, all.size() - at);
    w.write(std::span<const std::byte>(p + at, n));
    at += n;
  }
  EXPECT_EQ(w.written(), w.data_bytes());
  w.finish();
  EXPECT_EQ(read_file(dir.file("sub/one.bin")), read_file(dir.file("one.bin")));
}

TEST(TorchWriter, ArchiveNameIsTheFileStem) {
  EXPECT_EQ(torch_archive_name("/x/pytorch_model-00001-of-00002.bin"),
            "pytorch_model-00001-of-00002");
  EXPECT_EQ(torch_archive_name("model.v2.bin"), "model.v2");
  EXPECT_EQ(torch_archive_name("dir.d/plain"), "plain");
  EXPECT_EQ(torch_archive_name("/dev/stdout"), "stdout");
  EXPECT_EQ(torch_archive_name(".bin"), "archive");
  EXPECT_EQ(torch_archive_name("x/"), "archive");
}

TEST(TorchWriter, NoTensorsIsAnEmptyStateDict) {
  TempDir dir;
  const std::string path = dir.file("empty.bin");
  write_file(path, {});
  const std::string bytes = read_file(path);
  const ZipArchive z = read_zip(bytes);
  check_layout(z, bytes, false);
  EXPECT_EQ(z.members.size(), 6u);
  EXPECT_EQ(z.members[0].data, torch_state_dict_pickle({}, path));
}

// ---- misuse and failures -------------------------------------------------------------

TEST(TorchWriter, WritingPastTheDeclaredTotalIsAnErrorNamingTheTensor) {
  TempDir dir;
  const std::string path = dir.file("x.bin");
  TorchWriter w(path);
  w.add("first", DType::kU8, {2});
  w.add("second", DType::kU8, {2});
  w.begin();
  auto data = pattern(8, 1);
  w.write(std::span(data).first(3));
  try {
    w.write(std::span(data).first(2));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_EQ(e.file(), path);
    EXPECT_EQ(e.tensor(), "second");
    EXPECT_NE(e.rule().find("exceeds the declared 4 data bytes"), std::string::npos) << e.what();
  }
  // Nothing of the refused write went in: the file can still be completed.
  w.write(std::span(data).subspan(3, 1));
  w.finish();
  const ZipArchive z = read_zip(read_file(path));
  EXPECT_EQ(z.members.at(4).data + z.members.at(5).data, str(std::span(data).first(4)));
}

TEST(TorchWriter, FinishingShortIsAnErrorAndLeavesNoFile) {
  TempDir dir;
  const std::string path = dir.file("short.bin");
  {
    TorchWriter w(path);
    w.add("a", DType::kF32, {2});
    w.add("b", DType::kF32, {2});
    w.begin();
    w.write(pattern(10, 1));
    try {
      w.finish();
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kSynth);
      EXPECT_EQ(e.file(), path);
      EXPECT_EQ(e.tensor(), "b");
      EXPECT_NE(e.rule().find("only 10 of 16"), std::string::npos) << e.what();
      EXPECT_NE(e.rule().find("2 of 8"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(path));
  }
  // An archive without its central directory is not left behind, nor its temporary.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(TorchWriter, AFileAtThePathIsReplacedOnlyByAFinishedOne) {
  TempDir dir;
  const std::string path = dir.file("x.bin");
  ferry::testing::write_file(path, "old");
  {
    TorchWriter w(path);
    w.add("a", DType::kU8, {4});
    w.begin();
    w.write(pattern(2, 0));
  }  // abandoned short
  EXPECT_EQ(read_file(path), "old");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
  write_file(path, {{"a", DType::kU8, {1}}});
  EXPECT_EQ(read_zip(read_file(path)).members.size(), 7u);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
}

TEST(TorchWriter, AnOutputsFailureCarriesTheStageAndSettingItWasGiven) {
  TempDir dir;
  const std::string full = dir.file("full.bin");
  // A twin of /dev/full: written in place (never replaced), every write ENOSPC.
  if (::mknod(full.c_str(), S_IFCHR | 0666, makedev(1, 7)) != 0) {
    GTEST_SKIP() << "mknod is not permitted here; CI runs as root and makes the node";
  }
  TorchWriter w(full, Stage::kOutput, "dump");
  w.add("a", DType::kU8, {1});
  w.begin();
  w.write(pattern(1, 0));
  try {
    w.finish();  // the buffered bytes reach the device here
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kOutput) << e.what();
    EXPECT_EQ(e.file(), full);
    EXPECT_NE(e.rule().find("dump: cannot write: " + errno_text(ENOSPC)), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(w.write(pattern(1, 0)), Error);  // failed: nothing more is taken
  struct stat st {};
  ASSERT_EQ(::lstat(full.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));  // neither replaced nor removed
}

TEST(TorchWriter, CannotCreateTheFileNamesThePath) {
  TempDir dir;
  const std::string path = dir.file("missing/folder/x.bin");
  TorchWriter w(path);
  w.add("a", DType::kU8, {1});
  try {
    w.begin();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_EQ(e.file(), path);
  }
}

TEST(TorchWriter, RejectsMisuse) {
  TempDir dir;
  const std::string path = dir.file("m.bin");
  TorchWriter w(path);
  auto one = pattern(1, 0);
  EXPECT_THROW(w.write(one), Error);  // before begin
  EXPECT_THROW(w.finish(), Error);    // before begin
  w.add("a", DType::kU8, {1});
  w.begin();
  EXPECT_THROW(w.begin(), Error);
  try {
    w.add("b", DType::kU8, {1});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.tensor(), "b");
    EXPECT_NE(e.rule().find("add() after begin()"), std::string::npos) << e.what();
  }
  w.write(one);
  w.finish();
  EXPECT_THROW(w.write(one), Error);
  EXPECT_THROW(w.finish(), Error);
  EXPECT_TRUE(std::filesystem::exists(path));  // a finished file stays
}

TEST(TorchWriter, RefusesNamesAndShapesTorchCannotHold) {
  TorchWriter w("/nonexistent/n.bin", Stage::kOutput, "dump");
  auto expect_error = [&](const std::string& name, std::vector<std::uint64_t> shape,
                          const std::string& rule) {
    try {
      w.add(name, DType::kF32, std::move(shape));
      FAIL() << "expected an error for '" << name << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kOutput);
      EXPECT_EQ(e.file(), "/nonexistent/n.bin");
      EXPECT_NE(e.rule().find("dump: "), std::string::npos) << e.what();
      EXPECT_NE(e.rule().find(rule), std::string::npos) << e.what();
    }
  };
  expect_error("", {1}, "must not be empty");
  expect_error("bad\xff", {1}, "not valid UTF-8");
  expect_error("surrogate\xed\xa0\x80", {1}, "not valid UTF-8");
  expect_error("overlong\xc0\xaf", {1}, "not valid UTF-8");
  expect_error("huge", {std::uint64_t{1} << 40, std::uint64_t{1} << 30}, "overflow");
  expect_error("dim", {std::uint64_t{1} << 63}, "does not fit torch's int64");
  // No bytes, but strides past int64 (a 0 dimension counts as 1 in them).
  expect_error("strides", {0, std::uint64_t{1} << 32, std::uint64_t{1} << 32, 2}, "overflow");
  w.add("a", DType::kF32, {1});
  expect_error("a", {1}, "declared twice");
  try {
    torch_state_dict_pickle({{"x", DType::kU8, {1}}, {"x", DType::kU8, {1}}}, "f.bin");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kSynth);
    EXPECT_EQ(e.file(), "f.bin");
    EXPECT_EQ(e.tensor(), "x");
  }
}

}  // namespace
}  // namespace ferry::io
