// The rows of the configuration table (runtime/config_keys.hpp). Most rows are made
// by a template over the member they set (a bool, an integer or a size in a range, a
// string, one of a list of names); the few keys whose reading depends on other keys
// or on more than one spelling have rows of their own.
#include "runtime/config_keys.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <limits>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "io/file.hpp"
#include "models/hf_config.hpp"
#include "models/postprocess.hpp"

namespace ferry::runtime {

void config_rule(std::string rule) {
  throw Error(Stage::kConfig, "", "", std::move(rule));
}

std::string json_quoted(std::string_view text) {
  return nlohmann::json(std::string(text)).dump();
}

std::string_view trim_space(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())) != 0) {
    s.remove_prefix(1);
  }
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())) != 0) {
    s.remove_suffix(1);
  }
  return s;
}

namespace {

using models::json_non_negative;

constexpr std::int64_t kMaxParallel = 4096;  // tp, ep, pp: far beyond any deployment
constexpr std::uint64_t kMaxChunkBytes = std::uint64_t{1} << 30;     // a read returns < 2 GiB
constexpr std::uint64_t kMaxStagingBytes = std::uint64_t{64} << 30;  // staging for all lanes
constexpr std::uint64_t kAlign = io::kDirectAlignment;
// io.max_metadata_bytes: a config.json is a few KiB, the largest indexes tens of MB.
constexpr std::uint64_t kMinMetadataBytes = std::uint64_t{64} << 10;
constexpr std::uint64_t kMaxMetadataBytes = std::uint64_t{4} << 30;
// save.max_file_bytes: 1 MiB (tests) to 1 TiB; a file still holds one tensor at least.
constexpr std::uint64_t kMinSaveFileBytes = std::uint64_t{1} << 20;
constexpr std::uint64_t kMaxSaveFileBytes = std::uint64_t{1} << 40;
// host.bandwidth_gbps, when not 0: 10 MB/s to 10 TB/s, around every link there is
// (PCIe 1.0 x1 moves 0.25 GB/s); 1e-300 made a load that never finished.
constexpr double kMinBandwidthGbps = 0.01;
constexpr double kMaxBandwidthGbps = 10000;

// ---- reading one value ------------------------------------------------------------

std::string as_string(const KeyInput& in) {
  if (in.value.is_string()) {
    return in.value.get<std::string>();
  }
  if (in.text.has_value() && in.value.is_primitive()) {
    return *in.text;  // `--set model.path=2024` parsed as a number; the text is what was meant
  }
  config_rule("expected a string, got " + in.value.dump());
}

bool as_bool(const KeyInput& in) {
  if (!in.value.is_boolean()) {
    config_rule("expected true or false, got " + in.value.dump());
  }
  return in.value.get<bool>();
}

std::int64_t as_int(const KeyInput& in, std::int64_t lo, std::int64_t hi) {
  const nlohmann::json& v = in.value;
  const std::string kind = lo == 1   ? "a positive integer"
                           : lo == 0 ? "a non-negative integer"
                                     : "an integer";
  if (!v.is_number_integer()) {
    config_rule("expected " + kind + ", got " + v.dump());
  }
  const bool in_range = v.is_number_unsigned()
                            ? v.get<std::uint64_t>() <= static_cast<std::uint64_t>(hi) &&
                                  static_cast<std::int64_t>(v.get<std::uint64_t>()) >= lo
                            : v.get<std::int64_t>() >= lo && v.get<std::int64_t>() <= hi;
  if (!in_range) {
    config_rule("expected an integer from " + std::to_string(lo) + " to " + std::to_string(hi) +
                ", got " + v.dump());
  }
  return v.is_number_unsigned() ? static_cast<std::int64_t>(v.get<std::uint64_t>())
                                : v.get<std::int64_t>();
}

std::uint64_t as_size(const KeyInput& in, std::uint64_t lo, std::uint64_t hi) {
  const std::uint64_t bytes = parse_size(in.value);
  if (bytes < lo || bytes > hi) {
    config_rule("expected " + std::to_string(lo) + " to " + std::to_string(hi) + " bytes, got " +
                in.value.dump());
  }
  return bytes;
}

// "a, b or c"
std::string or_list(std::span<const std::string_view> names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    out += i == 0 ? "" : i + 1 == names.size() ? " or " : ", ";
    out += names[i];
  }
  return out;
}

