// An open, read-only weight file: RAII over the descriptor, its size, and the
// path as the user should see it in errors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ferry::io {

// O_DIRECT's alignment of file offsets, lengths and memory (the logical block size
// of the filesystems ferry reads from is at most the page size): the one spelling of
// 4096 for staging buffers, bounce buffers, plan splits and io.chunk_bytes' checks.
inline constexpr std::size_t kDirectAlignment = 4096;

// Which file a descriptor or path is, as of one fstat: what tells a shard that was
// replaced (renamed over), rewritten or truncated since its header was read. An
// empty identity (inode 0) is unknown and matches nothing.
struct FileIdentity {
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
  // The inode's change time and link count: a write moves ctime even when the
  // writer sets mtime back (no call sets ctime), but so does a rename over the
  // path (the old inode loses its link), which changes no byte of it.
  std::int64_t ctime_ns = 0;
  std::uint64_t links = 0;
  bool known() const { return inode != 0; }
  bool operator==(const FileIdentity&) const = default;
};
// From fstat(2) results (struct stat), for those who have one.
FileIdentity identity_of(const void* stat_buffer);
// Whether the bytes of the file `now` describes may differ from those of `before`
// (both of the same descriptor, or of a path): another device or inode, another
// size or mtime, or a ctime that moved while the link count stayed (a write that
// restored mtime; also chmod, chown or a new extended attribute, which this cannot
// tell apart). A ctime that moved with the link count (the path renamed over or
// unlinked) alone is no change: the descriptor still reads the same bytes. An
// unknown `now` (fstat failed) is a change; an unknown `before` is none.
bool changed(const FileIdentity& before, const FileIdentity& now);
// "size 100 -> 90 bytes, inode 12 -> 13": what differs, for error messages.
std::string describe_change(const FileIdentity& before, const FileIdentity& now);

class File {
 public:
  // Opens `path` read-only (following symbolic links). With `direct`, also opens
  // with O_DIRECT; `display` is the name used in error messages (defaults to path).
  // Throws ferry::Error(Stage::kRead) naming the file when it cannot be opened.
  static File open(const std::string& path, bool direct = false, std::string display = {});
  // Takes ownership of an open descriptor of any kind (a pipe, a socket: what the
  // reader tests need to make a read that never completes), said to hold `size`
  // bytes. Closes it when the File dies.
  static File adopt(int fd, std::uint64_t size, std::string display);
  // A second descriptor of the very file `kept` holds open (through
  // /proc/self/fd, so a rename over its path since changes nothing), with or
  // without O_DIRECT: what a reader that wants O_DIRECT opens from a descriptor
  // kept since the header was read. Throws as open() does.
  static File reopen(const File& kept, bool direct);

  File() = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  int fd() const { return fd_; }
  std::uint64_t size() const { return size_; }
  // The open file's identity as of open() (what the reads go to from then on, even
  // if the path is renamed over later).
  const FileIdentity& identity() const { return identity_; }
  // The identity as of now (one fstat of the descriptor): a file truncated or
  // rewritten in place since open() shows a new size or mtime. Empty (unknown)
  // when fstat fails.
  FileIdentity current_identity() const;
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }
  const std::string& display() const { return display_; }
  // O_DIRECT alignment of offsets, lengths and buffers (kDirectAlignment when
  // direct, else 1).
  std::uint32_t alignment() const { return direct_ ? kDirectAlignment : 1; }

 private:
  int fd_ = -1;
  std::uint64_t size_ = 0;
  FileIdentity identity_;
  bool direct_ = false;
  std::string path_;
  std::string display_;
};

// posix_fadvise(DONTNEED) over the whole file: drops its clean pages from the page
// cache. Best effort: returns false (and logs at debug) when the kernel refuses.
bool drop_page_cache(const File& file);

}  // namespace ferry::io
