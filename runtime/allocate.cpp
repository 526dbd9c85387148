// Where a load's memory comes from: the devices (made from the config, or the test
// seams'), every parameter (an arena per local rank, or the engine's Allocator one
// call a parameter), load-only params, what hooks reallocate, and pinned staging
// memory for CUDA devices.
#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/log.hpp"
#include "common/thread_start.hpp"
#include "gpu/backends.hpp"
#include "gpu/metered_device.hpp"
#include "io/file.hpp"
#include "io/numa.hpp"
#include "io/staging_pool.hpp"
#include "runtime/load_work.hpp"

namespace ferry::runtime {

namespace {

// Staging memory that CUDA copies read without staging it again: pinned host
// memory of a CUDA device (portable, so every device's copies may use it).
class PinnedStagingAllocator final : public io::BufferAllocator {
 public:
  // node >= 0: the pages are placed on that NUMA node (bound, then touched) before
  // they are pinned, since pinned pages cannot move; else allocate_pinned.
  explicit PinnedStagingAllocator(std::shared_ptr<gpu::Device> device, int node = -1)
      : device_(std::move(device)),
        node_(node),
        host_(node >= 0 ? io::numa_allocator(io::aligned_host_allocator(), node) : nullptr) {}

  void* allocate(std::size_t bytes, std::size_t alignment) override {
    if (alignment > gpu::kPinnedAlignment) {
      return nullptr;
    }
    if (host_) {
      void* p = host_->allocate(bytes, alignment);
      if (p == nullptr) {
        return nullptr;
      }
      std::memset(p, 0, bytes);  // first touch: the pages land on the node
      gpu::HostRegistration pinned;
      try {
        pinned = device_->register_host(p, bytes);
      } catch (...) {
        host_->deallocate(p, bytes);
        throw;
      }
      std::lock_guard lock(mu_);
      placed_.emplace(p, std::move(pinned));
      return p;
    }
    gpu::PinnedAllocation a = device_->allocate_pinned(bytes);
    void* p = a.data();
    std::lock_guard lock(mu_);
    live_.emplace(p, std::move(a));
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    std::lock_guard lock(mu_);
    live_.erase(p);
    if (auto it = placed_.find(p); it != placed_.end()) {
      placed_.erase(it);  // unpins before the memory goes
      host_->deallocate(p, bytes);
    }
  }
  std::string name() const override {
    return "pinned memory of " + device_->name() +
           (node_ >= 0 ? " on NUMA node " + std::to_string(node_) : "");
  }

