// The weight-cache daemon (ferry/cache.hpp): one load into shareable memory, a
// registration, and a server that answers each connection on a thread of its own
// (at most kMaxConnections at once), every one under cache.timeout_ms.
#include <fcntl.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "cache/protocol.hpp"
#include "cache/registry.hpp"
#include "cache/socket.hpp"
#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "ferry/cache.hpp"
#include "gpu/device.hpp"
#include "runtime/cache.hpp"
#include "runtime/load_work.hpp"
#include "runtime/remote.hpp"

namespace ferry::runtime {

namespace {

constexpr std::size_t kMaxConnections = 64;
// A request is a few hundred bytes; 1 MiB leaves room and bounds a hostile one.
constexpr std::size_t kMaxRequestBytes = std::size_t{1} << 20;

[[noreturn]] void fail(const std::string& where, const std::string& rule) {
  throw Error(Stage::kCache, where, "", rule);
}

// What the daemon shares, made once after the load: every block, and each rank's
// table in terms of them.
struct Shared {
  std::vector<gpu::SharedBlock> blocks;
  std::vector<std::string> block_device;
  std::vector<cache::TableRank> ranks;  // storage = index into blocks
  std::uint64_t bytes = 0;
};

Shared share(const LoadedModel::State& state) {
  Shared out;
  std::map<const std::byte*, std::size_t> index;  // block base -> blocks[i]
  for (std::size_t r = 0; r < state.ranks.size(); ++r) {
    const LoadedRank& rank = state.ranks[r];
    gpu::Device& device = *state.devices.at(r);
    std::vector<std::size_t> seen;  // this rank's blocks, by index into out.blocks
    cache::TableRank t;
    t.tp_rank = rank.tp_rank;
    t.pp_rank = rank.pp_rank;
    t.device = rank.device;
    for (const LoadedParam& p : rank.params) {
      cache::TableParam tp;
      tp.name = p.name;
      tp.dtype = p.dtype;
      tp.shape = p.shape;
      tp.strides = p.strides;
      tp.nbytes = p.nbytes;
      if (p.nbytes == 0) {
        t.params.push_back(std::move(tp));  // storage 0, offset 0: nothing to map
        continue;
      }
      // Most params of a rank lie in its arena: ask the device (a CUDA IPC handle
      // each time) only for a pointer outside the blocks this rank has seen.
      std::optional<gpu::SharedBlock> b;
      for (const std::size_t k : seen) {
        const gpu::SharedBlock& x = out.blocks[k];
        if (p.data >= x.base && p.data < x.base + x.bytes) {
          b = x;
          break;
        }
      }
      if (!b) {
        b = device.shared_block(p.data);
      }
      if (!b) {
        throw Error(Stage::kCache, device.name(), p.name,
                    "the parameter is not in memory this device can share (null devices, or "
                    "memory adopted from an engine, cannot be served)");
      }
      auto [it, fresh] = index.emplace(b->base, out.blocks.size());
      if (fresh) {
        out.bytes += b->bytes;
        out.blocks.push_back(*b);
        out.block_device.push_back(device.name());
        seen.push_back(it->second);
      }
      tp.storage = it->second;
      tp.offset = static_cast<std::uint64_t>(p.data - b->base);
      t.params.push_back(std::move(tp));
    }
    out.ranks.push_back(std::move(t));
  }
  return out;
}

}  // namespace

struct CacheDaemon::Impl {
  LoadConfig config;
  std::unique_ptr<Runtime> runtime;  // kept for metrics.listen; idle after the load
  std::shared_ptr<LoadedModel> model;
  std::shared_ptr<LoadedModel::State> state;
  CacheIdentity id;
  Shared shared;
  cache::Registry registry;
  std::string key;
  std::string socket_path;
  std::string record_path;
  cache::ProcessIdentity self = cache::self_identity();
  cache::UniqueFd listener;
  std::unique_ptr<RemoteSeed> remote;  // remote.listen: targets on other machines
  int wake[2] = {-1, -1};
  std::atomic<bool> stopping{false};
  bool registered = false;
  Clock::time_point registered_at;

