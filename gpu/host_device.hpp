// The host backend: emulated devices whose memory is host RAM and whose copies run
// on the calling thread (the copy worker's), with non-temporal stores as a DMA
// engine would write. It is the reference every other backend is compared with,
// and the backend every test runs on.
//
// Beyond what a GPU does, it checks: every device pointer a stream is given must
// lie inside a live allocation of that device (else ferry::Error), so a pipeline
// bug that would silently corrupt GPU memory fails loudly here. Optional: a capacity
// (allocation beyond it fails like out-of-memory), a bandwidth cap that makes
// host-to-device copies no faster than a link of that speed, and poisoning of new
// allocations so that bytes a load never wrote are visible.
//
// Bytes land synchronously: memory is written when the call returns. Without a
// bandwidth cap an event is complete when record() returns. With one, each stream
// books its host-to-device transfers on the device's emulated link (see
// gpu/link_throttle.hpp) and its events and synchronize() complete when the link
// has carried everything queued before them, without holding the caller meanwhile:
// the timing a CUDA stream's copy engine shows the copy worker. Those waits are
// emulated time only, so Stream::abandon_emulated_waits ends them at once (a stopped
// load does not wait for a slow link).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "gpu/device.hpp"

namespace ferry::gpu {

struct HostDeviceOptions {
  // Emulated host-to-device link in GB/s (1e9 bytes/s), shared by all streams of
  // the device; 0 = as fast as memcpy. Device-to-host copies are not capped.
  double bandwidth_gbps = 0;
  // Device memory the emulated device has; 0 = unlimited. An allocation that would
  // take the live total past it throws, like cudaMalloc running out of memory.
  std::size_t capacity_bytes = 0;
  // Fill each new device allocation with kPoisonByte (cudaMalloc gives garbage;
  // fresh host pages would read as zeros and hide missing writes).
  bool poison_allocations = false;
  // Run every stream operation later, in order, on a thread of the stream, as a DMA
  // engine would (each about 100 us after the one before); events and
  // synchronize() complete when the work queued before them has run. Argument
  // checks still happen at the call. With it, a pipeline that gives a staging
  // buffer back before the copy reading it has run copies whatever the buffer
  // holds by then (see io::StagingPool::poison_on_return): host.deferred_copies.
  bool deferred_copies = false;
  // With deferred_copies: called (on the stream's thread) for each host-to-device
  // copy whose source bytes changed between the call and the moment the copy ran,
  // naming the operation: the caller broke the Stream contract (a host buffer must
  // stay unchanged until an event after the copy completes), e.g. a staging buffer
  // given back to its pool, and poisoned there, while a copy still read it. The
  // source is fingerprinted when the copy is queued (every byte of up to 64 KiB,
  // else samples across it) and again before it runs. Empty: not checked.
  std::function<void(const std::string& what)> on_changed_source = nullptr;
  // Ask for transparent huge pages (MADV_HUGEPAGE) for large allocations. Off by
  // default: on the virtual machines measured, committing 2.2 GB in huge pages
  // took 4.4-4.9 s in the usual state (free memory handed back to the hypervisor)
  // against 0.6 s in 4 KiB pages, and saved 0.3 s only right after another process
  // freed huge pages (docs/PERFORMANCE.md, read width).
  bool huge_pages = false;
  // Emulate a DMA link that pays per row: Device::narrow_row_bytes() returns this,
  // so the copy worker gathers narrower row slices through device scratch as it
  // does on CUDA (64 KiB there). 0: every width is fine (host memory is).
  std::size_t narrow_row_bytes = 0;
  // Every device allocation is a memfd of its own, mapped shared, so that
  // Device::shared_block can hand it to another process (`ferry serve`). Small
  // blocks then cost a page each and a descriptor; off by default.
  bool shared_memory = false;
};

inline constexpr std::byte kPoisonByte{0xA5};

// Emulates another thread of the engine capturing a CUDA graph in global mode
// (PyTorch's default), for tests of capture safety. While one lives, every host
// device refuses, with a ferry::Error that says so, what CUDA would refuse or what
// would break the capture: allocate, allocate_pinned, register_host,
// create_stream, reserve_events; a record() or synchronize() that finds its
// device's event pool empty (CUDA would create an event); and an event query or
// wait, or a stream synchronize(), on a thread that never called bind() (CUDA:
// a thread not in cudaStreamCaptureModeRelaxed). Host devices model the CUDA
// event pool for this: each stream reserves 16 events, reserve_events more, a
// live event holds one. Process-wide; guards may nest.
class HostCaptureGuard {
 public:
  HostCaptureGuard();
  ~HostCaptureGuard();
  HostCaptureGuard(const HostCaptureGuard&) = delete;
  HostCaptureGuard& operator=(const HostCaptureGuard&) = delete;
  static bool active();
};

// Emulated device "host:<index>". Throws ferry::Error (Stage::kConfig) for a
// negative index or a bandwidth that is negative, infinite or NaN.
std::shared_ptr<Device> make_host_device(int index, const HostDeviceOptions& options = {});

}  // namespace ferry::gpu
