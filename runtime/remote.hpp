// remote_instance's seed inside the weight-cache daemon (internal): the daemon's
// shared blocks registered with UCX, a progress thread that serves targets' gets,
// and the conversation on the control port (remote/control.hpp). The target's side
// is Runtime::Impl::pull_remote (runtime/remote_target.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/protocol.hpp"
#include "cache/socket.hpp"
#include "runtime/cache.hpp"
#include "runtime/load_config.hpp"

namespace ferry::runtime {

// One block of the daemon's memory as a seed serves it.
struct SeedBlock {
  const std::byte* base = nullptr;
  std::uint64_t bytes = 0;
  bool cuda = false;   // CUDA memory (a UCX with CUDA registers it), else host
  std::string device;  // the daemon's name for it
};

class RemoteSeed {
 public:
  // Reads remote.token_file, registers every block with UCX (remote.transports),
  // listens on remote.listen and starts the progress thread. `ranks`' storages are
  // indices into `blocks`. Throws Error(Stage::kRemote or kConfig).
  RemoteSeed(const LoadConfig& config, std::vector<SeedBlock> blocks,
             std::vector<cache::TableRank> ranks, const CacheIdentity& id);
  ~RemoteSeed();  // stops the progress thread; the connections must have ended
  RemoteSeed(const RemoteSeed&) = delete;
  RemoteSeed& operator=(const RemoteSeed&) = delete;

  int listener() const;
  // The control port as bound ("10.0.0.1:7300"; the kernel's port for port 0).
  const std::string& address() const;
  // One target's conversation, on a connection thread of the daemon: the hello with
  // the token first (nothing else is answered before it), then query and fetch.
  // `cancel_fd` ends a wait when the daemon stops. Never throws.
  void handle(cache::Connection conn, int cancel_fd, const std::atomic<bool>& stopping);

  std::uint64_t served() const;   // tables handed to targets
  std::uint64_t refused() const;  // connections that failed authentication or erred

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::runtime
