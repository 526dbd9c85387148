// Whether every param will be (or was) written entirely, and exactly once.
//
// check_coverage answers it up front, from the routes of a whole checkpoint, byte
// by byte rather than by count: every piece's destination (each row of a pitched
// one), every zero fill and every hook output becomes an interval of its param;
// the intervals must lie inside the param, be pairwise disjoint, and together cover
// it. A byte count alone is fooled by one region written twice and another of the
// same size never written; the intervals are not. Fragments are the pieces cut at
// window edges (actors/plan.hpp), so what holds for the pieces holds for them.
//
// The coordinator uses a CoverageTracker as pieces complete (to know when a hook's
// inputs are ready and to list what is missing at the end): there a count is
// enough, because check_coverage has already proven the pieces disjoint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
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
// outputs have been written: the params some bytes of which nothing writes
// (`written` counts the bytes that are written). Throws Error(Stage::kPlacement,
// naming the param) for a family's bug: a destination outside its param, or two
// writes to the same bytes, naming both (with `route_name`, asked only for such an
// error, the tensors they copy; else "route #i").
std::vector<CoverageGap> check_coverage(
    const Model& model, std::span<const Route> routes,
    const std::function<std::string(std::size_t route)>& route_name = {});

// The distinct param names of `gaps`, sorted: what the coordinator lists in "a
// parameter that neither the checkpoint nor a post-load hook filled".
std::vector<std::string> gap_names(const std::vector<CoverageGap>& gaps);

}  // namespace ferry::models
