// CRC-32 as zlib's crc32() computes it (IEEE 802.3, reflected polynomial 0xEDB88320,
// initial and final XOR 0xFFFFFFFF): the checksum every ZIP member carries, which
// io/torch_writer.cpp computes while it streams a PyTorch checkpoint's tensor data.
// Slicing-by-16 over 16 KiB of tables, so that checksumming GBs of weights costs
// little next to writing them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace ferry {

// The CRC of the bytes so far, `crc` (0 for none), extended by `bytes`: as zlib's
// crc32(crc, buf, len), so crc32(crc32(0, a), b) == crc32(0, a + b).
// Thread-safe (the tables are constant).
std::uint32_t crc32(std::uint32_t crc, std::span<const std::byte> bytes);

}  // namespace ferry
