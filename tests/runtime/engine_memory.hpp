// An engine's Allocator for tests: host memory from aligned_alloc, counted per
// device, that checks every release against what it handed out.
#pragma once

#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "runtime/api_internal.hpp"

namespace ferry::testing {

class EngineMemory : public runtime::Allocator {
 public:
  void* allocate(const std::string& device, std::size_t bytes, std::size_t alignment) override {
    std::lock_guard lock(mu_);
    if (fail_after_ >= 0 && calls_ >= fail_after_) {
      throw std::runtime_error("engine pool exhausted");
    }
    ++calls_;
    void* p = std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
    live_[p] = {device, bytes};
    return p;
  }
  void release(const std::string& device, void* data, std::size_t bytes) noexcept override {
    std::lock_guard lock(mu_);
    auto it = live_.find(data);
    if (it == live_.end() || it->second.first != device || it->second.second != bytes) {
      ++bad_releases_;
      return;
    }
    live_.erase(it);
    std::free(data);
  }
  // Whether [p, p + bytes) lies in one live allocation of `device`.
  bool holds(const std::string& device, const void* p, std::size_t bytes) const {
    std::lock_guard lock(mu_);
    for (const auto& [base, owner] : live_) {
      const auto* b = static_cast<const std::byte*>(base);
      const auto* q = static_cast<const std::byte*>(p);
      if (owner.first == device && q >= b && q + bytes <= b + owner.second) {
        return true;
      }
    }
    return false;
  }
  std::size_t live() const {
    std::lock_guard lock(mu_);
    return live_.size();
  }
  int calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  int bad_releases() const {
    std::lock_guard lock(mu_);
    return bad_releases_;
  }
  void fail_after(int calls) { fail_after_ = calls; }

 private:
  mutable std::mutex mu_;
  std::map<void*, std::pair<std::string, std::size_t>> live_;
  int calls_ = 0;
  int bad_releases_ = 0;
  int fail_after_ = -1;
};

}  // namespace ferry::testing
