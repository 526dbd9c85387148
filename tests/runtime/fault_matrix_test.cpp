// The fault matrix (issue 17 §3): one injected fault per row, at every stage of a
// load on the host backend, each through the code path that meets it in
// production (a file gone at open, a header cut short, a read that fails, a
// device that refuses memory or a copy, a hook or a callback that throws, a
// cancel in each phase). docs/FAULTS.md lists the rows and this file's test names.
//
// Every row checks the same things afterwards: the load ended in one error that
// names the stage (and the file and tensor where the fault has them); every device
// allocation, stream and event came back; every staging buffer went back to its
// allocator; no file descriptor and no thread is left over; and the same Runtime
// then loads the checkpoint correctly (compared element by element with the
// synthesized values).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/thread_start.hpp"
#include "gpu/host_device.hpp"
#include "io/fault_injection.hpp"
#include "io/reader.hpp"
#include "io/staging_pool.hpp"
#include "models/hooks.hpp"
#include "models/model.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/faulty_device.hpp"
#include "testing/process_census.hpp"
#include "testing/temp_dir.hpp"
#include "testing/with_hooks.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::FaultyDevice;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

constexpr int kTp = 2;
constexpr std::chrono::milliseconds kThreadsSettle{3000};
const std::string kShard2 = "model-00002-of-00004.safetensors";

// Staging memory that counts its live buffers and can refuse the n-th one.
using StagingCounter = testing::CountingAllocator;

// Forwards to a model and calls `on_hooks` whenever hooks() is asked for (from
// whichever thread asks).
class ObservedModel final : public models::Model {
 public:
  ObservedModel(std::shared_ptr<const models::Model> base, std::function<void()> on_hooks)
      : base_(std::move(base)), on_hooks_(std::move(on_hooks)) {}
  std::string family() const override { return base_->family(); }
  const models::ParallelLayout& layout() const override { return base_->layout(); }
  const std::vector<models::RankShell>& shells() const override { return base_->shells(); }
  models::Route route(const io::TensorInfo& tensor) const override { return base_->route(tensor); }
  std::vector<models::Piece> fill_pieces() const override { return base_->fill_pieces(); }
  std::vector<models::PostLoadHook> hooks() const override {
    on_hooks_();
    return base_->hooks();
  }
  std::vector<std::string> notes() const override { return base_->notes(); }

 private:
  std::shared_ptr<const models::Model> base_;
  std::function<void()> on_hooks_;
};

// Forwards to a real reader but never reports the completion of its `hang_at`-th
// read (1-based): a read stuck in the kernel, as a hung file system leaves one.
// cancel() gives up on it after its bound, as the io_uring reader does when the
// kernel does not answer its cancel.
class HangingReader final : public io::Reader {
 public:
  HangingReader(std::unique_ptr<io::Reader> inner, int hang_at, std::atomic<bool>& hung)
      : inner_(std::move(inner)), hang_at_(hang_at), hung_(hung) {}
  void submit(const io::ReadOp& op) override {
    if (++submitted_ == hang_at_) {
      stuck_tag_ = op.tag;
    }
    inner_->submit(op);
  }
  std::size_t poll(std::vector<io::Completion>& out, std::chrono::milliseconds wait) override {
    std::vector<io::Completion> got;
    inner_->poll(got, wait);
    std::size_t n = 0;
    for (io::Completion& c : got) {
      if (stuck_tag_ && c.tag == *stuck_tag_) {
        swallowed_ = true;  // never reported: stuck
        hung_.store(true);
        continue;
      }
      out.push_back(std::move(c));
      ++n;
    }
    return n;
  }
  std::size_t outstanding() const override { return inner_->outstanding() + (swallowed_ ? 1 : 0); }
  const io::ReaderStats& stats() const override { return inner_->stats(); }
  std::string name() const override { return "hanging"; }
  bool cancel(std::chrono::milliseconds bound) noexcept override {
    const bool inner_done = inner_->cancel(bound);
    if (swallowed_) {
      std::this_thread::sleep_for(bound);  // the kernel never answers
      return false;
    }
    return inner_done;
  }

 private:
  std::unique_ptr<io::Reader> inner_;
  int hang_at_;
  std::atomic<bool>& hung_;
  int submitted_ = 0;
  std::optional<std::uint64_t> stuck_tag_;
  bool swallowed_ = false;
};

