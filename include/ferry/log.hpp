// Minimal leveled logging to standard error. Engines (and tests) may install a sink
// to capture what was logged: one for the whole process (set_sink), or one for the
// threads doing one piece of work (ScopedSink: a Runtime sets its own on every
// thread of its loads). A sink is called outside the logging lock, from any thread,
// and what it logs itself goes to standard error.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "ferry/export.hpp"

namespace ferry::log {

enum class Level { kDebug, kInfo, kWarn, kError };

using Sink = std::function<void(Level, std::string_view)>;

// Messages below this level are dropped (default kInfo; FERRY_LOG=debug|info|warn|error).
FERRY_API void set_level(Level level);
FERRY_API Level level();

// Replaces the sink (nullptr restores standard error). Returns the previous sink.
FERRY_API Sink set_sink(Sink sink);

// While a ScopedSink lives, the messages of the thread that made it go to its sink
// instead of the process-wide one (a null sink: to the process-wide one). Scopes
// nest; each restores the one before it. Not thread-safe itself: one per thread,
// destroyed on the thread that made it. (The thread's state is a plain pointer to
// the sink this object holds: a thread-local with a destructor would make glibc
// allocate on the thread's first log, and abort the process if that fails.)
class FERRY_API ScopedSink {
 public:
  explicit ScopedSink(std::shared_ptr<const Sink> sink);
  ~ScopedSink();
  ScopedSink(const ScopedSink&) = delete;
  ScopedSink& operator=(const ScopedSink&) = delete;

 private:
  std::shared_ptr<const Sink> sink_;
  const std::shared_ptr<const Sink>* previous_;
};
// This thread's scoped sink (null: none), to hand to the threads it starts.
FERRY_API std::shared_ptr<const Sink> thread_sink();

// Never throws: a message that cannot be delivered for want of memory is written
// to standard error without allocating (it is called from destructors).
FERRY_API void write(Level level, std::string_view message) noexcept;
inline void debug(std::string_view m) noexcept {
  write(Level::kDebug, m);
}
inline void info(std::string_view m) noexcept {
  write(Level::kInfo, m);
}
inline void warn(std::string_view m) noexcept {
  write(Level::kWarn, m);
}
inline void error(std::string_view m) noexcept {
  write(Level::kError, m);
}

}  // namespace ferry::log
