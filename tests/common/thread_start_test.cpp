// run_each: one call an index, on the calling thread for one and a thread each for
// more, each with the caller's log sink; every call runs to its end before the
// lowest failing index's exception comes out; a refused thread is the start's
// Error, after the started ones were joined.
#include "common/thread_start.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/log.hpp"

namespace ferry {
namespace {

TEST(RunEach, OneRunsOnTheCallingThreadAndMoreOnAThreadEach) {
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id one;
  run_each("test one", 1, [&](std::size_t i) {
    EXPECT_EQ(i, 0u);
    one = std::this_thread::get_id();
  });
  EXPECT_EQ(one, caller);

  record_thread_starts();
  std::mutex mu;
  std::vector<std::thread::id> ids(4);
  std::vector<int> calls(4, 0);
  run_each("test many", 4, [&](std::size_t i) {
    const std::lock_guard lock(mu);
    ids[i] = std::this_thread::get_id();
    ++calls[i];
  });
  EXPECT_EQ(stop_recording_thread_starts(),
            (std::vector<std::string>{"test many 0", "test many 1", "test many 2", "test many 3"}));
  EXPECT_EQ(calls, (std::vector<int>{1, 1, 1, 1}));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    EXPECT_NE(ids[i], caller) << i;
    for (std::size_t j = i + 1; j < ids.size(); ++j) {
      EXPECT_NE(ids[i], ids[j]) << i << " " << j;
    }
  }

  bool ran = false;
  run_each("test none", 0, [&](std::size_t) { ran = true; });
  EXPECT_FALSE(ran);
}

TEST(RunEach, EveryCallEndsThenTheLowestFailingIndexThrows) {
  std::atomic<int> finished{0};
  try {
    run_each("test fail", 5, [&](std::size_t i) {
      ++finished;
      if (i == 1 || i == 3) {
        throw std::runtime_error("index " + std::to_string(i));
      }
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "index 1");
  }
  EXPECT_EQ(finished.load(), 5);
}

TEST(RunEach, ARefusedThreadIsTheStartsErrorAfterTheStartedOnesEnd) {
  std::atomic<int> finished{0};
  inject_thread_start_failure("test refused 2");
  try {
    run_each("test refused", 4, [&](std::size_t) { ++finished; });
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kResources);
    EXPECT_EQ(std::string(e.what()).rfind("resources: could not start thread test refused 2: ", 0),
              0u)
        << e.what();
  }
  EXPECT_FALSE(thread_start_failure_pending());
  // The two started before the refusal were joined: they ran, and no call is left
  // running after run_each returned.
  EXPECT_EQ(finished.load(), 2);
}

TEST(RunEach, EachThreadLogsToTheCallersScopedSink) {
  const log::Level before = log::level();
  log::set_level(log::Level::kInfo);
  std::mutex mu;
  std::vector<std::string> seen;
  {
    const log::ScopedSink scope(std::make_shared<const log::Sink>(
        [&](log::Level, std::string_view m) {
          const std::lock_guard lock(mu);
          seen.emplace_back(m);
        }));
    run_each("test log", 3, [](std::size_t i) { log::info("from " + std::to_string(i)); });
  }
  log::set_level(before);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<std::string>{"from 0", "from 1", "from 2"}));
}

}  // namespace
}  // namespace ferry
