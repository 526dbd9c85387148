// `ferry load`'s progress: redrawn in place on a terminal at most 10 times a second,
// plain lines otherwise (on a phase change and every interval), the rate and ETA
// from the stream's own start, and --quiet silencing it.
#include "tools/progress.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "runtime/runtime_test_util.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::tools {
namespace {

using runtime::LoadPhase;
using runtime::LoadProgress;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = ProgressPrinter::Clock;
using std::chrono::milliseconds;

std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buf[512];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
    out.append(buf, n);
  }
  return out;
}

LoadProgress at(LoadPhase phase, std::uint64_t read, std::uint64_t planned = 4'000'000'000) {
  LoadProgress p;
  p.phase = phase;
  p.bytes_read = read;
  p.bytes_planned = planned;
  return p;
}

TEST(Progress, PlainLinesOnPhaseChangesAndEveryInterval) {
  std::FILE* f = std::tmpfile();
  ProgressPrinter printer(f, false, milliseconds(2000));
  const Clock::time_point t0 = Clock::now();
  printer.update(at(LoadPhase::kPlan, 0, 0), t0);
  printer.update(at(LoadPhase::kStream, 0), t0 + milliseconds(10));
  printer.update(at(LoadPhase::kStream, 1'000'000'000), t0 + milliseconds(500));  // not due
  printer.update(at(LoadPhase::kStream, 2'000'000'000), t0 + milliseconds(2010));
  printer.finish();
  const std::string out = contents(f);
  std::fclose(f);
  EXPECT_EQ(out,
            "ferry: progress: plan\n"
            "ferry: progress: stream 0 B / 3.7 GiB (0%)\n"
            "ferry: progress: stream 1.9 GiB / 3.7 GiB (50%) 1.00 GB/s ETA 2.0 s\n");
}

TEST(Progress, OneRedrawnLineOnATerminal) {
  std::FILE* f = std::tmpfile();
  ProgressPrinter printer(f, true);
  const Clock::time_point t0 = Clock::now();
  printer.update(at(LoadPhase::kStream, 0), t0);
  printer.update(at(LoadPhase::kStream, 100), t0 + milliseconds(20));  // within 100 ms
  printer.update(at(LoadPhase::kStream, 2'000'000'000), t0 + milliseconds(1000));
  printer.update(at(LoadPhase::kVerify, 4'000'000'000), t0 + milliseconds(1010));  // phase change
  printer.finish();
  const std::string out = contents(f);
  std::fclose(f);
  EXPECT_EQ(out,
            "\r\033[2Kferry: stream 0 B / 3.7 GiB (0%)"
            "\r\033[2Kferry: stream 1.9 GiB / 3.7 GiB (50%) 2.00 GB/s ETA 1.0 s"
            "\r\033[2Kferry: verify 3.7 GiB / 3.7 GiB (100%)\n");
}

TEST(Progress, FerryLoadPrintsProgressUnlessQuiet) {
  testing::TempDir dir;
  testing::Checkpoint ck = testing::synth_checkpoint(dir.file("ck"), "llama");
  testing::RunResult r = testing::run({FERRY_BINARY, "load", "--model", ck.dir});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("ferry: progress: done "));
  r = testing::run({FERRY_BINARY, "load", "--model", ck.dir, "--quiet"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.err, Not(HasSubstr("progress")));
}

}  // namespace
}  // namespace ferry::tools
