// Test decorators: a Device/Stream pair that forwards every call to a real device
// (gpu::DeviceWrapper) and lets a test break one operation, to prove the self-test
// notices.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/device.hpp"
#include "gpu/device_wrapper.hpp"

namespace ferry::gpu::testing {

// Hooks run after the forwarded call (they may corrupt results or throw).
struct Faults {
  std::function<void(std::byte* dst, DType dst_dtype, std::size_t count)> after_cast;  // cast()
  std::function<void()> before_fill;
  std::function<void()> on_bind;
  std::function<void(std::size_t bytes)> on_copy_d2h;  // before a read-back is forwarded
  bool leak_allocations = false;  // allocate() also keeps a byte of device memory
};

class ForwardingStream final : public StreamWrapper {
 public:
  ForwardingStream(std::unique_ptr<Stream> inner, std::shared_ptr<Faults> faults)
      : StreamWrapper(std::move(inner)), faults_(std::move(faults)) {}

  void copy_d2h(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    if (faults_->on_copy_d2h) {
      faults_->on_copy_d2h(bytes);
    }
    StreamWrapper::copy_d2h(dst, src, bytes);
  }
  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override {
    if (faults_->before_fill) {
      faults_->before_fill();
    }
    StreamWrapper::fill(dst, count, dtype, value);
  }
  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    StreamWrapper::cast(dst, dst_dtype, src, src_dtype, count);
    if (faults_->after_cast) {
      faults_->after_cast(dst, dst_dtype, count);
    }
  }

 private:
  std::shared_ptr<Faults> faults_;
};

class ForwardingDevice final : public DeviceWrapper {
 public:
  explicit ForwardingDevice(std::shared_ptr<Device> inner)
      : DeviceWrapper(std::move(inner)), faults_(std::make_shared<Faults>()) {}

  Faults& faults() { return *faults_; }

  std::string name() const override { return "broken(" + DeviceWrapper::name() + ")"; }
  void bind() override {
    if (faults_->on_bind) {
      faults_->on_bind();
    }
    DeviceWrapper::bind();
  }
  DeviceAllocation allocate(std::size_t bytes) override {
    if (faults_->leak_allocations) {
      leaked_.push_back(DeviceWrapper::allocate(1));
    }
    return DeviceWrapper::allocate(bytes);
  }
  std::unique_ptr<Stream> create_stream() override {
    return std::make_unique<ForwardingStream>(DeviceWrapper::create_stream(), faults_);
  }

 private:
  std::shared_ptr<Faults> faults_;
  std::vector<DeviceAllocation> leaked_;
};

}  // namespace ferry::gpu::testing