// One row's fault, armed before the Runtime exists; `armed` turns every fault off
// for the load that must succeed afterwards.
struct Context {
  explicit Context(const Checkpoint& checkpoint) : ck(checkpoint) {}
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  const Checkpoint& ck;
  std::vector<std::string> sets;  // config assignments of the row
  RuntimeTestSeams hooks;
  LoadCallbacks callbacks;
  std::atomic<bool> armed{true};
  // Undoes damage to the checkpoint before the load that must succeed.
  std::function<void()> restore;
  // Replaces the model at plan time while armed (the plan phase runs it).
  std::function<std::shared_ptr<const models::Model>(std::shared_ptr<const models::Model>)> wrap;
  // Called before each operation of local rank `rank`'s device while armed.
  std::function<void(std::size_t rank, std::string_view op)> device_fault;

  std::shared_ptr<StagingCounter> staging = std::make_shared<StagingCounter>();
  std::vector<std::shared_ptr<gpu::Device>> inner;  // the host devices, for their stats
  std::thread::id loading_thread;                   // where wrap_model ran
  std::atomic<int> copies{0};                       // before_copy calls
  std::atomic<int> wraps{0};                        // wrap_model calls while armed
  std::atomic<bool> hung{false};                    // a HangingReader withheld its read
  std::atomic<Runtime*> runtime{nullptr};
  std::atomic<const LoadHandle*> handle{nullptr};
  std::optional<LoadPhase> phase_at_cancel;
  std::thread helper;  // a row's own thread (joined after the load)
  bool deferred_copies = false;  // the host devices run copies on a thread per stream

