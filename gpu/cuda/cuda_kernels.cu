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

#include "gpu/cuda/cuda_kernels.hpp"
#include "gpu/cuda/kernels_emulated.hpp"

namespace ferry::gpu::cuda {
namespace {

enum class Kind { kBF16, kF16, kF32 };

template <Kind K>
struct Storage {
  using Type = std::uint16_t;
};
template <>
struct Storage<Kind::kF32> {
  using Type = std::uint32_t;
};

constexpr unsigned kThreads = 256;
constexpr std::size_t kMaxBlocks = 8192;  // grid-stride loops cover the rest

constexpr std::uint32_t kF32CanonicalNaN = 0x7FC00000u;
constexpr std::uint16_t kBF16CanonicalNaN = 0x7FC0u;
constexpr std::uint16_t kF16CanonicalNaN = 0x7E00u;

__host__ __device__ inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

__host__ __device__ inline float bits_float(std::uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

__host__ __device__ inline bool f32_is_nan(std::uint32_t bits) {
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// Element -> F32 bits (exact for every non-NaN input).
template <Kind K>
__host__ __device__ inline std::uint32_t widen(typename Storage<K>::Type v) {
  if constexpr (K == Kind::kBF16) {
    if ((v & 0x7FFFu) > 0x7F80u) {
      return (static_cast<std::uint32_t>(v & 0x8000u) << 16) | kF32CanonicalNaN;
    }
    __nv_bfloat16_raw raw;
    raw.x = v;
    return float_bits(__bfloat162float(__nv_bfloat16(raw)));
  } else if constexpr (K == Kind::kF16) {
    if ((v & 0x7FFFu) > 0x7C00u) {
      return (static_cast<std::uint32_t>(v & 0x8000u) << 16) | kF32CanonicalNaN;
    }
    __half_raw raw;
    raw.x = v;
    return float_bits(__half2float(__half(raw)));
  } else {
    return f32_is_nan(v) ? ((v & 0x80000000u) | kF32CanonicalNaN) : v;
  }
}

// F32 bits -> element, rounding to nearest even.
template <Kind K>
__host__ __device__ inline typename Storage<K>::Type narrow(std::uint32_t f) {
  if constexpr (K == Kind::kBF16) {
    if (f32_is_nan(f)) {
      return static_cast<std::uint16_t>(((f >> 16) & 0x8000u) | kBF16CanonicalNaN);
    }
    __nv_bfloat16_raw raw = __float2bfloat16_rn(bits_float(f));
    return raw.x;
  } else if constexpr (K == Kind::kF16) {
    if (f32_is_nan(f)) {
      return static_cast<std::uint16_t>(((f >> 16) & 0x8000u) | kF16CanonicalNaN);
    }
    __half_raw raw = __float2half_rn(bits_float(f));
    return raw.x;
  } else {
    return f32_is_nan(f) ? ((f & 0x80000000u) | kF32CanonicalNaN) : f;
  }
}

template <class T, bool kAligned>
__host__ __device__ inline T load(const unsigned char* base, std::size_t i) {
#ifdef __CUDA_ARCH__
  if constexpr (kAligned) {
    return reinterpret_cast<const T*>(base)[i];
  }
#endif
  T v;
  memcpy(&v, base + i * sizeof(T), sizeof(T));
  return v;
}

template <class T, bool kAligned>
__host__ __device__ inline void store(unsigned char* base, std::size_t i, T v) {
#ifdef __CUDA_ARCH__
  if constexpr (kAligned) {
    reinterpret_cast<T*>(base)[i] = v;
    return;
  }
#endif
  memcpy(base + i * sizeof(T), &v, sizeof(T));
}

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

template <Kind S, Kind D, bool kAligned>
__global__ void cast_kernel(unsigned char* dst, const unsigned char* src, std::size_t count) {
  std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    cast_one<S, D, kAligned>(dst, src, i);
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

unsigned grid_for(std::size_t count) {
  std::size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

Kind kind_of(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return Kind::kBF16;
    case DType::kF16:
      return Kind::kF16;
    default:
      return Kind::kF32;  // the caller has checked the dtype is castable
  }
}

std::size_t kind_size(Kind kind) {
  return kind == Kind::kF32 ? 4 : 2;
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
  const unsigned char* src;
  std::size_t count;
  Kind src_kind;
  Kind dst_kind;
  bool aligned;
};

CastArgs cast_args(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                   std::size_t count) {
  CastArgs a{reinterpret_cast<unsigned char*>(dst),
             reinterpret_cast<const unsigned char*>(src),
             count,
             kind_of(src_dtype),
             kind_of(dst_dtype),
             false};
  a.aligned = reinterpret_cast<std::uintptr_t>(dst) % kind_size(a.dst_kind) == 0 &&
              reinterpret_cast<std::uintptr_t>(src) % kind_size(a.src_kind) == 0;
  return a;
}

struct LaunchCast {
  CastArgs a;
  cudaStream_t stream;
  template <Kind S, Kind D, bool kAligned>
  cudaError_t run() {
    cast_kernel<S, D, kAligned><<<grid_for(a.count), kThreads, 0, stream>>>(a.dst, a.src, a.count);
    return cudaGetLastError();
  }
};

struct EmulateCast {
  CastArgs a;
  template <Kind S, Kind D, bool kAligned>
  cudaError_t run() {
    for (std::size_t i = 0; i < a.count; ++i) {
      cast_one<S, D, kAligned>(a.dst, a.src, i);
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

cudaError_t launch_cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                        std::size_t count, cudaStream_t stream) {
  if (count == 0) {
    return cudaSuccess;
  }
  (void)cudaGetLastError();
  LaunchCast op{cast_args(dst, dst_dtype, src, src_dtype, count), stream};
  return with_kinds(op.a.src_kind, op.a.dst_kind, op.a.aligned, op);
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
  EmulateCast op{cast_args(dst, dst_dtype, src, src_dtype, count)};
  with_kinds(op.a.src_kind, op.a.dst_kind, op.a.aligned, op);
}

}  // namespace ferry::gpu::cuda
