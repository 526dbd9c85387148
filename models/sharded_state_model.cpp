#include "models/sharded_state_model.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "io/sharded_state.hpp"

namespace ferry::models {
namespace {

constexpr const char* kLmHead = "lm_head.weight";

std::string file_name(const std::string& file) {
  return std::filesystem::path(file).filename().string();
}

class ShardedStateModel final : public Model {
 public:
  ShardedStateModel(std::shared_ptr<const Model> base, const io::CheckpointIndex& index,
                    const StoredState& stored, const ShardedStateNaming& naming, std::string folder,
                    std::string format)
      : base_(std::move(base)), folder_(std::move(folder)), format_(std::move(format)) {
    std::map<int, std::size_t> local;  // tp rank -> index into shells
    for (std::size_t i = 0; i < base_->shells().size(); ++i) {
      RankShell shell = base_->shells()[i];
      for (ParamSpec& p : shell.params) {
        if (p.transient) {
          bad("", p.name,
              "the load converts this param from one it loads only for that (" +
                  std::string(dtype_name(p.dtype)) + format_shape(p.shape) +
                  ", e.g. quantization.online or a fused param): a state dict holds the "
                  "conversion's result and nothing to make it from again; read this "
                  "layout from ferry's own model.load_format=presharded, or load the checkpoint");
        }
        p.loaded_shape.clear();  // stored as the hooks left it
      }
      local.emplace(shell.tp_rank, i);
      shells_.push_back(std::move(shell));
    }
    keep_hooks();
    std::unordered_map<std::string, const io::TensorInfo*> infos;  // key(file, tensor)
    for (const io::TensorInfo& t : index.tensors) {
      infos.emplace(key(file_name(t.file), t.name), &t);
    }
    for (const ShardedStateNaming::Extra& x : naming.extras) {
      buffers_.insert(x.name);
    }
    for (const auto& [tp_rank, entries] : stored) {
      auto at = local.find(tp_rank);
      if (at == local.end()) {
        continue;
      }
      const std::size_t r = at->second;
      const RankShell& shell = shells_[r];
      const std::string rank = " (tp rank " + std::to_string(tp_rank) + ")";
      std::map<std::size_t, std::string> filled;  // param -> key(file, tensor)
      for (const StoredTensor& e : entries) {
        auto info = infos.find(key(e.file, e.tensor));
        if (info == infos.end()) {
          bad(e.file, e.tensor,
              "the folder says param '" + e.name + "' is stored here" + rank +
                  ", and the file holds no such tensor");
        }
        const io::TensorInfo& t = *info->second;
        if (e.extra) {
          extras_.insert(key(e.file, e.tensor));
          continue;  // a tensor attribute; what ferry holds of these, its hooks make
        }
        auto buffer =
            std::find_if(naming.extras.begin(), naming.extras.end(),
                         [&](const ShardedStateNaming::Extra& x) { return x.name == e.name; });
        if (buffer != naming.extras.end()) {
          if (buffer->dtype != t.dtype || buffer->shape != t.shape) {
            bad(e.file, e.name,
                "stored as " + std::string(dtype_name(t.dtype)) + format_shape(t.shape) +
                    ", the model's buffer is " + std::string(dtype_name(buffer->dtype)) +
                    format_shape(buffer->shape) + rank);
          }
          buffers_.insert(e.tensor);
          continue;
        }
        std::string name = e.name;
        if (!naming.tied_embedding.empty() && name == kLmHead && !shell.by_name.contains(kLmHead)) {
          name = naming.tied_embedding;
        }
        auto it = shell.by_name.find(name);
        if (it == shell.by_name.end() || sglang_state_dict_lacks(name)) {
          bad(e.file, e.name,
              "the rank's state holds no param of this name" + rank +
                  ": the folder was saved from another model, layout or postprocess.target "
                  "(SGLang saves what its GPU's post-processing left: postprocess.target=sm90 "
                  "or sm100 holds that; loader, the checkpoint's layout)");
        }
        const std::string where = key(e.file, e.tensor);
        if (auto [prev, fresh] = filled.emplace(it->second, where); !fresh) {
          if (prev->second == where) {
            continue;  // one storage under two names (a tied embedding)
          }
          bad(e.file, e.name, "stored twice for one rank" + rank);
        }
        const ParamSpec& spec = shell.params[it->second];
        if (spec.dtype != t.dtype || spec.shape != t.shape || spec.nbytes != t.nbytes) {
          bad(e.file, e.name,
              "stored as " + std::string(dtype_name(t.dtype)) + format_shape(t.shape) + " (" +
                  std::to_string(t.nbytes) + " bytes), the layout has " +
                  std::string(dtype_name(spec.dtype)) + format_shape(spec.shape) + " (" +
                  std::to_string(spec.nbytes) + " bytes)" + rank +
                  ": the folder was saved for another layout, dtype or postprocess target");
        }
        targets_[where].push_back(Target{r, it->second});
      }
      std::vector<std::string> missing;
      for (std::size_t k = 0; k < shell.params.size(); ++k) {
        if (!sglang_state_dict_lacks(shell.params[k].name) && !filled.contains(k)) {
          missing.push_back(shell.params[k].name);
        }
      }
      if (!missing.empty()) {
        std::string list;
        for (std::size_t i = 0; i < missing.size() && i < 5; ++i) {
          list += (i == 0 ? "" : ", ") + missing[i];
        }
        if (missing.size() > 5) {
          list += ", ... (" + std::to_string(missing.size()) + " in all)";
        }
        bad("", missing.front(),
            "tp rank " + std::to_string(tp_rank) + "'s files do not hold " +
                std::to_string(missing.size()) + " of its params: " + list);
      }
    }
    for (const auto& [tp_rank, i] : local) {
      if (!stored.contains(tp_rank)) {
        bad("", "", "nothing is stored for tp rank " + std::to_string(tp_rank));
      }
    }
  }

