// `ferry bench --experiment FILE [--model DIR] [--repeat N] [--out DIR]`: runs every
// combination of an experiment (tools/bench_experiment.hpp) and its peers, each as
// its own child process, for N rounds in rotated order (../shared/notes
// benchmarks.md), and writes OUT/results.json, OUT/results.csv and OUT/chart.svg
// (bars per configuration and peer, and the stage timeline of the median run of
// the fastest configuration, from its trace). Timings are the child's wall clock
// measured here; peak RSS is wait4's.
//
// Peers: `cat` (cold: `dd iflag=direct` per file), `pread` (a per-tensor pread loop
// into preallocated memory, in a forked child), `sglang` and `load_file` (Python:
// safe_open + get_tensor + narrow + copy_, and safetensors.torch.load_file), which
// run from the interpreter in FERRY_BENCH_PYTHON or .venv-bench/bin/python
// (scripts/bench-venv.sh makes it) and are skipped with a message without one.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/format.hpp"
#include "common/log.hpp"
#include "common/small_file.hpp"
#include "embedded_peers.hpp"
#include "io/read_fully.hpp"
#include "io/safetensors.hpp"
#include "synth/synth.hpp"
#include "tools/bench_experiment.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"

namespace ferry::tools {
namespace {

namespace fs = std::filesystem;

// A trace `bench` reads back to draw a run's timeline: ferry wrote it, and it grows
// with the load (an event per read and copy), so it gets a cap of its own.
constexpr std::uint64_t kMaxTraceBytes = std::uint64_t{1} << 30;
using Clock = std::chrono::steady_clock;

constexpr const char kDescription[] =
    "Runs an experiment: every combination of its configuration matrix and its peers,\n"
    "each as a child process, for --repeat rounds in rotated order; prints a table and\n"
    "writes results.json, results.csv and chart.svg to --out.";

// ---- peers written in Python (bench/peers/*.py, embedded at build time) -----------

// ---- child processes --------------------------------------------------------------

struct Measured {
  double seconds = 0;
  std::uint64_t peak_rss = 0;
  int status = 0;
};

Measured wait_child(pid_t pid, Clock::time_point started) {
  int status = 0;
  struct rusage usage {};
  Measured m;
  if (wait4(pid, &status, 0, &usage) < 0) {
    m.status = -1;
    return m;
  }
  m.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  m.peak_rss = static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
  m.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return m;
}

// Runs `argv` with stdout and stderr to `log`.
Measured run_process(const std::vector<std::string>& argv, const std::string& log) {
  const Clock::time_point started = Clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    std::vector<char*> args;
    for (const std::string& a : argv) {
      args.push_back(const_cast<char*>(a.c_str()));
    }
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  if (pid < 0) {
    return Measured{0, 0, -1};
  }
  return wait_child(pid, started);
}

// The pread peer in a forked child: every tensor of every file read with one
// pread into preallocated (touched) memory. A failure is written to `log`, naming
// the file and tensor.
Measured run_pread_peer(const std::vector<std::string>& files, const std::string& log) {
  const Clock::time_point started = Clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    int status = 0;
    try {
      std::vector<io::SafetensorsHeader> headers;
      std::uint64_t total = 0;
      for (const std::string& f : files) {
        headers.push_back(io::read_safetensors_header(f, f));
        for (const io::TensorInfo& t : headers.back().tensors) {
          total += t.nbytes;
        }
      }
      std::vector<std::byte> memory(total);  // preallocated and touched
      std::uint64_t at = 0;
      for (std::size_t i = 0; i < files.size(); ++i) {
        const int fd = ::open(files[i].c_str(), O_RDONLY);
        if (fd < 0) {
          throw_errno(Stage::kRead, files[i], "pread peer: open", errno);
        }
        for (const io::TensorInfo& t : headers[i].tensors) {
          io::read_exactly(fd, {memory.data() + at, static_cast<std::size_t>(t.nbytes)}, t.offset,
                           Stage::kRead, files[i], t.name, "pread peer");
          at += t.nbytes;
        }
        ::close(fd);
      }
    } catch (const std::exception& e) {
      std::ofstream(log) << e.what() << "\n";
      status = 1;
    }
    _exit(status);
  }
  if (pid < 0) {
    return Measured{0, 0, -1};
  }
  return wait_child(pid, started);
}

void drop_cache(const std::vector<std::string>& files) {
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY);
    if (fd >= 0) {
      ::fdatasync(fd);
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
}

std::string self_exe() {
  std::error_code ec;
  fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "ferry" : p.string();
}

std::optional<std::string> bench_python() {
  // The command line's own thread, before any other starts; nothing sets the environment.
  const char* env = std::getenv("FERRY_BENCH_PYTHON");  // NOLINT(concurrency-mt-unsafe)
  if (env != nullptr && *env != '\0') {
    return std::string(env);
  }
  if (fs::exists(".venv-bench/bin/python")) {
    return fs::absolute(".venv-bench/bin/python").string();
  }
  return std::nullopt;
}

// ---- results ----------------------------------------------------------------------

struct Entry {
  std::string name;   // the combination's label, or "peer: cat"
  std::string kind;   // "ferry", "read-alone", "peer"
  std::string group;  // the combination a read-alone run belongs to
  std::optional<runtime::LoadConfig> config;
  std::string peer;
  std::vector<double> seconds;
  std::vector<std::uint64_t> rss;
  std::vector<nlohmann::json> reports;  // ferry runs
  std::vector<std::string> traces;      // ferry runs: trace file per round
};

double median(std::vector<double> v) {
  if (v.empty()) {
    return 0;
  }
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

std::string fmt(double v, int digits = 2) {
  return fixed(v, digits);
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Bars of median seconds (whiskers min-max), then the timeline of `trace_file`.
std::string chart(const std::vector<const Entry*>& rows, const std::string& trace_file,
                  const std::string& title) {
  const int width = 960, label_w = 340, bar_h = 18, gap = 6;
  double max_s = 0;
  for (const Entry* e : rows) {
    for (double s : e->seconds) {
      max_s = std::max(max_s, s);
    }
  }
  max_s = max_s > 0 ? max_s : 1;
  const double scale = (width - label_w - 80) / max_s;
  std::string body;
  int y = 40;
  for (const Entry* e : rows) {
    const double med = median(e->seconds);
    const double lo = *std::min_element(e->seconds.begin(), e->seconds.end());
    const double hi = *std::max_element(e->seconds.begin(), e->seconds.end());
    const char* colour = e->kind == "peer"         ? "#999999"
                         : e->kind == "read-alone" ? "#8fb3d9"
                                                   : "#2f6db5";
    body += "<text x=\"4\" y=\"" + std::to_string(y + 13) + "\" font-size=\"12\">" +
            xml_escape(e->name) + "</text>\n";
    body += "<rect x=\"" + std::to_string(label_w) + "\" y=\"" + std::to_string(y) + "\" width=\"" +
            fmt(med * scale, 1) + "\" height=\"" + std::to_string(bar_h) + "\" fill=\"" + colour +
            "\"/>\n";
    body += "<line x1=\"" + fmt(label_w + lo * scale, 1) + "\" x2=\"" +
            fmt(label_w + hi * scale, 1) + "\" y1=\"" + std::to_string(y + bar_h / 2) + "\" y2=\"" +
            std::to_string(y + bar_h / 2) + "\" stroke=\"black\"/>\n";
    body += "<text x=\"" + fmt(label_w + med * scale + 6, 1) + "\" y=\"" + std::to_string(y + 13) +
            "\" font-size=\"12\">" + fmt(med) + " s</text>\n";
    y += bar_h + gap;
  }
  // The timeline: one row per trace lane, events as rectangles.
  if (!trace_file.empty()) {
    std::string text;
    try {
      text = read_small_file(trace_file, Stage::kConfig, kMaxTraceBytes, "the trace");
    } catch (const Error& e) {
      log::warn(std::string("bench: no timeline: ") + e.what());
    }
    nlohmann::json trace = nlohmann::json::parse(text, nullptr, false);
    if (!trace.is_discarded()) {
      std::map<int, std::string> lanes;
      double end_us = 1;
      for (const nlohmann::json& ev : trace["traceEvents"]) {
        if (ev["ph"] == "M" && ev["name"] == "thread_name") {
          lanes[ev["tid"].get<int>()] = ev["args"]["name"].get<std::string>();
        } else if (ev["ph"] == "X") {
          end_us = std::max(end_us, ev["ts"].get<double>() + ev["dur"].get<double>());
        }
      }
      y += 24;
      body += "<text x=\"4\" y=\"" + std::to_string(y) +
              "\" font-size=\"13\" font-weight=\"bold\">timeline of the median run of the "
              "fastest configuration (" +
              fmt(end_us / 1e6, 3) + " s)</text>\n";
      y += 10;
      std::map<int, int> row_y;
      for (const auto& [tid, name] : lanes) {
        row_y[tid] = y;
        body += "<text x=\"4\" y=\"" + std::to_string(y + 11) + "\" font-size=\"11\">" +
                xml_escape(name) + "</text>\n";
        y += 16;
      }
      const double ts_scale = (width - label_w - 20) / end_us;
      static const std::map<std::string, std::string> colours = {{"read", "#2f6db5"},
                                                                 {"copy", "#e08a1e"},
                                                                 {"cast", "#c0392b"},
                                                                 {"fill", "#8e44ad"},
                                                                 {"zero", "#7f8c8d"}};
      for (const nlohmann::json& ev : trace["traceEvents"]) {
        if (ev["ph"] != "X" || !row_y.count(ev["tid"].get<int>())) {
          continue;
        }
        const std::string name = ev["name"].get<std::string>();
        const auto c = colours.find(name);
        body += "<rect x=\"" + fmt(label_w + ev["ts"].get<double>() * ts_scale, 2) + "\" y=\"" +
                std::to_string(row_y[ev["tid"].get<int>()]) + "\" width=\"" +
                fmt(std::max(0.5, ev["dur"].get<double>() * ts_scale), 2) +
                "\" height=\"12\" fill=\"" + (c != colours.end() ? c->second : "#27ae60") +
                "\"><title>" + xml_escape(name) + "</title></rect>\n";
      }
    }
  }
  return "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(width) +
         "\" height=\"" + std::to_string(y + 20) + "\" font-family=\"sans-serif\">\n" +
         "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"4\" y=\"20\" "
         "font-size=\"15\" font-weight=\"bold\">" +
         xml_escape(title) + "</text>\n" + body + "</svg>\n";
}

// One bench invocation: the experiment, its checkpoint and the runs of each round.
struct Bench {
  std::string experiment_file;
  std::string model;
  std::string out;
  int repeat = 5;
  Experiment e;
  std::vector<std::string> files;  // the checkpoint's .safetensors files, sorted
  std::uint64_t file_bytes = 0;
  std::vector<Entry> entries;
  std::vector<std::string> skipped;
  std::optional<std::string> python;

  fs::path runs() const { return fs::path(out) / "runs"; }
};

// The checkpoint folder: --model, the experiment's path, or a synthetic one of its
// family and preset (generated once into the output's cache).
void choose_checkpoint(Bench& b) {
  if (!b.model.empty()) {
    return;
  }
  if (b.e.path) {
    b.model = *b.e.path;
  } else if (!b.e.family.empty()) {
    b.model = (fs::path(b.out) / "cache" / (b.e.family + "-" + b.e.preset)).string();
    if (!fs::exists(fs::path(b.model) / "config.json")) {
      synth::SynthOptions o;
      o.family = b.e.family;
      o.preset = b.e.preset;
      o.out = b.model;
      o.fsync = false;
      synth::synthesize(o);
    }
  } else {
    throw Error(Stage::kConfig, b.experiment_file, "",
                "experiment: no checkpoint (give \"checkpoint\" or --model)");
  }
}

void list_weight_files(Bench& b) {
  for (const auto& entry : fs::directory_iterator(b.model)) {
    if (entry.path().extension() == ".safetensors") {
      b.files.push_back(entry.path().string());
      b.file_bytes += entry.file_size();
    }
  }
  std::sort(b.files.begin(), b.files.end());
  if (b.files.empty()) {
    throw Error(Stage::kConfig, b.model, "", "bench: no .safetensors files in the checkpoint");
  }
}

// What runs each round: every combination (and its read-alone twin where the
// overlap is measured), then the peers.
void plan_entries(Bench& b) {
  for (Combination& c : expand(b.e, b.model)) {
    if (!c.config) {
      b.skipped.push_back(c.label + ": " + c.skipped);
      continue;
    }
    if (b.e.cold) {
      c.config->io.direct = true;  // the note's cold: ferry reads with O_DIRECT
      if (c.config->prefetch.enabled) {
        b.skipped.push_back(c.label + ": prefetch with cold (io.direct) runs");
        continue;
      }
    }
    Entry f;
    f.name = c.label;
    f.kind = "ferry";
    f.config = c.config;
    b.entries.push_back(f);
    if (b.e.overlap && c.config->host.bandwidth_gbps > 0) {
      Entry r = f;
      r.kind = "read-alone";
      r.group = c.label;
      r.name = c.label + " [read alone: null devices]";
      r.config->devices.kind = runtime::DeviceSpec::Kind::kNull;
      b.entries.push_back(r);
    }
  }
  b.python = bench_python();
  for (const std::string& peer : b.e.peers) {
    if ((peer == "sglang" || peer == "load_file") && !b.python) {
      b.skipped.push_back("peer " + peer +
                          ": no Python with torch and safetensors (run scripts/bench-venv.sh, or "
                          "set FERRY_BENCH_PYTHON)");
      continue;
    }
    Entry p;
    p.name = "peer: " + peer + (peer == "cat" && b.e.cold ? " (dd iflag=direct)" : "");
    p.kind = "peer";
    p.peer = peer;
    b.entries.push_back(p);
  }
  for (const std::string& s : b.skipped) {
    std::printf("skipped: %s\n", s.c_str());
  }
  if (b.entries.empty()) {
    throw Error(Stage::kConfig, b.experiment_file, "", "bench: nothing to run");
  }
}

// Peer scripts and configs on disk; the files warmed once for a hot run, as `cat`
// would.
void prepare_runs(const Bench& b) {
  write_file_replacing((b.runs() / "peer_sglang.py").string(), kSglangPeer, "bench --out");
  write_file_replacing((b.runs() / "peer_load_file.py").string(), kLoadFilePeer, "bench --out");
  for (std::size_t i = 0; i < b.entries.size(); ++i) {
    if (b.entries[i].config) {
      write_file_replacing((b.runs() / ("config-" + std::to_string(i) + ".json")).string(),
                           runtime::to_json(*b.entries[i].config).dump(2), "bench --out");
    }
  }
  if (!b.e.cold) {
    for (const std::string& f : b.files) {
      std::ifstream in(f, std::ios::binary);
      std::vector<char> buf(1 << 20);
      while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount()) {
      }
    }
  }
}

// Entry i's run of one round, its output in runs/<i>-r<round>.log.
Measured run_entry(Bench& b, std::size_t i, int round, const std::string& exe, int tp) {
  Entry& entry = b.entries[i];
  const std::string id = std::to_string(i) + "-r" + std::to_string(round);
  const std::string log = (b.runs() / (id + ".log")).string();
  Measured m;
  if (entry.config) {
    const std::string report = (b.runs() / (id + ".report.json")).string();
    const std::string trace = (b.runs() / (id + ".trace.json")).string();
    m = run_process({exe, "load", "--config",
                     (b.runs() / ("config-" + std::to_string(i) + ".json")).string(), "--report",
                     report, "--trace", trace, "--quiet"},
                    log);
    if (m.status == 0) {
      entry.reports.push_back(nlohmann::json::parse(
          read_small_file(report, Stage::kConfig, kDefaultMaxMetadataBytes, "the report")));
      entry.traces.push_back(trace);
    }
  } else if (entry.peer == "cat") {
    std::vector<std::string> argv;
    if (b.e.cold) {
      std::string script;
      for (const std::string& f : b.files) {
        script += "dd if='" + f + "' of=/dev/null bs=4M iflag=direct status=none; ";
      }
      argv = {"sh", "-c", script};
    } else {
      argv = {"sh", "-c", "cat \"$@\" > /dev/null", "cat"};
      argv.insert(argv.end(), b.files.begin(), b.files.end());
    }
    m = run_process(argv, log);
  } else if (entry.peer == "pread") {
    m = run_pread_peer(b.files, log);
  } else {
    const std::string script =
        (b.runs() / (entry.peer == "sglang" ? "peer_sglang.py" : "peer_load_file.py")).string();
    m = run_process({*b.python, script, b.model, std::to_string(tp)}, log);
  }
  if (m.status != 0) {
    throw Error(Stage::kConfig, log, "",
                "bench: run '" + entry.name + "' exited with status " +
                    std::to_string(m.status) + " (its output is in the log)");
  }
  return m;
}

// Every entry once a round, each round starting one entry further on.
void run_rounds(Bench& b) {
  const std::string exe = self_exe();
  const int tp = b.entries.front().config ? b.entries.front().config->parallel.tp : 1;
  for (int round = 0; round < b.repeat; ++round) {
    for (std::size_t k = 0; k < b.entries.size(); ++k) {
      const std::size_t i = (k + static_cast<std::size_t>(round)) % b.entries.size();
      if (b.e.cold) {
        drop_cache(b.files);
      }
      const Measured m = run_entry(b, i, round, exe, tp);
      b.entries[i].seconds.push_back(m.seconds);
      b.entries[i].rss.push_back(m.peak_rss);
    }
    std::printf("round %d/%d done\n", round + 1, b.repeat);
    std::fflush(stdout);
  }
}

// (read alone + copy alone) / stream, medians of the same rounds: for a ferry run
// whose read-alone twin ran.
std::optional<double> overlap_efficiency(const Bench& b, const Entry& entry) {
  std::optional<double> efficiency;
  if (entry.kind != "ferry" || !b.e.overlap || entry.config->host.bandwidth_gbps <= 0) {
    return efficiency;
  }
  for (const Entry& other : b.entries) {
    if (other.kind == "read-alone" && other.group == entry.name) {
      std::vector<double> read_alone, stream;
      for (const nlohmann::json& r : other.reports) {
        read_alone.push_back(r["phases"]["stream"].get<double>());
      }
      for (const nlohmann::json& r : entry.reports) {
        stream.push_back(r["phases"]["stream"].get<double>());
      }
      const double copy_alone =
          static_cast<double>(entry.reports.front()["bytes_copied"].get<std::uint64_t>()) /
          (entry.config->host.bandwidth_gbps * 1e9);
      if (median(stream) > 0) {
        efficiency = (median(read_alone) + copy_alone) / median(stream);
      }
    }
  }
  return efficiency;
}

// The table on stdout, results.json, results.csv and chart.svg; the fastest ferry
// configuration is the peers' reference.
void write_results(const Bench& b) {
  const Entry* best = nullptr;
  for (const Entry& entry : b.entries) {
    if (entry.kind == "ferry" && (!best || median(entry.seconds) < median(best->seconds))) {
      best = &entry;
    }
  }
  nlohmann::json results = {{"experiment", b.experiment_file},
                            {"checkpoint", b.model},
                            {"file_bytes", b.file_bytes},
                            {"rounds", b.repeat},
                            {"cold", b.e.cold},
                            {"skipped", b.skipped},
                            {"runs", nlohmann::json::array()}};
  std::string csv =
      "name,kind,median_s,min_s,max_s,gbps,ratio_to_best_ferry,overlap_efficiency,bytes_read,"
      "peak_rss_bytes\n";
  int name_w = 8;
  for (const Entry& entry : b.entries) {
    name_w = std::max(name_w, static_cast<int>(entry.name.size()));
  }
  std::printf("\n%-*s %-22s %7s %8s %8s %12s %8s\n", name_w, "run", "seconds med (min-max)",
              "GB/s", "ratio", "overlap", "bytes read", "RSS MiB");
  for (const Entry& entry : b.entries) {
    const double med = median(entry.seconds);
    const double lo = *std::min_element(entry.seconds.begin(), entry.seconds.end());
    const double hi = *std::max_element(entry.seconds.begin(), entry.seconds.end());
    std::vector<double> rss(entry.rss.begin(), entry.rss.end());
    const double rss_med = median(rss);
    std::uint64_t bytes_read = b.file_bytes;
    if (!entry.reports.empty()) {
      bytes_read = entry.reports.front().value("bytes_read", std::uint64_t{0});
    }
    const std::optional<double> efficiency = overlap_efficiency(b, entry);
    const double gbps = med > 0 ? static_cast<double>(b.file_bytes) / med / 1e9 : 0;
    const double ratio = best && entry.kind == "peer" ? med / median(best->seconds) : 0;
    std::printf("%-*s %6s (%s-%s) %7s %8s %8s %12s %8s\n", name_w, entry.name.c_str(),
                fmt(med).c_str(), fmt(lo).c_str(), fmt(hi).c_str(), fmt(gbps).c_str(),
                ratio > 0 ? fmt(ratio).c_str() : "", efficiency ? fmt(*efficiency).c_str() : "",
                human_bytes(bytes_read).c_str(), fmt(rss_med / (1 << 20), 0).c_str());
    nlohmann::json run = {{"name", entry.name},
                          {"kind", entry.kind},
                          {"seconds", entry.seconds},
                          {"median_s", med},
                          {"min_s", lo},
                          {"max_s", hi},
                          {"gbps", gbps},
                          {"bytes_read", bytes_read},
                          {"peak_rss_bytes", entry.rss}};
    if (ratio > 0) {
      run["ratio_to_best_ferry"] = ratio;
    }
    if (efficiency) {
      run["overlap_efficiency"] = *efficiency;
    }
    if (entry.config) {
      run["config"] = runtime::to_json(*entry.config);
    }
    results["runs"].push_back(run);
    csv += "\"" + entry.name + "\"," + entry.kind + "," + fmt(med, 4) + "," + fmt(lo, 4) + "," +
           fmt(hi, 4) + "," + fmt(gbps, 3) + "," + (ratio > 0 ? fmt(ratio, 3) : "") + "," +
           (efficiency ? fmt(*efficiency, 3) : "") + "," + std::to_string(bytes_read) + "," +
           fmt(rss_med, 0) + "\n";
  }
  write_file_replacing((fs::path(b.out) / "results.csv").string(), csv, "bench --out");
  std::string timeline;
  if (best) {
    // The median run of the fastest configuration.
    std::vector<std::pair<double, std::size_t>> order;
    for (std::size_t r = 0; r < best->seconds.size(); ++r) {
      order.emplace_back(best->seconds[r], r);
    }
    std::sort(order.begin(), order.end());
    timeline = best->traces.at(order[order.size() / 2].second);
    results["timeline_trace"] = timeline;
  }
  write_file_replacing((fs::path(b.out) / "results.json").string(), results.dump(2) + "\n",
                       "bench --out");
  std::vector<const Entry*> rows;
  for (const Entry& entry : b.entries) {
    rows.push_back(&entry);
  }
  write_file_replacing(
      (fs::path(b.out) / "chart.svg").string(),
      chart(rows, timeline,
            fs::path(b.experiment_file).filename().string() + " on " +
                fs::path(b.model).filename().string() + " (" + human_bytes(b.file_bytes) +
                (b.e.cold ? ", cold" : ", hot") + ", median of " + std::to_string(b.repeat) + ")"),
      "bench --out");
}

}  // namespace

int cmd_bench(const Args& args) {
  CLI::App app(kDescription, "ferry bench");
  Bench b;
  b.out = "bench-out";
  app.add_option("--experiment", b.experiment_file, "the experiment (JSON)")->required();
  app.add_option("--model", b.model, "checkpoint folder (overrides the experiment's)");
  app.add_option("--repeat", b.repeat, "rounds (default 5)")->check(CLI::Range(1, 1000));
  app.add_option("--out", b.out, "folder for results.json, results.csv, chart.svg and runs/");
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  try {
    b.e = read_experiment(b.experiment_file);
    fs::create_directories(b.runs());
    choose_checkpoint(b);
    list_weight_files(b);
    plan_entries(b);
    prepare_runs(b);
    run_rounds(b);
    write_results(b);
    std::printf("\nwrote %s/results.json, results.csv, chart.svg\n", b.out.c_str());
  } catch (const Error& err) {
    std::fprintf(stderr, "ferry bench: error: %s\n", err.what());
    return 1;
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "ferry bench: error: %s\n", ex.what());
    return 1;
  }
  return 0;
}

}  // namespace ferry::tools
