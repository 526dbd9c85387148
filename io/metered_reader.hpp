// A Reader decorator that reports what an observer (runtime metrics) wants to know:
// how many reads are in flight, and how long each took from submit() until poll()
// returned it. The reads themselves, their order and their errors are the inner
// reader's, untouched.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/reader.hpp"

namespace ferry::io {

struct ReadObserver {
  // After every submit() and every poll() that returned something.
  std::function<void(std::size_t in_flight)> on_in_flight;
  // Per op poll() returned: when it was submitted and returned, its file and
  // bytes, and whether it failed.
  std::function<void(const ReadOp& op, std::chrono::steady_clock::time_point submitted,
                     std::chrono::steady_clock::time_point completed, bool failed)>
      on_read;
};

class MeteredReader final : public Reader {
 public:
  MeteredReader(std::unique_ptr<Reader> inner, ReadObserver observer);

  void submit(const ReadOp& op) override;
  std::size_t poll(std::vector<Completion>& out, std::chrono::milliseconds wait) override;
  std::size_t outstanding() const override { return inner_->outstanding(); }
  const ReaderStats& stats() const override { return inner_->stats(); }
  std::string name() const override { return inner_->name(); }
  bool cancel(std::chrono::milliseconds bound) noexcept override {
    const bool over = inner_->cancel(bound);
    if (over) {
      pending_.clear();  // their completions were discarded
    }
    return over;
  }

 private:
  struct Pending {
    std::chrono::steady_clock::time_point submitted;
    ReadOp op;
  };
  std::unique_ptr<Reader> inner_;
  ReadObserver observer_;
  std::unordered_map<std::uint64_t, Pending> pending_;  // by tag
};

}  // namespace ferry::io
