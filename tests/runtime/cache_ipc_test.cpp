// The weight cache's CUDA transport with the handle exchange mocked: a daemon whose
// devices share their blocks as "cuda_ipc" (a 64-byte handle and a GPU UUID, no
// descriptor passed) and clients whose devices open such handles, as
// gpu/cuda/cuda_device.cpp does with cudaIpcGetMemHandle / cudaIpcOpenMemHandle.
// The mock's handle names the daemon's memfd through /proc (pid, descriptor), so
// what a client maps is the daemon's memory, found by the handle alone; the UUID
// check is the real one. The real CUDA path runs in scripts/gpu-check.sh.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "cache/protocol.hpp"
#include "cache/socket.hpp"
#include "ferry/cache.hpp"
#include "gpu/device_wrapper.hpp"
#include "gpu/host_device.hpp"
#include "runtime/cache.hpp"
#include "runtime/cache_util.hpp"

namespace ferry::runtime {
namespace {

using testing::Checkpoint;
using testing::Sets;
using testing::synth_checkpoint;
using testing::TempDir;

// A host device that shares and maps the way the CUDA backend does.
class MockIpcDevice final : public gpu::DeviceWrapper {
 public:
  MockIpcDevice(int index, std::string uuid)
      : gpu::DeviceWrapper(gpu::make_host_device(index, shared_options())),
        uuid_(std::move(uuid)) {}

  std::optional<gpu::SharedBlock> shared_block(const std::byte* p) const override {
    std::optional<gpu::SharedBlock> b = inner()->shared_block(p);
    if (!b) {
      return b;
    }
    struct Handle {
      std::int64_t pid;
      std::int64_t fd;
      char pad[48];
    } h{::getpid(), b->fd, {}};
    static_assert(sizeof(Handle) == 64);
    b->kind = "cuda_ipc";
    b->fd = -1;
    b->uuid = uuid_;
    b->handle = gpu::to_hex(&h, sizeof h);
    return b;
  }

  gpu::DeviceAllocation map_shared(const gpu::SharedBlock& block, int fd) override {
    EXPECT_EQ(fd, -1) << "a cuda_ipc block comes with no descriptor";
    if (block.kind != "cuda_ipc") {
      throw Error(Stage::kCopy, name(), "", "the mock maps cuda_ipc blocks only");
    }
    if (block.uuid != uuid_) {
      throw Error(Stage::kCopy, name(), "",
                  "the shared block lives on GPU " + block.uuid + ", this device is " + uuid_);
    }
    const std::optional<std::string> bytes = gpu::from_hex(block.handle, 64);
    if (!bytes) {
      throw Error(Stage::kCopy, name(), "", "a CUDA IPC handle must be 128 hex digits");
    }
    std::int64_t h[2];
    std::memcpy(h, bytes->data(), sizeof h);
    const std::string path = "/proc/" + std::to_string(h[0]) + "/fd/" + std::to_string(h[1]);
    const int mem = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (mem < 0) {
      throw Error(Stage::kCopy, name(), "", "cannot open the handle's memory " + path);
    }
    const std::size_t length = (block.bytes + 4095) / 4096 * 4096;
    void* p = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, mem, 0);
    ::close(mem);
    if (p == MAP_FAILED) {
      throw Error(Stage::kCopy, name(), "", "cannot map the handle's memory");
    }
    ++opened;
    return adopt(static_cast<std::byte*>(p), block.bytes,
                 [length](std::byte* data, std::size_t) { ::munmap(data, length); });
  }

  std::string uuid() const override { return uuid_; }

  int opened = 0;

 private:
  static gpu::HostDeviceOptions shared_options() {
    gpu::HostDeviceOptions o;
    o.shared_memory = true;
    return o;
  }
  std::string uuid_;
};

constexpr const char* kGpu0 = "GPU-11111111-2222-3333-4444-555555555555";
constexpr const char* kGpu1 = "GPU-11111111-2222-3333-4444-666666666666";

struct CacheIpc : ::testing::Test {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  std::string registry = testing::registry_dir(dir);
  Sets sets = {"parallel.tp=2", "cache.dir=" + registry};

