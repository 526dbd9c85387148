// CRC-32 by slicing-by-16: table t[k][b] is the CRC of byte b followed by k zero
// bytes, so 16 input bytes fold into the CRC with 16 independent lookups per step
// instead of a chain of 16 dependent ones.
#include "common/crc32.hpp"

#include <array>

namespace ferry {
namespace {

constexpr std::uint32_t kPolynomial = 0xEDB88320u;  // 0x04C11DB7 reflected
constexpr std::size_t kSlices = 16;

using Tables = std::array<std::array<std::uint32_t, 256>, kSlices>;

constexpr Tables make_tables() {
  Tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) {
      c = (c & 1u) != 0 ? (c >> 1) ^ kPolynomial : c >> 1;
    }
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < kSlices; ++k) {
    for (std::uint32_t b = 0; b < 256; ++b) {
      const std::uint32_t prev = t[k - 1][b];
      t[k][b] = (prev >> 8) ^ t[0][prev & 0xffu];
    }
  }
  return t;
}

constexpr Tables kTables = make_tables();

// Little-endian load: the algorithm folds the bytes in stream order into the
// low bits first, whatever the host's byte order.
std::uint32_t load_le32(const unsigned char* p) {
  return std::uint32_t{p[0]} | (std::uint32_t{p[1]} << 8) | (std::uint32_t{p[2]} << 16) |
         (std::uint32_t{p[3]} << 24);
}

}  // namespace

std::uint32_t crc32(std::uint32_t crc, std::span<const std::byte> bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t n = bytes.size();
  std::uint32_t c = ~crc;
  while (n >= kSlices) {
    const std::uint32_t a = load_le32(p) ^ c;
    const std::uint32_t b = load_le32(p + 4);
    const std::uint32_t d = load_le32(p + 8);
    const std::uint32_t e = load_le32(p + 12);
    c = kTables[15][a & 0xffu] ^ kTables[14][(a >> 8) & 0xffu] ^ kTables[13][(a >> 16) & 0xffu] ^
        kTables[12][a >> 24] ^ kTables[11][b & 0xffu] ^ kTables[10][(b >> 8) & 0xffu] ^
        kTables[9][(b >> 16) & 0xffu] ^ kTables[8][b >> 24] ^ kTables[7][d & 0xffu] ^
        kTables[6][(d >> 8) & 0xffu] ^ kTables[5][(d >> 16) & 0xffu] ^ kTables[4][d >> 24] ^
        kTables[3][e & 0xffu] ^ kTables[2][(e >> 8) & 0xffu] ^ kTables[1][(e >> 16) & 0xffu] ^
        kTables[0][e >> 24];
    p += kSlices;
    n -= kSlices;
  }
  while (n-- > 0) {
    c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xffu];
  }
  return ~c;
}

}  // namespace ferry
