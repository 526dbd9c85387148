// The weight cache's client (cache.mode daemon|client, model.load_format
// ipc_cache): find the daemon that holds this load's fingerprint and ranks in the
// registry, check it is the process that registered, fetch its table and memory,
// check the table against the model's own parameters, and map. SGLang's fail-fast
// contract (docs/OPERATING.md): no daemon registered is an error in daemon mode and
// a logged fallback to disk in client mode; everything else is an error in both.
#include <malloc.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "cache/protocol.hpp"
#include "cache/registry.hpp"
#include "cache/socket.hpp"
#include "common/format.hpp"
#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "gpu/device.hpp"
#include "runtime/cache.hpp"
#include "runtime/load_work.hpp"

namespace ferry::runtime {

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& rule,
                       const std::string& tensor = {}) {
  throw Error(Stage::kCache, where, tensor, rule);
}

// Checks every (pid, start time) of the daemon every `period` and calls `lost`
// once when it is gone or is another process.
class CacheWatch {
 public:
  CacheWatch(cache::ProcessIdentity daemon, std::chrono::milliseconds period,
             std::function<void(const std::string&)> lost)
      : daemon_(daemon), period_(period), lost_(std::move(lost)) {
    thread_ = start_thread("cache watch", [this] { loop(); });
  }
  ~CacheWatch() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the callback released the model: the loop returns next
    } else if (thread_.joinable()) {
      thread_.join();
    }
  }
  CacheWatch(const CacheWatch&) = delete;
  CacheWatch& operator=(const CacheWatch&) = delete;

 private:
  void loop() {
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, period_, [this] { return stop_; })) {
      if (cache::alive(daemon_)) {
        continue;
      }
      lock.unlock();
      const std::string why =
          "weight cache: the daemon (pid " + std::to_string(daemon_.pid) + ", start time " +
          std::to_string(daemon_.start_time) +
          ") whose memory this model maps is gone; graphs captured against it would read "
          "freed memory";
      if (lost_) {
        lost_(why);
      } else {
        log::error(why + "; aborting (set LoadCallbacks::on_cache_lost to decide otherwise)");
        std::abort();
      }
      return;
    }
  }

  cache::ProcessIdentity daemon_;
  std::chrono::milliseconds period_;
  std::function<void(const std::string&)> lost_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;  // last
};

// Whether registration `r` holds every tp rank of `wanted`.
bool serves(const cache::Registration& r, const std::vector<int>& wanted) {
  const auto it = r.record.find("ranks");
  if (it == r.record.end() || !it->is_array()) {
    return false;
  }
  std::set<int> held;
  for (const nlohmann::json& x : *it) {
    if (x.is_object() && x.contains("tp_rank") && x["tp_rank"].is_number_integer()) {
      held.insert(x["tp_rank"].get<int>());
    }
  }
  return std::all_of(wanted.begin(), wanted.end(), [&](int t) { return held.count(t) != 0; });
}

std::string model_of(const cache::Registration& r) {
  const auto it = r.record.find("model");
  return it != r.record.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// The reply's (pid, start_time) must be the registration's.
void check_same_daemon(const nlohmann::json& reply, const cache::Registration& reg,
                       const std::string& where) {
  const cache::ProcessIdentity got{static_cast<pid_t>(cache::get_uint(reply, "pid", where)),
                                   cache::get_uint(reply, "start_time", where)};
  if (!(got == reg.daemon)) {
    fail(where, "the daemon answering (pid " + std::to_string(got.pid) + ", start time " +
                    std::to_string(got.start_time) + ") is not the one registered (pid " +
                    std::to_string(reg.daemon.pid) + ", start time " +
                    std::to_string(reg.daemon.start_time) + ")");
  }
}

}  // namespace

ModelOnThread::ModelOnThread(const LoadConfig& config, const nlohmann::json& hf_config,
                             const char* name)
    : future_(promise_.get_future()) {
  thread_ = start_thread(name, [this, &config, &hf_config] {
    try {
      promise_.set_value(make_configured_model(config, hf_config));
    } catch (...) {
      promise_.set_exception(std::current_exception());
    }
  });
}

ModelOnThread::~ModelOnThread() {
  if (thread_.joinable()) {
    thread_.join();
  }
}

std::shared_ptr<const models::Model> ModelOnThread::get() {
  return future_.get();
}

