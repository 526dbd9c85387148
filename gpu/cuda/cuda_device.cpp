// The CUDA backend of gpu::Device: cudaMalloc'd device memory, pinned host memory
// (cudaHostAlloc / cudaHostRegister, both portable across devices), one
// non-blocking stream per Stream object, and a per-device pool of events made with
// cudaEventBlockingSync | cudaEventDisableTiming (waits sleep; none is created per
// chunk once a stream has filled the pool). Every handle is
// owned by an RAII object; every runtime call goes through FERRY_CUDA_CHECK, so an
// error names the device and the call.
//
// Device selection: each thread has its own current device (0 for a new thread).
// bind() makes this device current for the calling thread (the copy worker calls
// it once); every other method also makes it current for its own duration and
// restores the previous one, so that a stats query or an allocation from another
// thread cannot land on the wrong GPU.
//
// Releasing never throws: failures in destructors and release functions are logged.
#include <cuda_runtime_api.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "gpu/cuda/cuda_check.hpp"
#include "gpu/cuda/cuda_kernels.hpp"
#include "gpu/device.hpp"
#include "gpu/device_internal.hpp"
#include "gpu/kernels_host.hpp"

namespace ferry::gpu::cuda {
namespace {

using detail::MemoryKind;

// Events a stream records, made with cudaEventBlockingSync (a wait sleeps in the
// driver instead of spinning a core) and cudaEventDisableTiming; recycled through
// the device's pool, so a chunk reuses an event rather than creating one.
constexpr unsigned kEventFlags = cudaEventBlockingSync | cudaEventDisableTiming;
// Events each new stream adds to its device's pool up front (streams are created
// before streaming starts, in the copy worker's ensure_ready): enough for the
// chunks a worker keeps in flight; the pool grows past it only if a load needs more.
constexpr std::size_t kEventsPerStream = 16;

struct CudaDeviceState {
  std::string name;
  int index = 0;
  detail::StatsTracker stats;
  std::mutex events_mu;
  std::vector<cudaEvent_t> free_events;  // created, not handed out
  // cudaMalloc'd blocks (begin -> size), so that shared_block finds the allocation
  // a parameter lies in (a CUDA IPC handle names an allocation's start).
  std::mutex blocks_mu;
  std::map<std::uintptr_t, std::size_t> blocks;
  std::string uuid;  // read once (cudaGetDeviceProperties is slow); guarded by blocks_mu