// ---- rows made from a member --------------------------------------------------------

template <auto Section, auto Member>
auto& member(LoadConfig& c) {
  return c.*Section.*Member;
}

template <auto Section, auto Member>
const auto& member(const LoadConfig& c) {
  return c.*Section.*Member;
}

// A row over `Member` of `Section`: `Parse` reads a value (throwing the rule),
// `Type` says what it takes, `Spell` writes the member back (nullptr: as JSON has it).
template <auto Section, auto Member, auto Parse, auto Type, auto Spell = nullptr>
ConfigKey member_key(std::string_view name, std::string_view doc) {
  return {name, doc, Type,
          [](const KeyInput* in, LoadConfig& c) {
            auto& m = member<Section, Member>(c);
            if (in != nullptr) {
              m = static_cast<std::remove_reference_t<decltype(m)>>(Parse(*in));
            }
          },
          [](const LoadConfig& c) {
            if constexpr (std::is_null_pointer_v<decltype(Spell)>) {
              return nlohmann::json(member<Section, Member>(c));
            } else {
              return Spell(member<Section, Member>(c));
            }
          }};
}

std::string bool_type() {
  return "bool";
}

std::string string_type() {
  return "string";
}

template <std::int64_t Lo, std::int64_t Hi>
std::int64_t int_in(const KeyInput& in) {
  return as_int(in, Lo, Hi);
}

template <std::int64_t Lo, std::int64_t Hi>
std::string int_type() {
  return "integer " + std::to_string(Lo) + ".." + std::to_string(Hi);
}

template <std::uint64_t Lo, std::uint64_t Hi>
std::uint64_t size_in(const KeyInput& in) {
  return as_size(in, Lo, Hi);
}

template <std::uint64_t Lo, std::uint64_t Hi>
std::string size_type() {
  return "size " + std::to_string(Lo) + ".." + std::to_string(Hi);
}

// One of a fixed list of names, each standing for a value of the member.
template <typename T>
struct Choice {
  std::string_view name;
  T value;
};

template <const auto& Choices>
using ChoiceValue = std::remove_cvref_t<decltype(Choices[0].value)>;

template <typename T, std::size_t N>
std::string_view name_in(const std::array<Choice<T>, N>& choices, const T& value) {
  for (const Choice<T>& c : choices) {
    if (c.value == value) {
      return c.name;
    }
  }
  return "?";
}

template <const auto& Choices>
ChoiceValue<Choices> choice_in(const KeyInput& in) {
  const std::string text = as_string(in);
  std::vector<std::string_view> names;
  for (const auto& choice : Choices) {
    if (choice.name == text) {
      return choice.value;
    }
    names.push_back(choice.name);
  }
  config_rule("expected " + or_list(names) + ", got " + json_quoted(text));
}

template <const auto& Choices>
std::string choice_type() {
  std::string out;
  for (const auto& choice : Choices) {
    out += (out.empty() ? "" : "|") + std::string(choice.name);
  }
  return out;
}

template <const auto& Choices>
nlohmann::json choice_name(const ChoiceValue<Choices>& value) {
  return std::string(name_in(Choices, value));
}

template <auto Section, auto Member>
ConfigKey bool_key(std::string_view name, std::string_view doc) {
  return member_key<Section, Member, as_bool, bool_type>(name, doc);
}

template <auto Section, auto Member, std::int64_t Lo, std::int64_t Hi>
ConfigKey int_key(std::string_view name, std::string_view doc) {
  return member_key<Section, Member, int_in<Lo, Hi>, int_type<Lo, Hi>>(name, doc);
}

template <auto Section, auto Member, std::uint64_t Lo, std::uint64_t Hi>
ConfigKey size_key(std::string_view name, std::string_view doc) {
  return member_key<Section, Member, size_in<Lo, Hi>, size_type<Lo, Hi>>(name, doc);
}

template <auto Section, auto Member>
ConfigKey string_key(std::string_view name, std::string_view doc) {
  return member_key<Section, Member, as_string, string_type>(name, doc);
}

template <auto Section, auto Member, const auto& Choices>
ConfigKey choice_key(std::string_view name, std::string_view doc) {
  return member_key<Section, Member, choice_in<Choices>, choice_type<Choices>,
                    choice_name<Choices>>(name, doc);
}

// ---- the names of the values ------------------------------------------------------