  std::unique_ptr<CacheDaemon> daemon(const std::vector<std::string>& uuids) {
    RuntimeTestSeams seams;
    for (std::size_t i = 0; i < uuids.size(); ++i) {
      seams.devices.push_back(std::make_shared<MockIpcDevice>(static_cast<int>(i), uuids[i]));
    }
    const Config config = to_config(testing::make_config(ck.dir, sets));
    return std::make_unique<CacheDaemon>(config, make_sharing_runtime(config, seams));
  }
  // A client of tp rank `rank` on a mock device of `uuid` (another index than the
  // daemon's: CUDA_VISIBLE_DEVICES may differ; the UUID is what must match).
  LoadResult attach(int rank, const std::string& uuid, std::shared_ptr<MockIpcDevice>* device) {
    RuntimeTestSeams seams;
    *device = std::make_shared<MockIpcDevice>(7, uuid);
    seams.devices.push_back(*device);
    Runtime rt = make_runtime(
        to_config(testing::make_config(
            ck.dir, testing::with(sets, {"cache.mode=daemon",
                                         "parallel.ranks=[" + std::to_string(rank) + "]"}))),
        seams);
    return rt.load();
  }
};

TEST_F(CacheIpc, ClientsOpenTheHandlesOfTheirGpu) {
  std::unique_ptr<CacheDaemon> d = daemon({kGpu0, kGpu1});
  std::thread server([&] { d->serve(); });
  LoadResult disk = testing::load_with(ck.dir, {"parallel.tp=2"});
  ASSERT_TRUE(disk) << disk.error->message;
  for (int rank : {0, 1}) {
    std::shared_ptr<MockIpcDevice> device;
    LoadResult r = attach(rank, rank == 0 ? kGpu0 : kGpu1, &device);
    ASSERT_TRUE(r) << r.error->message;
    EXPECT_EQ(device->opened, 1);  // one handle: the rank's arena
    EXPECT_EQ(r.model->report().cache.storages, 1U);
    EXPECT_EQ(r.model->ranks()[0].device, "host:7");
    testing::expect_same_params(*r.model, *disk.model);
  }
  // Rank 1's memory lives on the second GPU: a client on the first is refused,
  // never handed another GPU's memory.
  std::shared_ptr<MockIpcDevice> device;
  LoadResult wrong = attach(1, kGpu0, &device);
  ASSERT_FALSE(wrong);
  EXPECT_EQ(wrong.error->stage, Stage::kCache);
  EXPECT_NE(wrong.error->message.find(std::string("lives on GPU ") + kGpu1), std::string::npos)
      << wrong.error->message;
  d->stop();
  server.join();
}

TEST_F(CacheIpc, TheTableCarriesHandlesAndUuidsAndNoDescriptors) {
  std::unique_ptr<CacheDaemon> d = daemon({kGpu0, kGpu1});
  std::thread server([&] { d->serve(); });
  const CacheIdentity id = cache_identity(disk_config(testing::make_config(ck.dir, sets)));
  cache::Connection c =
      cache::connect_unix(d->socket(), cache::Clock::now() + std::chrono::seconds(10));
  c.write_frame({{"type", "fetch"}, {"fingerprint", id.fingerprint}, {"ranks", {1, 0}}});
  const nlohmann::json reply = c.read_frame();
  const cache::FetchReply table = cache::parse_fetch_reply(reply, "test");
  EXPECT_EQ(table.descriptors(), 0U);
  EXPECT_EQ(reply["descriptors"], 0);
  ASSERT_EQ(table.storages.size(), 2U);
  EXPECT_EQ(table.storages[0].kind, "cuda_ipc");
  EXPECT_EQ(table.storages[0].uuid, kGpu1);  // rank 1 first, as asked
  EXPECT_EQ(table.storages[1].uuid, kGpu0);
  EXPECT_EQ(table.storages[0].handle.size(), 128U);
  ASSERT_EQ(table.ranks.size(), 2U);
  EXPECT_EQ(table.ranks[0].tp_rank, 1);
  // The connection stays open and idle: stop() does not wait for its timeout.
  const auto stopping = std::chrono::steady_clock::now();
  d->stop();
  server.join();
  EXPECT_LT(std::chrono::steady_clock::now() - stopping, std::chrono::seconds(10));
}

}  // namespace
}  // namespace ferry::runtime
