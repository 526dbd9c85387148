// The element primitives the CUDA kernels share (cuda_kernels.cu: fill, cast, copy,
// transpose, match; cuda_fp8_kernels.cu: FP8 quantization): the three float kinds,
// widening and RNE narrowing with the canonical NaNs, aligned and byte-wise loads and
// stores, and the launch geometry. Internal to gpu/cuda/; compiled by nvcc only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/dtype.hpp"

namespace ferry::gpu::cuda {

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

constexpr unsigned kMaxGridYZ = 65535;

inline unsigned grid_for(std::size_t count) {
  std::size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

inline unsigned capped(std::size_t n, std::size_t cap) {
  return static_cast<unsigned>(n < cap ? (n == 0 ? 1 : n) : cap);
}

// A 2-D grid over `rows` rows of `width` items: x over a row, y over the rows.
inline dim3 grid_2d(std::size_t width, std::size_t rows) {
  return dim3(grid_for(width), capped(rows, kMaxGridYZ), 1);
}

inline bool divides(std::size_t unit, std::uintptr_t value) {
  return value % unit == 0;
}

inline Kind kind_of(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return Kind::kBF16;
    case DType::kF16:
      return Kind::kF16;
    default:
      return Kind::kF32;  // the caller has checked the dtype is castable
  }
}

inline std::size_t kind_size(Kind kind) {
  return kind == Kind::kF32 ? 4 : 2;
}

// Calls op.template run<K, kAligned>() for a runtime kind and alignment.
template <class Op>
cudaError_t with_kind(Kind k, bool aligned, Op& op) {
  switch (k) {
    case Kind::kBF16:
      return aligned ? op.template run<Kind::kBF16, true>() : op.template run<Kind::kBF16, false>();
    case Kind::kF16:
      return aligned ? op.template run<Kind::kF16, true>() : op.template run<Kind::kF16, false>();
    case Kind::kF32:
      break;
  }
  return aligned ? op.template run<Kind::kF32, true>() : op.template run<Kind::kF32, false>();
}

}  // namespace ferry::gpu::cuda