  CudaDeviceState() = default;
  CudaDeviceState(const CudaDeviceState&) = delete;
  CudaDeviceState& operator=(const CudaDeviceState&) = delete;
  ~CudaDeviceState();
};

// Makes the state's device current for a scope. Throws.
class DeviceScope {
 public:
  explicit DeviceScope(const CudaDeviceState& state) {
    FERRY_CUDA_CHECK(state.name, cudaGetDevice(&previous_));
    if (previous_ != state.index) {
      FERRY_CUDA_CHECK(state.name, cudaSetDevice(state.index));
      restore_ = true;
    }
  }
  ~DeviceScope() {
    if (restore_) {
      (void)cudaSetDevice(previous_);
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

// Logs a failed call made while releasing something (destructors must not throw).
void warn_if_failed(cudaError_t err, const char* call, const std::string& device) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    log::warn(device + ": " + describe(err, call, "while releasing a resource"));
  }
}

// DeviceScope for release paths: never throws.
class QuietDeviceScope {
 public:
  explicit QuietDeviceScope(const CudaDeviceState& state) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != state.index) {
      warn_if_failed(cudaSetDevice(state.index), "cudaSetDevice", state.name);
      restore_ = true;
    }
  }
  ~QuietDeviceScope() {
    if (restore_) {
      (void)cudaSetDevice(previous_);
    }
  }
  QuietDeviceScope(const QuietDeviceScope&) = delete;
  QuietDeviceScope& operator=(const QuietDeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

CudaDeviceState::~CudaDeviceState() {
  QuietDeviceScope scope(*this);
  for (cudaEvent_t e : free_events) {
    warn_if_failed(cudaEventDestroy(e), "cudaEventDestroy", name);
  }
}

// Adds events to the pool until it holds `count` free ones. The caller has made
// the device current.
void reserve_events(CudaDeviceState& state, std::size_t count) {
  std::lock_guard lock(state.events_mu);
  while (state.free_events.size() < count) {
    cudaEvent_t e = nullptr;
    FERRY_CUDA_CHECK(state.name, cudaEventCreateWithFlags(&e, kEventFlags));
    state.free_events.push_back(e);
  }
}

// An event from the pool (a new one when it is empty). The device is current.
cudaEvent_t take_event(CudaDeviceState& state) {
  {
    std::lock_guard lock(state.events_mu);
    if (!state.free_events.empty()) {
      cudaEvent_t e = state.free_events.back();
      state.free_events.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  FERRY_CUDA_CHECK(state.name, cudaEventCreateWithFlags(&e, kEventFlags));
  return e;
}

// Back to the pool. Recording it again later replaces whatever it marked.
void give_event(CudaDeviceState& state, cudaEvent_t e) noexcept {
  std::lock_guard lock(state.events_mu);
  state.free_events.push_back(e);
}

class CudaEvent final : public Event {
 public:
  CudaEvent(std::shared_ptr<CudaDeviceState> state, cudaStream_t stream)
      : state_(std::move(state)) {
    DeviceScope scope(*state_);
    event_ = take_event(*state_);
    cudaError_t err = cudaEventRecord(event_, stream);
    if (err != cudaSuccess) {
      give_event(*state_, event_);
      check(err, "cudaEventRecord", state_->name);
    }
    state_->stats.event_created();
  }
  ~CudaEvent() override {
    give_event(*state_, event_);
    state_->stats.event_destroyed();
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  bool query() override {
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      return false;
    }
    FERRY_CUDA_CHECK(state_->name, err);
    return true;
  }

  void synchronize() override { FERRY_CUDA_CHECK(state_->name, cudaEventSynchronize(event_)); }

 private:
  std::shared_ptr<CudaDeviceState> state_;
  cudaEvent_t event_ = nullptr;
};

class CudaStream final : public Stream {
 public:
  explicit CudaStream(std::shared_ptr<CudaDeviceState> state) : state_(std::move(state)) {
    DeviceScope scope(*state_);
    FERRY_CUDA_CHECK(state_->name, cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    try {
      reserve_events(*state_, kEventsPerStream);
    } catch (...) {
      (void)cudaStreamDestroy(stream_);
      throw;
    }
    state_->stats.stream_created();
  }
  // Waits for queued work first: the host buffers it reads may be freed right after.
  ~CudaStream() override {
    QuietDeviceScope scope(*state_);
    wait_quietly();
    warn_if_failed(cudaStreamDestroy(stream_), "cudaStreamDestroy", state_->name);
    state_->stats.stream_destroyed();
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  void copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) override {
    if (bytes == 0) {
      return;
    }
    DeviceScope scope(*state_);
    FERRY_CUDA_CHECK(state_->name,
                     cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, stream_));
  }

  void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    const std::string& name = state_->name;
    std::size_t span =
        detail::pitched_span(name, "copy_h2d_2d", "destination", dst_pitch, width_bytes, rows);
    detail::pitched_span(name, "copy_h2d_2d", "source", src_pitch, width_bytes, rows);
    if (span == 0) {
      return;
    }
    DeviceScope scope(*state_);
    FERRY_CUDA_CHECK(name, cudaMemcpy2DAsync(dst, dst_pitch, src_host, src_pitch, width_bytes, rows,
                                             cudaMemcpyHostToDevice, stream_));
  }

  void copy_d2h(std::byte* dst_host, const std::byte* src, std::size_t bytes) override {
    if (bytes == 0) {
      return;
    }
    DeviceScope scope(*state_);
    FERRY_CUDA_CHECK(state_->name,
                     cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, stream_));
  }

  void fill(std::byte* dst, std::size_t count, DType dtype, double value) override {
    std::size_t bytes = detail::check_fill(state_->name, dtype, count);
    if (bytes == 0) {
      return;
    }
    // The value is converted on the host by the host twin, so both backends store
    // the same pattern; the kernel only replicates it.
    std::uint64_t pattern = host::fill_pattern(dtype, value);
    DeviceScope scope(*state_);
    check(launch_fill(dst, count, dtype_size(dtype), pattern, stream_), "fill kernel launch",
          state_->name,
          std::string(dtype_name(dtype)) + ", " + std::to_string(count) + " elements");
  }

  void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                   std::uint64_t seed) override {
    if (detail::check_fill_random(state_->name, dtype, count) == 0) {
      return;
    }
    const host::RandomRange r = host::random_range(low, high);
    DeviceScope scope(*state_);
    check(launch_fill_random(dst, count, dtype, r.low, r.span, seed, stream_),
          "fill_random kernel launch", state_->name,
          std::string(dtype_name(dtype)) + ", " + std::to_string(count) + " elements");
  }

  void zero(std::byte* dst, std::size_t bytes) override {
    if (bytes == 0) {
      return;
    }
    DeviceScope scope(*state_);
    FERRY_CUDA_CHECK(state_->name, cudaMemsetAsync(dst, 0, bytes, stream_));
  }

  void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
            std::size_t count) override {
    detail::CastBytes bytes =
        detail::check_cast(state_->name, dst, dst_dtype, src, src_dtype, count);
    if (count == 0 || (dst_dtype == src_dtype && dst == src)) {
      return;
    }
    DeviceScope scope(*state_);
    if (dst_dtype == src_dtype) {
      FERRY_CUDA_CHECK(state_->name,
                       cudaMemcpyAsync(dst, src, bytes.dst, cudaMemcpyDeviceToDevice, stream_));
      return;
    }
    check(launch_cast(dst, dst_dtype, src, src_dtype, count, stream_), "cast kernel launch",
          state_->name,
          std::string(dtype_name(src_dtype)) + " -> " + std::string(dtype_name(dst_dtype)) + ", " +
              std::to_string(count) + " elements");
  }

