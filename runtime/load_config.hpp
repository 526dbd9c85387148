// LoadConfig: every setting of a load, as a plain struct with in-code defaults, and
// the layered builder that fills it from JSON, the environment and the command line.
//
// Precedence, lowest first: the in-code defaults below, the config file (`--config`,
// else the embedded config/default.json), environment variables (FERRY_IO__CHUNK_BYTES
// is io.chunk_bytes), `--set key=value`, dedicated flags (`--tp`, `--model`, ...).
// Every layer merges key by key, so a later layer overrides only the keys it names.
// Unknown keys are rejected from every source, naming the key's dotted path and the
// source that introduced it; build() then reads every key through its row of the key
// table (runtime/config_keys.hpp: type, range, doc) and checks what spans several keys.
// All errors are ferry::Error(Stage::kConfig) whose file is the source, e.g.
//   config: --set io.chunk_byte: unknown key 'io.chunk_byte'
//   config: environment FERRY_IO__FOO: unknown key 'io.foo'
//   config: c.json: unknown key 'model.pth'
//   config: --set io.queue_depth: io.queue_depth: expected a positive integer, got "abc"
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.hpp"
#include "common/small_file.hpp"
#include "io/discover.hpp"
#include "io/io_config.hpp"
#include "io/reader.hpp"
#include "models/model.hpp"

