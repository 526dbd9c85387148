#include "common/log.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace ferry::log {
namespace {

Level initial_level() {
  // Read once, at the first message; ferry never sets the environment.
  const char* env = std::getenv("FERRY_LOG");  // NOLINT(concurrency-mt-unsafe)
  if (env == nullptr) {
    return Level::kInfo;
  }
  std::string_view v(env);
  if (v == "debug") return Level::kDebug;
  if (v == "warn") return Level::kWarn;
  if (v == "error") return Level::kError;
  return Level::kInfo;
}

struct State {
  std::mutex mu;
  Level level = initial_level();
  std::shared_ptr<const Sink> sink;  // copied out under the lock, called outside it
};

// Set while this thread runs the sink: a message the sink itself logs (through
// ferry, directly or not) goes to standard error instead of back into the sink.
thread_local bool t_in_sink = false;
// The innermost ScopedSink's sink on this thread (null, or pointing at a null
// sink: the process-wide one). Plain pointers only: a thread_local with a
// destructor makes glibc allocate on the thread's first use, and abort the whole
// process ("failed to register TLS destructor") when that allocation fails.
thread_local const std::shared_ptr<const Sink>* t_scoped = nullptr;

void to_stderr(Level l, std::string_view message) noexcept;

State& state() {
  static State s;
  return s;
}

std::string_view level_name(Level l) {
  switch (l) {
    case Level::kDebug: return "debug";
    case Level::kInfo: return "info";
    case Level::kWarn: return "warning";
    case Level::kError: return "error";
  }
  return "?";
}

}  // namespace

void set_level(Level l) {
  std::lock_guard lock(state().mu);
  state().level = l;
}

Level level() {
  std::lock_guard lock(state().mu);
  return state().level;
}

// Once the new sink is in place, waits for the calls of the old one still running
// on other threads (whatever it captured may die when this returns, as it could
// when the sink ran under the lock). Not from inside a sink: that would wait for
// itself.
Sink set_sink(Sink sink) {
  std::shared_ptr<const Sink> old = sink ? std::make_shared<const Sink>(std::move(sink)) : nullptr;
  {
    std::lock_guard lock(state().mu);
    std::swap(state().sink, old);
  }
  while (old && !t_in_sink && old.use_count() > 1) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return old ? *old : Sink{};
}

ScopedSink::ScopedSink(std::shared_ptr<const Sink> sink)
    : sink_(std::move(sink)), previous_(std::exchange(t_scoped, &sink_)) {}

ScopedSink::~ScopedSink() {
  t_scoped = previous_;
}

const std::shared_ptr<const Sink>* exchange_thread_sink(
    const std::shared_ptr<const Sink>* sink) noexcept {
  return std::exchange(t_scoped, sink);
}

std::shared_ptr<const Sink> thread_sink() {
  return t_scoped != nullptr ? *t_scoped : nullptr;
}

// The sink runs outside the lock: a sink that logs through ferry, or that blocks
// on a lock a logging thread holds, cannot deadlock here. A sink that throws is
// reported on standard error, with the message (write() is called from noexcept
// destructors).
void write(Level l, std::string_view message) noexcept {
  std::shared_ptr<const Sink> sink;
  {
    std::lock_guard lock(state().mu);
    if (l < state().level) {
      return;
    }
    sink = t_scoped != nullptr && *t_scoped ? *t_scoped : state().sink;
  }
  if (sink && *sink && !t_in_sink) {
    t_in_sink = true;
    try {
      (*sink)(l, message);
      t_in_sink = false;
      return;
    } catch (...) {
      t_in_sink = false;
      to_stderr(Level::kError, "the log sink threw; the message was:");
    }
  }
  to_stderr(l, message);
}

namespace {

// Without allocating (the message may be about memory running out): one fwrite of
// the line where it fits a stack buffer, else its parts under the stream's lock.
void to_stderr(Level l, std::string_view message) noexcept {
  const std::string_view prefix = "ferry ";
  const std::string_view name = level_name(l);
  const std::string_view parts[] = {prefix, name, ": ", message, "\n"};
  std::array<char, 1024> line;
  std::size_t size = 0;
  for (std::string_view p : parts) {
    size += p.size();
  }
  if (size <= line.size()) {
    char* out = line.data();
    for (std::string_view p : parts) {
      out = std::copy(p.begin(), p.end(), out);
    }
    std::fwrite(line.data(), 1, size, stderr);
    return;
  }
  ::flockfile(stderr);
  for (std::string_view p : parts) {
    ::fwrite_unlocked(p.data(), 1, p.size(), stderr);
  }
  ::funlockfile(stderr);
}

}  // namespace

}  // namespace ferry::log
