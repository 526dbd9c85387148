// A torch.save archive read as byte ranges (io::parse_torch_checkpoint over memory:
// the zip directory, the local headers, the pickle, the storages), fed arbitrary
// files.
//
// Input: the whole file.
//
// Asserted: it ends in an index or a ferry::Error, in memory bounded by the input
// (the directory and pickle caps are the input's size); an accepted index's tensors
// are sorted by offset, lie inside the file, and overlap only as the very same view
// (tied weights).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "common/error.hpp"
#include "fuzz/fuzz_check.hpp"
#include "io/torch_checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ferry::io;
  const ReadAt read = [&](std::uint64_t offset, std::span<std::byte> into) {
    if (offset > size || into.size() > size - offset) {
      throw ferry::Error(ferry::Stage::kHeader, "fuzz.bin", "", "read past the end");
    }
    if (!into.empty()) {
      std::memcpy(into.data(), data + offset, into.size());
    }
  };
  SafetensorsHeader h;
  try {
    h = parse_torch_checkpoint(read, size, "fuzz.bin", size + 1);
  } catch (const ferry::Error&) {
    return 0;
  }
  const TensorInfo* reach = nullptr;
  for (const TensorInfo& t : h.tensors) {
    FUZZ_CHECK(t.offset <= size && t.nbytes <= size - t.offset, t.name);
    FUZZ_CHECK(t.nbytes % dtype_size(t.dtype) == 0, t.name);
    if (reach != nullptr) {
      FUZZ_CHECK(t.offset >= reach->offset, "not sorted by offset");
      if (t.nbytes != 0 && t.offset < reach->offset + reach->nbytes) {
        FUZZ_CHECK(t.offset == reach->offset && t.nbytes == reach->nbytes &&
                       t.shape == reach->shape && t.dtype == reach->dtype,
                   "an overlap that is not the same view: " + t.name);
        continue;
      }
    }
    if (t.nbytes != 0 &&
        (reach == nullptr || t.offset + t.nbytes > reach->offset + reach->nbytes)) {
      reach = &t;
    }
  }
  return 0;
}
