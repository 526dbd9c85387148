#include "models/update_model.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include "common/error.hpp"
#include "models/coverage.hpp"

namespace ferry::models {
namespace {

[[noreturn]] void refuse(const std::string& tensor, const std::string& rule) {
  throw Error(Stage::kMapping, "", tensor, "update refused: " + rule);
}

// The route with only the pieces the filter keeps; dropped ("update_filter") when
// none are left.
Route filtered(Route route, const io::TensorInfo& tensor, const UpdateFilter& filter) {
  if (route.kind != RouteKind::kPlaced) {
    return route;
  }
  if (filter.keep_tensor && !filter.keep_tensor(tensor.name)) {
    route.pieces.clear();
  } else if (filter.only_params != nullptr) {
    const auto& only = *filter.only_params;
    std::erase_if(route.pieces, [&](const Piece& p) { return !only.at(p.local_rank).at(p.param); });
  }
  if (route.pieces.empty()) {
    return Route{RouteKind::kDropped, kUpdateFilterReason, {}, 0, 0};
  }
  route.src_begin = std::numeric_limits<std::uint64_t>::max();
  route.src_end = 0;
  for (const Piece& p : route.pieces) {
    route.src_begin = std::min(route.src_begin, p.src_offset);
    route.src_end = std::max(route.src_end, p.src_end());
  }
  return route;
}

class UpdateModel final : public Model {
 public:
  UpdateModel(std::shared_ptr<const Model> base, UpdateFilter filter,
              std::vector<std::vector<bool>> written, std::vector<PostLoadHook> hooks)
      : base_(std::move(base)),
        filter_(std::move(filter)),
        written_(std::move(written)),
        hooks_(std::move(hooks)) {
    // Pieces land only in params `written_` holds: all a kept piece lands in, or
    // the caller's only_params at most.
    filter_.only_params = &written_;
  }
  UpdateModel(const UpdateModel&) = delete;
  UpdateModel& operator=(const UpdateModel&) = delete;

  std::string family() const override { return base_->family(); }
  const ParallelLayout& layout() const override { return base_->layout(); }
  const std::vector<RankShell>& shells() const override { return base_->shells(); }
  Route route(const io::TensorInfo& tensor) const override {
    return filtered(base_->route(tensor), tensor, filter_);
  }
  std::vector<Piece> fill_pieces() const override {
    std::vector<Piece> out = base_->fill_pieces();
    std::erase_if(out, [&](const Piece& p) { return !written_.at(p.local_rank).at(p.param); });
    return out;
  }
  std::vector<PostLoadHook> hooks() const override { return hooks_; }
  std::vector<std::string> notes() const override { return {}; }  // said at the load

