// Weight files that change under the loader (the hardening issue, §5). The plan's
// offsets come from headers read at resolve: a shard replaced, rewritten or
// truncated after that is refused before a byte of it is read with the old
// offsets; one renamed over after the reader opened it still loads the original,
// from the descriptor the reader keeps for the whole load.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

#include "runtime/runtime_internal.hpp"
#include "runtime/runtime_test_util.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using testing::Checkpoint;
using testing::expect_matches_reference;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

const char* const kShard = "model-00002-of-00004.safetensors";

LoadResult load(const LoadConfig& config, RuntimeHooks hooks = {}) {
  Runtime rt(config, std::move(hooks));
  return rt.load();
}

// Replaces `path` by a new file (a new inode) holding `bytes`, as `mv new path` does.
void rename_over(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".new";
  std::ofstream(tmp, std::ios::binary) << bytes;
  fs::rename(tmp, path);
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Runs `change` on the shard once its header has been read (the model is built
// from the headers' index), then loads.
LoadResult load_changing_after_resolve(const Checkpoint& ck,
                                       const std::function<void(const std::string&)>& change) {
  RuntimeHooks hooks;
  hooks.wrap_model = [&](std::shared_ptr<const models::Model> m) {
    change(ck.dir + "/" + kShard);
    return m;
  };
  return load(make_config(ck.dir, {"parallel.tp=2"}), hooks);
}

TEST(ChangedFiles, AShardReplacedAfterItsHeaderWasReadIsRefused) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  // The very same bytes in a new file: still not the file the header came from.
  LoadResult r = load_changing_after_resolve(
      ck, [](const std::string& path) { rename_over(path, read_all(path)); });
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kRead) << r.error->message;
  EXPECT_EQ(r.error->file, kShard);
  EXPECT_NE(r.error->message.find("changed since its header was read (inode "), std::string::npos)
      << r.error->message;
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
  RuntimeHooks hooks;
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
