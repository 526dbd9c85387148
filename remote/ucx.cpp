// UCP for remote_instance (remote/ucx.hpp).
#include "remote/ucx.hpp"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <vector>

#include "common/error.hpp"

namespace ferry::remote {

namespace {

using Clock = std::chrono::steady_clock;

// A get larger than this is split: the in-flight bound then keeps several pieces
// moving, and one stalled piece is all a timeout waits on.
constexpr std::size_t kMaxPiece = std::size_t{8} << 20;

[[noreturn]] void fail(const std::string& where, const std::string& rule) {
  throw Error(Stage::kRemote, where, "", rule);
}

std::string status_text(ucs_status_t s) {
  return ucs_status_string(s);
}

}  // namespace

std::string hex(const void* data, std::size_t bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(bytes * 2, '0');
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    out[2 * i] = kDigits[p[i] >> 4];
    out[2 * i + 1] = kDigits[p[i] & 15];
  }
  return out;
}

std::string unhex(const std::string& text, const std::string& where, const char* what) {
  if (text.size() % 2 != 0) {
    fail(where, std::string(what) + " is not hex (odd length)");
  }
  auto digit = [&](char c) -> int {
    if (c >= '0' && c <= '9') {
      return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
      return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
      return c - 'A' + 10;
    }
    fail(where, std::string(what) + " is not hex");
  };
  std::string out(text.size() / 2, '\0');
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<char>(digit(text[2 * i]) * 16 + digit(text[2 * i + 1]));
  }
  return out;
}

struct Ucx::Impl {
  std::string where;
  std::string transports;
  std::chrono::milliseconds drain{0};
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  std::vector<ucp_mem_h> regions;
  ucp_ep_h ep = nullptr;
  ucs_status_t ep_status = UCS_OK;  // set by the endpoint's error handler
  std::vector<ucp_rkey_h> rkeys;

  // One piece of a get in flight.
  struct Piece {
    Impl* impl = nullptr;
    std::size_t get = 0;
    std::size_t offset = 0;
    std::size_t bytes = 0;
    bool issued = false;
    bool done = false;
    ucs_status_t status = UCS_OK;
  };
  std::size_t inflight = 0;
  std::size_t completed = 0;
  std::uint64_t landed = 0;
  const Piece* first_failure = nullptr;

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    if (self->ep_status == UCS_OK) {
      self->ep_status = status;
    }
  }

  static void on_get(void* request, ucs_status_t status, void* user) {
    auto* piece = static_cast<Piece*>(user);
    piece->impl->finish(*piece, status);
    ucp_request_free(request);
  }

  void finish(Piece& piece, ucs_status_t status) {
    piece.done = true;
    piece.status = status;
    inflight -= piece.bytes;
    ++completed;
    if (status == UCS_OK) {
      landed += piece.bytes;
    } else if (first_failure == nullptr) {
      first_failure = &piece;
    }
  }

  // Progresses; when nothing moved, sleeps on the worker's descriptor for at most `ms`.
  void progress_or_wait(int ms) {
    if (ucp_worker_progress(worker) != 0) {
      return;
    }
    if (ucp_worker_arm(worker) == UCS_ERR_BUSY) {
      return;
    }
    pollfd p{efd, POLLIN, 0};
    ::poll(&p, 1, ms);
  }

  // Waits for request `r` (of ucp_ep_close_nbx) until `until`; true when it ended.
  bool wait_request(void* r, Clock::time_point until) {
    if (r == nullptr) {
      return true;
    }
    if (UCS_PTR_IS_ERR(r)) {
      return true;
    }
    while (ucp_request_check_status(r) == UCS_INPROGRESS) {
      if (Clock::now() >= until) {
        return false;  // left to UCX: the worker outlives it (never destroyed while in doubt)
      }
      progress_or_wait(1);
    }
    ucp_request_free(r);
    return true;
  }

  void close_ep(bool force, Clock::time_point until) {
    if (ep == nullptr) {
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* r = ucp_ep_close_nbx(ep, &p);
    ep = nullptr;
    wait_request(r, until);
  }

  // After the endpoint is closed and nothing is in flight.
  void destroy_rkeys() {
    for (ucp_rkey_h k : rkeys) {
      ucp_rkey_destroy(k);
    }
    rkeys.clear();
  }
};

