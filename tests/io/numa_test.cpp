// NUMA placement of staging memory (io/numa.hpp): the nodes sysfs reports, the
// node that most of a lane's bytes feed, and an allocator whose pages land on the
// node asked for (node 0 exists on every Linux machine, so that part runs here).
#include "io/numa.hpp"

#include <gtest/gtest.h>
#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "testing/temp_dir.hpp"

namespace ferry::io {
namespace {

TEST(Numa, NodesAreTheNodeFoldersOfSysfs) {
  testing::TempDir dir;
  for (const char* name : {"node1", "node0", "node12", "nodex", "possible", "node"}) {
    std::filesystem::create_directories(dir.file(name));
  }
  EXPECT_EQ(numa_nodes(dir.path().string()), (std::vector<int>{0, 1, 12}));
  EXPECT_TRUE(numa_nodes(dir.file("missing")).empty());
  // This machine reports at least node 0 (where sysfs is mounted at all).
  if (std::filesystem::exists("/sys/devices/system/node")) {
    ASSERT_FALSE(numa_nodes().empty());
    EXPECT_EQ(numa_nodes().front(), 0);
  }
}

TEST(Numa, TheLaneGoesWhereMostOfItsBytesGo) {
  EXPECT_EQ(preferred_numa_node({10, 30, 25}, {0, 1, 0}), 0);  // 35 on node 0 against 30
  EXPECT_EQ(preferred_numa_node({10, 30, 5}, {0, 1, 0}), 1);
  EXPECT_EQ(preferred_numa_node({10, 10}, {1, 0}), 0);     // a tie: the lower node
  EXPECT_EQ(preferred_numa_node({10, 10}, {-1, -1}), -1);  // nothing known
  EXPECT_EQ(preferred_numa_node({100, 1}, {-1, 3}), 3);    // unknown nodes do not count
  EXPECT_EQ(preferred_numa_node({}, {}), -1);
}

// The memory policy of the mapping holding `p` (MPOL_DEFAULT, MPOL_PREFERRED, ...).
int policy_of(const void* p) {
  int mode = -1;
  EXPECT_EQ(::syscall(SYS_get_mempolicy, &mode, nullptr, 0, p, MPOL_F_ADDR), 0);
  return mode;
}

TEST(Numa, AllocatedPagesLandOnTheNodeAsked) {
  auto allocator = numa_allocator(aligned_host_allocator(), 0);
  EXPECT_NE(allocator->name().find("NUMA node 0"), std::string::npos);
  const std::size_t bytes = std::size_t{4} << 20;
  void* p = allocator->allocate(bytes, 4096);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, bytes);
  const int node = numa_node_of(p);
  if (node < 0) {
    allocator->deallocate(p, bytes);
    GTEST_SKIP() << "get_mempolicy is not available here";
  }
  EXPECT_EQ(node, 0);
  EXPECT_EQ(numa_node_of(static_cast<char*>(p) + bytes - 1), 0);
  // On one node every page is on node 0 anyway: the policy on the range is what
  // shows the binding happened (plain memory keeps the default policy).
  EXPECT_EQ(policy_of(p), MPOL_PREFERRED);
  EXPECT_EQ(policy_of(static_cast<char*>(p) + bytes - 1), MPOL_PREFERRED);
  void* plain = aligned_host_allocator()->allocate(bytes, 4096);
  std::memset(plain, 1, bytes);
  EXPECT_EQ(policy_of(plain), MPOL_DEFAULT);
  aligned_host_allocator()->deallocate(plain, bytes);
  allocator->deallocate(p, bytes);
  // A staging pool over it works like any other.
  StagingPool pool(3, 8192, numa_allocator(aligned_host_allocator(), 0));
  EXPECT_EQ(pool.total_bytes(), 3u * 8192);
  StagingBuffer b = pool.acquire();
  std::memset(b.data(), 7, b.size());
  EXPECT_EQ(numa_node_of(b.data()), 0);
}

}  // namespace
}  // namespace ferry::io
