// The log sink: called outside the logging lock (a sink that logs through ferry
// used to deadlock on it), never re-entered by what it logs itself, and a sink
// that throws does not throw out of log::write (called from noexcept destructors).
#include "common/log.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

namespace ferry::log {
namespace {

// Restores standard error and the level when a test ends.
struct SinkScope {
  SinkScope() : level(log::level()) {}
  ~SinkScope() {
    set_sink(nullptr);
    set_level(level);
  }
  Level level;
};

TEST(Log, ASinkThatLogsThroughFerryNeitherDeadlocksNorRecurses) {
  SinkScope scope;
  set_level(Level::kInfo);
  std::vector<std::string> seen;
  set_sink([&seen](Level, std::string_view m) {
    seen.emplace_back(m);
    warn("the sink logs too");  // would have deadlocked on the logging mutex
  });
  ::testing::internal::CaptureStderr();
  info("hello");
  info("again");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(seen, (std::vector<std::string>{"hello", "again"}));
  EXPECT_NE(err.find("ferry warning: the sink logs too"), std::string::npos) << err;
}

TEST(Log, ASinkThatThrowsIsReportedNotPropagated) {
  SinkScope scope;
  set_level(Level::kInfo);
  set_sink([](Level, std::string_view) { throw 7; });
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(warn("kept"));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("the log sink threw"), std::string::npos) << err;
  EXPECT_NE(err.find("ferry warning: kept"), std::string::npos) << err;
}

TEST(Log, SinksMayBeReplacedWhileOtherThreadsLog) {
  SinkScope scope;
  set_level(Level::kInfo);
  std::atomic<int> a{0};
  std::atomic<int> b{0};
  std::atomic<int> running{0};
  set_sink([&a](Level, std::string_view) { ++a; });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&running] {
      ++running;
      for (int i = 0; i < 2000; ++i) {
        info("tick");
      }
    });
  }
  while (running.load() < 4) {
    std::this_thread::yield();
  }
  for (int i = 0; i < 200; ++i) {
    set_sink(i % 2 == 0 ? Sink([&b](Level, std::string_view) { ++b; })
                        : Sink([&a](Level, std::string_view) { ++a; }));
  }
  for (std::thread& t : threads) {
    t.join();
  }
  set_sink(nullptr);
  EXPECT_EQ(a.load() + b.load(), 4 * 2000);  // every message reached one sink, once
}

// As when the sink ran under the lock, replacing it returns only once no thread is
// still inside the old one, so that what the old sink captured may die.
TEST(Log, ReplacingTheSinkWaitsForCallsStillRunningIt) {
  SinkScope scope;
  set_level(Level::kInfo);
  std::atomic<bool> entered{false};
  std::atomic<bool> finished{false};
  set_sink([&](Level, std::string_view) {
    entered = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    finished = true;
  });
  std::thread logger([] { info("slow"); });
  while (!entered.load()) {
    std::this_thread::yield();
  }
  set_sink(nullptr);
  EXPECT_TRUE(finished.load());
  logger.join();
}

TEST(Log, SetSinkReturnsThePreviousOne) {
  SinkScope scope;
  int calls = 0;
  set_sink([&calls](Level, std::string_view) { ++calls; });
  Sink previous = set_sink(nullptr);
  ASSERT_TRUE(previous);
  previous(Level::kInfo, "x");
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(set_sink(nullptr));
}

TEST(Log, AScopedSinkTakesThisThreadsMessagesOnly) {
  SinkScope scope;
  set_level(Level::kInfo);
  std::vector<std::string> process;
  std::vector<std::string> mine;
  std::vector<std::string> inner;
  set_sink([&process](Level, std::string_view m) { process.emplace_back(m); });
  {
    const ScopedSink s(
        std::make_shared<const Sink>([&mine](Level, std::string_view m) { mine.emplace_back(m); }));
    EXPECT_TRUE(thread_sink());
    info("scoped");
    std::thread([] { info("another thread"); }).join();
    {
      const ScopedSink nested(std::make_shared<const Sink>(
          [&inner](Level, std::string_view m) { inner.emplace_back(m); }));
      info("nested");
    }
    info("scoped again");
    {
      const ScopedSink none(nullptr);  // back to the process-wide sink
      info("unscoped inside");
    }
    // Handed to a thread the scope's owner starts.
    std::thread([sink = thread_sink()] {
      const ScopedSink inherited(sink);
      info("inherited");
    }).join();
  }
  info("after");
  EXPECT_FALSE(thread_sink());
  EXPECT_EQ(mine, (std::vector<std::string>{"scoped", "scoped again", "inherited"}));
  EXPECT_EQ(inner, (std::vector<std::string>{"nested"}));
  EXPECT_EQ(process, (std::vector<std::string>{"another thread", "unscoped inside", "after"}));
}

TEST(Log, AScopedSinkHonoursTheLevelAndAnEmptyOneFallsBackToStandardError) {
  SinkScope scope;
  set_level(Level::kWarn);
  int calls = 0;
  {
    const ScopedSink s(
        std::make_shared<const Sink>([&calls](Level, std::string_view) { ++calls; }));
    info("dropped");
    warn("kept");
  }
  EXPECT_EQ(calls, 1);
  ::testing::internal::CaptureStderr();
  {
    const ScopedSink empty(std::make_shared<const Sink>());
    warn("to stderr");
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("ferry warning: to stderr"), std::string::npos) << err;
  EXPECT_EQ(err.find("threw"), std::string::npos) << err;
}

// write() is called from destructors and noexcept failure paths, where a throw
// would terminate; and memory may be what ran out, so standard error is written
// without allocating, long lines included.
static_assert(noexcept(write(Level::kError, "")));

TEST(Log, StandardErrorTakesLinesOfEveryLength) {
  SinkScope scope;
  set_level(Level::kInfo);
  const std::string long_line(5000, 'x');
  ::testing::internal::CaptureStderr();
  warn("short");
  info(long_line);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "ferry warning: short\nferry info: " + long_line + "\n");
}

TEST(Log, AMessageThatCannotBeBuiltWritesItsFallback) {
  SinkScope scope;
  set_level(Level::kInfo);
  std::vector<std::string> seen;
  set_sink([&seen](Level, std::string_view m) { seen.emplace_back(m); });
  write_built(
      Level::kWarn, [] { return std::string("built"); }, "fallback");
  write_built(
      Level::kWarn,
      []() -> std::string { throw std::bad_alloc(); },
      "reader lane: reads still in flight");
  EXPECT_EQ(seen, (std::vector<std::string>{"built", "reader lane: reads still in flight"}));
}

}  // namespace
}  // namespace ferry::log
