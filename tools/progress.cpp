#include "tools/progress.hpp"

#include <string>

#include "common/format.hpp"

namespace ferry::tools {
ProgressPrinter::ProgressPrinter(std::FILE* out, bool terminal, std::chrono::milliseconds interval)
    : out_(out), terminal_(terminal), interval_(interval) {}

runtime::LoadCallbacks ProgressPrinter::callbacks() {
  runtime::LoadCallbacks cb;
  cb.on_progress = [this](const runtime::LoadProgress& p) {
    update(p, Clock::now());
    return true;
  };
  return cb;
}

std::string ProgressPrinter::line(const runtime::LoadProgress& p, double gbps, double eta) {
  std::string s(runtime::to_string(p.phase));
  if (p.bytes_planned > 0) {
    const double fraction =
        static_cast<double>(p.bytes_read) / static_cast<double>(p.bytes_planned);
    s += " " + human_bytes(p.bytes_read) + " / " + human_bytes(p.bytes_planned) + " (" +
         std::to_string(static_cast<int>(fraction * 100)) + "%)";
  }
  if (gbps > 0) {
    s += " " + fixed(gbps, 2) + " GB/s";
  }
  if (eta >= 0) {
    s += " ETA " + fixed(eta, 1) + " s";
  }
  return s;
}

void ProgressPrinter::update(const runtime::LoadProgress& p, Clock::time_point now) {
  if (p.phase == runtime::LoadPhase::kStream && last_phase_ != runtime::LoadPhase::kStream) {
    stream_started_ = now;
  }
  const bool phase_changed = p.phase != last_phase_;
  last_phase_ = p.phase;
  const auto since = now - last_print_;
  const bool due = terminal_ ? since >= std::chrono::milliseconds(100) || phase_changed
                             : phase_changed || since >= interval_;
  if (!due && printed_) {
    return;
  }
  double gbps = 0;
  double eta = -1;
  if (p.phase == runtime::LoadPhase::kStream && p.bytes_read > 0) {
    const double seconds = std::chrono::duration<double>(now - stream_started_).count();
    if (seconds > 0) {
      gbps = static_cast<double>(p.bytes_read) / seconds / 1e9;
      if (p.bytes_planned >= p.bytes_read && gbps > 0) {
        eta = static_cast<double>(p.bytes_planned - p.bytes_read) / (gbps * 1e9);
      }
    }
  }
  const std::string text = line(p, gbps, eta);
  if (terminal_) {
    std::fprintf(out_, "\r\033[2Kferry: %s", text.c_str());  // clear the line, redraw
    line_open_ = true;
  } else {
    std::fprintf(out_, "ferry: progress: %s\n", text.c_str());
  }
  std::fflush(out_);
  last_print_ = now;
  printed_ = true;
}

void ProgressPrinter::finish() {
  if (line_open_) {
    std::fputc('\n', out_);
    std::fflush(out_);
    line_open_ = false;
  }
}

}  // namespace ferry::tools
