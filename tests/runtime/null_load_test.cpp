// Loads onto null devices (gpu/null_device.hpp): the same reads and copies as onto
// host devices, every byte counted by the devices, post-load hooks checked and
// skipped (and listed in the report), dumps and read-backs refused, and a piece that
// runs past its parameter an error naming the parameter, as on the host backend.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "gpu/device_wrapper.hpp"
#include "gpu/null_device.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/error_of.hpp"
#include "testing/run.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

LoadResult load(const LoadConfig& config, const RuntimeTestSeams& hooks = {}) {
  Runtime rt = make_runtime(to_config(config), hooks);
  return rt.load();
}

TEST(NullLoad, ReadsAndCopiesWhatAHostLoadDoes) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  LoadResult host = load(make_config(ck.dir, {"parallel.tp=2"}));
  ASSERT_TRUE(host) << host.error->message;
  RuntimeTestSeams hooks;
  hooks.devices = {gpu::make_null_device(0), gpu::make_null_device(1)};
  LoadResult null = load(make_config(ck.dir, {"parallel.tp=2", "devices=null"}), hooks);
  ASSERT_TRUE(null) << null.error->message;
  const LoadReport& h = host.model->report();
  const LoadReport& n = null.model->report();
  EXPECT_EQ(n.bytes_read, h.bytes_read);
  EXPECT_EQ(n.bytes_copied, h.bytes_copied);
  EXPECT_EQ(n.tensors.placed, h.tensors.placed);
  EXPECT_TRUE(n.hooks_skipped.empty());
  // Every param byte was written once: the copies, and the zero rows of the padded
  // vocabulary, which are fills.
  ASSERT_EQ(null.model->ranks().size(), 2u);
  for (std::size_t r = 0; r < 2; ++r) {
    std::uint64_t param_bytes = 0;
    for (const LoadedParam& p : null.model->ranks()[r].params) {
      param_bytes += p.nbytes;
    }
    EXPECT_EQ(gpu::null_device_bytes_written(*hooks.devices[r]), param_bytes) << r;
  }
  EXPECT_LT(n.bytes_copied, gpu::null_device_bytes_written(*hooks.devices[0]) +
                                gpu::null_device_bytes_written(*hooks.devices[1]));
  EXPECT_EQ(null.model->ranks()[1].device, "null:1");
  EXPECT_EQ(null.model->ranks()[1].params.size(), host.model->ranks()[1].params.size());
  // Nothing to read back or dump.
  EXPECT_THAT([&] { null.model->read_param(0, null.model->ranks()[0].params[0].name); },
              ::testing::ThrowsMessage<Error>(HasSubstr("keeps no parameter data")));
  EXPECT_THAT(
      [&] { null.model->dump(dir.file("dump")); },
      ::testing::ThrowsMessage<Error>(HasSubstr("dump: this device keeps no parameter data")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("dump")));
}

TEST(NullLoad, HooksAreCheckedSkippedAndReported) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ds"), "deepseek_v3");
  LoadResult r = load(make_config(ck.dir, {"parallel.tp=2", "parallel.ep=2", "devices=null:2"}));
  ASSERT_TRUE(r) << r.error->message;
  const LoadReport& rep = r.model->report();
  // One MLA kv_b_proj -> w_kc / w_vc hook per layer and rank.
  const std::size_t layers = ck.config.at("num_hidden_layers").get<std::size_t>();
  ASSERT_EQ(rep.hooks_skipped.size(), 2 * layers);
  for (const std::string& h : rep.hooks_skipped) {
    EXPECT_THAT(h, ::testing::AnyOf(HasSubstr(" on null:0"), HasSubstr(" on null:1")));
  }
  EXPECT_EQ(to_json(rep).at("hooks_skipped").size(), 2 * layers);
  EXPECT_THAT(rep.summary(), HasSubstr("post-load hooks skipped (their devices keep no data): " +
                                       std::to_string(2 * layers)));
  LoadResult host = load(make_config(ck.dir, {"parallel.tp=2", "parallel.ep=2"}));
  ASSERT_TRUE(host) << host.error->message;
  EXPECT_TRUE(host.model->report().hooks_skipped.empty());
  EXPECT_EQ(host.model->report().bytes_copied, rep.bytes_copied);
}

// A null device whose allocations are 2 bytes short of what was asked, so the last
// piece of every parameter runs past it.
class ShortDevice final : public gpu::DeviceWrapper {
 public:
  explicit ShortDevice(int index) : DeviceWrapper(gpu::make_null_device(index)) {}
  gpu::DeviceAllocation allocate(std::size_t bytes) override {
    gpu::DeviceAllocation a = DeviceWrapper::allocate(bytes > 2 ? bytes - 2 : bytes);
    std::byte* data = a.data();
    auto owner = std::make_shared<gpu::DeviceAllocation>(std::move(a));
    return gpu::DeviceAllocation(data, bytes, [owner](std::byte*, std::size_t) { owner->reset(); });
  }
};

TEST(NullLoad, APiecePastItsParameterNamesTheParameter) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  RuntimeTestSeams hooks;
  auto device = std::make_shared<ShortDevice>(0);
  hooks.devices = {device};
  LoadResult r = load(make_config(ck.dir, {"parallel.tp=1", "devices=null"}), hooks);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error->stage, Stage::kCopy) << r.error->message;
  EXPECT_FALSE(r.error->tensor.empty()) << r.error->message;  // the parameter it was for
  EXPECT_THAT(r.error->message, HasSubstr("null:0"));
  EXPECT_THAT(r.error->message, HasSubstr("not inside a live allocation"));
  EXPECT_TRUE(device->stats().all_released());
}

TEST(NullLoad, DumpsAreRefusedBeforeAnythingIsRead) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  EXPECT_THAT(
      testing::error_of(Stage::kConfig,
                        [&] {
                          make_config(ck.dir, {"devices=null", "load.dump_dir=" + dir.file("d")});
                        }),
      HasSubstr("load.dump_dir: devices null:1 keep no parameter data"));
  testing::RunResult cli = testing::run({FERRY_BINARY, "load", "--model", ck.dir, "--tp", "2",
                                         "--devices", "null", "--dump-dir", dir.file("d")});
  EXPECT_EQ(cli.status, 2) << cli.out;
  EXPECT_THAT(cli.err,
              HasSubstr("--dump-dir: load.dump_dir: devices null:2 keep no parameter data"));
  EXPECT_FALSE(std::filesystem::exists(dir.file("d")));
  testing::RunResult ok =
      testing::run({FERRY_BINARY, "load", "--model", ck.dir, "--tp", "2", "--devices", "null:2"});
  EXPECT_EQ(ok.status, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("tp rank 1 on null:1"));
  testing::RunResult wrong =
      testing::run({FERRY_BINARY, "load", "--model", ck.dir, "--tp", "2", "--devices", "null:3"});
  EXPECT_EQ(wrong.status, 2);
  EXPECT_THAT(wrong.err, HasSubstr("devices null:3 gives 3 devices for 2 local ranks"));
}

}  // namespace
}  // namespace ferry::runtime
