// The central directory of a zip archive, read without inflating anything: what a
// torch.save file (io/torch_checkpoint.hpp) is wrapped in. Only what an index of
// byte ranges needs: each member's name, where its data starts in the file, its
// size, method and flags. ZIP64 is read (torch writes it past 4 GiB); split
// archives, encryption and members that overlap are refused, so a member's bytes
// are one range of the file that no other member shares (the trick of the
// non-recursive zip bombs).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace ferry::io {

// Reads exactly into.size() bytes at `offset`, or throws ferry::Error naming what
// was read. Over a descriptor (read_exactly) or over memory (the fuzz targets).
using ReadAt = std::function<void(std::uint64_t offset, std::span<std::byte> into)>;

struct ZipMember {
  std::string name;
  std::uint64_t header_offset = 0;  // its local file header
  std::uint64_t data_offset = 0;    // its first data byte in the file
  std::uint64_t size = 0;           // stored bytes (compressed size)
  std::uint64_t uncompressed_size = 0;
  std::uint16_t method = 0;  // 0 stored, 8 deflated, ...
  std::uint16_t flags = 0;
  std::uint32_t crc32 = 0;
};

struct ZipDirectory {
  std::vector<ZipMember> members;  // in central-directory order
  bool zip64 = false;
  // Bytes read to learn all this: the end records, the directory, the local headers.
  std::uint64_t bytes_read = 0;
};

// Reads and checks the central directory of the `file_size`-byte archive `read`
// reads, and every member's local header (its name must be the directory's; its
// extra field sets where the data starts). Throws ferry::Error(Stage::kHeader)
// naming `display` (and the member) when: no end-of-central-directory record is in
// the last 64 KiB + 22 bytes; the archive spans disks; the directory runs past its
// end record, is larger than `max_directory_bytes`, or holds fewer or more entries
// than the end record says; an entry is malformed, encrypted, names a member twice,
// or its data runs past the directory; stored sizes disagree; two members' bytes
// overlap.
ZipDirectory read_zip_directory(const ReadAt& read, std::uint64_t file_size,
                                const std::string& display, std::uint64_t max_directory_bytes);

}  // namespace ferry::io
