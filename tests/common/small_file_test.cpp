// read_small_file: metadata files are read whole only when they are regular files
// (symbolic links followed) no larger than the cap, in bounded time.
#include "common/small_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <string>

#include "common/error.hpp"
#include "testing/temp_dir.hpp"

namespace ferry {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// The error read_small_file throws for `path` (a failure when it throws nothing).
Error error_of(const std::string& path, std::uint64_t cap = kDefaultMaxMetadataBytes) {
  try {
    read_small_file(path, Stage::kIndex, cap, "the index", "shown-name.json");
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << path << " was read";
  return Error(Stage::kConfig, "", "", "");
}

TEST(SmallFile, ReadsARegularFileAndALinkToOneWhole) {
  testing::TempDir dir;
  const std::string text = "{\"weight_map\": {}}\n";
  testing::write_file(dir.file("a.json"), text);
  std::filesystem::create_symlink(dir.file("a.json"), dir.file("link.json"));
  EXPECT_EQ(read_small_file(dir.file("a.json"), Stage::kIndex, 1 << 20, "the index"), text);
  EXPECT_EQ(read_small_file(dir.file("link.json"), Stage::kIndex, 1 << 20, "the index"), text);
  // Exactly at the cap is allowed; an empty file is read as empty.
  EXPECT_EQ(read_small_file(dir.file("a.json"), Stage::kIndex, text.size(), "the index"), text);
  testing::write_file(dir.file("empty.json"), "");
  EXPECT_EQ(read_small_file(dir.file("empty.json"), Stage::kIndex, 16, "the index"), "");
}

TEST(SmallFile, AMissingFileNamesTheFileTheStageAndTheErrno) {
  testing::TempDir dir;
  const Error e = error_of(dir.file("missing.json"));
  EXPECT_EQ(e.stage(), Stage::kIndex);
  EXPECT_EQ(e.file(), "shown-name.json");
  EXPECT_EQ(e.rule(), "cannot open the index: No such file or directory");
}

TEST(SmallFile, ALinkToDevZeroIsRefusedBeforeAnythingIsRead) {
  testing::TempDir dir;
  std::filesystem::create_symlink("/dev/zero", dir.file("zero.json"));
  const Error e = error_of(dir.file("zero.json"));
  EXPECT_EQ(e.stage(), Stage::kIndex);
  EXPECT_EQ(e.file(), "shown-name.json");
  EXPECT_THAT(e.rule(), AllOf(HasSubstr("the index is a character device, not a regular file"),
                              HasSubstr("symbolic links are followed")));
}

TEST(SmallFile, AFifoFailsAtOnceWithoutAWriter) {
  testing::TempDir dir;
  ASSERT_EQ(::mkfifo(dir.file("fifo.json").c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const Error e = error_of(dir.file("fifo.json"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_THAT(e.rule(), HasSubstr("the index is a FIFO, not a regular file"));
}

TEST(SmallFile, ADirectoryAndAnOwnCharDeviceNodeAreRefused) {
  testing::TempDir dir;
  std::filesystem::create_directory(dir.file("dir.json"));
  EXPECT_THAT(error_of(dir.file("dir.json")).rule(),
              HasSubstr("the index is a directory, not a regular file"));
  // A node of our own (what /dev/zero is: 1, 5): never opened, only refused.
  if (::mknod(dir.file("zero").c_str(), S_IFCHR | 0600, makedev(1, 5)) != 0) {
    GTEST_SKIP() << "mknod refused (" << errno << "): no CAP_MKNOD here";
  }
  EXPECT_THAT(error_of(dir.file("zero")).rule(), HasSubstr("is a character device"));
  struct stat st {};
  ASSERT_EQ(::stat(dir.file("zero").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST(SmallFile, AFileOverTheCapIsRefusedWithItsSizeAndTheCap) {
  testing::TempDir dir;
  // 100 MiB, sparse: costs no disk, and would cost 100 MiB of memory if read.
  testing::write_file(dir.file("big.json"), "{");
  std::filesystem::resize_file(dir.file("big.json"), std::uint64_t{100} << 20);
  const Error e = error_of(dir.file("big.json"));
  EXPECT_EQ(e.file(), "shown-name.json");
  EXPECT_EQ(e.rule(),
            "the index is 104857600 bytes, over the cap of 67108864 bytes for metadata files "
            "(io.max_metadata_bytes); refused");
  testing::write_file(dir.file("small.json"), std::string(101, ' '));
  EXPECT_THAT(error_of(dir.file("small.json"), 100).rule(),
              HasSubstr("is 101 bytes, over the cap of 100 bytes"));
}

TEST(SmallFile, AFileLongerThanItsSizeSaysIsCutAtTheCap) {
  // /proc files are regular files of size 0 whose reads return more: what a file
  // growing after fstat looks like. At most cap + 1 bytes are read.
  const Error e = error_of("/proc/self/status", 64);
  EXPECT_EQ(e.rule(),
            "the index is more than 64 bytes (it grew while being read), over the cap of 64 "
            "bytes for metadata files (io.max_metadata_bytes); refused");
  EXPECT_THAT(read_small_file("/proc/self/status", Stage::kIndex, 1 << 20, "status"),
              HasSubstr("Name:"));
}

}  // namespace
}  // namespace ferry