  // Cancels the running load from inside it, noting the phase it was in.
  void cancel_here() {
    for (int i = 0; i < 5000 && handle.load() == nullptr; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (handle.load() != nullptr && !phase_at_cancel) {
      phase_at_cancel = handle.load()->progress().phase;
    }
    runtime.load()->cancel();
  }

  // Installs the devices, staging allocator and test hooks the rows share.
  void finish_arming() {
    for (std::size_t r = 0; r < kTp; ++r) {
      gpu::HostDeviceOptions o;
      o.poison_allocations = true;
      o.deferred_copies = deferred_copies;
      inner.push_back(gpu::make_host_device(static_cast<int>(r), o));
      hooks.devices.push_back(
          std::make_shared<FaultyDevice>(inner.back(), [this, r](std::string_view op) {
            if (armed.load() && device_fault) {
              device_fault(r, op);
            }
          }));
    }
    hooks.staging_allocator = staging;
    std::function<void(std::size_t, const std::string&)> row_copy = hooks.before_copy;
    hooks.before_copy = [this, row_copy](std::size_t rank, const std::string& param) {
      ++copies;
      if (armed.load() && row_copy) {
        row_copy(rank, param);
      }
    };
    hooks.wrap_model = [this](std::shared_ptr<const models::Model> m) {
      loading_thread = std::this_thread::get_id();
      if (!armed.load() || !wrap) {
        return m;
      }
      ++wraps;
      return wrap(std::move(m));
    };
  }

  void disarm() {
    armed.store(false);
    clear_thread_start_failure();
    if (hooks.faults) {
      hooks.faults->set_plan(io::FaultPlan{});
    }
    if (staging) {
      staging->fail_at.store(0);
    }
    if (helper.joinable()) {
      helper.join();
    }
    if (restore) {
      restore();
    }
  }
};

// What a failed cell must report.
enum class Names { kFileAndTensor, kFile, kNothing };

struct Row {
  std::string name;
  std::function<void(Context&)> arm;
  Stage stage = Stage::kRead;
  std::string in_message;  // the error's message holds this
  Names names = Names::kNothing;
  std::string in_file;                    // the error's file holds this (kFile*)
  std::optional<LoadPhase> cancel_phase;  // a cancel row: the phase it cancelled in
  std::function<void(Context&)> extra;    // further checks on what the row saw
  // Staging buffers the error reports as left to reads that never completed: the
  // staging allocator stays short by exactly these for the life of the process.
  int leaked_staging = 0;
};

// gtest prints a row by its name (not its bytes).
void PrintTo(const Row& row, std::ostream* os) {
  *os << row.name;
}

Row make_row(std::string name, std::function<void(Context&)> arm, Stage stage,
             std::string in_message, Names names, std::string in_file = "",
             std::optional<LoadPhase> cancel_phase = std::nullopt,
             std::function<void(Context&)> extra = {}) {
  return Row{std::move(name), std::move(arm),     stage,        std::move(in_message),
             names,           std::move(in_file), cancel_phase, std::move(extra)};
}

// A post-load hook on local rank 0 that waits for `input` and runs `run`.
std::function<std::shared_ptr<const models::Model>(std::shared_ptr<const models::Model>)> add_hook(
    const std::string& input, std::function<void()> run, std::vector<std::string> outputs = {}) {
  return [input, run, outputs](std::shared_ptr<const models::Model> base) {
    const models::RankShell& shell = base->shells()[0];
    models::PostLoadHook hook;
    hook.name = "fault-hook";
    hook.local_rank = 0;
    hook.inputs = {shell.by_name.at(input)};
    for (const std::string& out : outputs) {
      hook.outputs.push_back(shell.by_name.at(out));
    }
    hook.run = [run](models::HookContext&) { run(); };
    return std::shared_ptr<const models::Model>(ferry::testing::with_hooks(base, {std::move(hook)}));
  };
}

const std::string kQkv0 = "model.layers.0.self_attn.qkv_proj.weight";

// A thread a load starts (its name in common/thread_start.hpp's seam) and the
// settings that make the load start it.
struct ThreadRow {
  std::string row;     // the test's name
  std::string thread;  // the start that fails
  std::vector<std::string> sets;
  bool deferred_copies = false;
  bool callbacks = false;
  Names names = Names::kNothing;
  std::string in_file;
};

// Two read lanes, prefetch on, callbacks and deferred copies where a row needs
// them: the second of two (lanes, ranks, workers) fails with the first running.
ThreadRow thread_row(std::string row, std::string thread, std::vector<std::string> sets = {}) {
  ThreadRow t;
  t.row = std::move(row);
  t.thread = std::move(thread);
  t.sets = std::move(sets);
  return t;
}

std::vector<ThreadRow> thread_rows() {
  const std::vector<std::string> lanes = {"io.read_lanes=2", "io.direct_to_device=off"};
  std::vector<ThreadRow> out = {
      thread_row("Load", "load"),
      thread_row("Callbacks", "callbacks"),
      thread_row("AllocationRank1", "allocation rank 1"),
      thread_row("SchedulerWorker0", "scheduler worker 0"),
      thread_row("SchedulerWorker1", "scheduler worker 1"),
      thread_row("SchedulerClock", "scheduler clock"),
      thread_row("CopyWorkerRank0", "copy worker rank 0"),
      thread_row("CopyWorkerRank1", "copy worker rank 1"),
      thread_row("Prefetcher", "prefetcher", {"prefetch.enabled=true"}),
      thread_row("ReaderLane0", "reader lane 0", lanes),
      thread_row("ReaderLane1", "reader lane 1", lanes),
  };
  out[1].callbacks = true;
  // The host device's copy thread is made with the copy worker's stream: the
  // error names the device and what the stream was for.
  ThreadRow queue = thread_row("HostDeviceQueue", "host device queue");
  queue.deferred_copies = true;
  queue.names = Names::kFile;
  queue.in_file = "host:";
  out.push_back(std::move(queue));
  return out;
}

// Cuts shard 2 to `bytes` bytes before the load; restores it for the next.
void arm_truncated_shard(Context& c, std::uint64_t bytes) {
  const std::string path = c.ck.dir + "/" + kShard2;
  auto original = std::make_shared<std::string>(testing::read_file(path));
  std::filesystem::resize_file(path, bytes);
  c.restore = [path, original] { testing::write_file(path, *original); };
}

void arm_read_faults(Context& c, const io::FaultPlan& plan, const char* engine, const char* lanes) {
  c.hooks.faults = std::make_shared<io::FaultInjector>(plan);
  c.sets = {std::string("io.engine=") + engine, std::string("io.read_lanes=") + lanes};
}

std::vector<Row> rows() {
  std::vector<Row> out;

  // ---- files and headers
  out.push_back(make_row(
      "OpenFailsAtResolve",
      [](Context& c) {
        const std::string path = c.ck.dir + "/" + kShard2;
        std::filesystem::rename(path, path + ".away");
        c.restore = [path] { std::filesystem::rename(path + ".away", path); };
      },
      Stage::kDiscovery, kShard2, Names::kFile, "ck"));
  out.push_back(make_row(
      "HeaderCutShort", [](Context& c) { arm_truncated_shard(c, 20); }, Stage::kHeader, "",
      Names::kFile, kShard2));
  out.push_back(make_row(
      "DataShorterThanHeader",
      [](Context& c) {
        const auto size = std::filesystem::file_size(c.ck.dir + "/" + kShard2);
        arm_truncated_shard(c, size - 100);
      },
      Stage::kHeader, "", Names::kFile, kShard2));

  // ---- reads: EIO on the third system read, persistent EAGAIN
  for (const char* engine : {"uring", "pread"}) {
    for (const char* lanes : {"1", "2"}) {
      out.push_back(make_row(
          std::string("EioMidRead_") + engine + "_" + lanes + "lanes",
          [engine, lanes](Context& c) {
            io::FaultPlan plan;
            plan.fail_read_number = 3;
            arm_read_faults(c, plan, engine, lanes);
          },
          Stage::kRead, "", Names::kFileAndTensor, ".safetensors", std::nullopt,
          [](Context& c) { EXPECT_EQ(c.hooks.faults->faults_injected(), 1u); }));
    }
    out.push_back(make_row(
        std::string("PersistentEagain_") + engine,
        [engine](Context& c) {
          io::FaultPlan plan;
          plan.eagain_probability = 1.0;
          arm_read_faults(c, plan, engine, "1");
        },
        Stage::kRead, "retries without progress", Names::kFileAndTensor, ".safetensors"));
  }

  // ---- staging and devices
  out.push_back(make_row(
      "StagingAllocationFails", [](Context& c) { c.staging->fail_at.store(2); }, Stage::kStaging,
      "", Names::kNothing));
  out.push_back(make_row(
      "DeviceOutOfMemory",
      [](Context& c) {
        // Rank 1's arena is refused, then its third param: what rank 0 and the
        // first params got must come back.
        auto n = std::make_shared<std::atomic<int>>(0);
        c.device_fault = [n](std::size_t rank, std::string_view op) {
          if (rank == 1 && op == "allocate" && (++*n == 1 || *n == 3)) {
            throw Error(Stage::kCopy, "host:1", "", "out of memory (injected)");
          }
        };
      },
      Stage::kCopy, "out of memory (injected)", Names::kFile, "host:1", std::nullopt,
      [](Context& c) {
        EXPECT_GT(c.inner[0]->stats().device.total_count, 0u);
        EXPECT_GT(c.inner[1]->stats().device.total_count, 0u);
      }));
  out.push_back(make_row(
      "DeviceCopyFails",
      [](Context& c) {
        auto n = std::make_shared<std::atomic<int>>(0);
        c.device_fault = [n](std::size_t, std::string_view op) {
          if (op.substr(0, 8) == "copy_h2d" && ++*n == 5) {
            throw std::runtime_error("injected copy failure");
          }
        };
      },
      Stage::kCopy, "injected copy failure", Names::kFileAndTensor, ".safetensors", std::nullopt,
      [](Context&) {}));
  out.push_back(make_row(
      "BeforeCopyThrows",
      [](Context& c) {
        c.hooks.before_copy = [&c](std::size_t, const std::string&) {
          if (c.copies.load() == 5) {
            throw std::runtime_error("injected copy failure");
          }
        };
      },
      Stage::kCopy, "into parameter ", Names::kFileAndTensor, ".safetensors"));
  out.push_back(make_row(
      "HookFails",
      [](Context& c) {
        c.wrap = add_hook(kQkv0, [] { throw std::runtime_error("injected hook failure"); });
      },
      Stage::kPostProcess, "post-load hook 'fault-hook' failed: injected hook failure",
      Names::kFile, "host:0"));

  // ---- an exception inside each actor
  out.push_back(make_row(
      "ExceptionInReaderLane",
      [](Context& c) {
        // Single-copy reads ask the device, on the reader's thread, whether
        // its memory takes reads: the device throws there.
        c.sets = {"io.direct_to_device=on"};
        c.device_fault = [&c](std::size_t, std::string_view op) {
          if (op == "host_addressable" && std::this_thread::get_id() != c.loading_thread) {
            throw std::runtime_error("injected fault in the reader lane");
          }
        };
      },
      Stage::kRead, "reader: injected fault in the reader lane", Names::kNothing));
  out.push_back(make_row(
      "ExceptionInCopyWorker",
      [](Context& c) {
        c.device_fault = [](std::size_t rank, std::string_view op) {
          if (rank == 1 && op == "create_stream") {
            throw std::runtime_error("injected: no stream");
          }
        };
      },
      // The stream is made before streaming (actors::prepare_resources), for the
      // copy worker: the error names the device and what it was for.
      Stage::kCopy, "creating the copy worker's stream: injected: no stream", Names::kFile,
      "host:1"));
  out.push_back(make_row(
      "ExceptionInCopyWorkerWithChunksParked",
      [](Context& c) {
        auto n = std::make_shared<std::atomic<int>>(0);
        c.device_fault = [n](std::size_t rank, std::string_view op) {
          if (rank == 0 && op == "record" && ++*n == 3) {
            throw std::runtime_error("injected: record failed");
          }
        };
      },
      Stage::kCopy, "copy worker: injected: record failed", Names::kFile, "host:0"));
  for (const char* actor : {"post-processor", "coordinator"}) {
    // The actors without a seam of their own throw from PipelineInput::fault_point,
    // at their third message.
    const std::string what = std::string("injected fault in the ") + actor;
    out.push_back(make_row(
        actor == std::string("coordinator") ? "ExceptionInCoordinator" : "ExceptionInPostProcessor",
        [actor, what](Context& c) {
          auto n = std::make_shared<std::atomic<int>>(0);
          c.hooks.fault_point = [&c, actor, what, n](std::string_view who) {
            if (c.armed.load() && who == actor && ++*n == 3) {
              throw std::runtime_error(what);
            }
          };
        },
        actor == std::string("coordinator") ? Stage::kCopy : Stage::kPostProcess,
        std::string(actor) + ": " + what, Names::kNothing));
  }

  // ---- a read that never completes: the cancel gives it up after
  // io.cancel_timeout_ms and leaves its staging buffer to it, and says so
  {
    Row hang = make_row(
        "ReadNeverCompletes",
        [](Context& c) {
          c.sets = {"io.direct_to_device=off", "io.read_lanes=1", "io.cancel_timeout_ms=50"};
          c.hooks.wrap_reader =
              [&c](std::unique_ptr<io::Reader> inner) -> std::unique_ptr<io::Reader> {
            if (!c.armed.load()) {
              return inner;
            }
            return std::make_unique<HangingReader>(std::move(inner), 2, c.hung);
          };
          c.helper = std::thread([&c] {
            for (int i = 0; i < 10000 && !c.hung.load(); ++i) {
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            c.cancel_here();
          });
        },
        Stage::kCancelled,
        "1 staging buffer(s) left to reads still in flight after io.cancel_timeout_ms",
        Names::kNothing, "", LoadPhase::kStream,
        [](Context& c) { EXPECT_TRUE(c.hung.load()) << "the read was never withheld"; });
    hang.leaked_staging = 1;
    out.push_back(std::move(hang));
  }

  // ---- cancel in each phase
  out.push_back(make_row(
      "CancelDuringResolve",
      [](Context& c) {
        // (This row once made config.json a FIFO that blocked resolve; such a file is
        // refused at once now, hardening round two.)
        c.hooks.in_resolve = [&c] {
          if (c.armed.load()) {
            c.cancel_here();
          }
        };
      },
      Stage::kCancelled, "cancelled", Names::kNothing, "", LoadPhase::kResolve,
      [](Context& c) { EXPECT_EQ(c.wraps.load(), 0) << "the plan must not start"; }));
  out.push_back(make_row(
      "CancelDuringPlan",
      [](Context& c) {
        c.wrap = [&c](std::shared_ptr<const models::Model> m) {
          c.cancel_here();
          return m;
        };
      },
      Stage::kCancelled, "cancelled", Names::kNothing, "", LoadPhase::kPlan,
      [](Context& c) {
        for (const auto& d : c.inner) {
          EXPECT_EQ(d->stats().device.total_count, 0u) << "nothing is allocated";
        }
      }));
  out.push_back(make_row(
      "CancelDuringAllocate",
      [](Context& c) {
        c.device_fault = [&c](std::size_t rank, std::string_view op) {
          if (rank == 0 && op == "allocate") {
            c.cancel_here();
          }
        };
      },
      Stage::kCancelled, "cancelled", Names::kNothing, "", LoadPhase::kAllocate,
      [](Context& c) { EXPECT_EQ(c.copies.load(), 0) << "nothing is streamed"; }));
  out.push_back(make_row(
      "CancelDuringStream",
      [](Context& c) {
        c.hooks.before_copy = [&c](std::size_t, const std::string&) {
          if (c.copies.load() == 5) {
            c.cancel_here();
          }
        };
      },
      Stage::kCancelled, "cancelled", Names::kNothing, "", LoadPhase::kStream));
  out.push_back(make_row(
      "CancelDuringPostProcess",
      [](Context& c) {
        // LoadPhase has no post-process phase: hooks run while it says stream.
        c.wrap = add_hook(kQkv0, [&c] { c.cancel_here(); });
      },
      Stage::kCancelled, "cancelled", Names::kNothing, "", LoadPhase::kStream));
  out.push_back(make_row(
      "CancelDuringVerify",
      [](Context& c) {
        // Verify (on the loading thread, after the pipeline) lists the
        // model's hooks: the first such call once copies ran cancels.
        c.wrap = [&c](std::shared_ptr<const models::Model> m) {
          return std::make_shared<ObservedModel>(std::move(m), [&c] {
            if (std::this_thread::get_id() == c.loading_thread && c.copies.load() > 0 &&
                c.armed.load()) {
              c.cancel_here();
            }
          });
        };
      },
      Stage::kCancelled, "cancelled", Names::kNothing, "", LoadPhase::kVerify));

  // ---- callbacks that throw
  out.push_back(make_row(
      "ProgressCallbackThrows",
      [](Context& c) {
        c.callbacks.on_progress = [&c](const LoadProgress&) -> bool {
          if (c.armed.load()) {
            throw std::runtime_error("injected progress failure");
          }
          return true;
        };
      },
      Stage::kCancelled, "on_progress threw: injected progress failure", Names::kNothing));
  out.push_back(make_row(
      "LayerReadyCallbackThrows",
      [](Context& c) {
        c.callbacks.on_layer_ready = [&c](std::uint64_t layer, int) {
          if (c.armed.load() && layer == 1) {
            throw std::runtime_error("injected layer failure");
          }
        };
      },
      Stage::kCancelled, "on_layer_ready threw: injected layer failure", Names::kNothing));

  // ---- a thread the system refuses (common/thread_start.hpp's seam fails the named
  // start as pthread_create does, EAGAIN), one row per thread a load starts:
  // FaultMatrixThreads.EveryThreadOfALoadHasARow checks the list is complete
  for (const ThreadRow& t : thread_rows()) {
    out.push_back(make_row(
        "ThreadStartFails_" + t.row,
        [t](Context& c) {
          c.sets = t.sets;
          c.deferred_copies = t.deferred_copies;
          if (t.callbacks) {
            c.callbacks.on_progress = [](const LoadProgress&) { return true; };
          }
          inject_thread_start_failure(t.thread);
        },
        Stage::kResources, "could not start thread " + t.thread, t.names, t.in_file, std::nullopt,
        [](Context&) {
          EXPECT_FALSE(thread_start_failure_pending()) << "the thread was never started";
        }));
  }
  return out;
}

class FaultMatrix : public ::testing::TestWithParam<Row> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    ck_ = new Checkpoint(synth_checkpoint(dir_->file("ck"), "llama"));
    // A first load, so that what a process sets up once (the io_uring probe, CAF's
    // type registry) is not counted against the first row.
    Runtime rt(to_config(config({})));
    ASSERT_TRUE(rt.load());
  }
  static void TearDownTestSuite() {
    delete ck_;
    delete dir_;
  }
  static LoadConfig config(const std::vector<std::string>& extra) {
    std::vector<std::string> sets = {"parallel.tp=" + std::to_string(kTp), "io.chunk_bytes=16KiB"};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return make_config(ck_->dir, sets);
  }