 private:
  std::shared_ptr<gpu::Device> device_;
  int node_;
  std::shared_ptr<io::BufferAllocator> host_;  // node-bound host memory; null: allocate_pinned
  std::mutex mu_;
  std::map<void*, gpu::PinnedAllocation> live_;
  std::map<void*, gpu::HostRegistration> placed_;  // host_'s buffers, pinned
};

// `bytes` bytes of the engine's memory for `device`, tracked by the device and given
// back to the engine when the handle dies.
gpu::DeviceAllocation engine_allocation(const std::shared_ptr<Allocator>& allocator,
                                        gpu::Device& device, std::size_t bytes) {
  const std::string name = device.name();
  void* p = nullptr;
  try {
    p = allocator->allocate(name, bytes, gpu::kDeviceAlignment);
  } catch (const std::exception& e) {
    throw Error(Stage::kCopy, name, "", std::string("the engine's Allocator refused: ") + e.what());
  } catch (...) {
    throw Error(Stage::kCopy, name, "",
                "the engine's Allocator refused with an exception that is not a std::exception");
  }
  if (p == nullptr) {
    throw Error(Stage::kCopy, name, "", "the engine's Allocator returned null");
  }
  auto give_back = [allocator, name](std::byte* data, std::size_t size) {
    allocator->release(name, data, size);
  };
  if (reinterpret_cast<std::uintptr_t>(p) % gpu::kDeviceAlignment != 0) {
    give_back(static_cast<std::byte*>(p), bytes);
    throw Error(Stage::kCopy, name, "",
                "the engine's Allocator returned memory not aligned to " +
                    std::to_string(gpu::kDeviceAlignment) + " bytes");
  }
  try {
    return device.adopt(static_cast<std::byte*>(p), bytes, give_back);
  } catch (...) {
    give_back(static_cast<std::byte*>(p), bytes);
    throw;
  }
}

}  // namespace

// `bytes` bytes of memory for `spec` on `device`: from the engine's Allocator when
// there is one, else from the device.
gpu::DeviceAllocation allocate_param(const std::shared_ptr<Allocator>& allocator,
                                     gpu::Device& device, const models::ParamSpec& spec) {
  try {
    return allocator && spec.nbytes != 0 ? engine_allocation(allocator, device, spec.nbytes)
                                         : device.allocate(spec.nbytes);
  } catch (const Error& e) {
    throw Error(Stage::kCopy, device.name(), spec.name,
                "allocating " + std::to_string(spec.nbytes) + " bytes: " + e.rule());
  }
}

gpu::DeviceAllocation allocate_shareable(gpu::Device& device, const models::ParamSpec& spec,
                                         std::size_t granule) {
  if (spec.nbytes == 0) {
    return {};
  }
  const std::size_t rounded = (spec.nbytes + granule - 1) / granule * granule;
  std::shared_ptr<gpu::DeviceAllocation> block;
  try {
    block = std::make_shared<gpu::DeviceAllocation>(device.allocate(rounded));
  } catch (const Error& e) {
    throw Error(Stage::kCopy, device.name(), spec.name,
                "allocating " + std::to_string(rounded) + " bytes: " + e.rule());
  }
  return gpu::DeviceAllocation(block->data(), spec.nbytes, [block](std::byte*, std::size_t) {});
}

std::shared_ptr<io::BufferAllocator> pinned_staging_allocator(std::shared_ptr<gpu::Device> device,
                                                              int node) {
  return std::make_shared<PinnedStagingAllocator>(std::move(device), node);
}

namespace {

// What a sharing runtime (the weight-cache daemon's) rounds every block of params up
// to: NVIDIA's advice for memory shared by CUDA IPC.
constexpr std::size_t kShareGranule = std::size_t{2} << 20;

// A load-only param (ParamSpec::transient) of its own allocation, so that it can
// be freed before the others; with load.layered none yet (its first write does it).
gpu::DeviceAllocation allocate_transient(gpu::Device& device, const models::ParamSpec& spec,
                                         bool layered) {
  return layered ? gpu::DeviceAllocation{} : allocate_param(nullptr, device, spec);
}

// Every param of one local rank from one allocation of its device (an arena), each
// at a kDeviceAlignment boundary: one cudaMalloc per device instead of one per
// param. A param's handle keeps the arena alive; the arena goes with the last. An
// empty param gets an empty handle. Should the device refuse the one large block
// (a fragmented GPU), the params are allocated one by one, so that a real
// shortage fails naming the param that did not fit. Transient params are not in the
// arena (allocate_transient).
// `granule` > 1 (a sharing runtime's): every block that holds params is a multiple of
// it, so that what a CUDA IPC handle shares is the params' block alone (CUDA may place
// a small cudaMalloc inside a larger block, and IPC shares the whole of that).
std::vector<gpu::DeviceAllocation> allocate_rank(gpu::Device& device,
                                                 const std::vector<models::ParamSpec>& params,
                                                 bool layered, std::size_t granule) {
  std::vector<std::uint64_t> offsets;
  std::uint64_t end = 0;
  for (const models::ParamSpec& spec : params) {
    const std::uint64_t at =
        (end + gpu::kDeviceAlignment - 1) / gpu::kDeviceAlignment * gpu::kDeviceAlignment;
    offsets.push_back(at);
    end = spec.transient ? at : at + spec.nbytes;
  }
  std::vector<gpu::DeviceAllocation> out;
  std::shared_ptr<gpu::DeviceAllocation> arena;
  try {
    arena = std::make_shared<gpu::DeviceAllocation>(
        device.allocate((end + granule - 1) / granule * granule));
  } catch (const Error& e) {
    log::warn(device.name() + ": one block of " + std::to_string(end) + " bytes for " +
              std::to_string(params.size()) +
              " parameters was refused; allocating them one by one (" + e.rule() + ")");
    for (const models::ParamSpec& spec : params) {
      out.push_back(spec.transient ? allocate_transient(device, spec, layered)
                    : granule > 1  ? allocate_shareable(device, spec, granule)
                                   : allocate_param(nullptr, device, spec));
    }
    return out;
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].transient) {
      out.push_back(allocate_transient(device, params[i], layered));
    } else if (params[i].nbytes == 0) {
      out.emplace_back();
    } else {
      out.emplace_back(arena->data() + offsets[i], params[i].nbytes,
                       [arena](std::byte*, std::size_t) {});
    }
  }
  return out;
}

// Each local rank's params: from the engine's Allocator on this thread, one call a
// param (it is called from the loading thread only), or else from an arena per
// rank, the ranks set up in parallel, a thread each (a GPU's first allocation also
// creates its context, which takes a while per device). On failure everything
// allocated is given back and the first rank's error is thrown.
std::vector<std::vector<gpu::DeviceAllocation>> allocate_ranks(
    const std::shared_ptr<Allocator>& allocator,
    const std::vector<std::shared_ptr<gpu::Device>>& devices,
    const std::vector<models::RankShell>& shells, bool layered, std::size_t granule) {
  std::vector<std::vector<gpu::DeviceAllocation>> out(shells.size());
  if (allocator) {
    for (std::size_t r = 0; r < shells.size(); ++r) {
      for (const models::ParamSpec& spec : shells[r].params) {
        out[r].push_back(spec.transient ? allocate_transient(*devices[r], spec, layered)
                                        : allocate_param(allocator, *devices[r], spec));
      }
    }
    return out;
  }
  // What a failing rank allocated goes with `out`.
  run_each("allocation rank", shells.size(), [&](std::size_t r) {
    devices[r]->bind();
    out[r] = allocate_rank(*devices[r], shells[r].params, layered, granule);
  });
  return out;
}

}  // namespace

