// remote_instance's seed (runtime/remote.hpp): `ferry serve --remote HOST:PORT`.
// The seed does no work per byte: targets pull with one-sided gets, and its
// progress thread only lets UCX answer them (over TCP, UCX's own thread does the
// sends; over RDMA, the NIC does).
#include <fcntl.h>
#include <unistd.h>

#include <map>
#include <thread>

#include "cache/registry.hpp"
#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "remote/control.hpp"
#include "remote/ucx.hpp"
#include "runtime/remote.hpp"

namespace ferry::runtime {

namespace {

// A request is a few hundred bytes; 1 MiB leaves room and bounds a hostile one.
constexpr std::size_t kMaxRequestBytes = std::size_t{1} << 20;

[[noreturn]] void fail(const std::string& where, const std::string& rule) {
  throw Error(Stage::kRemote, where, "", rule);
}

}  // namespace

struct RemoteSeed::Impl {
  LoadConfig config;
  std::string token;
  std::vector<SeedBlock> blocks;
  std::vector<std::string> rkeys;  // per block, packed, hex
  std::vector<cache::TableRank> ranks;
  LayoutIdentity layout;
  nlohmann::json compat;
  cache::ProcessIdentity self = cache::self_identity();
  std::unique_ptr<remote::Ucx> ucx;
  std::string worker;  // the worker's address, hex
  cache::UniqueFd listener;
  std::string address;
  int stop[2] = {-1, -1};
  std::thread progress;
  std::atomic<std::uint64_t> served{0}, refused{0};

  ~Impl() {
    if (progress.joinable()) {
      const char byte = 1;
      [[maybe_unused]] const ssize_t n = ::write(stop[1], &byte, 1);
      progress.join();
    }
    ucx.reset();
    for (int fd : stop) {
      if (fd >= 0) {
        ::close(fd);
      }
    }
  }

  nlohmann::json fetch(const nlohmann::json& request, const std::string& where) const;
};

RemoteSeed::RemoteSeed(const LoadConfig& config, std::vector<SeedBlock> blocks,
                       std::vector<cache::TableRank> ranks, const CacheIdentity& id)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.config = config;
  const remote::HostPort at = remote::parse_host_port(config.remote.listen, "remote.listen", true);
  s.token = remote::read_token(config.remote.token_file);
  s.blocks = std::move(blocks);
  s.ranks = std::move(ranks);
  s.layout = layout_identity(id);
  s.compat = id.compat;
  s.ucx = std::make_unique<remote::Ucx>(remote::UcxOptions{config.remote.transports, at.text()});
  for (const SeedBlock& b : s.blocks) {
    if (b.cuda && !s.ucx->cuda_memory()) {
      fail(at.text(), "the daemon's parameters are in CUDA memory (" + b.device +
                          ") and this UCX has no CUDA transport (Debian's libucx is built "
                          "without one): serve remote targets with a UCX built --with-cuda");
    }
    // The daemon's own mapping is writable (the seal stops new writable ones); UCX
    // asks for a writable address, and gets only ever read it.
    void* base = const_cast<std::byte*>(b.base);  // NOLINT
    s.rkeys.push_back(s.ucx->packed_rkey(s.ucx->register_memory(base, b.bytes, b.cuda)));
  }
  s.worker = s.ucx->worker_address();
  s.listener = remote::listen_tcp(at);
  s.address = remote::HostPort{at.host, remote::bound_port(s.listener.get())}.text();
  if (at.host == "0.0.0.0" || at.host == "::") {
    log::warn("remote: the control port listens on every interface (" + s.address +
              "): give the address of the fleet's network instead");
  }
  if (::pipe2(s.stop, O_CLOEXEC | O_NONBLOCK) != 0) {
    fail(s.address, "pipe2: cannot make the progress thread's stop pipe");
  }
  s.progress = start_thread("remote progress", [&s] { s.ucx->serve(s.stop[0]); });
  log::info("remote: serving targets on " + s.address + " (" + std::to_string(s.blocks.size()) +
            " registered block(s), UCX " + s.ucx->transports() + ", layout " +
            s.layout.fingerprint.substr(0, 16) + ")");
}

RemoteSeed::~RemoteSeed() = default;

int RemoteSeed::listener() const {
  return impl_->listener.get();
}
const std::string& RemoteSeed::address() const {
  return impl_->address;
}
std::uint64_t RemoteSeed::served() const {
  return impl_->served.load();
}
std::uint64_t RemoteSeed::refused() const {
  return impl_->refused.load();
}

