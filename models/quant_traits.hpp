// One row per quantization method, as ggml's type_traits: what a method stores for a
// quantized weight (the weight's element type and packing, its scale's element type
// and grain, its companions). TableModel::apply_quant reads the row instead of
// testing the method, so a new method is a row here plus what is new about it.
#pragma once

#include <cstdint>

#include "common/dtype.hpp"
#include "models/model.hpp"

namespace ferry::models {

// Which weight elements share one scale element.
enum class ScaleGrain {
  kNone,     // not quantized
  kBlock,    // a [block_n, block_k] tile ([1, group_size] where group_blocks)
  kChannel,  // an output row: weight_scale [N, 1]
  kShard,    // a whole checkpoint tensor: one scalar a fused shard
};

struct QuantTraits {
  QuantScheme::Method method;
  const char* name;            // in errors: "NVFP4"
  DType weight_dtype;          // the quantized param's element type
  std::uint64_t values_per_byte;  // along K: 2 for E2M1 pairs (U8 [N, K / 2]), else 1
  DType scale_dtype;           // the weight scale's element type
  ScaleGrain grain;
  // The block is [1, group_size] (QuantScheme::group_size), not [block_n, block_k],
  // and every rank's share of K must be whole groups.
  bool group_blocks;
  bool second_scale;  // an F32 weight_scale_2 a shard (NVFP4's global scale)
  // The fused experts' w13_input_scale: one element an expert that w1's and then
  // w3's scalar write ([E], the FP8 methods), or each expert's row of shards with
  // the scalar loaded last in every element ([E, 2], NVFP4).
  bool merged_expert_input;
};

// The row of `method` (kNone's row has grain kNone).
const QuantTraits& quant_traits(QuantScheme::Method method);

}  // namespace ferry::models
