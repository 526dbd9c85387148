// Post-load hooks beyond what a family declares: validation shared by every place
// hooks are registered, and a decorator that adds hooks to an existing Model so the
// pipeline can exercise the mechanism on a real family before one needs a hook.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "models/model.hpp"

namespace ferry::models {

// Throws Error(Stage::kPostProcess) naming the hook when: it has no name or no
// `run`, its local rank has no shell, an input, output or rewrite index is outside
// that shell, an output is listed twice or is also an input, or two hooks of the list
// (together with `existing`) fill the same output of the same rank; a rewrite that is
// also the hook's input or output, some hook's output, or another hook's rewrite; or
// a hook reading a param another hook rewrites without the rewriting hook waiting
// for one of its outputs.
void validate_hooks(const Model& model, const std::vector<PostLoadHook>& hooks,
                    const std::vector<PostLoadHook>& existing = {});

// A Model that behaves as `base` and reports base's hooks followed by `extra`
// (validated). The result is as immutable and thread-safe as `base`.
std::unique_ptr<Model> with_hooks(std::shared_ptr<const Model> base,
                                  std::vector<PostLoadHook> extra);

// A Model that behaves as `base` with each of base's hooks' `run` wrapped by `wrap`
// (which gets the hook and its run, and returns the run to use), e.g. to time
// every hook. Everything else about the hooks stays as declared.
std::unique_ptr<Model> with_wrapped_hooks(
    std::shared_ptr<const Model> base,
    const std::function<std::function<void(HookContext&)>(
        const PostLoadHook&, std::function<void(HookContext&)>)>& wrap);

// A hook's context over the param pointers of its rank (as the pipeline and the
// runtime's startup run hooks): refuses a param the hook did not declare, and a
// reallocate() by a hook that does not declare `reallocates` (or with no
// `reallocate_param` to do it: the storage cannot move here). `device` names the
// device in errors.
class ParamsHookContext final : public HookContext {
 public:
  // Allocates new storage for `param` and records it; returns the new pointer.
  using ReallocateParam = std::function<std::byte*(std::size_t param)>;

  ParamsHookContext(const PostLoadHook& hook, std::span<std::byte* const> params,
                    gpu::Stream& stream, std::string device, ReallocateParam reallocate_param = {});
  std::byte* param_data(std::size_t param) override;
  gpu::Stream& stream() override { return stream_; }
  std::byte* reallocate(std::size_t param) override;

 private:
  bool declared(std::size_t param, bool outputs_only) const;

  const PostLoadHook& hook_;
  std::span<std::byte* const> params_;
  gpu::Stream& stream_;
  std::string device_;
  ReallocateParam reallocate_param_;
  std::map<std::size_t, std::byte*> moved_;  // params this run reallocated
};

}  // namespace ferry::models
