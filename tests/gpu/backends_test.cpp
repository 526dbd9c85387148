// Device specs: what make_devices accepts, what it refuses and how it says so.
#include "gpu/backends.hpp"

#include <gtest/gtest.h>

#include "common/error.hpp"

namespace ferry::gpu {
namespace {

TEST(BackendsTest, HostSpecMakesThatManyDevices) {
  auto devices = make_devices("host:4");
  ASSERT_EQ(devices.size(), 4u);
  for (std::size_t i = 0; i < devices.size(); ++i) {
    EXPECT_EQ(devices[i]->name(), "host:" + std::to_string(i));
  }
  // Separate devices: separate memory accounting.
  DeviceAllocation a = devices[1]->allocate(10);
  EXPECT_EQ(devices[1]->stats().device.live_count, 1u);
  EXPECT_EQ(devices[0]->stats().device.live_count, 0u);

  ASSERT_EQ(make_devices("host").size(), 1u);
  EXPECT_EQ(make_devices("host")[0]->name(), "host:0");
}

TEST(BackendsTest, HostOptionsReachEveryDevice) {
  auto devices = make_devices("host:2", {.capacity_bytes = 100});
  for (auto& d : devices) {
    EXPECT_THROW(d->allocate(101), Error) << d->name();
  }
}

TEST(BackendsTest, BadSpecsAreConfigErrorsQuotingTheSpec) {
  for (const char* spec : {"",        "host:",    "host:0",   "host:-1",          "host:+2",
                           "host:2x", "host: 2",  "host:1,2", "host:99999999999", "tpu:0",
                           ":1",      "HOST:1",   "cuda:",    "cuda:0,",          "cuda:,0",
                           "cuda:a",  "cuda:0,0", "cuda:-1",  "cuda:1 ",          "cuda:0;1"}) {
    try {
      make_devices(spec);
      ADD_FAILURE() << "accepted '" << spec << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kConfig) << e.what();
      EXPECT_NE(e.rule().find("device spec '" + std::string(spec) + "'"), std::string::npos)
          << e.what();
    }
  }
}

TEST(BackendsTest, MessagesSayWhatIsWrong) {
  auto rule_of = [](const char* spec) {
    try {
      make_devices(spec);
    } catch (const Error& e) {
      return e.rule();
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(rule_of("tpu:0").find("unknown backend 'tpu'"), std::string::npos);
  EXPECT_NE(rule_of("host:0").find("not a device count"), std::string::npos);
  EXPECT_NE(rule_of("cuda:0,0").find("listed twice"), std::string::npos);
  EXPECT_NE(rule_of("cuda:0,").find("ends with ','"), std::string::npos);
  EXPECT_NE(rule_of("cuda:x").find("'x' is not a CUDA device index"), std::string::npos);
}

TEST(BackendsTest, CudaSpecExplainsWhyNoDeviceIsAvailable) {
  std::string why;
  int count = cuda_device_count(&why);
  if (count > 0) {
    auto devices = make_devices("cuda:0");
    ASSERT_EQ(devices.size(), 1u);
    EXPECT_EQ(devices[0]->name(), "cuda:0");
    EXPECT_EQ(make_devices("cuda").size(), static_cast<std::size_t>(count));
    EXPECT_THROW(make_devices("cuda:" + std::to_string(count)), Error);
    return;
  }
  EXPECT_FALSE(why.empty());
  for (const char* spec : {"cuda", "cuda:0", "cuda:0,2"}) {
    try {
      make_devices(spec);
      ADD_FAILURE() << "accepted '" << spec << "' without a GPU";
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kConfig);
      if (cuda_compiled()) {
        // The runtime's own reason, e.g. cudaGetDeviceCount failing with code 35.
        EXPECT_NE(e.rule().find("no CUDA device is usable: " + why), std::string::npos) << e.what();
      } else {
        EXPECT_NE(e.rule().find("FERRY_CUDA=ON"), std::string::npos) << e.what();
      }
    }
  }
  try {
    make_cuda_device(0);
    ADD_FAILURE() << "made a CUDA device without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.file(), "cuda:0");
    EXPECT_EQ(e.stage(), Stage::kConfig);
  }
}

}  // namespace
}  // namespace ferry::gpu
