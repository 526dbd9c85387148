// The device interface every backend implements: device memory, pinned host memory,
// a stream that copies host-to-device (1-D and pitched 2-D) and runs the few kernels
// post-processing needs (fill, zero, dtype cast, FP8 dequantization and
// quantization, GGML block dequantization), and events that say when the work
// queued before them is done.
//
// The host backend (gpu/host_device.hpp) is the reference: every operation has a
// plain C++ definition there, and the CUDA backend must produce the same bytes.
//
// Errors: every failure throws ferry::Error with Stage::kCopy, the device's name in
// the `file` slot ("host:0", "cuda:1") and a rule that names the failing operation
// or runtime call, e.g. "cudaMemcpyAsync: invalid argument (cudaErrorInvalidValue,
// code 1)".
//
// Threading: a Device may be used from any thread (allocation, stats, streams are
// created under its own locks). A Stream is used by one thread at a time (its copy
// worker); an Event may be queried and waited on from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/dtype.hpp"
#include "common/ggml_blocks.hpp"
#include "gpu/fp8.hpp"

namespace ferry::gpu {

// Alignment every backend guarantees: device allocations start on a 256-byte
// boundary (as cudaMalloc does); pinned host allocations on a 4096-byte boundary so
// that O_DIRECT reads can land in them.
inline constexpr std::size_t kDeviceAlignment = 256;
inline constexpr std::size_t kPinnedAlignment = 4096;

// Counters for one kind of memory. `live_*` go back to 0 when everything was
// released; `peak_bytes` is the high-water mark of live_bytes; `total_*` only grow.
struct MemoryCounters {
  std::size_t live_bytes = 0;
  std::size_t live_count = 0;
  std::size_t peak_bytes = 0;
  std::size_t total_bytes = 0;
  std::size_t total_count = 0;
};

// What a device has handed out and not yet taken back. Tests use all_released() to
// prove that a failed or cancelled load gave everything back.
struct AllocationStats {
  MemoryCounters device;      // allocate()
  MemoryCounters pinned;      // allocate_pinned()
  MemoryCounters registered;  // register_host()
  std::size_t live_streams = 0;
  std::size_t live_events = 0;

  bool all_released() const {
    return device.live_count == 0 && pinned.live_count == 0 && registered.live_count == 0 &&
           live_streams == 0 && live_events == 0;
  }
};

// A move-only handle that owns a block of memory and gives it back when it dies.
// DeviceAllocation, PinnedAllocation and HostRegistration are the three flavours;
// the Tag keeps a device pointer from being passed where a host one is expected.
// A default-constructed or moved-from handle is empty (data() == nullptr, size() == 0).
// The handle keeps its device's state alive, so it may outlive the Device object.
template <class Tag>
class OwnedMemory {
 public:
  // Called exactly once with (data, size) when a non-empty handle is destroyed or
  // reset. Must not throw (backends log failures instead).
  using Release = std::function<void(std::byte*, std::size_t)>;

  OwnedMemory() = default;
  OwnedMemory(std::byte* data, std::size_t size, Release release)
      : data_(data), size_(size), release_(std::move(release)) {}
  ~OwnedMemory() { reset(); }

