#include "models/presharded_model.hpp"

#include <filesystem>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/error.hpp"

namespace ferry::models {
namespace {

// One local rank's param that a stored tensor fills.
struct Target {
  std::size_t local_rank = 0;
  std::size_t param = 0;
  const io::PreshardedParam* entry = nullptr;  // in the manifest the model keeps
};

class PreshardedModel final : public Model {
 public:
  PreshardedModel(std::shared_ptr<const Model> base, const io::PreshardedManifest& manifest,
                  std::string manifest_file)
      : base_(std::move(base)), manifest_(manifest), file_(std::move(manifest_file)) {
    const ParallelLayout& layout = base_->layout();
    if (manifest_.pp_rank != layout.pp_rank) {
      bad("", "the folder holds pipeline stage " + std::to_string(manifest_.pp_rank) +
                  ", the load asks stage " + std::to_string(layout.pp_rank));
    }
    std::unordered_map<int, const io::PreshardedRank*> by_tp;
    std::string held;
    for (const io::PreshardedRank& r : manifest_.ranks) {
      by_tp.emplace(r.tp_rank, &r);
      held += (held.empty() ? "" : ",") + std::to_string(r.tp_rank);
    }
    for (std::size_t i = 0; i < base_->shells().size(); ++i) {
      const RankShell& shell = base_->shells()[i];
      auto it = by_tp.find(shell.tp_rank);
      if (it == by_tp.end()) {
        bad("", "tp rank " + std::to_string(shell.tp_rank) +
                    " is not in the folder (it holds tp ranks " + held + ")");
      }
      add_rank(i, shell, *it->second);
    }
    for (const io::PreshardedRank& r : manifest_.ranks) {
      for (const io::PreshardedParam& p : r.params) {
        stored_.insert(p.tensor);
      }
    }
  }

  std::string family() const override { return base_->family(); }
  const ParallelLayout& layout() const override { return base_->layout(); }
  const std::vector<RankShell>& shells() const override { return shells_; }
  std::vector<Piece> fill_pieces() const override { return {}; }
  std::vector<std::string> notes() const override { return base_->notes(); }

  Route route(const io::TensorInfo& tensor) const override {
    Route route;
    auto it = targets_.find(tensor.name);
    if (it == targets_.end()) {
      if (stored_.contains(tensor.name)) {
        route.kind = RouteKind::kDropped;
        route.reason = "other_rank";
      } else if (tensor.name.rfind("__pad__.", 0) == 0) {
        route.kind = RouteKind::kDropped;
        route.reason = "padding";
      } else {
        route.kind = RouteKind::kUnmapped;
        route.reason = "unknown_name";
      }
      return route;
    }
    for (const Target& t : it->second) {
      const io::PreshardedParam& e = *t.entry;
      const std::string file = std::filesystem::path(tensor.file).filename().string();
      if (file != e.file || tensor.offset != e.offset || tensor.nbytes != e.nbytes) {
        throw Error(Stage::kIndex, tensor.file, tensor.name,
                    "presharded: the manifest stores param '" + e.name + "' in " + e.file +
                        " at byte " + std::to_string(e.offset) + " (" + std::to_string(e.nbytes) +
                        " bytes); the file's header puts tensor '" + tensor.name + "' in " + file +
                        " at byte " + std::to_string(tensor.offset) + " (" +
                        std::to_string(tensor.nbytes) + " bytes)");
      }
      if (e.nbytes == 0) {
        continue;
      }
      const std::uint64_t es = dtype_size(tensor.dtype);
      if (e.nbytes % es != 0) {
        throw Error(Stage::kIndex, tensor.file, tensor.name,
                    "presharded: " + std::to_string(e.nbytes) + " bytes are not whole " +
                        std::string(dtype_name(tensor.dtype)) + " elements");
      }
      Piece p;
      p.local_rank = t.local_rank;
      p.param = t.param;
      p.rows = 1;
      p.width_elems = e.nbytes / es;
      p.dst_pitch = p.src_pitch = e.nbytes;
      p.src_dtype = p.dst_dtype = tensor.dtype;
      route.pieces.push_back(p);
    }
    route.src_begin = 0;
    route.src_end = route.pieces.empty() ? 0 : tensor.nbytes;
    if (route.pieces.empty()) {
      route.kind = RouteKind::kDropped;
      route.reason = "empty";
    }
    return route;
  }

 private:
  [[noreturn]] void bad(const std::string& param, const std::string& what) const {
    throw Error(Stage::kIndex, file_, param, "presharded: " + what);
  }

  void add_rank(std::size_t local, const RankShell& shell, const io::PreshardedRank& stored) {
    RankShell& out = shells_.emplace_back();
    out.tp_rank = shell.tp_rank;
    for (const ParamSpec& spec : shell.params) {
      if (spec.transient) {
        continue;
      }
      ParamSpec kept = spec;
      kept.loaded_shape.clear();  // stored as the hooks left it
      out.by_name.emplace(kept.name, out.params.size());
      out.params.push_back(std::move(kept));
    }
    const std::string rank = " (tp rank " + std::to_string(shell.tp_rank) + ")";
    for (std::size_t k = 0; k < std::max(out.params.size(), stored.params.size()); ++k) {
      if (k >= stored.params.size()) {
        bad(out.params[k].name, "the folder does not store this param" + rank);
      }
      const io::PreshardedParam& e = stored.params[k];
      if (k >= out.params.size() || out.params[k].name != e.name) {
        bad(e.name, "the folder stores this param where the layout has " +
                        (k < out.params.size() ? "'" + out.params[k].name + "'"
                                               : std::string("no more params")) +
                        rank);
      }
      const ParamSpec& spec = out.params[k];
      if (spec.dtype != e.dtype || spec.shape != e.shape || spec.nbytes != e.nbytes) {
        bad(e.name, "the folder stores it as " + std::string(dtype_name(e.dtype)) +
                        format_shape(e.shape) + " (" + std::to_string(e.nbytes) +
                        " bytes), the layout asks " + std::string(dtype_name(spec.dtype)) +
                        format_shape(spec.shape) + " (" + std::to_string(spec.nbytes) + " bytes)" +
                        rank);
      }
      targets_[e.tensor].push_back({local, k, &e});
    }
  }

  std::shared_ptr<const Model> base_;
  io::PreshardedManifest manifest_;  // targets_ point into it
  std::string file_;
  std::vector<RankShell> shells_;
  std::unordered_map<std::string, std::vector<Target>> targets_;  // stored tensor -> params
  std::unordered_set<std::string> stored_;                        // every stored tensor
};

}  // namespace

std::shared_ptr<const Model> make_presharded_model(std::shared_ptr<const Model> base,
                                                   const io::PreshardedManifest& manifest,
                                                   const std::string& manifest_file) {
  return std::make_shared<PreshardedModel>(std::move(base), manifest, manifest_file);
}

}  // namespace ferry::models