Ucx::Ucx(const UcxOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& u = *impl_;
  u.where = options.where;
  u.transports = options.transports;
  u.drain = options.drain;
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) {
    fail(u.where, "UCX: reading its configuration failed: " + status_text(s));
  }
  if (!options.transports.empty()) {
    s = ucp_config_modify(config, "TLS", options.transports.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      fail(u.where,
           "UCX: remote.transports '" + options.transports + "' was refused: " + status_text(s));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  s = ucp_init(&params, config, &u.context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    fail(u.where,
         "UCX: ucp_init failed (transports '" +
             (options.transports.empty() ? std::string("UCX's default") : options.transports) +
             "'): " + status_text(s));
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(u.context, &wp, &u.worker);
  if (s != UCS_OK) {
    ucp_cleanup(u.context);
    fail(u.where, "UCX: ucp_worker_create failed: " + status_text(s));
  }
  s = ucp_worker_get_efd(u.worker, &u.efd);
  if (s != UCS_OK) {
    ucp_worker_destroy(u.worker);
    ucp_cleanup(u.context);
    fail(u.where, "UCX: the worker has no event descriptor: " + status_text(s));
  }
}

Ucx::~Ucx() {
  Impl& u = *impl_;
  u.close_ep(true, Clock::now() + std::chrono::seconds(2));
  u.destroy_rkeys();
  for (ucp_mem_h m : u.regions) {
    ucp_mem_unmap(u.context, m);
  }
  ucp_worker_destroy(u.worker);
  ucp_cleanup(u.context);
}

bool Ucx::cuda_memory() const {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(impl_->context, &attr) != UCS_OK) {
    return false;
  }
  return (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

std::string Ucx::transports() const {
  return impl_->transports.empty() ? "auto" : impl_->transports;
}

std::size_t Ucx::register_memory(void* base, std::size_t bytes, bool cuda) {
  Impl& u = *impl_;
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                 UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  p.address = base;
  p.length = bytes;
  p.memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h memh = nullptr;
  const ucs_status_t s = ucp_mem_map(u.context, &p, &memh);
  if (s != UCS_OK) {
    fail(u.where,
         "UCX: registering " + std::to_string(bytes) + " bytes of " + (cuda ? "CUDA" : "host") +
             " memory failed: " + status_text(s) +
             (cuda && !cuda_memory() ? " (this UCX has no CUDA transport: Debian's libucx is built "
                                       "without it; use a UCX built --with-cuda)"
                                     : ""));
  }
  u.regions.push_back(memh);
  return u.regions.size() - 1;
}

std::string Ucx::packed_rkey(std::size_t region) const {
  Impl& u = *impl_;
  void* buf = nullptr;
  std::size_t size = 0;
  const ucs_status_t s = ucp_rkey_pack(u.context, u.regions.at(region), &buf, &size);
  if (s != UCS_OK) {
    fail(u.where, "UCX: packing a remote key failed: " + status_text(s));
  }
  std::string out = hex(buf, size);
  ucp_rkey_buffer_release(buf);
  return out;
}

std::string Ucx::worker_address() const {
  Impl& u = *impl_;
  ucp_address_t* address = nullptr;
  std::size_t size = 0;
  const ucs_status_t s = ucp_worker_get_address(u.worker, &address, &size);
  if (s != UCS_OK) {
    fail(u.where, "UCX: the worker's address: " + status_text(s));
  }
  std::string out = hex(address, size);
  ucp_worker_release_address(u.worker, address);
  return out;
}

void Ucx::serve(int stop_fd) {
  Impl& u = *impl_;
  while (true) {
    while (ucp_worker_progress(u.worker) != 0) {
    }
    const ucs_status_t s = ucp_worker_arm(u.worker);
    if (s == UCS_ERR_BUSY) {
      continue;
    }
    pollfd fds[2] = {{u.efd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
    ::poll(fds, 2, 1000);
    if ((fds[1].revents & (POLLIN | POLLHUP)) != 0) {
      return;
    }
  }
}

void Ucx::connect(const std::string& address_hex, std::chrono::milliseconds timeout) {
  Impl& u = *impl_;
  const std::string address = unhex(address_hex, u.where, "the seed's worker address");
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &Impl::on_ep_error;
  p.err_handler.arg = &u;
  const ucs_status_t s = ucp_ep_create(u.worker, &p, &u.ep);
  if (s != UCS_OK) {
    u.ep = nullptr;
    fail(u.where, "UCX: no endpoint to the seed's worker: " + status_text(s) +
                      " (do both sides share a transport? remote.transports)");
  }
  ucp_request_param_t p2{};
  void* r = ucp_ep_flush_nbx(u.ep, &p2);
  const Clock::time_point until = Clock::now() + timeout;
  ucs_status_t status = UCS_OK;
  if (UCS_PTR_IS_ERR(r)) {
    status = UCS_PTR_STATUS(r);
  } else if (r != nullptr) {
    while ((status = ucp_request_check_status(r)) == UCS_INPROGRESS && u.ep_status == UCS_OK &&
           Clock::now() < until) {
      u.progress_or_wait(1);
    }
    if (status == UCS_INPROGRESS) {
      // Left to the worker, which outlives it (closed with the endpoint below).
      u.close_ep(true, Clock::now() + std::chrono::seconds(1));
      fail(u.where, "UCX: the connection to the seed's worker did not come up within " +
                        std::to_string(timeout.count()) + " ms (remote.timeout_ms)");
    }
    ucp_request_free(r);
  }
  if (status == UCS_OK && u.ep_status != UCS_OK) {
    status = u.ep_status;
  }
  if (status != UCS_OK) {
    u.close_ep(true, Clock::now() + std::chrono::seconds(1));
    fail(u.where, "UCX: the connection to the seed's worker failed: " + status_text(status) +
                      " (do both sides share a transport? remote.transports)");
  }
}

std::size_t Ucx::add_rkey(const std::string& packed_hex) {
  Impl& u = *impl_;
  const std::string packed = unhex(packed_hex, u.where, "a remote key");
  ucp_rkey_h rkey = nullptr;
  const ucs_status_t s = ucp_ep_rkey_unpack(u.ep, packed.data(), &rkey);
  if (s != UCS_OK) {
    fail(u.where, "UCX: the seed's remote key cannot be unpacked: " + status_text(s));
  }
  u.rkeys.push_back(rkey);
  return u.rkeys.size() - 1;
}

PullResult Ucx::pull(std::span<const Get> gets, std::size_t inflight_bytes,
                     std::chrono::milliseconds stall, const std::atomic<bool>* cancel) {
  Impl& u = *impl_;
  PullResult out;
  std::vector<Impl::Piece> pieces;
  for (std::size_t g = 0; g < gets.size(); ++g) {
    if (gets[g].rkey >= u.rkeys.size() ||
        (gets[g].region != Get::kNoRegion && gets[g].region >= u.regions.size())) {
      fail(u.where, "a get names a key or region that does not exist");
    }
    for (std::size_t off = 0; off < gets[g].bytes; off += kMaxPiece) {
      pieces.push_back(Impl::Piece{&u, g, off, std::min(kMaxPiece, gets[g].bytes - off)});
    }
  }
  u.inflight = 0;
  u.completed = 0;
  u.landed = 0;
  u.first_failure = nullptr;
  std::string why;
  const Impl::Piece* blamed = nullptr;
  std::size_t next = 0;
  std::size_t seen = 0;
  Clock::time_point moved = Clock::now();
  while (u.completed < pieces.size()) {
    while (next < pieces.size() &&
           (u.inflight == 0 || u.inflight + pieces[next].bytes <= inflight_bytes) &&
           u.ep_status == UCS_OK && u.first_failure == nullptr) {
      Impl::Piece& piece = pieces[next++];
      const Get& g = gets[piece.get];
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.send = &Impl::on_get;
      p.user_data = &piece;
      if (g.region != Get::kNoRegion) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        p.memh = u.regions[g.region];
      }
      piece.issued = true;
      u.inflight += piece.bytes;
      void* r = ucp_get_nbx(u.ep, g.dst + piece.offset, piece.bytes, g.remote + piece.offset,
                            u.rkeys[g.rkey], &p);
      if (r == nullptr) {
        u.finish(piece, UCS_OK);
      } else if (UCS_PTR_IS_ERR(r)) {
        u.finish(piece, UCS_PTR_STATUS(r));
      }
    }
    if (u.first_failure != nullptr) {
      blamed = u.first_failure;
      why = "a get failed: " + status_text(blamed->status);
      break;
    }
    if (u.ep_status != UCS_OK) {
      why = "the connection to the seed failed: " + status_text(u.ep_status);
      break;
    }
    if (cancel != nullptr && cancel->load()) {
      why = "cancelled";
      break;
    }
    if (u.completed == pieces.size()) {
      break;
    }
    u.progress_or_wait(1);
    if (u.completed != seen) {
      seen = u.completed;
      moved = Clock::now();
    } else if (Clock::now() - moved > stall) {
      why = "no data from the seed for " + std::to_string(stall.count()) +
            " ms (remote.timeout_ms): the seed or the network stalled";
      break;
    }
  }
  // The last completions may have been failures: the loop ends when all completed.
  if (why.empty() && u.first_failure != nullptr) {
    blamed = u.first_failure;
    why = "a get failed: " + status_text(blamed->status);
  } else if (why.empty() && u.ep_status != UCS_OK) {
    why = "the connection to the seed failed: " + status_text(u.ep_status);
  }
  if (why.empty()) {
    // Every byte of every get landed, or the pull is not done: sizes per get.
    std::vector<std::uint64_t> got(gets.size(), 0);
    for (const Impl::Piece& piece : pieces) {
      got[piece.get] += piece.done && piece.status == UCS_OK ? piece.bytes : 0;
    }
    for (std::size_t g = 0; g < gets.size(); ++g) {
      if (got[g] != gets[g].bytes) {
        out.ok = false;
        out.failed_tag = gets[g].tag;
        out.error =
            std::to_string(got[g]) + " of " + std::to_string(gets[g].bytes) + " bytes landed";
        out.bytes = u.landed;
        return out;
      }
    }
  }
  out.bytes = u.landed;
  if (why.empty()) {
    return out;
  }
  out.ok = false;
  out.error = why;
  if (blamed == nullptr) {
    for (const Impl::Piece& piece : pieces) {
      if (piece.issued && !piece.done) {
        blamed = &piece;
        break;
      }
    }
  }
  out.failed_tag = blamed != nullptr ? gets[blamed->get].tag : 0;
  // Close the endpoint at once: a forced close completes the gets in flight as
  // cancelled. What stays unknown after the drain is in doubt.
  u.close_ep(true, Clock::now() + u.drain);
  const Clock::time_point until = Clock::now() + u.drain;
  auto outstanding = [&] {
    return std::any_of(pieces.begin(), pieces.end(),
                       [](const Impl::Piece& p) { return p.issued && !p.done; });
  };
  while (outstanding() && Clock::now() < until) {
    u.progress_or_wait(1);
  }
  for (Impl::Piece& piece : pieces) {
    if (piece.issued && !piece.done) {
      ++out.in_doubt_gets;
      out.in_doubt_bytes += piece.bytes;
      // The callback may still run: it must find memory that lives (kept below).
    }
  }
  if (out.in_doubt_gets != 0) {
    // Reachable from a static, so that leak checkers see it kept, not lost.
    static auto* kept = new std::vector<std::vector<Impl::Piece>>();
    kept->push_back(std::move(pieces));  // the elements do not move
  } else {
    u.destroy_rkeys();
  }
  return out;
}

void Ucx::disconnect(std::chrono::milliseconds timeout) noexcept {
  impl_->close_ep(false, Clock::now() + timeout);
  impl_->destroy_rkeys();
}

}  // namespace ferry::remote
