// XXH3-128 (xxHash 0.8, from Debian's libxxhash-dev, compiled into this one file):
// the checksum of every tensor a presharded checkpoint stores, fast enough to run
// at disk speed on one core. Its canonical form is the 32 hex digits xxHash and
// SGLang's presharded manifests write (high 64 bits first, big-endian).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace ferry {

struct Hash128 {
  std::uint64_t high = 0;
  std::uint64_t low = 0;

  bool operator==(const Hash128&) const = default;
  // 32 lowercase hex digits, high half first.
  std::string hex() const;
  // The inverse of hex(): exactly 32 hex digits (either case), else nullopt.
  static std::optional<Hash128> from_hex(std::string_view text);
};

// XXH3-128 of `data` in one call.
Hash128 xxh3_128(std::span<const std::byte> data);

// The same over data given in pieces: any split gives the one-call hash. Not
// thread-safe; movable.
class Xxh3Hasher {
 public:
  Xxh3Hasher();
  ~Xxh3Hasher();
  Xxh3Hasher(Xxh3Hasher&&) noexcept;
  Xxh3Hasher& operator=(Xxh3Hasher&&) noexcept;

  void update(std::span<const std::byte> data);
  // The hash of everything given since construction or reset(); update() may go on.
  Hash128 digest() const;
  void reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ferry
