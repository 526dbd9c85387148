// Post-load hooks beyond what a family declares: validation shared by every place
// hooks are registered, and a decorator that adds hooks to an existing Model so the
// pipeline can exercise the mechanism on a real family before one needs a hook.
#pragma once

#include <memory>
#include <vector>

#include "models/model.hpp"

namespace ferry::models {

// Throws Error(Stage::kPostProcess) naming the hook when: it has no name or no
// `run`, its local rank has no shell, an input or output index is outside that
// shell, an output is listed twice or is also an input, or two hooks of the list
// (together with `existing`) fill the same output of the same rank.
void validate_hooks(const Model& model, const std::vector<PostLoadHook>& hooks,
                    const std::vector<PostLoadHook>& existing = {});

// A Model that behaves as `base` and reports base's hooks followed by `extra`
// (validated). The result is as immutable and thread-safe as `base`.
std::unique_ptr<Model> with_hooks(std::shared_ptr<const Model> base,
                                  std::vector<PostLoadHook> extra);

}  // namespace ferry::models