  OwnedMemory(OwnedMemory&& other) noexcept
      : data_(other.data_), size_(other.size_), release_(std::move(other.release_)) {
    other.data_ = nullptr;
    other.size_ = 0;
    other.release_ = nullptr;
  }
  OwnedMemory& operator=(OwnedMemory&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = other.data_;
      size_ = other.size_;
      release_ = std::move(other.release_);
      other.data_ = nullptr;
      other.size_ = 0;
      other.release_ = nullptr;
    }
    return *this;
  }
  OwnedMemory(const OwnedMemory&) = delete;
  OwnedMemory& operator=(const OwnedMemory&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool empty() const { return data_ == nullptr; }
  explicit operator bool() const { return data_ != nullptr; }

  // Gives the memory back now; the handle becomes empty.
  void reset() noexcept {
    if (release_) {
      Release release = std::move(release_);
      release_ = nullptr;
      release(data_, size_);
    }
    data_ = nullptr;
    size_ = 0;
  }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  Release release_;
};

struct DeviceMemoryTag;
struct PinnedMemoryTag;
struct HostRegistrationTag;

// Device memory: data() is a device pointer (on the host backend, host memory that
// only this device's streams may touch).
using DeviceAllocation = OwnedMemory<DeviceMemoryTag>;
// Page-locked host memory, kPinnedAlignment-aligned, directly readable and writable
// by the host.
using PinnedAllocation = OwnedMemory<PinnedMemoryTag>;
// An existing host buffer pinned for fast transfers; destroying it unpins (does not
// free) the buffer. data() is the caller's pointer.
using HostRegistration = OwnedMemory<HostRegistrationTag>;

// One range of Stream::match_pattern's table, as it lies in device memory (the
// same layout on the host and the device: 32 bytes, no padding).
struct PatternRange {
  const std::byte* data = nullptr;  // device pointer
  std::uint64_t bytes = 0;
  // The element's bytes: the low element_size bytes, in the machine's byte order
  // (host::fill_pattern's form).
  std::uint64_t pattern = 0;
  std::uint32_t element_size = 1;
  std::uint32_t reserved = 0;
};
static_assert(sizeof(PatternRange) == 32);

// A block of device memory another process can map: how a weight-cache daemon
// (`ferry serve`, runtime/cache_server.cpp) shares its parameters, and what its
// clients map (runtime/cache_client.cpp).
struct SharedBlock {
  std::string kind;                 // "memfd" (host devices) or "cuda_ipc"
  const std::byte* base = nullptr;  // the block's first byte, in the exporting process
  std::size_t bytes = 0;
  int fd = -1;         // memfd: the device's own descriptor, open while the block lives
  std::string uuid;    // cuda_ipc: the GPU's UUID ("GPU-..."), whatever its index here
  std::string handle;  // cuda_ipc: the cudaIpcMemHandle_t's 64 bytes, as hex
};

// Marks a point in a stream. Destroying an Event that is not complete is allowed.
class Event {
 public:
  virtual ~Event() = default;
  // True once every operation queued on the stream before record() has finished.
  virtual bool query() = 0;
  // Blocks until query() would return true.
  virtual void synchronize() = 0;
};

// An ordered queue of operations on one device. Operations may run asynchronously:
// host buffers passed to a copy must stay valid and unchanged until an event
// recorded after the copy completes (or synchronize() returns); pinned memory lets
// the CUDA backend copy without staging it again.
//
// Pointer arguments named dst/src without "host" are device pointers and must lie
// inside live allocations of this stream's device (the host backend checks this
// and throws; CUDA may fault). Zero-sized operations do nothing.
class Stream {
 public:
  virtual ~Stream() = default;

  // Host-to-device copy of `bytes` bytes.
  virtual void copy_h2d(std::byte* dst, const std::byte* src_host, std::size_t bytes) = 0;

  // Copies `rows` rows of `width_bytes` bytes each; row r goes from
  // src_host + r*src_pitch to dst + r*dst_pitch. Bytes between rows are left as they
  // were. Both pitches must be >= width_bytes.
  virtual void copy_h2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src_host,
                           std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) = 0;

  // Device-to-host copy, for dumps and verification (not throttled, not fast-path).
  // Asynchronous like the rest: read dst_host after synchronize() or an event.
  virtual void copy_d2h(std::byte* dst_host, const std::byte* src, std::size_t bytes) = 0;

  // Writes `count` elements of `dtype` holding `value`. The value is rounded to F32
  // first and then to the element type (round-to-nearest-even, as PyTorch's
  // torch.full does), except F64, which stores the double as is. Supported dtypes:
  // BF16, F16, F32, F64; others throw. dst needs no particular alignment.
  virtual void fill(std::byte* dst, std::size_t count, DType dtype, double value) = 0;

  // Writes `count` elements of `dtype` drawn from a counter-based generator: element
  // i depends only on (seed, i) (gpu/fill_random.hpp), so every backend writes the
  // same bytes. BF16, F16, F32, F8_E4M3: uniform in [low, high) computed in F32, then
  // rounded to nearest even (F8_E4M3 saturating at +-448); U8: any byte (low and
  // high unused). Other dtypes throw. dst needs no particular alignment. (The dummy
  // load format's weights.)
  virtual void fill_random(std::byte* dst, std::size_t count, DType dtype, double low, double high,
                           std::uint64_t seed) = 0;

  // Sets `bytes` bytes to zero.
  virtual void zero(std::byte* dst, std::size_t bytes) = 0;

  // Converts `count` elements between BF16, F16 and F32 (any pair), device to device.
  // Rounding is to nearest, ties to even; subnormals are kept (no flush to zero);
  // values beyond the target's range become infinity. A NaN input becomes the
  // canonical quiet NaN of the target type with the input's sign (0x7FC0 BF16,
  // 0x7E00 F16, 0x7FC00000 F32, sign bit added), so that all backends agree on the
  // bytes. Same dtype on both sides is a plain copy (NaN payloads kept). Other
  // dtypes throw. The ranges must not overlap, except dst == src with equal element
  // sizes (in place). No alignment needed.
  virtual void cast(std::byte* dst, DType dst_dtype, const std::byte* src, DType src_dtype,
                    std::size_t count) = 0;

