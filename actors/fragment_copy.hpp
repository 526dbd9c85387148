// How one fragment of a window goes from its staging buffer into its parameter, on
// the copy worker's stream: the path it takes, the device scratch the path needs,
// and the stream operations that carry it out. Plain C++ (no actors), so that every
// path is unit-tested on the host backend against the plain row-by-row result.
//
// The paths, by what the device's link does well (gpu::Device::narrow_row_bytes):
//  - kContiguous: one host-to-device copy (one row, or rows dense on both sides);
//  - kPitched: one pitched host-to-device copy (rows at least narrow_row_bytes
//    wide, or a device without a narrow-row limit);
//  - kGather: rows narrower than the limit (row-parallel tp slices: 1-7 KiB) whose
//    source pitch is at most kGatherMaxSpanRatio rows (so the span carries at most
//    that many times the bytes they hold): the span goes contiguously into device
//    scratch, then one device kernel gathers the rows into the parameter. Sparser
//    rows (tp 3 and up: the span would carry 3x the bytes over the link) stay
//    kPitched;
//  - kCast: the source dtype differs, or the source is GGML blocks (dequantized by
//    gpu::Stream::dequantize_ggml_2d instead of cast): the rows go to device scratch (contiguously
//    where they are dense or narrow enough to gather, else by one pitched copy),
//    then one cast_2d launch writes the whole pitched fragment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "actors/plan.hpp"
#include "gpu/device.hpp"

namespace ferry::actors {

enum class CopyPath { kContiguous, kPitched, kGather, kCast };
std::string_view to_string(CopyPath path);

// Gathered rows have a source pitch of at most this many rows. The rule is per row,
// not per span, so that a piece and every fragment a window cuts from it take the
// same path (or a plain copy, cut to one row): the scratch sized per piece before
// streaming then covers each fragment (a span's ratio falls with its row count).
inline constexpr std::uint64_t kGatherMaxSpanRatio = 2;

// The path of a fragment on a device whose narrow-row limit is `narrow_row_bytes`.
CopyPath copy_path(const Fragment& f, std::size_t narrow_row_bytes);

// Device scratch the fragment needs on that device (0: none).
std::uint64_t fragment_scratch_bytes(const Fragment& f, std::size_t narrow_row_bytes);

// Scratch that local rank `rank` needs for every fragment `plan` can cut: the
// largest need of its pieces, at most the plan's chunk_bytes (a fragment never
// spans more than its window). The copy worker allocates it before streaming.
std::uint64_t rank_scratch_bytes(const Plan& plan, std::size_t rank, std::size_t narrow_row_bytes);

// Queues fragment `f` of a window whose bytes are at `staging` into the parameter at
// `param`, through `scratch` (scratch_bytes long) where its path needs it. Scratch
// is reused in stream order, so nothing waits. Throws ferry::Error (Stage::kCopy)
// when the path needs more scratch than there is (an internal error), and what the
// stream throws.
void copy_fragment(gpu::Stream& stream, const Fragment& f, std::byte* param,
                   const std::byte* staging, std::byte* scratch, std::size_t scratch_bytes,
                   std::size_t narrow_row_bytes);

}  // namespace ferry::actors