void check_table(const cache::FetchReply& table, const models::Model& model,
                 const std::string& where, Stage stage) {
  auto refuse = [](const std::string& at, Stage st, const std::string& rule) {
    throw Error(st, at, "", rule);
  };
  const std::string who = stage == Stage::kRemote ? "the seed" : "the daemon";
  const auto& shells = model.shells();
  if (table.ranks.size() != shells.size()) {
    refuse(where, stage,
           who + " sent " + std::to_string(table.ranks.size()) + " rank(s) for " +
               std::to_string(shells.size()));
  }
  for (std::size_t r = 0; r < shells.size(); ++r) {
    const cache::TableRank& t = table.ranks[r];
    if (t.tp_rank != shells[r].tp_rank) {
      refuse(where, stage,
             who + " sent tp rank " + std::to_string(t.tp_rank) + " for " +
                 std::to_string(shells[r].tp_rank));
    }
    std::map<std::string, const cache::TableParam*> got;
    for (const cache::TableParam& p : t.params) {
      got[p.name] = &p;
    }
    std::vector<std::string> missing, wrong;
    std::size_t expected = 0;
    for (const models::ParamSpec& spec : shells[r].params) {
      if (spec.transient) {
        continue;
      }
      ++expected;
      const auto it = got.find(spec.name);
      if (it == got.end()) {
        missing.push_back(spec.name);
        continue;
      }
      const cache::TableParam& p = *it->second;
      if (p.dtype != spec.dtype || p.shape != spec.shape || p.nbytes != spec.nbytes) {
        wrong.push_back(spec.name + " (" + who + "'s " + std::string(dtype_name(p.dtype)) + " " +
                        format_dims(p.shape) + " " + std::to_string(p.nbytes) +
                        " bytes, this model's " + std::string(dtype_name(spec.dtype)) + " " +
                        format_dims(spec.shape) + " " + std::to_string(spec.nbytes) + " bytes)");
      }
    }
    if (!missing.empty() || !wrong.empty() || got.size() != expected) {
      std::vector<std::string> extra;
      std::set<std::string> mine;
      for (const models::ParamSpec& spec : shells[r].params) {
        mine.insert(spec.name);
      }
      for (const auto& [name, p] : got) {
        if (mine.count(name) == 0) {
          extra.push_back(name);
        }
      }
      refuse(where, stage,
             who + "'s table of tp rank " + std::to_string(t.tp_rank) + " does not fit " +
                 model.family() + ": " + std::to_string(missing.size()) + " missing (" +
                 join_first(missing, 4) + "), " + std::to_string(extra.size()) + " extra (" +
                 join_first(extra, 4) + "), " + std::to_string(wrong.size()) + " different (" +
                 join_first(wrong, 4) + ")");
    }
  }
}

