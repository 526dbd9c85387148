// Whether every param will be (or was) written entirely. The pieces that write one
// param never overlap (models/model.hpp), so a param is complete exactly when the
// bytes written into it equal its size; more than its size means two pieces
// overlapped, which is a bug in a family's rules and is reported the same way.
//
// The coordinator uses a CoverageTracker as pieces complete (to know when a hook's
// inputs are ready and to list what is missing at the end); check_coverage answers
// the same question up front from the routes of a whole checkpoint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "models/model.hpp"

namespace ferry::models {

struct CoverageGap {
  std::size_t local_rank = 0;
  int tp_rank = 0;
  std::size_t param = 0;
  std::string name;
  std::uint64_t written = 0;   // bytes the pieces and hooks write
  std::uint64_t expected = 0;  // the param's nbytes
};

// Counts bytes written per (local rank, param). Not thread-safe: one owner.
class CoverageTracker {
 public:
  explicit CoverageTracker(const Model& model);

  // Counts a piece's destination bytes (copy or zero).
  void add(const Piece& piece);
  // Counts every output of `hook` as fully written.
  void add_hook_outputs(const PostLoadHook& hook);

  std::uint64_t written(std::size_t local_rank, std::size_t param) const;
  bool complete(std::size_t local_rank, std::size_t param) const;
  // Params written less or more than their size, by local rank then param index.
  std::vector<CoverageGap> gaps() const;

 private:
  const Model& model_;
  std::vector<std::vector<std::uint64_t>> written_;  // [local rank][param]
};

// Gaps left when every piece of `routes`, the model's fill pieces and its hooks'
// outputs have been written.
std::vector<CoverageGap> check_coverage(const Model& model, std::span<const Route> routes);

// The distinct param names of `gaps`, sorted: what the coordinator lists in "a
// parameter that neither the checkpoint nor a post-load hook filled".
std::vector<std::string> gap_names(const std::vector<CoverageGap>& gaps);

}  // namespace ferry::models
