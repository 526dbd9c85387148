// Test decorators: a Device/Stream pair that forwards every call to a real device
// and lets a test break one operation, to prove the self-test notices.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/device.hpp"

namespace ferry::gpu::testing {

// Hooks run after the forwarded call (they may corrupt results or throw).
struct Faults {
  std::function<void(std::byte* dst, DType dst_dtype, std::size_t count)> after_cast;  // cast()
  std::function<void()> before_fill;
  std::function<void()> on_bind;
  std::function<void(std::size_t bytes)> on_copy_d2h;  // before a read-back is forwarded
  bool leak_allocations = false;  // allocate() also keeps a byte of device memory
};

class ForwardingStream final : public Stream {
 public:
  ForwardingStream(std::unique_ptr<Stream> inner, std::shared_ptr<Faults> faults)
      : inner_(std::move(inner)), faults_(std::move(faults)) {}

  void copy_h2d(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    inner_->copy_h2d(dst, src, bytes);
  }
  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width, std::size_t rows) override {
    inner_->copy_h2d_2d(dst, dst_pitch, src, src_pitch, width, rows);
  }
  void copy_d2h(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    if (faults_->on_copy_d2h) {
      faults_->on_copy_d2h(bytes);
    }
    inner_->copy_d2h(dst, src, bytes);
  }
  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override {
    if (faults_->before_fill) {
      faults_->before_fill();
    }
    inner_->fill(dst, count, dtype, value);
  }
  void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                   std::uint64_t seed) override {
    inner_->fill_random(dst, count, dtype, low, high, seed);
  }
  void zero(std::byte* dst, std::size_t bytes) override { inner_->zero(dst, bytes); }
  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    inner_->cast(dst, dst_dtype, src, src_dtype, count);
    if (faults_->after_cast) {
      faults_->after_cast(dst, dst_dtype, count);
    }
  }
  void zero_2d(std::byte* dst, std::size_t pitch, std::size_t width, std::size_t rows) override {
    inner_->zero_2d(dst, pitch, width, rows);
  }
  void set_bytes(std::byte* dst, std::byte value, std::size_t bytes) override {
    inner_->set_bytes(dst, value, bytes);
  }
  void match_pattern(const PatternRange* ranges, std::size_t count,
                     std::uint8_t* flags) override {
    inner_->match_pattern(ranges, count, flags);
  }
  void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
               std::size_t src_pitch, DType src_dtype, std::size_t width,
               std::size_t rows) override {
    inner_->cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows);
  }
  void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width, std::size_t rows) override {
    inner_->copy_d2d_2d(dst, dst_pitch, src, src_pitch, width, rows);
  }
  void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                 std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                 std::size_t cols, std::size_t batches) override {
    inner_->transpose(dst, dst_batch_pitch, src, src_batch_pitch, element_size, rows, cols,
                      batches);
  }
  void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src, const std::byte* scale,
                      const Fp8Scales& scales, std::size_t rows, std::size_t cols,
                      std::size_t batches) override {
    inner_->dequantize_fp8(dst, dst_dtype, src, scale, scales, rows, cols, batches);
  }
  void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                    const Fp8Scales& scales, Fp8ScaleRule rule, std::size_t rows, std::size_t cols,
                    std::size_t batches) override {
    inner_->quantize_fp8(dst, scale, src, src_dtype, scales, rule, rows, cols, batches);
  }
  void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows, std::size_t block_rows,
                  std::size_t scale_cols, std::size_t batches) override {
    inner_->pack_ue8m0(dst, scale, rows, block_rows, scale_cols, batches);
  }
  std::unique_ptr<Event> record() override { return inner_->record(); }
  void synchronize() override { inner_->synchronize(); }
  void abandon_emulated_waits() override { inner_->abandon_emulated_waits(); }

 private:
  std::unique_ptr<Stream> inner_;
  std::shared_ptr<Faults> faults_;
};

class ForwardingDevice final : public Device {
 public:
  explicit ForwardingDevice(std::shared_ptr<Device> inner)
      : inner_(std::move(inner)), faults_(std::make_shared<Faults>()) {}

  Faults& faults() { return *faults_; }

  std::string name() const override { return "broken(" + inner_->name() + ")"; }
  void bind() override {
    if (faults_->on_bind) {
      faults_->on_bind();
    }
    inner_->bind();
  }
  DeviceAllocation adopt(std::byte* data, std::size_t bytes,
                         DeviceAllocation::Release release) override {
    return inner_->adopt(data, bytes, std::move(release));
  }
  DeviceAllocation allocate(std::size_t bytes) override {
    if (faults_->leak_allocations) {
      leaked_.push_back(inner_->allocate(1));
    }
    return inner_->allocate(bytes);
  }
  PinnedAllocation allocate_pinned(std::size_t bytes) override {
    return inner_->allocate_pinned(bytes);
  }
  HostRegistration register_host(void* host, std::size_t bytes) override {
    return inner_->register_host(host, bytes);
  }
  std::unique_ptr<Stream> create_stream() override {
    return std::make_unique<ForwardingStream>(inner_->create_stream(), faults_);
  }
  void reserve_events(std::size_t count) override { inner_->reserve_events(count); }
  AllocationStats stats() const override { return inner_->stats(); }

 private:
  std::shared_ptr<Device> inner_;
  std::shared_ptr<Faults> faults_;
  std::vector<DeviceAllocation> leaked_;
};

}  // namespace ferry::gpu::testing
