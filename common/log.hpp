// The public header (include/ferry/log.hpp) is the definition; ferry's own code
// includes it by this name.
#pragma once

#include <memory>
#include <string_view>
#include <utility>

#include "ferry/log.hpp"

namespace ferry::log {

// Writes the message `make()` builds, from code that must not throw (destructors,
// noexcept failure paths): where building it runs out of memory, `fallback`.
template <class Make>
void write_built(Level level, Make&& make, std::string_view fallback) noexcept {
  try {
    write(level, std::forward<Make>(make)());
  } catch (...) {
    write(level, fallback);
  }
}

// Makes `*sink` this thread's scoped sink (null: none) and returns the one before,
// for a thread hook that cannot keep a ScopedSink alive across its start and end
// calls (CAF's). `*sink` must outlive its use as this thread's sink.
const std::shared_ptr<const Sink>* exchange_thread_sink(
    const std::shared_ptr<const Sink>* sink) noexcept;

}  // namespace ferry::log
