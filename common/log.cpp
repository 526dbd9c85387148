#include "common/log.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace ferry::log {
namespace {

Level initial_level() {
  const char* env = std::getenv("FERRY_LOG");
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
  Sink sink;
};

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

Sink set_sink(Sink sink) {
  std::lock_guard lock(state().mu);
  std::swap(state().sink, sink);
  return sink;
}

void write(Level l, std::string_view message) {
  std::lock_guard lock(state().mu);
  if (l < state().level) {
    return;
  }
  if (state().sink) {
    state().sink(l, message);
    return;
  }
  std::string line = "ferry ";
  line += level_name(l);
  line += ": ";
  line += message;
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace ferry::log
