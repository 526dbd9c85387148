#include "gpu/kernels_host.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "common/fp8.hpp"
#include "common/thread_start.hpp"
#include "gpu/fill_random.hpp"
#include "gpu/marlin.hpp"

namespace ferry::gpu::host {
namespace {

static_assert(std::endian::native == std::endian::little,
              "fill patterns and element loads assume a little-endian host");

bool f32_is_nan(std::uint32_t bits) {
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// Rounds `value >> shift` to nearest, ties to even (shift >= 1).
std::uint32_t shift_right_rne(std::uint32_t value, unsigned shift) {
  std::uint32_t quotient = value >> shift;
  std::uint32_t remainder = value & ((1u << shift) - 1u);
  std::uint32_t half = 1u << (shift - 1u);
  if (remainder > half || (remainder == half && (quotient & 1u) != 0)) {
    ++quotient;
  }
  return quotient;
}

template <class T>
T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void store(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

// Element i of a BF16/F16/F32 array, widened to F32 bits.
std::uint32_t load_as_f32(const std::byte* base, std::size_t i, DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return bf16_to_f32(load<std::uint16_t>(base + 2 * i));
    case DType::kF16:
      return f16_to_f32(load<std::uint16_t>(base + 2 * i));
    default:
      return load<std::uint32_t>(base + 4 * i);
  }
}

void store_from_f32(std::byte* base, std::size_t i, DType dtype, std::uint32_t f32_bits) {
  switch (dtype) {
    case DType::kBF16:
      store(base + 2 * i, f32_to_bf16(f32_bits));
      break;
    case DType::kF16:
      store(base + 2 * i, f32_to_f16(f32_bits));
      break;
    default:
      store(base + 4 * i,
            f32_is_nan(f32_bits) ? (f32_bits & 0x80000000u) | kF32CanonicalNaN : f32_bits);
  }
}

// double -> float, rounding to nearest even, finite values past the float range
// included (a plain cast of those is undefined behaviour in C++).
float double_to_float(double value) {
  constexpr double kRoundsToInfinity = 0x1.ffffffp+127;  // FLT_MAX + half an ulp: tie to inf
  constexpr float kMax = std::numeric_limits<float>::max();
  if (std::isfinite(value) && std::fabs(value) >= kRoundsToInfinity) {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    return value < 0 ? -kInf : kInf;
  }
  if (std::isfinite(value) && std::fabs(value) > kMax) {
    return value < 0 ? -kMax : kMax;
  }
  return static_cast<float>(value);
}

float from_f32_bits(std::uint32_t bits) {
  return std::bit_cast<float>(bits);
}

bool castable(DType d) {
  return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32;
}

}  // namespace

std::uint16_t f32_to_bf16(std::uint32_t bits) {
  auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  if (f32_is_nan(bits)) {
    return sign | kBF16CanonicalNaN;
  }
  // Adding 0x7FFF plus the lowest kept bit rounds ties to even; a carry out of the
  // mantissa bumps the exponent, which is also right for the largest finite values
  // (they become infinity) and for subnormals (BF16 shares F32's exponent range).
  std::uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

std::uint32_t bf16_to_f32(std::uint16_t bits) {
  if ((bits & 0x7FFFu) > 0x7F80u) {
    return (static_cast<std::uint32_t>(bits & 0x8000u) << 16) | kF32CanonicalNaN;
  }
  return static_cast<std::uint32_t>(bits) << 16;
}

std::uint16_t f32_to_f16(std::uint32_t bits) {
  auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  std::uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) {
    return sign | kF16CanonicalNaN;
  }
  // 65520 (0x477FF000) is halfway between the largest F16 (65504) and 2^16; the tie
  // goes to the even neighbour, which is infinity. Infinity itself lands here too.
  if (magnitude >= 0x477FF000u) {
    return sign | 0x7C00u;
  }
  if (magnitude < 0x38800000u) {  // below 2^-14: an F16 subnormal or zero
    // 2^-25 is halfway between 0 and the smallest subnormal 2^-24: ties to 0.
    if (magnitude <= 0x33000000u) {
      return sign;
    }
    // value = mantissa * 2^(exponent - 150); in units of 2^-24 that is
    // mantissa >> (126 - exponent), with exponent in [102, 112].
    std::uint32_t exponent = magnitude >> 23;
    std::uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
    // May round up to 0x400, which is the encoding of the smallest normal: correct.
    return sign | static_cast<std::uint16_t>(shift_right_rne(mantissa, 126u - exponent));
  }
  // Normal: rebias the exponent (127 -> 15) and drop 13 mantissa bits. A carry from
  // rounding moves into the exponent; the overflow test above keeps it finite.
  std::uint32_t rebiased = magnitude - 0x38000000u;
  return sign | static_cast<std::uint16_t>(shift_right_rne(rebiased, 13));
}

std::uint32_t f16_to_f32(std::uint16_t bits) {
  std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  std::uint32_t exponent = (bits >> 10) & 0x1Fu;
  std::uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0x1F) {
    return mantissa == 0 ? (sign | 0x7F800000u) : (sign | kF32CanonicalNaN);
  }
  if (exponent == 0) {
    if (mantissa == 0) {
      return sign;
    }
    // Subnormal mantissa * 2^-24: normalise so the leading 1 sits at bit 10.
    int e = -14;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    mantissa &= 0x3FFu;
    return sign | (static_cast<std::uint32_t>(e + 127) << 23) | (mantissa << 13);
  }
  return sign | ((exponent + 112u) << 23) | (mantissa << 13);
}

std::uint64_t fill_pattern(DType dtype, double value) {
  if (dtype == DType::kF64) {
    return std::bit_cast<std::uint64_t>(value);
  }
  auto f32 = std::bit_cast<std::uint32_t>(double_to_float(value));
  switch (dtype) {
    case DType::kF32:
      return f32_is_nan(f32) ? ((f32 & 0x80000000u) | kF32CanonicalNaN) : f32;
    case DType::kBF16:
      return f32_to_bf16(f32);
    case DType::kF16:
      return f32_to_f16(f32);
    default:
      throw Error(Stage::kCopy, "", "",
                  "fill: dtype " + std::string(dtype_name(dtype)) +
                      " is not supported (BF16, F16, F32, F64 are)");
  }
}

void fill(std::byte* dst, std::size_t count, DType dtype, double value) {
  std::uint64_t pattern = fill_pattern(dtype, value);
  std::size_t size = dtype_size(dtype);
  std::byte element[8];
  std::memcpy(element, &pattern, size);  // little-endian: the low bytes are the element
  // Element by element for the first 4 KiB, then the filled prefix is copied onto
  // what follows it in blocks of up to 1 MiB (memcpy speed, not one call an element).
  const std::size_t total = count * size;
  const std::size_t head = std::min(total, std::size_t{4096});
  for (std::size_t off = 0; off < head; off += size) {
    std::memcpy(dst + off, element, size);
  }
  for (std::size_t done = head; done < total;) {
    const std::size_t n = std::min({done, total - done, std::size_t{1} << 20});
    std::memcpy(dst + done, dst, n);
    done += n;
  }
}

RandomRange random_range(double low, double high) {
  const float lo = double_to_float(low);
  return {lo, double_to_float(high) - lo};
}

void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                 std::uint64_t seed) {
  const RandomRange r = random_range(low, high);
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t bits = random_fill::splitmix64(seed + i);
    const auto f = std::bit_cast<std::uint32_t>(random_fill::value(bits, r.low, r.span));
    switch (dtype) {
      case DType::kU8:
        dst[i] = static_cast<std::byte>(bits >> 56);
        break;
      case DType::kF8E4M3:
        dst[i] = static_cast<std::byte>(random_fill::e4m3_from_f32_bits(f));
        break;
      case DType::kBF16:
      case DType::kF16:
      case DType::kF32:
        store_from_f32(dst, i, dtype, f);
        break;
      default:
        throw Error(Stage::kCopy, "", "",
                    "fill_random: dtype " + std::string(dtype_name(dtype)) +
                        " is not supported (BF16, F16, F32, F8_E4M3, U8 are)");
    }
  }
}

