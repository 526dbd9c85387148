// NUMA placement of staging memory: which nodes the system reports, and an
// allocator decorator that binds a buffer's pages to one node before they are first
// touched. Linux only (sysfs and mbind(2), called directly: no libnuma).
//
// Used by the load pipeline for each read lane's staging (io.read_lanes): on a
// machine with several nodes, a lane's buffers live on the node of the devices its
// files mostly feed. On one node (or where sysfs says nothing) nothing is bound.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "io/staging_pool.hpp"

namespace ferry::io {

// The online NUMA nodes under `sysfs` (its node<N> folders), ascending; empty when
// the folder is missing or lists none.
std::vector<int> numa_nodes(const std::string& sysfs = "/sys/devices/system/node");

// Allocations from `base`, with each buffer's pages preferring `node`
// (MPOL_PREFERRED, pages already present moved where the kernel can). A policy the
// kernel refuses is logged once and the memory is used where it is: placement is a
// speed matter, never a failure. `base` must not be null; node >= 0.
std::shared_ptr<BufferAllocator> numa_allocator(std::shared_ptr<BufferAllocator> base, int node);

// The node that backs the page holding `p` (touched memory), or -1 when unknown.
int numa_node_of(const void* p);

// The node of the devices that take most bytes: `rank_bytes[r]` bytes go to a
// device on node `rank_nodes[r]` (-1: unknown, not counted). -1 when no byte goes
// to a device with a known node. Ties go to the lower node.
int preferred_numa_node(const std::vector<unsigned long long>& rank_bytes,
                        const std::vector<int>& rank_nodes);

}  // namespace ferry::io
