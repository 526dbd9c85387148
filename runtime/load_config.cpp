// LoadConfig's layered builder: merging sources key by key, then reading the merged
// keys into the plain struct through the key table (runtime/config_keys.hpp), which
// also makes the set of known keys and to_json, so the schema, the builder and the
// report cannot drift apart. What stays here: the layers, the checks that span
// several keys, and the parsers of sizes, ranks, devices and addresses.
#include "runtime/load_config.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <numeric>
#include <set>
#include <utility>

#include "common/error.hpp"
#include "common/json_depth.hpp"
#include "common/log.hpp"
#include "common/small_file.hpp"
#include "io/file.hpp"
#include "models/hf_config.hpp"
#include "remote/control.hpp"
#include "runtime/config_keys.hpp"

namespace ferry::runtime {
namespace {

constexpr int kMaxCudaOrdinal = 1024;  // keeps "cuda:0-999999999" from allocating

[[noreturn]] void fail(std::string_view source, std::string rule) {
  throw Error(Stage::kConfig, std::string(source), "", std::move(rule));
}

// Known keys, read off the key table: leaves ("io.direct", "devices") and
// sections ("io").
struct Schema {
  std::set<std::string> leaves;
  std::set<std::string> sections;
};

const Schema& schema() {
  static const Schema s = [] {
    Schema out;
    for (const ConfigKey& key : config_keys()) {
      out.leaves.emplace(key.name);
      if (!key.section().empty()) {
        out.sections.emplace(key.section());
      }
    }
    return out;
  }();
  return s;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) {
    row[j] = j;
  }
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// "unknown key 'io.chunk_byte' (did you mean 'io.chunk_bytes'?)" for near misses,
// and "unknown key 'tp' (did you mean 'parallel.tp'?)" for a key without its section.
std::string unknown_key(const std::string& key) {
  // Keys that were removed, with what replaced them.
  static const std::map<std::string, std::string> kRemoved = {
      {"metrics.prometheus_file",
       "it was removed: metrics.textfile writes the metrics after each load (and "
       "metrics.listen serves them)"},
      {"io.staging_buffers",
       "it was replaced by io.staging_bytes, the host staging memory in bytes for all read "
       "lanes together (io.staging_buffers x io.chunk_bytes before; e.g. 8MiB)"},
  };
  if (auto it = kRemoved.find(key); it != kRemoved.end()) {
    return "unknown key '" + key + "': " + it->second;
  }
  std::string rule = "unknown key '" + key + "'";
  std::string best;
  std::size_t best_distance = std::min<std::size_t>(3, (key.size() + 1) / 2);  // typos only
  auto consider = [&](const std::string& candidate) {
    std::size_t d = edit_distance(key, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  };
  for (const auto& k : schema().leaves) {
    consider(k);
  }
  for (const auto& k : schema().sections) {
    consider(k);
  }
  if (key.find('.') == std::string::npos) {
    for (const auto& k : schema().leaves) {
      if (std::size_t dot = k.find('.'); dot != std::string::npos && k.substr(dot + 1) == key) {
        best = k;
      }
    }
  }
  if (!best.empty()) {
    rule += " (did you mean '" + best + "'?)";
  }
  return rule;
}

// The rule for --set and environment values: JSON when the text parses as JSON,
// else the text itself as a string.
nlohmann::json parse_value_text(std::string_view text) {
  if (json_depth(text) > kMaxJsonDepth) {
    return nlohmann::json(std::string(text));  // not a value any key takes: refused by its key
  }
  nlohmann::json value = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (value.is_discarded()) {
    return nlohmann::json(std::string(text));
  }
  return value;
}

// Whether `text` is well-formed UTF-8 (RFC 3629: no overlong forms, surrogates or
// code points past U+10FFFF), which nlohmann requires of every string it writes.
bool valid_utf8(std::string_view text) {
  for (std::size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    std::size_t more = 0;
    std::uint32_t cp = 0;
    if (lead < 0x80) {
      ++i;
      continue;
    }
    if (lead >= 0xC2 && lead <= 0xDF) {
      more = 1;
      cp = lead & 0x1Fu;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      more = 2;
      cp = lead & 0x0Fu;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      more = 3;
      cp = lead & 0x07u;
    } else {
      return false;
    }
    if (text.size() - i <= more) {
      return false;
    }
    for (std::size_t k = 1; k <= more; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      if ((b & 0xC0u) != 0x80u) {
        return false;
      }
      cp = (cp << 6) | (b & 0x3Fu);
    }
    if ((more == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (more == 3 && (cp < 0x10000 || cp > 0x10FFFF))) {
      return false;
    }
    i += more + 1;
  }
  return true;
}

// A non-negative decimal integer made of digits only, at most `limit`.
std::optional<std::uint64_t> parse_digits(std::string_view s, std::uint64_t limit) {
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  std::uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v > limit) {
    return std::nullopt;
  }
  return v;
}

// "0,2", "0-3", "1-2,5": integers in [0, limit) in the order written, no duplicates.
// `what` names an item ("rank", "device"); `prefix` starts every error rule;
// `range_rule` explains the limit.
std::vector<int> parse_int_list(std::string_view text, const std::string& prefix,
                                std::string_view what, int limit, const std::string& range_rule) {
  std::vector<int> out;
  std::set<int> seen;
  auto add = [&](std::uint64_t v) {
    if (v >= static_cast<std::uint64_t>(limit)) {
      fail("", prefix + std::string(what) + " " + std::to_string(v) + " " + range_rule);
    }
    int i = static_cast<int>(v);
    if (!seen.insert(i).second) {
      fail("", prefix + std::string(what) + " " + std::to_string(i) + " is listed twice");
    }
    out.push_back(i);
  };
  std::size_t start = 0;
  while (true) {
    std::size_t comma = text.find(',', start);
    std::string_view item = trim_space(text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (item.empty()) {
      fail("", prefix + "empty item");
    }
    // Digits never exceed INT_MAX here, so comparisons against limit are exact.
    constexpr std::uint64_t kMax = INT_MAX;
    std::size_t dash = item.find('-');
    if (dash == std::string_view::npos) {
      auto v = parse_digits(item, kMax);
      if (!v) {
        fail("", prefix + "'" + std::string(item) + "' is not a " + std::string(what) +
                     " or a range (a-b)");
      }
      add(*v);
    } else {
      auto lo = parse_digits(trim_space(item.substr(0, dash)), kMax);
      auto hi = parse_digits(trim_space(item.substr(dash + 1)), kMax);
      if (!lo || !hi) {
        fail("", prefix + "'" + std::string(item) + "' is not a " + std::string(what) +
                     " or a range (a-b)");
      }
      if (*lo > *hi) {
        fail("", prefix + "reversed range " + std::to_string(*lo) + "-" + std::to_string(*hi));
      }
      if (*hi >= static_cast<std::uint64_t>(limit)) {
        add(*hi);  // reports the out-of-range end before expanding anything
      }
      for (std::uint64_t v = *lo; v <= *hi; ++v) {
        add(v);
      }
    }
    if (comma == std::string_view::npos) {
      break;
    }
    start = comma + 1;
  }
  return out;
}

std::string join(const std::vector<int>& values) {
  std::string out;
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i > 0) {
      out += ",";
    }
    out += std::to_string(values[i]);
  }
  return out;
}

// Why a FERRY_ variable without "__" (and not a key without a section, FERRY_DEVICES)
// is not configuration.
std::string ignored_variable_reason(const std::string& name) {
  std::string rest = name.substr(std::string_view("FERRY_").size());
  std::string lower;
  for (char c : rest) {
    lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (!lower.empty() && schema().sections.count(lower) != 0) {
    return "names the section '" + lower + "', not a key; set its keys one by one (FERRY_" + rest +
           "__<KEY>)";
  }
  return "not a ferry variable (configuration variables are FERRY_ and a key in upper case "
         "with __ for each dot, as FERRY_IO__CHUNK_BYTES)";
}

}  // namespace

// "NAME=value" entries (as environ) -> name -> value; entries without '=' are skipped.
std::map<std::string, std::string> env_map(const char* const* envp) {
  std::map<std::string, std::string> env;
  for (; envp != nullptr && *envp != nullptr; ++envp) {
    std::string_view entry(*envp);
    std::size_t eq = entry.find('=');
    if (eq != std::string_view::npos) {
      env.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
    }
  }
  return env;
}

// ---- ConfigBuilder -----------------------------------------------------------

void ConfigBuilder::set_key(const std::string& key, const nlohmann::json& value,
                            const KeyOrigin& origin, const std::optional<std::string>& text) {
  if (schema().sections.count(key) != 0) {
    if (!value.is_object()) {
      fail(origin.source, key + ": expected an object, got " + value.dump());
    }
    for (const auto& [sub, sub_value] : value.items()) {
      set_key(key + "." + sub, sub_value, origin, std::nullopt);
    }
    return;
  }
  if (schema().leaves.count(key) == 0) {
    fail(origin.source, unknown_key(key));
  }
  entries_[key] = Entry{value, origin, text};
}

void ConfigBuilder::apply_json(const nlohmann::json& object, std::string_view source) {
  if (!object.is_object()) {
    fail(source, "expected a JSON object at the top level, got " + object.dump());
  }
  const KeyOrigin origin{ConfigLayer::kFile, std::string(source)};
  for (const auto& [key, value] : object.items()) {
    set_key(key, value, origin, std::nullopt);
  }
}

void ConfigBuilder::apply_json_text(std::string_view text, std::string_view source) {
  if (json_depth(text) > kMaxJsonDepth) {
    fail(source, json_too_deep_rule());
  }
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {  // out_of_range too: "1e400"
    fail(source, std::string("not valid JSON: ") + e.what());
  }
  apply_json(object, source);
}

void ConfigBuilder::apply_file(const std::filesystem::path& path) {
  // Read with the default cap: io.max_metadata_bytes is not known before the file is.
  apply_json_text(read_small_file(path.string(), Stage::kConfig, kDefaultMaxMetadataBytes,
                                  "the config file"),
                  path.string());
}

void ConfigBuilder::apply_text(std::string_view key, std::string_view text,
                               const KeyOrigin& origin) {
  // Environment and command-line bytes are not checked by any JSON parser, and
  // nlohmann throws when it writes a string that is not UTF-8 (in errors, reports).
  if (!valid_utf8(text)) {
    fail(origin.source, std::string(key) + ": the value is not valid UTF-8");
  }
  set_key(std::string(key), parse_value_text(text), origin, std::string(text));
}

void ConfigBuilder::apply_env(const std::map<std::string, std::string>& env) {
  constexpr std::string_view kPrefix = "FERRY_";
  for (const auto& [name, value] : env) {
    if (name.rfind(kPrefix, 0) != 0 ||
        std::find(kNonConfigVariables.begin(), kNonConfigVariables.end(), name) !=
            kNonConfigVariables.end()) {
      continue;
    }
    const KeyOrigin origin{ConfigLayer::kEnvironment, "environment " + name};
    const std::string& source = origin.source;
    const std::string& variable = name;  // clang 14 captures no structured binding
    const bool sectionless_key = std::any_of(
        config_keys().begin(), config_keys().end(),
        [&](const ConfigKey& key) { return key.section().empty() && key.env_name() == variable; });
    if (name.find("__") == std::string::npos && !sectionless_key) {
      // Not a configuration variable: wrappers set their own FERRY_ names.
      warnings_.push_back(source + ": " + ignored_variable_reason(name) + "; ignored");
      continue;
    }
    std::string_view rest = std::string_view(name).substr(kPrefix.size());
    std::string key;
    for (std::size_t i = 0; i < rest.size(); ++i) {
      char c = rest[i];
      if (!(std::isupper(static_cast<unsigned char>(c)) != 0 ||
            std::isdigit(static_cast<unsigned char>(c)) != 0 || c == '_')) {
        fail(source,
             "not a configuration variable: they are FERRY_ and the key in upper case "
             "with __ for each dot (FERRY_IO__CHUNK_BYTES is io.chunk_bytes)");
      }
      if (c == '_' && i + 1 < rest.size() && rest[i + 1] == '_') {
        key += '.';
        ++i;
      } else {
        key += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      }
    }
    apply_text(key, value, origin);
  }
}

void ConfigBuilder::apply_env(const char* const* envp) {
  apply_env(env_map(envp));
}

void ConfigBuilder::apply_set(std::string_view assignment) {
  std::size_t eq = assignment.find('=');
  if (eq == std::string_view::npos) {
    fail("--set " + std::string(assignment), "expected key=value");
  }
  std::string key(trim_space(assignment.substr(0, eq)));
  if (key.empty()) {
    fail("--set " + std::string(assignment), "expected key=value (the key is empty)");
  }
  apply_text(key, assignment.substr(eq + 1), KeyOrigin{ConfigLayer::kSet, "--set " + key});
}

void ConfigBuilder::apply_flag(std::string_view flag, std::string_view key, std::string_view text) {
  apply_text(key, text, KeyOrigin{ConfigLayer::kFlag, std::string(flag)});
}

void ConfigBuilder::apply_flag_value(std::string_view flag, std::string_view key,
                                     const nlohmann::json& value) {
  set_key(std::string(key), value, KeyOrigin{ConfigLayer::kFlag, std::string(flag)},
          std::nullopt);
}

KeyOrigin ConfigBuilder::origin(std::string_view key) const {
  auto it = entries_.find(std::string(key));
  return it == entries_.end() ? KeyOrigin{} : it->second.origin;
}

std::string_view to_string(ConfigLayer layer) {
  constexpr std::array<std::string_view, 5> kNames = {"default", "file", "environment", "--set",
                                                      "flag"};
  return kNames.at(static_cast<std::size_t>(layer));
}

IoAuto io_auto(DeviceSpec::Kind kind, std::size_t local_devices) {
  const std::size_t n = std::max<std::size_t>(1, local_devices);
  if (kind != DeviceSpec::Kind::kCuda) {
    return {std::size_t{1} << 20, (std::size_t{8} << 20) * n, 4, true};
  }
  return {std::size_t{16} << 20, std::min((std::size_t{256} << 20) * n, std::size_t{1} << 30),
          static_cast<unsigned>(std::min<std::size_t>(16, 8 * n)), false};
}

namespace {

// "key: rule", unless the rule already starts with the key ("devices cuda:0 gives ...",
// "io.direct_to_device=on with ...").
std::string keyed(std::string_view key, const std::string& rule) {
  if (rule.rfind(key, 0) == 0 && rule.size() > key.size() &&
      std::string_view(" :=").find(rule[key.size()]) != std::string_view::npos) {
    return rule;
  }
  return std::string(key) + ": " + rule;
}

}  // namespace

LoadConfig ConfigBuilder::build(Rules rules) const {
  LoadConfig c;
  std::string_view section;
  for (const ConfigKey& key : config_keys()) {
    if (section == "parallel" && key.section() != section) {
      // The rows below place the local ranks (devices, auto sizes): the layout's own
      // rules come first, so that an error names its cause (an ep that does not
      // divide tp, not a device count that does not match).
      check_parallel_rules(c);
    }
    section = key.section();
    const std::string name(key.name);
    const auto it = entries_.find(name);
    const Entry* e = it == entries_.end() ? nullptr : &it->second;
    const std::string source = e == nullptr ? KeyOrigin{}.source : e->origin.source;
    if (e != nullptr) {
      // Every key is read through here, so this is the one place a NUL is refused: the
      // C calls a path reaches would end it at the NUL ("rep.json\u0000.evil" wrote
      // rep.json), and no path, name, mode or size holds one.
      const std::string* text = e->value.is_string() ? e->value.get_ptr<const std::string*>()
                                : e->text.has_value() ? &*e->text
                                                      : nullptr;
      if (text != nullptr && text->find('\0') != std::string::npos) {
        fail(source, name + ": contains a NUL byte (\\u0000), which no path, name or mode may "
                            "hold: " + json_quoted(*text));
      }
    }
    try {
      if (e != nullptr) {
        const KeyInput input{e->value, e->text};
        key.read(&input, c);
      } else {
        key.read(nullptr, c);
      }
    } catch (const Error& err) {
      fail(source, keyed(name, err.rule()));
    }
  }
  if (section == "parallel") {
    check_parallel_rules(c);
  }
  check_across_keys(c, rules);
  return c;
}

// A rule that spans several keys, broken: the error names the key it is charged to
// and that key's source.
void ConfigBuilder::refuse(std::string_view key, const std::string& rule) const {
  fail(origin(key).source, keyed(key, rule));
}

void ConfigBuilder::check_parallel_rules(const LoadConfig& c) const {
  const ParallelConfig& p = c.parallel;
  if (p.tp % p.ep != 0) {
    refuse("parallel.ep", "expected a divisor of parallel.tp " + std::to_string(p.tp) + ", got " +
                              std::to_string(p.ep));
  }
  if (p.pp_rank >= p.pp) {
    refuse("parallel.pp_rank", "expected 0 to " + std::to_string(p.pp - 1) + " (parallel.pp " +
                                   std::to_string(p.pp) + "), got " + std::to_string(p.pp_rank));
  }
  if (!p.pp_partition.empty() && p.pp_partition.size() != static_cast<std::size_t>(p.pp)) {
    refuse("parallel.pp_partition", "expected one layer count per stage (parallel.pp " +
                                        std::to_string(p.pp) + "), got " +
                                        std::to_string(p.pp_partition.size()));
  }
  if (p.tp % p.attn_dp != 0) {
    refuse("parallel.attn_dp", "expected a divisor of parallel.tp " + std::to_string(p.tp) +
                                   " (attention tp = tp / attn_dp), got " +
                                   std::to_string(p.attn_dp));
  }
  if (p.dp_lm_head && p.attn_dp == 1) {
    refuse("parallel.dp_lm_head",
           "splits lm_head over the attention tp group and needs parallel.attn_dp > 1");
  }
  if (p.moe_a2a_deepep && p.ep != p.tp) {
    refuse("parallel.moe_a2a", "deepep runs experts with ep = tp (SGLang sets ep_size to "
                               "tp_size); set parallel.ep " +
                                   std::to_string(p.tp));
  }
}

void ConfigBuilder::check_across_keys(const LoadConfig& c, Rules rules) const {
  constexpr std::uint64_t kAlign = io::kDirectAlignment;
  if (c.io.staging_bytes != 0) {
    const std::uint64_t buffer = (c.io.chunk_bytes + kAlign - 1) / kAlign * kAlign;
    if (c.io.staging_bytes < buffer) {
      refuse("io.staging_bytes", "must hold at least one io.chunk_bytes buffer (" +
                                     std::to_string(buffer) + " bytes), got " +
                                     std::to_string(c.io.staging_bytes) +
                                     " (0 means auto: 8 MiB per local host device, 256 MiB "
                                     "per GPU up to 1 GiB)");
    }
  }
  if (c.io.direct && c.io.chunk_bytes % kAlign != 0) {
    refuse("io.chunk_bytes", "with io.direct it must be a multiple of " + std::to_string(kAlign) +
                                 ", got " + std::to_string(c.io.chunk_bytes));
  }
  if (c.update.tensor_dir.empty()) {
    refuse("update.tensor_dir", "must name a folder (a tmpfs such as /dev/shm)");
  }
  if (!c.load.dump_dir.empty() && c.devices.kind == DeviceSpec::Kind::kNull) {
    refuse("load.dump_dir", "devices " + to_string(c.devices) +
                                " keep no parameter data, so there is nothing to dump");
  }
  if (!c.load.save_presharded.empty() && c.devices.kind == DeviceSpec::Kind::kNull) {
    refuse("load.save_presharded", "devices " + to_string(c.devices) +
                                       " keep no parameter data, so there is nothing to save");
  }
  if (!c.load.save_sharded_state.empty() && c.devices.kind == DeviceSpec::Kind::kNull) {
    refuse("load.save_sharded_state", "devices " + to_string(c.devices) +
                                          " keep no parameter data, so there is nothing to save");
  }
  if (c.load.verify_checksums && c.devices.kind == DeviceSpec::Kind::kNull) {
    refuse("load.verify_checksums", "devices " + to_string(c.devices) +
                                        " keep no parameter data, so there is nothing to check");
  }
  if (rules == Rules::kAll) {
    if (std::optional<BrokenRule> broken = broken_load_rule(c)) {
      refuse(broken->key, broken->rule);
    }
  }
}

std::vector<int> local_tp_ranks(const LoadConfig& c) {
  if (!c.parallel.ranks.empty()) {
    return c.parallel.ranks;
  }
  std::vector<int> all(static_cast<std::size_t>(c.parallel.tp));
  for (std::size_t i = 0; i < all.size(); ++i) {
    all[i] = static_cast<int>(i);
  }
  return all;
}

std::optional<BrokenRule> broken_load_rule(const LoadConfig& c) {
  if (c.model.load_format == io::LoadFormat::kRemoteInstance) {
    if (c.remote.seed.empty()) {
      return BrokenRule{"remote.seed",
                        "model.load_format remote_instance pulls from a seed: set remote.seed "
                        "to its control port, HOST:PORT (`ferry serve --remote`)"};
    }
    if (c.remote.token_file.empty()) {
      return BrokenRule{"remote.token_file",
                        "model.load_format remote_instance: set remote.token_file to the "
                        "secret the seed was given"};
    }
    if (c.cache.mode != CacheConfig::Mode::kOff) {
      return BrokenRule{"cache.mode",
                        "model.load_format remote_instance with the weight cache: a load "
                        "either maps a local daemon's parameters or pulls a seed's, not both"};
    }
    if (c.devices.kind == DeviceSpec::Kind::kNull) {
      return BrokenRule{"model.load_format",
                        "remote_instance with devices " + to_string(c.devices) +
                            ": they keep no data, there is nothing to pull into"};
    }
    if (!c.load.save_presharded.empty() || !c.load.save_sharded_state.empty()) {
      return BrokenRule{"model.load_format",
                        "remote_instance with load.save_presharded / load.save_sharded_state: "
                        "save from the seed, or from a disk load"};
    }
  }
  for (const auto& [key, value] :
       {std::pair<const char*, const std::string*>{"remote.seed", &c.remote.seed},
        {"remote.listen", &c.remote.listen}}) {
    if (!value->empty()) {
      try {
        remote::parse_host_port(*value, key, std::string_view(key) == "remote.listen");
      } catch (const Error& e) {
        return BrokenRule{key, e.rule()};
      }
    }
  }
  const bool cached =
      c.cache.mode != CacheConfig::Mode::kOff || c.model.load_format == io::LoadFormat::kIpcCache;
  if (c.cache.mode != CacheConfig::Mode::kOff && c.model.load_format != io::LoadFormat::kAuto &&
      c.model.load_format != io::LoadFormat::kIpcCache &&
      c.model.load_format != c.cache.fallback_format) {
    return BrokenRule{"model.load_format",
                      "a cached load (cache.mode " + std::string(to_string(c.cache.mode)) +
                          ") reads from disk, when it does, with cache.fallback_format: leave "
                          "model.load_format auto and set cache.fallback_format"};
  }
  if (cached && c.devices.kind == DeviceSpec::Kind::kNull) {
    return BrokenRule{"cache.mode", "devices " + to_string(c.devices) +
                                        " keep no data: there is nothing to map a daemon's "
                                        "parameters into"};
  }
  if (c.load.verify_checksums && c.model.load_format != io::LoadFormat::kPresharded) {
    return BrokenRule{"load.verify_checksums",
                      "load.verify_checksums checks a presharded folder against its manifest: "
                      "set model.load_format=presharded, or turn it off"};
  }
  if (!c.load.save_presharded.empty() && c.model.load_format == io::LoadFormat::kDummy) {
    return BrokenRule{"load.save_presharded",
                      "load.save_presharded with model.load_format dummy: dummy values are "
                      "not a checkpoint to save"};
  }
  if (!c.load.save_sharded_state.empty() && c.model.load_format == io::LoadFormat::kDummy) {
    return BrokenRule{"load.save_sharded_state",
                      "load.save_sharded_state with model.load_format dummy: dummy values are "
                      "not a checkpoint to save"};
  }
  if (!c.load.save_sharded_state.empty() && c.model.load_format == io::LoadFormat::kShardedState) {
    return BrokenRule{"load.save_sharded_state",
                      "load.save_sharded_state with model.load_format sharded_state: the load "
                      "reads a sharded_state folder already; copy its files instead"};
  }
  if (c.load.layered && c.quantization.online == QuantizationConfig::Online::kNone) {
    return BrokenRule{
        "load.layered",
        "load.layered frees load-only parameters as soon as they are used, and only "
        "quantization.online makes any: set quantization.online, or turn layered off"};
  }
  if (c.load.layered && c.model.load_format == io::LoadFormat::kDummy) {
    return BrokenRule{"load.layered",
                      "load.layered with model.load_format dummy: a dummy load fills every "
                      "parameter at once, there is no stream to follow layer by layer"};
  }
  if (c.load.layered && c.io.direct_to_device == io::DirectToDevice::kOn) {
    return BrokenRule{"io.direct_to_device",
                      "io.direct_to_device=on with load.layered: a load-only param has no "
                      "storage until its copy worker's first write, so no read can land in it"};
  }
  if (c.prefetch.enabled && c.io.direct) {
    return BrokenRule{"prefetch.enabled",
                      "prefetch.enabled with io.direct: refused, because O_DIRECT reads bypass "
                      "the page cache the prefetch warms (turn one of them off)"};
  }
  return std::nullopt;
}

// ---- load_config ---------------------------------------------------------------

ConfigBuilder apply_sources(const ConfigSources& sources,
                            const std::map<std::string, std::string>& env) {
  ConfigBuilder b;
  if (!sources.config_file.empty()) {
    b.apply_file(sources.config_file);
  } else if (!sources.default_json.empty()) {
    b.apply_json_text(sources.default_json, sources.default_json_name);
  }
  b.apply_env(env);
  for (const auto& s : sources.sets) {
    b.apply_set(s);
  }
  for (const auto& flag : sources.flags) {
    b.apply_flag(flag.flag, flag.key, flag.value);
  }
  return b;
}

LoadConfig load_config(const ConfigSources& sources,
                       const std::map<std::string, std::string>& env) {
  const ConfigBuilder b = apply_sources(sources, env);
  for (const std::string& w : b.warnings()) {
    log::warn("config: " + w);
  }
  return b.build();
}

LoadConfig load_config(const ConfigSources& sources, const char* const* envp) {
  return load_config(sources, env_map(envp));
}

// ---- to_json -------------------------------------------------------------------

nlohmann::json to_json(const LoadConfig& c) {
  nlohmann::json out = nlohmann::json::object();
  for (const ConfigKey& key : config_keys()) {
    if (key.section().empty()) {
      out[std::string(key.name)] = key.write(c);
    } else {
      out[std::string(key.section())][std::string(key.leaf())] = key.write(c);
    }
  }
  return out;
}

namespace {

// RFC 1123 host names: dot-separated labels of 1-63 letters, digits and '-', not
// starting or ending with '-', 253 characters at most. The last label must not be all
// digits, so that "999.1.1.1" (which civetweb would read as 231.1.1.1, each number
// taken modulo 256) is judged as an IPv4 address, and refused, rather than as a name.
bool valid_host_name(std::string_view name) {
  if (name.empty() || name.size() > 253) {
    return false;
  }
  std::string_view last;
  while (true) {
    const std::size_t dot = name.find('.');
    const std::string_view label = name.substr(0, dot);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char ch : label) {
      if (std::isalnum(static_cast<unsigned char>(ch)) == 0 && ch != '-') {
        return false;
      }
    }
    last = label;
    if (dot == std::string_view::npos) {
      break;
    }
    name.remove_prefix(dot + 1);
  }
  return last.find_first_not_of("0123456789") != std::string_view::npos;
}

bool valid_ip(int family, const std::string& text) {
  unsigned char buf[sizeof(struct in6_addr)];
  return ::inet_pton(family, text.c_str(), buf) == 1;
}

}  // namespace

std::string metrics_bind_address(const std::string& text) {
  const std::string expected =
      "expected PORT or ADDRESS:PORT (ADDRESS an IPv4 address, an IPv6 address in brackets "
      "such as [::1], or a host name; port 0-65535; 0 picks a free one), got " +
      json_quoted(text);
  std::string host = "127.0.0.1";
  std::string port = text;
  bool ipv6 = false;
  if (!text.empty() && text.front() == '[') {
    const std::size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      throw Error(Stage::kConfig, "", "", expected);
    }
    host = text.substr(0, close + 1);
    port = text.substr(close + 2);
    ipv6 = true;
  } else if (const std::size_t colon = text.rfind(':'); colon != std::string::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != std::string::npos) {
      throw Error(Stage::kConfig, "", "",
                  "an IPv6 address goes in brackets, as in [::1]:9400; " + expected);
    }
  }
  const bool digits = !port.empty() && port.size() <= 5 &&
                      port.find_first_not_of("0123456789") == std::string::npos;
  if (host.empty() || !digits || std::stoul(port) > 65535) {
    throw Error(Stage::kConfig, "", "", expected);
  }
  if (ipv6) {
    if (!valid_ip(AF_INET6, host.substr(1, host.size() - 2))) {
      throw Error(Stage::kConfig, "", "",
                  "the address " + json_quoted(host) +
                      " is not an IPv6 address (inet_pton refused it); " + expected);
    }
  } else if (!valid_ip(AF_INET, host) && !valid_host_name(host)) {
    throw Error(Stage::kConfig, "", "",
                "the address " + json_quoted(host) +
                    " is neither an IPv4 address (four numbers 0-255, inet_pton) nor a host "
                    "name (RFC 1123: dot-separated labels of letters, digits and '-', the last "
                    "not all digits); " +
                    expected);
  }
  return host + ":" + port;
}

