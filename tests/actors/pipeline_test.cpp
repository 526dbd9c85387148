// run_pipeline on a toy model: params that only post-load hooks fill (a chain of
// two hooks), a cast, hook failures, cancellation before the start, and the
// guarantee that nothing of the pipeline is left when it returns.
#include "actors/pipeline.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpu/host_device.hpp"
#include "io/discover.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_writer.hpp"
#include "models/placement.hpp"
#include "models/table_model.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::actors {
namespace {

using testing::TempDir;

// "a": F32 [4, 8] with a[i] = i / 4; "b": BF16 [16] with synth values.
std::string write_toy_checkpoint(const TempDir& dir) {
  const std::string path = dir.file("model.safetensors");
  io::SafetensorsWriter w(path);
  w.add("a", DType::kF32, {4, 8});
  w.add("b", DType::kBF16, {16});
  w.begin();
  std::vector<float> a(32);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i) / 4;
  }
  w.write(std::as_bytes(std::span(a)));
  std::vector<std::byte> b(32);
  synth::synth_encode(DType::kBF16, 1, "b", 0, b);
  w.write(b);
  w.finish();
  return dir.str();
}

struct Toy {
  std::shared_ptr<models::TableModel> model;
  std::vector<std::string> order;  // hooks in the order they ran
  std::mutex mu;
};

// Params a (from "a"), b (F32 from BF16 "b"), a2 = hook "copy" (a), a3 = hook
// "again" (a2). `fail` names a hook that throws instead.
std::unique_ptr<Toy> make_toy(const std::string& fail = "") {
  auto toy = std::make_unique<Toy>();
  models::ParallelLayout layout;
  layout.local_ranks = {0};
  toy->model = std::make_shared<models::TableModel>(
      "toy", "ToyForTest", models::normalize_layout(layout), DType::kF32, false);
  auto& m = *toy->model;
  for (const char* p : {"a", "a2", "a3"}) {
    m.add_param(p, models::Shape{4, 8});
  }
  m.add_param("b", models::Shape{16});
  m.add_target("a", "a", {4, 8}, [](int) { return std::vector{models::replicated(4)}; });
  m.add_target("b", "b", {16}, [](int) { return std::vector{models::replicated(16)}; });
  m.finish();
  const auto& shell = m.shells()[0];
  auto copy_hook = [toy_ptr = toy.get(), fail](std::string name, std::size_t in, std::size_t out) {
    models::PostLoadHook h;
    h.name = name;
    h.inputs = {in};
    h.outputs = {out};
    h.run = [toy_ptr, name, in, out, fail](models::HookContext& ctx) {
      {
        std::lock_guard lock(toy_ptr->mu);
        toy_ptr->order.push_back(name);
      }
      if (name == fail) {
        throw std::runtime_error("hook exploded");
      }
      // Same dtype on both sides: a device-to-device copy.
      ctx.stream().cast(ctx.param_data(out), DType::kF32, ctx.param_data(in), DType::kF32, 32);
    };
    return h;
  };
  // Registered in reverse so that running them in input order is the pipeline's doing.
  m.add_hook(copy_hook("again", shell.by_name.at("a2"), shell.by_name.at("a3")));
  m.add_hook(copy_hook("copy", shell.by_name.at("a"), shell.by_name.at("a2")));
  return toy;
}

struct ToyRun {
  io::CheckpointIndex index;
  Plan plan;
  std::shared_ptr<gpu::Device> device;
  std::vector<gpu::DeviceAllocation> storage;
  PipelineResult result;
};

void run_toy(ToyRun& run, const std::string& dir, const models::Model& model,
             const std::atomic<bool>* cancel = nullptr,
             std::function<std::unique_ptr<io::Reader>(std::unique_ptr<io::Reader>)> wrap = {},
             const std::function<void(PipelineOptions&)>& tweak = {}) {
  run.index = io::build_checkpoint_index(io::resolve_source(dir));
  run.plan = make_plan(run.index, model, {4096, false});
  gpu::HostDeviceOptions o;
  o.poison_allocations = true;
  run.device = gpu::make_host_device(0, o);
  PipelineInput in;
  in.index = &run.index;
  in.model = &model;
  in.plan = &run.plan;
  in.ranks.resize(1);
  in.ranks[0].device = run.device;
  for (const auto& p : model.shells()[0].params) {
    run.storage.push_back(run.device->allocate(p.nbytes));
    in.ranks[0].params.push_back(run.storage.back().data());
  }
  in.options.io.chunk_bytes = 4096;
  in.options.io.staging_bytes = 2 * 4096;
  in.options.io.read_lanes = 1;
  in.options.io.queue_depth = 16;
  in.cancel = cancel;
  in.wrap_reader = std::move(wrap);
  if (tweak) {
    tweak(in.options);
  }
  run.result = run_pipeline(in);
}

