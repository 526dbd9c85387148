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
  // `device` (the params' device) makes the hook's declared scratch_bytes of device
  // scratch before it runs, as the copy worker does; without it, the hook gets none.
  HostHookContext(gpu::Stream& stream, std::vector<std::byte*> params,
                  const models::PostLoadHook& hook, gpu::Device* device = nullptr)
      : stream_(stream), params_(std::move(params)) {
    allowed_.insert(hook.inputs.begin(), hook.inputs.end());
    allowed_.insert(hook.outputs.begin(), hook.outputs.end());
    allowed_.insert(hook.rewrites.begin(), hook.rewrites.end());
    if (device != nullptr) {
      scratch_ = device->allocate(hook.scratch_bytes);
    }
  }
  std::byte* scratch(std::size_t bytes) override {
    if (bytes > scratch_.size()) {
      throw std::runtime_error("hook asked for more scratch than it declared");
    }
    return bytes == 0 ? nullptr : scratch_.data();
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
  gpu::DeviceAllocation scratch_;
};

}  // namespace ferry::testing
