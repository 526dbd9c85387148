// UCX (UCP) for remote_instance (docs/ARCHITECTURE.md, "Pulling from a seed"): one
// context and one worker, the memory they register, and the one-sided gets a target
// pulls a seed's parameters with. No UCX type is in this header: the runtime sees
// hex strings (worker addresses, packed remote keys) and plain pointers.
//
// One Ucx is used by one thread at a time (UCS_THREAD_MODE_SINGLE): the seed sets
// it up, then hands it to its progress thread; a target pulls on its loading thread.
// Every failure throws ferry::Error(Stage::kRemote) naming `where` (the seed).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace ferry::remote {

struct UcxOptions {
  // UCX_TLS for this context ("" = UCX's own choice: shared memory between processes
  // of one host, RDMA or TCP between hosts). "tcp" keeps two processes of one host on
  // the network (the namespace tests and benchmarks set it).
  std::string transports;
  // Who the errors name: the seed's HOST:PORT on a target, the listen address on a seed.
  std::string where;
  // How long a pull that gave up waits, after closing its endpoint, for the gets still
  // in flight before it calls them in doubt.
  std::chrono::milliseconds drain = std::chrono::seconds(2);
};

// One get: `bytes` from the peer's `remote` address (inside the storage whose key is
// `rkey`, an index from add_rkey) into `dst`. `region` is the registered region that
// holds `dst` (register_memory's index), or kNoRegion. `tag` is the caller's (the
// param index), reported back when the get fails.
struct Get {
  static constexpr std::size_t kNoRegion = ~std::size_t{0};
  std::byte* dst = nullptr;
  std::uint64_t remote = 0;
  std::size_t rkey = 0;
  std::size_t bytes = 0;
  std::size_t region = kNoRegion;
  std::size_t tag = 0;
};

struct PullResult {
  bool ok = true;
  std::uint64_t bytes = 0;     // landed
  std::size_t failed_tag = 0;  // !ok: the get that failed first (or was waiting)
  std::string error;           // !ok: what happened
  // Gets whose completion is unknown when the pull gave up (the peer stalled past the
  // timeout): their destinations may still be written. Quarantine, never free.
  std::uint64_t in_doubt_bytes = 0;
  std::size_t in_doubt_gets = 0;
};

class Ucx {
 public:
  explicit Ucx(const UcxOptions& options);
  ~Ucx();
  Ucx(const Ucx&) = delete;
  Ucx& operator=(const Ucx&) = delete;

  // Whether this UCX registers CUDA memory (a build with the cuda transports).
  bool cuda_memory() const;
  // The transports the context opened, as UCX names them ("tcp", "rc_mlx5", ...).
  std::string transports() const;

  // Registers [base, base + bytes) (host memory, or CUDA memory with `cuda`); the
  // region's index. It stays registered while this Ucx lives.
  std::size_t register_memory(void* base, std::size_t bytes, bool cuda = false);
  // The region's remote key, packed, as hex (what a peer unpacks to read it).
  std::string packed_rkey(std::size_t region) const;
  // This worker's address, as hex (what a peer connects to).
  std::string worker_address() const;

  // Seed: progresses the worker (serving peers' gets) until `stop_fd` is readable.
  void serve(int stop_fd);

  // Target: an endpoint to the worker at `address_hex` (errors reported, not fatal),
  // flushed before `timeout` so that the connection is up (or refused) before the
  // first get.
  void connect(const std::string& address_hex,
               std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Unpacks a peer's packed key (hex) for the endpoint; its index for Get::rkey.
  std::size_t add_rkey(const std::string& packed_hex);
  // Runs `gets`, with at most `inflight_bytes` in flight (one get at least). Gives up
  // when no get completes for `stall`, when `cancel` becomes true, or at the first
  // failure, then closes the endpoint and waits a while for the gets still in flight;
  // those that stay unknown are counted in_doubt.
  PullResult pull(std::span<const Get> gets, std::size_t inflight_bytes,
                  std::chrono::milliseconds stall, const std::atomic<bool>* cancel);
  // Target: closes the endpoint politely (flushing), bounded by `timeout`.
  void disconnect(std::chrono::milliseconds timeout) noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Bytes to hex and back (worker addresses and packed keys travel as text).
std::string hex(const void* data, std::size_t bytes);
// Throws Error(Stage::kRemote) naming `where` and `what` for text that is not hex.
std::string unhex(const std::string& text, const std::string& where, const char* what);

}  // namespace ferry::remote
