#include "common/xxh3.hpp"

#include <new>

// Header-only use of Debian's xxhash.h: no shared library for the package or the
// Python module to carry.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ferry {

struct Xxh3Hasher::State {
  XXH3_state_t s;
};

namespace {

Hash128 from_xxh(XXH128_hash_t h) {
  return Hash128{h.high64, h.low64};
}

}  // namespace

std::string Hash128::hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[static_cast<std::size_t>(15 - i)] = kDigits[(high >> (4 * i)) & 0xF];
    out[static_cast<std::size_t>(31 - i)] = kDigits[(low >> (4 * i)) & 0xF];
  }
  return out;
}

std::optional<Hash128> Hash128::from_hex(std::string_view text) {
  if (text.size() != 32) {
    return std::nullopt;
  }
  Hash128 out;
  for (std::size_t i = 0; i < 32; ++i) {
    const char c = text[i];
    std::uint64_t v = 0;
    if (c >= '0' && c <= '9') {
      v = static_cast<std::uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v = static_cast<std::uint64_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v = static_cast<std::uint64_t>(c - 'A' + 10);
    } else {
      return std::nullopt;
    }
    std::uint64_t& half = i < 16 ? out.high : out.low;
    half = (half << 4) | v;
  }
  return out;
}

Hash128 xxh3_128(std::span<const std::byte> data) {
  return from_xxh(XXH3_128bits(data.data(), data.size()));
}

Xxh3Hasher::Xxh3Hasher() : state_(std::make_unique<State>()) {
  reset();
}
Xxh3Hasher::~Xxh3Hasher() = default;
Xxh3Hasher::Xxh3Hasher(Xxh3Hasher&&) noexcept = default;
Xxh3Hasher& Xxh3Hasher::operator=(Xxh3Hasher&&) noexcept = default;

void Xxh3Hasher::update(std::span<const std::byte> data) {
  if (!data.empty()) {
    XXH3_128bits_update(&state_->s, data.data(), data.size());
  }
}

Hash128 Xxh3Hasher::digest() const {
  return from_xxh(XXH3_128bits_digest(&state_->s));
}

void Xxh3Hasher::reset() {
  XXH3_128bits_reset(&state_->s);
}

}  // namespace ferry
