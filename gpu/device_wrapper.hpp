// Bases for Device and Stream decorators, as LevelDB's EnvWrapper: every call
// forwards to the inner object, so a decorator (the metered device, the tests'
// fault-injecting and forwarding devices) overrides only what it changes, and a new
// virtual method of Device or Stream is one forwarder here instead of one in every
// decorator. A decorator that wraps streams overrides create_stream() and wraps
// what DeviceWrapper::create_stream() returns.
#pragma once

#include <memory>
#include <string>

#include "gpu/device.hpp"

namespace ferry::gpu {

class StreamWrapper : public Stream {
 public:
  // `inner` must not be null.
  explicit StreamWrapper(std::unique_ptr<Stream> inner);
  Stream& inner() const { return *inner_; }

  void copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) override;
  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override;
  void copy_d2h(std::byte* dst_host, const std::byte* src, std::size_t bytes) override;
  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override;
  void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                   std::uint64_t seed) override;
  void zero(std::byte* dst, std::size_t bytes) override;
  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override;
  void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
               std::size_t rows) override;
  void set_bytes(std::byte* dst, std::byte value, std::size_t bytes) override;
  void match_pattern(const PatternRange* ranges, std::size_t count, std::uint8_t* flags) override;
  void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
               std::size_t src_pitch, DType src_dtype, std::size_t width,
               std::size_t rows) override;
  void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                          const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                          std::size_t width, std::size_t rows) override;
  void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override;
  void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                 std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                 std::size_t cols, std::size_t batches) override;
  void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src, const std::byte* scale,
                      const Fp8Scales& scales, std::size_t rows, std::size_t cols,
                      std::size_t batches) override;
  void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                    const Fp8Scales& scales, Fp8ScaleRule rule, std::size_t rows, std::size_t cols,
                    std::size_t batches) override;
  void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows, std::size_t block_rows,
                  std::size_t scale_cols, std::size_t batches) override;
  void repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t k) override;
  void marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t groups) override;
  std::unique_ptr<Event> record() override;
  void synchronize() override;
  void abandon_emulated_waits() override;

 private:
  std::unique_ptr<Stream> inner_;
};

class DeviceWrapper : public Device {
 public:
  // `inner` must not be null.
  explicit DeviceWrapper(std::shared_ptr<Device> inner);
  const std::shared_ptr<Device>& inner() const { return inner_; }

  std::string name() const override;
  void bind() override;
  DeviceAllocation allocate(std::size_t bytes) override;
  DeviceAllocation adopt(std::byte* data, std::size_t bytes,
                         DeviceAllocation::Release release) override;
  PinnedAllocation allocate_pinned(std::size_t bytes) override;
  HostRegistration register_host(void* host, std::size_t bytes) override;
  // The inner device's stream, unwrapped.
  std::unique_ptr<Stream> create_stream() override;
  void reserve_events(std::size_t count) override;
  AllocationStats stats() const override;
  bool holds_data() const override;
  bool host_addressable() const override;
  int numa_node() const override;
  std::size_t narrow_row_bytes() const override;
  std::optional<SharedBlock> shared_block(const std::byte* p) const override;
  void seal_shared() override;
  DeviceAllocation map_shared(const SharedBlock& block, int fd) override;
  std::string uuid() const override;

 private:
  std::shared_ptr<Device> inner_;
};

}  // namespace ferry::gpu
