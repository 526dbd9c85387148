// SGLang's sharded_state checkpoints (model.load_format=sharded_state, issue 34): each
// tp rank's state dict as the engine holds it after loading, in files named as
// SGLang 0.5.23's ShardedStateLoader.DEFAULT_PATTERN names them
// (python/sglang/srt/model_loader/loader.py):
//
//   <folder>/model-rank-<tp rank>-part-<part>.safetensors
//
// A rank's parts are plain safetensors files (no alignment padding: SGLang's reader
// takes every tensor of a rank's files for a param), their tensors named as the
// params. SGLang writes no manifest and no READY: a rank's files are its state.
// This header is the naming; runtime/sharded_state.hpp reads and writes the folder.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::io {

// "model-rank-<rank>-part-<part>.safetensors".
std::string sharded_state_file(int rank, int part);

struct ShardedStateName {
  int rank = 0;
  int part = 0;
};
// The rank and part of a file name SGLang's pattern makes (decimal numbers without
// sign or leading zeros beyond "0", below 2^31); nullopt for any other name.
std::optional<ShardedStateName> parse_sharded_state_file(std::string_view name);

// The folder's sharded_state files, by rank, each rank's names sorted by part (a
// name parse refuses, such as "part-01", is not one of them). Throws
// Error(Stage::kDiscovery) when the folder cannot be listed.
std::map<int, std::vector<std::string>> list_sharded_state(const std::string& folder);

}  // namespace ferry::io
