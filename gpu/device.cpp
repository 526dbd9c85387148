// Shared parts of the device layer: dtype capabilities, allocation counters and the
// argument checks every backend runs (see gpu/device_internal.hpp).
#include "gpu/device.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <utility>

#include "common/error.hpp"
#include "gpu/device_internal.hpp"

namespace ferry::gpu {

std::string to_hex(const void* data, std::size_t bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    out += kHex[p[i] >> 4];
    out += kHex[p[i] & 15];
  }
  return out;
}

std::optional<std::string> from_hex(const std::string& hex, std::size_t bytes) {
  if (hex.size() != 2 * bytes) {
    return std::nullopt;
  }
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') {
      return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
      return c - 'a' + 10;
    }
    return -1;
  };
  std::string out(bytes, '\0');
  for (std::size_t i = 0; i < bytes; ++i) {
    const int hi = digit(hex[2 * i]);
    const int lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return std::nullopt;
    }
    out[i] = static_cast<char>(hi * 16 + lo);
  }
  return out;
}

std::string gpu_uuid_text(const unsigned char* uuid16) {
  const std::string h = to_hex(uuid16, 16);
  return "GPU-" + h.substr(0, 8) + "-" + h.substr(8, 4) + "-" + h.substr(12, 4) + "-" +
         h.substr(16, 4) + "-" + h.substr(20, 12);
}

DeviceAllocation Device::map_shared(const SharedBlock& block, int fd) {
  (void)fd;
  detail::fail(name(), "this device cannot map memory another process shares (" + block.kind + ")");
}

bool castable_dtype(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32;
}

bool fillable_dtype(DType dtype) {
  return castable_dtype(dtype) || dtype == DType::kF64;
}

bool random_fillable_dtype(DType dtype) {
  return castable_dtype(dtype) || dtype == DType::kF8E4M3 || dtype == DType::kU8;
}

namespace detail {

MemoryCounters& StatsTracker::counters(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kDevice:
      return stats_.device;
    case MemoryKind::kPinned:
      return stats_.pinned;
    case MemoryKind::kRegistered:
      break;
  }
  return stats_.registered;
}

void StatsTracker::add(MemoryKind kind, std::size_t bytes) {
  std::lock_guard lock(mu_);
  MemoryCounters& c = counters(kind);
  c.live_bytes += bytes;
  c.live_count += 1;
  c.peak_bytes = std::max(c.peak_bytes, c.live_bytes);
  c.total_bytes += bytes;
  c.total_count += 1;
}

void StatsTracker::remove(MemoryKind kind, std::size_t bytes) {
  std::lock_guard lock(mu_);
  MemoryCounters& c = counters(kind);
  c.live_bytes -= bytes;
  c.live_count -= 1;
}

void StatsTracker::stream_created() {
  std::lock_guard lock(mu_);
  ++stats_.live_streams;
}

void StatsTracker::stream_destroyed() {
  std::lock_guard lock(mu_);
  --stats_.live_streams;
}

void StatsTracker::event_created() {
  std::lock_guard lock(mu_);
  ++stats_.live_events;
}

void StatsTracker::event_destroyed() {
  std::lock_guard lock(mu_);
  --stats_.live_events;
}

AllocationStats StatsTracker::snapshot() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void fail(const std::string& device, std::string rule) {
  throw Error(Stage::kCopy, device, "", std::move(rule));
}

void AllocationMap::add(const std::byte* p, std::size_t bytes) {
  std::lock_guard lock(mu_);
  live_.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
}

void AllocationMap::remove(const std::byte* p) {
  std::lock_guard lock(mu_);
  live_.erase(reinterpret_cast<std::uintptr_t>(p));
}

void AllocationMap::check(const std::string& device, std::string_view op, std::string_view which,
                          const std::byte* p, std::size_t bytes) const {
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  {
    std::lock_guard lock(mu_);
    auto it = live_.upper_bound(begin);
    if (it != live_.begin()) {
      --it;
      const std::uintptr_t offset = begin - it->first;
      if (offset <= it->second && bytes <= it->second - offset) {
        return;
      }
    }
  }
  fail(device, std::string(op) + ": " + std::string(which) + " [" + hex(p) + ", +" +
                   std::to_string(bytes) + ") is not inside a live allocation of this device");
}

