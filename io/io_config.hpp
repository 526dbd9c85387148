// The io and prefetch sections of the load configuration (runtime/load_config.hpp
// builds them from its keys: runtime/config_keys.cpp), as the read pipeline takes
// them (actors::PipelineOptions): one definition for both.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/small_file.hpp"
#include "io/reader.hpp"

namespace ferry::io {

struct IoConfig {
  io::Engine engine = io::Engine::kUring;  // uring (falls back to pread) or pread
  // Defaults measured best from the page cache (docs/PERFORMANCE.md): 1 MiB
  // buffers keep the pool (8 MiB) in the CPU caches between the reader's kernel
  // copy and the copy workers; cold O_DIRECT reads prefer queue_depth 16 x 4 MiB.
  // GPUs take other defaults, sized for their link (runtime::io_auto).
  // Reader threads, each with its own ring, staging and whole files (or large
  // spans of one file); 0 = auto (io_auto: min(cores, weight files read, 4) on
  // host devices).
  unsigned read_lanes = 0;
  unsigned queue_depth = 4;  // reads in flight per lane
  // One read and one staging buffer. The key's default is "auto", which build()
  // resolves by the devices (io_auto: 1 MiB on host devices, 16 MiB on GPUs).
  std::size_t chunk_bytes = std::size_t{1} << 20;
  bool chunk_bytes_auto = true;  // chunk_bytes is io_auto's (to_json writes "auto")
  // Host staging memory for all lanes together, split evenly across them in
  // chunk_bytes buffers; 0 = auto (io_auto: 8 MiB per local host device). (Replaces
  // staging_buffers.)
  std::size_t staging_bytes = 0;
  // Reads that are one contiguous run of one host device's param land there with
  // no staging: auto (where possible with two lanes or more), on (wherever
  // possible; fail when no device can), off.
  io::DirectToDevice direct_to_device = io::DirectToDevice::kAuto;
  bool direct = false;      // O_DIRECT reads (skip the page cache)
  bool drop_cache = false;  // evict the files from the page cache first (cold-cache runs)
  // When a load stops early, how long the reader waits for the reads it asked the
  // kernel to cancel; a read still there after it is reported and its buffers are
  // leaked instead of waited for (a hung file system must not hang the engine).
  std::uint64_t cancel_timeout_ms = 5000;
  // The most bytes of a metadata file ferry reads whole: config.json,
  // hf_quant_config.json, the safetensors index, an EPLB map (common/small_file.hpp);
  // larger ones, and anything not a regular file, are refused. ferry's own config file
  // is read with the default, before this key is known.
  std::uint64_t max_metadata_bytes = kDefaultMaxMetadataBytes;
  bool operator==(const IoConfig&) const = default;
};

struct PrefetchConfig {
  bool enabled = false;  // warm the page cache ahead of the reader with worker threads
  unsigned threads = 4;  // prefetch worker threads
  std::size_t block_bytes = std::size_t{16} << 20;     // one prefetch pread
  std::uint64_t ahead_bytes = std::uint64_t{1} << 30;  // how far past the reader; 0 = no bound
  bool operator==(const PrefetchConfig&) const = default;
};

}  // namespace ferry::io