  std::string family() const override { return base_->family(); }
  const ParallelLayout& layout() const override { return base_->layout(); }
  const std::vector<RankShell>& shells() const override { return shells_; }
  std::vector<Piece> fill_pieces() const override { return {}; }
  std::vector<PostLoadHook> hooks() const override { return hooks_; }
  std::vector<std::string> notes() const override { return base_->notes(); }

  Route route(const io::TensorInfo& tensor) const override {
    Route route;
    const std::string k = key(file_name(tensor.file), tensor.name);
    auto it = targets_.find(k);
    if (it == targets_.end()) {
      route.kind = RouteKind::kDropped;
      route.reason = buffers_.contains(tensor.name) ? "config_buffer"
                     : extras_.contains(k)          ? "sglang_extra"
                                                    : "other_rank";
      return route;
    }
    if (tensor.nbytes == 0) {
      route.kind = RouteKind::kDropped;
      route.reason = "empty";
      return route;
    }
    for (const Target& t : it->second) {
      Piece p;
      p.local_rank = t.local_rank;
      p.param = t.param;
      p.rows = 1;
      p.width_elems = tensor.nbytes / dtype_size(tensor.dtype);
      p.dst_pitch = p.src_pitch = tensor.nbytes;
      p.src_dtype = p.dst_dtype = tensor.dtype;
      route.pieces.push_back(p);
    }
    route.src_begin = 0;
    route.src_end = tensor.nbytes;
    return route;
  }

 private:
  struct Target {
    std::size_t local_rank = 0;
    std::size_t param = 0;
  };

  static std::string key(const std::string& file, const std::string& tensor) {
    return file + '\0' + tensor;
  }

  [[noreturn]] void bad(const std::string& file, const std::string& tensor,
                        const std::string& what) const {
    throw Error(Stage::kIndex, file.empty() ? folder_ : folder_ + "/" + file, tensor,
                format_ + ": " + what);
  }