// ---- sizes, ranks, devices -------------------------------------------------------

std::uint64_t parse_size(const nlohmann::json& value) {
  const std::string expected =
      "expected a size: a number of bytes, or a number with B, KiB, MiB, GiB, KB, MB or GB, got ";
  if (auto bytes = models::json_non_negative(value)) {
    return *bytes;
  }
  if (value.is_number() && value.get<double>() < 0) {
    fail("", "expected a non-negative size, got " + value.dump());
  }
  if (value.is_number_float()) {
    // JSON reads 1e9 as a float; it is still a number of bytes. 2^64 is exact in a double.
    double d = value.get<double>();
    if (d >= 18446744073709551616.0) {
      fail("", value.dump() + " is too large (at most 2^64 - 1 bytes)");
    }
    if (d != static_cast<double>(static_cast<std::uint64_t>(d))) {
      fail("", value.dump() + " is not a whole number of bytes");
    }
    return static_cast<std::uint64_t>(d);
  }
  if (!value.is_string()) {
    fail("", expected + value.dump());
  }
  const std::string& original = value.get_ref<const std::string&>();
  std::string_view s = trim_space(original);
  auto is_digit = [](char ch) { return ch >= '0' && ch <= '9'; };
  std::size_t i = 0;
  while (i < s.size() && is_digit(s[i])) {
    ++i;
  }
  std::string_view whole = s.substr(0, i);
  std::string_view fraction;
  if (i < s.size() && s[i] == '.') {
    std::size_t start = ++i;
    while (i < s.size() && is_digit(s[i])) {
      ++i;
    }
    fraction = s.substr(start, i - start);
    if (fraction.empty()) {
      fail("", expected + value.dump());
    }
  }
  if (whole.empty()) {
    fail("", expected + value.dump());
  }
  std::string_view unit = trim_space(s.substr(i));
  static const std::pair<std::string_view, std::uint64_t> kUnits[] = {
      {"", 1},
      {"B", 1},
      {"KiB", std::uint64_t{1} << 10},
      {"MiB", std::uint64_t{1} << 20},
      {"GiB", std::uint64_t{1} << 30},
      {"KB", 1000},
      {"MB", 1000 * 1000},
      {"GB", 1000 * 1000 * 1000},
  };
  const auto* found = std::find_if(std::begin(kUnits), std::end(kUnits),
                                   [&](const auto& u) { return u.first == unit; });
  if (found == std::end(kUnits)) {
    fail("", expected + value.dump());
  }
  while (!fraction.empty() && fraction.back() == '0') {
    fraction.remove_suffix(1);  // "1.50GiB" is "1.5GiB"
  }
  // mantissa = whole and fraction digits as one integer; bytes = mantissa * unit / 10^f.
  const std::string too_large = value.dump() + " is too large (at most 2^64 - 1 bytes)";
  std::uint64_t mantissa = 0;
  std::uint64_t scale = 1;
  for (char ch : std::string(whole) + std::string(fraction)) {
    if (__builtin_mul_overflow(mantissa, std::uint64_t{10}, &mantissa) ||
        __builtin_add_overflow(mantissa, static_cast<std::uint64_t>(ch - '0'), &mantissa)) {
      fail("", too_large);
    }
  }
  for (std::size_t k = 0; k < fraction.size(); ++k) {
    if (__builtin_mul_overflow(scale, std::uint64_t{10}, &scale)) {
      fail("", value.dump() + " has too many decimals");
    }
  }
  std::uint64_t scaled = 0;
  if (__builtin_mul_overflow(mantissa, found->second, &scaled)) {
    fail("", too_large);
  }
  if (scaled % scale != 0) {
    fail("", value.dump() + " is not a whole number of bytes");
  }
  return scaled / scale;
}

