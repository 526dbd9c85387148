#include "gpu/device_wrapper.hpp"

#include <stdexcept>
#include <utility>

namespace ferry::gpu {

StreamWrapper::StreamWrapper(std::unique_ptr<Stream> inner) : inner_(std::move(inner)) {
  if (!inner_) {
    throw std::invalid_argument("StreamWrapper: no inner stream");
  }
}

void StreamWrapper::copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) {
  inner_->copy_h2d(dst, src_host, bytes);
}
void StreamWrapper::copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                                std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) {
  inner_->copy_h2d_2d(dst, dst_pitch, src_host, src_pitch, width_bytes, rows);
}
void StreamWrapper::copy_d2h(std::byte* dst_host, const std::byte* src, std::size_t bytes) {
  inner_->copy_d2h(dst_host, src, bytes);
}
void StreamWrapper::fill(std::byte* dst, std::size_t count, DType dtype, double value) {
  inner_->fill(dst, count, dtype, value);
}
void StreamWrapper::fill_random(std::byte* dst, std::size_t count, DType dtype, double low,
                                double high, std::uint64_t seed) {
  inner_->fill_random(dst, count, dtype, low, high, seed);
}
void StreamWrapper::zero(std::byte* dst, std::size_t bytes) { inner_->zero(dst, bytes); }
void StreamWrapper::cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                         std::size_t count) {
  inner_->cast(dst, dst_dtype, src, src_dtype, count);
}
void StreamWrapper::zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
                            std::size_t rows) {
  inner_->zero_2d(dst, dst_pitch, width_bytes, rows);
}
void StreamWrapper::set_bytes(std::byte* dst, std::byte value, std::size_t bytes) {
  inner_->set_bytes(dst, value, bytes);
}
void StreamWrapper::match_pattern(const PatternRange* ranges, std::size_t count,
                                  std::uint8_t* flags) {
  inner_->match_pattern(ranges, count, flags);
}
void StreamWrapper::cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                            const std::byte* src, std::size_t src_pitch, DType src_dtype,
                            std::size_t width, std::size_t rows) {
  inner_->cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows);
}
void StreamWrapper::dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                                       const std::byte* src, std::size_t src_pitch,
                                       GgmlBlocks blocks, std::size_t width, std::size_t rows) {
  inner_->dequantize_ggml_2d(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width, rows);
}
void StreamWrapper::copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                                std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) {
  inner_->copy_d2d_2d(dst, dst_pitch, src, src_pitch, width_bytes, rows);
}
void StreamWrapper::transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                              std::size_t src_batch_pitch, std::size_t element_size,
                              std::size_t rows, std::size_t cols, std::size_t batches) {
  inner_->transpose(dst, dst_batch_pitch, src, src_batch_pitch, element_size, rows, cols, batches);
}
void StreamWrapper::dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src,
                                   const std::byte* scale, const Fp8Scales& scales,
                                   std::size_t rows, std::size_t cols, std::size_t batches) {
  inner_->dequantize_fp8(dst, dst_dtype, src, scale, scales, rows, cols, batches);
}
void StreamWrapper::quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src,
                                 DType src_dtype, const Fp8Scales& scales, Fp8ScaleRule rule,
                                 std::size_t rows, std::size_t cols, std::size_t batches) {
  inner_->quantize_fp8(dst, scale, src, src_dtype, scales, rule, rows, cols, batches);
}
void StreamWrapper::pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows,
                               std::size_t block_rows, std::size_t scale_cols,
                               std::size_t batches) {
  inner_->pack_ue8m0(dst, scale, rows, block_rows, scale_cols, batches);
}
void StreamWrapper::repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                                      std::size_t k) {
  inner_->repack_marlin_fp4(dst, src, n, k);
}
void StreamWrapper::marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                                      std::size_t groups) {
  inner_->marlin_fp4_scales(dst, src, n, groups);
}
std::unique_ptr<Event> StreamWrapper::record() { return inner_->record(); }
void StreamWrapper::synchronize() { inner_->synchronize(); }
void StreamWrapper::abandon_emulated_waits() { inner_->abandon_emulated_waits(); }

DeviceWrapper::DeviceWrapper(std::shared_ptr<Device> inner) : inner_(std::move(inner)) {
  if (!inner_) {
    throw std::invalid_argument("DeviceWrapper: no inner device");
  }
}

std::string DeviceWrapper::name() const { return inner_->name(); }
void DeviceWrapper::bind() { inner_->bind(); }
DeviceAllocation DeviceWrapper::allocate(std::size_t bytes) { return inner_->allocate(bytes); }
DeviceAllocation DeviceWrapper::adopt(std::byte* data, std::size_t bytes,
                                      DeviceAllocation::Release release) {
  return inner_->adopt(data, bytes, std::move(release));
}
PinnedAllocation DeviceWrapper::allocate_pinned(std::size_t bytes) {
  return inner_->allocate_pinned(bytes);
}
HostRegistration DeviceWrapper::register_host(void* host, std::size_t bytes) {
  return inner_->register_host(host, bytes);
}
std::unique_ptr<Stream> DeviceWrapper::create_stream() { return inner_->create_stream(); }
void DeviceWrapper::reserve_events(std::size_t count) { inner_->reserve_events(count); }
AllocationStats DeviceWrapper::stats() const { return inner_->stats(); }
bool DeviceWrapper::holds_data() const { return inner_->holds_data(); }
bool DeviceWrapper::host_addressable() const { return inner_->host_addressable(); }
int DeviceWrapper::numa_node() const { return inner_->numa_node(); }
std::size_t DeviceWrapper::narrow_row_bytes() const { return inner_->narrow_row_bytes(); }

std::optional<SharedBlock> DeviceWrapper::shared_block(const std::byte* p) const {
  return inner_->shared_block(p);
}
void DeviceWrapper::seal_shared() {
  inner_->seal_shared();
}
DeviceAllocation DeviceWrapper::map_shared(const SharedBlock& block, int fd) {
  return inner_->map_shared(block, fd);
}
std::string DeviceWrapper::uuid() const {
  return inner_->uuid();
}

}  // namespace ferry::gpu
