// A post-load hook's context over params allocated on a host device, for running
// a model's hooks outside the pipeline; it refuses params the hook did not declare.
#pragma once

#include <cstddef>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include "gpu/device.hpp"
#include "models/model.hpp"

namespace ferry::testing {

class HostHookContext final : public models::HookContext {
 public:
  HostHookContext(gpu::Stream& stream, std::vector<std::byte*> params,
                  const models::PostLoadHook& hook)
      : stream_(stream), params_(std::move(params)) {
    allowed_.insert(hook.inputs.begin(), hook.inputs.end());
    allowed_.insert(hook.outputs.begin(), hook.outputs.end());
    allowed_.insert(hook.rewrites.begin(), hook.rewrites.end());
  }
  std::byte* param_data(std::size_t param) override {
    if (allowed_.count(param) == 0) {
      throw std::runtime_error("hook asked for an undeclared param");
    }
    return params_.at(param);
  }
  gpu::Stream& stream() override { return stream_; }

 private:
  gpu::Stream& stream_;
  std::vector<std::byte*> params_;
  std::set<std::size_t> allowed_;
};

}  // namespace ferry::testing
