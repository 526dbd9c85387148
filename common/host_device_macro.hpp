// FERRY_HOST_DEVICE marks the few functions that CUDA kernels share with the host
// (`__host__ __device__` under nvcc, nothing elsewhere).
#pragma once

#ifdef __CUDACC__
#define FERRY_HOST_DEVICE __host__ __device__
#else
#define FERRY_HOST_DEVICE
#endif
