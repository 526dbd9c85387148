// The scheduler of a load's actor system (actors/threads_internal.hpp says why it
// replaces CAF's): scheduler.max-threads workers that take jobs (actors with
// messages to handle) from one shared queue, and a thread that runs CAF's clock
// (delayed messages, timeouts). An idle worker sleeps on the queue's condition
// variable; a load's scheduled actors (coordinator, post-processor) handle a few
// messages per second, so one queue costs nothing, and nothing busy-polls (the
// reader and the copy workers, on threads of their own, keep the cores).
//
// Starting: the threads go through start_thread(); when one cannot be started,
// those already running are stopped and joined before the Error leaves
// caf::actor_system's constructor. No printer actor (CAF's aout): ferry prints
// nothing through actors, and it would be one more thread.
#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/detail/thread_safe_actor_clock.hpp>
#include <caf/execution_unit.hpp>
#include <caf/logger.hpp>
#include <caf/resumable.hpp>
#include <caf/scheduler/abstract_coordinator.hpp>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "actors/threads_internal.hpp"

namespace ferry::actors {
namespace {

class LoadScheduler;

// A worker's execution unit: what an actor that it runs schedules goes to the queue.
class WorkerUnit final : public caf::execution_unit {
 public:
  WorkerUnit(caf::actor_system& system, LoadScheduler& scheduler)
      : caf::execution_unit(&system), scheduler_(scheduler) {}
  void exec_later(caf::resumable* job) override;

 private:
  LoadScheduler& scheduler_;
};

class LoadScheduler final : public caf::scheduler::abstract_coordinator {
 public:
  explicit LoadScheduler(caf::actor_system& system) : abstract_coordinator(system) {}
  LoadScheduler(const LoadScheduler&) = delete;
  LoadScheduler& operator=(const LoadScheduler&) = delete;
  // start() either succeeds or stops what it started; stop() ran otherwise.
  ~LoadScheduler() override { halt(); }

  void start() override {
    try {
      const std::size_t workers = std::max<std::size_t>(1, num_workers());
      for (std::size_t i = 0; i < workers; ++i) {
        workers_.push_back(
            start_thread("scheduler worker " + std::to_string(i), [this] { run_worker(); }));
      }
      clock_thread_ = start_thread("scheduler clock", [this] {
        CAF_SET_LOGGER_SYS(&system());
        system().thread_started();
        clock_.run_dispatch_loop();
        system().thread_terminates();
      });
    } catch (...) {
      halt();
      throw;
    }
  }

  // After every actor is done (~actor_system): the workers finish what is queued
  // (the exits of CAF's own hidden actors) and leave.
  void stop() override { halt(); }

  void enqueue(caf::resumable* job) override {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(job);
    }
    cv_.notify_one();
  }

  caf::actor_clock& clock() noexcept override { return clock_; }

 private:
  // Blocks for the next job; nullptr once stopping and the queue is empty.
  caf::resumable* next_job() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) {
      return nullptr;
    }
    caf::resumable* job = queue_.front();
    queue_.pop_front();
    return job;
  }

  void run_worker() {
    CAF_SET_LOGGER_SYS(&system());
    system().thread_started();
    WorkerUnit unit(system(), *this);
    while (caf::resumable* job = next_job()) {
      switch (job->resume(&unit, max_throughput())) {
        case caf::resumable::resume_later:
          enqueue(job);  // its reference stays with the queue
          break;
        case caf::resumable::done:
        case caf::resumable::awaiting_message:
          // Scheduled again (with a new reference) when a message comes.
          intrusive_ptr_release(job);
          break;
        case caf::resumable::shutdown_execution_unit:
          intrusive_ptr_release(job);
          break;
      }
    }
    system().thread_terminates();
  }

  // Stops and joins whatever runs; idempotent.
  void halt() noexcept {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    join_all(workers_);
    workers_.clear();
    if (clock_thread_.joinable()) {
      clock_.cancel_dispatch_loop();
      clock_thread_.join();
    }
    std::deque<caf::resumable*> left;
    {
      std::lock_guard lock(mu_);
      left.swap(queue_);
    }
    for (caf::resumable* job : left) {
      cleanup_and_release(job);
    }
  }

  caf::detail::thread_safe_actor_clock clock_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<caf::resumable*> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  std::thread clock_thread_;
};

void WorkerUnit::exec_later(caf::resumable* job) { scheduler_.enqueue(job); }

}  // namespace

void use_load_scheduler(caf::actor_system_config& config) {
  config.module_factories.push_back(
      [](caf::actor_system& system) -> caf::actor_system::module* {
        return new LoadScheduler(system);
      });
}

}  // namespace ferry::actors