  static void expect_released(const Context& c, int leaked_staging = 0) {
    for (const auto& d : c.inner) {
      gpu::AllocationStats s = d->stats();
      EXPECT_TRUE(s.all_released())
          << d->name() << ": " << s.device.live_count << " allocations, " << s.live_streams
          << " streams, " << s.live_events << " events live";
    }
    EXPECT_EQ(c.staging->live(), leaked_staging)
        << "staging buffers not returned to the allocator (or not the ones the error reports)";
  }

  static TempDir* dir_;
  static Checkpoint* ck_;
};
TempDir* FaultMatrix::dir_ = nullptr;
Checkpoint* FaultMatrix::ck_ = nullptr;

TEST_P(FaultMatrix, EndsInOneCleanErrorAndLeavesNothingBehind) {
  const Row& row = GetParam();
  const std::size_t fds = testing::open_fds();
  const std::size_t threads = testing::settled_threads();
  Context c(*ck_);
  row.arm(c);
  c.finish_arming();
  {
    Runtime rt = make_runtime(to_config(config(c.sets)), c.hooks);
    c.runtime = &rt;
    LoadResult r;
    {
      LoadHandle handle = rt.start(c.callbacks);
      c.handle = &handle;
      r = handle.wait();
      c.handle = nullptr;
    }
    c.disarm();  // joins the row's helper thread before anything is counted
    ASSERT_FALSE(r) << "the fault did not fail the load";
    ASSERT_TRUE(r.error.has_value());
    const ErrorInfo& e = *r.error;
    EXPECT_EQ(e.stage, row.stage) << e.message;
    EXPECT_NE(e.message.find(row.in_message), std::string::npos) << e.message;
    EXPECT_NE(e.message.find(e.rule), std::string::npos) << e.message;
    // One error, not one wrapped in another: its stage is named once.
    const std::string prefix = std::string(to_string(e.stage)) + ": ";
    EXPECT_EQ(e.message.find(prefix), 0u) << e.message;
    EXPECT_EQ(e.message.find(prefix, 1), std::string::npos) << e.message;
    if (row.names != Names::kNothing) {
      EXPECT_FALSE(e.file.empty()) << e.message;
      EXPECT_NE(e.file.find(row.in_file), std::string::npos) << e.message;
    }
    if (row.names == Names::kFileAndTensor) {
      EXPECT_TRUE(ck_->shapes.count(e.tensor)) << "tensor '" << e.tensor << "': " << e.message;
    }
    if (row.cancel_phase) {
      ASSERT_TRUE(c.phase_at_cancel.has_value()) << "the cancel never ran";
      EXPECT_EQ(to_string(*c.phase_at_cancel), to_string(*row.cancel_phase));
    }
    if (row.extra) {
      row.extra(c);
    }
    EXPECT_EQ(rt.state(), RuntimeState::kFailed);

    // Nothing of the failed load is left.
    expect_released(c, row.leaked_staging);
    EXPECT_EQ(testing::open_fds(), fds) << "file descriptors left open";
    EXPECT_LE(testing::threads_settle_to(threads, kThreadsSettle), threads) << "threads left";

    // The same Runtime loads next, correctly.
    LoadResult next = rt.load();
    ASSERT_TRUE(next) << next.error->message;
    EXPECT_GT(testing::expect_matches_reference(*next.model, *ck_, kTp, DType::kBF16), 0u);
  }
  expect_released(c, row.leaked_staging);
  EXPECT_EQ(testing::open_fds(), fds);
  EXPECT_LE(testing::threads_settle_to(threads, kThreadsSettle), threads);
}

