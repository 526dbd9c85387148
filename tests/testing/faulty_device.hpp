// A Device/Stream decorator for fault tests: forwards every call to a real device
// (the host backend; gpu::DeviceWrapper) and, before each, asks the test whether to
// fail it. The test's `fault` callback sees the operation's name ("allocate", "bind",
// "create_stream", "host_addressable", "copy_h2d", "copy_h2d_2d", "cast",
// "record", ...) and throws to inject the failure, so a load meets the fault in
// the real pipeline code that made the call. The inner device keeps the
// allocation counters (stats() forwards), so a test can check afterwards that
// everything it handed out came back.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "gpu/device.hpp"
#include "gpu/device_wrapper.hpp"

namespace ferry::testing {

// Called before each forwarded operation; throwing fails that operation.
using DeviceFault = std::function<void(std::string_view op)>;

class FaultyStream final : public gpu::StreamWrapper {
 public:
  FaultyStream(std::unique_ptr<gpu::Stream> inner, std::shared_ptr<const DeviceFault> fault)
      : StreamWrapper(std::move(inner)), fault_(std::move(fault)) {}

  void copy_h2d(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    check("copy_h2d");
    StreamWrapper::copy_h2d(dst, src, bytes);
  }
  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width, std::size_t rows) override {
    check("copy_h2d_2d");
    StreamWrapper::copy_h2d_2d(dst, dst_pitch, src, src_pitch, width, rows);
  }
  void copy_d2h(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    check("copy_d2h");
    StreamWrapper::copy_d2h(dst, src, bytes);
  }
  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override {
    check("fill");
    StreamWrapper::fill(dst, count, dtype, value);
  }
  void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                   std::uint64_t seed) override {
    check("fill_random");
    StreamWrapper::fill_random(dst, count, dtype, low, high, seed);
  }
  void zero(std::byte* dst, std::size_t bytes) override {
    check("zero");
    StreamWrapper::zero(dst, bytes);
  }
  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    check("cast");
    StreamWrapper::cast(dst, dst_dtype, src, src_dtype, count);
  }
  void zero_2d(std::byte* dst, std::size_t pitch, std::size_t width, std::size_t rows) override {
    check("zero_2d");
    StreamWrapper::zero_2d(dst, pitch, width, rows);
  }
  void set_bytes(std::byte* dst, std::byte value, std::size_t bytes) override {
    check("set_bytes");
    StreamWrapper::set_bytes(dst, value, bytes);
  }
  void match_pattern(const gpu::PatternRange* ranges, std::size_t count,
                     std::uint8_t* flags) override {
    check("match_pattern");
    StreamWrapper::match_pattern(ranges, count, flags);
  }
  void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
               std::size_t src_pitch, DType src_dtype, std::size_t width,
               std::size_t rows) override {
    check("cast_2d");
    StreamWrapper::cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows);
  }
  void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                          const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                          std::size_t width, std::size_t rows) override {
    check("dequantize_ggml_2d");
    StreamWrapper::dequantize_ggml_2d(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width,
                                      rows);
  }
  void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width, std::size_t rows) override {
    check("copy_d2d_2d");
    StreamWrapper::copy_d2d_2d(dst, dst_pitch, src, src_pitch, width, rows);
  }
  void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                 std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                 std::size_t cols, std::size_t batches) override {
    check("transpose");
    StreamWrapper::transpose(dst, dst_batch_pitch, src, src_batch_pitch, element_size, rows, cols,
                             batches);
  }
  void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src, const std::byte* scale,
                      const gpu::Fp8Scales& scales, std::size_t rows, std::size_t cols,
                      std::size_t batches) override {
    check("dequantize_fp8");
    StreamWrapper::dequantize_fp8(dst, dst_dtype, src, scale, scales, rows, cols, batches);
  }
  void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                    const gpu::Fp8Scales& scales, gpu::Fp8ScaleRule rule, std::size_t rows,
                    std::size_t cols, std::size_t batches) override {
    check("quantize_fp8");
    StreamWrapper::quantize_fp8(dst, scale, src, src_dtype, scales, rule, rows, cols, batches);
  }
  void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows, std::size_t block_rows,
                  std::size_t scale_cols, std::size_t batches) override {
    check("pack_ue8m0");
    StreamWrapper::pack_ue8m0(dst, scale, rows, block_rows, scale_cols, batches);
  }
  void repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t k) override {
    check("repack_marlin_fp4");
    StreamWrapper::repack_marlin_fp4(dst, src, n, k);
  }
  void marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t groups) override {
    check("marlin_fp4_scales");
    StreamWrapper::marlin_fp4_scales(dst, src, n, groups);
  }
  std::unique_ptr<gpu::Event> record() override {
    check("record");
    return StreamWrapper::record();
  }
  void synchronize() override {
    check("synchronize");
    StreamWrapper::synchronize();
  }

 private:
  void check(std::string_view op) const {
    if (*fault_) {
      (*fault_)(op);
    }
  }
  std::shared_ptr<const DeviceFault> fault_;
};

class FaultyDevice final : public gpu::DeviceWrapper {
 public:
  FaultyDevice(std::shared_ptr<gpu::Device> inner, DeviceFault fault)
      : DeviceWrapper(std::move(inner)),
        fault_(std::make_shared<const DeviceFault>(std::move(fault))) {}

  void bind() override {
    check("bind");
    DeviceWrapper::bind();
  }
  gpu::DeviceAllocation allocate(std::size_t bytes) override {
    check("allocate");
    return DeviceWrapper::allocate(bytes);
  }
  gpu::DeviceAllocation adopt(std::byte* data, std::size_t bytes,
                              gpu::DeviceAllocation::Release release) override {
    check("adopt");
    return DeviceWrapper::adopt(data, bytes, std::move(release));
  }
  gpu::PinnedAllocation allocate_pinned(std::size_t bytes) override {
    check("allocate_pinned");
    return DeviceWrapper::allocate_pinned(bytes);
  }
  gpu::HostRegistration register_host(void* host, std::size_t bytes) override {
    check("register_host");
    return DeviceWrapper::register_host(host, bytes);
  }
  std::unique_ptr<gpu::Stream> create_stream() override {
    check("create_stream");
    return std::make_unique<FaultyStream>(DeviceWrapper::create_stream(), fault_);
  }
  bool host_addressable() const override {
    check("host_addressable");
    return DeviceWrapper::host_addressable();
  }

 private:
  void check(std::string_view op) const {
    if (*fault_) {
      (*fault_)(op);
    }
  }
  std::shared_ptr<const DeviceFault> fault_;
};

}  // namespace ferry::testing
