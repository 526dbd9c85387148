// The scheduler of a load's actor system (actors/threads_internal.hpp says why it
// replaces CAF's): workers that take jobs (actors with messages to handle) from
// one shared queue, and a thread that runs CAF's clock (delayed messages,
// timeouts). An idle worker sleeps on the queue's condition variable; a load's
// scheduled actors (coordinator, post-processor) handle a few messages per second,
// so one queue costs nothing, and nothing busy-polls (the reader and the copy
// workers, on threads of their own, keep the cores).
//
// Starting: LoadSchedulerThreads starts the threads through start_thread() before
// the actor system exists, and they wait until its scheduler starts and hands
// itself over. A refused thread is thus an Error before caf::actor_system's
// constructor runs: CAF 0.17 cannot unwind that constructor (a failure in it
// crashed in ~actor_registry, releasing the spawn and config servers after the
// modules they use were gone). No printer actor (CAF's aout): ferry prints nothing
// through actors, and it would be one more thread.
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

// The threads, started before the scheduler they will run exists.
struct LoadSchedulerThreads::State {
  std::mutex mu;
  std::condition_variable cv;
  LoadScheduler* scheduler = nullptr;  // set when it starts
  bool released = false;               // no scheduler will come: leave
  std::vector<std::thread> workers;
  std::thread clock;

  // On a thread: the scheduler to run, or nullptr to leave.
  LoadScheduler* wait() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return scheduler != nullptr || released; });
    return scheduler;
  }
  void attach(LoadScheduler* s) {
    {
      std::lock_guard lock(mu);
      scheduler = s;
    }
    cv.notify_all();
  }
  void release() {
    {
      std::lock_guard lock(mu);
      released = true;
    }
    cv.notify_all();
  }
};

class LoadScheduler final : public caf::scheduler::abstract_coordinator {
 public:
  LoadScheduler(caf::actor_system& system, std::shared_ptr<LoadSchedulerThreads::State> threads)
      : abstract_coordinator(system), threads_(std::move(threads)) {}
  LoadScheduler(const LoadScheduler&) = delete;
  LoadScheduler& operator=(const LoadScheduler&) = delete;
  // When caf::actor_system's constructor failed after creating it: stop() never ran.
  ~LoadScheduler() override { halt(); }

  // Starts no thread (cannot fail): the waiting ones take over.
  void start() override { threads_->attach(this); }

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
        case caf::resumable::shutdown_execution_unit:
          // Scheduled again (with a new reference) when a message comes.
          intrusive_ptr_release(job);
          break;
      }
    }
    system().thread_terminates();
  }

  void run_clock() {
    CAF_SET_LOGGER_SYS(&system());
    system().thread_started();
    clock_.run_dispatch_loop();
    system().thread_terminates();
  }

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

  // Stops and joins the threads (those never handed a scheduler leave too);
  // idempotent.
  void halt() noexcept {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    threads_->release();
    join_all(threads_->workers);
    clock_.cancel_dispatch_loop();
    if (threads_->clock.joinable()) {
      threads_->clock.join();
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

  std::shared_ptr<LoadSchedulerThreads::State> threads_;
  caf::detail::thread_safe_actor_clock clock_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<caf::resumable*> queue_;
  bool stopping_ = false;
};

void WorkerUnit::exec_later(caf::resumable* job) {
  scheduler_.enqueue(job);
}

LoadSchedulerThreads::LoadSchedulerThreads(std::size_t workers)
    : state_(std::make_shared<State>()) {
  try {
    for (std::size_t i = 0; i < std::max<std::size_t>(1, workers); ++i) {
      state_->workers.push_back(
          start_thread("scheduler worker " + std::to_string(i), [st = state_] {
            if (LoadScheduler* s = st->wait()) {
              s->run_worker();
            }
          }));
    }
    state_->clock = start_thread("scheduler clock", [st = state_] {
      if (LoadScheduler* s = st->wait()) {
        s->run_clock();
      }
    });
  } catch (...) {
    state_->release();
    join_all(state_->workers);
    throw;
  }
}

LoadSchedulerThreads::~LoadSchedulerThreads() {
  state_->release();
  join_all(state_->workers);
  if (state_->clock.joinable()) {
    state_->clock.join();
  }
}

void LoadSchedulerThreads::use_in(caf::actor_system_config& config) {
  config.set("scheduler.max-threads", static_cast<int>(state_->workers.size()));
  config.module_factories.push_back(
      [st = state_](caf::actor_system& system) -> caf::actor_system::module* {
        return new LoadScheduler(system, st);
      });
}

}  // namespace ferry::actors