  std::atomic<std::uint64_t> clients_served{0}, connections{0}, refused{0};
  prometheus::Counter* m_served = nullptr;
  prometheus::Counter* m_refused = nullptr;
  prometheus::Gauge* m_bytes = nullptr;
  prometheus::Gauge* m_uptime = nullptr;

  std::mutex threads_mu;
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Worker> workers;

  explicit Impl(std::string dir) : registry(std::move(dir)) {}
  ~Impl() {
    remote.reset();  // after every connection thread (reap) ended
    for (int fd : wake) {
      if (fd >= 0) {
        ::close(fd);
      }
    }
  }

  void register_self();
  void unregister() noexcept;
  void handle(cache::Connection conn);
  void fetch(const nlohmann::json& request, cache::Connection& conn);
  void reap(bool all);
};

cache::FetchReply answer_fetch(const nlohmann::json& request, const std::string& fingerprint,
                               const std::vector<cache::TableRank>& held,
                               const std::function<cache::StorageEntry(std::size_t)>& storage,
                               const std::string& where, const std::string& who) {
  if (cache::get_string(request, "fingerprint", where) != fingerprint) {
    fail(where, "fingerprint mismatch: " + who + " holds " + fingerprint);
  }
  const auto it = request.find("ranks");
  if (it == request.end() || !it->is_array() || it->empty() || it->size() > 4096) {
    fail(where, "'ranks' must be a non-empty array of tp ranks");
  }
  cache::FetchReply reply;
  std::map<std::size_t, std::size_t> renumber;  // block -> reply storage
  for (const nlohmann::json& want : *it) {
    if (!want.is_number_integer()) {
      fail(where, "'ranks' must hold integers");
    }
    const int tp = want.get<int>();
    const cache::TableRank* found = nullptr;
    for (const cache::TableRank& r : held) {
      found = r.tp_rank == tp ? &r : found;
    }
    if (found == nullptr) {
      fail(where, who + " does not hold tp rank " + std::to_string(tp));
    }
    cache::TableRank rank = *found;
    for (cache::TableParam& p : rank.params) {
      if (p.nbytes == 0) {
        continue;
      }
      auto [at, fresh] = renumber.emplace(p.storage, reply.storages.size());
      if (fresh) {
        reply.storages.push_back(storage(p.storage));
      }
      p.storage = at->second;
    }
    reply.ranks.push_back(std::move(rank));
  }
  return reply;
}

void CacheDaemon::Impl::register_self() {
  const std::vector<std::shared_ptr<gpu::Device>>& devices = state->devices;
  key = cache::registry_key(id.fingerprint, device_set(devices));
  socket_path = registry.socket_path(key);
  record_path = registry.record_path(key);
  cache::Registry::Lock lock = registry.lock();
  if (std::optional<cache::Registration> old = registry.find(key)) {
    if (old->problem.empty() && cache::alive(old->daemon)) {
      fail(record_path, "a daemon already serves this fingerprint and these devices: pid " +
                            std::to_string(old->daemon.pid) + " (socket " + old->socket + ")");
    }
    log::warn("weight cache: replacing the stale registration " + record_path +
              (old->problem.empty()
                   ? " of pid " + std::to_string(old->daemon.pid) + ", which is gone"
                   : " (" + old->problem + ")"));
  }
  registry.remove(key);  // the stale record and socket, if any
  listener = cache::listen_unix(socket_path);
  nlohmann::json ranks = nlohmann::json::array();
  for (const cache::TableRank& r : shared.ranks) {
    ranks.push_back({{"tp_rank", r.tp_rank}, {"pp_rank", r.pp_rank}, {"device", r.device}});
  }
  nlohmann::json record = {{"version", 1},
                           {"key", key},
                           {"fingerprint", id.fingerprint},
                           {"model", id.model},
                           {"identity", id.identity},
                           {"compat", id.compat},
                           {"pid", self.pid},
                           {"start_time", self.start_time},
                           {"socket", socket_path},
                           {"devices", device_set(devices)},
                           {"ranks", ranks},
                           {"bytes", shared.bytes}};
  try {
    registry.publish(key, record);
  } catch (...) {
    listener.reset();
    ::unlink(socket_path.c_str());
    throw;
  }
  registered = true;
  registered_at = Clock::now();
}

void CacheDaemon::Impl::unregister() noexcept {
  if (!registered) {
    return;
  }
  registered = false;
  try {
    cache::Registry::Lock lock = registry.lock();
    // Only our own: a daemon started after us may have replaced the record.
    std::optional<cache::Registration> r = registry.find(key);
    if (r && r->problem.empty() && r->daemon == self) {
      registry.remove(key);
    }
  } catch (const std::exception& e) {
    log::warn(std::string("weight cache: could not remove the registration: ") + e.what());
  }
  listener.reset();
}

void CacheDaemon::Impl::fetch(const nlohmann::json& request, cache::Connection& conn) {
  std::vector<int> fds;
  const cache::FetchReply reply = answer_fetch(
      request, id.fingerprint, shared.ranks,
      [&](std::size_t block) {
        const gpu::SharedBlock& b = shared.blocks[block];
        cache::StorageEntry e;
        e.kind = b.kind;
        e.bytes = b.bytes;
        e.device = shared.block_device[block];
        e.uuid = b.uuid;
        e.handle = b.handle;
        if (b.kind == "memfd") {
          fds.push_back(b.fd);
        }
        return e;
      },
      conn.where(), "this daemon");
  conn.write_frame(cache::to_json(reply));
  conn.send_fds(fds);
  ++clients_served;
  if (m_served != nullptr) {
    m_served->Increment();
  }
}

void CacheDaemon::Impl::handle(cache::Connection conn) {
  const auto timeout = std::chrono::milliseconds(config.cache.timeout_ms);
  try {
    conn.set_deadline(Clock::now() + timeout);
    conn.set_cancel_fd(wake[0]);  // stop() ends a wait on an idle client at once
    const cache::Connection::Peer peer = conn.peer();
    if (peer.uid != ::geteuid()) {
      fail(conn.where(), "a client of uid " + std::to_string(peer.uid) +
                             " was refused: this daemon serves uid " + std::to_string(::geteuid()) +
                             " only");
    }
    while (!stopping.load()) {
      std::optional<nlohmann::json> request = conn.next_frame(kMaxRequestBytes);
      if (!request) {
        return;  // the client is done
      }
      const std::string type = cache::request_type(*request, conn.where());
      const nlohmann::json ident = {{"pid", self.pid}, {"start_time", self.start_time}};
      if (type == "hello") {
        if (!request->contains("protocol") || (*request)["protocol"] != cache::kProtocolVersion) {
          fail(conn.where(), "protocol version mismatch: this daemon speaks " +
                                 std::to_string(cache::kProtocolVersion));
        }
        nlohmann::json reply = {
            {"type", "hello"}, {"protocol", cache::kProtocolVersion}, {"ferry", release()}};
        reply.update(ident);
        conn.write_frame(reply);
      } else if (type == "ping") {
        nlohmann::json reply = {{"type", "ping"}};
        reply.update(ident);
        conn.write_frame(reply);
      } else if (type == "query") {
        const std::string fp = cache::get_string(*request, "fingerprint", conn.where());
        const auto theirs = request->find("identity");
        nlohmann::json differences = nlohmann::json::array();
        if (fp != id.fingerprint && theirs != request->end()) {
          for (const std::string& d : identity_differences(id.identity, *theirs)) {
            differences.push_back(d);
          }
        }
        nlohmann::json ranks = nlohmann::json::array();
        for (const cache::TableRank& r : shared.ranks) {
          ranks.push_back(r.tp_rank);
        }
        nlohmann::json reply = {{"type", "query"},
                                {"status", fp == id.fingerprint ? "ok" : "mismatch"},
                                {"fingerprint", id.fingerprint},
                                {"identity", id.identity},
                                {"compat", id.compat},
                                {"differences", differences},
                                {"ranks", ranks}};
        reply.update(ident);
        conn.write_frame(reply);
      } else {
        fetch(*request, conn);
      }
      conn.set_deadline(Clock::now() + timeout);
    }
  } catch (const std::exception& e) {
    if (stopping.load()) {
      return;  // an idle client at stop(): nothing to tell it
    }
    ++refused;
    if (m_refused != nullptr) {
      m_refused->Increment();
    }
    log::warn(std::string("weight cache: a connection ended with an error: ") + e.what());
    try {
      conn.set_cancel_fd(-1);
      conn.set_deadline(Clock::now() + std::chrono::milliseconds(200));
      const Error* fe = dynamic_cast<const Error*>(&e);
      conn.write_frame(cache::error_reply(fe != nullptr ? fe->rule() : e.what()));
    } catch (const std::exception&) {
      // the peer is gone or stalls: closing is all that is left
    }
  }
}

void CacheDaemon::Impl::reap(bool all) {
  std::vector<Worker> done;
  {
    std::lock_guard lock(threads_mu);
    for (auto it = workers.begin(); it != workers.end();) {
      if (all || it->done->load()) {
        done.push_back(std::move(*it));
        it = workers.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Worker& w : done) {
    w.thread.join();
  }
}

CacheDaemon::CacheDaemon(Config config) : CacheDaemon(config, nullptr) {}

CacheDaemon::CacheDaemon(Config config, std::unique_ptr<Runtime> runtime) {
  LoadConfig lc = disk_config(config.load_config());
  lc.cache.mode = CacheConfig::Mode::kOff;
  impl_ = std::make_unique<Impl>(lc.cache.dir);
  Impl& d = *impl_;
  d.config = lc;
  if (::pipe2(d.wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    fail("", "pipe2: cannot make the daemon's wake-up pipe");
  }
  // Computed before the load, as SGLang builds its CacheConfig: what the load reads.
  d.id = cache_identity(lc);
  d.runtime = runtime ? std::move(runtime) : make_sharing_runtime(to_config(lc));
  LoadResult r = d.runtime->load();
  if (!r) {
    const ErrorInfo& e = *r.error;
    throw Error(e.stage, e.file, e.tensor, e.rule);
  }
  d.model = r.model;
  d.state = loaded_state(*d.runtime);
  if (!d.state) {
    fail("", "the daemon's load left no model state");
  }
  // Only the parameters stay: no update will run (a cached model refuses them).
  d.state->origin = {};
  d.shared = share(*d.state);
  for (const auto& device : d.state->devices) {
    device->seal_shared();
  }
  d.state->report.cache.mode = "serve";
  d.state->report.cache.fingerprint = d.id.fingerprint;
  if (std::shared_ptr<LoadMetrics> m = runtime_metrics(*d.runtime)) {
    prometheus::Registry& reg = *m->registry();
    d.m_served = &prometheus::BuildCounter()
                      .Name("ferry_cache_clients_served_total")
                      .Help("Parameter tables (and their memory) handed to clients")
                      .Register(reg)
                      .Add({});
    d.m_refused = &prometheus::BuildCounter()
                       .Name("ferry_cache_connections_refused_total")
                       .Help("Connections that ended with an error frame")
                       .Register(reg)
                       .Add({});
    d.m_bytes = &prometheus::BuildGauge()
                     .Name("ferry_cache_bytes_shared")
                     .Help("Bytes of device memory the daemon shares")
                     .Register(reg)
                     .Add({});
    d.m_uptime = &prometheus::BuildGauge()
                      .Name("ferry_cache_uptime_seconds")
                      .Help("Seconds since the daemon registered")
                      .Register(reg)
                      .Add({});
    d.m_bytes->Set(static_cast<double>(d.shared.bytes));
  }
  if (!lc.remote.listen.empty()) {
    std::vector<SeedBlock> blocks;
    for (std::size_t b = 0; b < d.shared.blocks.size(); ++b) {
      const gpu::SharedBlock& x = d.shared.blocks[b];
      blocks.push_back(SeedBlock{x.base, x.bytes, x.kind == "cuda_ipc", d.shared.block_device[b]});
    }
    d.remote = std::make_unique<RemoteSeed>(lc, std::move(blocks), d.shared.ranks, d.id);
  }
  d.register_self();
  d.state->report.cache.socket = d.socket_path;
  log::info("weight cache: serving " + d.id.model + " (" + std::to_string(d.shared.blocks.size()) +
            " shared block(s), " + std::to_string(d.shared.bytes) + " bytes) on " + d.socket_path);
}

CacheDaemon::~CacheDaemon() {
  stop();
  impl_->reap(true);
  impl_->unregister();
}

void CacheDaemon::stop() noexcept {
  impl_->stopping.store(true);
  const char byte = 1;
  [[maybe_unused]] const ssize_t n = ::write(impl_->wake[1], &byte, 1);
}

void CacheDaemon::serve() {
  Impl& d = *impl_;
  while (!d.stopping.load()) {
    if (d.m_uptime != nullptr) {
      d.m_uptime->Set(seconds_between(d.registered_at, Clock::now()));
    }
    pollfd fds[3] = {{d.listener.get(), POLLIN, 0},
                     {d.wake[0], POLLIN, 0},
                     {d.remote ? d.remote->listener() : -1, POLLIN, 0}};
    const int n = ::poll(fds, 3, 1000);
    d.reap(false);
    if (n <= 0 || (fds[1].revents & POLLIN) != 0) {
      continue;
    }
    const bool from_remote = (fds[2].revents & POLLIN) != 0;
    std::optional<cache::Connection> conn;
    try {
      conn = from_remote ? cache::accept_one(d.remote->listener(), d.remote->address())
                         : cache::accept_one(d.listener.get(), d.socket_path);
    } catch (const Error& e) {
      log::warn(e.what());
      continue;
    }
    if (!conn) {
      continue;
    }
    ++d.connections;
    std::lock_guard lock(d.threads_mu);
    if (d.workers.size() >= kMaxConnections) {
      ++d.refused;
      conn->set_deadline(Clock::now() + std::chrono::milliseconds(100));
      try {
        conn->write_frame(cache::error_reply("busy: " + std::to_string(kMaxConnections) +
                                             " connections are open; try again"));
      } catch (const Error&) {
      }
      continue;
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    try {
      std::thread t =
          start_thread("cache conn", [&d, c = std::move(*conn), done, from_remote]() mutable {
            if (from_remote) {
              d.remote->handle(std::move(c), d.wake[0], d.stopping);
            } else {
              d.handle(std::move(c));
            }
            done->store(true);
          });
      d.workers.push_back(Impl::Worker{std::move(t), done});
    } catch (const Error& e) {
      log::warn(e.what());
    }
  }
  d.unregister();  // no new clients from here
  d.reap(true);
}

CacheDaemon::Stats CacheDaemon::stats() const {
  Stats s;
  s.clients_served = impl_->clients_served.load();
  s.bytes_shared = impl_->shared.bytes;
  s.connections = impl_->connections.load();
  s.refused = impl_->refused.load();
  s.uptime_seconds = impl_->registered ? seconds_between(impl_->registered_at, Clock::now()) : 0;
  if (impl_->remote) {
    s.remote_served = impl_->remote->served();
    s.remote_refused = impl_->remote->refused();
  }
  return s;
}

std::string CacheDaemon::remote_address() const {
  return impl_->remote ? impl_->remote->address() : std::string();
}

const std::string& CacheDaemon::socket() const {
  return impl_->socket_path;
}
const std::string& CacheDaemon::registration() const {
  return impl_->record_path;
}
const std::string& CacheDaemon::fingerprint() const {
  return impl_->id.fingerprint;
}
std::shared_ptr<const LoadedModel> CacheDaemon::model() const {
  return impl_->model;
}

}  // namespace ferry::runtime
