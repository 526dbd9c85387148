// The post-processor: counts the bytes that have landed in every param of every
// local rank and runs post-load hooks as soon as their inputs (and the params they
// rewrite) are complete; a rewritten param is final once its hook has run.
//
//   copy workers ── LandedMsg, DrainedMsg, HookDoneMsg ──► post-processor
//   post-processor ── RunHookMsg ──► the hook's rank's copy worker
//   post-processor ── AllCompleteMsg ──► coordinator
//
// Pieces never overlap (models/model.hpp), so a param is complete exactly when its
// byte count equals its size; more is a bug in a family's rules and fails the load.
// Hooks run on their rank's copy worker, which owns the bound device and stream.
// When every worker has drained the stream, no hook is running and some param is
// still short, nothing can fill it any more: the load fails listing those params
// rather than waiting forever.
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "actors/messages_internal.hpp"

namespace ferry::actors {
namespace {

constexpr std::size_t kMaxNamesListed = 50;

struct PostProcessorState;
using Self = PostProcessorActor::stateful_pointer<PostProcessorState>;

struct PostProcessorState {
  std::shared_ptr<Shared> shared;
  CoordinatorActor coordinator;
  std::vector<CopyWorkerActor> workers;  // empty until WorkersMsg
  std::vector<models::PostLoadHook> hooks;
  std::vector<std::vector<std::uint64_t>> landed;  // [rank][param]
  std::vector<std::vector<bool>> is_output;        // filled by a hook
  std::vector<std::vector<bool>> is_rewritten;     // rewritten by a hook after its pieces
  std::map<std::pair<std::size_t, std::size_t>, std::vector<std::size_t>> waiting;  // -> hooks
  std::vector<std::size_t> hook_missing;  // inputs not complete yet, per hook
  std::deque<std::size_t> ready;          // hooks to start once the workers are known
  std::size_t missing_copied = 0;         // incomplete params that copies and fills write
  std::size_t missing_all = 0;            // incomplete params, hook outputs included
  std::size_t drained = 0;
  std::size_t hooks_running = 0;
  bool all_sent = false;

  PostProcessorState() = default;
  PostProcessorState(const PostProcessorState&) = delete;
  PostProcessorState& operator=(const PostProcessorState&) = delete;
  ~PostProcessorState() {
    if (shared) {
      shared->publish_landed(std::move(landed));
    }
  }

  const models::ParamSpec& spec(std::size_t rank, std::size_t param) const {
    return shared->model().shells()[rank].params[param];
  }

  void init() {
    const auto& shells = shared->model().shells();
    hooks = shared->model().hooks();
    for (const models::RankShell& shell : shells) {
      landed.emplace_back(shell.params.size(), 0);
      is_output.emplace_back(shell.params.size(), false);
      is_rewritten.emplace_back(shell.params.size(), false);
    }
    for (const models::PostLoadHook& h : hooks) {
      for (std::size_t out : h.outputs) {
        is_output[h.local_rank][out] = true;
      }
      for (std::size_t p : h.rewrites) {
        is_rewritten[h.local_rank][p] = true;
      }
    }
    for (std::size_t r = 0; r < shells.size(); ++r) {
      for (std::size_t p = 0; p < shells[r].params.size(); ++p) {
        if (shells[r].params[p].nbytes != 0) {
          ++missing_all;
          if (!is_output[r][p]) {
            ++missing_copied;
          }
        }
      }
    }
    hook_missing.assign(hooks.size(), 0);
    for (std::size_t h = 0; h < hooks.size(); ++h) {
      for (const auto& ids : {hooks[h].inputs, hooks[h].rewrites}) {
        for (std::size_t in : ids) {
          if (spec(hooks[h].local_rank, in).nbytes != 0) {
            waiting[{hooks[h].local_rank, in}].push_back(h);
            ++hook_missing[h];
          }
        }
      }
      if (hook_missing[h] == 0) {
        ready.push_back(h);
      }
    }
  }

  void start_ready(Self self) {
    while (!workers.empty() && !ready.empty()) {
      std::size_t h = ready.front();
      ready.pop_front();
      ++hooks_running;
      self->send(workers.at(hooks[h].local_rank), RunHookMsg{static_cast<std::uint32_t>(h)});
    }
  }

  // A param's bytes have all landed (a rewritten one is final only once its hook ran:
  // finished()).
  void completed(std::size_t rank, std::size_t param) {
    if (!is_rewritten[rank][param]) {
      finished(rank, param);
    }
    if (!is_output[rank][param]) {
      --missing_copied;
    }
    auto it = waiting.find({rank, param});
    if (it != waiting.end()) {
      for (std::size_t h : it->second) {
        if (--hook_missing[h] == 0) {
          ready.push_back(h);
        }
      }
    }
  }