void check_host_pointer(const std::string& device, std::string_view op, std::string_view which,
                        const void* p, std::size_t bytes) {
  if (p == nullptr && bytes != 0) {
    fail(device, std::string(op) + ": " + std::string(which) + " is null");
  }
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

std::size_t checked_mul(const std::string& device, std::string_view op, std::size_t a,
                        std::size_t b) {
  if (a != 0 && b > std::numeric_limits<std::size_t>::max() / a) {
    fail(device, std::string(op) + ": size overflows (" + std::to_string(a) + " x " +
                     std::to_string(b) + ")");
  }
  return a * b;
}

std::size_t pitched_span(const std::string& device, std::string_view op, std::string_view which,
                         std::size_t pitch, std::size_t width_bytes, std::size_t rows) {
  if (width_bytes > pitch) {
    fail(device, std::string(op) + ": " + std::string(which) + " pitch " + std::to_string(pitch) +
                     " is smaller than the row width " + std::to_string(width_bytes));
  }
  if (rows == 0 || width_bytes == 0) {
    return 0;
  }
  std::size_t body = checked_mul(device, op, rows - 1, pitch);
  if (body > std::numeric_limits<std::size_t>::max() - width_bytes) {
    fail(device, std::string(op) + ": size overflows");
  }
  return body + width_bytes;
}

std::size_t check_fill(const std::string& device, DType dtype, std::size_t count) {
  if (!fillable_dtype(dtype)) {
    fail(device, "fill: dtype " + std::string(dtype_name(dtype)) +
                     " is not supported (BF16, F16, F32, F64 are)");
  }
  return checked_mul(device, "fill", count, dtype_size(dtype));
}

std::size_t check_fill_random(const std::string& device, DType dtype, std::size_t count) {
  if (!random_fillable_dtype(dtype)) {
    fail(device, "fill_random: dtype " + std::string(dtype_name(dtype)) +
                     " is not supported (BF16, F16, F32, F8_E4M3, U8 are)");
  }
  return checked_mul(device, "fill_random", count, dtype_size(dtype));
}

std::size_t TrackedStreamChecks::copy_h2d(const std::byte* dst, const std::byte* src_host,
                                          std::size_t bytes) const {
  if (bytes == 0) {
    return 0;
  }
  allocations_.check(device_, "copy_h2d", "destination", dst, bytes);
  check_host_pointer(device_, "copy_h2d", "source", src_host, bytes);
  return bytes;
}

std::size_t TrackedStreamChecks::copy_h2d_2d(const std::byte* dst, std::size_t dst_pitch,
                                             const std::byte* src_host, std::size_t src_pitch,
                                             std::size_t width_bytes, std::size_t rows) const {
  const std::size_t dst_span =
      pitched_span(device_, "copy_h2d_2d", "destination", dst_pitch, width_bytes, rows);
  pitched_span(device_, "copy_h2d_2d", "source", src_pitch, width_bytes, rows);
  if (dst_span == 0) {
    return 0;
  }
  allocations_.check(device_, "copy_h2d_2d", "destination", dst, dst_span);
  check_host_pointer(device_, "copy_h2d_2d", "source", src_host, width_bytes);
  return dst_span;
}

std::size_t TrackedStreamChecks::fill(const std::byte* dst, std::size_t count, DType dtype) const {
  return check_destination("fill", dst, check_fill(device_, dtype, count));
}

std::size_t TrackedStreamChecks::fill_random(const std::byte* dst, std::size_t count,
                                             DType dtype) const {
  return check_destination("fill_random", dst, check_fill_random(device_, dtype, count));
}

std::size_t TrackedStreamChecks::zero(const std::byte* dst, std::size_t bytes) const {
  return check_destination("zero", dst, bytes);
}

std::size_t TrackedStreamChecks::cast(const std::byte* dst, DType dst_dtype, const std::byte* src,
                                      DType src_dtype, std::size_t count) const {
  const CastBytes bytes = check_cast(device_, dst, dst_dtype, src, src_dtype, count);
  if (count == 0) {
    return 0;
  }
  allocations_.check(device_, "cast", "destination", dst, bytes.dst);
  allocations_.check(device_, "cast", "source", src, bytes.src);
  return bytes.dst;
}

std::size_t TrackedStreamChecks::zero_2d(const std::byte* dst, std::size_t dst_pitch,
                                         std::size_t width_bytes, std::size_t rows) const {
  const std::size_t span =
      pitched_span(device_, "zero_2d", "destination", dst_pitch, width_bytes, rows);
  return check_destination("zero_2d", dst, span);
}

std::size_t TrackedStreamChecks::set_bytes(const std::byte* dst, std::size_t bytes) const {
  return check_destination("set_bytes", dst, bytes);
}

std::size_t TrackedStreamChecks::check_destination(std::string_view op, const std::byte* dst,
                                                   std::size_t bytes) const {
  if (bytes != 0) {
    allocations_.check(device_, op, "destination", dst, bytes);
  }
  return bytes;
}

void check_pattern_table(const std::string& device, const void* ranges) {
  if (reinterpret_cast<std::uintptr_t>(ranges) % alignof(PatternRange) != 0) {
    fail(device, "match_pattern: the table at " + hex(ranges) + " is not " +
                     std::to_string(alignof(PatternRange)) + "-byte aligned");
  }
}

std::size_t TrackedStreamChecks::match_pattern(const PatternRange* ranges, std::size_t count,
                                               const std::uint8_t* flags) const {
  if (count == 0) {
    return 0;
  }
  check_pattern_table(device_, ranges);
  allocations_.check(device_, "match_pattern", "table",
                     reinterpret_cast<const std::byte*>(ranges),
                     checked_mul(device_, "match_pattern", count, sizeof(PatternRange)));
  allocations_.check(device_, "match_pattern", "flags", reinterpret_cast<const std::byte*>(flags),
                     count);
  return count;
}

void TrackedStreamChecks::check_pattern_range(const PatternRange& range, std::size_t index) const {
  const std::uint32_t es = range.element_size;
  if (es != 1 && es != 2 && es != 4 && es != 8) {
    fail(device_, "match_pattern: range " + std::to_string(index) + " has element size " +
                      std::to_string(es) + " (1, 2, 4 or 8 expected)");
  }
  if (range.bytes != 0) {
    allocations_.check(device_, "match_pattern", "range " + std::to_string(index), range.data,
                       static_cast<std::size_t>(range.bytes));
  }
}

std::size_t TrackedStreamChecks::cast_2d(const std::byte* dst, std::size_t dst_pitch,
                                         DType dst_dtype, const std::byte* src,
                                         std::size_t src_pitch, DType src_dtype, std::size_t width,
                                         std::size_t rows) const {
  const Spans spans =
      check_cast_2d(device_, dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows);
  return check_spans("cast_2d", dst, src, spans);
}

std::size_t TrackedStreamChecks::dequantize_ggml_2d(const std::byte* dst, std::size_t dst_pitch,
                                                    DType dst_dtype, const std::byte* src,
                                                    std::size_t src_pitch, GgmlBlocks blocks,
                                                    std::size_t width, std::size_t rows) const {
  const Spans spans = check_dequantize_ggml_2d(device_, dst, dst_pitch, dst_dtype, src, src_pitch,
                                               blocks, width, rows);
  return check_spans("dequantize_ggml_2d", dst, src, spans);
}

std::size_t TrackedStreamChecks::copy_d2d_2d(const std::byte* dst, std::size_t dst_pitch,
                                             const std::byte* src, std::size_t src_pitch,
                                             std::size_t width_bytes, std::size_t rows) const {
  const Spans spans = check_copy_d2d_2d(device_, dst, dst_pitch, src, src_pitch, width_bytes, rows);
  return check_spans("copy_d2d_2d", dst, src, spans);
}

std::size_t TrackedStreamChecks::transpose(const std::byte* dst, std::size_t dst_batch_pitch,
                                           const std::byte* src, std::size_t src_batch_pitch,
                                           std::size_t element_size, std::size_t rows,
                                           std::size_t cols, std::size_t batches) const {
  const Spans spans = check_transpose(device_, dst, dst_batch_pitch, src, src_batch_pitch,
                                      element_size, rows, cols, batches);
  return check_spans("transpose", dst, src, spans);
}

std::size_t TrackedStreamChecks::marlin_fp4(std::string_view op, const std::byte* dst,
                                            const std::byte* src, std::size_t n,
                                            std::size_t inner) const {
  return check_spans(op, dst, src, check_marlin_fp4(device_, op, dst, src, n, inner));
}

Fp8Spans TrackedStreamChecks::dequantize_fp8(const std::byte* dst, DType dst_dtype,
                                             const std::byte* src, const std::byte* scale,
                                             const Fp8Scales& scales, std::size_t rows,
                                             std::size_t cols, std::size_t batches) const {
  const Fp8Spans s =
      check_dequantize_fp8(device_, dst, dst_dtype, src, scale, scales, rows, cols, batches);
  return check_fp8(
      "dequantize_fp8", s,
      {{"destination", dst, s.dst}, {"source", src, s.src}, {"scales", scale, s.scale}});
}

Fp8Spans TrackedStreamChecks::quantize_fp8(const std::byte* dst, const std::byte* scale,
                                           const std::byte* src, DType src_dtype,
                                           const Fp8Scales& scales, std::size_t rows,
                                           std::size_t cols, std::size_t batches) const {
  const Fp8Spans s =
      check_quantize_fp8(device_, dst, scale, src, src_dtype, scales, rows, cols, batches);
  return check_fp8(
      "quantize_fp8", s,
      {{"destination", dst, s.dst}, {"scales", scale, s.scale}, {"source", src, s.src}});
}

Fp8Spans TrackedStreamChecks::pack_ue8m0(const std::byte* dst, const std::byte* scale,
                                         std::size_t rows, std::size_t block_rows,
                                         std::size_t scale_cols, std::size_t batches) const {
  const Fp8Spans s = check_pack_ue8m0(device_, dst, scale, rows, block_rows, scale_cols, batches);
  return check_fp8("pack_ue8m0", s, {{"destination", dst, s.dst}, {"scales", scale, s.scale}});
}

Fp8Spans TrackedStreamChecks::check_fp8(std::string_view op, const Fp8Spans& spans,
                                        std::initializer_list<Operand> operands) const {
  if (spans.dst != 0) {
    for (const Operand& o : operands) {
      allocations_.check(device_, op, o.role, o.data, o.bytes);
    }
  }
  return spans;
}

std::size_t TrackedStreamChecks::check_spans(std::string_view op, const std::byte* dst,
                                             const std::byte* src, const Spans& spans) const {
  if (spans.dst == 0) {
    return 0;
  }
  allocations_.check(device_, op, "destination", dst, spans.dst);
  allocations_.check(device_, op, "source", src, spans.src);
  return spans.dst;
}

namespace {

bool overlapping(const std::byte* a, std::size_t a_bytes, const std::byte* b, std::size_t b_bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

void fail_overlap(const std::string& device, std::string_view op, const std::byte* dst,
                  const std::byte* src, const Spans& spans) {
  fail(device, std::string(op) + ": source [" + hex(src) + ", +" + std::to_string(spans.src) +
                   ") and destination [" + hex(dst) + ", +" + std::to_string(spans.dst) +
                   ") overlap");
}

}  // namespace

Spans check_cast_2d(const std::string& device, const std::byte* dst, std::size_t dst_pitch,
                    DType dst_dtype, const std::byte* src, std::size_t src_pitch, DType src_dtype,
                    std::size_t width, std::size_t rows) {
  if (!castable_dtype(dst_dtype) || !castable_dtype(src_dtype)) {
    fail(device, "cast_2d " + std::string(dtype_name(src_dtype)) + " -> " +
                     std::string(dtype_name(dst_dtype)) + ": only BF16, F16 and F32 are supported");
  }
  const std::size_t dst_row = checked_mul(device, "cast_2d", width, dtype_size(dst_dtype));
  const std::size_t src_row = checked_mul(device, "cast_2d", width, dtype_size(src_dtype));
  Spans spans{pitched_span(device, "cast_2d", "destination", dst_pitch, dst_row, rows),
              pitched_span(device, "cast_2d", "source", src_pitch, src_row, rows)};
  if (spans.dst == 0) {
    return {};
  }
  const bool in_place = dst == src && dst_pitch == src_pitch && dst_row == src_row;
  if (!in_place && overlapping(dst, spans.dst, src, spans.src)) {
    fail_overlap(device, "cast_2d", dst, src, spans);
  }
  return spans;
}

Spans check_dequantize_ggml_2d(const std::string& device, const std::byte* dst,
                               std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
                               std::size_t src_pitch, GgmlBlocks blocks, std::size_t width,
                               std::size_t rows) {
  constexpr std::string_view kOp = "dequantize_ggml_2d";
  const std::string what = std::string(kOp) + " " + std::string(ggml_blocks_name(blocks)) + " -> " +
                           std::string(dtype_name(dst_dtype));
  if (blocks == GgmlBlocks::kNone) {
    fail(device, what + ": no block format (Q4_0 .. Q6_K expected)");
  }
  if (!castable_dtype(dst_dtype)) {
    fail(device, what + ": only BF16, F16 and F32 destinations are supported");
  }
  const GgmlBlockShape shape = ggml_block_shape(blocks);
  if (width % shape.elems != 0) {
    fail(device, what + ": a row of " + std::to_string(width) +
                     " elements is not a whole number of blocks (" + std::to_string(shape.elems) +
                     " elements each)");
  }
  const std::size_t dst_row = checked_mul(device, kOp, width, dtype_size(dst_dtype));
  const std::size_t src_row = checked_mul(device, kOp, width / shape.elems, shape.bytes);
  Spans spans{pitched_span(device, kOp, "destination", dst_pitch, dst_row, rows),
              pitched_span(device, kOp, "source", src_pitch, src_row, rows)};
  if (spans.dst == 0) {
    return {};
  }
  if (overlapping(dst, spans.dst, src, spans.src)) {
    fail_overlap(device, kOp, dst, src, spans);
  }
  return spans;
}

Spans check_copy_d2d_2d(const std::string& device, const std::byte* dst, std::size_t dst_pitch,
                        const std::byte* src, std::size_t src_pitch, std::size_t width_bytes,
                        std::size_t rows) {
  Spans spans{pitched_span(device, "copy_d2d_2d", "destination", dst_pitch, width_bytes, rows),
              pitched_span(device, "copy_d2d_2d", "source", src_pitch, width_bytes, rows)};
  if (spans.dst == 0) {
    return {};
  }
  if (overlapping(dst, spans.dst, src, spans.src)) {
    fail_overlap(device, "copy_d2d_2d", dst, src, spans);
  }
  return spans;
}

Spans check_transpose(const std::string& device, const std::byte* dst, std::size_t dst_batch_pitch,
                      const std::byte* src, std::size_t src_batch_pitch, std::size_t element_size,
                      std::size_t rows, std::size_t cols, std::size_t batches) {
  if (element_size != 1 && element_size != 2 && element_size != 4 && element_size != 8) {
    fail(device, "transpose: element size " + std::to_string(element_size) +
                     " is not supported (1, 2, 4 and 8 are)");
  }
  const std::size_t matrix =
      checked_mul(device, "transpose", checked_mul(device, "transpose", rows, cols), element_size);
  Spans spans{pitched_span(device, "transpose", "destination", dst_batch_pitch, matrix, batches),
              pitched_span(device, "transpose", "source", src_batch_pitch, matrix, batches)};
  if (spans.dst == 0) {
    return {};
  }
  if (overlapping(dst, spans.dst, src, spans.src)) {
    fail_overlap(device, "transpose", dst, src, spans);
  }
  return spans;
}

Spans check_marlin_fp4(const std::string& device, std::string_view op, const std::byte* dst,
                       const std::byte* src, std::size_t n, std::size_t inner) {
  const bool weight = op == "repack_marlin_fp4";
  if (n % 64 != 0 || (weight && inner % 16 != 0)) {
    fail(device, std::string(op) + ": n " + std::to_string(n) + (weight ? ", k " : ", groups ") +
                     std::to_string(inner) + ": Marlin's tiles need n % 64 == 0" +
                     (weight ? " and k % 16 == 0" : ""));
  }
  // The weight: n rows of k / 2 bytes either way; the scales: n x groups bytes.
  const std::size_t bytes = checked_mul(device, op, n, weight ? inner / 2 : inner);
  const Spans spans{bytes, bytes};
  if (bytes != 0 && overlapping(dst, spans.dst, src, spans.src)) {
    fail_overlap(device, op, dst, src, spans);
  }
  return bytes == 0 ? Spans{} : spans;
}

namespace {

// Spans of a batch of rows x cols matrices with their scales; fails for a bad
// scale layout. `dst_size` / `src_size`: bytes an element takes on each side.
Fp8Spans fp8_spans(const std::string& device, std::string_view op, const Fp8Scales& scales,
                   std::size_t rows, std::size_t cols, std::size_t batches, std::size_t dst_size,
                   std::size_t src_size, bool repeat_scale) {
  if (scales.granularity == Fp8Granularity::kBlock &&
      (scales.block_rows == 0 || scales.block_cols == 0)) {
    fail(device, std::string(op) + ": block scales need a block of at least 1 x 1, not " +
                     std::to_string(scales.block_rows) + " x " + std::to_string(scales.block_cols));
  }
  if (repeat_scale && scales.granularity == Fp8Granularity::kTensor && scales.tensor_repeat == 0) {
    fail(device, std::string(op) +
                     ": a per-tensor scale must be written at least once "
                     "(tensor_repeat is 0)");
  }
  const std::size_t elems = checked_mul(device, op, checked_mul(device, op, rows, cols), batches);
  if (elems == 0) {
    return {};
  }
  std::size_t per_matrix = fp8::scale_count(scales, rows, cols);
  if (repeat_scale && scales.granularity == Fp8Granularity::kTensor) {
    per_matrix = scales.tensor_repeat;
  }
  return {checked_mul(device, op, elems, dst_size), checked_mul(device, op, elems, src_size),
          checked_mul(device, op, checked_mul(device, op, per_matrix, batches), sizeof(float))};
}

void fail_fp8_overlap(const std::string& device, std::string_view op, std::string_view a_name,
                      const std::byte* a, std::size_t a_bytes, std::string_view b_name,
                      const std::byte* b, std::size_t b_bytes) {
  if (overlapping(a, a_bytes, b, b_bytes)) {
    fail(device, std::string(op) + ": " + std::string(a_name) + " [" + hex(a) + ", +" +
                     std::to_string(a_bytes) + ") and " + std::string(b_name) + " [" + hex(b) +
                     ", +" + std::to_string(b_bytes) + ") overlap");
  }
}

}  // namespace

Fp8Spans check_dequantize_fp8(const std::string& device, const std::byte* dst, DType dst_dtype,
                              const std::byte* src, const std::byte* scale, const Fp8Scales& scales,
                              std::size_t rows, std::size_t cols, std::size_t batches) {
  if (!castable_dtype(dst_dtype)) {
    fail(device, "dequantize_fp8: F8_E4M3 -> " + std::string(dtype_name(dst_dtype)) +
                     " is not supported (BF16, F16 and F32 are)");
  }
  const Fp8Spans spans = fp8_spans(device, "dequantize_fp8", scales, rows, cols, batches,
                                   dtype_size(dst_dtype), 1, false);
  if (spans.dst != 0) {
    fail_fp8_overlap(device, "dequantize_fp8", "source", src, spans.src, "destination", dst,
                     spans.dst);
    fail_fp8_overlap(device, "dequantize_fp8", "scales", scale, spans.scale, "destination", dst,
                     spans.dst);
  }
  return spans;
}

Fp8Spans check_quantize_fp8(const std::string& device, const std::byte* dst, const std::byte* scale,
                            const std::byte* src, DType src_dtype, const Fp8Scales& scales,
                            std::size_t rows, std::size_t cols, std::size_t batches) {
  if (!castable_dtype(src_dtype)) {
    fail(device, "quantize_fp8: " + std::string(dtype_name(src_dtype)) +
                     " -> F8_E4M3 is not supported (BF16, F16 and F32 are)");
  }
  const Fp8Spans spans = fp8_spans(device, "quantize_fp8", scales, rows, cols, batches, 1,
                                   dtype_size(src_dtype), true);
  if (spans.dst != 0) {
    fail_fp8_overlap(device, "quantize_fp8", "source", src, spans.src, "destination", dst,
                     spans.dst);
    fail_fp8_overlap(device, "quantize_fp8", "source", src, spans.src, "scales", scale,
                     spans.scale);
    fail_fp8_overlap(device, "quantize_fp8", "scales", scale, spans.scale, "destination", dst,
                     spans.dst);
  }
  return spans;
}

Fp8Spans check_pack_ue8m0(const std::string& device, const std::byte* dst, const std::byte* scale,
                          std::size_t rows, std::size_t block_rows, std::size_t scale_cols,
                          std::size_t batches) {
  if (block_rows == 0) {
    fail(device, "pack_ue8m0: block_rows must be at least 1");
  }
  const std::string_view op = "pack_ue8m0";
  const std::size_t words = (scale_cols + 3) / 4;
  const std::size_t block_row_count = (rows + block_rows - 1) / block_rows;
  Fp8Spans spans;
  spans.dst = checked_mul(device, op,
                          checked_mul(device, op, checked_mul(device, op, words, rows), batches),
                          sizeof(std::int32_t));
  if (spans.dst == 0) {
    return {};
  }
  spans.scale = checked_mul(
      device, op,
      checked_mul(device, op, checked_mul(device, op, block_row_count, scale_cols), batches),
      sizeof(float));
  fail_fp8_overlap(device, op, "scales", scale, spans.scale, "destination", dst, spans.dst);
  return spans;
}

CastBytes check_cast(const std::string& device, const std::byte* dst, DType dst_dtype,
                     const std::byte* src, DType src_dtype, std::size_t count) {
  if (!castable_dtype(dst_dtype) || !castable_dtype(src_dtype)) {
    fail(device, "cast " + std::string(dtype_name(src_dtype)) + " -> " +
                     std::string(dtype_name(dst_dtype)) + ": only BF16, F16 and F32 are supported");
  }
  CastBytes bytes{checked_mul(device, "cast", count, dtype_size(dst_dtype)),
                  checked_mul(device, "cast", count, dtype_size(src_dtype))};
  if (count == 0) {
    return bytes;
  }
  auto d = reinterpret_cast<std::uintptr_t>(dst);
  auto s = reinterpret_cast<std::uintptr_t>(src);
  bool in_place = dst == src && bytes.dst == bytes.src;
  bool overlap = d < s + bytes.src && s < d + bytes.dst;
  if (overlap && !in_place) {
    fail(device, "cast " + std::string(dtype_name(src_dtype)) + " -> " +
                     std::string(dtype_name(dst_dtype)) + ": source [" + hex(src) + ", +" +
                     std::to_string(bytes.src) + ") and destination [" + hex(dst) + ", +" +
                     std::to_string(bytes.dst) +
                     ") overlap (only dst == src with equal element sizes may)");
  }
  return bytes;
}

}  // namespace detail
}  // namespace ferry::gpu
