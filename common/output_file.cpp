// OutputFile: symlinks resolved by hand (a dangling link's target is created, which
// realpath(3) cannot do), the temporary made with O_EXCL under a unique name (a stale
// or planted PATH.tmp is never opened or followed), in-place writes with SIGPIPE held
// off for the calling thread only.
#include "common/output_file.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>
#include <string_view>
#include <utility>

namespace ferry {
namespace {

// Linux gives up after 40 hops (ELOOP); so does ferry.
constexpr int kMaxSymlinkHops = 40;
// Unique temporary names: the process id and a counter (retried on EEXIST).
std::atomic<std::uint64_t> g_tmp_counter{0};

// `path` after following every symlink at its last component; empty with errno set
// when a hop cannot be read. An absent final target is returned as it is.
std::string follow_symlinks(const std::string& path, int& err) {
  std::string p = path;
  for (int hop = 0;; ++hop) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0) {
      if (errno == ENOENT) {
        return p;
      }
      err = errno;
      return {};
    }
    if (!S_ISLNK(st.st_mode)) {
      return p;
    }
    if (hop == kMaxSymlinkHops) {
      err = ELOOP;
      return {};
    }
    std::string link(PATH_MAX, '\0');
    const ssize_t n = ::readlink(p.c_str(), link.data(), link.size());
    if (n < 0) {
      err = errno;
      return {};
    }
    link.resize(static_cast<std::size_t>(n));
    const std::filesystem::path target(link);
    p = target.is_absolute() ? link
                             : (std::filesystem::path(p).parent_path() / target).string();
  }
}

const char* kind_name(mode_t mode) {
  if (S_ISDIR(mode)) {
    return "a folder";
  }
  if (S_ISBLK(mode)) {
    return "a block device";
  }
  if (S_ISSOCK(mode)) {
    return "a socket";
  }
  if (S_ISFIFO(mode) || S_ISCHR(mode)) {
    return "a FIFO or a device that appeared while it was being resolved";
  }
  return "neither a regular file, a FIFO nor a character device";
}

// N for "/dev/stdout" (1), "/dev/stderr" (2), "/dev/fd/N" and "/proc/self/fd/N".
std::optional<int> own_descriptor(const std::string& path) {
  if (path == "/dev/stdout") {
    return 1;
  }
  if (path == "/dev/stderr") {
    return 2;
  }
  for (const std::string_view prefix : {"/dev/fd/", "/proc/self/fd/"}) {
    if (path.size() > prefix.size() && path.size() <= prefix.size() + 9 &&
        path.compare(0, prefix.size(), prefix) == 0 &&
        path.find_first_not_of("0123456789", prefix.size()) == std::string::npos) {
      return std::stoi(path.substr(prefix.size()));
    }
  }
  return std::nullopt;
}

// Blocks SIGPIPE for this thread while an in-place write runs, so that a FIFO whose
// reader went away fails the write with EPIPE instead of killing the process; a
// SIGPIPE the write raised is taken off the thread's pending set before unblocking.
class SigpipeHold {
 public:
  SigpipeHold() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~SigpipeHold() {
    if (raised_ && !was_pending_) {
      const timespec zero{};
      while (sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeHold(const SigpipeHold&) = delete;
  SigpipeHold& operator=(const SigpipeHold&) = delete;

  void saw_epipe() { raised_ = true; }

 private:
  sigset_t pipe_{};
  sigset_t old_{};
  bool was_pending_ = false;
  bool raised_ = false;
};

}  // namespace

OutputFile::OutputFile(std::string path, Stage stage, std::string what)
    : path_(std::move(path)), stage_(stage), what_(std::move(what)) {
  if (path_.find('\0') != std::string::npos) {
    fail("the path contains a NUL byte");
  }
  if (path_.empty()) {
    fail("the path is empty");
  }
  // This process's own descriptors: written where they stand, so that `--report
  // /dev/stdout >out.txt` adds the report to out.txt rather than replacing the file
  // (its link would lead there).
  if (const std::optional<int> n = own_descriptor(path_)) {
    // What the process printed through stdio before comes first.
    std::fflush(*n == 1 ? stdout : *n == 2 ? stderr : nullptr);
    in_place_ = true;
    target_ = path_;
    fd_ = ::fcntl(*n, F_DUPFD_CLOEXEC, 0);
    if (fd_ < 0) {
      fail("descriptor " + std::to_string(*n) + " is not open", errno);
    }
    return;
  }
  // A FIFO or a device, reached through any links the kernel follows (a pipe at
  // /proc/self/fd/N is a link to no path): written in place.
  struct stat followed {};
  if (::stat(path_.c_str(), &followed) == 0 &&
      (S_ISFIFO(followed.st_mode) || S_ISCHR(followed.st_mode))) {
    in_place_ = true;
    target_ = path_;
    // O_NONBLOCK: a FIFO with no reader fails with ENXIO instead of blocking the
    // open forever. No O_TRUNC: a device or a pipe is never truncated.
    fd_ = ::open(path_.c_str(), O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd_ < 0) {
      if (errno == ENXIO && S_ISFIFO(followed.st_mode)) {
        fail("the FIFO has no reader (ferry does not wait for one)");
      }
      fail(std::string("cannot open the ") +
               (S_ISFIFO(followed.st_mode) ? "FIFO" : "character device") + " to write in place",
           errno);
    }
    // What was opened, not what was there a moment before: never a regular file
    // written without its temporary.
    struct stat opened {};
    if (::fstat(fd_, &opened) != 0 || !(S_ISFIFO(opened.st_mode) || S_ISCHR(opened.st_mode))) {
      fail("it changed kind while being opened");
    }
    const int flags = ::fcntl(fd_, F_GETFL);
    if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) {
      fail("cannot make the descriptor blocking", errno);
    }
    return;
  }
  int err = 0;
  target_ = follow_symlinks(path_, err);
  if (target_.empty()) {
    fail(err == ELOOP ? "too many levels of symlinks" : "cannot follow the symlink", err);
  }
  struct stat st {};
  const bool exists = ::lstat(target_.c_str(), &st) == 0;
  if (!exists && errno != ENOENT) {
    fail("cannot stat it", errno);
  }
  if (exists && !S_ISREG(st.st_mode)) {
    fail(std::string("it is ") + kind_name(st.st_mode) +
         "; ferry replaces regular files and writes in place only to FIFOs and character "
         "devices");
  }
  // 0666 less the umask for a new file, as any program's output; a replaced file
  // keeps its mode (a private report stays private) and, where allowed, its owner.
  for (int attempt = 0;; ++attempt) {
    tmp_ = target_ + ".tmp." + std::to_string(::getpid()) + "." +
           std::to_string(g_tmp_counter.fetch_add(1));
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd_ >= 0) {
      break;
    }
    if (errno != EEXIST || attempt == 100) {
      const int e = errno;
      tmp_.clear();  // nothing of ours to remove
      fail("cannot create a temporary file beside it", e);
    }
  }
  if (exists) {
    if (::fchmod(fd_, st.st_mode & 07777) != 0) {
      fail("cannot give the temporary file the mode of the file it replaces", errno);
    }
    if (::fchown(fd_, st.st_uid, st.st_gid) != 0) {
      // Best effort: only root may give a file away; the file is then ours.
    }
  }
}