void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
          std::size_t count) {
  if (!castable(dst_dtype) || !castable(src_dtype)) {
    throw Error(Stage::kCopy, "", "",
                "cast " + std::string(dtype_name(src_dtype)) + " -> " +
                    std::string(dtype_name(dst_dtype)) + ": only BF16, F16 and F32 are supported");
  }
  if (dst_dtype == src_dtype) {
    if (count != 0 && dst != src) {
      std::memmove(dst, src, count * dtype_size(dst_dtype));
    }
    return;
  }
  // Every F16 and BF16 value is exact in F32, so going through F32 rounds once.
  // Forward order keeps dst == src correct for equal element sizes (BF16 <-> F16).
  for (std::size_t i = 0; i < count; ++i) {
    store_from_f32(dst, i, dst_dtype, load_as_f32(src, i, src_dtype));
  }
}

void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes, std::size_t rows) {
  for (std::size_t r = 0; r < rows; ++r) {
    std::memset(dst + r * dst_pitch, 0, width_bytes);
  }
}

void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
             std::size_t src_pitch, DType src_dtype, std::size_t width, std::size_t rows) {
  for (std::size_t r = 0; r < rows; ++r) {
    cast(dst + r * dst_pitch, dst_dtype, src + r * src_pitch, src_dtype, width);
  }
}

