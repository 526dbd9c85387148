// The device self-test: passes host against host, and fails, naming the right
// checks, when the device under test is broken.
#include "gpu/selftest.hpp"

#include <gtest/gtest.h>

#include <set>
#include <stdexcept>

#include "gpu/forwarding_device.hpp"
#include "gpu/host_device.hpp"

namespace ferry::gpu {
namespace {

std::set<std::string> failed_names(const SelftestResult& r) {
  std::set<std::string> out;
  for (const auto& c : r.checks) {
    if (!c.passed) {
      out.insert(c.name);
    }
  }
  return out;
}

TEST(SelftestTest, HostAgainstHostPassesEveryCheck) {
  auto dut = make_host_device(0, {.poison_allocations = true});
  auto reference = make_host_device(1);
  SelftestResult r = run_selftest(*dut, *reference);
  EXPECT_TRUE(r.passed()) << r.report();
  EXPECT_EQ(r.failures(), 0u);
  EXPECT_EQ(r.device, "host:0");
  EXPECT_EQ(r.reference, "host:1");
  std::set<std::string> names;
  for (const auto& c : r.checks) {
    names.insert(c.name);
  }
  for (const char* want :
       {"copy_h2d", "copy_h2d from pinned memory", "copy_h2d from registered memory",
        "copy_h2d_2d odd pitches", "zero", "fill BF16", "fill F16 unaligned", "fill F64",
        "fill F32 large", "cast F32 -> BF16", "cast F32 -> F16 unaligned", "cast BF16 -> F32",
        "cast F16 -> BF16 in place", "cast F32 -> BF16 large", "event after copy", "two streams",
        "everything released"}) {
    EXPECT_TRUE(names.count(want)) << "missing check '" << want << "'";
  }
  EXPECT_EQ(names.size(), r.checks.size()) << "check names must be unique";
  EXPECT_NE(r.report().find(std::to_string(r.checks.size()) + "/" +
                            std::to_string(r.checks.size()) + " checks passed"),
            std::string::npos)
      << r.report();
  EXPECT_TRUE(dut->stats().all_released());
  EXPECT_TRUE(reference->stats().all_released());
}

TEST(SelftestTest, AFlippedBitInCastFailsExactlyTheCastChecks) {
  testing::ForwardingDevice dut(make_host_device(0));
  dut.faults().after_cast = [](std::byte* dst, DType, std::size_t count) {
    if (count > 100) {
      dst[100] ^= std::byte{0x01};  // host backend: device memory is host memory
    }
  };
  auto reference = make_host_device(1);
  SelftestResult r = run_selftest(dut, *reference);
  EXPECT_FALSE(r.passed());
  std::set<std::string> failed = failed_names(r);
  EXPECT_FALSE(failed.empty());
  for (const auto& c : r.checks) {
    bool is_cast = c.name.rfind("cast ", 0) == 0;
    EXPECT_EQ(c.passed, !is_cast) << c.name << ": " << c.detail;
    if (is_cast) {
      EXPECT_NE(c.detail.find("1 of "), std::string::npos) << c.detail;
      EXPECT_NE(c.detail.find("bytes differ"), std::string::npos) << c.detail;
    }
  }
  EXPECT_NE(r.report().find("FAIL cast F32 -> BF16"), std::string::npos);
}

TEST(SelftestTest, AnOperationThatThrowsIsAFailedCheckNotACrash) {
  testing::ForwardingDevice dut(make_host_device(0));
  dut.faults().before_fill = [] { throw std::runtime_error("fill exploded"); };
  auto reference = make_host_device(1);
  SelftestResult r = run_selftest(dut, *reference);
  EXPECT_FALSE(r.passed());
  for (const auto& c : r.checks) {
    bool fills = c.name.rfind("fill ", 0) == 0 || c.name == "two streams";
    EXPECT_EQ(c.passed, !fills) << c.name << ": " << c.detail;
    if (fills) {
      EXPECT_NE(c.detail.find("broken(host:0) threw: fill exploded"), std::string::npos)
          << c.detail;
    }
  }
  // What the failed checks had allocated was still given back.
  EXPECT_TRUE(dut.stats().all_released());
}

TEST(SelftestTest, ALeakIsReported) {
  testing::ForwardingDevice dut(make_host_device(0));
  dut.faults().leak_allocations = true;
  auto reference = make_host_device(1);
  SelftestResult r = run_selftest(dut, *reference);
  EXPECT_EQ(failed_names(r), std::set<std::string>{"everything released"}) << r.report();
}

TEST(SelftestTest, ABindFailureStopsEarly) {
  testing::ForwardingDevice dut(make_host_device(0));
  dut.faults().on_bind = [] { throw std::runtime_error("cudaSetDevice: no"); };
  auto reference = make_host_device(1);
  SelftestResult r = run_selftest(dut, *reference);
  ASSERT_EQ(r.checks.size(), 1u);
  EXPECT_EQ(r.checks[0].name, "bind");
  EXPECT_FALSE(r.passed());
  EXPECT_NE(r.report().find("cudaSetDevice: no"), std::string::npos);
}

TEST(SelftestTest, AnEmptyResultIsNotAPass) {
  SelftestResult r;
  EXPECT_FALSE(r.passed());
}

}  // namespace
}  // namespace ferry::gpu
