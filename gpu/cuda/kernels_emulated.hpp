// The CUDA kernels' per-element code (gpu/cuda/cuda_kernels.cu), compiled for the
// host and run in a plain loop. Only built with the CUDA backend. Tests compare it
// with the host twins (gpu/kernels_host.hpp) on machines without a GPU; this checks
// the kernels' own logic (NaN handling, alignment paths, dispatch) and the host
// fallbacks of cuda_fp16.h / cuda_bf16.h, but not the GPU's conversion
// instructions: the self-test on a real device does that.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.hpp"

namespace ferry::gpu::cuda {

void fill_emulated(std::byte* dst, std::size_t count, std::size_t element_size,
                   std::uint64_t pattern);

void cast_emulated(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                   std::size_t count);

}  // namespace ferry::gpu::cuda