bool Runtime::Impl::attach_cache(LoadWork& w, LoadHandle::State& handle) {
  LoadReport& report = w.report;
  report.cache.mode = std::string(to_string(cache));
  if (std::optional<BrokenRule> broken = broken_load_rule(config)) {
    throw Error(Stage::kConfig, "", "", broken->rule);
  }
  handle.phase.store(LoadPhase::kResolve);
  if (seams.in_resolve) {
    seams.in_resolve();
  }
  if (!config.load.save_presharded.empty() || !config.load.save_sharded_state.empty()) {
    throw Error(Stage::kConfig, "", "",
                "load.save_presharded / load.save_sharded_state with the weight cache: an "
                "attached load maps a daemon's parameters and saves nothing; save from a "
                "load without the cache (or give `ferry serve` the save)");
  }
  const CacheIdentity id = cache_identity(config);
  report.cache.fingerprint = id.fingerprint;
  // The model's own parameters, from config.json alone (what the daemon's table must
  // hold), made on a thread of their own while the daemon is found and asked.
  ModelOnThread model_on_thread(config, id.hf_config, "cache model");
  cache::Registry registry(config.cache.dir);
  const std::vector<int> wanted = local_tp_ranks(config);
  std::vector<cache::Registration> same_model;
  for (cache::Registration& r : registry.list()) {
    if (!r.problem.empty()) {
      fail(r.path, "a registration cannot be read (" + r.problem +
                       "): remove it, or restart the daemon that wrote it");
    }
    if (model_of(r) == id.model) {
      same_model.push_back(std::move(r));
    }
  }
  const cache::Registration* chosen = nullptr;
  for (const cache::Registration& r : same_model) {
    if (r.fingerprint == id.fingerprint && serves(r, wanted)) {
      chosen = &r;
      break;
    }
  }
  if (chosen == nullptr) {
    if (!same_model.empty()) {
      // A daemon holds this model otherwise: never load a second copy beside it.
      const cache::Registration& r = same_model.front();
      std::vector<std::string> diff;
      if (r.fingerprint == id.fingerprint) {
        diff.push_back("the daemon holds other tp ranks than this load's");
      } else if (r.record.contains("identity")) {
        diff = identity_differences(r.record["identity"], id.identity);
      }
      fail(r.path, "fingerprint mismatch: the daemon registered for " + id.model + " (pid " +
                       std::to_string(r.daemon.pid) +
                       ") holds another layout: " + join_first(diff, 8));
    }
    const std::string why = "no daemon is registered in " + registry.dir() + " for " + id.model +
                            " (fingerprint " + id.fingerprint.substr(0, 16) + ")";
    if (cache == CacheConfig::Mode::kDaemon) {
      fail(registry.dir(), why + "; cache.mode daemon needs one: start `ferry serve --model " +
                               config.model.path + "` with this load's layout");
    }
    log::warn("weight cache (cache.mode client): " + why + "; loading from disk");
    report.cache.fallback = why;
    report.warnings.push_back("weight cache: " + why + "; loaded from disk");
    return false;
  }
  const cache::Registration& reg = *chosen;
  const std::string& where = reg.socket;
  // The socket: there, a socket, ours.
  if (!cache::check_socket(reg.socket)) {
    fail(where, std::string("the registered socket is missing while its daemon (pid ") +
                    std::to_string(reg.daemon.pid) + ") is " +
                    (cache::alive(reg.daemon) ? "alive" : "gone") +
                    ": restart `ferry serve` to register again");
  }
  const auto timeout = std::chrono::milliseconds(config.cache.timeout_ms);
  cache::Connection conn = [&] {
    try {
      return cache::connect_unix(reg.socket, Clock::now() + timeout);
    } catch (const Error& e) {
      fail(where, e.rule() + "; the registered daemon (pid " + std::to_string(reg.daemon.pid) +
                      ") is " +
                      (cache::alive(reg.daemon)
                           ? "alive"
                           : "gone: its registration is stale, and restarting `ferry serve` "
                             "replaces it"));
    }
  }();
  const cache::Connection::Peer peer = conn.peer();
  if (peer.uid != ::geteuid()) {
    fail(where, "the daemon runs as uid " + std::to_string(peer.uid) + ", not as this uid " +
                    std::to_string(::geteuid()));
  }
  if (peer.pid != reg.daemon.pid || !cache::alive(reg.daemon)) {
    fail(where, "the process on the socket (pid " + std::to_string(peer.pid) +
                    ") is not the registered daemon (pid " + std::to_string(reg.daemon.pid) +
                    ", start time " + std::to_string(reg.daemon.start_time) + ")");
  }
  conn.write_frame(
      {{"type", "hello"}, {"protocol", cache::kProtocolVersion}, {"ferry", release()}});
  const nlohmann::json hello = conn.read_frame(std::size_t{1} << 20);
  cache::expect_reply(hello, "hello", where);
  check_same_daemon(hello, reg, where);
  conn.write_frame({{"type", "query"}, {"fingerprint", id.fingerprint}, {"identity", id.identity}});
  const nlohmann::json query = conn.read_frame(std::size_t{16} << 20);
  cache::expect_reply(query, "query", where);
  check_same_daemon(query, reg, where);
  if (cache::get_string(query, "status", where) != "ok" ||
      cache::get_string(query, "fingerprint", where) != id.fingerprint) {
    std::vector<std::string> diff;
    if (query.contains("identity")) {
      diff = identity_differences(query["identity"], id.identity);
    }
    fail(where, "fingerprint mismatch: " + join_first(diff, 8));
  }
  if (!query.contains("compat") || query["compat"] != id.compat) {
    fail(where, "the daemon runs another ferry or protocol: its " +
                    (query.contains("compat") ? query["compat"].dump() : std::string("none")) +
                    ", this process's " + id.compat.dump() + "; restart it with this release");
  }
  conn.write_frame({{"type", "fetch"}, {"fingerprint", id.fingerprint}, {"ranks", wanted}});
  const cache::FetchReply table = cache::parse_fetch_reply(conn.read_frame(), where);
  std::vector<cache::UniqueFd> fds = conn.receive_fds(table.descriptors());
  w.resolved_at = Clock::now();
  handle.phase.store(LoadPhase::kPlan);
  w.model = model_on_thread.get();
  const auto& shells = w.model->shells();
  w.planned_at = Clock::now();
  check_table(table, *w.model, where, Stage::kCache);
  handle.check_cancel();

  // ---- map
  handle.phase.store(LoadPhase::kAllocate);
  make_devices(w);
  LoadedModel::State& state = *w.state;
  std::vector<std::shared_ptr<gpu::DeviceAllocation>> mapped(table.storages.size());
  std::vector<int> storage_fd(table.storages.size(), -1);
  for (std::size_t s = 0, f = 0; s < table.storages.size(); ++s) {
    if (table.storages[s].kind == "memfd") {
      storage_fd[s] = fds.at(f++).get();
    }
  }
  for (std::size_t r = 0; r < shells.size(); ++r) {
    gpu::Device& device = *state.devices.at(r);
    const cache::TableRank& t = table.ranks[r];
    std::map<std::string, const cache::TableParam*> by_name;
    for (const cache::TableParam& p : t.params) {
      by_name[p.name] = &p;
    }
    LoadedRank rank;
    rank.tp_rank = t.tp_rank;
    rank.pp_rank = t.pp_rank;
    rank.device = device.name();
    std::vector<gpu::DeviceAllocation> storage;
    for (const models::ParamSpec& spec : shells[r].params) {
      if (spec.transient) {
        continue;
      }
      const cache::TableParam& p = *by_name.at(spec.name);
      LoadedParam lp;
      lp.name = p.name;
      lp.dtype = p.dtype;
      lp.shape = p.shape;
      lp.strides = p.strides;
      lp.nbytes = p.nbytes;
      if (p.nbytes != 0) {
        std::shared_ptr<gpu::DeviceAllocation>& m = mapped.at(p.storage);
        if (!m) {
          const cache::StorageEntry& e = table.storages[p.storage];
          gpu::SharedBlock block;
          block.kind = e.kind;
          block.bytes = e.bytes;
          block.uuid = e.uuid;
          block.handle = e.handle;
          try {
            m = std::make_shared<gpu::DeviceAllocation>(
                device.map_shared(block, storage_fd[p.storage]));
          } catch (const Error& err) {
            fail(where, "mapping the daemon's storage " + std::to_string(p.storage) + " (" +
                            e.device + ", " + std::to_string(e.bytes) + " bytes) on " +
                            device.name() + ": " + err.rule());
          }
          report.cache.bytes_mapped += e.bytes;
          ++report.cache.storages;
        }
        lp.data = m->data() + p.offset;
        storage.emplace_back(lp.data, p.nbytes, [m](std::byte*, std::size_t) {});
      } else {
        storage.emplace_back();
      }
      rank.params.push_back(std::move(lp));
    }
    std::sort(rank.params.begin(), rank.params.end(),
              [](const LoadedParam& a, const LoadedParam& b) { return a.name < b.name; });
    state.ranks.push_back(std::move(rank));
    state.storage.push_back(std::move(storage));
  }
  w.allocated_at = Clock::now();
  report.load_format = "ipc_cache";
  report.cache.attached = true;
  report.cache.socket = reg.socket;
  report.cache.daemon_pid = reg.daemon.pid;
  report.postprocess_target = id.identity.value("postprocess_target", report.postprocess_target);
  report.phases.resolve = seconds_between(w.begin, w.resolved_at);
  report.phases.plan = seconds_between(w.resolved_at, w.planned_at);
  report.phases.allocate = seconds_between(w.planned_at, w.allocated_at);
  report.seconds = seconds_between(w.begin, w.allocated_at);
  report.peak_rss_bytes = peak_rss_bytes();
  for (const auto& d : state.devices) {
    report.peak_device_bytes[d->name()] = d->stats().device.peak_bytes;
  }
  w.model.reset();
  // What building the model's table took (tens of MiB for a DeepSeek-sized config)
  // goes back to the system: an engine attaches to share memory, not to keep heap.
  ::malloc_trim(0);
  state.cache = std::make_shared<CacheWatch>(
      reg.daemon, std::chrono::milliseconds(config.cache.watch_ms), handle.on_cache_lost);
  log::info("weight cache: attached to daemon pid " + std::to_string(reg.daemon.pid) + " (" +
            std::to_string(report.cache.storages) + " shared block(s), " +
            std::to_string(report.cache.bytes_mapped) + " bytes)");
  return true;
}

LoadResult Runtime::Impl::attached(LoadWork& w) {
  w.state->report = w.report;
  LoadResult result;
  result.model = std::make_shared<LoadedModel>(w.state);
  std::lock_guard lock(mu);
  last_model = result.model;
  last_state = w.state;
  return result;
}

}  // namespace ferry::runtime