using Requant = models::QuantScheme::Requant;
using Online = QuantizationConfig::Online;
using Target = models::QuantScheme::Target;

constexpr std::array<Choice<io::LoadFormat>, 10> kLoadFormats{{
    {"auto", io::LoadFormat::kAuto},
    {"safetensors", io::LoadFormat::kSafetensors},
    {"mistral", io::LoadFormat::kMistral},
    {"pt", io::LoadFormat::kPt},
    {"gguf", io::LoadFormat::kGguf},
    {"dummy", io::LoadFormat::kDummy},
    {"presharded", io::LoadFormat::kPresharded},
    {"sharded_state", io::LoadFormat::kShardedState},
    {"ipc_cache", io::LoadFormat::kIpcCache},
    {"remote_instance", io::LoadFormat::kRemoteInstance},
}};
constexpr std::array<Choice<std::optional<DType>>, 4> kDTypes{{
    {"auto", std::nullopt},
    {"bf16", DType::kBF16},
    {"f16", DType::kF16},
    {"f32", DType::kF32},
}};
constexpr std::array<Choice<models::Unaligned>, 2> kUnaligned{{
    {"refuse", models::Unaligned::kRefuse},
    {"pad", models::Unaligned::kPad},
}};
constexpr std::array<Choice<Requant>, 3> kRequants{{
    {"none", Requant::kNone},
    {"ue8m0", Requant::kUe8m0},
    {"tensor", Requant::kTensor},
}};
constexpr std::array<Choice<Online>, 4> kOnline{{
    {"none", Online::kNone},
    {"auto", Online::kAuto},
    {"fp8_channel", Online::kChannel},
    {"fp8_tensor", Online::kTensor},
}};
constexpr std::array<Choice<std::optional<Target>>, 4> kTargets{{
    {"loader", Target::kLoader},
    {"sm90", Target::kSm90},
    {"sm100", Target::kSm100},
    {"auto", std::nullopt},
}};
constexpr std::array<Choice<bool>, 2> kMoeA2a{{{"none", false}, {"deepep", true}}};
constexpr std::array<Choice<io::Engine>, 2> kEngines{{
    {"uring", io::Engine::kUring},
    {"pread", io::Engine::kPread},
}};
constexpr std::array<Choice<io::DirectToDevice>, 3> kDirectToDevice{{
    {"auto", io::DirectToDevice::kAuto},
    {"on", io::DirectToDevice::kOn},
    {"off", io::DirectToDevice::kOff},
}};
constexpr std::array<Choice<StartupMode>, 3> kStartupModes{{
    {"serial", StartupMode::kSerial},
    {"overlap", StartupMode::kOverlap},
    {"auto", StartupMode::kAuto},
}};

constexpr std::array<Choice<CacheConfig::Mode>, 3> kCacheModes{{
    {"off", CacheConfig::Mode::kOff},
    {"daemon", CacheConfig::Mode::kDaemon},
    {"client", CacheConfig::Mode::kClient},
}};
// cache.fallback_format: the formats a daemon loads from disk: every load format
// but the last two, ipc_cache and remote_instance.
template <typename T, std::size_t N>
constexpr std::array<Choice<T>, N - 2> disk_formats(const std::array<Choice<T>, N>& all) {
  std::array<Choice<T>, N - 2> out{};
  for (std::size_t i = 0; i + 2 < N; ++i) {
    out[i] = all[i];
  }
  return out;
}
static_assert(kLoadFormats[kLoadFormats.size() - 2].value == io::LoadFormat::kIpcCache);
static_assert(kLoadFormats.back().value == io::LoadFormat::kRemoteInstance);
constexpr std::array<Choice<io::LoadFormat>, kLoadFormats.size() - 2> kFallbackFormats =
    disk_formats(kLoadFormats);
// remote.fallback_format: none, or a disk format.
constexpr std::array<Choice<std::optional<io::LoadFormat>>, kFallbackFormats.size() + 1>
    kRemoteFallbacks = [] {
      std::array<Choice<std::optional<io::LoadFormat>>, kFallbackFormats.size() + 1> out{};
      out[0] = {"none", std::nullopt};
      for (std::size_t i = 0; i < kFallbackFormats.size(); ++i) {
        out[i + 1] = {kFallbackFormats[i].name, kFallbackFormats[i].value};
      }
      return out;
    }();

