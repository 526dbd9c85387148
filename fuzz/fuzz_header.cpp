// The safetensors header parser (io::parse_safetensors_header) and its three paths
// (io/safetensors_internal.hpp), fed arbitrary JSON text.
//
// Input: the JSON text, then 8 bytes read by FuzzedDataProvider from the end as the
// data region's size, so file_size = 8 + text size + that (wrapping: any file size).
//
// Asserted:
//  - differential: wherever the plain scanner or the SAX pass accepts, the document
//    path accepts too and gives the same header; where a fast path refuses with an
//    error, so does the document path; parse_safetensors_header agrees with them;
//  - against an independent reading of the same text with nlohmann::json: every
//    entry's dtype, shape and data_offsets, the metadata, the entry count;
//  - the header's own rules: byte counts are element counts times the dtype's size
//    (checked without overflow), tensors sorted by offset, inside the file, and
//    tiling the data region exactly.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "fuzz/fuzz_check.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_internal.hpp"

namespace ferry::io {
namespace {

using nlohmann::json;

struct Outcome {
  std::optional<SafetensorsHeader> header;  // accepted
  bool refused = false;                     // threw ferry::Error
};

template <class F>
Outcome attempt(F&& parse) {
  Outcome o;
  try {
    o.header = parse();
  } catch (const Error&) {
    o.refused = true;
  }
  return o;
}

bool same_tensor(const TensorInfo& a, const TensorInfo& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.file == b.file &&
         a.file_index == b.file_index && a.offset == b.offset && a.nbytes == b.nbytes;
}

bool same_header(const SafetensorsHeader& a, const SafetensorsHeader& b) {
  if (a.file != b.file || a.file_size != b.file_size || a.header_bytes != b.header_bytes ||
      a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    if (!same_tensor(a.tensors[i], b.tensors[i])) {
      return false;
    }
  }
  return true;
}

// An accepted header, read again with nlohmann and the format's rules.
void check_accepted(std::string_view text, std::uint64_t file_size, const SafetensorsHeader& h) {
  FUZZ_CHECK(h.header_bytes == 8 + text.size());
  FUZZ_CHECK(h.file_size == file_size);
  FUZZ_CHECK(h.header_bytes <= file_size);
  const std::uint64_t data_bytes = file_size - h.header_bytes;

  const json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  FUZZ_CHECK(!doc.is_discarded(), "an accepted header is not JSON to nlohmann");
  FUZZ_CHECK(doc.is_object());
  std::map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : h.tensors) {
    FUZZ_CHECK(by_name.emplace(t.name, &t).second, "two tensors named " + t.name);
    FUZZ_CHECK(t.name.find('\0') == std::string::npos);
  }
  std::size_t entries = 0;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (it.key() == "__metadata__") {
      FUZZ_CHECK(it->is_object());
      std::map<std::string, std::string> metadata;
      for (auto m = it->begin(); m != it->end(); ++m) {
        FUZZ_CHECK(m->is_string(), "metadata value not a string: " + m.key());
        metadata[m.key()] = m->get<std::string>();
      }
      FUZZ_CHECK(metadata == h.metadata);
      continue;
    }
    ++entries;
    auto found = by_name.find(it.key());
    FUZZ_CHECK(found != by_name.end(), "entry not in the header: " + it.key());
    const TensorInfo& t = *found->second;
    const json& e = *it;
    FUZZ_CHECK(e.is_object());
    FUZZ_CHECK(e.contains("dtype") && e["dtype"].is_string());
    const std::optional<DType> dtype = parse_dtype(e["dtype"].get<std::string>());
    FUZZ_CHECK(dtype.has_value() && *dtype == t.dtype, t.name);
    FUZZ_CHECK(e.contains("shape") && e["shape"].is_array());
    std::vector<std::uint64_t> shape;
    std::uint64_t elements = 1;
    for (const json& d : e["shape"]) {
      FUZZ_CHECK(d.is_number_unsigned(), t.name);
      shape.push_back(d.get<std::uint64_t>());
      FUZZ_CHECK(!__builtin_mul_overflow(elements, shape.back(), &elements), "shape overflows");
    }
    FUZZ_CHECK(shape == t.shape, t.name);
    std::uint64_t bytes = 0;
    FUZZ_CHECK(!__builtin_mul_overflow(elements, dtype_size(t.dtype), &bytes), "bytes overflow");
    FUZZ_CHECK(e.contains("data_offsets") && e["data_offsets"].is_array() &&
               e["data_offsets"].size() == 2 && e["data_offsets"][0].is_number_unsigned() &&
               e["data_offsets"][1].is_number_unsigned());
    const std::uint64_t begin = e["data_offsets"][0].get<std::uint64_t>();
    const std::uint64_t end = e["data_offsets"][1].get<std::uint64_t>();
    FUZZ_CHECK(begin <= end && end <= data_bytes, t.name);
    FUZZ_CHECK(end - begin == bytes && t.nbytes == bytes, t.name);
    FUZZ_CHECK(t.offset == h.header_bytes + begin, t.name);
  }
  FUZZ_CHECK(entries == h.tensors.size());
  if (!doc.contains("__metadata__")) {
    FUZZ_CHECK(h.metadata.empty());
  }

  // Sorted by offset and tiling [header_bytes, file_size) with no gap or overlap
  // (the reference's rule: each tensor starts where the one before it ends).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (const TensorInfo& t : h.tensors) {
    ranges.emplace_back(t.offset, t.offset + t.nbytes);
  }
  FUZZ_CHECK(std::is_sorted(ranges.begin(), ranges.end(),
                            [](const auto& a, const auto& b) { return a.first < b.first; }),
             "tensors not sorted by offset");
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t at = h.header_bytes;
  for (const auto& [begin, end] : ranges) {
    FUZZ_CHECK(begin == at, "a gap or an overlap in the data region");
    at = end;
  }
  FUZZ_CHECK(at == file_size, "the tensors do not reach the end of the file");
}

}  // namespace
}  // namespace ferry::io

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ferry::io;
  FuzzedDataProvider in(data, size);
  const std::uint64_t data_bytes = in.ConsumeIntegral<std::uint64_t>();
  const std::string text = in.ConsumeRemainingBytesAsString();
  const std::uint64_t file_size = 8 + text.size() + data_bytes;  // wraps on purpose
  const std::string display = "fuzz.safetensors";

  const Outcome plain =
      attempt([&] { return detail::parse_header_plain(text, file_size, display); });
  const Outcome sax = attempt([&] { return detail::parse_header_sax(text, file_size, display); });
  const Outcome doc = attempt(
      [&] { return std::optional(detail::parse_header_document(text, file_size, display)); });
  const Outcome api =
      attempt([&] { return std::optional(parse_safetensors_header(text, file_size, display)); });

  FUZZ_CHECK(doc.refused != doc.header.has_value());
  FUZZ_CHECK(api.refused == doc.refused, "parse_safetensors_header disagrees with the document");
  for (const Outcome* fast : {&plain, &sax}) {
    if (fast->header) {
      FUZZ_CHECK(doc.header.has_value(), "a fast path accepts what the document path refuses");
      FUZZ_CHECK(same_header(*fast->header, *doc.header), "a fast path reads another header");
    }
    if (fast->refused) {
      FUZZ_CHECK(doc.refused, "a fast path refuses what the document path accepts");
    }
  }
  if (doc.header) {
    FUZZ_CHECK(same_header(*api.header, *doc.header));
    check_accepted(text, file_size, *doc.header);
  }
  return 0;
}
