// The index parser (io::parse_weight_index), fed arbitrary text.
//
// Input: the whole input is the index's text.
//
// Asserted, for every index it accepts:
//  - an independent reading with nlohmann::json finds an object with a
//    "weight_map" object of strings, equal to the parsed map (ferry refuses
//    duplicate keys, so nlohmann's keep-the-last cannot differ), and the same
//    metadata.total_size (an unsigned number, or a whole non-negative float that
//    fits in 64 bits; absent otherwise);
//  - the document path agrees with the fast path: the same document with one more
//    top-level key (which the SAX pass hands to the document path) parses to the
//    same index.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "common/error.hpp"
#include "fuzz/fuzz_check.hpp"
#include "io/safetensors.hpp"

namespace {

using ferry::io::WeightIndex;
using nlohmann::json;

std::optional<WeightIndex> parse(std::string_view text) {
  try {
    return ferry::io::parse_weight_index(text, "fuzz.index.json");
  } catch (const ferry::Error&) {
    return std::nullopt;
  }
}

std::optional<std::uint64_t> expected_total_size(const json& doc) {
  auto md = doc.find("metadata");
  if (md == doc.end() || !md->is_object()) {
    return std::nullopt;
  }
  auto ts = md->find("total_size");
  if (ts == md->end()) {
    return std::nullopt;
  }
  if (ts->is_number_unsigned()) {
    return ts->get<std::uint64_t>();
  }
  if (ts->is_number_float()) {
    const double v = ts->get<double>();
    if (v >= 0 && v == std::floor(v) && v < 18446744073709551616.0) {
      return static_cast<std::uint64_t>(v);
    }
  }
  return std::nullopt;
}

void check(const WeightIndex& index, const json& doc) {
  FUZZ_CHECK(index.file == "fuzz.index.json");
  FUZZ_CHECK(doc.is_object());
  auto wm = doc.find("weight_map");
  FUZZ_CHECK(wm != doc.end() && wm->is_object());
  std::map<std::string, std::string> want;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    FUZZ_CHECK(it->is_string(), "weight_map value not a string: " + it.key());
    want[it.key()] = it->get<std::string>();
  }
  FUZZ_CHECK(want == index.weight_map, "weight_map differs from nlohmann's reading");
  FUZZ_CHECK(expected_total_size(doc) == index.total_size, "total_size differs");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::optional<WeightIndex> index = parse(text);
  if (!index) {
    return 0;
  }
  const json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  FUZZ_CHECK(!doc.is_discarded(), "an accepted index is not JSON to nlohmann");
  check(*index, doc);

  json extended = doc;
  extended["\x01 fuzz: not an index key"] = nullptr;
  const std::string again = extended.dump();
  const std::optional<WeightIndex> slow = parse(again);
  FUZZ_CHECK(slow.has_value(), "the document path refuses what the fast path accepts");
  FUZZ_CHECK(slow->weight_map == index->weight_map && slow->total_size == index->total_size,
             "the document path reads another index");
  return 0;
}
