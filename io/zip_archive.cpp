#include "io/zip_archive.hpp"

#include <algorithm>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

namespace ferry::io {
namespace {

constexpr std::uint32_t kEndSignature = 0x06054b50;
constexpr std::uint32_t kZip64EndSignature = 0x06064b50;
constexpr std::uint32_t kZip64LocatorSignature = 0x07064b50;
constexpr std::uint32_t kCentralSignature = 0x02014b50;
constexpr std::uint32_t kLocalSignature = 0x04034b50;
constexpr std::uint64_t kEndBytes = 22;
constexpr std::uint64_t kLocatorBytes = 20;
constexpr std::uint64_t kZip64EndBytes = 56;
constexpr std::uint64_t kCentralBytes = 46;
constexpr std::uint64_t kLocalBytes = 30;
constexpr std::uint64_t kMaxComment = 0xffff;

[[noreturn]] void fail(const std::string& display, const std::string& member,
                       const std::string& rule) {
  throw Error(Stage::kHeader, display, member, "zip archive: " + rule);
}

// Little-endian fields of a byte buffer, bounds checked by the callers' sizes.
std::uint64_t le(const std::byte* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) {
    v = (v << 8) | std::to_integer<std::uint64_t>(p[i]);
  }
  return v;
}

struct End {
  std::uint64_t entries = 0;
  std::uint64_t directory_size = 0;
  std::uint64_t directory_offset = 0;
  std::uint64_t limit = 0;  // the directory must end by here (its end record)
  bool zip64 = false;
};

End read_end(const ReadAt& read, std::uint64_t file_size, const std::string& display,
             std::uint64_t& bytes_read) {
  if (file_size < kEndBytes) {
    fail(display, "",
         "the file is " + std::to_string(file_size) +
             " bytes, too short for an end-of-central-directory record");
  }
  const std::uint64_t tail = std::min(file_size, kEndBytes + kMaxComment);
  std::vector<std::byte> buf(tail);
  read(file_size - tail, buf);
  bytes_read += tail;
  // The last record whose comment length reaches exactly the end of the file.
  std::optional<std::uint64_t> at;
  for (std::uint64_t i = tail - kEndBytes + 1; i-- > 0;) {
    if (le(&buf[i], 4) == kEndSignature && i + kEndBytes + le(&buf[i + 20], 2) == tail) {
      at = i;
      break;
    }
  }
  if (!at) {
    fail(display, "", "no end-of-central-directory record (not a zip archive, or truncated)");
  }
  const std::byte* e = &buf[*at];
  End end;
  const std::uint64_t end_offset = file_size - tail + *at;
  if (le(e + 4, 2) != 0 || le(e + 6, 2) != 0 || le(e + 8, 2) != le(e + 10, 2)) {
    fail(display, "", "the archive spans several disks");
  }
  end.entries = le(e + 10, 2);
  end.directory_size = le(e + 12, 4);
  end.directory_offset = le(e + 16, 4);
  end.limit = end_offset;
  const bool escaped = end.entries == 0xffff || end.directory_size == 0xffffffff ||
                       end.directory_offset == 0xffffffff;
  if (end_offset < kLocatorBytes) {
    if (escaped) {
      fail(display, "", "the end record asks for ZIP64 but no ZIP64 locator precedes it");
    }
    return end;
  }
  std::byte loc[kLocatorBytes];
  read(end_offset - kLocatorBytes, loc);
  bytes_read += kLocatorBytes;
  if (le(loc, 4) != kZip64LocatorSignature) {
    if (escaped) {
      fail(display, "", "the end record asks for ZIP64 but no ZIP64 locator precedes it");
    }
    return end;
  }
  if (le(loc + 4, 4) != 0 || le(loc + 16, 4) > 1) {
    fail(display, "", "the archive spans several disks (ZIP64 locator)");
  }
  const std::uint64_t z_offset = le(loc + 8, 8);
  if (z_offset > end_offset - kLocatorBytes ||
      end_offset - kLocatorBytes - z_offset < kZip64EndBytes) {
    fail(display, "",
         "the ZIP64 end record offset " + std::to_string(z_offset) +
             " does not lie before its locator");
  }
  std::byte z[kZip64EndBytes];
  read(z_offset, z);
  bytes_read += kZip64EndBytes;
  if (le(z, 4) != kZip64EndSignature) {
    fail(display, "",
         "no ZIP64 end record where the locator points (" + std::to_string(z_offset) + ")");
  }
  if (le(z + 16, 4) != 0 || le(z + 20, 4) != 0 || le(z + 24, 8) != le(z + 32, 8)) {
    fail(display, "", "the archive spans several disks (ZIP64 end record)");
  }
  end.entries = le(z + 32, 8);
  end.directory_size = le(z + 40, 8);
  end.directory_offset = le(z + 48, 8);
  end.limit = z_offset;
  end.zip64 = true;
  return end;
}

// The ZIP64 extended information of a central entry: the 64-bit values of the
// fields whose 32-bit slots hold 0xffffffff, in the order the format fixes.
void read_zip64_extra(std::span<const std::byte> extra, ZipMember& m, bool want_usize,
                      bool want_csize, bool want_offset, const std::string& display) {
  std::size_t i = 0;
  while (i + 4 <= extra.size()) {
    const std::uint64_t id = le(&extra[i], 2);
    const std::uint64_t len = le(&extra[i + 2], 2);
    if (i + 4 + len > extra.size()) {
      fail(display, m.name, "an extra field runs past the entry");
    }
    if (id == 0x0001) {
      const std::byte* p = &extra[i + 4];
      std::uint64_t left = len;
      auto take = [&](std::uint64_t& field, const char* what) {
        if (left < 8) {
          fail(display, m.name, std::string("the ZIP64 extra field lacks the ") + what);
        }
        field = le(p, 8);
        p += 8;
        left -= 8;
      };
      if (want_usize) {
        take(m.uncompressed_size, "uncompressed size");
      }
      if (want_csize) {
        take(m.size, "compressed size");
      }
      if (want_offset) {
        take(m.header_offset, "local header offset");
      }
      return;
    }
    i += 4 + len;
  }
  if (want_usize || want_csize || want_offset) {
    fail(display, m.name, "a 32-bit field says ZIP64 but the entry has no ZIP64 extra field");
  }
}

}  // namespace

