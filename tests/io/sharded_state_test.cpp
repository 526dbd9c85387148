// SGLang's sharded_state file names (io/sharded_state.hpp): the pattern
// "model-rank-{rank}-part-{part}.safetensors" of SGLang 0.5.23's
// ShardedStateLoader.DEFAULT_PATTERN, formatted and parsed, and a folder listed.
#include "io/sharded_state.hpp"

#include <gtest/gtest.h>

#include <fstream>

#include "common/error.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

TEST(ShardedStateNames, FormatsAsSGLangsPattern) {
  EXPECT_EQ(sharded_state_file(0, 0), "model-rank-0-part-0.safetensors");
  EXPECT_EQ(sharded_state_file(12, 3), "model-rank-12-part-3.safetensors");
}

TEST(ShardedStateNames, ParsesWhatItFormatsAndNothingElse) {
  const auto n = parse_sharded_state_file("model-rank-7-part-10.safetensors");
  ASSERT_TRUE(n);
  EXPECT_EQ(n->rank, 7);
  EXPECT_EQ(n->part, 10);
  for (const char* bad :
       {"model-rank-01-part-0.safetensors", "model-rank--1-part-0.safetensors",
        "model-rank-1-part-.safetensors", "model-rank-1-part-0.safetensor",
        "model-rank-1.safetensors", "model-00001-of-00002.safetensors",
        "model-rank-99999999999-part-0.safetensors", "model-rank-1-part-0x1.safetensors",
        "xmodel-rank-1-part-0.safetensors"}) {
    EXPECT_FALSE(parse_sharded_state_file(bad)) << bad;
  }
}

TEST(ShardedStateNames, ListsAFolderByRankInPartOrder) {
  testing::TempDir dir;
  for (const char* name :
       {"model-rank-1-part-10.safetensors", "model-rank-1-part-2.safetensors",
        "model-rank-0-part-0.safetensors", "config.json", "model-rank-01-part-0.safetensors"}) {
    std::ofstream(dir.file(name)) << "x";
  }
  const auto files = list_sharded_state(dir.str());
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files.at(0), std::vector<std::string>{"model-rank-0-part-0.safetensors"});
  EXPECT_EQ(files.at(1), (std::vector<std::string>{"model-rank-1-part-2.safetensors",
                                                   "model-rank-1-part-10.safetensors"}));
  EXPECT_THROW(list_sharded_state(dir.file("missing")), Error);
}

}  // namespace
}  // namespace ferry::io
