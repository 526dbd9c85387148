// SGLang's sharded_state checkpoints in the runtime (model.load_format=sharded_state,
// load.save_sharded_state, `ferry save --format sharded_state`): each tp rank's state
// dict in model-rank-<r>-part-<p>.safetensors (io/sharded_state.hpp), as SGLang
// 0.5.23's ShardedStateLoader writes and reads it (model_loader/loader.py:
// save_model, load_model). SGLang names a rank's files by its tp rank alone, so a
// folder holds one pipeline stage; with pp > 1 ferry keeps each stage's files in the
// folder's pp-<stage>/ (a ferry extension: SGLang 0.5.23 has no sharded_state for
// pp > 1).
#pragma once

#include <string>

#include "models/sharded_state_model.hpp"
#include "runtime/load_config.hpp"
#include "runtime/load_work.hpp"
#include "runtime/plan_report.hpp"

namespace ferry::runtime {

inline constexpr const char* kShardedState = "sharded_state";  // ResolvedCheckpoint::stored_format

// The folder of this process's pipeline stage under `root`: root itself, or
// root/pp-<stage> when pp > 1.
std::string sharded_state_folder(const LoadConfig& config, const std::string& root);

// How SGLang names this model's state dict: a tied embedding stored as lm_head.weight
// where SGLang's model class registers lm_head as the embedding (every supported
// family but Gemma and Gemma 2, with one pipeline stage), and Gemma 2's
// model.normalizer buffer. Throws Error(Stage::kConfig) for a Gemma 2 config without
// a hidden_size.
models::ShardedStateNaming sharded_state_naming(const LoadConfig& config,
                                                const nlohmann::json& hf_config);

// model.load_format=sharded_state: the local tp ranks' files in the stage's folder
// of model.path, indexed; config.json from model.path. Throws Error(Stage::kDiscovery)
// naming the folder when a local rank has no files, or when the folder holds files
// of a tp rank the layout does not have (a save with a larger tp).
ResolvedCheckpoint resolve_sharded_state(const LoadConfig& config);

// Saves every local rank's params (made by `config` over `hf_config`, read from the
// checkpoint in `source_folder`) in the stage's folder of `root`: each rank's params
// in its shell's order, less what SGLang's state dict lacks (MLA's w_kc, w_vc,
// w_scale), in parts of at most save.max_file_bytes (one tensor at least). Beside
// them config.json and the checkpoint's small metadata files (tokenizer, generation
// config), unless already there. Refuses a folder that holds a local rank's files
// already (a sharded_state folder has no signature to tell whether they match); on
// an error, removes the files it wrote. Returns the folder. Throws
// Error(Stage::kOutput).
std::string save_sharded_state(const LoadedModel::State& state, const LoadConfig& config,
                               const nlohmann::json& hf_config, const std::string& source_folder,
                               const std::string& root);

}  // namespace ferry::runtime
