#include "gpu/metered_device.hpp"

#include <chrono>
#include <utility>

namespace ferry::gpu {
namespace {

using Clock = std::chrono::steady_clock;

class MeteredStream final : public Stream {
 public:
  MeteredStream(std::unique_ptr<Stream> inner, std::shared_ptr<const CopyObserver> observer,
                std::string device)
      : inner_(std::move(inner)), observer_(std::move(observer)), device_(std::move(device)) {}

  void copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) override {
    const Clock::time_point t = Clock::now();
    inner_->copy_h2d(dst, src_host, bytes);
    report("copy", bytes, t);
  }
  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    inner_->copy_h2d_2d(dst, dst_pitch, src_host, src_pitch, width_bytes, rows);
    report("copy", width_bytes * rows, t);
  }
  void copy_d2h(std::byte* dst_host, const std::byte* src, std::size_t bytes) override {
    inner_->copy_d2h(dst_host, src, bytes);
  }
  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override {
    const Clock::time_point t = Clock::now();
    inner_->fill(dst, count, dtype, value);
    report("fill", count * dtype_size(dtype), t);
  }
  void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                   std::uint64_t seed) override {
    const Clock::time_point t = Clock::now();
    inner_->fill_random(dst, count, dtype, low, high, seed);
    report("fill", count * dtype_size(dtype), t);
  }
  void zero(std::byte* dst, std::size_t bytes) override {
    const Clock::time_point t = Clock::now();
    inner_->zero(dst, bytes);
    report("zero", bytes, t);
  }
  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    const Clock::time_point t = Clock::now();
    inner_->cast(dst, dst_dtype, src, src_dtype, count);
    report("cast", count * dtype_size(dst_dtype), t);
  }
  void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
               std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    inner_->zero_2d(dst, dst_pitch, width_bytes, rows);
    report("zero", width_bytes * rows, t);
  }
  void set_bytes(std::byte* dst, std::byte value, std::size_t bytes) override {
    const Clock::time_point t = Clock::now();
    inner_->set_bytes(dst, value, bytes);
    report("fill", bytes, t);
  }
  void match_pattern(const PatternRange* ranges, std::size_t count,
                     std::uint8_t* flags) override {
    inner_->match_pattern(ranges, count, flags);
  }
  void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
               std::size_t src_pitch, DType src_dtype, std::size_t width,
               std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    inner_->cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows);
    report("cast", width * rows * dtype_size(dst_dtype), t);
  }
  void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    const Clock::time_point t = Clock::now();
    inner_->copy_d2d_2d(dst, dst_pitch, src, src_pitch, width_bytes, rows);
    report("gather", width_bytes * rows, t);
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

  std::unique_ptr<Stream> inner_;
  std::shared_ptr<const CopyObserver> observer_;
  std::string device_;
};

class MeteredDevice final : public Device {
 public:
  MeteredDevice(std::shared_ptr<Device> inner, CopyObserver observer)
      : inner_(std::move(inner)),
        observer_(std::make_shared<const CopyObserver>(std::move(observer))) {}

  std::string name() const override { return inner_->name(); }
  void bind() override { inner_->bind(); }
  DeviceAllocation allocate(std::size_t bytes) override { return inner_->allocate(bytes); }
  DeviceAllocation adopt(std::byte* data, std::size_t bytes,
                         DeviceAllocation::Release release) override {
    return inner_->adopt(data, bytes, std::move(release));
  }
  PinnedAllocation allocate_pinned(std::size_t bytes) override {
    return inner_->allocate_pinned(bytes);
  }
  HostRegistration register_host(void* host, std::size_t bytes) override {
    return inner_->register_host(host, bytes);
  }
  std::unique_ptr<Stream> create_stream() override {
    return std::make_unique<MeteredStream>(inner_->create_stream(), observer_, inner_->name());
  }
  void reserve_events(std::size_t count) override { inner_->reserve_events(count); }
  AllocationStats stats() const override { return inner_->stats(); }
  bool holds_data() const override { return inner_->holds_data(); }
  bool host_addressable() const override { return inner_->host_addressable(); }
  int numa_node() const override { return inner_->numa_node(); }
  std::size_t narrow_row_bytes() const override { return inner_->narrow_row_bytes(); }

 private:
  std::shared_ptr<Device> inner_;
  std::shared_ptr<const CopyObserver> observer_;
};

}  // namespace

std::shared_ptr<Device> metered_device(std::shared_ptr<Device> inner, CopyObserver observer) {
  return std::make_shared<MeteredDevice>(std::move(inner), std::move(observer));
}

}  // namespace ferry::gpu
