// The weight cache's daemon as a library: what `ferry serve` runs. A CacheDaemon
// loads a model once (as Runtime::load, post-processing included) into memory it
// can share, registers it in the per-user registry (cache.dir) and serves its
// parameters to every engine process on the machine that loads the same model with
// cache.mode daemon or client: they map the daemon's memory instead of reading the
// checkpoint (docs/OPERATING.md, "The weight cache").
//
// Transports: host devices share each arena as a memfd (clients map it read-only,
// and the daemon seals it against writes through any new mapping); CUDA devices
// share one cudaIpcMemHandle per allocation, named by the GPU's UUID.
//
// With remote.listen (`ferry serve --remote HOST:PORT`) it is also a seed of
// remote_instance: targets on other machines authenticate with remote.token_file on
// that TCP control port, receive the table with UCX remote keys, and pull the
// parameters with one-sided gets (docs/OPERATING.md, "Pulling from a seed").
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/config.hpp"
#include "ferry/export.hpp"
#include "ferry/runtime.hpp"

namespace ferry::runtime {

class FERRY_API CacheDaemon {
 public:
  // Loads the model of `config` and registers; throws ferry::Error (the load's, or
  // Stage::kCache: cache.mode set, devices that cannot share, a daemon already
  // serving this fingerprint and these devices, a registry that is not ours).
  explicit CacheDaemon(Config config);
  // The same, loading with `runtime`: ferry's own tests give one made with test
  // seams (devices of their own). Its devices must be able to share their memory.
  CacheDaemon(Config config, std::unique_ptr<Runtime> runtime);
  // stop(), then unregisters; clients keep what they mapped as the transport allows
  // (memfd mappings outlive the daemon; CUDA IPC mappings do not).
  ~CacheDaemon();
  CacheDaemon(const CacheDaemon&) = delete;
  CacheDaemon& operator=(const CacheDaemon&) = delete;

  // Serves until stop(); returns after the last connection ended and the
  // registration was removed. Call it once, from one thread.
  void serve();
  // Makes serve() return. Async-signal-safe (an atomic store and a write(2)):
  // a SIGTERM handler may call it. Thread-safe.
  void stop() noexcept;

  struct Stats {
    std::uint64_t clients_served = 0;  // fetches answered
    std::uint64_t bytes_shared = 0;    // the shared blocks' bytes, each counted once
    std::uint64_t connections = 0;     // accepted, refused ones included
    std::uint64_t refused = 0;         // connections answered with an error
    double uptime_seconds = 0;         // since registration
    std::uint64_t remote_served = 0;   // remote.listen: tables handed to targets
    std::uint64_t remote_refused = 0;  // remote.listen: connections refused (a bad token...)
  };
  Stats stats() const;

  const std::string& socket() const;        // where clients connect
  // remote.listen: the control port remote targets connect to, as bound; "" = none.
  std::string remote_address() const;
  const std::string& registration() const;  // the registry record
  const std::string& fingerprint() const;
  // The daemon's own load (its report's cache.mode is "serve").
  std::shared_ptr<const LoadedModel> model() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::runtime
