// Runtime::set_log_sink: what a load logs, on any of its threads (the thread that
// runs it, the pipeline's actor threads, the prefetcher's), reaches that Runtime's
// sink only; two runtimes loading at once keep their messages apart, and the
// process-wide sink sees neither.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/log.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using ::testing::Contains;
using ::testing::Each;
using testing::make_config;
using ::testing::StartsWith;
using testing::synth_checkpoint;
using testing::TempDir;

// Messages a sink received, from any thread.
class Collected {
 public:
  log::Sink sink() {
    return [this](log::Level, std::string_view m) {
      std::lock_guard lock(mu_);
      lines_.emplace_back(m);
    };
  }
  std::vector<std::string> lines() const {
    std::lock_guard lock(mu_);
    return lines_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> lines_;
};

// Restores the process-wide sink and level when the test ends.
struct ProcessSink {
  explicit ProcessSink(Collected& c) : level(log::level()) {
    log::set_level(log::Level::kInfo);
    log::set_sink(c.sink());
  }
  ~ProcessSink() {
    log::set_sink(nullptr);
    log::set_level(level);
  }
  log::Level level;
};

// Hooks that log, tagged, from the load's thread (wrap_model) and from a copy
// worker (before_copy: a detached actor's own thread).
RuntimeTestSeams tagged_hooks(const std::string& tag) {
  RuntimeTestSeams hooks;
  hooks.wrap_model = [tag](std::shared_ptr<const models::Model> m) {
    log::warn(tag + " load thread");
    return m;
  };
  hooks.before_copy = [tag](std::size_t, const std::string&) { log::warn(tag + " copy worker"); };
  return hooks;
}

TEST(RuntimeLogSink, TwoRuntimesLoadingAtOnceKeepTheirMessagesApart) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  Collected process, a, b;
  ProcessSink restore(process);
  // The prefetcher's threads log a summary at info level (prefetch.enabled).
  Runtime ra =
      make_runtime(to_config(make_config(ck.dir, {"parallel.tp=2", "prefetch.enabled=true"})),
                   tagged_hooks("A"));
  Runtime rb =
      make_runtime(to_config(make_config(ck.dir, {"parallel.tp=2", "prefetch.enabled=true"})),
                   tagged_hooks("B"));
  ra.set_log_sink(a.sink());
  rb.set_log_sink(b.sink());
  LoadHandle ha = ra.start();
  LoadHandle hb = rb.start();
  LoadResult r1 = ha.wait();
  LoadResult r2 = hb.wait();
  ASSERT_TRUE(r1) << r1.error->message;
  ASSERT_TRUE(r2) << r2.error->message;

  EXPECT_THAT(a.lines(), Contains("A load thread"));
  EXPECT_THAT(a.lines(), Contains("A copy worker"));
  EXPECT_THAT(b.lines(), Contains("B load thread"));
  EXPECT_THAT(b.lines(), Contains("B copy worker"));
  // The prefetcher's own threads, started by a pipeline thread, inherit the sink.
  for (const Collected* c : {&a, &b}) {
    EXPECT_THAT(c->lines(), Contains(::testing::AnyOf(StartsWith("prefetch finished"),
                                                      StartsWith("prefetch cancelled"))));
  }
  for (const std::string& line : a.lines()) {
    EXPECT_FALSE(line.starts_with("B ")) << line;
  }
  for (const std::string& line : b.lines()) {
    EXPECT_FALSE(line.starts_with("A ")) << line;
  }
  // Nothing of either load reached the process-wide sink, untagged lines included.
  EXPECT_THAT(process.lines(), Each(::testing::Not(StartsWith("A "))));
  EXPECT_THAT(process.lines(), Each(::testing::Not(StartsWith("B "))));
  EXPECT_TRUE(process.lines().empty()) << process.lines().front();

  // Restored: the next load logs to the process-wide sink again.
  ra.set_log_sink(nullptr);
  const std::size_t a_before = a.lines().size();
  LoadResult again = ra.load();
  ASSERT_TRUE(again) << again.error->message;
  EXPECT_EQ(a.lines().size(), a_before);
  EXPECT_THAT(process.lines(), Contains("A copy worker"));
}

TEST(RuntimeLogSink, ThePlansWarningReachesTheRuntimesSinkOnly) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  std::string shard;
  for (const auto& e : std::filesystem::directory_iterator(ck.dir)) {
    if (e.path().extension() == ".safetensors") {
      shard = e.path().filename().string();
    }
  }
  testing::rewrite_shard(ck.dir, shard, [](std::vector<testing::ShardEntry>& entries) {
    entries.push_back({"model.extra_thing.weight", DType::kBF16, {4}, std::string(8, '\0')});
  });
  Collected process, mine;
  ProcessSink restore(process);
  Runtime rt(to_config(make_config(ck.dir, {"parallel.tp=2"})));
  rt.set_log_sink(mine.sink());
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  const std::string warning = "1 checkpoint tensor(s) map to no parameter";
  EXPECT_THAT(mine.lines(), Contains(::testing::HasSubstr(warning)));
  EXPECT_THAT(process.lines(), Each(::testing::Not(::testing::HasSubstr(warning))));
}

}  // namespace
}  // namespace ferry::runtime