  // The base's hooks that make what SGLang's state dict lacks (its post_load_weights
  // does the same); every other hook made what the files hold, and is not run again.
  void keep_hooks() {
    std::vector<PostLoadHook> all = base_->hooks();
    std::vector<std::set<std::size_t>> rewritten(shells_.size());  // by a hook not kept
    std::vector<std::set<std::size_t>> made(shells_.size());       // by a kept hook
    for (PostLoadHook& h : all) {
      const RankShell& shell = shells_.at(h.local_rank);
      std::size_t lacking = 0;
      for (std::size_t out : h.outputs) {
        lacking += sglang_state_dict_lacks(shell.params[out].name) ? 1 : 0;
      }
      if (lacking != 0 && (lacking != h.outputs.size() || !h.rewrites.empty())) {
        bad("", h.name, "internal: a hook makes params SGLang's state dict holds and lacks");
      }
      if (lacking == 0) {
        rewritten[h.local_rank].insert(h.rewrites.begin(), h.rewrites.end());
        rewritten[h.local_rank].insert(h.outputs.begin(), h.outputs.end());
        continue;
      }
      made[h.local_rank].insert(h.outputs.begin(), h.outputs.end());
      hooks_.push_back(std::move(h));
    }
    for (const PostLoadHook& h : hooks_) {
      for (std::size_t in : h.inputs) {
        if (rewritten[h.local_rank].contains(in)) {
          bad("", shells_[h.local_rank].params[in].name,
              "the hook " + h.name +
                  " reads this param, which the load's post-processing rewrites: the "
                  "stored param is past that, and the hook's outputs cannot be made from "
                  "it again; read this layout from model.load_format=presharded, or save "
                  "it with postprocess.target=loader");
        }
      }
    }
    for (std::size_t r = 0; r < shells_.size(); ++r) {
      for (std::size_t k = 0; k < shells_[r].params.size(); ++k) {
        const std::string& name = shells_[r].params[k].name;
        if (sglang_state_dict_lacks(name) && !made[r].contains(k)) {
          bad("", name, "internal: SGLang's state dict lacks this param and no hook makes it");
        }
      }
    }
  }

  std::shared_ptr<const Model> base_;
  std::string folder_;
  std::string format_;  // for errors: "sharded_state", "SGLang presharded"
  std::vector<RankShell> shells_;
  std::vector<PostLoadHook> hooks_;
  std::unordered_map<std::string, std::vector<Target>> targets_;  // key(file, tensor)
  std::unordered_set<std::string> buffers_;  // tensors of ShardedStateNaming::extras
  std::unordered_set<std::string> extras_;   // key(file, tensor) of SGLang's extras
};

}  // namespace

bool sglang_state_dict_lacks(const std::string& param) {
  for (const char* attr : {"self_attn.w_kc", "self_attn.w_vc", "self_attn.w_scale"}) {
    if (param.ends_with(attr)) {
      return true;
    }
  }
  return false;
}

std::string sharded_state_name(const std::string& param, const ShardedStateNaming& naming) {
  return !naming.tied_embedding.empty() && param == naming.tied_embedding ? kLmHead : param;
}

StoredState sharded_state_entries(const io::CheckpointIndex& index) {
  StoredState out;
  for (const io::TensorInfo& t : index.tensors) {
    const std::string file = file_name(t.file);
    if (const std::optional<io::ShardedStateName> n = io::parse_sharded_state_file(file)) {
      out[n->rank].push_back({file, t.name, t.name, false});
    }
  }
  return out;
}

std::shared_ptr<const Model> make_state_dict_model(
    std::shared_ptr<const Model> base, const io::CheckpointIndex& index, const StoredState& stored,
    const ShardedStateNaming& naming, const std::string& folder, const std::string& format) {
  return std::make_shared<ShardedStateModel>(std::move(base), index, stored, naming, folder,
                                             format);
}

}  // namespace ferry::models
