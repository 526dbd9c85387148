#include "io/metered_reader.hpp"

#include <utility>

namespace ferry::io {

MeteredReader::MeteredReader(std::unique_ptr<Reader> inner, ReadObserver observer)
    : inner_(std::move(inner)), observer_(std::move(observer)) {}

void MeteredReader::submit(const ReadOp& op) {
  const auto now = std::chrono::steady_clock::now();
  inner_->submit(op);  // a throw leaves nothing pending
  pending_[op.tag] = Pending{now, op};
  if (observer_.on_in_flight) {
    observer_.on_in_flight(inner_->outstanding());
  }
}

std::size_t MeteredReader::poll(std::vector<Completion>& out, std::chrono::milliseconds wait) {
  const std::size_t first = out.size();
  const std::size_t n = inner_->poll(out, wait);
  if (n == 0) {
    return n;
  }
  const auto now = std::chrono::steady_clock::now();
  for (std::size_t i = first; i < out.size(); ++i) {
    auto it = pending_.find(out[i].tag);
    if (it == pending_.end()) {
      continue;  // not submitted through this decorator
    }
    if (observer_.on_read) {
      observer_.on_read(it->second.op, it->second.submitted, now, out[i].error != nullptr);
    }
    pending_.erase(it);
  }
  if (observer_.on_in_flight) {
    observer_.on_in_flight(inner_->outstanding());
  }
  return n;
}

}  // namespace ferry::io
