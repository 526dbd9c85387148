// ggml's tensor types as GGUF files number them: the table (number, the name as
// llama.cpp spells it, elements per block, bytes per block), a reference host
// dequantization to float32 for the types ferry can read without llama.cpp, and a
// Q8_0 quantizer that gives gguf-py's bytes bit for bit. The reference is gguf-py's
// constants.py (GGMLQuantizationType, GGML_QUANT_SIZES) and quants.py; the block
// layouts are ggml's (ggml-common.h). Slow and simple on purpose: the reference a
// faster path is compared with, and what tests and `ferry inspect` use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "common/dtype.hpp"
#include "common/ggml_blocks.hpp"

namespace ferry::io {

// The numbers are the file format's: 4, 5, 31-33 and 36-38 were types ggml removed
// (Q4_2, Q4_3, the Q4_0_4_4 family, the IQ4_NL_4_4 family) and are refused.
enum class GgmlType : std::uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
};

struct GgmlTypeTraits {
  GgmlType type;
  std::string_view name;     // "Q4_K", "BF16": as llama.cpp and gguf-py print it
  std::uint32_t block_size;  // elements per block (1 for the plain types)
  std::uint32_t type_size;   // bytes per block
};

// Every type gguf-py's GGMLQuantizationType lists, in number order.
std::span<const GgmlTypeTraits> ggml_types();
// The traits of type number `number`; nullptr for a number no type has.
const GgmlTypeTraits* find_ggml_type(std::uint32_t number);
const GgmlTypeTraits& ggml_traits(GgmlType type);
std::string_view ggml_type_name(GgmlType type);
// By name, as ggml_type_name spells it; nullopt for anything else.
std::optional<GgmlType> parse_ggml_type(std::string_view name);

// The safetensors dtype of a plain (block size 1) type: F32, F16, BF16, F64 and the
// integers. nullopt for the quantized types, whose bytes have no element type.
std::optional<DType> ggml_dtype(GgmlType type);

// Bytes of a row of `elements` elements: nullopt when `elements` is not a whole
// number of blocks or the product overflows 64 bits.
std::optional<std::uint64_t> ggml_row_bytes(GgmlType type, std::uint64_t elements);

// The block format the copy path dequantizes `type` from (common/ggml_blocks.hpp):
// the quantized types dequantize() reads; nullopt for the others.
std::optional<GgmlBlocks> ggml_blocks(GgmlType type);

// Whether dequantize() reads `type`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
bool can_dequantize(GgmlType type);

// Decodes whole blocks of `type` into float32, as gguf-py's quants.dequantize does
// (the same operations in the same order, so results agree with it exactly on
// hosts that do not fuse multiply-adds; ferry is built without -ffp-contract, which
// ISO C++ mode leaves off). `src` holds n blocks (n * type_size bytes) and `out`
// n * block_size floats. Throws ferry::Error(Stage::kPostProcess) naming `tensor`
// for a type it cannot decode (by name) or sizes that do not match.
void dequantize(GgmlType type, std::span<const std::byte> src, std::span<float> out,
                std::string_view tensor = {});

// Encodes `in` (a multiple of 32 floats) as Q8_0 blocks into `out` (34 bytes per
// block), byte for byte as gguf-py's quants.quantize(x, Q8_0) (itself bit-exact with
// ggml's quantize_row_q8_0_ref): d = max|x| / 127 stored as fp16, q = round-half-
// away(x * (1/d)) as int8, q = 0 where d is 0. Throws ferry::Error(Stage::kSynth)
// naming `tensor` for a value that is not finite (NaN, infinity) or sizes that do not
// match.
void quantize_q8_0(std::span<const float> in, std::span<std::byte> out,
                   std::string_view tensor = {});

// IEEE binary16 and bfloat16 bits to float, exactly (subnormals, infinities, NaN).
float f16_to_float(std::uint16_t bits);
float bf16_to_float(std::uint16_t bits);

}  // namespace ferry::io