constexpr std::array<Choice<UpdateConfig::Rollback>, 2> kUpdateRollbacks{{
    {"reread", UpdateConfig::Rollback::kReread},
    {"snapshot", UpdateConfig::Rollback::kSnapshot},
}};

// ---- rows of their own ----------------------------------------------------------------

// auto (nullopt), true or false; a config file may give the booleans as JSON.
ConfigKey fuse_shared_experts_key() {
  return {"model.fuse_shared_experts",
          "fold the shared expert into the routed experts; auto: where SGLang does",
          [] { return std::string("auto|true|false"); },
          [](const KeyInput* in, LoadConfig& c) {
            if (in == nullptr) {
              return;
            }
            const nlohmann::json& v = in->value;
            if (v.is_boolean()) {
              c.model.fuse_shared_experts = v.get<bool>();
            } else if (v.is_string() && (v == "auto" || v == "true" || v == "false")) {
              c.model.fuse_shared_experts =
                  v == "auto" ? std::nullopt : std::optional<bool>(v == "true");
            } else {
              config_rule("expected auto, true or false, got " + v.dump());
            }
          },
          [](const LoadConfig& c) {
            return c.model.fuse_shared_experts ? nlohmann::json(*c.model.fuse_shared_experts)
                                               : nlohmann::json("auto");
          }};
}

// Layer counts; that there is one per stage is build()'s check.
ConfigKey pp_partition_key() {
  return {"parallel.pp_partition", "layers per pipeline stage; [] splits them as SGLang does",
          [] { return std::string("array of integers"); },
          [](const KeyInput* in, LoadConfig& c) {
            if (in == nullptr) {
              return;
            }
            const nlohmann::json& v = in->value;
            const bool ok = v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& x) {
                              auto n = json_non_negative(x);
                              return n && *n <= (1u << 20);
                            });
            if (!ok) {
              config_rule("expected an array of layer counts such as [16, 16], got " + v.dump());
            }
            c.parallel.pp_partition.clear();
            for (const auto& x : v) {
              c.parallel.pp_partition.push_back(static_cast<int>(*json_non_negative(x)));
            }
          },
          [](const LoadConfig& c) { return nlohmann::json(c.parallel.pp_partition); }};
}

// "0,2", "0-3", [0, 2] or one number, checked against parallel.tp; "" or absent: all.
ConfigKey ranks_key() {
  return {
      "parallel.ranks", "the tensor-parallel ranks this process loads; \"\" = all",
      [] { return std::string("ranks (\"0,2\", \"0-3\", [0, 2])"); },
      [](const KeyInput* in, LoadConfig& c) {
        const int tp = c.parallel.tp;
        if (in == nullptr) {
          c.parallel.ranks = parse_ranks("", tp);
          return;
        }
        const nlohmann::json& v = in->value;
        if (auto one = json_non_negative(v)) {
          c.parallel.ranks = parse_ranks(std::to_string(*one), tp);
          return;
        }
        if (v.is_string()) {
          c.parallel.ranks = parse_ranks(v.get<std::string>(), tp);
          return;
        }
        // [] means all ranks, as "" does.
        if (v.is_array() &&
            std::all_of(v.begin(), v.end(), [](const auto& x) { return json_non_negative(x); })) {
          std::string text;
          for (const auto& x : v) {
            text += (text.empty() ? "" : ",") + std::to_string(*json_non_negative(x));
          }
          c.parallel.ranks = parse_ranks(text, tp);
          return;
        }
        config_rule("expected a list of ranks such as \"0,2\", \"0-3\" or [0, 2], got " + v.dump());
      },
      [](const LoadConfig& c) { return nlohmann::json(c.parallel.ranks); }};
}

// 1 or "none"; a config file may give the 1 as a number.
ConfigKey moe_dense_tp_key() {
  return {
      "parallel.moe_dense_tp", "1: a MoE model's dense MLP layers whole on every rank",
      [] { return std::string("none|1"); },
      [](const KeyInput* in, LoadConfig& c) {
        if (in == nullptr) {
          return;
        }
        const std::string text = in->value.is_number_integer()
                                     ? std::to_string(in->value.get<std::int64_t>())
                                     : as_string(*in);
        if (text == "none") {
          c.parallel.moe_dense_tp = 0;
        } else if (text == "1") {
          c.parallel.moe_dense_tp = 1;
        } else {
          config_rule("expected none or 1 (SGLang's moe_dense_tp_size), got " + json_quoted(text));
        }
      },
      [](const LoadConfig& c) {
        return c.parallel.moe_dense_tp == 1 ? nlohmann::json(1) : nlohmann::json("none");
      }};
}