  // The pitched forms of zero, cast and a device-to-device copy: one operation over
  // `rows` rows (CUDA: one cudaMemset2DAsync or one kernel launch, not one call a
  // row). Row r of the destination starts at dst + r*dst_pitch, of the source at
  // src + r*src_pitch; bytes between rows are left as they were. Pitches must be at
  // least the row's bytes. Source and destination must not overlap (cast_2d: except
  // dst == src with equal pitches and element sizes, in place).
  virtual void zero_2d(std::byte* dst, std::size_t dst_pitch, std::size_t width_bytes,
                       std::size_t rows) = 0;

  // Sets `bytes` bytes to `value` (CUDA: one cudaMemsetAsync): a fill whose element
  // is one repeated byte, e.g. an FP8 sentinel, with no host source to keep alive.
  virtual void set_bytes(std::byte* dst, std::byte value, std::size_t bytes) = 0;

  // For each of the `count` ranges of the table at `ranges` (device memory holding
  // PatternRange entries, aligned for PatternRange: 8 bytes; else it throws), writes flags[i] = 1 when every whole element of range i
  // equals its pattern, else 0 (one pass on the device, CUDA: one kernel launch for
  // all ranges; the flags are device memory, `count` bytes, read back with
  // copy_d2h). Element j of a range is the element_size bytes at data +
  // j*element_size (any alignment); a range of no whole element (bytes <
  // element_size) is all pattern (1); trailing bytes past the last whole element
  // are not looked at. element_size is 1, 2, 4 or 8 (else the backend that can read
  // the table throws; CUDA writes 0). (The capture-safe startup's sentinel check.)
  virtual void match_pattern(const PatternRange* ranges, std::size_t count,
                             std::uint8_t* flags) = 0;
  // `width` elements a row, converted as cast() does.
  virtual void cast_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype, const std::byte* src,
                       std::size_t src_pitch, DType src_dtype, std::size_t width,
                       std::size_t rows) = 0;
  // Dequantizes `rows` rows of `width` elements stored as GGML blocks of `blocks`
  // (width a whole number of its blocks: a source row is ggml_row_bytes(blocks, width)
  // bytes, row r at src + r*src_pitch) into dst_dtype (BF16, F16 or F32): each element
  // is ggml_block_element()'s float32, rounded once to dst_dtype as cast() rounds
  // F32. Source and destination must not overlap. No alignment needed. A NaN element
  // (from a NaN or infinite block scale) becomes the target's canonical quiet NaN,
  // positive: the sign of a NaN that arithmetic makes differs between CPUs and GPUs.
  virtual void dequantize_ggml_2d(std::byte* dst, std::size_t dst_pitch, DType dst_dtype,
                                  const std::byte* src, std::size_t src_pitch, GgmlBlocks blocks,
                                  std::size_t width, std::size_t rows) = 0;
  // Device to device, `width_bytes` a row: how narrow rows copied contiguously into
  // device scratch are gathered into their parameter (CUDA: a kernel).
  virtual void copy_d2d_2d(std::byte* dst, std::size_t dst_pitch, const std::byte* src,
                           std::size_t src_pitch, std::size_t width_bytes, std::size_t rows) = 0;

  // Batched transpose, device to device: for each b < batches, the dense row-major
  // rows x cols matrix of `element_size`-byte elements (1, 2, 4 or 8) at
  // src + b*src_batch_pitch is written as the dense cols x rows matrix at
  // dst + b*dst_batch_pitch. Only bytes move. No overlap allowed. (The MLA split
  // builds w_kc with it, on the device.)
  virtual void transpose(std::byte* dst, std::size_t dst_batch_pitch, const std::byte* src,
                         std::size_t src_batch_pitch, std::size_t element_size, std::size_t rows,
                         std::size_t cols, std::size_t batches) = 0;

  // ---- FP8 E4M3 after loading (gpu/fp8.hpp) ----------------------------------------
  // What the quantized MLA split, the V3.2 indexer fusion, quantization.requant and
  // quantization.online run, on the device: no weight comes back to the host. Each
  // works on `batches` dense row-major rows x cols matrices, matrix after matrix,
  // with F32 scales laid out as `scales` says (fp8::scale_count a matrix, dense).
  // Pointers need no alignment. No two ranges may overlap. A kBlock layout needs
  // block sizes > 0; otherwise the call throws, as for other dtypes than the ones
  // named.

  // dst[b][r][c] = e4m3(src[b][r][c]) * scale of (r, c), computed in F32
  // (fp8::dequantize_one: a NaN result is the canonical NaN with the NaN operand's
  // sign) and rounded once to dst_dtype (BF16, F16 or F32) as cast() rounds. `scale`
  // is read as F32; kTensor reads one scale a matrix (tensor_repeat is ignored).
  virtual void dequantize_fp8(std::byte* dst, DType dst_dtype, const std::byte* src,
                              const std::byte* scale, const Fp8Scales& scales, std::size_t rows,
                              std::size_t cols, std::size_t batches) = 0;

  // Quantizes BF16 / F16 / F32 `src` to E4M3 `dst`: every group of elements sharing
  // a scale (a matrix, a row, a tile) gets (s, m) = fp8::scale_for(its amax, rule);
  // each element becomes e4m3(f32(x) * m) and the group's F32 slot of `scale` holds
  // s (kTensor: tensor_repeat copies a matrix). The amax reductions run on the
  // device: kTensor uses its scale slots as the accumulator (they are written
  // before they are final: nothing else may read them until the operation is done),
  // so no scratch and no host round trip is needed.
  virtual void quantize_fp8(std::byte* dst, std::byte* scale, const std::byte* src, DType src_dtype,
                            const Fp8Scales& scales, Fp8ScaleRule rule, std::size_t rows,
                            std::size_t cols, std::size_t batches) = 0;

  // DeepGEMM's packed UE8M0 block scales (SGLang's transform_scale_ue8m0): from
  // `batches` F32 block-scale matrices [ceil(rows / block_rows), scale_cols] at
  // `scale`, writes per matrix ceil(scale_cols / 4) * rows I32 words at `dst`,
  // MN-major: word (w, r) at w * rows + r holds the exponent bytes (F32 bits >> 23)
  // of the scales of column blocks 4w .. 4w + 3 of row r's block row,
  // little-endian, zero past scale_cols (fp8::ue8m0_word). block_rows > 0.
  virtual void pack_ue8m0(std::byte* dst, const std::byte* scale, std::size_t rows,
                          std::size_t block_rows, std::size_t scale_cols, std::size_t batches) = 0;

  // Marlin's NVFP4 layouts (gpu/marlin.hpp), device to device, no overlap: the
  // packed E2M1 weight [n, k / 2] bytes at `src` as gptq_marlin_repack leaves it,
  // [k / 16, 2n] 32-bit words at `dst` (n % 64 == 0, k % 16 == 0); the E4M3 block
  // scales [n, groups] at `src` as marlin_permute_scales and
  // nvfp4_marlin_process_scales leave them, [groups, n] bytes at `dst` (n % 64 ==
  // 0). Other sizes throw.
  virtual void repack_marlin_fp4(std::byte* dst, const std::byte* src, std::size_t n,
                                 std::size_t k) = 0;
  virtual void marlin_fp4_scales(std::byte* dst, const std::byte* src, std::size_t n,
                                 std::size_t groups) = 0;

  // An event that completes when everything queued so far has finished.
  virtual std::unique_ptr<Event> record() = 0;

  // Blocks until everything queued so far has finished.
  virtual void synchronize() = 0;

  // Ends the waits that only emulate time, for good: the host backend's bandwidth cap
  // (its copies land at once; events and synchronize() then wait for the emulated
  // link). From the call on, synchronize() and the events recorded on this stream
  // wait only for work still to run, and a thread already sleeping in one of them
  // wakes at once. How a stopped load (cancel, failure) gets past a link slow enough
  // to take minutes. Thread-safe: any thread, while another waits. Backends whose
  // waits are real (CUDA: a copy in flight still reads its buffer): nothing.
  virtual void abandon_emulated_waits() {}
};

