#include "models/coverage.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace ferry::models {

CoverageTracker::CoverageTracker(const Model& model) : model_(model) {
  for (const RankShell& shell : model.shells()) {
    written_.emplace_back(shell.params.size(), 0);
  }
}

void CoverageTracker::add(const Piece& piece) {
  if (piece.local_rank >= written_.size() || piece.param >= written_[piece.local_rank].size()) {
    throw Error(Stage::kVerify, "", "",
                "coverage: a piece names local rank " + std::to_string(piece.local_rank) +
                    " param " + std::to_string(piece.param) + ", which the model does not have");
  }
  written_[piece.local_rank][piece.param] += piece.dst_bytes();
}

void CoverageTracker::add_hook_outputs(const PostLoadHook& hook) {
  const auto& shells = model_.shells();
  for (std::size_t out : hook.outputs) {
    if (hook.local_rank >= written_.size() || out >= written_[hook.local_rank].size()) {
      throw Error(Stage::kVerify, "", "",
                  "coverage: hook '" + hook.name + "' names a param the model does not have");
    }
    written_[hook.local_rank][out] += shells[hook.local_rank].params[out].nbytes;
  }
}

std::uint64_t CoverageTracker::written(std::size_t local_rank, std::size_t param) const {
  return written_.at(local_rank).at(param);
}

bool CoverageTracker::complete(std::size_t local_rank, std::size_t param) const {
  return written(local_rank, param) == model_.shells().at(local_rank).params.at(param).nbytes;
}

std::vector<CoverageGap> CoverageTracker::gaps() const {
  std::vector<CoverageGap> out;
  const auto& shells = model_.shells();
  for (std::size_t r = 0; r < shells.size(); ++r) {
    for (std::size_t i = 0; i < shells[r].params.size(); ++i) {
      const ParamSpec& spec = shells[r].params[i];
      if (written_[r][i] != spec.nbytes) {
        out.push_back({r, shells[r].tp_rank, i, spec.name, written_[r][i], spec.nbytes});
      }
    }
  }
  return out;
}

std::vector<CoverageGap> check_coverage(const Model& model, std::span<const Route> routes) {
  CoverageTracker tracker(model);
  for (const Route& route : routes) {
    for (const Piece& p : route.pieces) {
      tracker.add(p);
    }
  }
  for (const Piece& p : model.fill_pieces()) {
    tracker.add(p);
  }
  for (const PostLoadHook& h : model.hooks()) {
    tracker.add_hook_outputs(h);
  }
  return tracker.gaps();
}

std::vector<std::string> gap_names(const std::vector<CoverageGap>& gaps) {
  std::vector<std::string> names;
  for (const CoverageGap& g : gaps) {
    names.push_back(g.name);
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

}  // namespace ferry::models
