// Weight files that change under the loader (the hardening issue, §5). Resolve
// reads every header from a descriptor it keeps open for the whole load, and the
// load reads from those descriptors: a shard renamed over at any point after that
// still loads the original; one truncated or rewritten in place is refused, before
// a byte of it is read with the old offsets, or (truncated mid-read) with a clean
// read error naming it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/process_census.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using testing::Checkpoint;
using testing::expect_matches_reference;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

const char* const kShard = "model-00002-of-00004.safetensors";

LoadResult load(const LoadConfig& config, RuntimeTestSeams hooks = {}) {
  Runtime rt = make_runtime(to_config(config), std::move(hooks));
  return rt.load();
}

// Replaces `path` by a new file (a new inode) holding `bytes`, as `mv new path` does.
void rename_over(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".new";
  std::ofstream(tmp, std::ios::binary) << bytes;
  fs::rename(tmp, path);
}

bool accepts_direct(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd >= 0) {
    ::close(fd);
  }
  return fd >= 0;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Runs `change` on the shard once its header has been read (the model is built
// from the headers' index), then loads.
LoadResult load_changing_after_resolve(const Checkpoint& ck,
                                       const std::function<void(const std::string&)>& change,
                                       std::vector<std::string> sets = {}) {
  RuntimeTestSeams hooks;
  hooks.wrap_model = [&](std::shared_ptr<const models::Model> m) {
    change(ck.dir + "/" + kShard);
    return m;
  };
  sets.insert(sets.begin(), "parallel.tp=2");
  return load(make_config(ck.dir, sets), hooks);
}

TEST(ChangedFiles, AShardReplacedAfterItsHeaderWasReadStillLoadsTheOriginal) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::string path = ck.dir + "/" + kShard;
  const std::string original = read_all(path);
  for (bool direct : {false, true}) {
    SCOPED_TRACE(direct ? "io.direct" : "buffered");
    if (direct && !accepts_direct(ck.dir + "/" + kShard)) {
      continue;  // tmpfs: no O_DIRECT here
    }
    // Garbage of the same size in a new file (a new inode) at the shard's path.
    LoadResult r = load_changing_after_resolve(
        ck, [](const std::string& p) { rename_over(p, std::string(fs::file_size(p), '\x5a')); },
        {std::string("io.direct=") + (direct ? "true" : "false"), "prefetch.enabled=false"});
    ASSERT_TRUE(r) << r.error->message;
    EXPECT_EQ(expect_matches_reference(*r.model, ck, 2, DType::kBF16), 27u * 2);
    rename_over(path, original);
  }
}

TEST(ChangedFiles, AShardRewrittenInPlaceAfterItsHeaderWasReadIsRefused) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  // Same size, same inode, other bytes: only the modification time tells.
  LoadResult r = load_changing_after_resolve(ck, [](const std::string& path) {
    const std::string bytes = read_all(path);
    std::ofstream(path, std::ios::binary | std::ios::in | std::ios::out) << bytes;
    fs::last_write_time(path, fs::last_write_time(path) + std::chrono::seconds(3));
  });
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kRead) << r.error->message;
  EXPECT_EQ(r.error->file, kShard);
  EXPECT_NE(r.error->message.find("changed since its header was read (mtime (ns) "),
            std::string::npos)
      << r.error->message;
}

TEST(ChangedFiles, TheDescriptorsKeptForALoadAreClosedAfterIt) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::size_t before = testing::open_fds();
  std::size_t during = 0;
  RuntimeTestSeams hooks;
  hooks.wrap_model = [&](std::shared_ptr<const models::Model> m) {
    during = testing::open_fds();
    return m;
  };
  LoadResult r = load(make_config(ck.dir, {"parallel.tp=2"}), hooks);
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_GE(during, before + 4) << "the four shards are held open from resolve";
  r.model.reset();
  EXPECT_EQ(testing::open_fds(), before);
}

TEST(ChangedFiles, AShardTruncatedAfterItsHeaderWasReadIsRefused) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  std::uint64_t before = 0;
  LoadResult r = load_changing_after_resolve(ck, [&before](const std::string& path) {
    before = fs::file_size(path);
    fs::resize_file(path, before - 100);
  });
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kRead) << r.error->message;
  EXPECT_EQ(r.error->file, kShard);
  EXPECT_NE(r.error->message.find("size " + std::to_string(before) + " -> " +
                                  std::to_string(before - 100)),
            std::string::npos)
      << r.error->message;
}

TEST(ChangedFiles, AShardRenamedOverDuringTheLoadStillLoadsTheOriginal) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  RuntimeTestSeams hooks;
  std::atomic<bool> replaced{false};
  hooks.before_copy = [&](std::size_t, const std::string&) {
    if (!replaced.exchange(true)) {  // the first copy: the one lane has opened every file
      for (const auto& entry : fs::directory_iterator(ck.dir)) {
        if (entry.path().extension() == ".safetensors") {
          rename_over(entry.path().string(),
                      std::string(fs::file_size(entry.path()), '\x5a'));  // garbage
        }
      }
    }
  };
  LoadResult r = load(make_config(ck.dir, {"parallel.tp=2", "io.read_lanes=1"}), hooks);
  ASSERT_TRUE(r) << r.error->message;
  EXPECT_TRUE(replaced.load());
  EXPECT_EQ(expect_matches_reference(*r.model, ck, 2, DType::kBF16), 27u * 2);
}

}  // namespace
}  // namespace ferry::runtime