INSTANTIATE_TEST_SUITE_P(Cells, FaultMatrix, ::testing::ValuesIn(rows()),
                         [](const ::testing::TestParamInfo<Row>& cell) { return cell.param.name; });

// Short reads, EAGAIN and EINTR now and then are recovered by the readers
// themselves: the load succeeds with the right bytes and leaves nothing behind.
class TransientReadFaults : public FaultMatrix {};

TEST_F(TransientReadFaults, ShortReadsEagainAndEintrStillLoadCorrectly) {
  for (const char* engine : {"uring", "pread"}) {
    for (const char* lanes : {"1", "2"}) {
      SCOPED_TRACE(std::string(engine) + ", " + lanes + " lane(s)");
      Context c(*ck_);
      io::FaultPlan plan;
      plan.seed = 7;
      plan.short_read_probability = 0.3;
      plan.eagain_probability = 0.1;
      plan.eintr_probability = 0.1;
      arm_read_faults(c, plan, engine, lanes);
      c.finish_arming();
      const std::size_t fds = testing::open_fds();
      const std::size_t threads = testing::settled_threads();
      {
        Runtime rt = make_runtime(to_config(config(c.sets)), c.hooks);
        LoadResult r = rt.load();
        ASSERT_TRUE(r) << r.error->message;
        EXPECT_GT(c.hooks.faults->faults_injected(), 10u);
        EXPECT_GT(testing::expect_matches_reference(*r.model, *ck_, kTp, DType::kBF16), 0u);
      }
      expect_released(c);
      EXPECT_EQ(testing::open_fds(), fds);
      EXPECT_LE(testing::threads_settle_to(threads, kThreadsSettle), threads);
    }
  }
}