// A reader whose poll() always throws once a read is in flight: the reader fails
// mid-load, and its teardown cannot reap the reads either.
class ThrowingPollReader final : public io::Reader {
 public:
  explicit ThrowingPollReader(std::unique_ptr<io::Reader> inner) : inner_(std::move(inner)) {}
  void submit(const io::ReadOp& op) override { inner_->submit(op); }
  std::size_t poll(std::vector<io::Completion>&, std::chrono::milliseconds) override {
    throw std::runtime_error("poll exploded");
  }
  std::size_t outstanding() const override { return inner_->outstanding(); }
  const io::ReaderStats& stats() const override { return inner_->stats(); }
  std::string name() const override { return "throwing(" + inner_->name() + ")"; }

 private:
  std::unique_ptr<io::Reader> inner_;
};

std::vector<float> read_f32(ToyRun& run, std::size_t param) {
  std::vector<float> out(run.storage[param].size() / 4);
  auto s = run.device->create_stream();
  s->copy_d2h(reinterpret_cast<std::byte*>(out.data()), run.storage[param].data(),
              run.storage[param].size());
  s->synchronize();
  return out;
}

TEST(Pipeline, HooksFillTheirOutputsInDependencyOrder) {
  TempDir dir;
  std::string ck = write_toy_checkpoint(dir);
  auto toy = make_toy();
  ToyRun run;
  run_toy(run, ck, *toy->model);
  ASSERT_FALSE(run.result.error) << run.result.error->what();
  EXPECT_EQ(toy->order, (std::vector<std::string>{"copy", "again"}));
  const auto& shell = toy->model->shells()[0];
  std::vector<float> a = read_f32(run, shell.by_name.at("a"));
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i], static_cast<float>(i) / 4);
  }
  EXPECT_EQ(read_f32(run, shell.by_name.at("a2")), a);
  EXPECT_EQ(read_f32(run, shell.by_name.at("a3")), a);
  std::vector<float> b = read_f32(run, shell.by_name.at("b"));
  for (std::size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(b[i], synth::synth_value(1, "b", i)) << i;
  }
  ASSERT_EQ(run.result.landed.size(), 1u);
  for (std::size_t p = 0; p < shell.params.size(); ++p) {
    EXPECT_EQ(run.result.landed[0][p], shell.params[p].nbytes) << shell.params[p].name;
  }
  EXPECT_EQ(run.result.bytes_copied, 32u * 4 + 16u * 4);  // a, and b as F32
  EXPECT_EQ(run.result.staging_buffers_leased_at_end, 0u);
  // Only the params remain: streams, events and the cast scratch are gone.
  gpu::AllocationStats s = run.device->stats();
  EXPECT_EQ(s.device.live_count, 4u);
  EXPECT_EQ(s.live_streams, 0u);
  EXPECT_EQ(s.live_events, 0u);
  EXPECT_EQ(s.device.total_count, 5u);  // the four params and one cast scratch
}

// A reader whose every poll throws: the load fails with that error, and the
// reader's teardown, which cannot reap its reads either, logs and leaks their
// buffers instead of throwing out of a destructor (std::terminate: the engine dies).
TEST(Pipeline, AReaderThatCannotReapItsReadsFailsTheLoadWithoutTerminating) {
  TempDir dir;
  std::string ck = write_toy_checkpoint(dir);
  auto toy = make_toy();
  ToyRun run;
  run_toy(run, ck, *toy->model, nullptr, [](std::unique_ptr<io::Reader> inner) {
    return std::make_unique<ThrowingPollReader>(std::move(inner));
  });
  ASSERT_TRUE(run.result.error.has_value());
  EXPECT_NE(std::string(run.result.error->what()).find("poll exploded"), std::string::npos)
      << run.result.error->what();
}

// A reader that counts its submissions and cancels the load at the first one.
class CancelAtFirstSubmit final : public io::Reader {
 public:
  CancelAtFirstSubmit(std::unique_ptr<io::Reader> inner, std::atomic<bool>& cancel,
                      std::atomic<int>& submits)
      : inner_(std::move(inner)), cancel_(cancel), submits_(submits) {}
  void submit(const io::ReadOp& op) override {
    ++submits_;
    cancel_ = true;
    inner_->submit(op);
  }
  std::size_t poll(std::vector<io::Completion>& out, std::chrono::milliseconds wait) override {
    return inner_->poll(out, wait);
  }
  std::size_t outstanding() const override { return inner_->outstanding(); }
  const io::ReaderStats& stats() const override { return inner_->stats(); }
  std::string name() const override { return inner_->name(); }

 private:
  std::unique_ptr<io::Reader> inner_;
  std::atomic<bool>& cancel_;
  std::atomic<int>& submits_;
};

