// The restricted unpickler (io::parse_state_dict_pickle), fed arbitrary bytes.
//
// Input: the pickle's bytes.
//
// Asserted: it ends in a state dict or a ferry::Error (never a crash, a hang or
// another exception; ASan sees the memory), and an accepted one holds what a state
// dict can: distinct names, size and stride of one rank, a storage key, a storage
// element count the tensor's dtype can be read from.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.hpp"
#include "fuzz/fuzz_check.hpp"
#include "io/pickle.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ferry::io;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  std::vector<PickledTensor> tensors;
  try {
    tensors = parse_state_dict_pickle(bytes, "fuzz.bin (fuzz/data.pkl)");
  } catch (const ferry::Error&) {
    return 0;
  }
  std::set<std::string> names;
  for (const PickledTensor& t : tensors) {
    FUZZ_CHECK(names.insert(t.name).second, "two tensors named " + t.name);
    FUZZ_CHECK(t.shape.size() == t.stride.size(), t.name);
    FUZZ_CHECK(!t.storage_key.empty(), t.name);
  }
  // Each tensor took at least a key, a storage and a REDUCE from the bytes.
  FUZZ_CHECK(tensors.size() <= size / 8 + 1);
  return 0;
}
