// Marlin's NVFP4 layouts, element by element: what SGLang 0.5.23's
// prepare_nvfp4_layer_for_marlin (quantization/marlin_utils_fp4.py) makes of a dense
// NVFP4 linear for the fp4 Marlin GEMM that serves NVFP4 below sm100. Shared by the
// host loops (gpu/kernels_host.cpp) and the CUDA kernels (gpu/cuda/cuda_kernels.cu),
// so the two give the same bytes. Stream::repack_marlin_fp4 and marlin_fp4_scales
// (gpu/device.hpp) run them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/host_device_macro.hpp"

namespace ferry::gpu::marlin {

// Word `w` of gptq_marlin_repack(weight.view(int32).T, perm = [], size_k = k,
// size_n = n, num_bits = 4) for the packed E2M1 weight [n, k / 2] bytes at `src`
// (element c of row r: byte c / 2 of the row, the low nibble first). The words are
// [k / 16][2n]: tile (kt, nt) of 16 x 64 elements (k x n) fills 128 consecutive
// words; word t * 4 + g of a tile is the one thread t of warp g writes
// (gptq_marlin_repack.cuh): the column warp g * 16 + t / 4 and the one 8 to its
// right, rows (t % 4) * 2 + {0, 1, 8, 9}, eight nibbles in the order {0, 2, 4, 6,
// 1, 3, 5, 7} of (left column's four rows, right column's four rows).
FERRY_HOST_DEVICE inline std::uint32_t repack_word(const unsigned char* src, std::size_t n,
                                                   std::size_t k, std::size_t w) {
  const std::size_t tile = w / 128;
  const std::size_t in_tile = w % 128;
  const std::size_t n_tiles = n / 64;
  const std::size_t thread = in_tile / 4;
  const std::size_t col = (tile % n_tiles) * 64 + (in_tile % 4) * 16 + thread / 4;
  const std::size_t row = (tile / n_tiles) * 16 + (thread % 4) * 2;
  const std::size_t row_bytes = k / 2;
  std::uint32_t out = 0;
  for (unsigned i = 0; i < 8; ++i) {
    const unsigned v = (i % 4) * 2 + i / 4;  // {0, 2, 4, 6, 1, 3, 5, 7}[i]
    const unsigned r4 = v % 4;
    const std::size_t kk = row + (r4 % 2) + (r4 / 2) * 8;  // {0, 1, 8, 9}[r4]
    const std::size_t nn = col + (v / 4) * 8;
    const unsigned byte = src[nn * row_bytes + kk / 2];
    out |= static_cast<std::uint32_t>((byte >> ((kk % 2) * 4)) & 0xFu) << (i * 4);
  }
  return out;
}

// nvfp4_marlin_process_scales of one E4M3 scale: the bits of f16(x * 2^7) (exact for
// every E4M3 value), shifted left once, high byte: the sign is dropped, then five
// exponent bits and the top three mantissa bits. NaN gives 0xFC, the code of f16
// 0x7E00, the NaN torch's CPU casts give; on a GPU torch's casts may give another
// NaN pattern (0x7FFF: 0xFF), so a NaN scale, which only a broken checkpoint has,
// is the one value whose code is not pinned to SGLang's on every device.
FERRY_HOST_DEVICE inline unsigned char scale_code(unsigned char e4m3) {
  const unsigned exponent = (e4m3 >> 3) & 0xFu;
  unsigned mantissa = e4m3 & 7u;
  if (exponent == 15 && mantissa == 7) {
    return 0xFC;
  }
  if (exponent != 0) {
    return static_cast<unsigned char>(((exponent + 15) << 3) | mantissa);
  }
  if (mantissa == 0) {
    return 0;
  }
  // Subnormal: mantissa * 2^-9, times 2^7, normalized in f16.
  unsigned f16_exponent = 16;
  while ((mantissa & 8u) == 0) {
    mantissa <<= 1;
    --f16_exponent;
  }
  return static_cast<unsigned char>((f16_exponent << 3) | (mantissa & 7u));
}

// Byte `f` of the Marlin scales [groups][n] made from the E4M3 block scales [n,
// groups] at `src`: transposed to [groups][n] (weight_scale.T), each run of 64
// permuted by marlin_permute_scales' scale_perm (position i * 8 + j takes i + 8 * j),
// each run of 4 by [0, 2, 1, 3], and coded (scale_code).
FERRY_HOST_DEVICE inline unsigned char scale_byte(const unsigned char* src, std::size_t n,
                                                  std::size_t groups, std::size_t f) {
  const std::size_t q = f - f % 4 + ((f % 4) % 3 == 0 ? f % 4 : 3 - f % 4);
  const std::size_t x = q % 64;
  const std::size_t t = q - x + x / 8 + (x % 8) * 8;
  return scale_code(src[(t % n) * groups + t / n]);
}

}  // namespace ferry::gpu::marlin
