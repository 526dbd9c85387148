// Helpers shared by the reader tests: seeded random files, guarded destination
// buffers, an O_DIRECT-capable folder, log capture, and a loop that drives a
// Reader until every op has completed.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/log.hpp"
#include "io/file.hpp"
#include "io/reader.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io::test {

inline std::string random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  for (std::size_t i = 0; i < n; i += 8) {
    std::uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<std::size_t>(8, n - i));
  }
  return out;
}

// Destination memory with guard bytes on both sides, placed `misalign` bytes past
// a 4096-byte boundary, so tests can catch writes outside [dst, dst + size).
class GuardedBuffer {
 public:
  static constexpr std::size_t kGuard = 4096;
  static constexpr unsigned char kFill = 0xA5;

  GuardedBuffer(std::size_t size, std::size_t misalign) : size_(size), misalign_(misalign) {
    total_ = kGuard + misalign + size + kGuard;
    total_ = (total_ + 4095) / 4096 * 4096;
    base_.reset(static_cast<std::byte*>(std::aligned_alloc(4096, total_)));
    std::memset(base_.get(), kFill, total_);
  }

  std::byte* data() { return base_.get() + kGuard + misalign_; }
  std::size_t size() const { return size_; }
  std::string_view view() const {
    return {reinterpret_cast<const char*>(base_.get() + kGuard + misalign_), size_};
  }
  // True when every byte outside [data(), data() + size()) still holds kFill.
  bool guards_intact() const {
    for (std::size_t i = 0; i < total_; ++i) {
      if (i >= kGuard + misalign_ && i < kGuard + misalign_ + size_) {
        continue;
      }
      if (static_cast<unsigned char>(base_[i]) != kFill) {
        return false;
      }
    }
    return true;
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::size_t size_;
  std::size_t misalign_;
  std::size_t total_;
  std::unique_ptr<std::byte[], Free> base_;
};

// Captures log lines at and above `level` while alive.
class LogCapture {
 public:
  explicit LogCapture(log::Level level = log::Level::kDebug) : old_level_(log::level()) {
    log::set_level(level);
    old_sink_ = log::set_sink([this](log::Level, std::string_view m) {
      std::lock_guard lock(mu_);  // the sink may run on several threads at once
      text_ += m;
      text_ += '\n';
    });
  }
  ~LogCapture() {
    log::set_sink(old_sink_);
    log::set_level(old_level_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  const std::string& text() const { return text_; }

 private:
  log::Level old_level_;
  log::Sink old_sink_;
  std::mutex mu_;
  std::string text_;
};

// A file of random bytes in a folder where O_DIRECT works: the temp folder, else
// one next to the ferry binary (in the build tree). nullopt when neither accepts it.
class DataFile {
 public:
  DataFile(std::size_t size, std::uint64_t seed, bool need_direct = false)
      : bytes_(random_bytes(size, seed)) {
    path_ = dir_.file("weights.bin");
    ferry::testing::write_file(path_, bytes_);
    if (need_direct && !accepts_direct(path_)) {
      std::string tmpl = (std::filesystem::path(FERRY_BUILD_DIR) / "reader-direct-XXXXXX").string();
      if (mkdtemp(tmpl.data()) != nullptr) {
        fallback_dir_ = tmpl;
        path_ = tmpl + "/weights.bin";
        ferry::testing::write_file(path_, bytes_);
      }
      direct_ok_ = accepts_direct(path_);
    }
  }
  ~DataFile() {
    if (!fallback_dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(fallback_dir_, ec);
    }
  }
  DataFile(const DataFile&) = delete;
  DataFile& operator=(const DataFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& bytes() const { return bytes_; }
  std::size_t size() const { return bytes_.size(); }
  bool direct_ok() const { return direct_ok_; }

 private:
  static bool accepts_direct(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0) {
      return false;
    }
    ::close(fd);
    return true;
  }

  ferry::testing::TempDir dir_;
  std::string bytes_;
  std::string path_;
  std::string fallback_dir_;
  bool direct_ok_ = true;
};

inline std::string engine_name(Engine e) {
  switch (e) {
    case Engine::kUring:
      return "uring";
    case Engine::kPread:
      return "pread";
  }
  return "?";
}

// The reader for `options.engine` itself (no fallback); null when io_uring is
// unavailable, with the reason in `why`.
inline std::unique_ptr<Reader> make_engine(const ReaderOptions& options, std::string* why) {
  switch (options.engine) {
    case Engine::kUring:
      return make_uring_reader(options, why);
    case Engine::kPread:
      return make_pread_reader(options);
  }
  return nullptr;
}

// Submits `ops` and polls until nothing is outstanding. Fails the test when a tag
// completes twice or an unknown tag appears. Returns the completions by tag.
inline std::map<std::uint64_t, Completion> run_ops(Reader& reader, const std::vector<ReadOp>& ops) {
  std::map<std::uint64_t, Completion> by_tag;
  for (const ReadOp& op : ops) {
    reader.submit(op);
  }
  EXPECT_EQ(reader.outstanding(), ops.size());
  std::vector<Completion> done;
  // Bounded so a reader that loses an op fails the test instead of hanging it.
  for (int idle = 0; reader.outstanding() > 0 && idle < 200;) {
    done.clear();
    if (reader.poll(done, std::chrono::milliseconds(100)) == 0) {
      ++idle;
    }
    for (Completion& c : done) {
      EXPECT_TRUE(by_tag.emplace(c.tag, c).second) << "tag " << c.tag << " completed twice";
    }
  }
  EXPECT_EQ(reader.outstanding(), 0u);
  EXPECT_EQ(by_tag.size(), ops.size());
  return by_tag;
}

inline std::string error_text(const std::exception_ptr& error) {
  if (!error) {
    return {};
  }
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace ferry::io::test