void copy_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src, std::size_t src_pitch,
             std::size_t width_bytes, std::size_t rows) {
  for (std::size_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * dst_pitch, src + r * src_pitch, width_bytes);
  }
}

void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                        const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                        std::size_t width, std::size_t rows) {
  const GgmlBlockShape shape = ggml_block_shape(blocks);
  if (shape.bytes == 0) {
    return;  // kNone: the caller has refused it
  }
  const std::size_t per_row = width / shape.elems;
  for (std::size_t r = 0; r < rows; ++r) {
    const auto* in = reinterpret_cast<const unsigned char*>(src + r * src_pitch);
    std::byte* out = dst + r * dst_pitch;
    for (std::size_t b = 0; b < per_row; ++b) {
      const unsigned char* block = in + b * shape.bytes;
      for (unsigned e = 0; e < shape.elems; ++e) {
        std::uint32_t f32 = std::bit_cast<std::uint32_t>(ggml_block_element(blocks, block, e));
        if (f32_is_nan(f32)) {
          f32 = kF32CanonicalNaN;  // the sign of a computed NaN is the CPU's: dropped
        }
        store_from_f32(out, b * shape.elems + e, dst_dtype, f32);
      }
    }
  }
}

void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
               std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
               std::size_t cols, std::size_t batches) {
  const std::size_t es = element_size;
  for (std::size_t b = 0; b < batches; ++b) {
    const std::byte* in = src + b * src_batch_pitch;
    std::byte* out = dst + b * dst_batch_pitch;
    for (std::size_t i = 0; i < rows; ++i) {
      for (std::size_t j = 0; j < cols; ++j) {
        std::memcpy(out + (j * rows + i) * es, in + (i * cols + j) * es, es);
      }
    }
  }
}

bool matches_pattern(const std::byte* data, std::uint64_t bytes, std::uint64_t pattern,
                     std::uint32_t element_size) {
  const std::uint64_t whole = bytes / element_size * element_size;
  if (element_size == 1) {
    // The FP8 sentinel: one byte repeated, compared a word at a time by memcmp's
    // library code rather than byte by byte here.
    const auto b = static_cast<std::byte>(pattern & 0xFF);
    std::byte block[4096];
    std::memset(block, static_cast<int>(b), sizeof block);
    for (std::uint64_t off = 0; off < whole; off += sizeof block) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(sizeof block, whole - off));
      if (std::memcmp(data + off, block, n) != 0) {
        return false;
      }
    }
    return true;
  }
  for (std::uint64_t off = 0; off < whole; off += element_size) {
    if (std::memcmp(data + off, &pattern, element_size) != 0) {
      return false;
    }
  }
  return true;
}