  // The param will not change again.
  void finished(std::size_t rank, std::size_t param) {
    if (const auto& notify = shared->input().on_param_complete) {
      notify(rank, param);
    }
    --missing_all;
  }

  void add(std::size_t rank, std::size_t param, std::uint64_t bytes) {
    const models::ParamSpec& s = spec(rank, param);
    std::uint64_t& n = landed[rank][param];
    const bool was_complete = n == s.nbytes;
    n += bytes;
    if (n > s.nbytes) {
      throw Error(Stage::kVerify, shared->input().ranks[rank].device->name(), s.name,
                  "internal: " + std::to_string(n) + " bytes written into a parameter of " +
                      std::to_string(s.nbytes) + " bytes (pieces overlap)");
    }
    if (!was_complete && n == s.nbytes && bytes != 0) {
      completed(rank, param);
    }
  }

  void check(Self self) {
    start_ready(self);
    if (missing_copied == 0 && shared->stream_done_seconds.load() < 0) {
      shared->stream_done_seconds.store(shared->seconds_since_start());
    }
    if (missing_all == 0) {
      if (!all_sent) {
        all_sent = true;
        self->send(coordinator, AllCompleteMsg{});
      }
      return;
    }
    if (drained == landed.size() && hooks_running == 0 && ready.empty()) {
      std::vector<std::string> names;
      for (std::size_t r = 0; r < landed.size(); ++r) {
        for (std::size_t p = 0; p < landed[r].size(); ++p) {
          const models::ParamSpec& s = spec(r, p);
          if (landed[r][p] != s.nbytes && names.size() < kMaxNamesListed) {
            names.push_back(
                s.name + " (tp rank " + std::to_string(shared->model().shells()[r].tp_rank) + ": " +
                std::to_string(landed[r][p]) + " of " + std::to_string(s.nbytes) + " bytes)");
          }
        }
      }
      std::string list;
      for (const std::string& n : names) {
        list += (list.empty() ? "" : ", ") + n;
      }
      throw Error(Stage::kVerify, "", "",
                  std::to_string(missing_all) +
                      " parameter(s) incomplete after every chunk landed and every runnable "
                      "hook ran: " +
                      list);
    }
  }
};

// PipelineInput::fault_point, for tests: an exception thrown here is one of the
// post-processor's.
void fault_point(const PostProcessorState& st) {
  if (st.shared->input().fault_point) {
    st.shared->input().fault_point("post-processor");
  }
}

PostProcessorActor::behavior_type post_processor(Self self, std::shared_ptr<Shared> shared,
                                                 CoordinatorActor coordinator) {
  self->state.shared = std::move(shared);
  self->state.coordinator = std::move(coordinator);
  // Before init(): an exception without a handler meets CAF's default one.
  self->set_exception_handler([self](std::exception_ptr& ep) -> caf::error {
    self->state.shared->fail(ep, Stage::kPostProcess, "", "", "post-processor: ");
    return caf::sec::runtime_error;
  });
  self->state.init();
  return {
      [self](WorkersMsg& msg) {
        fault_point(self->state);
        self->state.workers = std::move(msg.workers);
        self->state.check(self);
      },
      [self](LandedMsg& msg) {
        fault_point(self->state);
        for (const auto& [param, bytes] : msg.bytes) {
          self->state.add(msg.rank, param, bytes);
        }
        self->state.check(self);
      },
      [self](HookDoneMsg msg) {
        fault_point(self->state);
        auto& st = self->state;
        --st.hooks_running;
        const models::PostLoadHook& h = st.hooks.at(msg.hook);
        for (std::size_t out : h.outputs) {
          st.add(h.local_rank, out, st.spec(h.local_rank, out).nbytes);
        }
        for (std::size_t p : h.rewrites) {
          if (st.spec(h.local_rank, p).nbytes != 0) {
            st.finished(h.local_rank, p);
          }
        }
        st.check(self);
      },
      [self](DrainedMsg) {
        fault_point(self->state);
        ++self->state.drained;
        self->state.check(self);
      },
  };
}

}  // namespace

PostProcessorActor spawn_post_processor(caf::local_actor* parent, std::shared_ptr<Shared> shared,
                                        CoordinatorActor coordinator) {
  return parent->spawn(post_processor, std::move(shared), std::move(coordinator));
}

}  // namespace ferry::actors