// The thread rows above against the threads a load really starts: a load with every
// feature that starts a thread of its own, and a dummy load. A name without a row
// is a thread whose failure nothing checks. Prefetch workers and the host
// kernels' helpers are left out on purpose: a refused one is not an error (the
// tests below).
class FaultMatrixThreads : public FaultMatrix {
 protected:
  static std::string kind_of(std::string name) {
    while (!name.empty() && (name.back() == ' ' || (name.back() >= '0' && name.back() <= '9'))) {
      name.pop_back();
    }
    return name;
  }
};

TEST_F(FaultMatrixThreads, EveryThreadOfALoadHasARow) {
  std::set<std::string> covered = {"prefetch worker", "host kernel", "dummy fill rank"};
  for (const ThreadRow& t : thread_rows()) {
    covered.insert(kind_of(t.thread));
  }
  record_thread_starts();
  {
    Context c(*ck_);
    c.deferred_copies = true;
    c.finish_arming();
    Runtime rt = make_runtime(
        to_config(config({"io.read_lanes=2", "io.direct_to_device=off", "prefetch.enabled=true"})),
        c.hooks);
    LoadCallbacks callbacks;
    callbacks.on_progress = [](const LoadProgress&) { return true; };
    LoadResult r = rt.start(callbacks).wait();
    ASSERT_TRUE(r) << r.error->message;
    Runtime dummy(to_config(config({"model.load_format=dummy"})));
    LoadResult d = dummy.load();
    ASSERT_TRUE(d) << d.error->message;
  }
  const std::vector<std::string> seen = stop_recording_thread_starts();
  std::set<std::string> kinds;
  for (const std::string& name : seen) {
    kinds.insert(kind_of(name));
    EXPECT_TRUE(covered.count(kind_of(name))) << "no fault-matrix row fails thread '" << name << "'";
  }
  // The rows' threads were all seen: a row whose thread a load no longer starts
  // fails on its own (its injected failure stays pending).
  for (const char* kind : {"load", "callbacks", "allocation rank", "scheduler worker",
                           "scheduler clock", "copy worker rank", "prefetcher", "reader lane",
                           "host device queue", "prefetch worker", "dummy fill rank"}) {
    EXPECT_TRUE(kinds.count(kind)) << "a load started no '" << kind << "' thread";
  }
}

