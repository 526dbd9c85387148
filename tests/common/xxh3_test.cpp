// XXH3-128 against vectors from an independent build of xxHash (python-xxhash 3.x,
// xxHash 0.8.4: xxhash.xxh3_128_hexdigest), at lengths that take each of its code
// paths (empty, 1-3, 4-8, 9-16, 17-128, 129-240, and the long loop with a partial
// last stripe), in one call and streamed in uneven pieces.
#include "common/xxh3.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ferry {
namespace {

std::vector<std::byte> pattern(std::size_t n) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = static_cast<std::byte>((i * 31 + 7) & 0xFF);
  }
  return out;
}

const std::vector<std::pair<std::size_t, std::string>> kVectors = {
    {0, "99aa06d3014798d86001c324468d497f"},       {1, "495b62073ef70ca44c5cca45d0f4811f"},
    {3, "46f66cb93538156515f7093b173d005c"},       {16, "650fe308c566747df853dd94614dfa07"},
    {17, "18217300b5132d5a78c349fe81b2f26c"},      {128, "b4f87b99d2db8a511e04fad9f0cacb4d"},
    {129, "6881633650cd8924c51bc887976aef63"},     {240, "de57aab31e77a2ff93e173833f75ab66"},
    {241, "92b991a7192f3f080b3b630948ce4a00"},     {1000, "f534f51e82a81d29989765d0ea7a5ecd"},
    {1 << 20, "e3503d8de40743b7269eb834f6c110a9"},
};

TEST(Xxh3, MatchesAnIndependentBuildAtEveryLengthClass) {
  for (const auto& [n, want] : kVectors) {
    EXPECT_EQ(xxh3_128(pattern(n)).hex(), want) << n << " bytes";
  }
}

TEST(Xxh3, StreamedInUnevenPiecesGivesTheOneCallHash) {
  for (const auto& [n, want] : kVectors) {
    const std::vector<std::byte> data = pattern(n);
    Xxh3Hasher h;
    std::size_t at = 0;
    for (std::size_t step = 1; at < n; step = step * 3 + 1) {
      const std::size_t len = std::min(step, n - at);
      h.update(std::span(data).subspan(at, len));
      at += len;
    }
    EXPECT_EQ(h.digest().hex(), want) << n << " bytes";
    h.reset();
    EXPECT_EQ(h.digest().hex(), kVectors[0].second);  // reset: the empty input's
  }
}

TEST(Xxh3, OneFlippedBitChangesTheHash) {
  std::vector<std::byte> data = pattern(4096);
  const Hash128 before = xxh3_128(data);
  data[2048] ^= std::byte{1};
  EXPECT_NE(xxh3_128(data), before);
}

TEST(Xxh3, HexRoundTripsAndBadTextIsRefused) {
  const Hash128 h = xxh3_128(pattern(1000));
  EXPECT_EQ(Hash128::from_hex(h.hex()), h);
  EXPECT_EQ(Hash128::from_hex("F534F51E82A81D29989765D0EA7A5ECD"), h);  // either case
  EXPECT_EQ(h.high, 0xf534f51e82a81d29ULL);
  EXPECT_EQ(h.low, 0x989765d0ea7a5ecdULL);
  for (const char* bad : {"", "f534", "f534f51e82a81d29989765d0ea7a5ecd0",
                          "g534f51e82a81d29989765d0ea7a5ecd", "f534f51e82a81d29 89765d0ea7a5ecd"}) {
    EXPECT_EQ(Hash128::from_hex(bad), std::nullopt) << bad;
  }
}

}  // namespace
}  // namespace ferry
