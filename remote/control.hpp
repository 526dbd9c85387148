// A seed's control port (remote_instance): TCP connections carrying the weight
// cache's frames (cache/socket.hpp), authenticated by a shared secret. The bulk data
// never crosses it: a target pulls the parameters with UCX (remote/ucx.hpp).
//
//   hello  {protocol, ferry, nonce}     -> challenge {nonce, proof}: the seed's proof
//   auth   {proof}                      -> hello {protocol, ferry, pid, start_time}, or
//                                          an error frame and the connection closed
//   query  {fingerprint, identity}      -> as the local daemon's (the layout's identity)
//   fetch  {fingerprint, ranks}         -> the table (cache::FetchReply) with ucx
//                                          storages and the seed's worker address
//
// Both ends prove they hold the token without sending it: each sends 32 random
// bytes (a nonce), and each proof is HMAC-SHA-256(token, label | its peer's nonce |
// its own), with labels "ferry-seed" and "ferry-target". A target checks the seed's
// proof before it sends its own (a listener that is not the seed learns nothing it
// could replay), and the seed answers nothing but the challenge before the target's
// proof matched.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "cache/socket.hpp"

namespace ferry::remote {

// HOST:PORT, with HOST an IPv4 address, an IPv6 address in brackets or a host name.
struct HostPort {
  std::string host;
  std::uint16_t port = 0;
  std::string text() const;  // as given back: "10.0.0.1:7300", "[::1]:7300"
};
// Throws Error(Stage::kConfig) naming `key` for anything else (port 0 included,
// unless `any_port`: a listener's "let the kernel pick").
HostPort parse_host_port(const std::string& text, const std::string& key, bool any_port = false);

// A listening TCP socket bound to exactly that address (never all interfaces
// unless the address says so), non-blocking, close-on-exec.
cache::UniqueFd listen_tcp(const HostPort& address);
// The port a listening socket got (the one asked, or the kernel's for port 0).
std::uint16_t bound_port(int fd);
// Connects before `deadline`; the error names the address and errno.
cache::Connection connect_tcp(const HostPort& address, cache::Deadline deadline);
// The peer's address of a connected socket, "ADDRESS:PORT" ("?" when unknown).
std::string peer_address(int fd);

// The shared secret in `path` (remote.token_file), trailing whitespace removed. The
// file must be a regular file readable by its owner alone (no group or other bits,
// as ssh keys), hold 16 to 4096 bytes of token, and not be a link. Throws
// Error(Stage::kConfig) naming the file and what is wrong.
std::string read_token(const std::string& path);
// Equality in time that depends on the lengths only, never on where they differ.
bool same_token(std::string_view a, std::string_view b);

// 32 bytes from getrandom(2), as hex.
std::string random_nonce();
// HMAC-SHA-256(token, label | first | second) as hex: a side's proof.
std::string proof(std::string_view token, std::string_view label, std::string_view first,
                  std::string_view second);
inline constexpr std::string_view kSeedLabel = "ferry-seed";
inline constexpr std::string_view kTargetLabel = "ferry-target";

// The seed's checks, each "" when the frame passes, else why not (for the seed's
// log; the target is told "authentication failed" and nothing else):
// a target's first frame, a hello of `protocol` with a nonce (set in `nonce`)...
std::string check_hello(const nlohmann::json& frame, int protocol, std::string& nonce);
// ...and its second, an auth whose proof is the target's for these nonces.
std::string check_auth(const nlohmann::json& frame, std::string_view token,
                       std::string_view seed_nonce, std::string_view target_nonce);
// The target's check of the seed's challenge: "" when its proof is the seed's for
// `target_nonce` and the nonce it carries (set in `seed_nonce`).
std::string check_challenge(const nlohmann::json& frame, std::string_view token,
                            std::string_view target_nonce, std::string& seed_nonce);

}  // namespace ferry::remote
