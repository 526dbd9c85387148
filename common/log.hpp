// Minimal leveled logging to standard error. Tests (and engines) may install a sink
// to capture what was logged. The sink is process-wide; it is called outside the
// logging lock, from any thread, and what it logs itself goes to standard error.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace ferry::log {

enum class Level { kDebug, kInfo, kWarn, kError };

using Sink = std::function<void(Level, std::string_view)>;

// Messages below this level are dropped (default kInfo; FERRY_LOG=debug|info|warn|error).
void set_level(Level level);
Level level();

// Replaces the sink (nullptr restores standard error). Returns the previous sink.
Sink set_sink(Sink sink);

void write(Level level, std::string_view message);
inline void debug(std::string_view m) { write(Level::kDebug, m); }
inline void info(std::string_view m) { write(Level::kInfo, m); }
inline void warn(std::string_view m) { write(Level::kWarn, m); }
inline void error(std::string_view m) { write(Level::kError, m); }

}  // namespace ferry::log
