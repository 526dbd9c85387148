#include "cache/registry.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/error.hpp"
#include "common/sha256.hpp"
#include "common/small_file.hpp"

namespace ferry::cache {

namespace {

[[noreturn]] void fail(const std::string& where, const std::string& rule) {
  throw Error(Stage::kCache, where, "", rule);
}

// A registration is a few KiB; the cap keeps a planted file from costing memory.
constexpr std::uint64_t kMaxRecordBytes = std::uint64_t{16} << 20;

void fsync_path(const std::string& path, int flags) {
  UniqueFd fd(::open(path.c_str(), flags | O_CLOEXEC));
  if (!fd || ::fsync(fd.get()) != 0) {
    fail(path, std::string("fsync: ") + std::strerror(errno));
  }
}

}  // namespace

std::optional<std::uint64_t> process_start_time(pid_t pid) {
  if (pid <= 0) {
    return std::nullopt;
  }
  std::string text;
  try {
    text = read_small_file("/proc/" + std::to_string(pid) + "/stat", Stage::kCache, 1 << 16,
                           "a process's stat file");
  } catch (const Error&) {
    return std::nullopt;
  }
  // pid (comm) state ppid ...: comm may hold spaces and parentheses; the last ')'
  // ends it. starttime is the 22nd field, the 20th after the ')'.
  const std::size_t close = text.rfind(')');
  if (close == std::string::npos) {
    return std::nullopt;
  }
  std::size_t at = close + 1;
  std::string field;
  for (int i = 0; i < 20; ++i) {
    while (at < text.size() && text[at] == ' ') {
      ++at;
    }
    const std::size_t end = text.find(' ', at);
    field = text.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (i == 0 && (field == "Z" || field == "X")) {
      return std::nullopt;  // exited, not yet reaped
    }
    if (end == std::string::npos) {
      if (i != 19) {
        return std::nullopt;
      }
      break;
    }
    at = end;
  }
  char* stop = nullptr;
  const unsigned long long v = std::strtoull(field.c_str(), &stop, 10);
  if (field.empty() || stop == nullptr || *stop != '\0') {
    return std::nullopt;
  }
  return v;
}

ProcessIdentity self_identity() {
  const pid_t pid = ::getpid();
  return ProcessIdentity{pid, process_start_time(pid).value_or(0)};
}

bool alive(const ProcessIdentity& p) {
  const std::optional<std::uint64_t> t = process_start_time(p.pid);
  return t.has_value() && *t == p.start_time;
}

std::string default_registry_dir() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && xdg[0] == '/') {
    return std::string(xdg) + "/ferry-cache";
  }
  return "/tmp/ferry-cache-" + std::to_string(::geteuid());
}

std::string registry_key(const std::string& fingerprint, const std::string& devices) {
  const Sha256Digest d = sha256(fingerprint + "\n" + devices);
  return base64url(d.data(), 20);
}

Registry::Registry(std::string dir) : dir_(dir.empty() ? default_registry_dir() : std::move(dir)) {
  while (dir_.size() > 1 && dir_.back() == '/') {
    dir_.pop_back();
  }
  if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) {
    fail(dir_, std::string("cannot create the registry directory: ") + std::strerror(errno));
  }
  struct stat st {};
  if (::lstat(dir_.c_str(), &st) != 0) {
    fail(dir_, std::string("the registry directory: ") + std::strerror(errno));
  }
  if (!S_ISDIR(st.st_mode)) {
    fail(dir_, "the registry is not a directory (a link or a file is refused)");
  }
  if (st.st_uid != ::geteuid()) {
    fail(dir_, "the registry directory is owned by uid " + std::to_string(st.st_uid) +
                   ", not by this process's uid " + std::to_string(::geteuid()));
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    fail(dir_, std::string("the registry directory has mode ") + mode +
                   ": group or others may use it (0700 expected)");
  }
  // <dir>/<27-character key>.sock must fit a sockaddr_un.
  if (socket_path(std::string(27, 'k')).size() > kMaxSocketPath) {
    fail(dir_, "the registry directory's path is too long for its sockets (at most " +
                   std::to_string(kMaxSocketPath - 33) + " bytes)");
  }
}

