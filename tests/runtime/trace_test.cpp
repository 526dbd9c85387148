// The Chrome trace of a load (trace.path): named lanes for reads, each device,
// hooks and the runtime's phases; complete events that never overlap on a lane;
// bytes that add up to the report's; a capture-safe startup's phases.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::make_config;
using testing::read_file;
using testing::synth_checkpoint;
using testing::TempDir;

struct Trace {
  std::map<int, std::string> lanes;                           // tid -> name
  std::map<std::string, std::vector<nlohmann::json>> events;  // lane name -> X events
};

Trace read_trace(const std::string& path) {
  const nlohmann::json j = nlohmann::json::parse(read_file(path));
  Trace t;
  for (const nlohmann::json& e : j.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") {
      t.lanes[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
    }
  }
  for (const nlohmann::json& e : j.at("traceEvents")) {
    if (e.at("ph") == "X") {
      EXPECT_TRUE(t.lanes.count(e.at("tid").get<int>())) << e.dump();
      EXPECT_GE(e.at("dur").get<double>(), 0);
      t.events[t.lanes[e.at("tid").get<int>()]].push_back(e);
    }
  }
  // No two events of a lane overlap (they are written in start order).
  for (const auto& [lane, events] : t.events) {
    for (std::size_t i = 1; i < events.size(); ++i) {
      EXPECT_LE(events[i - 1]["ts"].get<double>() + events[i - 1]["dur"].get<double>(),
                events[i]["ts"].get<double>() + 1e-3)
          << lane << " event " << i;
    }
  }
  return t;
}

std::uint64_t bytes_of(const Trace& t, const std::string& lane_prefix, const std::string& name) {
  std::uint64_t n = 0;
  for (const auto& [lane, events] : t.events) {
    if (lane.rfind(lane_prefix, 0) == 0) {
      for (const nlohmann::json& e : events) {
        if (e["name"] == name) {
          n += e["args"]["bytes"].get<std::uint64_t>();
        }
      }
    }
  }
  return n;
}

std::set<std::string> names_on(const Trace& t, const std::string& lane_prefix) {
  std::set<std::string> out;
  for (const auto& [lane, events] : t.events) {
    if (lane.rfind(lane_prefix, 0) == 0) {
      for (const nlohmann::json& e : events) {
        out.insert(e["name"].get<std::string>());
      }
    }
  }
  return out;
}

TEST(Trace, ALoadShowsReadsCopiesAndPhasesOnTheirLanes) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::string path = dir.file("trace.json");
  Runtime rt(to_config(
      make_config(ck.dir, {"parallel.tp=2", "io.chunk_bytes=64KiB", "trace.path=" + path})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  const Trace t = read_trace(path);
  const LoadReport& report = r.model->report();
  // Both ranks are local, so every tensor byte is read once: the read events add up
  // to the files' data sections (each file less its 8-byte length and its header).
  std::uint64_t data = 0;
  for (const auto& e : std::filesystem::directory_iterator(ck.dir)) {
    if (e.path().extension() == ".safetensors") {
      const std::string bytes = read_file(e.path().string());
      std::uint64_t header = 0;
      std::memcpy(&header, bytes.data(), 8);
      data += bytes.size() - 8 - header;
    }
  }
  EXPECT_EQ(bytes_of(t, "read", "read"), data);
  EXPECT_LT(data, report.bytes_read);
  EXPECT_GE(t.events.at("read").size(), 2u);
  // Every copied byte on its device's lane (a dense family has no hooks), beside
  // those read straight into parameters (no copy).
  EXPECT_EQ(bytes_of(t, "host:0", "copy") + bytes_of(t, "host:1", "copy") +
                report.read_paths.direct_to_device,
            report.bytes_copied);
  EXPECT_GT(bytes_of(t, "host:1", "copy"), 0u);
  for (const char* phase : {"resolve", "plan", "allocate", "stream", "verify"}) {
    EXPECT_TRUE(names_on(t, "runtime").count(phase)) << phase;
  }
  EXPECT_TRUE(names_on(t, "prefetch").empty());  // prefetch.enabled is off
}

TEST(Trace, ThePipelinesPrefetchHasItsLanes) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::string path = dir.file("trace.json");
  // Slow copies keep the load running for a while (0.1 s or more), so that the
  // prefetch, which stops when the load ends, has time to read ahead even on a busy
  // machine; staged reads into two buffers per lane hold the reader back with them
  // (a read straight into a param would not wait for a copy, and the default
  // budget, 8 MiB, would hold the whole checkpoint).
  RuntimeTestSeams hooks;
  std::atomic<int> copies{0};
  hooks.before_copy = [&copies](std::size_t, const std::string&) {
    ++copies;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  };
  Runtime rt = make_runtime(
      to_config(
          make_config(ck.dir, {"prefetch.enabled=true", "prefetch.block_bytes=64KiB",
                               "io.chunk_bytes=64KiB", "io.direct_to_device=off", "io.read_lanes=2",
                               "io.staging_bytes=256KiB", "trace.path=" + path})),
      hooks);
  LoadResult r = rt.load();
  EXPECT_GE(copies.load(), 10);
  ASSERT_TRUE(r) << r.error->message;
  const Trace t = read_trace(path);
  EXPECT_EQ(bytes_of(t, "prefetch", "prefetch"), r.model->report().bytes_prefetched);
  EXPECT_GT(r.model->report().bytes_prefetched, 0u);
}

TEST(Trace, HooksAndTheStartupPhasesHaveTheirOwnEvents) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ds"), "deepseek_v3");
  const std::string path = dir.file("trace.json");
  Runtime rt(to_config(make_config(ck.dir, {"startup.mode=overlap", "trace.path=" + path})));
  ASSERT_TRUE(rt.prepare().wait());
  EXPECT_FALSE(std::filesystem::exists(path));  // written once, by commit()
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the "capture"
  LoadResult ready = rt.commit().wait();
  ASSERT_TRUE(ready);
  const Trace t = read_trace(path);
  const std::set<std::string> hooks = names_on(t, "hooks rank 0");
  ASSERT_FALSE(hooks.empty());
  for (const std::string& h : hooks) {
    EXPECT_NE(h.find("mla"), std::string::npos) << h;
  }
  // The hooks ran twice: on the sentinel and on the real weights.
  std::size_t runs = 0;
  for (const auto& [lane, events] : t.events) {
    if (lane.rfind("hooks rank 0", 0) == 0) {
      runs += events.size();
    }
  }
  EXPECT_EQ(runs, 2 * hooks.size());
  const std::set<std::string> phases = names_on(t, "runtime");
  for (const char* phase : {"resolve", "plan", "allocate", "sentinel", "capture (engine)",
                            "prefetch (capture)", "stream", "verify"}) {
    EXPECT_TRUE(phases.count(phase)) << phase;
  }
  EXPECT_TRUE(names_on(t, "host:0").count("fill"));  // the sentinel
  // The startup prefetch's blocks, during the capture: exactly what it read.
  EXPECT_EQ(bytes_of(t, "prefetch", "prefetch"), ready.model->report().startup.bytes_prefetched);
}

}  // namespace
}  // namespace ferry::runtime
