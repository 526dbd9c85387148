// Tests only: a built Model with extra post-load hooks, for the failure tests that
// need a hook a family does not declare (one that throws, blocks or watches).
// Production models register hooks in one place, models::make_model through
// TableModel::add_hook; this forwarding model is the one other way, and it lives
// here so that nothing outside the tests can reach it.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "models/hooks.hpp"
#include "models/model.hpp"

namespace ferry::testing {

class HookedModel final : public models::Model {
 public:
  HookedModel(std::shared_ptr<const models::Model> base, std::vector<models::PostLoadHook> hooks)
      : base_(std::move(base)), hooks_(std::move(hooks)) {}

  std::string family() const override { return base_->family(); }
  const models::ParallelLayout& layout() const override { return base_->layout(); }
  const std::vector<models::RankShell>& shells() const override { return base_->shells(); }
  models::Route route(const io::TensorInfo& tensor) const override { return base_->route(tensor); }
  std::vector<models::Piece> fill_pieces() const override { return base_->fill_pieces(); }
  std::vector<models::PostLoadHook> hooks() const override { return hooks_; }
  std::vector<std::string> notes() const override { return base_->notes(); }

 private:
  std::shared_ptr<const models::Model> base_;
  std::vector<models::PostLoadHook> hooks_;  // base's, then the extra ones
};

// `base` reporting its hooks followed by `extra`, validated as TableModel::add_hook
// validates (models::validate_hooks).
inline std::unique_ptr<models::Model> with_hooks(std::shared_ptr<const models::Model> base,
                                                 std::vector<models::PostLoadHook> extra) {
  if (!base) {
    throw Error(Stage::kPostProcess, "", "", "with_hooks: no model");
  }
  std::vector<models::PostLoadHook> all = base->hooks();
  models::validate_hooks(*base, extra, all);
  for (models::PostLoadHook& h : extra) {
    all.push_back(std::move(h));
  }
  return std::make_unique<HookedModel>(std::move(base), std::move(all));
}

}  // namespace ferry::testing
