// The CUDA kernels behind Stream::fill and Stream::cast, and their host-run
// emulation. Host twins: gpu/kernels_host.cpp; the bytes must match them exactly.
//
// Conversions use the RNE intrinsics (__float2bfloat16_rn, __float2half_rn; the
// widening ones are exact). NaN is handled before the intrinsics ever see it: the
// instructions' NaN outputs are not specified closely enough to promise identical
// bytes, so a NaN becomes the canonical quiet NaN of the target type with the
// input's sign, exactly as the host twin does.
//
// Pointers from a tensor's offset inside a buffer need not be aligned to the
// element size: each kernel has an aligned variant (typed loads/stores) and a byte
// variant (memcpy per element), chosen at launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "gpu/cuda/cuda_elements.cuh"
#include "gpu/cuda/cuda_kernels.hpp"
#include "gpu/cuda/kernels_emulated.hpp"
#include "gpu/fill_random.hpp"
#include "gpu/fp8.hpp"

namespace ferry::gpu::cuda {
namespace {

// One element of a cast: what every thread of cast_kernel does, and what
// cast_emulated loops over. Reads element i before writing it, so dst == src works
// for equal element sizes.
template <Kind S, Kind D, bool kAligned>
__host__ __device__ inline void cast_one(unsigned char* dst, const unsigned char* src,
                                         std::size_t i) {
  using In = typename Storage<S>::Type;
  using Out = typename Storage<D>::Type;
  store<Out, kAligned>(dst, i, narrow<D>(widen<S>(load<In, kAligned>(src, i))));
}

// A cast of `rows` rows of `width` elements: blocks stride over rows in y and over a
// row's elements in x (one launch for a whole pitched fragment).
template <Kind S, Kind D, bool kAligned>
__global__ void cast_kernel(unsigned char* dst, std::size_t dst_pitch, const unsigned char* src,
                            std::size_t src_pitch, std::size_t width, std::size_t rows) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < width;
         i += stride) {
      cast_one<S, D, kAligned>(dst + r * dst_pitch, src + r * src_pitch, i);
    }
  }
}

// Word i of row r of a pitched device-to-device copy; T is the widest word that
// divides both pointers, both pitches and the row (chosen at launch).
template <class T>
__host__ __device__ inline void copy_word(unsigned char* dst, std::size_t dst_pitch,
                                          const unsigned char* src, std::size_t src_pitch,
                                          std::size_t r, std::size_t i) {
  store<T, true>(dst + r * dst_pitch, i, load<T, true>(src + r * src_pitch, i));
}

template <class T>
__global__ void copy_2d_kernel(unsigned char* dst, std::size_t dst_pitch, const unsigned char* src,
                               std::size_t src_pitch, std::size_t words, std::size_t rows) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
         i += stride) {
      copy_word<T>(dst, dst_pitch, src, src_pitch, r, i);
    }
  }
}

// Where element (r, c) of a rows x cols matrix goes, and where it comes from: the
// transpose's whole mapping, shared by the kernel and its emulation.
__host__ __device__ inline std::size_t transpose_source(std::size_t r, std::size_t c,
                                                        std::size_t cols) {
  return r * cols + c;
}
__host__ __device__ inline std::size_t transpose_target(std::size_t r, std::size_t c,
                                                        std::size_t rows) {
  return c * rows + r;
}

constexpr unsigned kTile = 32;     // a transpose block moves a 32 x 32 tile
constexpr unsigned kTileRows = 8;  //   with 32 x 8 threads

