// Pieces the backends share and the pipeline does not need: the allocation
// counters behind Device::stats(), and the argument checks every Stream runs before
// it touches memory, so that all backends reject the same calls with the same words.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>

#include "common/dtype.hpp"
#include "gpu/device.hpp"

namespace ferry::gpu::detail {

enum class MemoryKind { kDevice, kPinned, kRegistered };

// Thread-safe counters; one per device.
class StatsTracker {
 public:
  void add(MemoryKind kind, std::size_t bytes);
  void remove(MemoryKind kind, std::size_t bytes);
  void stream_created();
  void stream_destroyed();
  void event_created();
  void event_destroyed();
  AllocationStats snapshot() const;

 private:
  MemoryCounters& counters(MemoryKind kind);

  mutable std::mutex mu_;
  AllocationStats stats_;
};

// The live device allocations of one device (begin -> size) and the check every
// stream operation runs against them, so the backends that check (host, null)
// refuse the same ranges with the same words. Thread-safe.
class AllocationMap {
 public:
  void add(const std::byte* p, std::size_t bytes);
  void remove(const std::byte* p);
  // Fails (Stage::kCopy, naming `device`, `op` and `which`) unless [p, p + bytes)
  // lies inside one live allocation.
  void check(const std::string& device, std::string_view op, std::string_view which,
             const std::byte* p, std::size_t bytes) const;

