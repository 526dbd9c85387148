// The open-file limit: raised once at start, and checked against a checkpoint's
// file count before the first of its files is opened.
#include "io/fd_limit.hpp"

#include <dirent.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <string>

#include "common/error.hpp"
#include "common/log.hpp"

namespace ferry::io {
namespace {

std::string limit_text(std::uint64_t v) {
  return v == UINT64_MAX ? std::string("unlimited") : std::to_string(v);
}

// Sets the soft limit to `soft` (the hard one unchanged); errno text on failure.
std::string set_soft_limit(std::uint64_t soft, std::uint64_t hard) {
  struct rlimit rl {};
  rl.rlim_cur = soft == UINT64_MAX ? RLIM_INFINITY : static_cast<rlim_t>(soft);
  rl.rlim_max = hard == UINT64_MAX ? RLIM_INFINITY : static_cast<rlim_t>(hard);
  if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return errno_text(errno);
  }
  return {};
}

}  // namespace

OpenFileLimit open_file_limit() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return {UINT64_MAX, UINT64_MAX};  // cannot fail on Linux; nothing to enforce then
  }
  auto value = [](rlim_t v) {
    return v == RLIM_INFINITY ? UINT64_MAX : static_cast<std::uint64_t>(v);
  };
  return {value(rl.rlim_cur), value(rl.rlim_max)};
}

std::size_t open_descriptors() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) {
    return 0;  // no /proc: the reserve has to do
  }
  std::size_t n = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') {
      ++n;
    }
  }
  ::closedir(dir);
  return n > 0 ? n - 1 : 0;  // less the listing's own descriptor
}

void raise_open_file_limit() {
  static std::once_flag once;
  // Nothing may leave the callback: an exception unwinding through glibc's
  // pthread_once makes glibc load libgcc_s with dlopen, and abort the process where
  // that fails (a std::bad_alloc under ulimit -v). A message that cannot be built
  // is dropped; the limit is raised or not all the same.
  std::call_once(once, []() noexcept {
    try {
      const OpenFileLimit now = open_file_limit();
      const std::uint64_t target = std::min(now.hard, kSoftLimitCeiling);
      if (target <= now.soft) {
        return;
      }
      const std::string err = set_soft_limit(target, now.hard);
      if (!err.empty()) {
        log::warn("open-file limit (RLIMIT_NOFILE): could not raise the soft limit from " +
                  limit_text(now.soft) + " to " + limit_text(target) + ": " + err);
        return;
      }
      log::info("open-file limit (RLIMIT_NOFILE): soft limit raised from " + limit_text(now.soft) +
                " to " + limit_text(target) + " (hard limit " + limit_text(now.hard) + ")");
    } catch (...) {
    }
  });
}

void reserve_descriptors(std::size_t files, const std::string& folder) {
  const OpenFileLimit now = open_file_limit();
  const std::size_t open = open_descriptors();
  const std::uint64_t needed = std::uint64_t{files} + open + kLoadDescriptorReserve;
  if (needed <= now.soft) {
    return;
  }
  const std::string count = std::to_string(files) + " weight files need about " +
                            std::to_string(needed) + " open file descriptors at once (" +
                            std::to_string(files) + " files, " + std::to_string(open) +
                            " open now, " + std::to_string(kLoadDescriptorReserve) +
                            " for the load)";
  if (needed > now.hard) {
    throw Error(Stage::kResources, folder, "",
                count + ", more than the open-file limit allows: RLIMIT_NOFILE hard limit " +
                    limit_text(now.hard) + " (soft " + limit_text(now.soft) +
                    "); raise the hard limit (ulimit -Hn as root, LimitNOFILE= for a systemd "
                    "service, docker run --ulimit nofile=N:N)");
  }
  const std::uint64_t target = std::max(needed, std::min(now.hard, kSoftLimitCeiling));
  const std::string err = set_soft_limit(target, now.hard);
  if (!err.empty()) {
    throw Error(Stage::kResources, folder, "",
                count + ": raising the RLIMIT_NOFILE soft limit from " + limit_text(now.soft) +
                    " to " + limit_text(target) + " failed: " + err);
  }
  log::info("open-file limit (RLIMIT_NOFILE): " + count + "; soft limit raised from " +
            limit_text(now.soft) + " to " + limit_text(target) + " (hard limit " +
            limit_text(now.hard) + ")");
}

}  // namespace ferry::io
