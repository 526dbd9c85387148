// The GGUF header parser (io::parse_gguf_header over bytes in memory), fed
// arbitrary files.
//
// Input: the whole file.
//
// Asserted for every header accepted:
//  - the format's rules, checked again independently: version 2 or 3; alignment a
//    power of two, general.alignment a u32 when present; the data section at
//    header_bytes rounded up to it; every tensor 1-4 dims none 0, a 1-63 byte name
//    of its own, a known type, dims[0] whole blocks, nbytes = rows x row bytes (no
//    overflow, in 128 bits), offset = data + relative offset, aligned, inside the
//    file; tensors sorted by offset and disjoint;
//  - differential: parsed again keeping no array elements, the same keys, value
//    types, scalars and array counts, and the same tensors;
//  - round trip: where every array was kept and the alignment is at most 4096, the
//    header and the tensors' bytes written again by io::gguf_file_bytes parse back to
//    equal metadata and equal tensors with equal bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "fuzz/fuzz_check.hpp"
#include "io/gguf.hpp"
#include "io/gguf_types.hpp"
#include "io/gguf_writer.hpp"

namespace ferry::io {
namespace {

bool same_value(const GgufValue& a, const GgufValue& b, bool elements) {
  if (a.type != b.type || a.u != b.u || a.i != b.i || a.s != b.s ||
      std::memcmp(&a.f, &b.f, sizeof(double)) != 0) {
    return false;
  }
  if (a.type != GgufValueType::kArray) {
    return true;
  }
  if (a.element_type != b.element_type || a.count != b.count) {
    return false;
  }
  if (!elements) {
    return true;
  }
  if (a.kept != b.kept || a.elements.size() != b.elements.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.elements.size(); ++i) {
    if (!same_value(a.elements[i], b.elements[i], true)) {
      return false;
    }
  }
  return true;
}

bool all_kept(const GgufValue& v) {
  if (v.type != GgufValueType::kArray) {
    return true;
  }
  if (!v.kept) {
    return false;
  }
  for (const GgufValue& e : v.elements) {
    if (!all_kept(e)) {
      return false;
    }
  }
  return true;
}

bool same_tensor(const GgufTensorInfo& a, const GgufTensorInfo& b) {
  return a.name == b.name && a.dims == b.dims && a.type == b.type && a.nbytes == b.nbytes;
}

void check_rules(const GgufHeader& h, std::size_t size) {
  FUZZ_CHECK(h.version == 2 || h.version == 3);
  FUZZ_CHECK(h.file_size == size);
  FUZZ_CHECK(h.alignment != 0 && (h.alignment & (h.alignment - 1)) == 0);
  if (const GgufValue* a = h.find("general.alignment")) {
    FUZZ_CHECK(a->type == GgufValueType::kU32 && a->u == h.alignment);
  } else {
    FUZZ_CHECK(h.alignment == 32);
  }
  FUZZ_CHECK(h.header_bytes >= 24 && h.header_bytes <= size);
  FUZZ_CHECK(h.data_offset % h.alignment == 0 && h.data_offset >= h.header_bytes &&
             h.data_offset - h.header_bytes < h.alignment);
  std::vector<std::string> names;
  std::uint64_t end = 0;
  for (const GgufTensorInfo& t : h.tensors) {
    FUZZ_CHECK(!t.name.empty() && t.name.size() <= 63, t.name);
    names.push_back(t.name);
    FUZZ_CHECK(t.dims.size() >= 1 && t.dims.size() <= 4, t.name);
    const GgmlTypeTraits* traits = find_ggml_type(static_cast<std::uint32_t>(t.type));
    FUZZ_CHECK(traits != nullptr, t.name);
    FUZZ_CHECK(t.dims[0] % traits->block_size == 0, t.name);
    unsigned __int128 elements = 1;
    for (std::uint64_t d : t.dims) {
      FUZZ_CHECK(d != 0, t.name);
      elements *= d;
      FUZZ_CHECK(elements <= ~std::uint64_t{0}, t.name);
    }
    const unsigned __int128 bytes = elements / traits->block_size * traits->type_size;
    FUZZ_CHECK(bytes == t.nbytes, t.name);
    FUZZ_CHECK(t.relative_offset % h.alignment == 0, t.name);
    FUZZ_CHECK(static_cast<unsigned __int128>(h.data_offset) + t.relative_offset == t.offset,
               t.name);
    FUZZ_CHECK(static_cast<unsigned __int128>(t.offset) + t.nbytes <= size, t.name);
    FUZZ_CHECK(t.offset >= end, "tensors unsorted or overlapping at " + t.name);
    end = t.offset + t.nbytes;
  }
  std::sort(names.begin(), names.end());
  FUZZ_CHECK(std::adjacent_find(names.begin(), names.end()) == names.end(), "a name twice");
}

void check_differential(std::span<const std::byte> in, const GgufHeader& h) {
  GgufParseOptions none;
  none.max_kept_array = 0;
  GgufHeader other;
  try {
    other = parse_gguf_header(in, "fuzz.gguf", none);
  } catch (const Error& e) {
    FUZZ_CHECK(false, std::string("refused when keeping no elements: ") + e.what());
  }
  FUZZ_CHECK(other.metadata.size() == h.metadata.size());
  auto b = other.metadata.cbegin();
  for (auto a = h.metadata.cbegin(); a != h.metadata.cend(); ++a, ++b) {
    FUZZ_CHECK(a->first == b->first);
    FUZZ_CHECK(same_value(a->second, b->second, false), a->first);
  }
  FUZZ_CHECK(other.tensors.size() == h.tensors.size());
  for (std::size_t i = 0; i < h.tensors.size(); ++i) {
    FUZZ_CHECK(same_tensor(h.tensors[i], other.tensors[i]));
    FUZZ_CHECK(h.tensors[i].offset == other.tensors[i].offset);
  }
  FUZZ_CHECK(other.data_offset == h.data_offset);
}

void check_round_trip(std::span<const std::byte> in, const GgufHeader& h) {
  if (h.alignment > 4096) {
    return;
  }
  GgufMetadata meta;
  for (const auto& [key, value] : h.metadata) {
    if (!all_kept(value)) {
      return;
    }
    if (key != "general.alignment") {
      meta.emplace_back(key, value);
    }
  }
  std::vector<GgufWriterTensor> tensors;
  std::vector<std::span<const std::byte>> data;
  for (const GgufTensorInfo& t : h.tensors) {
    tensors.push_back({t.name, t.type, t.dims});
    data.push_back(in.subspan(t.offset, t.nbytes));
  }
  std::vector<std::byte> again;
  try {
    again = gguf_file_bytes(meta, tensors, data, h.alignment);
  } catch (const Error& e) {
    FUZZ_CHECK(false, std::string("the writer refuses an accepted header: ") + e.what());
  }
  GgufHeader back;
  try {
    back = parse_gguf_header(again, "again.gguf");
  } catch (const Error& e) {
    FUZZ_CHECK(false, std::string("the writer's file does not parse: ") + e.what());
  }
  FUZZ_CHECK(back.alignment == h.alignment);
  // general.alignment is the writer's: written when not 32, whatever the input said.
  const auto keys = [](const GgufHeader& x) {
    return x.metadata.size() - (x.find("general.alignment") != nullptr ? 1 : 0);
  };
  FUZZ_CHECK(keys(back) == keys(h));
  for (const auto& [key, value] : h.metadata) {
    if (key == "general.alignment") {
      continue;
    }
    const GgufValue* v = back.find(key);
    FUZZ_CHECK(v != nullptr, key);
    FUZZ_CHECK(same_value(value, *v, true), key);
  }
  FUZZ_CHECK(back.tensors.size() == h.tensors.size());
  for (std::size_t i = 0; i < h.tensors.size(); ++i) {
    const GgufTensorInfo& a = h.tensors[i];
    const GgufTensorInfo& b = back.tensors[i];
    FUZZ_CHECK(same_tensor(a, b), a.name);
    FUZZ_CHECK(std::memcmp(in.data() + a.offset, again.data() + b.offset, a.nbytes) == 0, a.name);
  }
}

}  // namespace
}  // namespace ferry::io

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ferry::io;
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  GgufHeader h;
  try {
    h = parse_gguf_header(in, "fuzz.gguf");
  } catch (const ferry::Error&) {
    return 0;  // a clean refusal
  }
  check_rules(h, size);
  check_differential(in, h);
  check_round_trip(in, h);
  return 0;
}