namespace ferry::runtime {

struct ModelConfig {
  std::string path;                                    // checkpoint folder; "" = none given
  io::LoadFormat load_format = io::LoadFormat::kAuto;  // which files are weights (io/discover)
  std::optional<DType> dtype;  // bf16, f16 or f32; nullopt = "auto": the checkpoint's torch_dtype
  bool draft = false;          // load the draft (speculative) model's weights instead
  bool switch_w13 = false;     // swap the gate (w1) and up (w3) halves of fused MLPs
  std::string eplb_map;        // expert-placement (EPLB) map file; "" = identity
  // Fold the shared expert into the routed experts: nullopt = "auto" (SGLang's
  // decision on an NVIDIA GPU with default options), true (refused where auto would
  // not fuse) or false.
  std::optional<bool> fuse_shared_experts;
  int pad_moe_intermediate_to = 0;  // round MoE intermediate size up to this multiple; 0 = off
  // load_format dummy: the seed of every param's values (1234, SGLang's
  // initialize_dummy_weights seed), so that two dummy loads hold the same bytes.
  std::uint64_t dummy_seed = 1234;
  // Sizes tp does not divide: "refuse" (as SGLang asserts on GPU) or "pad" (zeros,
  // as SGLang's CPU path does).
  models::Unaligned unaligned_tp = models::Unaligned::kRefuse;
  bool operator==(const ModelConfig&) const = default;
};

struct ParallelConfig {
  int tp = 1;       // tensor-parallel size; a rank is a tensor-parallel rank 0..tp-1
  int ep = 1;       // expert-parallel size; must divide tp (experts are split among tp/ep groups)
  int pp = 1;       // pipeline-parallel size (one stage is loaded per process)
  int pp_rank = 0;  // the pipeline stage this process loads, 0..pp-1
  std::vector<int> pp_partition;  // layers per stage (pp entries); empty = even split
  // The ranks this process serves, in the order devices are given to them. Config
  // sources spell it "0,2", "0-3" or [0, 2]; "" (the default) means all 0..tp-1.
  // build() always fills it in; the default here is that of tp 1.
  std::vector<int> ranks{0};
  // SGLang's DeepSeek deployment layouts (models::ParallelLayout has the rules):
  // attention data parallelism (attention tp = tp / attn_dp; 1 = off), lm_head over
  // the attention tp group, the dense MLP layers whole on every rank
  // (moe_dense_tp 1; 0 = "none"), and DeepEP's unsplit shared experts.
  int attn_dp = 1;
  bool dp_lm_head = false;
  int moe_dense_tp = 0;
  bool moe_a2a_deepep = false;
  bool operator==(const ParallelConfig&) const = default;
};

// Where the local ranks live: one device per local rank, in order.
struct DeviceSpec {
  enum class Kind { kHost, kCuda, kNull };
  // host devices are arenas in RAM (the reference backend); null devices keep no
  // bytes (gpu/null_device.hpp: plans and reads of any size, nothing loaded)
  Kind kind = Kind::kHost;
  std::vector<int> ids{0};  // device ordinals; host devices are always 0..n-1
  bool operator==(const DeviceSpec&) const = default;
};

// What io.chunk_bytes, io.staging_bytes and io.read_lanes come to when left auto,
// by the kind and number of local devices. Host and null devices keep what was
// measured best on host memory (docs/PERFORMANCE.md): 1 MiB chunks that stay in the
// CPU caches, 8 MiB of staging per device, at most 4 lanes and one per file. A GPU's
// link wants more bytes per chunk and more in flight: at 50 GB/s a 1 MiB chunk is
// 20 us of DMA, of which a chunk's fixed costs (a message, an event record and
// query, device look-ups) would be a large share, and 8 MiB of staging holds only
// 160 us of link time. So on CUDA devices: 16 MiB chunks (335 us each at 50 GB/s),
// 256 MiB of pinned staging per GPU up to 1 GiB in all (at least 5 ms of link time
// in flight for one GPU), and 8 lanes per GPU up to 16, not bounded by the number
// of files (a lane takes large runs of one file's tensors when there are fewer
// files than lanes). The pipeline also caps lanes by cores and by staging buffers / 2.
struct IoAuto {
  std::size_t chunk_bytes = 0;
  std::size_t staging_bytes = 0;  // all lanes together
  unsigned max_lanes = 0;
  bool lanes_follow_files = true;  // at most one lane per weight file read
};
IoAuto io_auto(DeviceSpec::Kind kind, std::size_t local_devices);

// The io and prefetch sections are io/'s own settings (io/io_config.hpp); the
// pipeline takes them as they are built here.
using io::IoConfig;
using io::PrefetchConfig;

struct LoadOptions {
  bool strict = false;  // unmapped or missing tensors are errors rather than warnings
  int sort_weight_files =
      0;               // file order: 0 bytewise, -1 directory order, k > 0 staggered (io/discover)
  std::string report;  // write the JSON load report here; "" = none
  std::string dump_dir;  // dump the loaded parameters here for debugging; "" = none
  // Load-only params (quantization.online's full-precision weights) are allocated on
  // their first write and freed as soon as their hook has run, so a device holds the
  // quantized model plus about a layer in full precision, not all of it. Off: they
  // are allocated up front and freed at the end.
  bool layered = false;
  // After a load, its ranks as a presharded checkpoint (runtime/presharded.hpp) under
  // this folder, in the layout's subfolder; skipped when one is there already. With
  // model.load_format presharded and no folder for the layout anywhere, the load
  // reads the raw checkpoint at model.path instead and saves it. "" = none.
  std::string save_presharded;
  // model.load_format presharded: every param's XXH3-128 checked against the manifest
  // after the stream (each param read back once, in bounded blocks).
  bool verify_checksums = false;
  // After a load, each local tp rank's params as SGLang's sharded_state checkpoint
  // (runtime/sharded_state.hpp) in this folder: model-rank-<r>-part-<p>.safetensors,
  // with pp > 1 under pp-<stage>/. "" = none.
  std::string save_sharded_state;
  bool operator==(const LoadOptions&) const = default;
};

// What `ferry save`, load.save_presharded and load.save_sharded_state write.
struct SaveConfig {
  std::uint64_t max_file_bytes = std::uint64_t{20} << 30;  // a file holds one tensor at least
  bool operator==(const SaveConfig&) const = default;
};

// Runtime::update (runtime/update.cpp).
struct UpdateConfig {
  // How a failed update is undone, tried first: kReread (the model's current source
  // read again, when its files' stamps are unchanged: no memory, no time unless it
  // fails) or kSnapshot (the params it writes copied to host memory first, within
  // rollback_bytes). The other one when the first is not possible; else none.
  enum class Rollback { kReread, kSnapshot };
  Rollback rollback = Rollback::kReread;
  // The most host memory a snapshot may hold.
  std::uint64_t rollback_bytes = std::uint64_t{4} << 30;
  // Where in-memory tensors are laid out as a safetensors file the pipeline reads
  // (a tmpfs: the bytes stay in memory); removed when the update ends.
  std::string tensor_dir = "/dev/shm";
  bool operator==(const UpdateConfig&) const = default;
};

// The weight cache (`ferry serve`, runtime/cache_client.cpp): where a load's
// parameters come from a daemon that holds them already.
struct CacheConfig {
  // kOff: load from disk (model.load_format ipc_cache still asks for a daemon, as
  // kDaemon). kDaemon: the parameters must come from a daemon; none registered is an
  // error. kClient: from a daemon when one is registered, else from disk with
  // fallback_format (logged). Any other failure is an error in both modes.
  enum class Mode { kOff, kDaemon, kClient };
  Mode mode = Mode::kOff;
  // How the files are read without a daemon, and the format the daemon's
  // fingerprint is compared with (auto: as discovery finds them).
  io::LoadFormat fallback_format = io::LoadFormat::kAuto;
  std::string dir;  // the registry; "" = $XDG_RUNTIME_DIR/ferry-cache or /tmp/ferry-cache-<uid>
  // How often a client checks that its daemon is still the same process.
  std::uint64_t watch_ms = 5000;
  // How long one connection to a daemon may take, each way (the daemon's too).
  std::uint64_t timeout_ms = 30000;
  bool operator==(const CacheConfig&) const = default;
};

// remote_instance (runtime/remote_target.cpp, runtime/remote_seed.cpp): a target
// pulls its parameters over UCX from a seed, a `ferry serve --remote` of the same
// layout on another machine.
struct RemoteConfig {
  // The seed's control port, HOST:PORT (`ferry serve --remote` sets it): "" = this
  // daemon serves no remote targets.
  std::string listen;
  // model.load_format remote_instance: the seed's control port, HOST:PORT.
  std::string seed;
  // The shared secret both sides read (a file of mode 0600, 16 to 4096 bytes).
  std::string token_file;
  // Bytes of gets in flight at once (one get at least).
  std::uint64_t inflight_bytes = std::uint64_t{256} << 20;
  // The control connection's deadline each way, and how long a pull may see no data.
  std::uint64_t timeout_ms = 30000;
  // How the files are read when the seed cannot be reached at all (never after a pull
  // started); nullopt ("none"): that is an error.
  std::optional<io::LoadFormat> fallback_format;
  // UCX_TLS for the transfer ("" = UCX's choice; "tcp" keeps two processes of one
  // host on the network instead of shared memory).
  std::string transports;
  bool operator==(const RemoteConfig&) const = default;
};

struct HostConfig {
  double bandwidth_gbps = 0;  // host-device copy cap in GB/s to mimic PCIe; 0 = no cap
  // Host devices run copies later on a thread of their own, as a DMA engine would,
  // and staging buffers are poisoned when they return: a pipeline that released a
  // buffer before its copy completed loads wrong bytes (a test of asynchrony).
  bool deferred_copies = false;
  // Large host-device allocations ask for transparent huge pages (see
  // gpu::HostDeviceOptions::huge_pages; off by default).
  bool huge_pages = false;
  // Host devices gather row slices narrower than this through device scratch, as
  // CUDA devices do below 64 KiB (gpu::HostDeviceOptions::narrow_row_bytes): how
  // the CUDA copy path's gather is exercised without a GPU. 0 = never.
  std::uint64_t narrow_row_bytes = 0;
  bool operator==(const HostConfig&) const = default;
};

struct MetricsConfig {
  // Serve Prometheus metrics at http://ADDRESS:PORT/metrics while the Runtime lives;
  // "PORT" binds 127.0.0.1. "" = off. build() normalizes it to ADDRESS:PORT.
  std::string listen;
  // Write the metrics here after every load, through a temporary file renamed into
  // place (node_exporter's textfile collector); "" = none.
  std::string textfile;
  bool operator==(const MetricsConfig&) const = default;
};

struct TraceConfig {
  // Write a Chrome trace-event JSON of each load here (Perfetto, chrome://tracing):
  // reads, copies, casts, hooks and phases on lanes; "" = none.
  std::string path;
  bool operator==(const TraceConfig&) const = default;
};

// How Runtime::prepare()/commit() start a model (runtime/api_internal.hpp). load() and
// start() ignore it: they are always one serial pass.
enum class StartupMode {
  kSerial,   // prepare() loads fully; commit() only verifies
  kOverlap,  // prepare() fills sentinel shells and prefetches; commit() streams (or fails
             // with the admission's refusals)
  kAuto,     // overlap when admission allows it, else serial (the refusals are logged)
};
std::string_view to_string(CacheConfig::Mode mode);  // "off", "daemon", "client"
std::string_view to_string(StartupMode mode);

// quantization.requant's spelling: "none", "ue8m0", "tensor".
std::string_view requant_name(models::QuantScheme::Requant requant);

// metrics.listen's value as ADDRESS:PORT ("9400" -> "127.0.0.1:9400"). ADDRESS is an
// IPv4 address (inet_pton: "999.1.1.1" is refused, where the web server would bind
// 231.1.1.1), an IPv6 address in brackets ("[::1]:9400") or an RFC 1123 host name.
// Throws ferry::Error(Stage::kConfig) for anything else.
std::string metrics_bind_address(const std::string& text);

struct StartupConfig {
  StartupMode mode = StartupMode::kSerial;
  bool operator==(const StartupConfig&) const = default;
};

// GGUF checkpoints (model.load_format gguf, io/gguf_checkpoint.hpp).
struct GgufConfig {
  // Quantized GGML tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K) are
  // dequantized to the parameter's dtype on the device as they are copied. Off: they
  // would keep their GGML blocks for GGUF kernels (SGLang's GGUFLinearMethod); that
  // layout is not built, so a quantized tensor is refused by name.
  bool dequantize = true;
  bool operator==(const GgufConfig&) const = default;
};

struct QuantizationConfig {
  // Convert an FP8 block-scaled checkpoint's scales after loading (models/requant.hpp):
  // none, ue8m0 (power-of-two scales and DeepGEMM's packed copy, as SGLang on
  // Blackwell) or tensor (one scale per weight matrix). Off by default: the kernels
  // of Hopper read the checkpoint's block scales as they are.
  models::QuantScheme::Requant requant = models::QuantScheme::Requant::kNone;
  // Quantize a full-precision checkpoint to FP8 while loading (models/online_quant.hpp):
  // none, fp8_channel (a scale an output row), fp8_tensor (one a weight matrix), or
  // auto: SGLang's choice, per channel where cutlass FP8 runs (compute capability
  // 8.9 or above; host and null devices count as such), else per tensor.
  enum class Online { kNone, kAuto, kChannel, kTensor };
  Online online = Online::kNone;
  bool operator==(const QuantizationConfig&) const = default;
};

// quantization.online's spelling: "none", "auto", "fp8_channel", "fp8_tensor".
std::string_view online_name(QuantizationConfig::Online online);

struct PostprocessConfig {
  // postprocess.target (models/postprocess.hpp): the layout SGLang 0.5.23's
  // process_weights_after_loading leaves on that GPU: loader (its weight loaders'
  // state, the default), sm90, sm100, or auto (nullopt): the first CUDA device's
  // compute capability (9.x sm90, 10.x sm100, anything else loader, with a warning),
  // loader on host and null devices.
  std::optional<models::QuantScheme::Target> target = models::QuantScheme::Target::kLoader;
  bool operator==(const PostprocessConfig&) const = default;
};

// postprocess.target's spelling: models::to_string's, or "auto" for nullopt.
std::string_view target_name(const std::optional<models::QuantScheme::Target>& target);

struct LoadConfig {
  ModelConfig model;
  ParallelConfig parallel;
  // Config sources spell it "" (host:<local ranks>), "host", "host:N", "null" (one
  // per local rank), "null:N" or "cuda:0,2".
  DeviceSpec devices;
  IoConfig io;
  PrefetchConfig prefetch;
  LoadOptions load;
  HostConfig host;
  MetricsConfig metrics;
  TraceConfig trace;
  StartupConfig startup;
  GgufConfig gguf;
  QuantizationConfig quantization;
  PostprocessConfig postprocess;
  SaveConfig save;
  UpdateConfig update;
  CacheConfig cache;
  RemoteConfig remote;
  bool operator==(const LoadConfig&) const = default;
};

// FERRY_ environment variables that are not configuration keys: apply_env reads past
// them in silence (FERRY_LOG and FERRY_DISABLE_URING are read where they act; the
// last two tell the tests where the shared test data is, see the README).
inline constexpr std::array<std::string_view, 4> kNonConfigVariables = {
    "FERRY_LOG", "FERRY_DISABLE_URING", "FERRY_TEST_DATA", "FERRY_REQUIRE_TEST_DATA"};

// The layers a key's value can come from, lowest precedence first.
enum class ConfigLayer { kDefault, kFile, kEnvironment, kSet, kFlag };
std::string_view to_string(ConfigLayer layer);  // "default", "file", "environment", "--set", "flag"

// Where a key's effective value came from: its layer, and the source within it
// ("c.json", "environment FERRY_IO__DIRECT", "--set io.direct", "--tp", "defaults").
struct KeyOrigin {
  ConfigLayer layer = ConfigLayer::kDefault;
  std::string source = "defaults";
};

// Builds a LoadConfig layer by layer. Each apply_* merges its keys into a JSON tree
// (later calls override earlier ones key by key) and throws at once for unknown keys
// or malformed input; build() validates the values. Not thread-safe.
class ConfigBuilder {
 public:
  // `object` must be a JSON object shaped like to_json's output (any subset of it).
  void apply_json(const nlohmann::json& object, std::string_view source);
  // Parses `text` as JSON (for the embedded default), then apply_json.
  void apply_json_text(std::string_view text, std::string_view source);
  // Reads and parses a config file; its path names it in errors.
  void apply_file(const std::filesystem::path& path);
  // Variables starting with FERRY_ whose name contains "__", and FERRY_DEVICES, are
  // configuration variables: the rest of the name, lower-cased with "__" read as ".",
  // is the key (FERRY_IO__CHUNK_BYTES is io.chunk_bytes), and one that names no key
  // is an error. kNonConfigVariables are skipped in silence. Any other FERRY_
  // variable (FERRY_BIN, set by a wrapper script) is ignored with one warning naming
  // it, kept in warnings(). Values are read as by apply_set. Applied in name order.
  void apply_env(const std::map<std::string, std::string>& env);
  // A null-terminated "NAME=value" array such as environ.
  void apply_env(const char* const* envp);
  // "key=value": the value is JSON when it parses as JSON, else the text as a string.
  // A string key given a scalar that parsed as JSON (model.path=2024) keeps the text.
  void apply_set(std::string_view assignment);
  // A dedicated flag (`flag` names it in errors, e.g. "--tp") setting `key`; `text`
  // is read as apply_set reads values.
  void apply_flag(std::string_view flag, std::string_view key, std::string_view text);
  // As apply_flag with a typed value.
  void apply_flag_value(std::string_view flag, std::string_view key, const nlohmann::json& value);

