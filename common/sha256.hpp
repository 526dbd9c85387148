// SHA-256 (FIPS 180-4), for the weight-cache fingerprint (runtime/cache_*.cpp):
// the digest that names a daemon's socket and is compared with exact equality.
// A plain implementation: fingerprints hash a few KiB, so speed does not matter,
// and the build takes no crypto library for it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ferry {

using Sha256Digest = std::array<std::uint8_t, 32>;

Sha256Digest sha256(std::string_view data);
// Lower-case hex of the digest (64 characters).
std::string sha256_hex(std::string_view data);
// HMAC-SHA-256 (RFC 2104): remote_instance's challenge and response, which prove
// that both ends hold the shared secret without sending it.
Sha256Digest hmac_sha256(std::string_view key, std::string_view message);
// RFC 4648 base64url without padding of the first `bytes` bytes of a digest.
std::string base64url(const std::uint8_t* data, std::size_t bytes);

}  // namespace ferry