ZipDirectory read_zip_directory(const ReadAt& read, std::uint64_t file_size,
                                const std::string& display, std::uint64_t max_directory_bytes) {
  ZipDirectory out;
  const End end = read_end(read, file_size, display, out.bytes_read);
  out.zip64 = end.zip64;
  if (end.directory_offset > end.limit || end.directory_size > end.limit - end.directory_offset) {
    fail(display, "",
         "the central directory [" + std::to_string(end.directory_offset) + ", +" +
             std::to_string(end.directory_size) + ") runs past its end record at " +
             std::to_string(end.limit));
  }
  if (end.directory_size > max_directory_bytes) {
    fail(display, "",
         "the central directory is " + std::to_string(end.directory_size) +
             " bytes, over the limit of " + std::to_string(max_directory_bytes) +
             " (io.max_metadata_bytes)");
  }
  if (end.entries > end.directory_size / kCentralBytes) {
    fail(display, "",
         "the end record counts " + std::to_string(end.entries) + " entries, more than " +
             std::to_string(end.directory_size) + " directory bytes can hold");
  }
  std::vector<std::byte> dir(end.directory_size);
  read(end.directory_offset, dir);
  out.bytes_read += dir.size();
  out.members.reserve(end.entries);
  std::set<std::string_view> names;
  std::size_t at = 0;
  for (std::uint64_t n = 0; n < end.entries; ++n) {
    if (dir.size() - at < kCentralBytes || le(&dir[at], 4) != kCentralSignature) {
      fail(display, "",
           "central directory entry " + std::to_string(n) + " of " + std::to_string(end.entries) +
               " is not where the directory says (offset " +
               std::to_string(end.directory_offset + at) + ")");
    }
    const std::byte* c = &dir[at];
    const std::uint64_t name_len = le(c + 28, 2);
    const std::uint64_t extra_len = le(c + 30, 2);
    const std::uint64_t comment_len = le(c + 32, 2);
    if (dir.size() - at - kCentralBytes < name_len + extra_len + comment_len) {
      fail(display, "",
           "central directory entry " + std::to_string(n) + " runs past the directory");
    }
    ZipMember m;
    m.name.assign(reinterpret_cast<const char*>(c + kCentralBytes), name_len);
    m.flags = static_cast<std::uint16_t>(le(c + 8, 2));
    m.method = static_cast<std::uint16_t>(le(c + 10, 2));
    m.crc32 = static_cast<std::uint32_t>(le(c + 16, 4));
    m.size = le(c + 20, 4);
    m.uncompressed_size = le(c + 24, 4);
    m.header_offset = le(c + 42, 4);
    if (le(c + 34, 2) != 0 && le(c + 34, 2) != 0xffff) {
      fail(display, m.name, "the member is on another disk");
    }
    read_zip64_extra(std::span(c + kCentralBytes + name_len, extra_len), m,
                     m.uncompressed_size == 0xffffffff, m.size == 0xffffffff,
                     m.header_offset == 0xffffffff, display);
    if ((m.flags & 0x0001) != 0) {
      fail(display, m.name, "the member is encrypted");
    }
    if (!names.insert(std::string_view(reinterpret_cast<const char*>(c + kCentralBytes), name_len))
             .second) {
      fail(display, m.name, "the archive names this member twice");
    }
    out.members.push_back(std::move(m));
    at += kCentralBytes + name_len + extra_len + comment_len;
  }
  if (at != dir.size()) {
    fail(display, "",
         "the central directory holds " + std::to_string(dir.size() - at) +
             " bytes past its last entry (" + std::to_string(end.entries) + " entries)");
  }
  // Each local header: its name must be the directory's, its extra field moves the data.
  std::vector<std::byte> local;
  for (ZipMember& m : out.members) {
    if (m.header_offset > end.directory_offset ||
        end.directory_offset - m.header_offset < kLocalBytes + m.name.size()) {
      fail(display, m.name,
           "the local header at " + std::to_string(m.header_offset) +
               " does not lie before the central directory");
    }
    local.resize(kLocalBytes + m.name.size());
    read(m.header_offset, local);
    out.bytes_read += local.size();
    if (le(local.data(), 4) != kLocalSignature) {
      fail(display, m.name, "no local header at offset " + std::to_string(m.header_offset));
    }
    const std::uint64_t name_len = le(&local[26], 2);
    const std::uint64_t extra_len = le(&local[28], 2);
    if (name_len != m.name.size() ||
        std::string_view(reinterpret_cast<const char*>(&local[kLocalBytes]), name_len) != m.name) {
      fail(display, m.name, "the local header names another member");
    }
    if (le(&local[8], 2) != m.method) {
      fail(display, m.name, "the local header and the directory disagree on the method");
    }
    m.data_offset = m.header_offset + kLocalBytes + name_len + extra_len;
    if (m.data_offset > end.directory_offset || m.size > end.directory_offset - m.data_offset) {
      fail(display, m.name,
           "its data [" + std::to_string(m.data_offset) + ", +" + std::to_string(m.size) +
               ") runs into the central directory at " + std::to_string(end.directory_offset));
    }
    if (m.method == 0 && m.size != m.uncompressed_size) {
      fail(display, m.name,
           "a stored member of " + std::to_string(m.size) + " bytes says it inflates to " +
               std::to_string(m.uncompressed_size));
    }
  }
  // No two members share a byte: each one's header and data, in file order.
  std::vector<const ZipMember*> order;
  order.reserve(out.members.size());
  for (const ZipMember& m : out.members) {
    order.push_back(&m);
  }
  std::sort(order.begin(), order.end(), [](const ZipMember* a, const ZipMember* b) {
    return a->header_offset < b->header_offset;
  });
  for (std::size_t i = 1; i < order.size(); ++i) {
    const ZipMember& prev = *order[i - 1];
    if (order[i]->header_offset < prev.data_offset + prev.size) {
      fail(display, order[i]->name,
           "its bytes overlap member " + prev.name + " (at " +
               std::to_string(order[i]->header_offset) + ", inside [" +
               std::to_string(prev.header_offset) + ", " +
               std::to_string(prev.data_offset + prev.size) + "))");
    }
  }
  return out;
}

}  // namespace ferry::io
