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

int rank_of(const io::TensorInfo& t) {
  const std::string name = std::filesystem::path(t.file).filename().string();
  const std::optional<io::ShardedStateName> n = io::parse_sharded_state_file(name);
  return n ? n->rank : -1;
}

class ShardedStateModel final : public Model {
 public:
  ShardedStateModel(std::shared_ptr<const Model> base, const io::CheckpointIndex& index,
                    const ShardedStateNaming& naming, std::string folder)
      : base_(std::move(base)), folder_(std::move(folder)) {
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
                  "layout from model.load_format=presharded, or load the checkpoint");
        }
        p.loaded_shape.clear();  // stored as the hooks left it
      }
      local.emplace(shell.tp_rank, i);
      shells_.push_back(std::move(shell));
    }
    keep_hooks();
    // What each local rank's files must hold: every param SGLang's state dict has.
    std::vector<std::map<std::string, std::size_t>> wanted(shells_.size());
    for (std::size_t r = 0; r < shells_.size(); ++r) {
      for (std::size_t k = 0; k < shells_[r].params.size(); ++k) {
        const std::string& name = shells_[r].params[k].name;
        if (!sglang_state_dict_lacks(name)) {
          wanted[r].emplace(sharded_state_name(name, naming), k);
        }
      }
    }
    for (const ShardedStateNaming::Extra& x : naming.extras) {
      extras_.insert(x.name);
    }
    std::vector<std::map<std::string, std::string>> seen(shells_.size());  // name -> file
    for (const io::TensorInfo& t : index.tensors) {
      const int tp_rank = rank_of(t);
      auto at = local.find(tp_rank);
      if (at == local.end()) {
        continue;  // not a local rank's file: route() drops it
      }
      const std::size_t r = at->second;
      const std::string rank = " (tp rank " + std::to_string(tp_rank) + ")";
      auto extra =
          std::find_if(naming.extras.begin(), naming.extras.end(),
                       [&](const ShardedStateNaming::Extra& x) { return x.name == t.name; });
      if (extra != naming.extras.end()) {
        if (extra->dtype != t.dtype || extra->shape != t.shape) {
          bad(t.file, t.name,
              "stored as " + std::string(dtype_name(t.dtype)) + format_shape(t.shape) +
                  ", the model's buffer is " + std::string(dtype_name(extra->dtype)) +
                  format_shape(extra->shape) + rank);
        }
        continue;
      }
      auto it = wanted[r].find(t.name);
      if (it == wanted[r].end()) {
        bad(t.file, t.name,
            "the rank's state holds no param of this name" + rank +
                ": the folder was saved from another model, layout or postprocess.target "
                "(SGLang saves what its GPU's post-processing left: postprocess.target=sm90 "
                "or sm100 holds that; loader, the checkpoint's layout)");
      }
      if (auto [prev, fresh] = seen[r].emplace(t.name, t.file); !fresh) {
        bad(t.file, t.name, "stored twice for one rank, in " + prev->second + " and " + t.file);
      }
      const ParamSpec& spec = shells_[r].params[it->second];
      if (spec.dtype != t.dtype || spec.shape != t.shape || spec.nbytes != t.nbytes) {
        bad(t.file, t.name,
            "stored as " + std::string(dtype_name(t.dtype)) + format_shape(t.shape) + " (" +
                std::to_string(t.nbytes) + " bytes), the layout has " +
                std::string(dtype_name(spec.dtype)) + format_shape(spec.shape) + " (" +
                std::to_string(spec.nbytes) + " bytes)" + rank +
                ": the folder was saved for another layout, dtype or postprocess target");
      }
      targets_.emplace(key(tp_rank, t.name), Target{r, it->second});
    }
    for (std::size_t r = 0; r < shells_.size(); ++r) {
      std::vector<std::string> missing;
      for (const auto& [name, k] : wanted[r]) {
        if (!seen[r].contains(name)) {
          missing.push_back(name);
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
            "tp rank " + std::to_string(shells_[r].tp_rank) + "'s files do not hold " +
                std::to_string(missing.size()) + " of its params: " + list);
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
    if (extras_.contains(tensor.name)) {
      route.kind = RouteKind::kDropped;
      route.reason = "config_buffer";
      return route;
    }
    auto it = targets_.find(key(rank_of(tensor), tensor.name));
    if (it == targets_.end()) {
      route.kind = RouteKind::kDropped;
      route.reason = "other_rank";
      return route;
    }
    if (tensor.nbytes == 0) {
      route.kind = RouteKind::kDropped;
      route.reason = "empty";
      return route;
    }
    Piece p;
    p.local_rank = it->second.local_rank;
    p.param = it->second.param;
    p.rows = 1;
    p.width_elems = tensor.nbytes / dtype_size(tensor.dtype);
    p.dst_pitch = p.src_pitch = tensor.nbytes;
    p.src_dtype = p.dst_dtype = tensor.dtype;
    route.pieces.push_back(p);
    route.src_begin = 0;
    route.src_end = tensor.nbytes;
    return route;
  }

 private:
  struct Target {
    std::size_t local_rank = 0;
    std::size_t param = 0;
  };

  static std::string key(int tp_rank, const std::string& name) {
    return std::to_string(tp_rank) + '\0' + name;
  }

  [[noreturn]] void bad(const std::string& file, const std::string& tensor,
                        const std::string& what) const {
    throw Error(Stage::kIndex, file.empty() ? folder_ : folder_ + "/" + file, tensor,
                "sharded_state: " + what);
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
  std::vector<RankShell> shells_;
  std::vector<PostLoadHook> hooks_;
  std::unordered_map<std::string, Target> targets_;  // key(tp rank, stored name)
  std::unordered_set<std::string> extras_;           // ShardedStateNaming::extras' names
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

std::shared_ptr<const Model> make_sharded_state_model(std::shared_ptr<const Model> base,
                                                      const io::CheckpointIndex& index,
                                                      const ShardedStateNaming& naming,
                                                      const std::string& folder) {
  return std::make_shared<ShardedStateModel>(std::move(base), index, naming, folder);
}

}  // namespace ferry::models