nlohmann::json RemoteSeed::Impl::fetch(const nlohmann::json& request,
                                       const std::string& where) const {
  cache::FetchReply reply = answer_fetch(
      request, layout.fingerprint, ranks,
      [&](std::size_t block) {
        const SeedBlock& b = blocks[block];
        cache::StorageEntry e;
        e.kind = "ucx";
        e.bytes = b.bytes;
        e.device = b.device;
        e.address = reinterpret_cast<std::uintptr_t>(b.base);
        e.rkey = rkeys[block];
        return e;
      },
      where, "this seed");
  reply.worker = worker;
  return cache::to_json(reply);
}

void RemoteSeed::handle(cache::Connection conn, int cancel_fd, const std::atomic<bool>& stopping) {
  Impl& s = *impl_;
  const auto timeout = std::chrono::milliseconds(s.config.remote.timeout_ms);
  const std::string peer = remote::peer_address(conn.fd());
  const std::string where = "target " + peer;
  try {
    conn.set_deadline(cache::Clock::now() + timeout);
    conn.set_cancel_fd(cancel_fd);
    std::optional<nlohmann::json> first = conn.next_frame(kMaxRequestBytes);
    if (!first) {
      return;
    }
    auto refuse = [&](const std::string& why) {
      ++s.refused;
      log::warn("remote: refused " + where + ": " + why);
      conn.set_deadline(cache::Clock::now() + std::chrono::milliseconds(200));
      conn.write_frame(cache::error_reply("authentication failed"));
    };
    std::string target_nonce;
    std::string why = remote::check_hello(*first, cache::kProtocolVersion, target_nonce);
    if (!why.empty()) {
      refuse(why);
      return;
    }
    const std::string seed_nonce = remote::random_nonce();
    conn.write_frame(
        {{"type", "challenge"},
         {"nonce", seed_nonce},
         {"proof", remote::proof(s.token, remote::kSeedLabel, target_nonce, seed_nonce)}});
    std::optional<nlohmann::json> auth = conn.next_frame(kMaxRequestBytes);
    if (!auth) {
      ++s.refused;
      log::warn("remote: " + where +
                " left before proving the token (a wrong one, or not a "
                "ferry target)");
      return;
    }
    why = remote::check_auth(*auth, s.token, seed_nonce, target_nonce);
    if (!why.empty()) {
      refuse(why);
      return;
    }
    const nlohmann::json ident = {{"pid", s.self.pid}, {"start_time", s.self.start_time}};
    nlohmann::json hello = {
        {"type", "hello"}, {"protocol", cache::kProtocolVersion}, {"ferry", release()}};
    hello.update(ident);
    conn.write_frame(hello);
    while (!stopping.load()) {
      conn.set_deadline(cache::Clock::now() + timeout);
      std::optional<nlohmann::json> request = conn.next_frame(kMaxRequestBytes);
      if (!request) {
        return;
      }
      const std::string type = cache::request_type(*request, where);
      if (type == "query") {
        const std::string fp = cache::get_string(*request, "fingerprint", where);
        const auto theirs = request->find("identity");
        nlohmann::json differences = nlohmann::json::array();
        if (fp != s.layout.fingerprint && theirs != request->end()) {
          for (const std::string& d :
               identity_differences(s.layout.identity, *theirs, 8, "the seed")) {
            differences.push_back(d);
          }
        }
        nlohmann::json held = nlohmann::json::array();
        for (const cache::TableRank& r : s.ranks) {
          held.push_back(r.tp_rank);
        }
        nlohmann::json reply = {{"type", "query"},
                                {"status", fp == s.layout.fingerprint ? "ok" : "mismatch"},
                                {"fingerprint", s.layout.fingerprint},
                                {"identity", s.layout.identity},
                                {"compat", s.compat},
                                {"differences", differences},
                                {"ranks", held}};
        reply.update(ident);
        conn.write_frame(reply);
      } else if (type == "fetch") {
        conn.write_frame(s.fetch(*request, where));
        ++s.served;
        log::info("remote: " + where + " fetched the table");
      } else if (type == "ping") {
        nlohmann::json reply = {{"type", "ping"}};
        reply.update(ident);
        conn.write_frame(reply);
      } else {
        fail(where, "hello was already said");
      }
    }
  } catch (const std::exception& e) {
    if (stopping.load()) {
      return;
    }
    ++s.refused;
    log::warn(std::string("remote: a connection ended with an error: ") + e.what());
    try {
      conn.set_cancel_fd(-1);
      conn.set_deadline(cache::Clock::now() + std::chrono::milliseconds(200));
      const Error* fe = dynamic_cast<const Error*>(&e);
      conn.write_frame(cache::error_reply(fe != nullptr ? fe->rule() : e.what()));
    } catch (const std::exception&) {
      // the peer is gone or stalls
    }
  }
}

}  // namespace ferry::runtime