OutputFile::~OutputFile() { abandon(); }

void OutputFile::write(std::string_view text) {
  write(std::as_bytes(std::span<const char>(text.data(), text.size())));
}

void OutputFile::write(std::span<const std::byte> bytes) {
  if (fd_ < 0) {
    fail(committed_ ? "write after commit" : "write after a failure");
  }
  const std::byte* data = bytes.data();
  std::size_t left = bytes.size();
  std::optional<SigpipeHold> hold;
  if (in_place_) {
    hold.emplace();
  }
  while (left > 0) {
    const ssize_t n = ::write(fd_, data, left);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      const int err = errno;
      if (err == EPIPE && hold) {
        hold->saw_epipe();
      }
      hold.reset();
      fail("", err);
    }
    if (n == 0) {
      hold.reset();
      fail("write returned 0 bytes");
    }
    data += n;
    left -= static_cast<std::size_t>(n);
  }
}

void OutputFile::sync() {
  if (fd_ < 0) {
    fail("fsync after commit or a failure");
  }
  // A FIFO or a terminal cannot be synced (EINVAL); there is nothing to make durable.
  if (::fsync(fd_) != 0 && !(in_place_ && (errno == EINVAL || errno == EROFS))) {
    fail("fsync", errno);
  }
}

void OutputFile::commit() {
  if (fd_ < 0) {
    fail("commit after commit or a failure");
  }
  // close(2) can report a deferred write error (NFS, quotas): a failure, not success.
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    fail("close", errno);
  }
  if (!in_place_ && ::rename(tmp_.c_str(), target_.c_str()) != 0) {
    fail("cannot rename " + tmp_ + " into place", errno);
  }
  tmp_.clear();
  committed_ = true;
}

void OutputFile::abandon() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (!tmp_.empty()) {
    ::unlink(tmp_.c_str());
    tmp_.clear();
  }
}

void OutputFile::fail(const std::string& detail, int err) {
  abandon();
  std::string rule = what_.empty() ? "" : what_ + ": ";
  rule += "cannot write";
  if (!target_.empty() && target_ != path_) {
    rule += " " + target_ + " (where the symlink leads)";
  }
  if (!detail.empty()) {
    rule += ": " + detail;
  }
  if (err != 0) {
    rule += ": " + errno_text(err);
  }
  // A path with a NUL byte would end the message there: show the byte instead.
  std::string shown;
  for (char c : path_) {
    shown += c == '\0' ? std::string("\\0") : std::string(1, c);
  }
  throw Error(stage_, shown, "", rule);
}

void sync_folder(const std::string& dir, Stage stage, std::string_view what) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) {
      ::close(fd);
    }
    throw Error(stage, dir, "",
                std::string(what) + ": cannot sync the folder: " + std::strerror(err));
  }
  ::close(fd);
}

}  // namespace ferry