// One device per local rank; "" (or absent): host devices, one per local rank.
ConfigKey devices_key() {
  return {"devices", "one device per local rank: host:N, null:N or cuda:0,1",
          [] { return std::string("devices (host:N, null:N, cuda:IDS)"); },
          [](const KeyInput* in, LoadConfig& c) {
            c.devices = resolve_devices(in == nullptr ? "" : as_string(*in), c.parallel.ranks);
          },
          [](const LoadConfig& c) { return nlohmann::json(to_string(c.devices)); }};
}

// "auto" (or absent): io_auto's for the devices, and never so large that explicit
// staging holds fewer than two buffers (one read in flight while the other is copied).
ConfigKey chunk_bytes_key() {
  return {
      "io.chunk_bytes", "one read and one staging buffer; auto: by the devices",
      [] { return "auto|size " + std::to_string(kAlign) + ".." + std::to_string(kMaxChunkBytes); },
      [](const KeyInput* in, LoadConfig& c) {
        if (in != nullptr && !(in->value.is_string() && in->value == "auto")) {
          c.io.chunk_bytes = as_size(*in, kAlign, kMaxChunkBytes);
          c.io.chunk_bytes_auto = false;
          return;
        }
        c.io.chunk_bytes = io_auto(c.devices.kind, c.parallel.ranks.size()).chunk_bytes;
        c.io.chunk_bytes_auto = true;
        if (c.io.staging_bytes != 0) {
          const std::uint64_t half = c.io.staging_bytes / 2 / kAlign * kAlign;
          c.io.chunk_bytes =
              std::max<std::uint64_t>(kAlign, std::min<std::uint64_t>(c.io.chunk_bytes, half));
        }
      },
      [](const LoadConfig& c) {
        return c.io.chunk_bytes_auto ? nlohmann::json("auto") : nlohmann::json(c.io.chunk_bytes);
      }};
}

ConfigKey bandwidth_key() {
  return {"host.bandwidth_gbps", "cap host-device copies (GB/s) to mimic a PCIe link; 0 = none",
          [] { return std::string("number 0 or 0.01..10000"); },
          [](const KeyInput* in, LoadConfig& c) {
            if (in == nullptr) {
              return;
            }
            if (!in->value.is_number()) {
              config_rule("expected a number, got " + in->value.dump());
            }
            const double d = in->value.get<double>();
            std::ostringstream rule;
            if (!(d >= 0 && d <= kMaxBandwidthGbps)) {
              rule << "expected a number from " << 0 << " to " << kMaxBandwidthGbps << ", got "
                   << in->value.dump();
              config_rule(rule.str());
            }
            if (d != 0 && d < kMinBandwidthGbps) {
              rule << "expected 0 (no cap) or a number from " << kMinBandwidthGbps << " to "
                   << kMaxBandwidthGbps << " GB/s, got " << d
                   << " (a slower link would take hours to emulate a load)";
              config_rule(rule.str());
            }
            c.host.bandwidth_gbps = d;
          },
          [](const LoadConfig& c) { return nlohmann::json(c.host.bandwidth_gbps); }};
}

// "PORT" or "ADDRESS:PORT", kept as ADDRESS:PORT; "" = off.
ConfigKey metrics_listen_key() {
  return {"metrics.listen",
          "serve Prometheus metrics at ADDRESS:PORT (PORT: 127.0.0.1); \"\" = off",
          [] { return std::string("string (PORT or ADDRESS:PORT)"); },
          [](const KeyInput* in, LoadConfig& c) {
            if (in != nullptr) {
              const std::string text = as_string(*in);
              c.metrics.listen = text.empty() ? text : metrics_bind_address(text);
            }
          },
          [](const LoadConfig& c) { return nlohmann::json(c.metrics.listen); }};
}

// ---- the table ------------------------------------------------------------------------

using C = LoadConfig;

