// Starting a thread, for every thread ferry starts. std::thread throws
// std::system_error (EAGAIN) when the system refuses a thread: a low RLIMIT_AS
// (each stack is an 8 MiB mapping), RLIMIT_NPROC, kernel.threads-max. Left alone
// that exception ended the process (a std::thread vector destroyed with running
// threads in it, an exception out of a thread's body) or reached the user as
// "config: unexpected"; start_thread() turns it into one ferry::Error,
// "resources: could not start thread NAME: REASON", and the caller stops and joins
// whatever it had started.
//
// Threads another library starts for ferry (CAF's detached actors) are announced
// with check_thread_start(NAME) just before, and their std::system_error is turned
// into the same error with thread_start_failed().
//
// The test seam: inject_thread_start_failure() makes a chosen start fail as the
// system would (std::system_error, EAGAIN), through the same path as a real
// failure; record_thread_starts() lists the names of the starts a load makes, so
// that a test can fail each one in turn. Both are process-wide; tests only.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "common/error.hpp"

namespace ferry {

// The error for a thread `name` that could not be started.
Error thread_start_failed(std::string_view name, const std::system_error& e);

// Throws std::system_error (EAGAIN) when a test injected a failure for this start;
// counts and records the start otherwise.
void check_thread_start(std::string_view name);

// A std::thread running `fn`, or Error(Stage::kResources) when it cannot be started
// (`fn`, and what it holds, is destroyed then).
template <class F>
std::thread start_thread(std::string_view name, F&& fn) {
  try {
    check_thread_start(name);
    return std::thread(std::forward<F>(fn));
  } catch (const std::system_error& e) {
    throw thread_start_failed(name, e);
  }
}

// Joins every joinable thread of `threads` (the ones started before a start failed).
void join_all(std::vector<std::thread>& threads) noexcept;

// Runs fn(i) for every i in [0, count): on the calling thread when count is 1, else
// on a thread each, named "NAME i", that carries the caller's log sink. Every call
// runs to its end; then the exception of the lowest i that threw, if any, is
// rethrown. When the system refuses a thread, the ones started are joined and the
// start's Error is thrown.
void run_each(std::string_view name, std::size_t count,
              const std::function<void(std::size_t)>& fn);

// -- test seam -------------------------------------------------------------------

// The `nth` start (1-based, counted from this call) whose name begins with
// `name_prefix` ("" for any) fails once, with EAGAIN. Replaces an earlier one.
void inject_thread_start_failure(std::string name_prefix, std::size_t nth = 1);
// Whether the injected failure is still to come.
bool thread_start_failure_pending();
void clear_thread_start_failure();

// From now on, the name of every start (failed or not) is kept; returns and clears
// what was kept so far. Off again with stop_recording_thread_starts().
void record_thread_starts();
std::vector<std::string> stop_recording_thread_starts();

}  // namespace ferry
