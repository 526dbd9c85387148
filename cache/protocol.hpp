// The weight cache's messages (docs/ARCHITECTURE.md, "The weight cache"). Every
// request is a frame {"type": ..., ...}; every reply a frame of the same type, or
// {"type": "error", "message": ...} after which the daemon closes the connection.
//
//   hello  {protocol, ferry}                -> {protocol, ferry, pid, start_time}
//   query  {fingerprint, identity}          -> {status: ok|mismatch, fingerprint,
//                                               identity, compat, differences, ranks}
//   fetch  {fingerprint, ranks: [tp rank]}  -> the FetchReply below, then one
//                                              descriptor per memfd storage
//   ping   {}                               -> {}
//
// What a client receives is checked here before anything is mapped: types, ranges,
// every param inside its storage, unique names, the descriptor count. A peer is
// never trusted: parse_fetch_reply is what fuzz/fuzz_cache_frame.cpp feeds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/dtype.hpp"

namespace ferry::cache {

inline constexpr int kProtocolVersion = 1;

// One block of shared memory: a host device's memfd arena, or a CUDA allocation
// exported as a cudaIpcMemHandle.
struct StorageEntry {
  std::string kind;  // "memfd" (a descriptor follows the reply) or "cuda_ipc"
  std::uint64_t bytes = 0;
  std::string device;  // the daemon's name for it: "host:0", "cuda:1"
  std::string uuid;    // cuda_ipc: the GPU's UUID ("GPU-xxxxxxxx-..."), else ""
  std::string handle;  // cuda_ipc: the 64-byte handle, hex; else ""
  // "ucx" (a remote seed's, remote_instance): the storage's address in the seed and
  // its packed UCX remote key, hex.
  std::uint64_t address = 0;
  std::string rkey = {};
};

// What a seed's fetch reply may carry, in hex digits: a UCX worker address (tens to
// a few hundred bytes over TCP or InfiniBand) and a packed remote key.
inline constexpr std::size_t kMaxWorkerHex = 128 * 1024;
inline constexpr std::size_t kMaxRkeyHex = 16 * 1024;

struct TableParam {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<std::uint64_t> shape;
  std::vector<std::uint64_t> strides;  // in elements
  std::size_t storage = 0;             // index into FetchReply::storages
  std::uint64_t offset = 0;            // from the storage's start
  std::uint64_t nbytes = 0;
};

struct TableRank {
  int tp_rank = 0;
  int pp_rank = 0;
  std::string device;
  std::vector<TableParam> params;  // sorted by name
};

struct FetchReply {
  std::vector<StorageEntry> storages;
  std::vector<TableRank> ranks;
  // A remote seed's UCX worker address (hex); "" from a local daemon.
  std::string worker;
  // Descriptors that follow the frame: one per memfd storage, in storage order.
  std::size_t descriptors() const;
};

nlohmann::json to_json(const FetchReply& reply);
// Throws Error(Stage::kCache) naming `where` and, for a param, its name. `remote`: a
// seed's reply (ucx storages and a worker address, nothing else); else a local
// daemon's (memfd and cuda_ipc).
FetchReply parse_fetch_reply(const nlohmann::json& reply, const std::string& where,
                             bool remote = false);

// {"type": "error", "message": message}
nlohmann::json error_reply(const std::string& message);
// The request's type, checked to be one of hello, query, fetch, ping.
std::string request_type(const nlohmann::json& request, const std::string& where);
// Throws when `reply` is an error frame (its message quoted) or not of `type`.
// `peer` names the sender in the message ("the daemon", "the seed").
void expect_reply(const nlohmann::json& reply, std::string_view type, const std::string& where,
                  std::string_view peer = "the daemon");

// Reads field `key` of `doc` as the type asked, or throws naming where and the key.
std::string get_string(const nlohmann::json& doc, const char* key, const std::string& where);
std::uint64_t get_uint(const nlohmann::json& doc, const char* key, const std::string& where);

}  // namespace ferry::cache
