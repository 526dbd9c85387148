#include "io/numa.hpp"

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <utility>

#include "common/error.hpp"
#include "common/log.hpp"

namespace ferry::io {
namespace {

constexpr unsigned long kMaxNodes = 1024;  // bits in the node masks passed to the kernel

class NumaAllocator final : public BufferAllocator {
 public:
  NumaAllocator(std::shared_ptr<BufferAllocator> base, int node)
      : base_(std::move(base)), node_(node) {}

  void* allocate(std::size_t bytes, std::size_t alignment) override {
    void* p = base_->allocate(bytes, alignment);
    if (p != nullptr) {
      bind(p, bytes);
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override { base_->deallocate(p, bytes); }
  std::string name() const override {
    return base_->name() + " on NUMA node " + std::to_string(node_);
  }

 private:
  void bind(void* p, std::size_t bytes) const {
    // mbind works on whole pages: the range from p's page to the end of the buffer.
    const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<std::uintptr_t>(p) / page * page;
    const auto end = reinterpret_cast<std::uintptr_t>(p) + bytes;
    unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
    const auto node = static_cast<unsigned long>(node_);
    if (node >= kMaxNodes) {
      warn_once("node " + std::to_string(node_) + " is beyond the node masks ferry passes");
      return;
    }
    mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
    if (::syscall(SYS_mbind, begin, end - begin, MPOL_PREFERRED, mask, kMaxNodes, MPOL_MF_MOVE) !=
        0) {
      warn_once(std::string("mbind: ") + errno_text(errno));
    }
  }
  static void warn_once(const std::string& why) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      log::warn("staging: NUMA placement not applied (" + why + "); buffers stay where they are");
    }
  }

  std::shared_ptr<BufferAllocator> base_;
  int node_;
};

}  // namespace

std::vector<int> numa_nodes(const std::string& sysfs) {
  std::vector<int> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(sysfs, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() > 4 && name.rfind("node", 0) == 0 &&
        std::all_of(name.begin() + 4, name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      out.push_back(std::stoi(name.substr(4)));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::shared_ptr<BufferAllocator> numa_allocator(std::shared_ptr<BufferAllocator> base, int node) {
  return std::make_shared<NumaAllocator>(std::move(base), node);
}

int numa_node_of(const void* p) {
  int node = -1;
  if (::syscall(SYS_get_mempolicy, &node, nullptr, 0, p, MPOL_F_NODE | MPOL_F_ADDR) != 0) {
    return -1;
  }
  return node;
}

int preferred_numa_node(const std::vector<unsigned long long>& rank_bytes,
                        const std::vector<int>& rank_nodes) {
  std::map<int, unsigned long long> by_node;
  for (std::size_t r = 0; r < rank_bytes.size() && r < rank_nodes.size(); ++r) {
    if (rank_nodes[r] >= 0) {
      by_node[rank_nodes[r]] += rank_bytes[r];
    }
  }
  int best = -1;
  unsigned long long most = 0;
  for (const auto& [node, bytes] : by_node) {
    if (best < 0 || bytes > most) {
      best = node;
      most = bytes;
    }
  }
  return best;
}

}  // namespace ferry::io
