// File: the open descriptor of a weight file, its size and its display name.
#include "io/file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "common/log.hpp"

namespace ferry::io {

File File::open(const std::string& path, bool direct, std::string display) {
  if (display.empty()) {
    display = path;
  }
  int flags = O_RDONLY | O_CLOEXEC;
  if (direct) {
    flags |= O_DIRECT;
  }
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) {
    const int err = errno;
    // tmpfs and some network file systems refuse O_DIRECT with EINVAL: say so.
    throw_errno(Stage::kRead, display,
                direct && err == EINVAL ? "open: O_DIRECT refused by the file system" : "open",
                err);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw_errno(Stage::kRead, display, "fstat", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(
        Stage::kRead, display, "",
        S_ISDIR(st.st_mode) ? "open: is a directory, not a file" : "open: not a regular file");
  }
  File file;
  file.fd_ = fd;
  file.size_ = static_cast<std::uint64_t>(st.st_size);
  file.identity_ = identity_of(&st);
  file.direct_ = direct;
  file.path_ = path;
  file.display_ = std::move(display);
  return file;
}

File File::reopen(const File& kept, bool direct) {
  File file = open("/proc/self/fd/" + std::to_string(kept.fd_), direct, kept.display_);
  file.path_ = kept.path_;
  return file;
}

FileIdentity File::current_identity() const {
  struct stat st {};
  if (fd_ < 0 || ::fstat(fd_, &st) != 0) {
    return {};
  }
  return identity_of(&st);
}

FileIdentity identity_of(const void* stat_buffer) {
  const auto& st = *static_cast<const struct stat*>(stat_buffer);
  FileIdentity id;
  id.device = static_cast<std::uint64_t>(st.st_dev);
  id.inode = static_cast<std::uint64_t>(st.st_ino);
  id.size = static_cast<std::uint64_t>(st.st_size);
  id.mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  id.ctime_ns = static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
  id.links = static_cast<std::uint64_t>(st.st_nlink);
  return id;
}

bool changed(const FileIdentity& before, const FileIdentity& now) {
  if (!before.known()) {
    return false;
  }
  if (!now.known()) {
    return true;
  }
  if (before.device != now.device || before.inode != now.inode || before.size != now.size ||
      before.mtime_ns != now.mtime_ns) {
    return true;
  }
  return before.ctime_ns != now.ctime_ns && before.links == now.links;
}

std::string describe_change(const FileIdentity& before, const FileIdentity& now) {
  if (!now.known()) {
    return "fstat failed";
  }
  std::string out;
  auto add = [&out](const char* what, auto a, auto b) {
    if (a != b) {
      out += (out.empty() ? "" : ", ") + std::string(what) + " " + std::to_string(a) + " -> " +
             std::to_string(b);
    }
  };
  add("device", before.device, now.device);
  add("inode", before.inode, now.inode);
  add("size", before.size, now.size);
  add("mtime (ns)", before.mtime_ns, now.mtime_ns);
  add("ctime (ns)", before.ctime_ns, now.ctime_ns);
  add("links", before.links, now.links);
  return out.empty() ? "unchanged" : out;
}

File File::adopt(int fd, std::uint64_t size, std::string display) {
  File f;
  f.fd_ = fd;
  f.size_ = size;
  f.path_ = display;
  f.display_ = std::move(display);
  return f;
}

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      size_(std::exchange(other.size_, 0)),
      identity_(std::exchange(other.identity_, {})),
      direct_(std::exchange(other.direct_, false)),
      path_(std::move(other.path_)),
      display_(std::move(other.display_)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) {
      ::close(fd_);
    }
    fd_ = std::exchange(other.fd_, -1);
    size_ = std::exchange(other.size_, 0);
    identity_ = std::exchange(other.identity_, {});
    direct_ = std::exchange(other.direct_, false);
    path_ = std::move(other.path_);
    display_ = std::move(other.display_);
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) {
    // A read-only descriptor has nothing to flush; close errors carry no news.
    ::close(fd_);
  }
}

bool drop_page_cache(const File& file) {
  // len 0 means "to the end of the file", whatever its size is now.
  const int err = ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_DONTNEED);
  if (err != 0) {
    log::debug("drop_page_cache: " + file.display() +
               ": posix_fadvise(DONTNEED): " + errno_text(err));
    return false;
  }
  return true;
}

}  // namespace ferry::io
