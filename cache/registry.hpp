// The weight cache's registry: a per-user directory where each `ferry serve`
// daemon publishes what it holds and where its socket is, and where clients look.
//
//   <dir>/lock         flock()ed around every change (publish, remove, takeover)
//   <dir>/<key>.json   a daemon's registration, published by atomic rename + fsync
//   <dir>/<key>.sock   its socket
//
// The key is base64url of the first 20 bytes of SHA-256 over the fingerprint and
// the device set: one daemon per fingerprint and devices. The directory must be
// ours: a directory (not a link), owned by this effective uid, with no access for
// group or others (created 0700 when missing). Anything else is refused, since a
// registry another user can write could point a client at their socket.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cache/socket.hpp"

namespace ferry::cache {

// A process as (pid, start time): its start time is field 22 of /proc/<pid>/stat
// (clock ticks after boot), so a pid the kernel gave to another process since no
// longer matches.
struct ProcessIdentity {
  pid_t pid = 0;
  std::uint64_t start_time = 0;
  bool operator==(const ProcessIdentity&) const = default;
};
// The start time of `pid`, or nullopt when there is no such process (or it is a
// zombie: it has exited).
std::optional<std::uint64_t> process_start_time(pid_t pid);
ProcessIdentity self_identity();
// The process is there and is the same one.
bool alive(const ProcessIdentity& p);

// $XDG_RUNTIME_DIR/ferry-cache when XDG_RUNTIME_DIR is set (an absolute path),
// else /tmp/ferry-cache-<uid>.
std::string default_registry_dir();

// base64url(SHA-256(fingerprint "\n" devices)[0:20]): 27 characters.
std::string registry_key(const std::string& fingerprint, const std::string& devices);

// A registration as listed: the record and where it came from.
struct Registration {
  std::string key;
  std::string path;  // the .json file
  nlohmann::json record;
  ProcessIdentity daemon;  // record's pid and start_time
  std::string socket;      // record's socket path
  std::string fingerprint;
  std::string problem;  // not empty: the file could not be read or lacks a field
};

class Registry {
 public:
  // "" = default_registry_dir(). Creates the directory when missing and checks it.
  explicit Registry(std::string dir);

  const std::string& dir() const { return dir_; }
  std::string socket_path(const std::string& key) const { return dir_ + "/" + key + ".sock"; }
  std::string record_path(const std::string& key) const { return dir_ + "/" + key + ".json"; }

  // Holds flock(LOCK_EX) on <dir>/lock while it lives.
  class Lock {
   public:
    explicit Lock(UniqueFd fd) : fd_(std::move(fd)) {}

   private:
    UniqueFd fd_;
  };
  Lock lock() const;

  // Writes the record next to its final name, fsyncs it, renames it into place and
  // fsyncs the directory. Call it holding lock().
  void publish(const std::string& key, const nlohmann::json& record) const;
  // Removes the record and the socket; missing ones are fine.
  void remove(const std::string& key) const;
  // Every <key>.json in the directory, parsed (files of other names are ignored).
  std::vector<Registration> list() const;
  // The registration of `key`, when there is one.
  std::optional<Registration> find(const std::string& key) const;

 private:
  std::string dir_;
};

// Checks the node at `path` before a client connects: it exists (else "missing"),
// is a socket (not a regular file or anything else) and is owned by this effective
// uid. Throws Error(Stage::kCache) saying which failed; returns false only when it
// does not exist.
bool check_socket(const std::string& path);

}  // namespace ferry::cache
