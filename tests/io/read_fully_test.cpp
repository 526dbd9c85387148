// io::read_fully and read_exactly: the one loop for reading a range of a file outside
// the reader engines (safetensors headers, prefetch blocks, the bench's pread peer).
#include "io/read_fully.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/file.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

using ferry::testing::TempDir;
using ferry::testing::write_file;

std::string pattern(std::size_t n) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) {
    s[i] = static_cast<char>('a' + i % 26);
  }
  return s;
}

struct Fd {
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~Fd() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
  int fd;
};

// What read_exactly throws for this range (a failure of the test if it returns).
Error read_exactly_error(int fd, std::span<std::byte> out, std::uint64_t offset, Stage stage,
                         const std::string& file, const std::string& tensor,
                         const std::string& what) {
  try {
    read_exactly(fd, out, offset, stage, file, tensor, what);
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "read_exactly did not throw";
  return Error(stage, file, tensor, "no error");
}

TEST(ReadFully, ReadsAWholeRangeAtAnOffset) {
  TempDir dir;
  const std::string text = pattern(3 << 20);  // larger than one pread may return at once
  write_file(dir.file("f"), text);
  Fd f(dir.file("f"));
  ASSERT_GE(f.fd, 0);
  std::vector<std::byte> out((2 << 20) + 7);
  const ReadFullyResult r = read_fully(f.fd, out, 12345);
  EXPECT_TRUE(r.complete(out.size()));
  EXPECT_EQ(r.bytes, out.size());
  EXPECT_EQ(r.error, 0);
  EXPECT_EQ(std::memcmp(out.data(), text.data() + 12345, out.size()), 0);
  EXPECT_EQ(read_failure(r, out.size(), 12345, "block"), "");
}

TEST(ReadFully, StopsWhereTheFileEndsAndSaysWhere) {
  TempDir dir;
  write_file(dir.file("f"), pattern(1000));
  Fd f(dir.file("f"));
  std::vector<std::byte> out(100);
  const ReadFullyResult r = read_fully(f.fd, out, 950);
  EXPECT_FALSE(r.complete(out.size()));
  EXPECT_EQ(r.bytes, 50u);
  EXPECT_EQ(r.error, 0);
  EXPECT_EQ(read_failure(r, out.size(), 950, "tensor data"),
            "tensor data: the file ends at offset 1000, inside bytes [950, 1050)");
}

TEST(ReadFully, AZeroByteReadOfANeededRangeIsAnErrorNamingTheFile) {
  TempDir dir;
  write_file(dir.file("f"), pattern(10));
  Fd f(dir.file("f"));
  std::vector<std::byte> out(8);
  EXPECT_EQ(read_fully(f.fd, out, 4096).bytes, 0u);  // past the end: nothing, no error
  const Error e = read_exactly_error(f.fd, out, 4096, Stage::kRead, "shard-1.safetensors",
                                     "w.weight", "pread peer");
  EXPECT_EQ(e.stage(), Stage::kRead);
  EXPECT_EQ(e.file(), "shard-1.safetensors");
  EXPECT_EQ(e.tensor(), "w.weight");
  EXPECT_EQ(e.rule(), "pread peer: the file ends at offset 4096, inside bytes [4096, 4104)");
}

TEST(ReadFully, AFailedPreadCarriesItsErrno) {
  std::vector<std::byte> out(8);
  const ReadFullyResult r = read_fully(-1, out, 0);
  EXPECT_EQ(r.error, EBADF);
  EXPECT_EQ(r.bytes, 0u);
  EXPECT_EQ(read_failure(r, out.size(), 64, "header"),
            "header: pread at offset 64: " + errno_text(EBADF));
  TempDir dir;
  Fd d(dir.str());  // a directory: pread fails with EISDIR
  ASSERT_GE(d.fd, 0);
  const Error e = read_exactly_error(d.fd, out, 0, Stage::kHeader, "folder", "", "header");
  EXPECT_EQ(e.stage(), Stage::kHeader);
  EXPECT_EQ(e.file(), "folder");
  EXPECT_EQ(e.rule(), "header: pread at offset 0: " + errno_text(EISDIR));
}

TEST(ReadFully, AnEmptyRangeIsComplete) {
  const ReadFullyResult r = read_fully(-1, {}, 0);  // no pread at all
  EXPECT_TRUE(r.complete(0));
}

TEST(ReadFully, DirectFilesAlignToTheOneConstant) {
  static_assert(kDirectAlignment == 4096);
  TempDir dir;
  write_file(dir.file("f"), pattern(8192));
  try {
    const File f = File::open(dir.file("f"), true);
    EXPECT_EQ(f.alignment(), kDirectAlignment);
  } catch (const Error& e) {
    GTEST_SKIP() << "O_DIRECT not supported here: " << e.what();
  }
}

}  // namespace
}  // namespace ferry::io