// Batched transpose through a shared-memory tile, so that both the reads (along a
// source row) and the writes (along a destination row) are coalesced. Loop bounds
// depend on block indices only, so every thread of a block reaches each barrier.
template <class T, bool kAligned>
__global__ void transpose_kernel(unsigned char* dst, std::size_t dst_batch_pitch,
                                 const unsigned char* src, std::size_t src_batch_pitch,
                                 std::size_t rows, std::size_t cols, std::size_t batches) {
  __shared__ T tile[kTile][kTile + 1];
  const std::size_t tiles_r = (rows + kTile - 1) / kTile;
  const std::size_t tiles_c = (cols + kTile - 1) / kTile;
  for (std::size_t b = blockIdx.z; b < batches; b += gridDim.z) {
    const unsigned char* in = src + b * src_batch_pitch;
    unsigned char* out = dst + b * dst_batch_pitch;
    for (std::size_t tr = blockIdx.y; tr < tiles_r; tr += gridDim.y) {
      for (std::size_t tc = blockIdx.x; tc < tiles_c; tc += gridDim.x) {
        const std::size_t c = tc * kTile + threadIdx.x;
        for (unsigned k = threadIdx.y; k < kTile; k += kTileRows) {
          const std::size_t r = tr * kTile + k;
          if (r < rows && c < cols) {
            tile[k][threadIdx.x] = load<T, kAligned>(in, transpose_source(r, c, cols));
          }
        }
        __syncthreads();
        const std::size_t r = tr * kTile + threadIdx.x;
        for (unsigned k = threadIdx.y; k < kTile; k += kTileRows) {
          const std::size_t cc = tc * kTile + k;
          if (r < rows && cc < cols) {
            store<T, kAligned>(out, transpose_target(r, cc, rows), tile[threadIdx.x][k]);
          }
        }
        __syncthreads();
      }
    }
  }
}

// Stream::fill_random's element i (gpu/fill_random.hpp), stored with narrow<>.
enum class RandomKind { kBF16, kF16, kF32, kE4M3, kU8 };

template <bool kAligned>
__host__ __device__ inline void random_one(unsigned char* dst, std::size_t i, RandomKind kind,
                                           float low, float span, std::uint64_t seed) {
  const std::uint64_t bits = random_fill::splitmix64(seed + i);
  const std::uint32_t f = float_bits(random_fill::value(bits, low, span));
  switch (kind) {
    case RandomKind::kU8:
      dst[i] = static_cast<unsigned char>(bits >> 56);
      break;
    case RandomKind::kE4M3:
      dst[i] = random_fill::e4m3_from_f32_bits(f);
      break;
    case RandomKind::kBF16:
      store<std::uint16_t, kAligned>(dst, i, narrow<Kind::kBF16>(f));
      break;
    case RandomKind::kF16:
      store<std::uint16_t, kAligned>(dst, i, narrow<Kind::kF16>(f));
      break;
    case RandomKind::kF32:
      store<std::uint32_t, kAligned>(dst, i, narrow<Kind::kF32>(f));
      break;
  }
}

template <bool kAligned>
__global__ void fill_random_kernel(unsigned char* dst, std::size_t count, RandomKind kind,
                                   float low, float span, std::uint64_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    random_one<kAligned>(dst, i, kind, low, span, seed);
  }
}

template <class T, bool kAligned>
__global__ void fill_kernel(unsigned char* dst, std::size_t count, T value) {
  std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    store<T, kAligned>(dst, i, value);
  }
}

// Turns the runtime (source, destination, aligned) triple into a template
// instantiation of Op::run<S, D, kAligned>().
template <Kind S, Kind D, class Op>
cudaError_t with_alignment(bool aligned, Op& op) {
  return aligned ? op.template run<S, D, true>() : op.template run<S, D, false>();
}

template <Kind S, class Op>
cudaError_t with_destination(Kind d, bool aligned, Op& op) {
  switch (d) {
    case Kind::kBF16:
      return with_alignment<S, Kind::kBF16>(aligned, op);
    case Kind::kF16:
      return with_alignment<S, Kind::kF16>(aligned, op);
    case Kind::kF32:
      break;
  }
  return with_alignment<S, Kind::kF32>(aligned, op);
}

template <class Op>
cudaError_t with_kinds(Kind s, Kind d, bool aligned, Op& op) {
  switch (s) {
    case Kind::kBF16:
      return with_destination<Kind::kBF16>(d, aligned, op);
    case Kind::kF16:
      return with_destination<Kind::kF16>(d, aligned, op);
    case Kind::kF32:
      break;
  }
  return with_destination<Kind::kF32>(d, aligned, op);
}

struct CastArgs {
  unsigned char* dst;
  std::size_t dst_pitch;
  const unsigned char* src;
  std::size_t src_pitch;
  std::size_t width;
  std::size_t rows;
  Kind src_kind;
  Kind dst_kind;
  bool aligned;
};