class Device {
 public:
  virtual ~Device() = default;

  // "host:0", "cuda:1": used in every error message.
  virtual std::string name() const = 0;

  // Called once by each thread that will drive this device (the copy worker, on its
  // own thread, before anything else). CUDA: cudaSetDevice. Host: nothing. Other
  // methods also work from an unbound thread; bind() saves them a device switch.
  virtual void bind() = 0;

  // `bytes` bytes of device memory, kDeviceAlignment-aligned, contents undefined.
  // bytes == 0 gives an empty handle and counts nothing. Throws when out of memory.
  virtual DeviceAllocation allocate(std::size_t bytes) = 0;

  // Takes `bytes` bytes at `data` that the embedding engine allocated for this
  // device (device memory the backend can copy into: host memory for the host
  // backend), tracking them like its own allocations; when the handle dies the
  // device stops tracking them and calls `release` (which gives them back to the
  // engine). Fails (Stage::kCopy) for a null pointer, or where the backend cannot
  // use foreign memory (null devices). bytes == 0 gives an empty handle.
  virtual DeviceAllocation adopt(std::byte* data, std::size_t bytes,
                                 DeviceAllocation::Release release) = 0;

  // `bytes` bytes of page-locked host memory, kPinnedAlignment-aligned.
  // bytes == 0 gives an empty handle.
  virtual PinnedAllocation allocate_pinned(std::size_t bytes) = 0;

