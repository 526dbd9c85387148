// Prometheus metrics: the textfile after a load and the pull endpoint scraped over
// HTTP, both parsed here and checked against the load report (bytes read, skipped
// by reason, copied per device, tensors by route, phases adding up to the total);
// an engine's own registry; errors by stage; bad endpoints.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>

#include "ferry/metrics.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using ::testing::HasSubstr;
using testing::make_config;
using testing::read_file;
using testing::synth_checkpoint;
using testing::TempDir;

// One sample: `name{a="x",b="y"} value` -> key "name{a=x,b=y}" (labels sorted as
// written by the serializer), value.
using Samples = std::map<std::string, double>;

Samples parse(const std::string& text) {
  Samples out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') {
      continue;
    }
    const std::size_t space = line.rfind(' ');
    EXPECT_NE(space, std::string::npos) << line;
    std::string key = line.substr(0, space);
    std::string cleaned;
    for (char c : key) {
      if (c != '"') {
        cleaned += c;
      }
    }
    out[cleaned] = std::stod(line.substr(space + 1));
  }
  return out;
}

// Sum of every sample of family `name` whose key contains `filter`.
double sum(const Samples& s, const std::string& name, const std::string& filter = "") {
  double total = 0;
  for (const auto& [key, value] : s) {
    const bool family = key == name || key.rfind(name + "{", 0) == 0;
    if (family && key.find(filter) != std::string::npos) {
      total += value;
    }
  }
  return total;
}

