// A seed's control port (remote/control.cpp, cache/protocol.cpp), fed what a hostile
// peer could send: the input is written into one end of a real socket pair and read
// frame after frame by Connection::next_frame, as a seed reads a target and a target
// reads a seed. Each frame goes through the seed's checks (check_hello, check_auth)
// and the target's (check_challenge, parse_fetch_reply of a seed's table), and every
// string in it through parse_host_port.
//
// Asserted:
//  - only ferry::Error escapes (a nlohmann exception, a crash or a hang is a finding);
//  - no frame passes check_auth or check_challenge without the proof made with the
//    fuzzer's fixed token (a proof it could only guess);
//  - every accepted seed table holds: ucx storages only, each with a hex key and an
//    address whose range does not overflow, a hex worker address, each non-empty param
//    inside its storage, no name twice in a rank; to_json of it parses back the same.
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "cache/protocol.hpp"
#include "cache/socket.hpp"
#include "common/error.hpp"
#include "fuzz/fuzz_check.hpp"
#include "fuzz/fuzz_frames.hpp"
#include "remote/control.hpp"

namespace ferry::remote {
namespace {

constexpr std::string_view kToken = "fuzz-token-0123456789abcdef";
const std::string kNonceA(64, 'a');
const std::string kNonceB(64, 'b');

bool hex(const std::string& s) {
  return s.size() % 2 == 0 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

void check_seed_table(const cache::FetchReply& t) {
  FUZZ_CHECK(!t.worker.empty() && t.worker.size() <= cache::kMaxWorkerHex && hex(t.worker));
  for (const cache::StorageEntry& s : t.storages) {
    FUZZ_CHECK(s.kind == "ucx", s.kind);
    FUZZ_CHECK(!s.rkey.empty() && s.rkey.size() <= cache::kMaxRkeyHex && hex(s.rkey));
    FUZZ_CHECK(s.address <= ~std::uint64_t{0} - s.bytes);
  }
  FUZZ_CHECK(t.descriptors() == 0);
  for (const cache::TableRank& r : t.ranks) {
    std::set<std::string> names;
    for (const cache::TableParam& p : r.params) {
      FUZZ_CHECK(names.insert(p.name).second, p.name);
      if (p.nbytes != 0) {
        FUZZ_CHECK(p.storage < t.storages.size(), p.name);
        const std::uint64_t size = t.storages[p.storage].bytes;
        FUZZ_CHECK(p.offset <= size && p.nbytes <= size - p.offset, p.name);
      }
    }
  }
}

void strings(const nlohmann::json& j, int depth) {
  if (depth > 4) {
    return;
  }
  if (j.is_string()) {
    try {
      const HostPort a = parse_host_port(j.get<std::string>(), "fuzz");
      FUZZ_CHECK(a.port != 0);
      FUZZ_CHECK(parse_host_port(a.text(), "fuzz").text() == a.text(), a.text());
    } catch (const Error&) {
    }
  } else if (j.is_structured()) {
    for (const auto& v : j) {
      strings(v, depth + 1);
    }
  }
}

void one_frame(const nlohmann::json& frame) {
  std::string nonce;
  if (check_hello(frame, 1, nonce).empty()) {
    FUZZ_CHECK(nonce.size() == 64 && hex(nonce));
  }
  if (check_auth(frame, kToken, kNonceA, kNonceB).empty()) {
    FUZZ_CHECK(frame["proof"] == proof(kToken, kTargetLabel, kNonceA, kNonceB));
  }
  std::string seed_nonce;
  if (check_challenge(frame, kToken, kNonceA, seed_nonce).empty()) {
    FUZZ_CHECK(seed_nonce != kNonceA);
    FUZZ_CHECK(frame["proof"] == proof(kToken, kSeedLabel, kNonceA, seed_nonce));
  }
  try {
    (void)cache::request_type(frame, "fuzz");
  } catch (const Error&) {
  }
  strings(frame, 0);
  cache::FetchReply table;
  try {
    table = cache::parse_fetch_reply(frame, "fuzz", /*remote=*/true);
  } catch (const Error&) {
    return;
  }
  check_seed_table(table);
  const nlohmann::json again = cache::to_json(table);
  const cache::FetchReply back = cache::parse_fetch_reply(again, "fuzz", true);
  FUZZ_CHECK(cache::to_json(back) == again, "to_json of an accepted table parses back differently");
}

}  // namespace
}  // namespace ferry::remote

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ferry::fuzz::feed_frames(data, size,
                           [](const nlohmann::json& frame) { ferry::remote::one_frame(frame); });
  return 0;
}
