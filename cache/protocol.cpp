#include "cache/protocol.hpp"

#include <set>

#include "common/error.hpp"

namespace ferry::cache {

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& tensor,
                       const std::string& rule) {
  throw Error(Stage::kCache, where, tensor, rule);
}

// A reply's sizes are bounded so that a hostile daemon cannot make a client
// allocate without end: no param has more dimensions than a tensor can.
constexpr std::size_t kMaxDims = 16;
constexpr std::uint64_t kMaxStorages = 1 << 20;

const nlohmann::json& field(const nlohmann::json& doc, const char* key, const std::string& where,
                            const std::string& tensor = {}) {
  if (!doc.is_object()) {
    fail(where, tensor, std::string("expected an object holding '") + key + "'");
  }
  auto it = doc.find(key);
  if (it == doc.end()) {
    fail(where, tensor, std::string("the reply lacks '") + key + "'");
  }
  return *it;
}

std::uint64_t as_uint(const nlohmann::json& v, const char* key, const std::string& where,
                      const std::string& tensor = {}) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0)) {
    fail(where, tensor, std::string("'") + key + "' must be a non-negative integer");
  }
  return v.get<std::uint64_t>();
}

std::vector<std::uint64_t> dims(const nlohmann::json& v, const char* key, const std::string& where,
                                const std::string& tensor) {
  if (!v.is_array() || v.size() > kMaxDims) {
    fail(where, tensor,
         std::string("'") + key + "' must be an array of at most 16 non-negative integers");
  }
  std::vector<std::uint64_t> out;
  for (const nlohmann::json& d : v) {
    out.push_back(as_uint(d, key, where, tensor));
  }
  return out;
}

}  // namespace

std::string get_string(const nlohmann::json& doc, const char* key, const std::string& where) {
  const nlohmann::json& v = field(doc, key, where);
  if (!v.is_string()) {
    fail(where, "", std::string("'") + key + "' must be a string");
  }
  return v.get<std::string>();
}

std::uint64_t get_uint(const nlohmann::json& doc, const char* key, const std::string& where) {
  return as_uint(field(doc, key, where), key, where);
}

std::size_t FetchReply::descriptors() const {
  std::size_t n = 0;
  for (const StorageEntry& s : storages) {
    n += s.kind == "memfd" ? 1 : 0;
  }
  return n;
}

