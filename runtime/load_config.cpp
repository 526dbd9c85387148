// LoadConfig's layered builder: merging sources key by key, then validating the
// merged keys into the plain struct. The set of known keys is to_json's output for
// the in-code defaults, so the schema and the report cannot drift apart.
#include "runtime/load_config.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <fstream>
#include <iterator>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "common/error.hpp"
#include "common/json_depth.hpp"
#include "common/log.hpp"
#include "common/small_file.hpp"
#include "models/postprocess.hpp"

namespace ferry::runtime {
namespace {

constexpr std::string_view kDefaultsSource = "defaults";
constexpr int kMaxParallel = 4096;     // tp, ep, pp: far beyond any deployment
constexpr int kMaxCudaOrdinal = 1024;  // keeps "cuda:0-999999999" from allocating
constexpr std::uint64_t kMaxChunkBytes = std::uint64_t{1} << 30;     // a read returns < 2 GiB
constexpr std::uint64_t kMaxStagingBytes = std::uint64_t{64} << 30;  // staging for all lanes
// io.max_metadata_bytes: a config.json is a few KiB, the largest indexes tens of MB.
constexpr std::uint64_t kMinMetadataBytes = std::uint64_t{64} << 10;
constexpr std::uint64_t kMaxMetadataBytes = std::uint64_t{4} << 30;
constexpr std::uint64_t kDirectAlign = 4096;
// host.bandwidth_gbps, when not 0: 10 MB/s to 10 TB/s, around every link there is
// (PCIe 1.0 x1 moves 0.25 GB/s); 1e-300 made a load that never finished.
constexpr double kMinBandwidthGbps = 0.01;
constexpr double kMaxBandwidthGbps = 10000;

[[noreturn]] void fail(std::string_view source, std::string rule) {
  throw Error(Stage::kConfig, std::string(source), "", std::move(rule));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())) != 0) {
    s.remove_prefix(1);
  }
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())) != 0) {
    s.remove_suffix(1);
  }
  return s;
}

std::string json_quoted(std::string_view text) {
  return nlohmann::json(std::string(text)).dump();
}

// Known keys, read off to_json(LoadConfig{}): leaves ("io.direct", "devices") and
// sections ("io").
struct Schema {
  std::set<std::string> leaves;
  std::set<std::string> sections;
};

