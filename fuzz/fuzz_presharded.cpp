// The presharded manifest parsers, ferry's (io::parse_presharded_manifest) and
// SGLang's plan (io::parse_sglang_plan), fed arbitrary text as runtime/presharded.cpp
// and runtime/sglang_presharded.cpp read manifest.json and checksum.json: the depth check,
// nlohmann's parse (the runtime turns its every json::exception into a ferry::Error, a number too
// large for a double included), then the parser. A ferry::Error or a text nlohmann refuses is a
// clean refusal; any other exception (a nlohmann type_error or out_of_range the parser let through)
// is a finding.
//
// Asserted, for every manifest it accepts:
//  - to_json of the result parses back to the same manifest (every field);
//  - every param's bytes are dtype x shape, every non-empty one's offset is a multiple
//    of 4096, every file a plain name, and one stored tensor has one range;
// and for every SGLang plan it accepts: every read's world rank is inside the world,
// its file a plain name, its stored key 32 hex digits, its name not empty.
#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <tuple>

#include "common/error.hpp"
#include "common/json_depth.hpp"
#include "fuzz/fuzz_check.hpp"
#include "io/presharded.hpp"
#include "io/sglang_presharded.hpp"

namespace {

using ferry::io::PreshardedManifest;
using ferry::io::PreshardedParam;

bool same(const PreshardedManifest& a, const PreshardedManifest& b) {
  if (a.signature != b.signature || a.structure != b.structure || a.pp_rank != b.pp_rank ||
      a.ranks.size() != b.ranks.size()) {
    return false;
  }
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    if (a.ranks[r].tp_rank != b.ranks[r].tp_rank ||
        a.ranks[r].params.size() != b.ranks[r].params.size()) {
      return false;
    }
    for (std::size_t k = 0; k < a.ranks[r].params.size(); ++k) {
      const PreshardedParam& x = a.ranks[r].params[k];
      const PreshardedParam& y = b.ranks[r].params[k];
      if (std::tie(x.name, x.tensor, x.dtype, x.shape, x.nbytes, x.file, x.offset) !=
              std::tie(y.name, y.tensor, y.dtype, y.shape, y.nbytes, y.file, y.offset) ||
          x.xxh3 != y.xxh3) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (ferry::json_depth(text) > ferry::kMaxJsonDepth) {
    return 0;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {  // parse_error, or out_of_range for 1e999
    return 0;
  }
  try {
    const ferry::io::SglangPlan plan = ferry::io::parse_sglang_plan(j, "fuzz/checksum.json");
    for (const auto& [rank, reads] : plan.reads) {
      FUZZ_CHECK(rank >= 0 && rank < plan.world_size, std::to_string(rank));
      for (const ferry::io::SglangRead& r : reads) {
        FUZZ_CHECK(!r.file.empty() && r.file.find('/') == std::string::npos && r.file != "..",
                   r.file);
        FUZZ_CHECK(ferry::Hash128::from_hex(r.stored_key).has_value(), r.stored_key);
        FUZZ_CHECK(!r.name.empty(), r.file);
      }
    }
  } catch (const ferry::Error&) {
  }
  PreshardedManifest m;
  try {
    m = ferry::io::parse_presharded_manifest(j, "fuzz/manifest.json");
  } catch (const ferry::Error&) {
    return 0;
  }
  std::map<std::string, std::tuple<std::string, std::uint64_t, std::uint64_t>> ranges;
  for (const auto& rank : m.ranks) {
    for (const PreshardedParam& p : rank.params) {
      std::uint64_t elements = 1;
      for (std::uint64_t d : p.shape) {
        elements *= d;
      }
      FUZZ_CHECK(p.nbytes == elements * ferry::dtype_size(p.dtype), p.name);
      FUZZ_CHECK(p.nbytes == 0 || p.offset % ferry::io::kPreshardedAlignment == 0, p.name);
      FUZZ_CHECK(!p.file.empty() && p.file.find('/') == std::string::npos && p.file != "..",
                 p.file);
      const auto range = std::make_tuple(p.file, p.offset, p.nbytes);
      auto [it, fresh] = ranges.emplace(p.tensor, range);
      FUZZ_CHECK(fresh || it->second == range, p.tensor);
    }
  }
  const PreshardedManifest back =
      ferry::io::parse_presharded_manifest(ferry::io::to_json(m), "fuzz/manifest.json");
  FUZZ_CHECK(same(m, back), "to_json does not round-trip");
  return 0;
}
