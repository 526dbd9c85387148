// The model of a sharded_state read (model.load_format=sharded_state,
// runtime/sharded_state.hpp): each tp rank's files hold its state dict as SGLang's
// ShardedStateLoader saves it (SGLang 0.5.23, model_loader/loader.py), params named
// as the engine names them, after process_weights_after_loading. The family's own
// model for the layout gives the shells; each stored tensor is one whole, flat copy
// into the param of its name on the rank of its file. Nothing is sliced, cast,
// zero-filled or post-processed again, except what SGLang's state dict does not hold
// and its post_load_weights makes again from what it does: MLA attention's w_kc,
// w_vc and w_scale, which the family's own MLA hooks split from kv_b_proj.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "models/model.hpp"

namespace ferry::models {

// Whether SGLang's state dict lacks this param: MLA attention's w_kc, w_vc and
// w_scale are plain attributes that DeepseekV2AttentionMLA's post_load_weights sets
// (deepseek_v2.py), not parameters or buffers.
bool sglang_state_dict_lacks(const std::string& param);

struct ShardedStateNaming {
  // The param SGLang's model also registers as lm_head (a tied embedding:
  // `self.lm_head = self.model.embed_tokens`), whose state dict then names one
  // storage twice; ShardedStateLoader._filter_subtensors keeps the smaller name,
  // "lm_head.weight". Empty: no such param.
  std::string tied_embedding;
  // What SGLang's state dict holds beyond the params, computed from config.json:
  // Gemma 2's persistent buffer model.normalizer (sqrt(hidden_size), a scalar in the
  // model's dtype). A save writes each in every rank's first file (SGLang's reader
  // wants every state dict name); a read checks its dtype and shape and drops it
  // ("config_buffer"); ferry holds no param for it.
  struct Extra {
    std::string name;
    DType dtype = DType::kBF16;
    Shape shape;
    std::vector<std::byte> bytes;
  };
  std::vector<Extra> extras;
};

// The name `param` is stored under.
std::string sharded_state_name(const std::string& param, const ShardedStateNaming& naming);

// What the folder stores for a rank: each stored tensor (its file's name, its name
// in that file) and the state dict name it fills; `extra` for SGLang's plain tensor
// attributes (presharded's "is_extra": MLA's w_kc..., which the kept hooks make).
// One tensor may fill several names, and several ranks.
struct StoredTensor {
  std::string file;
  std::string tensor;
  std::string name;
  bool extra = false;
};
using StoredState = std::map<int, std::vector<StoredTensor>>;  // tp rank -> its tensors

// A sharded_state index's tensors, by the rank of their file's name: each stores the
// name it has.
StoredState sharded_state_entries(const io::CheckpointIndex& index);

// `base`: the family's model for the layout asked for; `index`: the files the local
// ranks read; `stored`: what they hold (tp ranks without a local shell are ignored).
// Checks, before anything is read, that each local rank's tensors fill exactly its
// params (each once, in its dtype and shape; one storage under a tied embedding's two
// names counts once), and that the base's hooks that make what the files lack read
// nothing that post-processing rewrote; throws Error(Stage::kIndex) naming `folder`,
// the file, the tensor and what differs (`format` opens the message).
// A base with transient params (loaded only to be converted) is refused: its state
// holds the conversion's result, and nothing to make it from again.
std::shared_ptr<const Model> make_state_dict_model(
    std::shared_ptr<const Model> base, const io::CheckpointIndex& index, const StoredState& stored,
    const ShardedStateNaming& naming, const std::string& folder, const std::string& format);

}  // namespace ferry::models