// A dummy load of several ranks fills each on a thread of its own.
TEST_F(FaultMatrixThreads, DummyFillThreadRefused) {
  const std::size_t fds = testing::open_fds();
  const std::size_t threads = testing::settled_threads();
  {
    Runtime rt(to_config(config({"model.load_format=dummy"})));
    inject_thread_start_failure("dummy fill rank 1");
    LoadResult r = rt.load();
    clear_thread_start_failure();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kResources) << r.error->message;
    EXPECT_EQ(r.error->message.rfind("resources: could not start thread dummy fill rank 1: ", 0),
              0u)
        << r.error->message;
    EXPECT_EQ(rt.state(), RuntimeState::kFailed);
    LoadResult next = rt.load();
    ASSERT_TRUE(next) << next.error->message;
  }
  EXPECT_EQ(testing::open_fds(), fds);
  EXPECT_LE(testing::threads_settle_to(threads, kThreadsSettle), threads);
}

// Prefetch is advice: a worker the system refuses leaves the load to read without
// it (a warning), and the load is complete and correct.
TEST_F(FaultMatrixThreads, PrefetchWorkerRefusedIsAWarning) {
  const std::size_t fds = testing::open_fds();
  const std::size_t threads = testing::settled_threads();
  {
    Runtime rt(to_config(config({"prefetch.enabled=true"})));
    std::vector<std::string> warnings;
    std::mutex mu;
    rt.set_log_sink([&](log::Level level, std::string_view message) {
      std::lock_guard lock(mu);
      if (level == log::Level::kWarn) {
        warnings.emplace_back(message);
      }
    });
    inject_thread_start_failure("prefetch worker 0");
    LoadResult r = rt.load();
    EXPECT_FALSE(thread_start_failure_pending()) << "no prefetch worker was started";
    clear_thread_start_failure();
    ASSERT_TRUE(r) << r.error->message;
    EXPECT_GT(testing::expect_matches_reference(*r.model, *ck_, kTp, DType::kBF16), 0u);
    std::lock_guard lock(mu);
    EXPECT_TRUE(std::any_of(warnings.begin(), warnings.end(), [](const std::string& w) {
      return w.find("could not start thread prefetch worker 0") != std::string::npos;
    })) << "no warning about the refused prefetch worker";
  }
  EXPECT_EQ(testing::open_fds(), fds);
  EXPECT_LE(testing::threads_settle_to(threads, kThreadsSettle), threads);
}

}  // namespace
}  // namespace ferry::runtime