void Runtime::Impl::make_devices(LoadWork& w) {
  LoadedModel::State& state = *w.state;
  const auto& shells = w.model->shells();
  if (!seams.devices.empty()) {
    state.devices = seams.devices;
  } else {
    gpu::HostDeviceOptions host;
    host.bandwidth_gbps = config.host.bandwidth_gbps;
    host.huge_pages = config.host.huge_pages;
    host.deferred_copies = config.host.deferred_copies;
    host.narrow_row_bytes = config.host.narrow_row_bytes;
    host.shared_memory = share_devices;
    state.devices = gpu::make_devices(to_string(config.devices), host);
  }
  if (state.devices.size() != shells.size()) {
    throw Error(Stage::kConfig, "", "",
                std::to_string(state.devices.size()) + " device(s) for " +
                    std::to_string(shells.size()) +
                    " local rank(s): each local rank needs exactly one device");
  }
  for (std::size_t r = 0; r < shells.size(); ++r) {
    if (!state.devices[r]) {
      throw Error(Stage::kConfig, "", "", "device of local rank " + std::to_string(r) + " is null");
    }
  }
  w.metrics = current_metrics();
  for (auto& d : state.devices) {
    if (w.metrics) {
      d = gpu::metered_device(d, w.metrics->copy_observer());
    }
    if (w.trace) {
      d = gpu::metered_device(d, w.trace->copy_observer());
    }
  }
}

void Runtime::Impl::allocate(LoadWork& w, LoadHandle::State& handle) {
  handle.phase.store(LoadPhase::kAllocate);
  LoadedModel::State& state = *w.state;
  const auto& shells = w.model->shells();
  state.storage = allocate_ranks(allocator, state.devices, shells, config.load.layered,
                                 share_devices ? kShareGranule : 1);
  for (std::size_t r = 0; r < shells.size(); ++r) {
    gpu::Device& device = *state.devices[r];
    LoadedRank rank;
    rank.tp_rank = shells[r].tp_rank;
    rank.pp_rank = config.parallel.pp_rank;
    rank.device = device.name();
    for (std::size_t i = 0; i < shells[r].params.size(); ++i) {
      const models::ParamSpec& spec = shells[r].params[i];
      const gpu::DeviceAllocation& a = state.storage[r][i];
      LoadedParam p;
      p.name = spec.name;
      p.dtype = spec.dtype;
      p.shape = spec.shape;
      p.strides = spec.strides;
      p.data = a.data();
      p.nbytes = spec.nbytes;
      rank.params.push_back(std::move(p));
    }
    state.ranks.push_back(std::move(rank));
  }
  if (config.io.drop_cache) {
    for (const io::CheckpointFile& f : w.resolved.index.files) {
      io::drop_page_cache(io::File::open(f.path, false, f.name));
    }
  }
  handle.check_cancel();
  w.allocated_at = Clock::now();
  w.span("allocate", w.planned_at, w.allocated_at);
}

void Runtime::Impl::drop_transients(LoadWork& w) {
  std::lock_guard lock(w.state_mu);
  LoadedModel::State& state = *w.state;
  w.report.peak_device_bytes.clear();
  for (const auto& d : state.devices) {
    w.report.peak_device_bytes[d->name()] = d->stats().device.peak_bytes;
  }
  const auto& shells = w.model->shells();
  for (std::size_t r = 0; r < shells.size(); ++r) {
    const auto& params = shells[r].params;
    if (std::none_of(params.begin(), params.end(),
                     [](const models::ParamSpec& p) { return p.transient; })) {
      continue;
    }
    std::vector<LoadedParam> kept;
    std::vector<gpu::DeviceAllocation> storage;
    for (std::size_t p = 0; p < params.size(); ++p) {
      if (!params[p].transient) {
        kept.push_back(std::move(state.ranks[r].params[p]));
        storage.push_back(std::move(state.storage[r][p]));
      }
    }
    state.ranks[r].params = std::move(kept);
    state.storage[r] = std::move(storage);  // the dropped ones' handles free them here
  }
}

std::byte* Runtime::Impl::reallocate(LoadWork& w, std::size_t rank, std::size_t param) {
  const models::ParamSpec& spec = w.model->shells().at(rank).params.at(param);
  std::lock_guard lock(w.state_mu);
  LoadedModel::State& state = *w.state;
  gpu::DeviceAllocation fresh =
      share_devices ? allocate_shareable(*state.devices.at(rank), spec, kShareGranule)
                    : allocate_param(allocator, *state.devices.at(rank), spec);
  std::byte* data = fresh.data();
  state.retired.push_back(std::exchange(state.storage.at(rank).at(param), std::move(fresh)));
  state.ranks.at(rank).params.at(param).data = data;
  return data;
}

}  // namespace ferry::runtime