std::vector<int> parse_ranks(std::string_view text, int tp) {
  if (tp < 1) {
    fail("", "parallel.tp must be at least 1, got " + std::to_string(tp));
  }
  if (trim_space(text).empty()) {
    std::vector<int> all(static_cast<std::size_t>(tp));
    for (int r = 0; r < tp; ++r) {
      all[static_cast<std::size_t>(r)] = r;
    }
    return all;
  }
  return parse_int_list(text, "parallel.ranks " + json_quoted(text) + ": ", "rank", tp,
                        "is out of range for parallel.tp " + std::to_string(tp) + " (0.." +
                            std::to_string(tp - 1) + ")");
}

DeviceSpec resolve_devices(std::string_view spec, std::span<const int> local_ranks) {
  const std::vector<int> ranks(local_ranks.begin(), local_ranks.end());
  const std::size_t n = ranks.size();
  std::string_view s = trim_space(spec);
  const std::string prefix = "devices " + json_quoted(s) + ": ";
  auto check_count = [&](std::size_t given) {
    if (given != n) {
      fail("", "devices " + std::string(s) + " gives " + std::to_string(given) +
                   (given == 1 ? " device" : " devices") + " for " + std::to_string(n) +
                   (n == 1 ? " local rank" : " local ranks") + " (" + join(ranks) + ")");
    }
  };
  if (n == 0) {
    fail("", "devices: no local ranks to place");
  }
  DeviceSpec out;
  // "" / host / host:N and null / null:N: one device per local rank, numbered from 0.
  const std::string_view backend = s.substr(0, s.find(':'));
  if (s.empty() || backend == "host" || backend == "null") {
    if (backend.size() < s.size()) {
      auto count = parse_digits(trim_space(s.substr(backend.size() + 1)), INT_MAX);
      if (!count || *count == 0) {
        fail("", prefix + "expected " + std::string(backend) + ":N with N the number of " +
                     std::string(backend) + " devices (at least 1)");
      }
      check_count(*count);
    }
    out.kind = backend == "null" ? DeviceSpec::Kind::kNull : DeviceSpec::Kind::kHost;
    out.ids.resize(n);
    std::iota(out.ids.begin(), out.ids.end(), 0);
    return out;
  }
  constexpr std::string_view kCuda = "cuda:";
  if (s.rfind(kCuda, 0) == 0) {
    out.kind = DeviceSpec::Kind::kCuda;
    out.ids = parse_int_list(
        s.substr(kCuda.size()), prefix, "device", kMaxCudaOrdinal,
        "is not a CUDA device ordinal (0.." + std::to_string(kMaxCudaOrdinal - 1) + ")");
    check_count(out.ids.size());
    return out;
  }
  if (s == "cuda") {
    fail("", prefix + "name one CUDA device per local rank, e.g. cuda:0,1");
  }
  fail("", prefix + "expected host, host:N, null, null:N or cuda:<ids> (e.g. cuda:0,2)");
}

std::string to_string(const DeviceSpec& spec) {
  if (spec.kind == DeviceSpec::Kind::kHost) {
    return "host:" + std::to_string(spec.ids.size());
  }
  if (spec.kind == DeviceSpec::Kind::kNull) {
    return "null:" + std::to_string(spec.ids.size());
  }
  return "cuda:" + join(spec.ids);
}

}  // namespace ferry::runtime
