// The weight cache's wire (cache/socket.cpp, cache/protocol.cpp), fed what a hostile
// peer could send: the input is written into one end of a real socket pair and read
// from the other by Connection::next_frame, frame after frame, as the daemon reads
// requests and a client reads replies; every frame is given to request_type (the
// daemon's dispatch) and parse_fetch_reply (the client's check of a table).
//
// Asserted:
//  - only ferry::Error escapes (a nlohmann exception, a crash or a hang is a finding);
//  - every accepted table holds: each non-empty param inside its storage (no
//    overflow), no name twice in a rank, one descriptor per memfd storage, a
//    cuda_ipc storage with a 128-digit handle and a UUID;
//  - to_json of an accepted table parses back to the same table, field by field.
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

namespace ferry::cache {
namespace {

void check_table(const FetchReply& t) {
  std::size_t memfd = 0;
  for (const StorageEntry& s : t.storages) {
    FUZZ_CHECK(s.kind == "memfd" || s.kind == "cuda_ipc", s.kind);
    memfd += s.kind == "memfd" ? 1 : 0;
    if (s.kind == "cuda_ipc") {
      FUZZ_CHECK(s.handle.size() == 128 && !s.uuid.empty());
    }
  }
  FUZZ_CHECK(t.descriptors() == memfd);
  for (const TableRank& r : t.ranks) {
    std::set<std::string> names;
    for (const TableParam& p : r.params) {
      FUZZ_CHECK(names.insert(p.name).second, p.name);
      FUZZ_CHECK(p.shape.size() == p.strides.size(), p.name);
      if (p.nbytes != 0) {
        FUZZ_CHECK(p.storage < t.storages.size(), p.name);
        const std::uint64_t size = t.storages[p.storage].bytes;
        FUZZ_CHECK(p.offset <= size && p.nbytes <= size - p.offset, p.name);
      }
    }
  }
}

bool same(const FetchReply& a, const FetchReply& b) {
  if (a.storages.size() != b.storages.size() || a.ranks.size() != b.ranks.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.storages.size(); ++i) {
    const StorageEntry &x = a.storages[i], &y = b.storages[i];
    if (x.kind != y.kind || x.bytes != y.bytes || x.device != y.device || x.uuid != y.uuid ||
        x.handle != y.handle) {
      return false;
    }
  }
  for (std::size_t i = 0; i < a.ranks.size(); ++i) {
    const TableRank &x = a.ranks[i], &y = b.ranks[i];
    if (x.tp_rank != y.tp_rank || x.pp_rank != y.pp_rank || x.device != y.device ||
        x.params.size() != y.params.size()) {
      return false;
    }
    for (std::size_t j = 0; j < x.params.size(); ++j) {
      const TableParam &p = x.params[j], &q = y.params[j];
      if (p.name != q.name || p.dtype != q.dtype || p.shape != q.shape || p.strides != q.strides ||
          p.storage != q.storage || p.offset != q.offset || p.nbytes != q.nbytes) {
        return false;
      }
    }
  }
  return true;
}

void one_frame(const nlohmann::json& frame) {
  try {
    (void)request_type(frame, "fuzz");
  } catch (const Error&) {
  }
  FetchReply table;
  try {
    table = parse_fetch_reply(frame, "fuzz");
  } catch (const Error&) {
    return;
  }
  check_table(table);
  const FetchReply again = parse_fetch_reply(to_json(table), "fuzz");
  FUZZ_CHECK(same(table, again), "to_json of an accepted table parses back differently");
}

}  // namespace
}  // namespace ferry::cache

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ferry::fuzz::feed_frames(data, size,
                           [](const nlohmann::json& frame) { ferry::cache::one_frame(frame); });
  return 0;
}
