// remote_instance's target (model.load_format remote_instance): ask a seed (`ferry
// serve --remote`) for the parameters of this load's ranks, check its layout and
// table against this model's own, allocate as a disk load does (the engine's
// Allocator included), and pull every parameter straight into its storage with UCX
// gets. No post-processing runs: the seed's parameters are in the served layout.
//
// A seed that cannot be reached at all is an error, or a logged load from disk with
// remote.fallback_format. Anything after the pull started is an error: the storage
// is freed and nothing is handed over, except memory a get may still write (its
// completion unknown when the pull gave up), which is quarantined: kept, with the
// UCX worker that may write it, for the life of the process.
#include <algorithm>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "cache/protocol.hpp"
#include "common/format.hpp"
#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "gpu/device.hpp"
#include "remote/control.hpp"
#include "remote/ucx.hpp"
#include "runtime/cache.hpp"
#include "runtime/load_work.hpp"

namespace ferry::runtime {

namespace {

// Memory that a get whose completion is unknown may still write, and the UCX
// context that may write it: never freed. Reachable from a static (not a leak).
struct Quarantine {
  std::mutex mu;
  std::vector<std::unique_ptr<remote::Ucx>> ucx;
  std::vector<std::vector<std::vector<gpu::DeviceAllocation>>> storage;
  std::vector<gpu::PinnedAllocation> staging;
  std::uint64_t bytes = 0;
};
Quarantine& quarantine() {
  static auto* q = new Quarantine();
  return *q;
}

// Contiguous ranges over the destinations, merged when less than a page apart (no
// unmapped page can lie between them): what a target registers with UCX.
struct Range {
  std::byte* begin = nullptr;
  std::byte* end = nullptr;
};
std::vector<Range> merged_ranges(std::vector<Range> ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<Range> out;
  for (const Range& r : ranges) {
    if (!out.empty() && r.begin <= out.back().end + 4096) {
      out.back().end = std::max(out.back().end, r.end);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// One param to pull: where it lands, and where it is in the seed.
struct Wanted {
  std::string name;
  std::size_t rank = 0;
  std::byte* dst = nullptr;
  std::uint64_t remote = 0;
  std::size_t rkey = 0;
  std::uint64_t bytes = 0;
};

}  // namespace

bool Runtime::Impl::pull_remote(LoadWork& w, LoadHandle::State& handle) {
  LoadReport& report = w.report;
  const RemoteConfig& rc = config.remote;
  const std::string& where = rc.seed;
  report.remote.seed = rc.seed;
  report.remote.transports = rc.transports.empty() ? "auto" : rc.transports;
  {
    LoadConfig asked = config;
    asked.model.load_format = io::LoadFormat::kRemoteInstance;
    if (std::optional<BrokenRule> broken = broken_load_rule(asked)) {
      throw Error(Stage::kConfig, "", "", broken->rule);
    }
  }
  handle.phase.store(LoadPhase::kResolve);
  if (seams.in_resolve) {
    seams.in_resolve();
  }
  const std::string token = remote::read_token(rc.token_file);
  const remote::HostPort seed = remote::parse_host_port(rc.seed, "remote.seed");
  const CacheIdentity id = cache_identity(config);
  const LayoutIdentity layout = layout_identity(id);
  report.remote.fingerprint = layout.fingerprint;
  // The model's own parameters, from config.json alone, made while the seed is asked.
  ModelOnThread model_on_thread(config, id.hf_config, "remote model");
  const auto timeout = std::chrono::milliseconds(rc.timeout_ms);
  std::optional<cache::Connection> conn;
  try {
    conn.emplace(remote::connect_tcp(seed, Clock::now() + timeout));
  } catch (const Error& e) {
    if (!rc.fallback_format) {
      throw Error(Stage::kRemote, where, "",
                  e.rule() + " (remote.fallback_format is none: no load from disk)");
    }
    const std::string why = "the seed " + where + " cannot be reached: " + e.rule();
    log::warn("remote_instance: " + why + "; loading from disk (remote.fallback_format " +
              std::string(io::to_string(*rc.fallback_format)) + ")");
    report.remote.fallback = why;
    report.warnings.push_back("remote_instance: " + why + "; loaded from disk");
    return false;
  }

  // ---- ask: every failure from here on is the seed's, in stage remote
  cache::FetchReply table;
  try {
    const std::string nonce = remote::random_nonce();
    conn->write_frame({{"type", "hello"},
                       {"protocol", cache::kProtocolVersion},
                       {"ferry", release()},
                       {"nonce", nonce}});
    const nlohmann::json challenge = conn->read_frame(std::size_t{1} << 20);
    cache::expect_reply(challenge, "challenge", where, "the seed");
    std::string seed_nonce;
    const std::string why = remote::check_challenge(challenge, token, nonce, seed_nonce);
    if (!why.empty()) {
      throw Error(Stage::kRemote, where, "", "authentication failed: " + why);
    }
    conn->write_frame({{"type", "auth"},
                       {"proof", remote::proof(token, remote::kTargetLabel, seed_nonce, nonce)}});
    cache::expect_reply(conn->read_frame(std::size_t{1} << 20), "hello", where, "the seed");
    conn->write_frame(
        {{"type", "query"}, {"fingerprint", layout.fingerprint}, {"identity", layout.identity}});
    const nlohmann::json query = conn->read_frame(std::size_t{16} << 20);
    cache::expect_reply(query, "query", where, "the seed");
    if (cache::get_string(query, "status", where) != "ok" ||
        cache::get_string(query, "fingerprint", where) != layout.fingerprint) {
      std::vector<std::string> diff;
      if (query.contains("identity")) {
        diff = identity_differences(query["identity"], layout.identity, 8, "the seed");
      }
      throw Error(Stage::kRemote, where, "",
                  "the seed serves another layout: " +
                      (diff.empty() ? std::string("fingerprints differ") : join_first(diff, 8)));
    }
    if (!query.contains("compat") || query["compat"] != id.compat) {
      throw Error(Stage::kRemote, where, "",
                  "the seed runs another ferry or protocol: its " +
                      (query.contains("compat") ? query["compat"].dump() : std::string("none")) +
                      ", this process's " + id.compat.dump());
    }
    conn->write_frame({{"type", "fetch"},
                       {"fingerprint", layout.fingerprint},
                       {"ranks", local_tp_ranks(config)}});
    const nlohmann::json reply = conn->read_frame();
    cache::expect_reply(reply, "fetch", where, "the seed");
    table = cache::parse_fetch_reply(reply, where, /*remote=*/true);
  } catch (const Error& e) {
    throw Error(Stage::kRemote, where, e.tensor(), e.rule());
  }
  conn.reset();  // the pull needs no control connection
  w.resolved_at = Clock::now();
  handle.phase.store(LoadPhase::kPlan);
  w.model = model_on_thread.get();
  w.planned_at = Clock::now();
  check_table(table, *w.model, where, Stage::kRemote);
  handle.check_cancel();

  // ---- allocate, as a disk load does
  make_devices(w);
  allocate(w, handle);
  LoadedModel::State& state = *w.state;
  const auto& shells = w.model->shells();

  // ---- pull
  handle.phase.store(LoadPhase::kStream);
  const Clock::time_point t0 = Clock::now();
  auto ucx = std::make_unique<remote::Ucx>(remote::UcxOptions{rc.transports, where});
  std::vector<Wanted> wanted;
  std::vector<std::size_t> rkeys;
  try {
    ucx->connect(table.worker, timeout);
    for (const cache::StorageEntry& s : table.storages) {
      rkeys.push_back(ucx->add_rkey(s.rkey));
    }
  } catch (const Error& e) {
    throw Error(Stage::kRemote, where, "", e.rule());
  }
  for (std::size_t r = 0; r < shells.size(); ++r) {
    std::map<std::string_view, const cache::TableParam*> by_name;
    for (const cache::TableParam& p : table.ranks[r].params) {
      by_name[p.name] = &p;
    }
    for (std::size_t i = 0; i < shells[r].params.size(); ++i) {
      const models::ParamSpec& spec = shells[r].params[i];
      if (spec.transient || spec.nbytes == 0) {
        continue;
      }
      const cache::TableParam& t = *by_name.at(spec.name);
      const cache::StorageEntry& s = table.storages[t.storage];
      wanted.push_back(Wanted{spec.name, r, state.storage[r][i].data(), s.address + t.offset,
                              rkeys[t.storage], t.nbytes});
    }
  }
  // Each rank's device: host memory UCX registers (host devices, or a UCX with
  // CUDA), or memory it cannot reach, pulled through a registered host buffer.
  std::vector<bool> direct(shells.size());
  for (std::size_t r = 0; r < shells.size(); ++r) {
    direct[r] = state.devices[r]->host_addressable();
  }
  report.remote.staged = std::find(direct.begin(), direct.end(), false) != direct.end();
  std::vector<remote::Get> gets;
  std::vector<Range> ranges;
  for (std::size_t k = 0; k < wanted.size(); ++k) {
    if (direct[wanted[k].rank]) {
      ranges.push_back({wanted[k].dst, wanted[k].dst + wanted[k].bytes});
    }
  }
  const std::vector<Range> regions = merged_ranges(std::move(ranges));
  std::vector<std::size_t> region_index;
  for (const Range& g : regions) {
    region_index.push_back(
        ucx->register_memory(g.begin, static_cast<std::size_t>(g.end - g.begin)));
  }
  auto region_of = [&](const std::byte* p) {
    const auto it =
        std::upper_bound(regions.begin(), regions.end(), p,
                         [](const std::byte* x, const Range& g) { return x < g.begin; });
    return region_index[static_cast<std::size_t>(it - regions.begin()) - 1];
  };
  for (std::size_t k = 0; k < wanted.size(); ++k) {
    const Wanted& x = wanted[k];
    if (direct[x.rank]) {
      gets.push_back(remote::Get{x.dst, x.remote, x.rkey, x.bytes, region_of(x.dst), k});
    }
  }
  auto give_up = [&](remote::PullResult res, std::vector<gpu::PinnedAllocation> staging) {
    if (seams.after_failed_pull) {
      seams.after_failed_pull(res.in_doubt_gets, res.in_doubt_bytes);
    }
    std::string rule = res.error;
    if (res.in_doubt_gets != 0) {
      Quarantine& q = quarantine();
      std::lock_guard lock(q.mu);
      q.bytes += res.in_doubt_bytes;
      rule += "; " + std::to_string(res.in_doubt_gets) + " get(s) of " +
              std::to_string(res.in_doubt_bytes) +
              " bytes never completed: their memory is quarantined (kept, never freed or "
              "reused) for the life of this process, " +
              std::to_string(q.bytes) + " bytes in all";
      q.ucx.push_back(std::move(ucx));
      q.storage.push_back(std::move(state.storage));
      for (gpu::PinnedAllocation& s : staging) {
        q.staging.push_back(std::move(s));
      }
      log::error("remote_instance: " + rule);
    }
    throw Error(Stage::kRemote, where, wanted.at(res.failed_tag).name,
                rule + " (after " + std::to_string(report.remote.bytes) + " bytes)");
  };
  const std::uint64_t inflight = rc.inflight_bytes;
  std::uint64_t total = 0;
  for (const Wanted& x : wanted) {
    total += x.bytes;
  }
  log::info("remote_instance: pulling " + std::to_string(wanted.size()) + " param(s), " +
            std::to_string(total) + " bytes from " + where);
  if (seams.before_pull) {
    seams.before_pull();
  }
  remote::PullResult res = ucx->pull(gets, inflight, timeout, &handle.cancel);
  report.remote.bytes += res.bytes;
  if (!res.ok) {
    give_up(res, {});
  }
  // The staged ranks: waves of gets into one registered host buffer per rank, each
  // wave copied to the device before the buffer is used again.
  for (std::size_t r = 0; r < shells.size(); ++r) {
    if (direct[r]) {
      continue;
    }
    gpu::Device& device = *state.devices[r];
    std::vector<gpu::PinnedAllocation> staging;
    staging.push_back(device.allocate_pinned(inflight));
    std::byte* buffer = staging.back().data();
    const std::size_t region = ucx->register_memory(buffer, inflight);
    std::unique_ptr<gpu::Stream> stream = device.create_stream();
    struct Piece {
      std::size_t wanted;
      std::uint64_t offset;  // in the param
      std::uint64_t bytes;
    };
    std::vector<Piece> pieces;
    for (std::size_t k = 0; k < wanted.size(); ++k) {
      if (wanted[k].rank != r) {
        continue;
      }
      for (std::uint64_t off = 0; off < wanted[k].bytes; off += inflight) {
        pieces.push_back({k, off, std::min<std::uint64_t>(inflight, wanted[k].bytes - off)});
      }
    }
    for (std::size_t p = 0; p < pieces.size();) {
      std::vector<remote::Get> wave;
      std::vector<std::pair<std::size_t, std::uint64_t>> at;  // piece, buffer offset
      std::uint64_t used = 0;
      for (; p < pieces.size() && used + pieces[p].bytes <= inflight; ++p) {
        const Wanted& x = wanted[pieces[p].wanted];
        wave.push_back(remote::Get{buffer + used, x.remote + pieces[p].offset, x.rkey,
                                   pieces[p].bytes, region, pieces[p].wanted});
        at.emplace_back(p, used);
        used += (pieces[p].bytes + 255) / 256 * 256;
      }
      res = ucx->pull(wave, inflight, timeout, &handle.cancel);
      report.remote.bytes += res.bytes;
      if (!res.ok) {
        give_up(res, std::move(staging));
      }
      for (const auto& [piece, offset] : at) {
        const Piece& x = pieces[piece];
        stream->copy_h2d(wanted[x.wanted].dst + x.offset, buffer + offset, x.bytes);
      }
      stream->synchronize();
    }
  }
  ucx->disconnect(timeout);
  ucx.reset();
  const Clock::time_point t1 = Clock::now();
  drop_transients(w);
  report.load_format = "remote_instance";
  report.remote.pulled = true;
  report.remote.params = wanted.size();
  report.remote.seconds = seconds_between(t0, t1);
  report.remote.gbps = report.remote.seconds > 0
                           ? static_cast<double>(report.remote.bytes) / report.remote.seconds / 1e9
                           : 0;
  report.postprocess_target = id.identity.value("postprocess_target", report.postprocess_target);
  report.phases.resolve = seconds_between(w.begin, w.resolved_at);
  report.phases.plan = seconds_between(w.resolved_at, w.planned_at);
  report.phases.allocate = seconds_between(w.planned_at, w.allocated_at);
  report.phases.stream = report.remote.seconds;
  report.seconds = seconds_between(w.begin, t1);
  report.peak_rss_bytes = peak_rss_bytes();
  for (const auto& d : state.devices) {
    report.peak_device_bytes[d->name()] = d->stats().device.peak_bytes;
  }
  w.model.reset();
  log::info("remote_instance: pulled " + std::to_string(report.remote.params) + " param(s), " +
            std::to_string(report.remote.bytes) + " bytes from " + where + " in " +
            fixed(report.remote.seconds, 3) + " s");
  return true;
}

}  // namespace ferry::runtime