CastArgs cast_args(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
                   std::size_t src_pitch, DType src_dtype, std::size_t width, std::size_t rows) {
  CastArgs a{reinterpret_cast<unsigned char*>(dst),
             dst_pitch,
             reinterpret_cast<const unsigned char*>(src),
             src_pitch,
             width,
             rows,
             kind_of(src_dtype),
             kind_of(dst_dtype),
             false};
  const std::size_t ds = kind_size(a.dst_kind);
  const std::size_t ss = kind_size(a.src_kind);
  a.aligned = divides(ds, reinterpret_cast<std::uintptr_t>(dst)) && divides(ds, dst_pitch) &&
              divides(ss, reinterpret_cast<std::uintptr_t>(src)) && divides(ss, src_pitch);
  return a;
}

struct LaunchCast {
  CastArgs a;
  cudaStream_t stream;
  template <Kind S, Kind D, bool kAligned>
  cudaError_t run() {
    cast_kernel<S, D, kAligned><<<grid_2d(a.width, a.rows), kThreads, 0, stream>>>(
        a.dst, a.dst_pitch, a.src, a.src_pitch, a.width, a.rows);
    return cudaGetLastError();
  }
};

struct EmulateCast {
  CastArgs a;
  template <Kind S, Kind D, bool kAligned>
  cudaError_t run() {
    for (std::size_t r = 0; r < a.rows; ++r) {
      for (std::size_t i = 0; i < a.width; ++i) {
        cast_one<S, D, kAligned>(a.dst + r * a.dst_pitch, a.src + r * a.src_pitch, i);
      }
    }
    return cudaSuccess;
  }
};

// The widest word (16, 8, 4, 2 or 1 bytes) dividing every address and length of a
// pitched copy: how many bytes each thread moves at once.
std::size_t copy_word_size(const std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                           std::size_t src_pitch, std::size_t width_bytes) {
  for (std::size_t w : {16, 8, 4, 2}) {
    if (divides(w, reinterpret_cast<std::uintptr_t>(dst)) &&
        divides(w, reinterpret_cast<std::uintptr_t>(src)) && divides(w, dst_pitch) &&
        divides(w, src_pitch) && divides(w, width_bytes)) {
      return w;
    }
  }
  return 1;
}

// Calls op.template run<T>() with the unsigned word type of `size` bytes.
template <class Op>
cudaError_t with_word(std::size_t size, Op& op) {
  switch (size) {
    case 16:
      return op.template run<uint4>();
    case 8:
      return op.template run<unsigned long long>();
    case 4:
      return op.template run<std::uint32_t>();
    case 2:
      return op.template run<std::uint16_t>();
    default:
      return op.template run<std::uint8_t>();
  }
}

struct CopyArgs {
  unsigned char* dst;
  std::size_t dst_pitch;
  const unsigned char* src;
  std::size_t src_pitch;
  std::size_t width_bytes;
  std::size_t rows;
};

struct LaunchCopy2d {
  CopyArgs a;
  cudaStream_t stream;
  template <class T>
  cudaError_t run() {
    const std::size_t words = a.width_bytes / sizeof(T);
    copy_2d_kernel<T><<<grid_2d(words, a.rows), kThreads, 0, stream>>>(a.dst, a.dst_pitch, a.src,
                                                                       a.src_pitch, words, a.rows);
    return cudaGetLastError();
  }
};

struct EmulateCopy2d {
  CopyArgs a;
  template <class T>
  cudaError_t run() {
    const std::size_t words = a.width_bytes / sizeof(T);
    for (std::size_t r = 0; r < a.rows; ++r) {
      for (std::size_t i = 0; i < words; ++i) {
        copy_word<T>(a.dst, a.dst_pitch, a.src, a.src_pitch, r, i);
      }
    }
    return cudaSuccess;
  }
};

struct TransposeArgs {
  unsigned char* dst;
  std::size_t dst_batch_pitch;
  const unsigned char* src;
  std::size_t src_batch_pitch;
  std::size_t element_size;
  std::size_t rows;
  std::size_t cols;
  std::size_t batches;
  bool aligned() const {
    const std::size_t es = element_size;
    return divides(es, reinterpret_cast<std::uintptr_t>(dst)) &&
           divides(es, reinterpret_cast<std::uintptr_t>(src)) && divides(es, dst_batch_pitch) &&
           divides(es, src_batch_pitch);
  }
};