void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src, const std::byte* scale,
                    const Fp8Scales& scales, std::size_t rows, std::size_t cols,
                    std::size_t batches) {
  const std::size_t per_matrix = fp8::scale_count(scales, rows, cols);
  const auto* s = reinterpret_cast<const unsigned char*>(scale);
  for (std::size_t b = 0; b < batches; ++b) {
    for (std::size_t r = 0; r < rows; ++r) {
      const std::size_t row = (b * rows + r) * cols;
      for (std::size_t c = 0; c < cols; ++c) {
        const float sc = fp8::load_f32(s, b * per_matrix + fp8::scale_index(scales, r, c, cols));
        const auto q = static_cast<std::uint8_t>(src[row + c]);
        store_from_f32(dst, row + c, dst_dtype, fp8::dequantize_one(q, sc));
      }
    }
  }
}

void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                  const Fp8Scales& scales, Fp8ScaleRule rule, std::size_t rows, std::size_t cols,
                  std::size_t batches) {
  // Every group is a tile: the matrix (kTensor), a row (kRow), a block (kBlock).
  std::size_t tile_rows = rows;
  std::size_t tile_cols = cols;
  if (scales.granularity == Fp8Granularity::kRow) {
    tile_rows = 1;
  } else if (scales.granularity == Fp8Granularity::kBlock) {
    tile_rows = scales.block_rows;
    tile_cols = scales.block_cols;
  }
  if (rows == 0 || cols == 0 || batches == 0) {
    return;
  }
  const bool tensor = scales.granularity == Fp8Granularity::kTensor;
  const std::size_t per_matrix =
      tensor ? scales.tensor_repeat : fp8::scale_count(scales, rows, cols);
  const std::size_t row_tiles = (rows + tile_rows - 1) / tile_rows;
  const std::size_t col_tiles = (cols + tile_cols - 1) / tile_cols;
  auto* q = reinterpret_cast<std::uint8_t*>(dst);
  // Tile rows [t_begin, t_end) of all matrices, in the order (matrix, tile row):
  // each writes its own elements and scale slots, so ranges run side by side.
  auto run = [&](std::size_t t_begin, std::size_t t_end) {
    std::vector<float> buf(std::min(cols, tile_cols));
    for (std::size_t t = t_begin; t < t_end; ++t) {
      const std::size_t b = t / row_tiles;
      const std::size_t r0 = t % row_tiles * tile_rows;
      const std::size_t r1 = std::min(rows, r0 + tile_rows);
      std::size_t slot = b * per_matrix + (tensor ? 0 : t % row_tiles * col_tiles);
      for (std::size_t c0 = 0; c0 < cols; c0 += tile_cols) {
        const std::size_t n = std::min(cols, c0 + tile_cols) - c0;
        const std::size_t copies = tensor ? scales.tensor_repeat : 1;
        float amax = 0;
        if (rule == Fp8ScaleRule::kStatic) {
          // The group's static scale: the largest of its slots as they are.
          amax = fp8::load_f32(reinterpret_cast<const unsigned char*>(scale), slot);
          for (std::size_t k = 1; k < copies; ++k) {
            amax = std::max(amax, fp8::load_f32(reinterpret_cast<const unsigned char*>(scale),
                                                slot + k));
          }
        } else {
          for (std::size_t r = r0; r < r1; ++r) {
            const std::size_t at = (b * rows + r) * cols + c0;
            for (std::size_t i = 0; i < n; ++i) {
              amax = fp8::amax_fold(amax, from_f32_bits(load_as_f32(src, at + i, src_dtype)));
            }
          }
        }
        const fp8::ScaleMul sm = fp8::scale_for(amax, rule);
        for (std::size_t r = r0; r < r1; ++r) {
          const std::size_t at = (b * rows + r) * cols + c0;
          for (std::size_t i = 0; i < n; ++i) {
            buf[i] = from_f32_bits(load_as_f32(src, at + i, src_dtype));
          }
          scale_to_e4m3(buf.data(), n, sm.mul, q + at);
        }
        for (std::size_t k = 0; k < copies; ++k) {
          std::memcpy(scale + 4 * slot++, &sm.scale, sizeof(float));
        }
      }
    }
  };
  // A large weight's row or block groups are spread over the cores, as a GPU spreads
  // them over its blocks (quantization.online on host devices quantizes every linear
  // weight of a model here); small ones, and a whole tensor's one group, stay on
  // the calling thread.
  const std::size_t tiles = batches * row_tiles;
  constexpr std::size_t kElementsPerThread = std::size_t{1} << 20;
  const std::size_t threads = std::min<std::size_t>(
      {std::max(1u, std::thread::hardware_concurrency()), std::size_t{16}, tiles,
       std::max<std::size_t>(1, batches * rows * cols / kElementsPerThread)});
  if (threads <= 1) {
    run(0, tiles);
    return;
  }
  // A share whose thread the system refuses runs here, after the first: this runs
  // on a stream's thread (a copy worker, a deferred queue), where a throw would
  // fail the load for want of a helper the work does not need.
  std::vector<std::thread> pool;
  std::size_t k = 1;
  for (; k < threads; ++k) {
    try {
      pool.push_back(start_thread("host kernel " + std::to_string(k),
                                  [&run, begin = tiles * k / threads,
                                   end = tiles * (k + 1) / threads] { run(begin, end); }));
    } catch (const Error&) {
      break;
    }
  }
  run(0, tiles / threads);
  run(tiles * k / threads, tiles);
  join_all(pool);
}

