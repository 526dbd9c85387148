// The weight cache inside the runtime (internal): the fingerprint both sides
// compute, the daemon's table of what it shares, and the client's attach. The
// mechanism below it (frames, registry, messages) is cache/; the public faces are
// ferry/cache.hpp (the daemon) and cache.mode (the client, in Runtime::load).
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cache/protocol.hpp"
#include "ferry/runtime.hpp"
#include "runtime/load_config.hpp"
#include "runtime/test_seams.hpp"

namespace ferry::gpu {
class Device;
}  // namespace ferry::gpu
namespace ferry::models {
class Model;
}  // namespace ferry::models

namespace ferry::runtime {

// ferry's own layout version: bump it when a release changes the bytes a load
// leaves for the same checkpoint and configuration, so that a daemon of the old
// release is a loud mismatch instead of a silent one.
inline constexpr int kCacheLayoutVersion = 1;

// The release this build is (the project's version: libferry.so's version()), as
// the weight cache's hello and compat fields say it.
std::string release();

// What decides the bytes of a load (`identity`, hashed into `fingerprint`, compared
// with exact equality), and what is compared but not hashed (`compat`: ferry's
// version, the protocol, the device kinds), so that an upgrade is reported as such.
struct CacheIdentity {
  nlohmann::json identity;
  nlohmann::json compat;
  std::string fingerprint;   // SHA-256 hex of identity's compact text
  std::string model;         // identity's model folder (realpath)
  nlohmann::json hf_config;  // the config.json read (the client's model is made from it)
};

// The identity of a load of `c` read from disk (c.model.load_format: the disk
// format): the model folder's realpath, each weight file's and index's (name,
// device, inode, size, mtime: every *.safetensors, *.bin, *.pt, *.gguf and
// *.index.json of the folder, listed without parsing an index; the files a
// presharded, sharded_state or GGUF load reads, the last also when a folder has no
// config.json, since a GGUF's config is its metadata), config.json's hash (hf_quant_config.json
// merged in), every key of the model, parallel, gguf, quantization and postprocess sections except
// the ones kFingerprintExcluded names (postprocess.target as resolved for `c`'s devices), the EPLB
// map's hash and kCacheLayoutVersion. parallel.ranks is not in it: each rank's table is checked on
// its own, and data-parallel replicas share a daemon.
CacheIdentity cache_identity(const LoadConfig& c);
// Keys of the fingerprinted sections that are not hashed as written, and why.
inline constexpr const char* kFingerprintSections[] = {"model", "parallel", "gguf", "quantization",
                                                       "postprocess"};
inline constexpr const char* kFingerprintExcluded[] = {
    "model.path",          // its realpath is
    "model.load_format",   // the format discovery settled on is
    "parallel.ranks",      // which ranks a process holds; the fetch checks each one
    "postprocess.target",  // as resolved for the devices is
};
// remote_instance: what of a load's identity a seed and a target on other machines
// compare: all but the model folder, its files and the disk format (another
// machine's paths, inodes and times, and a seed may have read another copy of the
// files), with its own fingerprint. Both sides read config.json (hashed in it).
struct LayoutIdentity {
  nlohmann::json identity;
  std::string fingerprint;
};
LayoutIdentity layout_identity(const CacheIdentity& id);

// "field: the daemon's X, this load's Y" for each field of `theirs` and `ours`
// that differs (the files listed by name), at most `limit` of them.
// `peer` names theirs ("the daemon", "the seed").
std::vector<std::string> identity_differences(const nlohmann::json& theirs,
                                              const nlohmann::json& ours, std::size_t limit = 8,
                                              std::string_view peer = "the daemon");

// The effective mode of a load: kOff, or kDaemon / kClient (model.load_format
// ipc_cache with cache.mode off is kDaemon).
CacheConfig::Mode cache_mode(const LoadConfig& c);
// The load `c` asks for, read from disk: model.load_format is cache.fallback_format.
LoadConfig disk_config(const LoadConfig& c);

// The registry's name for a daemon's devices: "host:0,host:1" for host devices,
// the GPUs' UUIDs for CUDA ones.
std::string device_set(const std::vector<std::shared_ptr<gpu::Device>>& devices);

// The model of `config` and `hf_config` (make_configured_model), made on a thread of
// its own while the caller asks a daemon or a seed; get() waits for it (rethrowing
// what making it threw). The thread is joined when the object dies.
class ModelOnThread {
 public:
  ModelOnThread(const LoadConfig& config, const nlohmann::json& hf_config, const char* name);
  ~ModelOnThread();
  ModelOnThread(const ModelOnThread&) = delete;
  ModelOnThread& operator=(const ModelOnThread&) = delete;
  std::shared_ptr<const models::Model> get();

 private:
  std::promise<std::shared_ptr<const models::Model>> promise_;
  std::future<std::shared_ptr<const models::Model>> future_;
  std::thread thread_;
};

// A fetch request's reply, as a daemon and a seed answer it: `request`'s fingerprint
// must be `fingerprint`, its "ranks" tp ranks that `held` has; each rank's params
// are renumbered onto the reply's storages in order of first use, and `storage(b)`
// makes the reply's entry for block `b` (an index into what `held` names), once per
// block. Throws Error(stage) naming `where` and `who` ("this daemon", "this seed").
cache::FetchReply answer_fetch(const nlohmann::json& request, const std::string& fingerprint,
                               const std::vector<cache::TableRank>& held,
                               const std::function<cache::StorageEntry(std::size_t)>& storage,
                               const std::string& where, const std::string& who);

// Checks that `table` (a daemon's or a seed's) holds, rank by rank, exactly the
// params `model` keeps (transient ones aside), each of the same dtype, shape and
// size. Throws Error(stage) naming `where` and what is missing, extra or different.
void check_table(const cache::FetchReply& table, const models::Model& model,
                 const std::string& where, Stage stage);

// Internal doors into a Runtime (runtime.cpp): one whose devices can share their
// memory (HostDeviceOptions::shared_memory: the daemon's), the state of the model
// it loaded last, and its metrics (null when metrics.* are off).
std::unique_ptr<Runtime> make_sharing_runtime(Config config, RuntimeTestSeams seams = {});
std::shared_ptr<LoadedModel::State> loaded_state(Runtime& runtime);
class LoadMetrics;
std::shared_ptr<LoadMetrics> runtime_metrics(Runtime& runtime);

}  // namespace ferry::runtime
