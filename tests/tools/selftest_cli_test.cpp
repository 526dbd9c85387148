// `ferry selftest` through the binary: host against host passes; CUDA without a GPU
// (as on the build machines) fails with the reason instead of pretending.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "gpu/backends.hpp"
#include "testing/run.hpp"

namespace ferry::tools {
namespace {

using ::testing::HasSubstr;
using ferry::testing::run;

TEST(SelftestCliTest, HostDevicesPassEveryCheck) {
  auto r = run({FERRY_BINARY, "selftest", "--devices", "host:2"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("selftest: 2 device(s), all checks passed"));
}

TEST(SelftestCliTest, CudaWithoutAGpuSaysWhy) {
  std::string why;
  if (gpu::cuda_device_count(&why) > 0) {
    GTEST_SKIP() << "a CUDA device is present; the GPU selftest is exercised by CudaDevice tests";
  }
  auto r = run({FERRY_BINARY, "selftest", "--devices", "cuda"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("cuda"));
}

TEST(SelftestCliTest, BadSpecIsAnError) {
  auto r = run({FERRY_BINARY, "selftest", "--devices", "tpu:0"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("tpu:0"));
  EXPECT_EQ(run({FERRY_BINARY, "selftest", "--bogus"}).status, 2);
}

}  // namespace
}  // namespace ferry::tools