 private:
  std::shared_ptr<const Model> base_;
  UpdateFilter filter_;
  std::vector<std::vector<bool>> written_;
  std::vector<PostLoadHook> hooks_;
};

}  // namespace

std::shared_ptr<const Model> make_update_model(std::shared_ptr<const Model> base,
                                               const io::CheckpointIndex& index,
                                               const UpdateFilter& filter, UpdateSelection& out) {
  const auto& shells = base->shells();
  std::vector<std::vector<bool>> pieces(shells.size());  // written by a piece
  for (std::size_t r = 0; r < shells.size(); ++r) {
    pieces[r].assign(shells[r].params.size(), false);
  }
  for (const io::TensorInfo& t : index.tensors) {
    for (const Piece& p : filtered(base->route(t), t, filter).pieces) {
      pieces.at(p.local_rank).at(p.param) = true;
    }
  }
  std::vector<std::vector<bool>> written = pieces;
  const std::vector<PostLoadHook> base_hooks = base->hooks();
  // Params some hook rewrites in place, per local rank.
  std::vector<std::vector<bool>> rewritten(shells.size());
  for (std::size_t r = 0; r < shells.size(); ++r) {
    rewritten[r].assign(shells[r].params.size(), false);
  }
  for (const PostLoadHook& h : base_hooks) {
    for (std::size_t p : h.rewrites) {
      rewritten.at(h.local_rank).at(p) = true;
    }
  }
  std::vector<bool> rerun(base_hooks.size(), false);
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t i = 0; i < base_hooks.size(); ++i) {
      const PostLoadHook& h = base_hooks[i];
      const std::vector<bool>& w = written.at(h.local_rank);
      if (rerun[i] ||
          (std::none_of(h.inputs.begin(), h.inputs.end(), [&](std::size_t p) { return w.at(p); }) &&
           std::none_of(h.rewrites.begin(), h.rewrites.end(),
                        [&](std::size_t p) { return w.at(p); }))) {
        continue;
      }
      rerun[i] = true;
      changed = true;
      for (std::size_t p : h.outputs) {
        written.at(h.local_rank).at(p) = true;
      }
    }
  }
  std::vector<PostLoadHook> hooks;
  for (std::size_t i = 0; i < base_hooks.size(); ++i) {
    if (!rerun[i]) {
      continue;
    }
    const PostLoadHook& h = base_hooks[i];
    const RankShell& shell = shells.at(h.local_rank);
    const std::string which = "post-load hook '" + h.name + "' (tp rank " +
                              std::to_string(shell.tp_rank) + ") must run again";
    if (!h.idempotent) {
      refuse("", which + ", and it is not idempotent (its result depends on an earlier run)");
    }
    if (h.reallocates) {
      refuse("", which + ", and it moves its outputs' storage, which an update must keep");
    }
    for (std::size_t p : h.rewrites) {
      if (!pieces[h.local_rank][p]) {
        refuse(
            shell.params[p].name,
            which + ": it rewrites this param in place, so the update must give its tensors too");
      }
    }
    for (std::size_t p : h.inputs) {
      const ParamSpec& spec = shell.params[p];
      if (written[h.local_rank][p]) {
        continue;
      }
      if (spec.transient) {
        refuse(spec.name, which +
                              ": it reads this load-only param, which the load freed; the "
                              "update must give its tensors too");
      }
      if (rewritten[h.local_rank][p]) {
        refuse(spec.name, which +
                              ": it reads this param as loaded, before another hook rewrites it in "
                              "place; the update must give its tensors too");
      }
    }
    out.hooks_rerun.push_back(h.name + " (local rank " + std::to_string(h.local_rank) + ")");
    hooks.push_back(h);
  }
  out.written = written;
  out.params_written = out.params_unchanged = 0;
  out.bytes_written = 0;
  for (std::size_t r = 0; r < shells.size(); ++r) {
    PostLoadHook unchanged;
    unchanged.name = kUnchangedHook;
    unchanged.local_rank = r;
    unchanged.run = [](HookContext&) {};
    for (std::size_t p = 0; p < shells[r].params.size(); ++p) {
      if (written[r][p]) {
        ++out.params_written;
        out.bytes_written += shells[r].params[p].nbytes;
      } else {
        ++out.params_unchanged;
        unchanged.outputs.push_back(p);
      }
    }
    if (!unchanged.outputs.empty()) {
      hooks.push_back(std::move(unchanged));
    }
  }
  return std::make_shared<UpdateModel>(std::move(base), filter, std::move(written),
                                       std::move(hooks));
}

void check_update_coverage(const Model& update_model, const io::CheckpointIndex& index,
                           const std::string& folder) {
  std::vector<Route> routes;
  std::vector<std::size_t> tensor_of;
  for (std::size_t i = 0; i < index.tensors.size(); ++i) {
    Route r = update_model.route(index.tensors[i]);
    if (r.kind == RouteKind::kPlaced) {
      routes.push_back(std::move(r));
      tensor_of.push_back(i);
    }
  }
  const std::vector<CoverageGap> gaps =
      check_coverage(update_model, routes,
                     [&](std::size_t route) { return index.tensors.at(tensor_of.at(route)).name; });
  if (gaps.empty()) {
    return;
  }
  const CoverageGap& g = gaps.front();
  throw Error(Stage::kMapping, folder, g.name,
              "update refused: the update writes " + std::to_string(g.written) + " of the " +
                  std::to_string(g.expected) + " bytes of this param (tp rank " +
                  std::to_string(g.tp_rank) + ", " + std::to_string(gaps.size()) +
                  " param(s) in all): give every checkpoint tensor it is made of (all the shards "
                  "a fused param holds), or none");
}

}  // namespace ferry::models