  void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
               std::size_t rows) override {
    if (detail::pitched_span(state_->name, "zero_2d", "destination", dst_pitch, width_bytes,
                             rows) == 0) {
      return;
    }
    DeviceScope scope(*state_);
    FERRY_CUDA_CHECK(state_->name,
                     cudaMemset2DAsync(dst, dst_pitch, 0, width_bytes, rows, stream_));
  }

  void set_bytes(std::byte* dst, std::byte value, std::size_t bytes) override {
    if (bytes == 0) {
      return;
    }
    DeviceScope scope(*state_);
    FERRY_CUDA_CHECK(state_->name,
                     cudaMemsetAsync(dst, static_cast<int>(value), bytes, stream_));
  }

  void match_pattern(const PatternRange* ranges, std::size_t count,
                     std::uint8_t* flags) override {
    if (count == 0) {
      return;
    }
    detail::check_pattern_table(state_->name, ranges);
    DeviceScope scope(*state_);
    check(launch_match_pattern(ranges, count, flags, stream_), "match_pattern kernel launch",
          state_->name, std::to_string(count) + " ranges");
  }

  void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
               std::size_t src_pitch, DType src_dtype, std::size_t width,
               std::size_t rows) override {
    const detail::Spans spans = detail::check_cast_2d(state_->name, dst, dst_pitch, dst_dtype, src,
                                                      src_pitch, src_dtype, width, rows);
    if (spans.dst == 0 || (dst_dtype == src_dtype && dst == src)) {
      return;
    }
    DeviceScope scope(*state_);
    if (dst_dtype == src_dtype) {
      const std::size_t row = width * dtype_size(dst_dtype);
      check(launch_copy_2d(dst, dst_pitch, src, src_pitch, row, rows, stream_),
            "copy kernel launch", state_->name);
      return;
    }
    check(
        launch_cast_2d(dst, dst_pitch, dst_dtype, src, src_pitch, src_dtype, width, rows, stream_),
        "cast kernel launch", state_->name,
        std::string(dtype_name(src_dtype)) + " -> " + std::string(dtype_name(dst_dtype)) + ", " +
            std::to_string(rows) + " rows of " + std::to_string(width) + " elements");
  }

  void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                          const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                          std::size_t width, std::size_t rows) override {
    if (detail::check_dequantize_ggml_2d(state_->name, dst, dst_pitch, dst_dtype, src, src_pitch,
                                         blocks, width, rows)
            .dst == 0) {
      return;
    }
    DeviceScope scope(*state_);
    check(launch_dequantize_ggml_2d(dst, dst_pitch, dst_dtype, src, src_pitch, blocks, width, rows,
                                    stream_),
          "dequantize_ggml_2d kernel launch", state_->name,
          std::string(ggml_blocks_name(blocks)) + " -> " + std::string(dtype_name(dst_dtype)) +
              ", " + std::to_string(rows) + " rows of " + std::to_string(width) + " elements");
  }

  void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                   std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) override {
    if (detail::check_copy_d2d_2d(state_->name, dst, dst_pitch, src, src_pitch, width_bytes, rows)
            .dst == 0) {
      return;
    }
    DeviceScope scope(*state_);
    check(launch_copy_2d(dst, dst_pitch, src, src_pitch, width_bytes, rows, stream_),
          "gather kernel launch", state_->name,
          std::to_string(rows) + " rows of " + std::to_string(width_bytes) + " bytes");
  }

  void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                 std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                 std::size_t cols, std::size_t batches) override {
    if (detail::check_transpose(state_->name, dst, dst_batch_pitch, src, src_batch_pitch,
                                element_size, rows, cols, batches)
            .dst == 0) {
      return;
    }
    DeviceScope scope(*state_);
    check(launch_transpose(dst, dst_batch_pitch, src, src_batch_pitch, element_size, rows, cols,
                           batches, stream_),
          "transpose kernel launch", state_->name,
          std::to_string(batches) + " x " + std::to_string(rows) + " x " + std::to_string(cols));
  }

  void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src, const std::byte* scale,
                      const Fp8Scales& scales, std::size_t rows, std::size_t cols,
                      std::size_t batches) override {
    if (detail::check_dequantize_fp8(state_->name, dst, dst_dtype, src, scale, scales, rows, cols,
                                     batches)
            .dst == 0) {
      return;
    }
    DeviceScope scope(*state_);
    check(launch_dequantize_fp8(dst, dst_dtype, src, scale, scales, rows, cols, batches, stream_),
          "dequantize_fp8 kernel launch", state_->name,
          std::to_string(batches) + " x " + std::to_string(rows) + " x " + std::to_string(cols) +
              " -> " + std::string(dtype_name(dst_dtype)));
  }

  void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                    const Fp8Scales& scales, Fp8ScaleRule rule, std::size_t rows, std::size_t cols,
                    std::size_t batches) override {
    if (detail::check_quantize_fp8(state_->name, dst, scale, src, src_dtype, scales, rows, cols,
                                   batches)
            .dst == 0) {
      return;
    }
    DeviceScope scope(*state_);
    check(
        launch_quantize_fp8(dst, scale, src, src_dtype, scales, rule, rows, cols, batches, stream_),
        "quantize_fp8 kernel launch", state_->name,
        std::string(dtype_name(src_dtype)) + " " + std::to_string(batches) + " x " +
            std::to_string(rows) + " x " + std::to_string(cols));
  }

  void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows, std::size_t block_rows,
                  std::size_t scale_cols, std::size_t batches) override {
    if (detail::check_pack_ue8m0(state_->name, dst, scale, rows, block_rows, scale_cols, batches)
            .dst == 0) {
      return;
    }
    DeviceScope scope(*state_);
    check(launch_pack_ue8m0(dst, scale, rows, block_rows, scale_cols, batches, stream_),
          "pack_ue8m0 kernel launch", state_->name,
          std::to_string(batches) + " x " + std::to_string(rows) + " rows");
  }

  void repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t k) override {
    if (detail::check_marlin_fp4(state_->name, "repack_marlin_fp4", dst, src, n, k).dst == 0) {
      return;
    }
    DeviceScope scope(*state_);
    check(launch_repack_marlin_fp4(dst, src, n, k, stream_), "repack_marlin_fp4 kernel launch",
          state_->name, std::to_string(n) + " x " + std::to_string(k));
  }

  void marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                         std::size_t groups) override {
    if (detail::check_marlin_fp4(state_->name, "marlin_fp4_scales", dst, src, n, groups).dst ==
        0) {
      return;
    }
    DeviceScope scope(*state_);
    check(launch_marlin_fp4_scales(dst, src, n, groups, stream_), "marlin_fp4_scales kernel launch",
          state_->name, std::to_string(n) + " x " + std::to_string(groups));
  }

  std::unique_ptr<Event> record() override { return std::make_unique<CudaEvent>(state_, stream_); }

  // Through a pooled blocking-sync event: cudaStreamSynchronize spins a core unless
  // the whole process (the engine) chose blocking sync for the device.
  void synchronize() override {
    DeviceScope scope(*state_);
    check(wait(), "cudaEventRecord/cudaEventSynchronize", state_->name);
  }

 private:
  // Waits for the stream's queued work on a pooled event; the device is current.
  cudaError_t wait() {
    cudaEvent_t e = take_event(*state_);
    cudaError_t err = cudaEventRecord(e, stream_);
    if (err == cudaSuccess) {
      err = cudaEventSynchronize(e);
    }
    give_event(*state_, e);
    return err;
  }

  // wait() for the destructor: never throws; falls back to cudaStreamSynchronize
  // when no event can be had.
  void wait_quietly() noexcept {
    try {
      warn_if_failed(wait(), "cudaEventSynchronize", state_->name);
    } catch (const std::exception&) {
      warn_if_failed(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", state_->name);
    }
  }

  std::shared_ptr<CudaDeviceState> state_;
  cudaStream_t stream_ = nullptr;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(std::shared_ptr<CudaDeviceState> state) : state_(std::move(state)) {}

  std::string name() const override { return state_->name; }

  // Also puts the calling thread in cudaStreamCaptureModeRelaxed (for the thread's
  // life): ferry's threads (copy workers, the commit's verification) then may
  // query and wait on ferry's own events while another thread of the engine
  // captures a graph in global mode, which would otherwise refuse those calls as
  // potentially unsafe. Safe, because ferry never records an event on, or waits
  // for, a capturing stream; everything that allocates or creates was made in
  // prepare() (include/ferry/runtime.hpp says which calls commit() makes).
  void bind() override {
    FERRY_CUDA_CHECK(state_->name, cudaSetDevice(state_->index));
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    FERRY_CUDA_CHECK(state_->name, cudaThreadExchangeStreamCaptureMode(&mode));
  }

  // The PCI device's node from sysfs; -1 when the driver or sysfs does not say.
  int numa_node() const override {
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, state_->index) != cudaSuccess) {
      return -1;
    }
    std::string id(bus_id);
    for (char& c : id) {
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    std::ifstream in("/sys/bus/pci/devices/" + id + "/numa_node");
    int node = -1;
    return in >> node ? node : -1;
  }

  DeviceAllocation allocate(std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    DeviceScope scope(*state_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      check(err, "cudaMalloc", state_->name,
            std::to_string(bytes) + " bytes requested, " +
                std::to_string(state_->stats.snapshot().device.live_bytes) +
                " bytes held by ferry on this device");
    }
    state_->stats.add(MemoryKind::kDevice, bytes);
    {
      std::lock_guard lock(state_->blocks_mu);
      state_->blocks[reinterpret_cast<std::uintptr_t>(p)] = bytes;
    }
    return DeviceAllocation(static_cast<std::byte*>(p), bytes,
                            [state = state_](std::byte* data, std::size_t size) {
                              {
                                std::lock_guard lock(state->blocks_mu);
                                state->blocks.erase(reinterpret_cast<std::uintptr_t>(data));
                              }
                              QuietDeviceScope release_scope(*state);
                              warn_if_failed(cudaFree(data), "cudaFree", state->name);
                              state->stats.remove(MemoryKind::kDevice, size);
                            });
  }

  // The weight cache's CUDA transport: one cudaIpcMemHandle per allocation (an
  // arena holds a rank's parameters), named by the GPU's UUID, which a client checks
  // against its own device's (the same GPU whatever index CUDA_VISIBLE_DEVICES gives
  // it; a client on another GPU is refused). CUDA may place a small cudaMalloc inside
  // a larger block and IPC shares the whole block: the sharing runtime rounds what it
  // allocates for parameters up to 2 MiB (runtime/allocate.cpp).
  std::optional<SharedBlock> shared_block(const std::byte* p) const override {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::uintptr_t base = 0;
    std::size_t size = 0;
    {
      std::lock_guard lock(state_->blocks_mu);
      auto it = state_->blocks.upper_bound(at);
      if (it == state_->blocks.begin()) {
        return std::nullopt;
      }
      --it;
      if (at >= it->first + it->second) {
        return std::nullopt;
      }
      base = it->first;
      size = it->second;
    }
    DeviceScope scope(*state_);
    cudaIpcMemHandle_t handle{};
    FERRY_CUDA_CHECK(state_->name, cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)));
    SharedBlock b;
    b.kind = "cuda_ipc";
    b.base = reinterpret_cast<const std::byte*>(base);
    b.bytes = size;
    b.uuid = uuid();
    b.handle = to_hex(&handle, sizeof handle);
    return b;
  }

  std::string uuid() const override {
    std::lock_guard lock(state_->blocks_mu);
    if (state_->uuid.empty()) {
      cudaDeviceProp prop{};
      FERRY_CUDA_CHECK(state_->name, cudaGetDeviceProperties(&prop, state_->index));
      state_->uuid = gpu_uuid_text(reinterpret_cast<const unsigned char*>(prop.uuid.bytes));
    }
    return state_->uuid;
  }

  DeviceAllocation map_shared(const SharedBlock& block, int fd) override {
    (void)fd;
    if (block.kind != "cuda_ipc") {
      throw ferry::Error(ferry::Stage::kCopy, state_->name, "",
                         "a CUDA device maps cuda_ipc blocks only, not " + block.kind);
    }
    if (block.bytes == 0) {
      throw ferry::Error(ferry::Stage::kCopy, state_->name, "",
                         "a shared block of 0 bytes: nothing to open");
    }
    const std::string mine = uuid();
    if (block.uuid != mine) {
      throw ferry::Error(
          ferry::Stage::kCopy, state_->name, "",
          "the shared block lives on GPU " + block.uuid + ", this device is " + mine);
    }
    static_assert(sizeof(cudaIpcMemHandle_t) == 64);
    const std::optional<std::string> bytes = from_hex(block.handle, sizeof(cudaIpcMemHandle_t));
    if (!bytes) {
      throw ferry::Error(ferry::Stage::kCopy, state_->name, "",
                         "a CUDA IPC handle must be 128 hex digits");
    }
    cudaIpcMemHandle_t handle{};
    std::memcpy(&handle, bytes->data(), sizeof handle);
    DeviceScope scope(*state_);
    void* p = nullptr;
    FERRY_CUDA_CHECK(state_->name,
                     cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess));
    auto close = [state = state_](std::byte* data, std::size_t) {
      QuietDeviceScope release_scope(*state);
      warn_if_failed(cudaIpcCloseMemHandle(data), "cudaIpcCloseMemHandle", state->name);
    };
    try {
      return adopt(static_cast<std::byte*>(p), block.bytes, close);
    } catch (...) {
      close(static_cast<std::byte*>(p), block.bytes);
      throw;
    }
  }

  DeviceAllocation adopt(std::byte* data, std::size_t bytes,
                         DeviceAllocation::Release release) override {
    if (bytes == 0) {
      return {};
    }
    if (data == nullptr) {
      throw ferry::Error(ferry::Stage::kCopy, state_->name, "",
                         "adopt: the engine's memory is null");
    }
    state_->stats.add(MemoryKind::kDevice, bytes);
    return DeviceAllocation(
        data, bytes,
        [state = state_, release = std::move(release)](std::byte* p, std::size_t size) {
          state->stats.remove(MemoryKind::kDevice, size);
          release(p, size);
        });
  }

  PinnedAllocation allocate_pinned(std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    DeviceScope scope(*state_);
    void* base = nullptr;
    FERRY_CUDA_CHECK(state_->name, cudaHostAlloc(&base, bytes, cudaHostAllocPortable));
    std::byte* data = static_cast<std::byte*>(base);
    if (reinterpret_cast<std::uintptr_t>(base) % kPinnedAlignment != 0) {
      // The runtime hands out page-aligned blocks in practice but does not promise
      // it; over-allocate and align by hand if it ever does not.
      warn_if_failed(cudaFreeHost(base), "cudaFreeHost", state_->name);
      FERRY_CUDA_CHECK(state_->name,
                       cudaHostAlloc(&base, bytes + kPinnedAlignment, cudaHostAllocPortable));
      auto addr = reinterpret_cast<std::uintptr_t>(base);
      data = static_cast<std::byte*>(base) +
             (kPinnedAlignment - addr % kPinnedAlignment) % kPinnedAlignment;
    }
    state_->stats.add(MemoryKind::kPinned, bytes);
    return PinnedAllocation(data, bytes, [state = state_, base](std::byte*, std::size_t size) {
      warn_if_failed(cudaFreeHost(base), "cudaFreeHost", state->name);
      state->stats.remove(MemoryKind::kPinned, size);
    });
  }

  HostRegistration register_host(void* host, std::size_t bytes) override {
    if (bytes == 0) {
      return {};
    }
    DeviceScope scope(*state_);
    FERRY_CUDA_CHECK(state_->name, cudaHostRegister(host, bytes, cudaHostRegisterPortable));
    state_->stats.add(MemoryKind::kRegistered, bytes);
    return HostRegistration(
        static_cast<std::byte*>(host), bytes, [state = state_](std::byte* data, std::size_t size) {
          warn_if_failed(cudaHostUnregister(data), "cudaHostUnregister", state->name);
          state->stats.remove(MemoryKind::kRegistered, size);
        });
  }

  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CudaStream>(state_); }

  void reserve_events(std::size_t count) override {
    DeviceScope scope(*state_);
    cuda::reserve_events(*state_, count);
  }

  AllocationStats stats() const override { return state_->stats.snapshot(); }

  // A copy engine pays per row of a pitched copy; rows of a few KiB (row-parallel
  // tp slices) move far below the link's rate. Narrower rows are gathered on the
  // device (actors/fragment_copy.hpp).
  std::size_t narrow_row_bytes() const override { return std::size_t{64} << 10; }

 private:
  std::shared_ptr<CudaDeviceState> state_;
};

}  // namespace

// Called by make_cuda_device (gpu/backends.cpp) after it checked the index.
std::shared_ptr<Device> make_device(int index) {
  auto state = std::make_shared<CudaDeviceState>();
  state->name = "cuda:" + std::to_string(index);
  state->index = index;
  return std::make_shared<CudaDevice>(std::move(state));
}

}  // namespace ferry::gpu::cuda