struct LaunchTranspose {
  TransposeArgs a;
  cudaStream_t stream;
  template <class T>
  cudaError_t run() {
    const dim3 grid(capped((a.cols + kTile - 1) / kTile, kMaxBlocks),
                    capped((a.rows + kTile - 1) / kTile, kMaxGridYZ),
                    capped(a.batches, kMaxGridYZ));
    const dim3 block(kTile, kTileRows, 1);
    if (a.aligned()) {
      transpose_kernel<T, true><<<grid, block, 0, stream>>>(
          a.dst, a.dst_batch_pitch, a.src, a.src_batch_pitch, a.rows, a.cols, a.batches);
    } else {
      transpose_kernel<T, false><<<grid, block, 0, stream>>>(
          a.dst, a.dst_batch_pitch, a.src, a.src_batch_pitch, a.rows, a.cols, a.batches);
    }
    return cudaGetLastError();
  }
};

struct EmulateTranspose {
  TransposeArgs a;
  template <class T>
  cudaError_t run() {
    for (std::size_t b = 0; b < a.batches; ++b) {
      const unsigned char* in = a.src + b * a.src_batch_pitch;
      unsigned char* out = a.dst + b * a.dst_batch_pitch;
      for (std::size_t r = 0; r < a.rows; ++r) {
        for (std::size_t c = 0; c < a.cols; ++c) {
          store<T, false>(out, transpose_target(r, c, a.rows),
                          load<T, false>(in, transpose_source(r, c, a.cols)));
        }
      }
    }
    return cudaSuccess;
  }
};

template <class T>
cudaError_t launch_fill_typed(unsigned char* dst, std::size_t count, T value, cudaStream_t stream) {
  if (reinterpret_cast<std::uintptr_t>(dst) % sizeof(T) == 0) {
    fill_kernel<T, true><<<grid_for(count), kThreads, 0, stream>>>(dst, count, value);
  } else {
    fill_kernel<T, false><<<grid_for(count), kThreads, 0, stream>>>(dst, count, value);
  }
  return cudaGetLastError();
}

template <class T>
void emulate_fill_typed(unsigned char* dst, std::size_t count, T value) {
  bool aligned = reinterpret_cast<std::uintptr_t>(dst) % sizeof(T) == 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (aligned) {
      store<T, true>(dst, i, value);
    } else {
      store<T, false>(dst, i, value);
    }
  }
}

}  // namespace

cudaError_t launch_fill(std::byte* dst, std::size_t count, std::size_t element_size,
                        std::uint64_t pattern, cudaStream_t stream) {
  if (count == 0) {
    return cudaSuccess;
  }
  // A failure left in the last-error slot by an earlier call (already reported to
  // its caller) must not be blamed on this launch.
  (void)cudaGetLastError();
  auto* d = reinterpret_cast<unsigned char*>(dst);
  switch (element_size) {
    case 2:
      return launch_fill_typed(d, count, static_cast<std::uint16_t>(pattern), stream);
    case 4:
      return launch_fill_typed(d, count, static_cast<std::uint32_t>(pattern), stream);
    case 8:
      return launch_fill_typed(d, count, static_cast<unsigned long long>(pattern), stream);
    default:
      return cudaErrorInvalidValue;
  }
}

namespace {

bool random_kind(DType dtype, RandomKind& kind) {
  switch (dtype) {
    case DType::kBF16:
      kind = RandomKind::kBF16;
      return true;
    case DType::kF16:
      kind = RandomKind::kF16;
      return true;
    case DType::kF32:
      kind = RandomKind::kF32;
      return true;
    case DType::kF8E4M3:
      kind = RandomKind::kE4M3;
      return true;
    case DType::kU8:
      kind = RandomKind::kU8;
      return true;
    default:
      return false;
  }
}

}  // namespace

