// Teardown that never hangs: a read that never completes (from a FIFO nobody
// writes to) is cancelled (IORING_OP_ASYNC_CANCEL) and waited for within
// io.cancel_timeout_ms, by Reader::cancel and by the reader's destructor; the
// default cancel (pread and decorators) is bounded too. Before, the io_uring
// reader's destructor waited for the read forever.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "io/reader.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A FIFO with a writer that never writes: a read of it waits forever.
struct StuckFile {
  testing::TempDir dir;
  int writer = -1;
  File file;
  StuckFile() {
    const std::string path = dir.file("stuck.fifo");
    EXPECT_EQ(::mkfifo(path.c_str(), 0600), 0);
    writer = ::open(path.c_str(), O_RDWR | O_CLOEXEC);  // does not block, keeps it open
    const int reader = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    EXPECT_GE(reader, 0);
    file = File::adopt(reader, std::uint64_t{1} << 20, "stuck.fifo");
  }
  ~StuckFile() { ::close(writer); }
};

std::unique_ptr<Reader> uring(milliseconds cancel_timeout) {
  ReaderOptions o;
  o.engine = Engine::kUring;
  o.queue_depth = 4;
  o.cancel_timeout = cancel_timeout;
  std::string why;
  std::unique_ptr<Reader> r = make_uring_reader(o, &why);
  if (!r) {
    ADD_FAILURE() << "io_uring is not available here: " << why;
  }
  return r;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TEST(ReaderCancel, AReadThatNeverCompletesIsCancelledWithinTheBound) {
  if (!uring_available()) {
    GTEST_SKIP() << "io_uring is not available here";
  }
  StuckFile stuck;
  std::unique_ptr<Reader> reader = uring(milliseconds(5000));
  ASSERT_TRUE(reader);
  std::vector<std::byte> buf(4096);
  reader->submit({&stuck.file, 0, buf.size(), buf.data(), 7});
  std::vector<Completion> done;
  reader->poll(done, milliseconds(100));
  ASSERT_TRUE(done.empty()) << "the read was meant to wait";
  ASSERT_EQ(reader->outstanding(), 1u);

  const Clock::time_point t = Clock::now();
  EXPECT_TRUE(reader->cancel(milliseconds(5000)));  // the kernel cancels a pipe read
  EXPECT_LT(seconds_since(t), 2.0);
  EXPECT_EQ(reader->outstanding(), 0u);
  const Clock::time_point d = Clock::now();
  reader.reset();
  EXPECT_LT(seconds_since(d), 1.0);
}

TEST(ReaderCancel, TheDestructorCancelsTooInsteadOfWaitingForever) {
  if (!uring_available()) {
    GTEST_SKIP() << "io_uring is not available here";
  }
  StuckFile stuck;
  std::unique_ptr<Reader> reader = uring(milliseconds(2000));
  ASSERT_TRUE(reader);
  std::vector<std::byte> buf(4096);
  reader->submit({&stuck.file, 0, buf.size(), buf.data(), 1});
  reader->submit({&stuck.file, 0, buf.size(), buf.data(), 2});
  std::vector<Completion> done;
  reader->poll(done, milliseconds(50));
  const Clock::time_point t = Clock::now();
  reader.reset();  // used to block in io_uring_wait_cqe for good
  EXPECT_LT(seconds_since(t), 2.5);
}

// A reader whose reads never end and cannot be cancelled (the default cancel only
// polls): cancel gives up after its bound and says so.
class NeverDone final : public Reader {
 public:
  void submit(const ReadOp&) override { ++outstanding_; }
  std::size_t poll(std::vector<Completion>&, milliseconds wait) override {
    std::this_thread::sleep_for(std::min(wait, milliseconds(10)));
    return 0;
  }
  std::size_t outstanding() const override { return outstanding_; }
  const ReaderStats& stats() const override { return stats_; }
  std::string name() const override { return "never"; }

 private:
  std::size_t outstanding_ = 0;
  ReaderStats stats_;
};

TEST(ReaderCancel, TheDefaultCancelIsBoundedAndSaysWhenReadsRemain) {
  NeverDone reader;
  EXPECT_TRUE(reader.cancel(milliseconds(100)));  // nothing outstanding
  std::byte b{};
  reader.submit({nullptr, 0, 1, &b, 0});
  const Clock::time_point t = Clock::now();
  EXPECT_FALSE(reader.cancel(milliseconds(150)));
  const double took = seconds_since(t);
  EXPECT_GE(took, 0.14);
  EXPECT_LT(took, 2.0);
}

}  // namespace
}  // namespace ferry::io