 private:
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> live_;
};

// Fails when a host pointer is null and `bytes` is not zero.
void check_host_pointer(const std::string& device, std::string_view op, std::string_view which,
                        const void* p, std::size_t bytes);

// Throws ferry::Error(Stage::kCopy, device, "", rule).
[[noreturn]] void fail(const std::string& device, std::string rule);
// Stream::match_pattern's table must be aligned for PatternRange (a GPU kernel reads
// its 8-byte fields in place and faults on a misaligned one); fail() otherwise.
void check_pattern_table(const std::string& device, const void* ranges);

// "0x7f...": for messages.
std::string hex(const void* p);

// a * b, or fail() with "<op>: size overflows".
std::size_t checked_mul(const std::string& device, std::string_view op, std::size_t a,
                        std::size_t b);

// Bytes a pitched region covers: (rows - 1) * pitch + width_bytes (0 if empty).
// Fails when width_bytes > pitch or the size overflows.
std::size_t pitched_span(const std::string& device, std::string_view op, std::string_view which,
                         std::size_t pitch, std::size_t width_bytes, std::size_t rows);

// Checks a fill() call; returns the bytes it writes.
std::size_t check_fill(const std::string& device, DType dtype, std::size_t count);
// Checks a fill_random() call's dtype and size; returns the bytes it writes.
std::size_t check_fill_random(const std::string& device, DType dtype, std::size_t count);

// `bytes` of kPinnedAlignment-aligned host memory standing in for pinned memory (the
// host and null backends), counted in state->stats; the release keeps `state` alive.
// State has `name` and `stats` (a StatsTracker).
template <class State>
PinnedAllocation allocate_host_pinned(const std::shared_ptr<State>& state, std::size_t bytes) {
  if (bytes == 0) {
    return {};
  }
  std::byte* p = nullptr;
  try {
    p = static_cast<std::byte*>(::operator new (bytes, std::align_val_t{kPinnedAlignment}));
  } catch (const std::bad_alloc&) {
    fail(state->name, "allocate_pinned: host RAM refused " + std::to_string(bytes) + " bytes");
  }
  state->stats.add(MemoryKind::kPinned, bytes);
  return PinnedAllocation(p, bytes, [state](std::byte* data, std::size_t size) {
    state->stats.remove(MemoryKind::kPinned, size);
    ::operator delete (data, std::align_val_t{kPinnedAlignment});
  });
}

struct CastBytes {
  std::size_t dst = 0;
  std::size_t src = 0;
};
// Checks a cast() call (dtypes, sizes, overlap); returns the bytes read and written.
CastBytes check_cast(const std::string& device, const std::byte* dst, DType dst_dtype,
                     const std::byte* src, DType src_dtype, std::size_t count);

// The byte ranges a two-sided device operation covers: the destination's span and
// the source's (0, 0: nothing to do).
struct Spans {
  std::size_t dst = 0;
  std::size_t src = 0;
};
// Checks a cast_2d() call (dtypes, pitches, overlap); returns its spans.
Spans check_cast_2d(const std::string& device, const std::byte* dst, std::size_t dst_pitch,
                    DType dst_dtype, const std::byte* src, std::size_t src_pitch, DType src_dtype,
                    std::size_t width, std::size_t rows);
// Checks a dequantize_ggml_2d() call (a block format, a castable destination dtype,
// whole blocks a row, pitches, no overlap); returns its spans.
Spans check_dequantize_ggml_2d(const std::string& device, const std::byte* dst,
                               std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
                               std::size_t src_pitch, GgmlBlocks blocks, std::size_t width,
                               std::size_t rows);
// Checks a copy_d2d_2d() call (pitches, no overlap); returns its spans.
Spans check_copy_d2d_2d(const std::string& device, const std::byte* dst, std::size_t dst_pitch,
                        const std::byte* src, std::size_t src_pitch, std::size_t width_bytes,
                        std::size_t rows);
// Checks a transpose() call (element size, batch pitches, no overlap); returns its spans.
Spans check_transpose(const std::string& device, const std::byte* dst, std::size_t dst_batch_pitch,
                      const std::byte* src, std::size_t src_batch_pitch, std::size_t element_size,
                      std::size_t rows, std::size_t cols, std::size_t batches);

// The byte ranges an FP8 operation covers (gpu::Stream::dequantize_fp8,
// quantize_fp8, pack_ue8m0): its destination, its element source and its scales
// (read by dequantize_fp8 and pack_ue8m0, written by quantize_fp8). All 0: nothing
// to do.
struct Fp8Spans {
  std::size_t dst = 0;
  std::size_t src = 0;
  std::size_t scale = 0;
};
// Check the calls' dtypes, scale layouts, sizes and overlaps; return their spans.
Fp8Spans check_dequantize_fp8(const std::string& device, const std::byte* dst, DType dst_dtype,
                              const std::byte* src, const std::byte* scale, const Fp8Scales& scales,
                              std::size_t rows, std::size_t cols, std::size_t batches);
Fp8Spans check_quantize_fp8(const std::string& device, const std::byte* dst, const std::byte* scale,
                            const std::byte* src, DType src_dtype, const Fp8Scales& scales,
                            std::size_t rows, std::size_t cols, std::size_t batches);
Fp8Spans check_pack_ue8m0(const std::string& device, const std::byte* dst, const std::byte* scale,
                          std::size_t rows, std::size_t block_rows, std::size_t scale_cols,
                          std::size_t batches);

// Checks a repack_marlin_fp4() (`op` "repack_marlin_fp4", `inner` k) or
// marlin_fp4_scales() (`op` "marlin_fp4_scales", `inner` groups) call: n % 64 == 0,
// k % 16 == 0, no overlap; returns its spans (equal: the layouts move bytes).
Spans check_marlin_fp4(const std::string& device, std::string_view op, const std::byte* dst,
                       const std::byte* src, std::size_t n, std::size_t inner);

// A stream's checks on the backends that track their allocations (host, null): the
// arguments, then every device range against `allocations` and every host pointer,
// with the same words on both. Each returns the bytes the operation writes on the
// device (0: nothing to do, nothing checked further).
class TrackedStreamChecks {
 public:
  TrackedStreamChecks(const std::string& device, const AllocationMap& allocations)
      : device_(device), allocations_(allocations) {}
  std::size_t copy_h2d(const std::byte* dst, const std::byte* src_host, std::size_t bytes) const;
  // The destination's pitched span; the bytes written are width_bytes * rows.
  std::size_t copy_h2d_2d(const std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                          std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) const;
  std::size_t fill(const std::byte* dst, std::size_t count, DType dtype) const;
  std::size_t fill_random(const std::byte* dst, std::size_t count, DType dtype) const;
  std::size_t zero(const std::byte* dst, std::size_t bytes) const;
  std::size_t cast(const std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                   std::size_t count) const;
  // The pitched and batched operations return the destination's span.
  std::size_t zero_2d(const std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
                      std::size_t rows) const;
  std::size_t set_bytes(const std::byte* dst, std::size_t bytes) const;
  // The table (count entries) and the flags (count bytes); returns count. The
  // entries themselves are checked by a backend that can read them
  // (check_pattern_range).
  std::size_t match_pattern(const PatternRange* ranges, std::size_t count,
                            const std::uint8_t* flags) const;
  // One entry of a match_pattern table: its element size, and its data inside a
  // live allocation. `index` names it in the message.
  void check_pattern_range(const PatternRange& range, std::size_t index) const;
  std::size_t cast_2d(const std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                      const std::byte* src, std::size_t src_pitch, DType src_dtype,
                      std::size_t width, std::size_t rows) const;
  std::size_t dequantize_ggml_2d(const std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                                 const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                                 std::size_t width, std::size_t rows) const;
  std::size_t copy_d2d_2d(const std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                          std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) const;
  std::size_t transpose(const std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                        std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                        std::size_t cols, std::size_t batches) const;
  // The FP8 operations return the spans (every range checked against the live
  // allocations); spans.dst == 0: nothing to do.
  Fp8Spans dequantize_fp8(const std::byte* dst, DType dst_dtype, const std::byte* src,
                          const std::byte* scale, const Fp8Scales& scales, std::size_t rows,
                          std::size_t cols, std::size_t batches) const;
  Fp8Spans quantize_fp8(const std::byte* dst, const std::byte* scale, const std::byte* src,
                        DType src_dtype, const Fp8Scales& scales, std::size_t rows,
                        std::size_t cols, std::size_t batches) const;
  Fp8Spans pack_ue8m0(const std::byte* dst, const std::byte* scale, std::size_t rows,
                      std::size_t block_rows, std::size_t scale_cols, std::size_t batches) const;
  std::size_t marlin_fp4(std::string_view op, const std::byte* dst, const std::byte* src,
                         std::size_t n, std::size_t inner) const;

 private:
  // Checks `bytes` at dst against the live allocations unless 0; returns `bytes`.
  std::size_t check_destination(std::string_view op, const std::byte* dst,
                                std::size_t bytes) const;
  // Checks both spans against the live allocations; returns the destination's.
  std::size_t check_spans(std::string_view op, const std::byte* dst, const std::byte* src,
                          const Spans& spans) const;
  // An FP8 operation's operands (role, start, bytes) checked in order, unless
  // spans.dst == 0 (nothing to do); returns `spans`.
  struct Operand {
    std::string_view role;
    const std::byte* data;
    std::size_t bytes;
  };
  Fp8Spans check_fp8(std::string_view op, const Fp8Spans& spans,
                     std::initializer_list<Operand> operands) const;

  const std::string& device_;
  const AllocationMap& allocations_;
};

}  // namespace ferry::gpu::detail