cudaError_t launch_fill_random(std::byte* dst, std::size_t count, DType dtype, float low,
                               float span, std::uint64_t seed, cudaStream_t stream) {
  RandomKind kind{};
  if (!random_kind(dtype, kind)) {
    return cudaErrorInvalidValue;
  }
  if (count == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  auto* d = reinterpret_cast<unsigned char*>(dst);
  if (reinterpret_cast<std::uintptr_t>(dst) % dtype_size(dtype) == 0) {
    fill_random_kernel<true>
        <<<grid_for(count), kThreads, 0, stream>>>(d, count, kind, low, span, seed);
  } else {
    fill_random_kernel<false>
        <<<grid_for(count), kThreads, 0, stream>>>(d, count, kind, low, span, seed);
  }
  return cudaGetLastError();
}

void fill_random_emulated(std::byte* dst, std::size_t count, DType dtype, float low, float span,
                          std::uint64_t seed) {
  RandomKind kind{};
  if (!random_kind(dtype, kind)) {
    return;
  }
  auto* d = reinterpret_cast<unsigned char*>(dst);
  const bool aligned = reinterpret_cast<std::uintptr_t>(dst) % dtype_size(dtype) == 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (aligned) {
      random_one<true>(d, i, kind, low, span, seed);
    } else {
      random_one<false>(d, i, kind, low, span, seed);
    }
  }
}

cudaError_t launch_cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                        std::size_t count, cudaStream_t stream) {
  const std::size_t dst_row = count * kind_size(kind_of(dst_dtype));
  const std::size_t src_row = count * kind_size(kind_of(src_dtype));
  return launch_cast_2d(dst, dst_row, dst_dtype, src, src_row, src_dtype, count, 1, stream);
}