const std::vector<ConfigKey>& table() {
  static const std::vector<ConfigKey> rows = {
      string_key<&C::model, &ModelConfig::path>(
          "model.path", "the checkpoint folder (or one of its files); \"\" = none given"),
      choice_key<&C::model, &ModelConfig::load_format, kLoadFormats>(
          "model.load_format",
          "which files are weights; pt: *.pt; gguf: one llama.cpp GGUF file (model.path may "
          "name it); dummy: none, values from config.json; presharded: a folder "
          "`ferry save` wrote; sharded_state: SGLang's model-rank-<r>-part-<p>.safetensors; "
          "ipc_cache: map a `ferry serve` daemon's params; remote_instance: pull them from "
          "a seed (remote.seed) over UCX"),
      choice_key<&C::model, &ModelConfig::dtype, kDTypes>(
          "model.dtype", "parameter dtype; auto: the checkpoint's torch_dtype"),
      bool_key<&C::model, &ModelConfig::draft>(
          "model.draft", "load the draft (MTP) model's weights instead of the target's"),
      bool_key<&C::model, &ModelConfig::switch_w13>(
          "model.switch_w13", "swap the gate (w1) and up (w3) halves of fused MLPs"),
      string_key<&C::model, &ModelConfig::eplb_map>(
          "model.eplb_map", "expert-placement (EPLB) map file; \"\" = identity"),
      fuse_shared_experts_key(),
      int_key<&C::model, &ModelConfig::pad_moe_intermediate_to, 0, 1 << 20>(
          "model.pad_moe_intermediate_to", "round the MoE intermediate size up to this; 0 = off"),
      int_key<&C::model, &ModelConfig::dummy_seed, 0, std::numeric_limits<std::int64_t>::max()>(
          "model.dummy_seed", "load_format dummy: the seed of every parameter's values"),
      choice_key<&C::model, &ModelConfig::unaligned_tp, kUnaligned>(
          "model.unaligned_tp", "sizes tp does not divide: refuse (SGLang's GPU path) or pad"),
      bool_key<&C::gguf, &GgufConfig::dequantize>(
          "gguf.dequantize",
          "dequantize quantized GGUF tensors (Q8_0, Q4_K, ...) on the device; off: refused"),
      choice_key<&C::quantization, &QuantizationConfig::requant, kRequants>(
          "quantization.requant", "convert an FP8 block-scaled checkpoint's scales after loading"),
      choice_key<&C::quantization, &QuantizationConfig::online, kOnline>(
          "quantization.online", "quantize a full-precision checkpoint to FP8 while loading"),
      choice_key<&C::postprocess, &PostprocessConfig::target, kTargets>(
          "postprocess.target", "the layout SGLang leaves on that GPU; auto: the first device's"),
      int_key<&C::parallel, &ParallelConfig::tp, 1, kMaxParallel>("parallel.tp",
                                                                  "tensor-parallel size"),
      int_key<&C::parallel, &ParallelConfig::ep, 1, kMaxParallel>(
          "parallel.ep", "expert-parallel size; divides parallel.tp"),
      int_key<&C::parallel, &ParallelConfig::pp, 1, kMaxParallel>(
          "parallel.pp", "pipeline-parallel size; one stage is loaded per process"),
      int_key<&C::parallel, &ParallelConfig::pp_rank, 0, kMaxParallel>(
          "parallel.pp_rank", "the pipeline stage this process loads"),
      pp_partition_key(),
      ranks_key(),
      int_key<&C::parallel, &ParallelConfig::attn_dp, 1, kMaxParallel>(
          "parallel.attn_dp", "attention data parallelism (attention tp = tp / attn_dp); 1 = off"),
      bool_key<&C::parallel, &ParallelConfig::dp_lm_head>(
          "parallel.dp_lm_head", "lm_head over the attention tp group; needs attn_dp > 1"),
      moe_dense_tp_key(),
      choice_key<&C::parallel, &ParallelConfig::moe_a2a_deepep, kMoeA2a>(
          "parallel.moe_a2a", "deepep: shared experts whole on every rank; needs ep = tp"),
      devices_key(),
      choice_key<&C::io, &IoConfig::engine, kEngines>(
          "io.engine", "reader: uring (falls back to pread) or pread"),
      int_key<&C::io, &IoConfig::read_lanes, 0, 64>("io.read_lanes",
                                                    "reader threads; 0 = auto (by the devices)"),
      int_key<&C::io, &IoConfig::queue_depth, 1, 32768>("io.queue_depth",
                                                        "reads in flight per lane"),
      int_key<&C::io, &IoConfig::cancel_timeout_ms, 1, 3'600'000>(
          "io.cancel_timeout_ms", "how long a stopped load waits for its cancelled reads"),
      size_key<&C::io, &IoConfig::max_metadata_bytes, kMinMetadataBytes, kMaxMetadataBytes>(
          "io.max_metadata_bytes", "the most bytes of a metadata file ferry reads whole"),
      size_key<&C::io, &IoConfig::staging_bytes, 0, kMaxStagingBytes>(
          "io.staging_bytes", "host staging memory for all lanes together; 0 = auto"),
      chunk_bytes_key(),
      choice_key<&C::io, &IoConfig::direct_to_device, kDirectToDevice>(
          "io.direct_to_device", "reads land in parameters without staging where they can"),
      bool_key<&C::io, &IoConfig::direct>("io.direct", "O_DIRECT reads (skip the page cache)"),
      bool_key<&C::io, &IoConfig::drop_cache>(
          "io.drop_cache", "evict the weight files from the page cache first (cold runs)"),
      bool_key<&C::prefetch, &PrefetchConfig::enabled>(
          "prefetch.enabled", "warm the page cache ahead of the reader, planned ranges only"),
      int_key<&C::prefetch, &PrefetchConfig::threads, 1, 256>("prefetch.threads",
                                                              "prefetch worker threads"),
      size_key<&C::prefetch, &PrefetchConfig::block_bytes, kAlign, kMaxChunkBytes>(
          "prefetch.block_bytes", "one prefetch read"),
      size_key<&C::prefetch, &PrefetchConfig::ahead_bytes, 0,
               std::numeric_limits<std::uint64_t>::max()>(
          "prefetch.ahead_bytes", "how far the prefetch runs ahead of the reader; 0 = no bound"),
      bool_key<&C::load, &LoadOptions::strict>(
          "load.strict", "unmapped or missing tensors are errors rather than warnings"),
      int_key<&C::load, &LoadOptions::sort_weight_files, -1, 1 << 20>(
          "load.sort_weight_files", "file order: 0 bytewise, -1 directory order, k > 0 staggered"),
      string_key<&C::load, &LoadOptions::report>("load.report",
                                                 "write the JSON load report here; \"\" = none"),
      string_key<&C::load, &LoadOptions::dump_dir>(
          "load.dump_dir", "dump the loaded parameters here for debugging; \"\" = none"),
      bool_key<&C::load, &LoadOptions::layered>(
          "load.layered", "free quantization.online's full-precision weights layer by layer"),
      string_key<&C::load, &LoadOptions::save_presharded>(
          "load.save_presharded",
          "after a load, save its ranks as a presharded checkpoint under this folder; \"\" = no"),
      string_key<&C::load, &LoadOptions::save_sharded_state>(
          "load.save_sharded_state",
          "after a load, save each tp rank's params as SGLang's sharded_state files in this "
          "folder; \"\" = no"),
      bool_key<&C::load, &LoadOptions::verify_checksums>(
          "load.verify_checksums", "presharded: check every param's XXH3-128 against the manifest"),
      size_key<&C::save, &SaveConfig::max_file_bytes, kMinSaveFileBytes, kMaxSaveFileBytes>(
          "save.max_file_bytes",
          "the largest file a presharded or sharded_state save writes (one tensor at least)"),
      choice_key<&C::update, &UpdateConfig::rollback, kUpdateRollbacks>(
          "update.rollback",
          "how a failed update is undone, tried first: reread (the old source) or snapshot"),
      size_key<&C::update, &UpdateConfig::rollback_bytes, 0,
               std::numeric_limits<std::uint64_t>::max()>(
          "update.rollback_bytes",
          "the most host memory an update's snapshot of the params it writes may hold"),
      string_key<&C::update, &UpdateConfig::tensor_dir>(
          "update.tensor_dir", "where in-memory update tensors are laid out as a file (a tmpfs)"),
      choice_key<&C::cache, &CacheConfig::mode, kCacheModes>(
          "cache.mode",
          "the weight cache: off, daemon (a `ferry serve` must hold the model) or client "
          "(one does, else load from disk)"),
      choice_key<&C::cache, &CacheConfig::fallback_format, kFallbackFormats>(
          "cache.fallback_format",
          "how a cached load reads the files without a daemon, and the daemon's format"),
      string_key<&C::cache, &CacheConfig::dir>(
          "cache.dir",
          "the daemons' registry; \"\" = $XDG_RUNTIME_DIR/ferry-cache or /tmp/ferry-cache-<uid>"),
      int_key<&C::cache, &CacheConfig::watch_ms, 10, 3'600'000>(
          "cache.watch_ms", "how often a client checks that its daemon still lives"),
      int_key<&C::cache, &CacheConfig::timeout_ms, 100, 3'600'000>(
          "cache.timeout_ms", "how long one connection to a daemon may take"),
      string_key<&C::remote, &RemoteConfig::listen>(
          "remote.listen",
          "`ferry serve`: also serve remote targets on this HOST:PORT (its control port); "
          "\"\" = none"),
      string_key<&C::remote, &RemoteConfig::seed>(
          "remote.seed", "remote_instance: the seed's control port, HOST:PORT"),
      string_key<&C::remote, &RemoteConfig::token_file>(
          "remote.token_file",
          "the secret a seed and its targets share (a file of mode 0600, 16 to 4096 bytes)"),
      size_key<&C::remote, &RemoteConfig::inflight_bytes, std::uint64_t{64} << 10,
               std::uint64_t{64} << 30>("remote.inflight_bytes",
                                        "bytes of UCX gets in flight at once during a pull"),
      int_key<&C::remote, &RemoteConfig::timeout_ms, 100, 3'600'000>(
          "remote.timeout_ms",
          "the control connection's deadline, and how long a pull may see no data"),
      choice_key<&C::remote, &RemoteConfig::fallback_format, kRemoteFallbacks>(
          "remote.fallback_format",
          "how to read the files when the seed cannot be reached at all; none: an error"),
      string_key<&C::remote, &RemoteConfig::transports>(
          "remote.transports",
          "UCX_TLS for the pull (\"\" = UCX's choice; tcp keeps one host's processes on the "
          "network)"),
      bandwidth_key(),
      bool_key<&C::host, &HostConfig::deferred_copies>(
          "host.deferred_copies", "host devices copy later on a thread, as a DMA engine does"),
      bool_key<&C::host, &HostConfig::huge_pages>(
          "host.huge_pages", "large host-device allocations ask for transparent huge pages"),
      size_key<&C::host, &HostConfig::narrow_row_bytes, 0, std::uint64_t{1} << 30>(
          "host.narrow_row_bytes", "gather narrower row slices through device scratch; 0 = never"),
      metrics_listen_key(),
      string_key<&C::metrics, &MetricsConfig::textfile>(
          "metrics.textfile", "write the metrics here after every load; \"\" = none"),
      string_key<&C::trace, &TraceConfig::path>(
          "trace.path", "write a Chrome trace of each load here; \"\" = none"),
      choice_key<&C::startup, &StartupConfig::mode, kStartupModes>(
          "startup.mode", "how prepare()/commit() boot: serial, overlap or auto"),
  };
  return rows;
}

}  // namespace