  // Pins an existing host buffer (for example a staging pool's) until the handle
  // dies. The buffer must outlive the handle. bytes == 0 gives an empty handle.
  virtual HostRegistration register_host(void* host, std::size_t bytes) = 0;

  virtual std::unique_ptr<Stream> create_stream() = 0;

  // Makes the device's event pool hold at least `count` free events, so that as
  // many record() (and synchronize()) calls outstanding at once create none: what
  // a capture-safe load reserves before it streams (actors::prepare_resources).
  // Each new stream reserves 16. Backends without a pool: nothing.
  virtual void reserve_events(std::size_t count) { (void)count; }

  // A snapshot of the allocation counters.
  virtual AllocationStats stats() const = 0;

  // ---- sharing with other processes (the weight cache) ------------------------------
  // The shareable block that holds device pointer `p`, or nullopt when this device's
  // memory cannot be shared (the default; host devices made without
  // HostDeviceOptions::shared_memory; memory adopted from an engine).
  virtual std::optional<SharedBlock> shared_block(const std::byte* p) const {
    (void)p;
    return std::nullopt;
  }
  // From now on no new mapping of this device's shared blocks may write them, and no
  // write(2) may change them (memfd: F_SEAL_FUTURE_WRITE; the device's own mapping
  // stays writable). CUDA IPC has no such seal: nothing.
  virtual void seal_shared() {}
  // Maps a block another process shared (`fd`: its descriptor, for memfd) into this
  // device's memory, read-only where the backend can enforce it (host: PROT_READ),
  // tracked like an allocation and unmapped when the handle dies. Throws
  // Error(Stage::kCopy) where the backend cannot map that kind (the default).
  virtual DeviceAllocation map_shared(const SharedBlock& block, int fd);
  // The GPU's UUID ("GPU-xxxxxxxx-xxxx-..."), the identity a CUDA IPC handle is tied
  // to whatever CUDA_VISIBLE_DEVICES says; "" for devices that are not GPUs.
  virtual std::string uuid() const { return {}; }

  // False for a device that keeps no bytes (the null backend, gpu/null_device.hpp):
  // its copies are checked and counted but discarded, so nothing can be read back,
  // and work that needs parameter memory (post-load hooks, dumps) cannot run on it.
  virtual bool holds_data() const { return true; }

  // True when this device's parameter memory is host memory that a file read may
  // land in directly, with nothing to emulate on the way (the host backend without
  // a bandwidth cap): the load pipeline's single-copy reads (io.direct_to_device).
  // False for GPUs (no mapped host memory) and for devices that keep no data.
  virtual bool host_addressable() const { return false; }

  // The NUMA node the device is attached to (a GPU's PCI node), or -1 when unknown
  // or not meaningful (host devices): where staging feeding it is best allocated.
  virtual int numa_node() const { return -1; }

  // Host-to-device pitched copies with rows narrower than this many bytes move
  // slowly on this device's link (a DMA engine pays per row): the copy worker copies
  // such a slice's source span contiguously into device scratch and gathers the
  // rows on the device instead (actors::fragment_copy). 0: every width is fine
  // (host memory; the null device). CUDA: 64 KiB.
  virtual std::size_t narrow_row_bytes() const { return 0; }
};

// A CUDA IPC handle's bytes as lower-case hex, and back: nullopt unless `hex` is
// exactly 2 * bytes hex digits (what a client is sent is checked before use).
std::string to_hex(const void* data, std::size_t bytes);
std::optional<std::string> from_hex(const std::string& hex, std::size_t bytes);
// A GPU's 16-byte UUID as nvidia-smi writes it: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
std::string gpu_uuid_text(const unsigned char* uuid16);

// True for the element types cast() converts: BF16, F16, F32.
bool castable_dtype(DType dtype);
// True for the element types fill() writes: BF16, F16, F32, F64.
bool fillable_dtype(DType dtype);
// The dtypes fill_random() writes: BF16, F16, F32, F8_E4M3, U8.
bool random_fillable_dtype(DType dtype);

}  // namespace ferry::gpu