cudaError_t launch_cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                           const std::byte* src, std::size_t src_pitch, DType src_dtype,
                           std::size_t width, std::size_t rows, cudaStream_t stream) {
  if (width == 0 || rows == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  LaunchCast op{cast_args(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows),
                stream};
  return with_kinds(op.a.src_kind, op.a.dst_kind, op.a.aligned, op);
}

cudaError_t launch_copy_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                           std::size_t src_pitch, std::size_t width_bytes, std::size_t rows,
                           cudaStream_t stream) {
  if (width_bytes == 0 || rows == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  LaunchCopy2d op{{reinterpret_cast<unsigned char*>(dst), dst_pitch,
                   reinterpret_cast<const unsigned char*>(src), src_pitch, width_bytes, rows},
                  stream};
  return with_word(copy_word_size(dst, dst_pitch, src, src_pitch, width_bytes), op);
}

cudaError_t launch_transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                             std::size_t src_batch_pitch, std::size_t element_size,
                             std::size_t rows, std::size_t cols, std::size_t batches,
                             cudaStream_t stream) {
  if (rows == 0 || cols == 0 || batches == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  LaunchTranspose op{{reinterpret_cast<unsigned char*>(dst), dst_batch_pitch,
                      reinterpret_cast<const unsigned char*>(src), src_batch_pitch, element_size,
                      rows, cols, batches},
                     stream};
  return element_size == 16 ? cudaErrorInvalidValue : with_word(element_size, op);
}

namespace {

constexpr unsigned kMatchPasses = 8;  // bytes a thread compares between two votes

__host__ __device__ inline bool valid_element_size(std::uint32_t es) {
  return es == 1 || es == 2 || es == 4 || es == 8;
}

// Byte j of a range holds byte j % element_size of its element: the low bytes of
// `pattern`, least significant first (the little-endian machine order of
// host::fill_pattern).
__host__ __device__ inline bool pattern_byte(const unsigned char* data, std::uint64_t j,
                                             std::uint64_t pattern, std::uint32_t es) {
  const unsigned shift = static_cast<unsigned>(j % es) * 8;
  return data[j] == static_cast<unsigned char>((pattern >> shift) & 0xFFu);
}

// A block a range. The threads of a block read consecutive bytes (coalesced) and
// vote after every kMatchPasses bytes each, so that a range that differs early
// (real weights, against the sentinel) is settled in its first pass; the vote is
// uniform, so every thread leaves the loop together.
__global__ void match_pattern_kernel(const PatternRange* ranges, std::size_t count,
                                     std::uint8_t* flags) {
  for (std::size_t r = blockIdx.x; r < count; r += gridDim.x) {
    const PatternRange range = ranges[r];
    const bool valid = valid_element_size(range.element_size);
    const std::uint64_t whole =
        valid ? range.bytes / range.element_size * range.element_size : 0;
    const auto* data = reinterpret_cast<const unsigned char*>(range.data);
    int same = valid ? 1 : 0;
    const std::uint64_t step = static_cast<std::uint64_t>(blockDim.x) * kMatchPasses;
    for (std::uint64_t base = 0; base < whole && same != 0; base += step) {
      int mine = 1;
      for (unsigned k = 0; k < kMatchPasses; ++k) {
        const std::uint64_t j = base + static_cast<std::uint64_t>(k) * blockDim.x + threadIdx.x;
        if (j < whole && !pattern_byte(data, j, range.pattern, range.element_size)) {
          mine = 0;
        }
      }
      same = __syncthreads_and(mine);
    }
    if (threadIdx.x == 0) {
      flags[r] = same != 0 ? 1 : 0;
    }
    __syncthreads();  // the next range's loads after this one's vote
  }
}

}  // namespace

cudaError_t launch_match_pattern(const PatternRange* ranges, std::size_t count,
                                 std::uint8_t* flags, cudaStream_t stream) {
  if (count == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  const unsigned blocks = static_cast<unsigned>(count < kMaxBlocks ? count : kMaxBlocks);
  match_pattern_kernel<<<blocks, kThreads, 0, stream>>>(ranges, count, flags);
  return cudaGetLastError();
}

void match_pattern_emulated(const PatternRange* ranges, std::size_t count, std::uint8_t* flags) {
  for (std::size_t r = 0; r < count; ++r) {
    const PatternRange& range = ranges[r];
    const bool valid = valid_element_size(range.element_size);
    const std::uint64_t whole =
        valid ? range.bytes / range.element_size * range.element_size : 0;
    const auto* data = reinterpret_cast<const unsigned char*>(range.data);
    bool same = valid;
    for (std::uint64_t j = 0; j < whole && same; ++j) {
      same = pattern_byte(data, j, range.pattern, range.element_size);
    }
    flags[r] = same ? 1 : 0;
  }
}

void fill_emulated(std::byte* dst, std::size_t count, std::size_t element_size,
                   std::uint64_t pattern) {
  auto* d = reinterpret_cast<unsigned char*>(dst);
  switch (element_size) {
    case 2:
      emulate_fill_typed(d, count, static_cast<std::uint16_t>(pattern));
      break;
    case 4:
      emulate_fill_typed(d, count, static_cast<std::uint32_t>(pattern));
      break;
    case 8:
      emulate_fill_typed(d, count, static_cast<unsigned long long>(pattern));
      break;
    default:
      break;
  }
}

void cast_emulated(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                   std::size_t count) {
  const std::size_t dst_row = count * kind_size(kind_of(dst_dtype));
  const std::size_t src_row = count * kind_size(kind_of(src_dtype));
  cast_2d_emulated(dst, dst_row, dst_dtype, src, src_row, src_dtype, count, 1);
}

void cast_2d_emulated(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
                      std::size_t src_pitch, DType src_dtype, std::size_t width, std::size_t rows) {
  EmulateCast op{cast_args(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows)};
  with_kinds(op.a.src_kind, op.a.dst_kind, op.a.aligned, op);
}

void copy_2d_emulated(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                      std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) {
  EmulateCopy2d op{{reinterpret_cast<unsigned char*>(dst), dst_pitch,
                    reinterpret_cast<const unsigned char*>(src), src_pitch, width_bytes, rows}};
  with_word(copy_word_size(dst, dst_pitch, src, src_pitch, width_bytes), op);
}

std::size_t copy_2d_word_size(const std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                              std::size_t src_pitch, std::size_t width_bytes) {
  return copy_word_size(dst, dst_pitch, src, src_pitch, width_bytes);
}

void transpose_emulated(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                        std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                        std::size_t cols, std::size_t batches) {
  EmulateTranspose op{{reinterpret_cast<unsigned char*>(dst), dst_batch_pitch,
                       reinterpret_cast<const unsigned char*>(src), src_batch_pitch, element_size,
                       rows, cols, batches}};
  if (element_size != 16) {
    with_word(element_size, op);
  }
}


}  // namespace ferry::gpu::cuda