nlohmann::json to_json(const FetchReply& reply) {
  nlohmann::json storages = nlohmann::json::array();
  for (const StorageEntry& s : reply.storages) {
    nlohmann::json entry = {{"kind", s.kind},
                            {"bytes", s.bytes},
                            {"device", s.device},
                            {"uuid", s.uuid},
                            {"handle", s.handle}};
    if (s.kind == "ucx") {
      entry["address"] = s.address;
      entry["rkey"] = s.rkey;
    }
    storages.push_back(std::move(entry));
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (const TableRank& r : reply.ranks) {
    nlohmann::json params = nlohmann::json::array();
    for (const TableParam& p : r.params) {
      params.push_back({{"name", p.name},
                        {"dtype", dtype_name(p.dtype)},
                        {"shape", p.shape},
                        {"strides", p.strides},
                        {"storage", p.storage},
                        {"offset", p.offset},
                        {"bytes", p.nbytes}});
    }
    ranks.push_back({{"tp_rank", r.tp_rank},
                     {"pp_rank", r.pp_rank},
                     {"device", r.device},
                     {"params", std::move(params)}});
  }
  nlohmann::json out = {{"type", "fetch"},
                        {"status", "ok"},
                        {"storages", std::move(storages)},
                        {"ranks", std::move(ranks)},
                        {"descriptors", reply.descriptors()}};
  if (!reply.worker.empty()) {
    out["worker"] = reply.worker;
  }
  return out;
}

namespace {

bool is_hex(const std::string& s) {
  return s.size() % 2 == 0 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

}  // namespace

FetchReply parse_fetch_reply(const nlohmann::json& reply, const std::string& where, bool remote) {
  expect_reply(reply, "fetch", where);
  FetchReply out;
  if (remote) {
    out.worker = get_string(reply, "worker", where);
    if (out.worker.empty() || out.worker.size() > kMaxWorkerHex || !is_hex(out.worker)) {
      fail(where, "",
           "'worker' must be a UCX worker address in lowercase hex, at most " +
               std::to_string(kMaxWorkerHex) + " digits");
    }
  }
  const nlohmann::json& storages = field(reply, "storages", where);
  if (!storages.is_array() || storages.size() > kMaxStorages) {
    fail(where, "", "'storages' must be an array of at most 1048576 entries");
  }
  for (const nlohmann::json& s : storages) {
    StorageEntry e;
    e.kind = get_string(s, "kind", where);
    if (remote ? e.kind != "ucx" : e.kind != "memfd" && e.kind != "cuda_ipc") {
      fail(where, "",
           "unknown storage kind '" + e.kind + "' (" +
               (remote ? "a seed sends ucx" : "memfd or cuda_ipc") + ")");
    }
    e.bytes = get_uint(s, "bytes", where);
    e.device = get_string(s, "device", where);
    e.uuid = get_string(s, "uuid", where);
    e.handle = get_string(s, "handle", where);
    if (e.kind == "cuda_ipc" && (e.handle.size() != 128 || e.uuid.empty())) {
      fail(where, "", "a cuda_ipc storage needs a 64-byte handle (128 hex digits) and a GPU uuid");
    }
    if (e.kind == "ucx") {
      e.address = get_uint(s, "address", where);
      e.rkey = get_string(s, "rkey", where);
      if (e.rkey.empty() || e.rkey.size() > kMaxRkeyHex || !is_hex(e.rkey)) {
        fail(where, "",
             "a ucx storage needs a packed remote key in lowercase hex, at most " +
                 std::to_string(kMaxRkeyHex) + " digits");
      }
      if (e.address > ~std::uint64_t{0} - e.bytes) {
        fail(where, "", "a ucx storage's address and size overflow");
      }
    }
    out.storages.push_back(std::move(e));
  }
  if (get_uint(reply, "descriptors", where) != out.descriptors()) {
    fail(where, "",
         "the reply announces " + std::to_string(get_uint(reply, "descriptors", where)) +
             " descriptors for " + std::to_string(out.descriptors()) + " memfd storage(s)");
  }
  const nlohmann::json& ranks = field(reply, "ranks", where);
  if (!ranks.is_array()) {
    fail(where, "", "'ranks' must be an array");
  }
  for (const nlohmann::json& r : ranks) {
    TableRank rank;
    const std::uint64_t tp = get_uint(r, "tp_rank", where);
    const std::uint64_t pp = get_uint(r, "pp_rank", where);
    if (tp > 65535 || pp > 65535) {
      fail(where, "", "a rank above 65535");
    }
    rank.tp_rank = static_cast<int>(tp);
    rank.pp_rank = static_cast<int>(pp);
    rank.device = get_string(r, "device", where);
    const nlohmann::json& params = field(r, "params", where);
    if (!params.is_array()) {
      fail(where, "", "'params' must be an array");
    }
    std::set<std::string> names;
    for (const nlohmann::json& j : params) {
      TableParam p;
      p.name = get_string(j, "name", where);
      const std::string dtype = get_string(j, "dtype", where);
      const std::optional<DType> d = parse_dtype(dtype);
      if (!d) {
        fail(where, p.name, "unknown dtype '" + dtype + "'");
      }
      p.dtype = *d;
      p.shape = dims(field(j, "shape", where, p.name), "shape", where, p.name);
      p.strides = dims(field(j, "strides", where, p.name), "strides", where, p.name);
      if (p.strides.size() != p.shape.size()) {
        fail(where, p.name, "shape and strides differ in length");
      }
      p.storage = as_uint(field(j, "storage", where, p.name), "storage", where, p.name);
      p.offset = as_uint(field(j, "offset", where, p.name), "offset", where, p.name);
      p.nbytes = as_uint(field(j, "bytes", where, p.name), "bytes", where, p.name);
      if (p.nbytes == 0 && p.storage == 0) {
        // an empty param maps nothing (storage 0 need not exist)
      } else if (p.storage >= out.storages.size()) {
        fail(where, p.name, "storage " + std::to_string(p.storage) + " is not in the reply");
      }
      const std::uint64_t size = p.nbytes == 0 ? 0 : out.storages[p.storage].bytes;
      if (p.nbytes != 0 && (p.offset > size || p.nbytes > size - p.offset)) {
        fail(where, p.name,
             "bytes [" + std::to_string(p.offset) + ", +" + std::to_string(p.nbytes) +
                 ") lie outside storage " + std::to_string(p.storage) + " of " +
                 std::to_string(size) + " bytes");
      }
      if (!names.insert(p.name).second) {
        fail(where, p.name, "the param is listed twice in tp rank " + std::to_string(tp));
      }
      rank.params.push_back(std::move(p));
    }
    out.ranks.push_back(std::move(rank));
  }
  return out;
}

nlohmann::json error_reply(const std::string& message) {
  return {{"type", "error"}, {"message", message}};
}

std::string request_type(const nlohmann::json& request, const std::string& where) {
  const std::string type = get_string(request, "type", where);
  if (type != "hello" && type != "query" && type != "fetch" && type != "ping") {
    fail(where, "", "unknown request type '" + type + "' (hello, query, fetch, ping)");
  }
  return type;
}

void expect_reply(const nlohmann::json& reply, std::string_view type, const std::string& where,
                  std::string_view peer) {
  const std::string got = get_string(reply, "type", where);
  if (got == "error") {
    const auto it = reply.find("message");
    fail(where, "",
         std::string(peer) + " answered with an error: " +
             (it != reply.end() && it->is_string() ? it->get<std::string>() : std::string("?")));
  }
  if (got != type) {
    fail(where, "", "expected a '" + std::string(type) + "' reply, got '" + got + "'");
  }
}

}  // namespace ferry::cache
