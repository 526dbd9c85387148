#include "gpu/metered_device.hpp"

#include <chrono>
#include <utility>

#include "gpu/device_wrapper.hpp"

namespace ferry::gpu {
namespace {

using Clock = std::chrono::steady_clock;

// Only the operations that write device memory are timed and reported; the rest
// forward (StreamWrapper).
class MeteredStream final : public StreamWrapper {
 public:
  MeteredStream(std::unique_ptr<Stream> inner, std::shared_ptr<const CopyObserver> observer,
                std::string device)
      : StreamWrapper(std::move(inner)),
        observer_(std::move(observer)),
        device_(std::move(device)) {}

  void copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::copy_h2d(dst, src_host, bytes);
    report("copy", bytes, t);
  }
  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::copy_h2d_2d(dst, dst_pitch, src_host, src_pitch, width_bytes, rows);
    report("copy", width_bytes * rows, t);
  }
  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::fill(dst, count, dtype, value);
    report("fill", count * dtype_size(dtype), t);
  }
  void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                   std::uint64_t seed) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::fill_random(dst, count, dtype, low, high, seed);
    report("fill", count * dtype_size(dtype), t);
  }
  void zero(std::byte* dst, std::size_t bytes) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::zero(dst, bytes);
    report("zero", bytes, t);
  }
  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::cast(dst, dst_dtype, src, src_dtype, count);
    report("cast", count * dtype_size(dst_dtype), t);
  }
  void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
               std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::zero_2d(dst, dst_pitch, width_bytes, rows);
    report("zero", width_bytes * rows, t);
  }
  void set_bytes(std::byte* dst, std::byte value, std::size_t bytes) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::set_bytes(dst, value, bytes);
    report("fill", bytes, t);
  }
  void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
               std::size_t src_pitch, DType src_dtype, std::size_t width,
               std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows);
    report("cast", width * rows * dtype_size(dst_dtype), t);
  }
  void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                          const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                          std::size_t width, std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::dequantize_ggml_2d(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width,
                                      rows);
    report("cast", width * rows * dtype_size(dst_dtype), t);
  }
  void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    StreamWrapper::copy_d2d_2d(dst, dst_pitch, src, src_pitch, width_bytes, rows);
    report("gather", width_bytes * rows, t);
  }

 private:
  void report(std::string_view op, std::size_t bytes, Clock::time_point began) {
    if (observer_->on_op && bytes != 0) {
      DeviceOp o;
      o.device = &device_;
      o.op = op;
      o.bytes = bytes;
      o.begin = began;
      o.end = Clock::now();
      observer_->on_op(o);
    }
  }

  std::shared_ptr<const CopyObserver> observer_;
  std::string device_;
};

class MeteredDevice final : public DeviceWrapper {
 public:
  MeteredDevice(std::shared_ptr<Device> inner, CopyObserver observer)
      : DeviceWrapper(std::move(inner)),
        observer_(std::make_shared<const CopyObserver>(std::move(observer))) {}

  std::unique_ptr<Stream> create_stream() override {
    return std::make_unique<MeteredStream>(DeviceWrapper::create_stream(), observer_, name());
  }

 private:
  std::shared_ptr<const CopyObserver> observer_;
};

}  // namespace

std::shared_ptr<Device> metered_device(std::shared_ptr<Device> inner, CopyObserver observer) {
  return std::make_shared<MeteredDevice>(std::move(inner), std::move(observer));
}

}  // namespace ferry::gpu