void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows, std::size_t block_rows,
                std::size_t scale_cols, std::size_t batches) {
  const std::size_t words = (scale_cols + 3) / 4;
  const std::size_t per_matrix = ((rows + block_rows - 1) / block_rows) * scale_cols;
  const auto* s = reinterpret_cast<const unsigned char*>(scale);
  for (std::size_t b = 0; b < batches; ++b) {
    for (std::size_t w = 0; w < words; ++w) {
      for (std::size_t r = 0; r < rows; ++r) {
        store(dst + 4 * ((b * words + w) * rows + r),
              fp8::ue8m0_word(s + 4 * b * per_matrix, r, w, block_rows, scale_cols));
      }
    }
  }
}

void repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n, std::size_t k) {
  const auto* s = reinterpret_cast<const unsigned char*>(src);
  const std::size_t words = n * k / 8;
  for (std::size_t w = 0; w < words; ++w) {
    store(dst + 4 * w, marlin::repack_word(s, n, k, w));
  }
}

void marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n, std::size_t groups) {
  const auto* s = reinterpret_cast<const unsigned char*>(src);
  for (std::size_t f = 0; f < n * groups; ++f) {
    dst[f] = static_cast<std::byte>(marlin::scale_byte(s, n, groups, f));
  }
}

void copy_around_caches(std::byte* dst, const std::byte* src, std::size_t bytes) {
#if defined(__SSE2__)
  constexpr std::size_t kStreamFrom = std::size_t{64} << 10;
  if (bytes >= kStreamFrom) {
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    bytes -= head;
    const std::size_t vectors = bytes / 16;
    auto* d = reinterpret_cast<__m128i*>(dst);
    const auto* s = reinterpret_cast<const __m128i*>(src);
    std::size_t i = 0;
    for (; i + 4 <= vectors; i += 4) {
      const __m128i v0 = _mm_loadu_si128(s + i);
      const __m128i v1 = _mm_loadu_si128(s + i + 1);
      const __m128i v2 = _mm_loadu_si128(s + i + 2);
      const __m128i v3 = _mm_loadu_si128(s + i + 3);
      _mm_stream_si128(d + i, v0);
      _mm_stream_si128(d + i + 1, v1);
      _mm_stream_si128(d + i + 2, v2);
      _mm_stream_si128(d + i + 3, v3);
    }
    for (; i < vectors; ++i) {
      _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
    }
    _mm_sfence();  // the streamed stores are ordered before whatever follows the copy
    std::memcpy(dst + vectors * 16, src + vectors * 16, bytes % 16);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

}  // namespace ferry::gpu::host
