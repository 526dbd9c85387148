// CRC-32 against zlib (Python's zlib.crc32): the check value of the CRC catalogue,
// the empty input, and lengths on either side of the 16-byte step of the sliced
// loop; streamed in uneven pieces it gives the one-call value.
#include "common/crc32.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry {
namespace {

std::span<const std::byte> bytes_of(std::string_view text) {
  return std::as_bytes(std::span<const char>(text.data(), text.size()));
}

std::vector<std::byte> pattern(std::size_t n) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = static_cast<std::byte>((i * 31 + 7) & 0xFF);
  }
  return out;
}

TEST(Crc32, CheckValueAndEmptyInput) {
  EXPECT_EQ(crc32(0, bytes_of("123456789")), 0xCBF43926u);
  EXPECT_EQ(crc32(0, {}), 0u);
  // An empty piece leaves any CRC as it was.
  EXPECT_EQ(crc32(0xCBF43926u, {}), 0xCBF43926u);
  EXPECT_EQ(crc32(0, bytes_of("The quick brown fox jumps over the lazy dog")), 0x414FA339u);
  EXPECT_EQ(crc32(0, std::vector<std::byte>(32, std::byte{0})), 0x190A55ADu);
  EXPECT_EQ(crc32(0, std::vector<std::byte>(32, std::byte{0xFF})), 0xFF6CAB0Bu);
}

TEST(Crc32, MatchesZlibAroundTheSliceWidth) {
  const std::vector<std::pair<std::size_t, std::uint32_t>> vectors = {
      {1, 0x4C667A2Eu},  {15, 0x8F77FABBu}, {16, 0x0636A895u},   {17, 0x71B8D951u},
      {31, 0x45D69B08u}, {33, 0xD390BD70u}, {1000, 0x8902161Eu}, {1 << 20, 0xD424BDC1u},
  };
  for (const auto& [n, want] : vectors) {
    EXPECT_EQ(crc32(0, pattern(n)), want) << n << " bytes";
  }
}

TEST(Crc32, SplitCallsGiveTheOneCallValue) {
  const std::vector<std::byte> data = pattern(10007);
  const std::uint32_t whole = crc32(0, data);
  for (std::size_t cut : {0u, 1u, 7u, 16u, 17u, 4096u, 10006u, 10007u}) {
    std::span<const std::byte> all(data);
    EXPECT_EQ(crc32(crc32(0, all.first(cut)), all.subspan(cut)), whole) << "cut at " << cut;
  }
  // Many uneven pieces, none aligned to the step.
  std::uint32_t crc = 0;
  std::size_t at = 0;
  for (std::size_t piece = 1; at < data.size(); piece = piece * 3 % 97 + 1) {
    const std::size_t n = std::min(piece, data.size() - at);
    crc = crc32(crc, std::span<const std::byte>(data).subspan(at, n));
    at += n;
  }
  EXPECT_EQ(crc, whole);
}

}  // namespace
}  // namespace ferry
