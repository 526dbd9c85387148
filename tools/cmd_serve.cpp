// `ferry serve`: the weight-cache daemon (ferry/cache.hpp). Loads DIR like `ferry
// load` (the same model, parallel and configuration flags: a config shared with
// the engines works, cache.* included), keeps the parameters resident in memory it
// can share, registers in cache.dir and serves every engine process of this user
// that loads the same model with cache.mode daemon or client. SIGTERM or SIGINT
// stops it: no new clients, the registration removed; clients keep their mappings
// as the transport allows (host memfd mappings outlive the daemon).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>

#include "common/error.hpp"
#include "common/format.hpp"
#include "ferry/cache.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/load_config.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"

namespace ferry::tools {
namespace {

constexpr const char kDescription[] =
    "Loads the checkpoint in DIR once, keeps its parameters resident and serves them to\n"
    "every engine process of this user that loads the same model with the weight cache\n"
    "(cache.mode daemon or client): they map this process's memory instead of reading\n"
    "the checkpoint. SIGTERM or Ctrl-C stops it.";

std::atomic<runtime::CacheDaemon*> g_daemon{nullptr};

extern "C" void stop_on_signal(int) {
  if (runtime::CacheDaemon* d = g_daemon.load()) {
    d->stop();  // an atomic store and a write(2): safe in a signal handler
  }
}

}  // namespace

int cmd_serve(const Args& args) {
  CLI::App app(kDescription, "ferry serve");
  ConfigArgs config_args;
  add_config_options(app, config_args, load_config_flags());
  std::string ready_file;
  std::string remote_listen;
  app.add_option("--remote", remote_listen,
                 "also serve remote_instance targets on this control port, HOST:PORT (the "
                 "address of the fleet's network; remote.token_file is the shared secret)");
  app.add_option("--ready-file", ready_file,
                 "once registered, write {socket, registration, pid, fingerprint} here as JSON "
                 "(for a supervisor or a script that waits for the daemon)");
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  std::optional<runtime::LoadConfig> config = config_from_args(config_args, "serve");
  if (!config) {
    return 2;
  }
  if (!remote_listen.empty()) {
    config->remote.listen = remote_listen;
  }
  // Block the stop signals until the handler has a daemon to stop.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigprocmask(SIG_BLOCK, &stop_signals, nullptr);
  std::unique_ptr<runtime::CacheDaemon> daemon;
  try {
    daemon = std::make_unique<runtime::CacheDaemon>(to_config(*config));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry serve: error: %s\n", e.what());
    return 1;
  }
  struct sigaction action {};
  action.sa_handler = stop_on_signal;
  sigemptyset(&action.sa_mask);
  g_daemon.store(daemon.get());
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  sigprocmask(SIG_UNBLOCK, &stop_signals, nullptr);

  const runtime::LoadReport& report = daemon->model()->report();
  std::fputs(report.summary().c_str(), stdout);
  std::printf("serving %s: %llu bytes shared on %s (registration %s); SIGTERM or Ctrl-C stops\n",
              config->model.path.c_str(),
              static_cast<unsigned long long>(daemon->stats().bytes_shared),
              daemon->socket().c_str(), daemon->registration().c_str());
  if (!daemon->remote_address().empty()) {
    std::printf("serving remote targets on %s\n", daemon->remote_address().c_str());
  }
  std::fflush(stdout);
  try {
    if (!config->load.report.empty()) {
      write_file_replacing(config->load.report, report.json(2) + "\n", "load.report");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry serve: error: %s\n", e.what());
    return 1;
  }
  if (!ready_file.empty()) {
    const nlohmann::json ready = {{"socket", daemon->socket()},
                                  {"bytes_shared", daemon->stats().bytes_shared},
                                  {"registration", daemon->registration()},
                                  {"pid", static_cast<long>(::getpid())},
                                  {"fingerprint", daemon->fingerprint()},
                                  {"remote", daemon->remote_address()}};
    try {
      write_file_replacing(ready_file, ready.dump() + "\n", "--ready-file");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ferry serve: error: %s\n", e.what());
      return 1;
    }
  }
  daemon->serve();
  const runtime::CacheDaemon::Stats stats = daemon->stats();
  g_daemon.store(nullptr);
  daemon.reset();  // unregisters (again: a no-op) and frees the parameters
  std::printf(
      "stopped: %llu client(s) served, %llu connection(s) refused; remote: %llu "
      "target(s) served, %llu refused\n",
      static_cast<unsigned long long>(stats.clients_served),
      static_cast<unsigned long long>(stats.refused),
      static_cast<unsigned long long>(stats.remote_served),
      static_cast<unsigned long long>(stats.remote_refused));
  return 0;
}

}  // namespace ferry::tools