Registry::Lock Registry::lock() const {
  const std::string path = dir_ + "/lock";
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) {
    fail(path, std::string("open: ") + std::strerror(errno));
  }
  while (::flock(fd.get(), LOCK_EX) != 0) {
    if (errno != EINTR) {
      fail(path, std::string("flock: ") + std::strerror(errno));
    }
  }
  return Lock(std::move(fd));
}

void Registry::publish(const std::string& key, const nlohmann::json& record) const {
  const std::string final_path = record_path(key);
  const std::string tmp = dir_ + "/." + key + ".json." + std::to_string(::getpid());
  const std::string text = record.dump(2) + "\n";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) {
      fail(tmp, std::string("open: ") + std::strerror(errno));
    }
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        fail(tmp, std::string("write: ") + std::strerror(err));
      }
      done += static_cast<std::size_t>(n);
    }
    if (::fsync(fd.get()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      fail(tmp, std::string("fsync: ") + std::strerror(err));
    }
  }
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(final_path, std::string("rename: ") + std::strerror(err));
  }
  fsync_path(dir_, O_RDONLY | O_DIRECTORY);
}

void Registry::remove(const std::string& key) const {
  ::unlink(record_path(key).c_str());
  ::unlink(socket_path(key).c_str());
}

namespace {

Registration read_registration(const std::string& key, const std::string& path) {
  Registration r;
  r.key = key;
  r.path = path;
  try {
    r.record =
        parse_frame(read_small_file(path, Stage::kCache, kMaxRecordBytes, "a registration"), path);
    const nlohmann::json& j = r.record;
    if (!j.contains("pid") || !j["pid"].is_number_integer() || !j.contains("start_time") ||
        !j["start_time"].is_number_unsigned() || !j.contains("socket") ||
        !j["socket"].is_string() || !j.contains("fingerprint") || !j["fingerprint"].is_string()) {
      r.problem = "a registration needs pid, start_time, socket and fingerprint";
      return r;
    }
    r.daemon = ProcessIdentity{j["pid"].get<pid_t>(), j["start_time"].get<std::uint64_t>()};
    r.socket = j["socket"].get<std::string>();
    r.fingerprint = j["fingerprint"].get<std::string>();
  } catch (const Error& e) {
    r.problem = e.rule();
  }
  return r;
}

}  // namespace

std::vector<Registration> Registry::list() const {
  std::vector<Registration> out;
  DIR* d = ::opendir(dir_.c_str());
  if (d == nullptr) {
    fail(dir_, std::string("opendir: ") + std::strerror(errno));
  }
  std::vector<std::string> keys;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() > 5 && name[0] != '.' && name.ends_with(".json")) {
      keys.push_back(name.substr(0, name.size() - 5));
    }
  }
  ::closedir(d);
  std::sort(keys.begin(), keys.end());
  for (const std::string& key : keys) {
    out.push_back(read_registration(key, record_path(key)));
  }
  return out;
}

std::optional<Registration> Registry::find(const std::string& key) const {
  const std::string path = record_path(key);
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return std::nullopt;
  }
  return read_registration(key, path);
}

bool check_socket(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return false;
    }
    fail(path, std::string("lstat: ") + std::strerror(errno));
  }
  if (!S_ISSOCK(st.st_mode)) {
    fail(path, std::string("not a socket (") +
                   (S_ISREG(st.st_mode)   ? "a regular file"
                    : S_ISLNK(st.st_mode) ? "a symbolic link"
                                          : "another kind of file") +
                   "): something else holds the daemon's socket path");
  }
  if (st.st_uid != ::geteuid()) {
    fail(path, "the socket is owned by uid " + std::to_string(st.st_uid) +
                   ", not by this process's uid " + std::to_string(::geteuid()));
  }
  return true;
}

}  // namespace ferry::cache