  // Which of the rules that span several keys build() checks: all of them (the CLI,
  // a whole configuration), or all but the load rules (broken_load_rule), for a
  // Config set call by call, which may pass through a state that breaks one on its
  // way (load.layered set before quantization.online); a load checks those when it
  // starts.
  enum class Rules { kAll, kAllButLoad };
  // Reads the merged keys over the in-code defaults, row by row of the key table
  // (which resolves ranks, devices and auto sizes), then checks the rules that span
  // several keys. Errors name the key and the source that set it.
  LoadConfig build(Rules rules = Rules::kAll) const;

  // Where `key` (a table key, "io.direct") got its value from: the layer that set it
  // last, or kDefault.
  KeyOrigin origin(std::string_view key) const;

  // What the layers applied so far ignored, one line each, for the caller to log
  // (load_config logs them with log::warn).
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  // One key's value and the layer that set it last.
  struct Entry {
    nlohmann::json value;
    KeyOrigin origin;                 // "c.json", "--set io.direct", "environment FERRY_X", ...
    std::optional<std::string> text;  // the raw text, for values read from text
  };
  void apply_text(std::string_view key, std::string_view text, const KeyOrigin& origin);
  void set_key(const std::string& key, const nlohmann::json& value, const KeyOrigin& origin,
               const std::optional<std::string>& text);
  [[noreturn]] void refuse(std::string_view key, const std::string& rule) const;
  // The rules between the parallel.* keys, checked as soon as those rows are read.
  void check_parallel_rules(const LoadConfig& config) const;
  // The rules that span several sections, once every row is read.
  void check_across_keys(const LoadConfig& config, Rules rules) const;