std::span<const ConfigKey> config_keys() {
  return table();
}

const ConfigKey* find_config_key(std::string_view name) {
  for (const ConfigKey& key : table()) {
    if (key.name == name) {
      return &key;
    }
  }
  return nullptr;
}

std::string_view ConfigKey::section() const {
  const std::size_t dot = name.find('.');
  return dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
}

std::string_view ConfigKey::leaf() const {
  const std::size_t dot = name.find('.');
  return dot == std::string_view::npos ? name : name.substr(dot + 1);
}

std::string ConfigKey::env_name() const {
  std::string out = "FERRY_";
  for (char ch : name) {
    out += ch == '.'
               ? std::string("__")
               : std::string(1, static_cast<char>(std::toupper(static_cast<unsigned char>(ch))));
  }
  return out;
}

nlohmann::json ConfigKey::default_value() const {
  return write(LoadConfig{});
}

// ---- the names load_config.hpp declares -------------------------------------------

std::string_view to_string(StartupMode mode) {
  return name_in(kStartupModes, mode);
}

std::string_view requant_name(models::QuantScheme::Requant requant) {
  return name_in(kRequants, requant);
}

std::string_view to_string(CacheConfig::Mode mode) {
  return name_in(kCacheModes, mode);
}

std::string_view online_name(QuantizationConfig::Online online) {
  return name_in(kOnline, online);
}

std::string_view target_name(const std::optional<models::QuantScheme::Target>& target) {
  return name_in(kTargets, target);
}

}  // namespace ferry::runtime