std::string http_get(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    ADD_FAILURE() << "cannot connect to 127.0.0.1:" << port;
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  EXPECT_EQ(::write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string response;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) {
    response.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return response;
}

// The body of GET /metrics.
std::string scrape(int port) {
  const std::string response = http_get(port, "/metrics");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  const std::size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// The checks every scrape of a finished load must pass.
void expect_matches_report(const Samples& s, const LoadReport& r, std::size_t devices) {
  EXPECT_EQ(sum(s, "ferry_bytes_read_total"), static_cast<double>(r.bytes_read));
  EXPECT_EQ(sum(s, "ferry_bytes_skipped_total"), static_cast<double>(r.bytes_skipped));
  for (const auto& [reason, bytes] : r.bytes_skipped_by_reason) {
    EXPECT_EQ(sum(s, "ferry_bytes_skipped_total", "reason=" + reason), static_cast<double>(bytes))
        << reason;
  }
  // A dense family has no hooks: every device byte is checkpoint data, copied or
  // read straight into its parameter.
  EXPECT_EQ(sum(s, "ferry_read_path_bytes_total", "path=direct_to_device"),
            static_cast<double>(r.read_paths.direct_to_device));
  EXPECT_EQ(sum(s, "ferry_read_path_bytes_total", "path=staged"),
            static_cast<double>(r.read_paths.staged));
  EXPECT_EQ(sum(s, "ferry_bytes_copied_total") +
                sum(s, "ferry_read_path_bytes_total", "path=direct_to_device"),
            static_cast<double>(r.bytes_copied));
  for (std::size_t d = 0; d < devices; ++d) {
    EXPECT_GT(sum(s, "ferry_bytes_copied_total", "device=host:" + std::to_string(d)), 0) << d;
    EXPECT_GT(sum(s, "ferry_copy_seconds_count", "device=host:" + std::to_string(d)), 0) << d;
  }
  EXPECT_EQ(sum(s, "ferry_tensors_total", "route=placed"), static_cast<double>(r.tensors.placed));
  EXPECT_EQ(sum(s, "ferry_tensors_total", "route=dropped"), static_cast<double>(r.tensors.dropped));
  EXPECT_NEAR(sum(s, "ferry_load_phase_seconds"), sum(s, "ferry_load_seconds"), 1e-9);
  EXPECT_NEAR(sum(s, "ferry_load_seconds"), r.seconds, 1e-9);
  EXPECT_GT(sum(s, "ferry_read_seconds_count"), 0);
  EXPECT_EQ(sum(s, "ferry_read_seconds_count"), sum(s, "ferry_read_seconds_bucket", "le=+Inf"));
  EXPECT_EQ(sum(s, "ferry_staging_buffers_in_use"), 0);  // all returned at the end
  EXPECT_EQ(sum(s, "ferry_reader_inflight"), 0);
  EXPECT_EQ(sum(s, "ferry_load_errors_total"), 0);
}

TEST(Metrics, TheTextfileAfterALoadMatchesItsReport) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  const std::string file = dir.file("ferry.prom");
  Runtime rt(to_config(
      make_config(ck.dir, {"parallel.tp=4", "parallel.ranks=1,2", "metrics.textfile=" + file})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  ASSERT_TRUE(std::filesystem::exists(file));
  EXPECT_FALSE(std::filesystem::exists(file + ".tmp"));
  const LoadReport& report = r.model->report();
  EXPECT_GT(report.bytes_skipped_by_reason.at("remote_slices"), 0u);
  std::uint64_t reasons = 0;
  for (const auto& [reason, bytes] : report.bytes_skipped_by_reason) {
    reasons += bytes;
  }
  EXPECT_EQ(reasons, report.bytes_skipped);
  const Samples s = parse(read_file(file));
  expect_matches_report(s, report, 2);
  EXPECT_EQ(sum(s, "ferry_load_seconds", "model=ck"), sum(s, "ferry_load_seconds"));
  EXPECT_EQ(sum(s, "ferry_load_seconds", "startup_mode=load"), sum(s, "ferry_load_seconds"));
}

TEST(Metrics, TheEndpointServesWhileTheRuntimeLives) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "qwen2");
  int port = 0;
  {
    Runtime rt(to_config(make_config(ck.dir, {"parallel.tp=2", "metrics.listen=127.0.0.1:0"})));
    const std::vector<int> ports = metrics_ports(rt);
    ASSERT_EQ(ports.size(), 1u);
    port = ports[0];
    // Before any load: the live gauges are there, nothing else counted yet.
    Samples before = parse(scrape(port));
    EXPECT_EQ(sum(before, "ferry_reader_inflight"), 0);
    EXPECT_EQ(sum(before, "ferry_bytes_read_total"), 0);

    LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
    expect_matches_report(parse(scrape(port)), r.model->report(), 2);

    // A second load adds to the counters.
    LoadResult again = rt.load();
    ASSERT_TRUE(again);
    EXPECT_EQ(sum(parse(scrape(port)), "ferry_bytes_read_total"),
              static_cast<double>(r.model->report().bytes_read + again.model->report().bytes_read));
  }
  // The Runtime is gone, and with it the endpoint.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_NE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ::close(fd);
}

TEST(Metrics, AnEnginesOwnRegistryGetsFerrysFamilies) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name("engine_requests_total").Help("x").Register(*registry).Add({});
  Runtime rt(to_config(make_config(ck.dir, {"parallel.tp=2", "parallel.ranks=1"})));
  use_registry(rt, registry);
  LoadResult r = rt.load();
  ASSERT_TRUE(r);
  std::map<std::string, bool> names;
  for (const auto& family : registry->Collect()) {
    names[family.name] = true;
  }
  for (const char* name :
       {"engine_requests_total", "ferry_load_seconds", "ferry_load_phase_seconds",
        "ferry_bytes_read_total", "ferry_bytes_skipped_total", "ferry_bytes_copied_total",
        "ferry_tensors_total", "ferry_load_throughput_bytes_per_second",
        "ferry_staging_buffers_in_use", "ferry_reader_inflight", "ferry_read_seconds",
        "ferry_copy_seconds", "ferry_prefetch_bytes_total", "ferry_read_path_bytes_total",
        "ferry_load_errors_total"}) {
    EXPECT_TRUE(names.count(name)) << name;
  }
}

TEST(Metrics, FailedLoadsCountByStageAndABadEndpointFailsLoadsClearly) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  std::filesystem::resize_file(ck.dir + "/model-00003-of-00004.safetensors", 1000);
  const std::string file = dir.file("m.prom");
  Runtime rt(to_config(make_config(ck.dir, {"metrics.textfile=" + file})));
  ASSERT_FALSE(rt.load());
  ASSERT_FALSE(rt.load());
  const Samples s = parse(read_file(file));
  EXPECT_EQ(sum(s, "ferry_load_errors_total"), 2);
  EXPECT_EQ(sum(s, "ferry_load_errors_total", "stage=header"), 2);

  // A port already taken: the Runtime still constructs; each load says why it fails.
  Checkpoint good = synth_checkpoint(dir.file("good"), "llama");
  Runtime first(to_config(make_config(good.dir, {"metrics.listen=127.0.0.1:0"})));
  const int port = metrics_ports(first).at(0);
  Runtime second(
      to_config(make_config(good.dir, {"metrics.listen=127.0.0.1:" + std::to_string(port)})));
  EXPECT_TRUE(metrics_ports(second).empty());
  LoadResult r = second.load();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kConfig);
  EXPECT_THAT(r.error->message, HasSubstr("metrics.listen: cannot serve metrics on 127.0.0.1:" +
                                          std::to_string(port)));
}

}  // namespace
}  // namespace ferry::runtime
