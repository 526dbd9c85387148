#include "models/hooks.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "common/error.hpp"

namespace ferry::models {
namespace {

[[noreturn]] void bad_hook(const std::string& name, const std::string& rule) {
  throw Error(Stage::kPostProcess, "", "", "post-load hook '" + name + "': " + rule);
}

}  // namespace

void validate_hooks(const Model& model, const std::vector<PostLoadHook>& hooks,
                    const std::vector<PostLoadHook>& existing) {
  const auto& shells = model.shells();
  std::set<std::pair<std::size_t, std::size_t>> filled;  // (local rank, param)
  for (const PostLoadHook& h : existing) {
    for (std::size_t out : h.outputs) {
      filled.emplace(h.local_rank, out);
    }
  }
  for (const PostLoadHook& h : hooks) {
    if (h.name.empty()) {
      bad_hook(h.name, "a hook needs a name");
    }
    if (!h.run) {
      bad_hook(h.name, "no function to run");
    }
    if (h.local_rank >= shells.size()) {
      bad_hook(h.name, "local rank " + std::to_string(h.local_rank) + " has no shell (" +
                           std::to_string(shells.size()) + " local ranks)");
    }
    const RankShell& shell = shells[h.local_rank];
    auto check_index = [&](std::size_t param, const char* what) {
      if (param >= shell.params.size()) {
        bad_hook(h.name, std::string(what) + " param index " + std::to_string(param) +
                             " is outside the shell (" + std::to_string(shell.params.size()) +
                             " params)");
      }
    };
    std::set<std::size_t> inputs;
    for (std::size_t in : h.inputs) {
      check_index(in, "input");
      inputs.insert(in);
    }
    std::set<std::size_t> outputs;
    for (std::size_t out : h.outputs) {
      check_index(out, "output");
      const std::string& name = shell.params[out].name;
      if (!outputs.insert(out).second) {
        bad_hook(h.name, "output " + name + " is listed twice");
      }
      if (inputs.count(out) != 0) {
        bad_hook(h.name, "output " + name + " is also an input");
      }
      if (!filled.emplace(h.local_rank, out).second) {
        bad_hook(h.name, "output " + name + " on local rank " + std::to_string(h.local_rank) +
                             " is already filled by another hook");
      }
    }
    for (std::size_t p : h.rewrites) {
      check_index(p, "rewritten");
      if (inputs.count(p) != 0 || outputs.count(p) != 0) {
        bad_hook(h.name, "rewritten param " + shell.params[p].name +
                             " is also an input or output (a rewrite is an input already)");
      }
    }
  }
  // Rewrites: of params the pieces fill, once each, after every hook that reads them.
  std::vector<const PostLoadHook*> all;
  for (const PostLoadHook& h : existing) {
    all.push_back(&h);
  }
  for (const PostLoadHook& h : hooks) {
    all.push_back(&h);
  }
  std::map<std::pair<std::size_t, std::size_t>, const PostLoadHook*> rewriter;
  for (const PostLoadHook* h : all) {
    for (std::size_t p : h->rewrites) {
      const std::string& name = shells[h->local_rank].params[p].name;
      if (filled.count({h->local_rank, p}) != 0) {
        bad_hook(h->name, "rewritten param " + name + " is a hook's output");
      }
      if (!rewriter.emplace(std::pair{h->local_rank, p}, h).second) {
        bad_hook(h->name, "param " + name + " is rewritten by two hooks");
      }
    }
  }
  for (const PostLoadHook* reader : all) {
    for (std::size_t in : reader->inputs) {
      auto it = rewriter.find({reader->local_rank, in});
      if (it == rewriter.end() || it->second == reader) {
        continue;
      }
      const PostLoadHook& writer = *it->second;
      const bool waits =
          std::any_of(writer.inputs.begin(), writer.inputs.end(), [&](std::size_t p) {
            return std::find(reader->outputs.begin(), reader->outputs.end(), p) !=
                   reader->outputs.end();
          });
      if (!waits) {
        bad_hook(writer.name, "rewrites " + shells[reader->local_rank].params[in].name +
                                  ", which hook '" + reader->name +
                                  "' reads, without waiting for one of its outputs");
      }
    }
  }
}

void run_hook(const PostLoadHook& hook, HookContext& context, const HookObserver& observer) {
  const auto begin = std::chrono::steady_clock::now();
  try {
    hook.run(context);
  } catch (...) {
    if (observer) {
      observer(hook, begin, std::chrono::steady_clock::now());
    }
    throw;
  }
  if (observer) {
    observer(hook, begin, std::chrono::steady_clock::now());
  }
}

ParamsHookContext::ParamsHookContext(const PostLoadHook& hook, std::span<std::byte* const> params,
                                     gpu::Stream& stream, std::string device,
                                     ReallocateParam reallocate_param, std::span<std::byte> scratch)
    : hook_(hook),
      params_(params),
      stream_(stream),
      device_(std::move(device)),
      reallocate_param_(std::move(reallocate_param)),
      scratch_(scratch) {}

std::byte* ParamsHookContext::scratch(std::size_t bytes) {
  if (bytes == 0) {
    return nullptr;
  }
  if (bytes > scratch_.size()) {
    throw Error(Stage::kPostProcess, device_, "",
                "post-load hook '" + hook_.name + "' asked for " + std::to_string(bytes) +
                    " bytes of device scratch; " + std::to_string(scratch_.size()) +
                    " were made for it (it declares scratch_bytes " +
                    std::to_string(hook_.scratch_bytes) + ")");
  }
  return scratch_.data();
}

bool ParamsHookContext::declared(std::size_t param, bool outputs_only) const {
  auto has = [param](const std::vector<std::size_t>& ids) {
    return std::find(ids.begin(), ids.end(), param) != ids.end();
  };
  return param < params_.size() &&
         (has(hook_.outputs) || (!outputs_only && (has(hook_.inputs) || has(hook_.rewrites))));
}

std::byte* ParamsHookContext::param_data(std::size_t param) {
  if (!declared(param, false)) {
    throw Error(Stage::kPostProcess, device_, "",
                "post-load hook '" + hook_.name + "' asked for param " + std::to_string(param) +
                    ", which is not one of its declared inputs, outputs or rewrites");
  }
  auto moved = moved_.find(param);
  return moved != moved_.end() ? moved->second : params_[param];
}

std::byte* ParamsHookContext::reallocate(std::size_t param) {
  if (!declared(param, true)) {
    throw Error(Stage::kPostProcess, device_, "",
                "post-load hook '" + hook_.name + "' asked to reallocate param " +
                    std::to_string(param) + ", which is not one of its declared outputs");
  }
  if (!hook_.reallocates) {
    throw Error(Stage::kPostProcess, device_, "",
                "post-load hook '" + hook_.name +
                    "' reallocated an output but does not declare `reallocates`");
  }
  if (!reallocate_param_) {
    throw Error(Stage::kPostProcess, device_, "",
                "post-load hook '" + hook_.name + "' asked to reallocate param " +
                    std::to_string(param) + ", but storage cannot be replaced here");
  }
  std::byte* fresh = reallocate_param_(param);
  moved_[param] = fresh;
  return fresh;
}

}  // namespace ferry::models
