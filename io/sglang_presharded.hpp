// SGLang's presharded folders (SGLang 0.5.23, model_loader/loader.py,
// PreshardedModelLoader): the post-processed state of every rank of one launch,
// deduplicated by content across ranks and names:
//
//   <model>/presharded/TP-<tp>-sig-<16 hex>/   (sha1 of the shard config, sorted JSON)
//     checksum.json                            the plan (parsed below)
//     model-<id:05d>-common.safetensor         tensors every rank reads
//     model-<id:05d>-rank-<r:03d>,....safetensor tensors some ranks read
//     READY                                    written last, by world rank 0
//
// Each stored tensor is named by its stored key: the XXH3-128 (hex) of
// str(tuple(shape)) + str(dtype) and then its bytes (_hash_tensor). The plan says,
// for each world rank (pp rank * tp + tp rank), which stored key of which file each
// of its state dict names (and "extras": plain tensor attributes such as MLA's w_kc)
// reads. This header is the plan's parser and the stored key; the runtime reads the
// folder (runtime/presharded.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "common/xxh3.hpp"

namespace ferry::io {

inline constexpr const char* kSglangPlan = "checksum.json";
inline constexpr int kSglangPlanVersion = 1;  // PreshardedModelLoader.PLAN_VERSION

struct SglangRead {
  std::string file;        // "filename", relative to the folder
  std::string stored_key;  // the tensor's name in that file
  std::string name;        // the state dict name (or extra attribute) it fills
  bool extra = false;      // "is_extra"
};

struct SglangPlan {
  int world_size = 0;
  std::map<int, std::vector<SglangRead>> reads;  // world rank -> "rank_to_reads"
  nlohmann::json shard_config;                   // as stored ("shard_config")
};

// Parses checksum.json. Throws Error(Stage::kIndex) naming `file` and the field for
// anything that is not the plan SGLang 0.5.23 writes: another version, a world rank
// outside the world size, a file name with a path in it, a stored key that is not
// 32 hex digits, a read whose fields are missing or of another type.
SglangPlan parse_sglang_plan(const nlohmann::json& doc, const std::string& file);

// torch's str(dtype) ("torch.bfloat16", "torch.float8_e4m3fn", ...).
std::string torch_dtype_name(DType dtype);

// The stored key of a tensor of `dtype` and `shape` holding `bytes` (_hash_tensor:
// XXH3-128 of str(tuple(shape)) + str(dtype), then the bytes in order).
Hash128 sglang_stored_key(DType dtype, const std::vector<std::uint64_t>& shape,
                          std::span<const std::byte> bytes);
// The same, over bytes given in pieces: the prefix, then update() per piece.
Xxh3Hasher sglang_key_hasher(DType dtype, const std::vector<std::uint64_t>& shape);

}  // namespace ferry::io