// Once the load is cancelled (or has failed) the reader issues no new read, not
// even to fill its queue: here 64 windows, 16 buffers and a queue of 16, and the
// cancel comes with the first read.
TEST(Pipeline, NoReadIsIssuedAfterTheLoadStops) {
  TempDir dir;
  {
    io::SafetensorsWriter w(dir.file("model.safetensors"));
    w.add("big", DType::kF32, {64, 1024});
    w.begin();
    std::vector<float> v(64 * 1024, 1.0f);
    w.write(std::as_bytes(std::span(v)));
    w.finish();
  }
  models::ParallelLayout layout;
  layout.local_ranks = {0};
  models::TableModel model("big", "BigForTest", models::normalize_layout(layout), DType::kF32,
                           false);
  model.add_param("big", models::Shape{64, 1024});
  model.add_target("big", "big", {64, 1024},
                   [](int) { return std::vector{models::replicated(64)}; });
  model.finish();
  io::CheckpointIndex index = io::build_checkpoint_index(io::resolve_source(dir.str()));
  Plan plan = make_plan(index, model, {4096, false});
  auto device = gpu::make_host_device(0);
  gpu::DeviceAllocation param = device->allocate(64 * 1024 * 4);
  std::atomic<bool> cancel{false};
  std::atomic<int> submits{0};
  PipelineInput in;
  in.index = &index;
  in.model = &model;
  in.plan = &plan;
  in.ranks.resize(1);
  in.ranks[0].device = device;
  in.ranks[0].params.push_back(param.data());
  in.options.io.chunk_bytes = 4096;
  in.options.io.staging_bytes = 16 * 4096;
  in.options.io.queue_depth = 16;
  in.options.io.read_lanes = 1;
  in.options.io.direct_to_device = io::DirectToDevice::kOff;
  in.cancel = &cancel;
  in.wrap_reader = [&](std::unique_ptr<io::Reader> inner) {
    return std::make_unique<CancelAtFirstSubmit>(std::move(inner), cancel, submits);
  };
  PipelineResult r = run_pipeline(in);
  ASSERT_TRUE(r.error.has_value());
  EXPECT_EQ(r.error->stage(), Stage::kCancelled) << r.error->what();
  EXPECT_EQ(submits.load(), 1);
}

// read_lanes 0: on host devices at most one lane per file read; where the devices'
// link wants more (runtime::io_auto on GPUs), lanes split one file's spans too.
TEST(Pipeline, AutoLanesFollowTheFilesOnlyWhereAsked) {
  TempDir dir;
  const std::string ck = write_toy_checkpoint(dir);  // one file, two tensors
  auto toy = make_toy();
  const std::size_t cores = std::max(1u, std::thread::hardware_concurrency());
  for (bool follow : {true, false}) {
    ToyRun run;
    run_toy(run, ck, *toy->model, nullptr, {}, [follow](PipelineOptions& o) {
      o.io.read_lanes = 0;
      o.io.staging_bytes = 8 * 4096;
      o.max_auto_lanes = 8;
      o.lanes_follow_files = follow;
    });
    ASSERT_FALSE(run.result.error) << run.result.error->what();
    EXPECT_EQ(run.result.read_lanes, follow ? 1u : std::min<std::size_t>(cores, 2))
        << "lanes_follow_files " << follow;  // two spans: two lanes at most
    EXPECT_EQ(read_f32(run, 0)[5], 1.25f);
  }
}

TEST(Pipeline, AFailingHookAbortsWithItsName) {
  TempDir dir;
  std::string ck = write_toy_checkpoint(dir);
  auto toy = make_toy("copy");
  ToyRun run;
  run_toy(run, ck, *toy->model);
  ASSERT_TRUE(run.result.error);
  EXPECT_EQ(run.result.error->stage(), Stage::kPostProcess);
  EXPECT_NE(std::string(run.result.error->what()).find("'copy'"), std::string::npos)
      << run.result.error->what();
  EXPECT_NE(std::string(run.result.error->what()).find("hook exploded"), std::string::npos);
  EXPECT_EQ(toy->order, std::vector<std::string>{"copy"});  // "again" never ran
  run.storage.clear();
  EXPECT_TRUE(run.device->stats().all_released());
}

TEST(Pipeline, CancelledBeforeTheStartStopsAtOnce) {
  TempDir dir;
  std::string ck = write_toy_checkpoint(dir);
  auto toy = make_toy();
  std::atomic<bool> cancel{true};
  ToyRun run;
  run_toy(run, ck, *toy->model, &cancel);
  ASSERT_TRUE(run.result.error);
  EXPECT_EQ(run.result.error->stage(), Stage::kCancelled);
  EXPECT_TRUE(toy->order.empty());
  run.storage.clear();
  EXPECT_TRUE(run.device->stats().all_released());
}

TEST(Pipeline, MissingInputsAreRejected) {
  PipelineInput in;
  PipelineResult r = run_pipeline(in);
  ASSERT_TRUE(r.error);
  EXPECT_NE(std::string(r.error->what()).find("run_pipeline needs"), std::string::npos);
}

}  // namespace
}  // namespace ferry::actors