const Schema& schema() {
  static const Schema s = [] {
    Schema out;
    const nlohmann::json defaults = to_json(LoadConfig{});  // outlives the loop below
    for (const auto& [key, value] : defaults.items()) {
      if (value.is_object()) {
        out.sections.insert(key);
        for (const auto& [sub, unused] : value.items()) {
          out.leaves.insert(key + "." + sub);
        }
      } else {
        out.leaves.insert(key);
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

// A JSON integer >= 0, whether stored signed (built in code) or unsigned (parsed).
std::optional<std::uint64_t> as_non_negative(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    return v.get<std::uint64_t>();
  }
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  }
  return std::nullopt;
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
    std::string_view item = trim(text.substr(
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
      auto lo = parse_digits(trim(item.substr(0, dash)), kMax);
      auto hi = parse_digits(trim(item.substr(dash + 1)), kMax);
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

// Why a FERRY_ variable without "__" (and not FERRY_DEVICES) is not configuration.
std::string ignored_variable_reason(const std::string& name) {
  std::string rest = name.substr(std::string_view("FERRY_").size());
  std::string lower;
  for (char c : rest) {
    lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  const nlohmann::json defaults = to_json(LoadConfig{});
  if (!lower.empty() && defaults.contains(lower) && defaults[lower].is_object()) {
    return "names the section '" + lower + "', not a key; set its keys one by one (FERRY_" + rest +
           "__<KEY>)";
  }
  return "not a ferry variable (configuration variables are FERRY_ and a key in upper case "
         "with __ for each dot, as FERRY_IO__CHUNK_BYTES)";
}

std::string_view direct_to_device_name(io::DirectToDevice mode) {
  switch (mode) {
    case io::DirectToDevice::kOn:
      return "on";
    case io::DirectToDevice::kOff:
      return "off";
    case io::DirectToDevice::kAuto:
      break;
  }
  return "auto";
}

std::string_view engine_name(io::Engine engine) {
  switch (engine) {
    case io::Engine::kUring:
      return "uring";
    case io::Engine::kPread:
      return "pread";
  }
  return "unknown";
}

std::string dtype_key(const std::optional<DType>& dtype) {
  if (!dtype) {
    return "auto";
  }
  std::string name(dtype_name(*dtype));
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;  // "bf16", "f16", "f32" (others never pass build())
}

// Reads the merged entries over the in-code defaults. Every error names the key
// and the source that set it; every key read is marked so build() can check that
// none was left over.
class Fields {
 public:
  struct Entry {
    const nlohmann::json* value;
    std::string_view source;
    const std::optional<std::string>* text;
  };
  using Lookup = std::map<std::string, Entry>;

  explicit Fields(Lookup entries) : entries_(std::move(entries)) {}

  // Every key is read through here, so this is the one place a NUL is refused: the
  // C calls a path reaches would end it at the NUL ("rep.json\u0000.evil" wrote
  // rep.json), and no path, name, mode or size holds one.
  const Entry* find(const std::string& key) {
    read_.insert(key);
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      return nullptr;
    }
    const Entry& e = it->second;
    const std::string* text = e.value->is_string() ? e.value->get_ptr<const std::string*>()
                              : e.text->has_value() ? &**e.text
                                                    : nullptr;
    if (text != nullptr && text->find('\0') != std::string::npos) {
      fail_key(key, "contains a NUL byte (\\u0000), which no path, name or mode may hold: " +
                        json_quoted(*text));
    }
    return &e;
  }

  std::string_view source(const std::string& key) const {
    auto it = entries_.find(key);
    return it == entries_.end() ? kDefaultsSource : it->second.source;
  }

  [[noreturn]] void fail_key(const std::string& key, const std::string& rule) const {
    fail(source(key), key + ": " + rule);
  }

  std::string get_string(const std::string& key, std::string fallback) {
    const Entry* e = find(key);
    if (e == nullptr) {
      return fallback;
    }
    std::string text;
    if (e->value->is_string()) {
      text = e->value->get<std::string>();
    } else if (e->text->has_value() && e->value->is_primitive()) {
      // `--set model.path=2024` parsed as a number; the text is what was meant.
      text = **e->text;
    } else {
      fail_key(key, "expected a string, got " + e->value->dump());
    }
    return text;
  }

  // True when `key` is absent or the string "auto" (a size key whose default ferry
  // picks); the key then counts as read.
  bool is_auto(const std::string& key) {
    const Entry* e = find(key);
    return e == nullptr || (e->value->is_string() && e->value->get<std::string>() == "auto");
  }

  bool get_bool(const std::string& key, bool fallback) {
    const Entry* e = find(key);
    if (e == nullptr) {
      return fallback;
    }
    if (!e->value->is_boolean()) {
      fail_key(key, "expected true or false, got " + e->value->dump());
    }
    return e->value->get<bool>();
  }

  std::int64_t get_int(const std::string& key, std::int64_t lo, std::int64_t hi,
                       std::int64_t fallback) {
    const Entry* e = find(key);
    if (e == nullptr) {
      return fallback;
    }
    const nlohmann::json& v = *e->value;
    std::string kind = lo == 1   ? "a positive integer"
                       : lo == 0 ? "a non-negative integer"
                                 : "an integer";
    if (!v.is_number_integer()) {
      fail_key(key, "expected " + kind + ", got " + v.dump());
    }
    bool in_range = v.is_number_unsigned()
                        ? v.get<std::uint64_t>() <= static_cast<std::uint64_t>(hi) &&
                              static_cast<std::int64_t>(v.get<std::uint64_t>()) >= lo
                        : v.get<std::int64_t>() >= lo && v.get<std::int64_t>() <= hi;
    if (!in_range) {
      fail_key(key, "expected an integer from " + std::to_string(lo) + " to " + std::to_string(hi) +
                        ", got " + v.dump());
    }
    return v.is_number_unsigned() ? static_cast<std::int64_t>(v.get<std::uint64_t>())
                                  : v.get<std::int64_t>();
  }

  std::uint64_t get_size(const std::string& key, std::uint64_t lo, std::uint64_t hi,
                         std::uint64_t fallback) {
    const Entry* e = find(key);
    if (e == nullptr) {
      return fallback;
    }
    std::uint64_t bytes = 0;
    try {
      bytes = parse_size(*e->value);
    } catch (const Error& err) {
      fail_key(key, err.rule());
    }
    if (bytes < lo || bytes > hi) {
      fail_key(key, "expected " + std::to_string(lo) + " to " + std::to_string(hi) +
                        " bytes, got " + e->value->dump());
    }
    return bytes;
  }

  double get_double(const std::string& key, double lo, double hi, double fallback) {
    const Entry* e = find(key);
    if (e == nullptr) {
      return fallback;
    }
    if (!e->value->is_number()) {
      fail_key(key, "expected a number, got " + e->value->dump());
    }
    double d = e->value->get<double>();
    if (!(d >= lo && d <= hi)) {
      std::ostringstream rule;
      rule << "expected a number from " << lo << " to " << hi << ", got " << e->value->dump();
      fail_key(key, rule.str());
    }
    return d;
  }

  // Keys the builder holds that no get_* asked for: a schema/build() mismatch.
  std::vector<std::string> unread() const {
    std::vector<std::string> out;
    for (const auto& [key, unused] : entries_) {
      if (read_.count(key) == 0) {
        out.push_back(key);
      }
    }
    return out;
  }

 private:
  Lookup entries_;
  std::set<std::string> read_;
};

std::vector<int> read_ranks(Fields& f, int tp) {
  const std::string key = "parallel.ranks";
  const Fields::Entry* e = f.find(key);
  try {
    if (e == nullptr) {
      return parse_ranks("", tp);
    }
    const nlohmann::json& v = *e->value;
    if (auto one = as_non_negative(v)) {
      return parse_ranks(std::to_string(*one), tp);
    }
    if (v.is_string()) {
      return parse_ranks(v.get<std::string>(), tp);
    }
    // [] means all ranks, as "" does.
    if (v.is_array() &&
        std::all_of(v.begin(), v.end(), [](const auto& x) { return as_non_negative(x); })) {
      std::string text;
      for (const auto& x : v) {
        if (!text.empty()) {
          text += ',';
        }
        text += std::to_string(*as_non_negative(x));
      }
      return parse_ranks(text, tp);
    }
  } catch (const Error& err) {
    fail(f.source(key), err.rule());
  }
  f.fail_key(
      key, "expected a list of ranks such as \"0,2\", \"0-3\" or [0, 2], got " + e->value->dump());
}

}  // namespace

// ---- ConfigBuilder -----------------------------------------------------------

void ConfigBuilder::set_key(const std::string& key, const nlohmann::json& value,
                            const std::string& source, const std::optional<std::string>& text) {
  if (schema().sections.count(key) != 0) {
    if (!value.is_object()) {
      fail(source, key + ": expected an object, got " + value.dump());
    }
    for (const auto& [sub, sub_value] : value.items()) {
      set_key(key + "." + sub, sub_value, source, std::nullopt);
    }
    return;
  }
  if (schema().leaves.count(key) == 0) {
    fail(source, unknown_key(key));
  }
  entries_[key] = Entry{value, source, text};
}

void ConfigBuilder::apply_json(const nlohmann::json& object, std::string_view source) {
  if (!object.is_object()) {
    fail(source, "expected a JSON object at the top level, got " + object.dump());
  }
  for (const auto& [key, value] : object.items()) {
    set_key(key, value, std::string(source), std::nullopt);
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
                               const std::string& source) {
  // Environment and command-line bytes are not checked by any JSON parser, and
  // nlohmann throws when it writes a string that is not UTF-8 (in errors, reports).
  if (!valid_utf8(text)) {
    fail(source, std::string(key) + ": the value is not valid UTF-8");
  }
  set_key(std::string(key), parse_value_text(text), source, std::string(text));
}

void ConfigBuilder::apply_env(const std::map<std::string, std::string>& env) {
  constexpr std::string_view kPrefix = "FERRY_";
  for (const auto& [name, value] : env) {
    if (name.rfind(kPrefix, 0) != 0 ||
        std::find(kNonConfigVariables.begin(), kNonConfigVariables.end(), name) !=
            kNonConfigVariables.end()) {
      continue;
    }
    std::string source = "environment " + name;
    if (name.find("__") == std::string::npos && name != "FERRY_DEVICES") {
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
    apply_text(key, value, source);
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
  std::string key(trim(assignment.substr(0, eq)));
  if (key.empty()) {
    fail("--set " + std::string(assignment), "expected key=value (the key is empty)");
  }
  apply_text(key, assignment.substr(eq + 1), "--set " + key);
}

void ConfigBuilder::apply_flag(std::string_view flag, std::string_view key, std::string_view text) {
  apply_text(key, text, std::string(flag));
}

void ConfigBuilder::apply_flag_value(std::string_view flag, std::string_view key,
                                     const nlohmann::json& value) {
  set_key(std::string(key), value, std::string(flag), std::nullopt);
}

IoAuto io_auto(DeviceSpec::Kind kind, std::size_t local_devices) {
  const std::size_t n = std::max<std::size_t>(1, local_devices);
  if (kind != DeviceSpec::Kind::kCuda) {
    return {std::size_t{1} << 20, (std::size_t{8} << 20) * n, 4, true};
  }
  return {std::size_t{16} << 20, std::min((std::size_t{256} << 20) * n, std::size_t{1} << 30),
          static_cast<unsigned>(std::min<std::size_t>(16, 8 * n)), false};
}

LoadConfig ConfigBuilder::build() const {
  Fields::Lookup lookup;
  for (const auto& [key, entry] : entries_) {
    lookup.emplace(key, Fields::Entry{&entry.value, entry.source, &entry.text});
  }
  Fields f(std::move(lookup));
  const LoadConfig d;  // the in-code defaults
  LoadConfig c;

  // model
  c.model.path = f.get_string("model.path", d.model.path);
  {
    std::string text =
        f.get_string("model.load_format", std::string(io::to_string(d.model.load_format)));
    auto format = io::parse_load_format(text);
    if (!format) {
      f.fail_key("model.load_format",
                 "expected auto, safetensors, mistral, pt or dummy, got " + json_quoted(text));
    }
    c.model.load_format = *format;
  }
  {
    std::string text = f.get_string("model.dtype", dtype_key(d.model.dtype));
    if (text == "auto") {
      c.model.dtype = std::nullopt;
    } else if (text == "bf16") {
      c.model.dtype = DType::kBF16;
    } else if (text == "f16") {
      c.model.dtype = DType::kF16;
    } else if (text == "f32") {
      c.model.dtype = DType::kF32;
    } else {
      f.fail_key("model.dtype", "expected auto, bf16, f16 or f32, got " + json_quoted(text));
    }
  }
  c.model.draft = f.get_bool("model.draft", d.model.draft);
  c.model.switch_w13 = f.get_bool("model.switch_w13", d.model.switch_w13);
  c.model.eplb_map = f.get_string("model.eplb_map", d.model.eplb_map);
  if (const Fields::Entry* e = f.find("model.fuse_shared_experts")) {
    const nlohmann::json& v = *e->value;
    if (v.is_boolean()) {
      c.model.fuse_shared_experts = v.get<bool>();
    } else if (v.is_string() && (v == "auto" || v == "true" || v == "false")) {
      c.model.fuse_shared_experts = v == "auto" ? std::nullopt : std::optional<bool>(v == "true");
    } else {
      f.fail_key("model.fuse_shared_experts", "expected auto, true or false, got " + v.dump());
    }
  } else {
    c.model.fuse_shared_experts = d.model.fuse_shared_experts;
  }
  {
    const std::string text = f.get_string(
        "model.unaligned_tp", d.model.unaligned_tp == models::Unaligned::kPad ? "pad" : "refuse");
    if (text == "refuse") {
      c.model.unaligned_tp = models::Unaligned::kRefuse;
    } else if (text == "pad") {
      c.model.unaligned_tp = models::Unaligned::kPad;
    } else {
      f.fail_key("model.unaligned_tp", "expected refuse or pad, got " + json_quoted(text));
    }
  }
  c.model.pad_moe_intermediate_to = static_cast<int>(
      f.get_int("model.pad_moe_intermediate_to", 0, 1 << 20, d.model.pad_moe_intermediate_to));
  c.model.dummy_seed = static_cast<std::uint64_t>(
      f.get_int("model.dummy_seed", 0, std::numeric_limits<std::int64_t>::max(),
                static_cast<std::int64_t>(d.model.dummy_seed)));

  // parallel
  ParallelConfig& p = c.parallel;
  p.tp = static_cast<int>(f.get_int("parallel.tp", 1, kMaxParallel, d.parallel.tp));
  p.ep = static_cast<int>(f.get_int("parallel.ep", 1, kMaxParallel, d.parallel.ep));
  if (p.tp % p.ep != 0) {
    f.fail_key("parallel.ep", "expected a divisor of parallel.tp " + std::to_string(p.tp) +
                                  ", got " + std::to_string(p.ep));
  }
  p.pp = static_cast<int>(f.get_int("parallel.pp", 1, kMaxParallel, d.parallel.pp));
  p.pp_rank = static_cast<int>(f.get_int("parallel.pp_rank", 0, kMaxParallel, d.parallel.pp_rank));
  if (p.pp_rank >= p.pp) {
    f.fail_key("parallel.pp_rank", "expected 0 to " + std::to_string(p.pp - 1) + " (parallel.pp " +
                                       std::to_string(p.pp) + "), got " +
                                       std::to_string(p.pp_rank));
  }
  if (const Fields::Entry* e = f.find("parallel.pp_partition")) {
    const nlohmann::json& v = *e->value;
    bool ok = v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& x) {
                auto n = as_non_negative(x);
                return n && *n <= (1u << 20);
              });
    if (!ok) {
      f.fail_key("parallel.pp_partition",
                 "expected an array of layer counts such as [16, 16], got " + v.dump());
    }
    p.pp_partition.clear();
    for (const auto& x : v) {
      p.pp_partition.push_back(static_cast<int>(*as_non_negative(x)));
    }
    if (!p.pp_partition.empty() && p.pp_partition.size() != static_cast<std::size_t>(p.pp)) {
      f.fail_key("parallel.pp_partition", "expected one layer count per stage (parallel.pp " +
                                              std::to_string(p.pp) + "), got " +
                                              std::to_string(p.pp_partition.size()));
    }
  }
  p.ranks = read_ranks(f, p.tp);
  p.attn_dp = static_cast<int>(f.get_int("parallel.attn_dp", 1, kMaxParallel, d.parallel.attn_dp));
  if (p.tp % p.attn_dp != 0) {
    f.fail_key("parallel.attn_dp", "expected a divisor of parallel.tp " + std::to_string(p.tp) +
                                       " (attention tp = tp / attn_dp), got " +
                                       std::to_string(p.attn_dp));
  }
  p.dp_lm_head = f.get_bool("parallel.dp_lm_head", d.parallel.dp_lm_head);
  if (p.dp_lm_head && p.attn_dp == 1) {
    f.fail_key("parallel.dp_lm_head",
               "splits lm_head over the attention tp group and needs parallel.attn_dp > 1");
  }
  {
    // 1 or "none"; a config file may give the 1 as a number.
    const Fields::Entry* e = f.find("parallel.moe_dense_tp");
    const std::string text =
        e != nullptr && e->value->is_number_integer()
            ? std::to_string(e->value->get<std::int64_t>())
            : f.get_string("parallel.moe_dense_tp", d.parallel.moe_dense_tp == 1 ? "1" : "none");
    if (text == "none") {
      p.moe_dense_tp = 0;
    } else if (text == "1") {
      p.moe_dense_tp = 1;
    } else {
      f.fail_key("parallel.moe_dense_tp",
                 "expected none or 1 (SGLang's moe_dense_tp_size), got " + json_quoted(text));
    }
  }
  {
    const std::string text =
        f.get_string("parallel.moe_a2a", d.parallel.moe_a2a_deepep ? "deepep" : "none");
    if (text == "none") {
      p.moe_a2a_deepep = false;
    } else if (text == "deepep") {
      p.moe_a2a_deepep = true;
      if (p.ep != p.tp) {
        f.fail_key("parallel.moe_a2a", "deepep runs experts with ep = tp (SGLang sets ep_size to "
                                       "tp_size); set parallel.ep " +
                                           std::to_string(p.tp));
      }
    } else {
      f.fail_key("parallel.moe_a2a", "expected none or deepep, got " + json_quoted(text));
    }
  }

  // devices
  {
    std::string spec = f.get_string("devices", "");
    try {
      c.devices = resolve_devices(spec, p.ranks);
    } catch (const Error& err) {
      fail(f.source("devices"), err.rule());
    }
  }

  // io
  {
    std::string text = f.get_string("io.engine", std::string(engine_name(d.io.engine)));
    if (text == "uring") {
      c.io.engine = io::Engine::kUring;
    } else if (text == "pread") {
      c.io.engine = io::Engine::kPread;
    } else {
      f.fail_key("io.engine", "expected uring or pread, got " + json_quoted(text));
    }
  }
  c.io.read_lanes = static_cast<unsigned>(f.get_int("io.read_lanes", 0, 64, d.io.read_lanes));
  c.io.queue_depth = static_cast<unsigned>(f.get_int("io.queue_depth", 1, 32768, d.io.queue_depth));
  c.io.cancel_timeout_ms = static_cast<std::uint64_t>(f.get_int(
      "io.cancel_timeout_ms", 1, 3'600'000, static_cast<std::int64_t>(d.io.cancel_timeout_ms)));
  c.io.staging_bytes = f.get_size("io.staging_bytes", 0, kMaxStagingBytes, d.io.staging_bytes);
  c.io.max_metadata_bytes = f.get_size("io.max_metadata_bytes", kMinMetadataBytes,
                                       kMaxMetadataBytes, d.io.max_metadata_bytes);
  if (f.is_auto("io.chunk_bytes")) {
    // By the devices' link, and never so large that explicit staging holds fewer
    // than two buffers (one read in flight while the other is copied).
    const IoAuto a = io_auto(c.devices.kind, p.ranks.size());
    c.io.chunk_bytes = a.chunk_bytes;
    if (c.io.staging_bytes != 0) {
      const std::uint64_t half = c.io.staging_bytes / 2 / kDirectAlign * kDirectAlign;
      c.io.chunk_bytes = std::max<std::uint64_t>(
          kDirectAlign, std::min<std::uint64_t>(c.io.chunk_bytes, half));
    }
  } else {
    c.io.chunk_bytes = f.get_size("io.chunk_bytes", 4096, kMaxChunkBytes, d.io.chunk_bytes);
    c.io.chunk_bytes_auto = false;
  }
  if (c.io.staging_bytes != 0) {
    const std::uint64_t buffer =
        (c.io.chunk_bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    if (c.io.staging_bytes < buffer) {
      f.fail_key("io.staging_bytes", "must hold at least one io.chunk_bytes buffer (" +
                                         std::to_string(buffer) + " bytes), got " +
                                         std::to_string(c.io.staging_bytes) +
                                         " (0 means auto: 8 MiB per local host device, 256 MiB "
                                         "per GPU up to 1 GiB)");
    }
  }
  {
    std::string text = f.get_string("io.direct_to_device",
                                    std::string(direct_to_device_name(d.io.direct_to_device)));
    if (text == "auto") {
      c.io.direct_to_device = io::DirectToDevice::kAuto;
    } else if (text == "on") {
      c.io.direct_to_device = io::DirectToDevice::kOn;
    } else if (text == "off") {
      c.io.direct_to_device = io::DirectToDevice::kOff;
    } else {
      f.fail_key("io.direct_to_device", "expected auto, on or off, got " + json_quoted(text));
    }
  }
  c.io.direct = f.get_bool("io.direct", d.io.direct);
  c.io.drop_cache = f.get_bool("io.drop_cache", d.io.drop_cache);
  if (c.io.direct && c.io.chunk_bytes % kDirectAlign != 0) {
    f.fail_key("io.chunk_bytes", "with io.direct it must be a multiple of 4096, got " +
                                     std::to_string(c.io.chunk_bytes));
  }

  // prefetch
  c.prefetch.enabled = f.get_bool("prefetch.enabled", d.prefetch.enabled);
  c.prefetch.threads =
      static_cast<unsigned>(f.get_int("prefetch.threads", 1, 256, d.prefetch.threads));
  c.prefetch.block_bytes =
      f.get_size("prefetch.block_bytes", 4096, kMaxChunkBytes, d.prefetch.block_bytes);
  c.prefetch.ahead_bytes = f.get_size(
      "prefetch.ahead_bytes", 0, std::numeric_limits<std::uint64_t>::max(), d.prefetch.ahead_bytes);

  // load
  c.load.strict = f.get_bool("load.strict", d.load.strict);
  c.load.sort_weight_files =
      static_cast<int>(f.get_int("load.sort_weight_files", -1, 1 << 20, d.load.sort_weight_files));
  c.load.report = f.get_string("load.report", d.load.report);
  c.load.dump_dir = f.get_string("load.dump_dir", d.load.dump_dir);
  c.load.layered = f.get_bool("load.layered", d.load.layered);
  if (!c.load.dump_dir.empty() && c.devices.kind == DeviceSpec::Kind::kNull) {
    fail(f.source("load.dump_dir"), "load.dump_dir: devices " + to_string(c.devices) +
                                        " keep no parameter data, so there is nothing to dump");
  }

  // host, metrics
  c.host.bandwidth_gbps = f.get_double("host.bandwidth_gbps", 0, kMaxBandwidthGbps,
                                       d.host.bandwidth_gbps);
  if (c.host.bandwidth_gbps != 0 && c.host.bandwidth_gbps < kMinBandwidthGbps) {
    std::ostringstream rule;
    rule << "expected 0 (no cap) or a number from " << kMinBandwidthGbps << " to "
         << kMaxBandwidthGbps << " GB/s, got " << c.host.bandwidth_gbps
         << " (a slower link would take hours to emulate a load)";
    f.fail_key("host.bandwidth_gbps", rule.str());
  }
  c.host.deferred_copies = f.get_bool("host.deferred_copies", d.host.deferred_copies);
  c.host.huge_pages = f.get_bool("host.huge_pages", d.host.huge_pages);
  c.host.narrow_row_bytes =
      f.get_size("host.narrow_row_bytes", 0, std::uint64_t{1} << 30, d.host.narrow_row_bytes);
  c.metrics.listen = f.get_string("metrics.listen", d.metrics.listen);
  c.metrics.textfile = f.get_string("metrics.textfile", d.metrics.textfile);
  if (!c.metrics.listen.empty()) {
    try {
      c.metrics.listen = metrics_bind_address(c.metrics.listen);
    } catch (const Error& err) {
      fail(f.source("metrics.listen"), "metrics.listen: " + err.rule());
    }
  }

  c.trace.path = f.get_string("trace.path", d.trace.path);

  // startup
  {
    std::string text = f.get_string("startup.mode", std::string(to_string(d.startup.mode)));
    if (text == "serial") {
      c.startup.mode = StartupMode::kSerial;
    } else if (text == "overlap") {
      c.startup.mode = StartupMode::kOverlap;
    } else if (text == "auto") {
      c.startup.mode = StartupMode::kAuto;
    } else {
      f.fail_key("startup.mode", "expected serial, overlap or auto, got " + json_quoted(text));
    }
  }

  // quantization
  {
    using Requant = models::QuantScheme::Requant;
    const std::string text = f.get_string("quantization.requant", "none");
    if (text == "none") {
      c.quantization.requant = Requant::kNone;
    } else if (text == "ue8m0") {
      c.quantization.requant = Requant::kUe8m0;
    } else if (text == "tensor") {
      c.quantization.requant = Requant::kTensor;
    } else {
      f.fail_key("quantization.requant",
                 "expected none, ue8m0 or tensor, got " + json_quoted(text));
    }
    using Online = QuantizationConfig::Online;
    const std::string online = f.get_string("quantization.online", "none");
    bool known = false;
    for (Online o : {Online::kNone, Online::kAuto, Online::kChannel, Online::kTensor}) {
      if (online == online_name(o)) {
        c.quantization.online = o;
        known = true;
      }
    }
    if (!known) {
      f.fail_key("quantization.online",
                 "expected none, auto, fp8_channel or fp8_tensor, got " + json_quoted(online));
    }
  }

  // postprocess
  {
    const std::string text = f.get_string("postprocess.target", "loader");
    if (text == "auto") {
      c.postprocess.target = std::nullopt;
    } else if (auto target = models::parse_target(text)) {
      c.postprocess.target = *target;
    } else {
      f.fail_key("postprocess.target",
                 "expected loader, sm90, sm100 or auto, got " + json_quoted(text));
    }
  }

  if (auto left = f.unread(); !left.empty()) {
    // to_json knows a key this function does not read: a bug, not a user error.
    throw std::logic_error("LoadConfig: build() does not read key '" + left.front() + "'");
  }
  return c;
}

// ---- load_config ---------------------------------------------------------------

LoadConfig load_config(const ConfigSources& sources,
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
  using nlohmann::json;
  return json{
      {"model",
       {
           {"path", c.model.path},
           {"load_format", io::to_string(c.model.load_format)},
           {"dtype", dtype_key(c.model.dtype)},
           {"draft", c.model.draft},
           {"switch_w13", c.model.switch_w13},
           {"eplb_map", c.model.eplb_map},
           {"fuse_shared_experts", c.model.fuse_shared_experts
                                       ? nlohmann::json(*c.model.fuse_shared_experts)
                                       : nlohmann::json("auto")},
           {"unaligned_tp", c.model.unaligned_tp == models::Unaligned::kPad ? "pad" : "refuse"},
           {"pad_moe_intermediate_to", c.model.pad_moe_intermediate_to},
           {"dummy_seed", c.model.dummy_seed},
       }},
      {"parallel",
       {
           {"tp", c.parallel.tp},
           {"ep", c.parallel.ep},
           {"pp", c.parallel.pp},
           {"pp_rank", c.parallel.pp_rank},
           {"pp_partition", c.parallel.pp_partition},
           {"ranks", c.parallel.ranks},
           {"attn_dp", c.parallel.attn_dp},
           {"dp_lm_head", c.parallel.dp_lm_head},
           {"moe_dense_tp", c.parallel.moe_dense_tp == 1 ? nlohmann::json(1) : nlohmann::json("none")},
           {"moe_a2a", c.parallel.moe_a2a_deepep ? "deepep" : "none"},
       }},
      {"devices", to_string(c.devices)},
      {"io",
       {
           {"engine", engine_name(c.io.engine)},
           {"read_lanes", c.io.read_lanes},
           {"queue_depth", c.io.queue_depth},
           {"chunk_bytes",
            c.io.chunk_bytes_auto ? nlohmann::json("auto") : nlohmann::json(c.io.chunk_bytes)},
           {"staging_bytes", c.io.staging_bytes},
           {"direct_to_device", direct_to_device_name(c.io.direct_to_device)},
           {"direct", c.io.direct},
           {"drop_cache", c.io.drop_cache},
           {"cancel_timeout_ms", c.io.cancel_timeout_ms},
           {"max_metadata_bytes", c.io.max_metadata_bytes},
       }},
      {"prefetch",
       {
           {"enabled", c.prefetch.enabled},
           {"threads", c.prefetch.threads},
           {"block_bytes", c.prefetch.block_bytes},
           {"ahead_bytes", c.prefetch.ahead_bytes},
       }},
      {"load",
       {
           {"strict", c.load.strict},
           {"sort_weight_files", c.load.sort_weight_files},
           {"report", c.load.report},
           {"dump_dir", c.load.dump_dir},
           {"layered", c.load.layered},
       }},
      {"host",
       {{"bandwidth_gbps", c.host.bandwidth_gbps},
        {"deferred_copies", c.host.deferred_copies},
        {"huge_pages", c.host.huge_pages},
        {"narrow_row_bytes", c.host.narrow_row_bytes}}},
      {"metrics", {{"listen", c.metrics.listen}, {"textfile", c.metrics.textfile}}},
      {"trace", {{"path", c.trace.path}}},
      {"startup", {{"mode", to_string(c.startup.mode)}}},
      {"quantization",
       {{"requant", requant_name(c.quantization.requant)},
        {"online", online_name(c.quantization.online)}}},
      {"postprocess", {{"target", target_name(c.postprocess.target)}}},
  };
}

std::string_view requant_name(models::QuantScheme::Requant r) {
  switch (r) {
    case models::QuantScheme::Requant::kUe8m0:
      return "ue8m0";
    case models::QuantScheme::Requant::kTensor:
      return "tensor";
    case models::QuantScheme::Requant::kNone:
      break;
  }
  return "none";
}

std::string_view target_name(const std::optional<models::QuantScheme::Target>& target) {
  return target ? models::to_string(*target) : std::string_view("auto");
}

std::string_view online_name(QuantizationConfig::Online online) {
  switch (online) {
    case QuantizationConfig::Online::kAuto:
      return "auto";
    case QuantizationConfig::Online::kChannel:
      return "fp8_channel";
    case QuantizationConfig::Online::kTensor:
      return "fp8_tensor";
    case QuantizationConfig::Online::kNone:
      break;
  }
  return "none";
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

std::string_view to_string(StartupMode mode) {
  switch (mode) {
    case StartupMode::kSerial:
      return "serial";
    case StartupMode::kOverlap:
      return "overlap";
    case StartupMode::kAuto:
      return "auto";
  }
  return "?";
}

// ---- sizes, ranks, devices -------------------------------------------------------

std::uint64_t parse_size(const nlohmann::json& value) {
  const std::string expected =
      "expected a size: a number of bytes, or a number with B, KiB, MiB, GiB, KB, MB or GB, got ";
  if (auto bytes = as_non_negative(value)) {
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
  std::string_view s = trim(original);
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
  std::string_view unit = trim(s.substr(i));
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
  if (trim(text).empty()) {
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
  std::string_view s = trim(spec);
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
      auto count = parse_digits(trim(s.substr(backend.size() + 1)), INT_MAX);
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
