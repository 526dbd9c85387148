// A restricted unpickler for the state dict inside a torch.save archive
// (`<archive>/data.pkl`). It executes nothing: it knows the opcodes of pickle
// protocols 0 to 2 that a state dict needs, and the globals torch.load's
// weights_only mode allows for one (collections.OrderedDict, torch._utils's
// _rebuild_tensor_v2 / _v3 / _rebuild_parameter, the torch.*Storage types,
// torch.storage.UntypedStorage, torch.device, the dtype objects). Calling one of
// those builds a record (a tensor: its storage key, offset, shape, strides and
// dtype), never a Python object. Any other global, opcode or call is an error that
// names it, which is all a malicious pickle can reach.
//
// Bounded: each opcode makes at most one value, objects nest at most kMaxPickleDepth
// deep, integers past 64 bits are refused before their bytes are read, and nothing
// can be changed once it is inside another object (so no cycle can be made).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.hpp"

namespace ferry::io {

inline constexpr int kMaxPickleDepth = 32;

struct PickledTensor {
  std::string name;         // its key in the state dict
  std::string storage_key;  // the archive member `data/<key>` holding its storage
  DType dtype = DType::kU8;
  // The storage's element count as pickled: in elements of `dtype` for a typed
  // storage, in bytes for an untyped one (_rebuild_tensor_v3).
  std::uint64_t storage_numel = 0;
  bool untyped_storage = false;
  std::uint64_t storage_offset = 0;  // in elements of `dtype`
  std::vector<std::uint64_t> shape;
  std::vector<std::uint64_t> stride;  // in elements
};

// The tensors of the state dict pickled in `bytes`, in the dict's order. Throws
// ferry::Error(Stage::kHeader) naming `display` (and the key when there is one)
// for: an opcode outside the set (by name and offset), a global outside the
// allow-list, a call of an allowed global with arguments it does not take, a
// persistent id that is not ('storage', type, key, location, numel), nesting past
// kMaxPickleDepth, an integer past 64 bits, a change to an object already inside
// another, a key given twice, a value that is not a tensor, a top level that is
// not a dict, bytes past STOP or no STOP.
std::vector<PickledTensor> parse_state_dict_pickle(std::string_view bytes,
                                                   const std::string& display);

}  // namespace ferry::io
