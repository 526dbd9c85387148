// Post-load hooks: the validation TableModel::add_hook applies (the one place hooks
// are registered), how the pipeline and the runtime's startup run one, and the
// context they run in.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
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

// Sees each hook's run as it ends (the runtime's trace): the hook, and when its run
// began and ended. Called on the thread that ran the hook, also when it threw.
using HookObserver = std::function<void(const PostLoadHook& hook,
                                        std::chrono::steady_clock::time_point begin,
                                        std::chrono::steady_clock::time_point end)>;

// Runs `hook` on `context`, then tells `observer` (when set) how long it took.
void run_hook(const PostLoadHook& hook, HookContext& context, const HookObserver& observer);

// A hook's context over the param pointers of its rank (as the pipeline and the
// runtime's startup run hooks): refuses a param the hook did not declare, and a
// reallocate() by a hook that does not declare `reallocates` (or with no
// `reallocate_param` to do it: the storage cannot move here). `device` names the
// device in errors; `scratch` is the device scratch made for the hook.
class ParamsHookContext final : public HookContext {
 public:
  // Allocates new storage for `param` and records it; returns the new pointer.
  using ReallocateParam = std::function<std::byte*(std::size_t param)>;

  ParamsHookContext(const PostLoadHook& hook, std::span<std::byte* const> params,
                    gpu::Stream& stream, std::string device, ReallocateParam reallocate_param = {},
                    std::span<std::byte> scratch = {});
  std::byte* param_data(std::size_t param) override;
  gpu::Stream& stream() override { return stream_; }
  std::byte* reallocate(std::size_t param) override;
  // A prefix of the device scratch the caller made (at least the hook's
  // scratch_bytes: the caller's business); refuses more than that.
  std::byte* scratch(std::size_t bytes) override;

 private:
  bool declared(std::size_t param, bool outputs_only) const;

  const PostLoadHook& hook_;
  std::span<std::byte* const> params_;
  gpu::Stream& stream_;
  std::string device_;
  ReallocateParam reallocate_param_;
  std::span<std::byte> scratch_;
  std::map<std::size_t, std::byte*> moved_;  // params this run reallocated
};

}  // namespace ferry::models