  // The merged tree, flattened: dotted key -> entry. Sections ("io") never appear,
  // only their keys ("io.direct"), so a layer overrides exactly the keys it names.
  std::map<std::string, Entry> entries_;
  std::vector<std::string> warnings_;
};

// A rule between keys that a load needs to hold, broken: the key it is charged to
// and what the rule says.
struct BrokenRule {
  std::string_view key;
  std::string rule;
};
// The first load rule `config` breaks (load.layered with what it cannot follow,
// prefetch with O_DIRECT), or nullopt. build() checks them with the rest; a load
// checks them again when it starts, for a configuration set call by call.
std::optional<BrokenRule> broken_load_rule(const LoadConfig& config);

// The tp ranks this process serves: parallel.ranks, or every rank 0..tp-1.
std::vector<int> local_tp_ranks(const LoadConfig& config);

// Where a LoadConfig comes from, as the CLI collected it.
struct ConfigSources {
  struct Flag {
    std::string flag;   // "--tp"
    std::string key;    // "parallel.tp"
    std::string value;  // text, read as apply_set reads values
  };
  std::string config_file;   // --config; "" = use default_json
  std::string default_json;  // the text of config/default.json (embedded by the CLI)
  std::string default_json_name = "config/default.json";  // names it in errors
  std::vector<std::string> sets;                          // --set key=value, in command-line order
  std::vector<Flag> flags;                                // dedicated flags, in command-line order
};

// A builder with every layer of `sources` applied over `env`: defaults < config
// file (or default_json) < environment < --set < flags. Its warnings are not logged.
ConfigBuilder apply_sources(const ConfigSources& sources,
                            const std::map<std::string, std::string>& env);

// apply_sources, its warnings (ignored FERRY_ variables) logged with log::warn once
// each, built.
LoadConfig load_config(const ConfigSources& sources, const std::map<std::string, std::string>& env);
LoadConfig load_config(const ConfigSources& sources, const char* const* envp);

// "NAME=value" entries (as environ) -> name -> value; entries without '=' are skipped.
std::map<std::string, std::string> env_map(const char* const* envp);

// The effective configuration with every key of the table (ranks as an array,
// devices as "host:N" / "cuda:0,2", sizes in bytes), for the load report. Applying it
// to an empty ConfigBuilder builds an equal LoadConfig.
nlohmann::json to_json(const LoadConfig& config);

// A size: a non-negative JSON number, or a string "4096", "4KiB", "4 MiB", "1.5GiB",
// "1GB" (KiB/MiB/GiB binary, KB/MB/GB decimal, B bytes). A fraction (1.5GiB, 1e9) is
// allowed when the result is a whole number of bytes. Throws Error(kConfig) for anything else,
// negative values, unknown units and sizes beyond 2^64 - 1.
std::uint64_t parse_size(const nlohmann::json& value);

// "0,2", "0-3", "1-2,5" (whitespace allowed) -> the ranks in the order written; "" ->
// 0..tp-1. Throws Error(kConfig) quoting the text for empty items, non-numbers,
// reversed ranges, ranks >= tp and duplicates.
std::vector<int> parse_ranks(std::string_view text, int tp);

// Resolves a device spec for the local ranks: "" or "host" -> host:<ranks>; "host:N"
// needs N == ranks; "cuda:0,2" (ranges allowed) needs one id per rank. Throws
// Error(kConfig) quoting the spec for a count mismatch, duplicates or bad text.
DeviceSpec resolve_devices(std::string_view spec, std::span<const int> local_ranks);

// "host:2", "cuda:0,2": a spec resolve_devices maps back to `spec`.
std::string to_string(const DeviceSpec& spec);

}  // namespace ferry::runtime
