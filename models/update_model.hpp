// An in-place update (runtime::Runtime::update) as a model the ordinary pipeline
// runs: the loaded model's shells, its routes for the tensors the update gives, the
// hooks those tensors feed, and every other param left as it is.
//
// What the update touches is decided from the routes before anything is read:
//   - a param is written when a kept tensor's piece lands in it (its zero fills
//     then go with it), or when it is an output of a hook that runs again;
//   - a hook runs again when one of its inputs or the params it rewrites in place
//     is written (to a fixed point: outputs feed other hooks);
//   - every other param is "unchanged": one no-op hook per local rank,
//     `update:unchanged`, lists them as its outputs, so that the coverage proof
//     (models/coverage.hpp) and the pipeline's completion count hold them as filled
//     by rule, and the hooks that read them run at once.
// A hook that runs again must find what it found during the load. So the update is
// refused, naming the hook and the param, when a hook that runs again:
//   - rewrites in place a param the update does not give new bytes for (it would
//     rewrite its own output);
//   - reads a param another hook rewrites in place, and the update does not give it
//     (it would read the rewritten bytes);
//   - reads a load-only (transient) param the update does not give (the load freed it);
//   - is not idempotent, or moves its outputs' storage (reallocates).
// A param the update writes only part of is refused too (every tensor a fused param
// is made of must come together): check_update_coverage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "models/model.hpp"

namespace ferry::models {

// The drop reason of a tensor an update's name filter leaves out (docs/plan-json.md).
inline constexpr const char* kUpdateFilterReason = "update_filter";
// The no-op hook that holds the params an update leaves as they are.
inline constexpr const char* kUnchangedHook = "update:unchanged";

struct UpdateSelection {
  std::vector<std::vector<bool>> written;  // [local rank][param]: the update writes it
  std::size_t params_written = 0;          // over the local ranks
  std::size_t params_unchanged = 0;
  std::uint64_t bytes_written = 0;       // the written params' nbytes (transients included)
  std::vector<std::string> hooks_rerun;  // "<name> (local rank <r>)"
};

struct UpdateFilter {
  // A checkpoint tensor of the source is used when this says so (null: every one).
  std::function<bool(const std::string& tensor)> keep_tensor;
  // Only pieces into these params are kept (null: any): a re-read of the old source
  // that writes exactly what a failed update touched.
  const std::vector<std::vector<bool>>* only_params = nullptr;
};

// The update model over `base` for the tensors of `index`. Throws
// Error(Stage::kMapping) naming the hook and param for the refusals above, and
// what base->route throws.
std::shared_ptr<const Model> make_update_model(std::shared_ptr<const Model> base,
                                               const io::CheckpointIndex& index,
                                               const UpdateFilter& filter, UpdateSelection& out);

// Refuses (Error(Stage::kMapping), naming the param, its tp rank, the bytes written
// and the source folder) a param the update's tensors write only part of, with the
// routes of `index` under the update model.
void check_update_coverage(const Model& update_model, const io::CheckpointIndex& index,
                           const std::string& folder);

}  // namespace ferry::models
