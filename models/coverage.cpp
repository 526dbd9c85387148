#include "models/coverage.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace ferry::models {

CoverageTracker::CoverageTracker(const Model& model) : model_(model) {
  for (const RankShell& shell : model.shells()) {
    written_.emplace_back(shell.params.size(), 0);
  }
}

void CoverageTracker::add(const Piece& piece) {
  if (piece.local_rank >= written_.size() || piece.param >= written_[piece.local_rank].size()) {
    throw Error(Stage::kVerify, "", "",
                "coverage: a piece names local rank " + std::to_string(piece.local_rank) +
                    " param " + std::to_string(piece.param) + ", which the model does not have");
  }
  written_[piece.local_rank][piece.param] += piece.dst_bytes();
}

void CoverageTracker::add_hook_outputs(const PostLoadHook& hook) {
  const auto& shells = model_.shells();
  for (std::size_t out : hook.outputs) {
    if (hook.local_rank >= written_.size() || out >= written_[hook.local_rank].size()) {
      throw Error(Stage::kVerify, "", "",
                  "coverage: hook '" + hook.name + "' names a param the model does not have");
    }
    written_[hook.local_rank][out] += shells[hook.local_rank].params[out].nbytes;
  }
}

std::uint64_t CoverageTracker::written(std::size_t local_rank, std::size_t param) const {
  return written_.at(local_rank).at(param);
}

bool CoverageTracker::complete(std::size_t local_rank, std::size_t param) const {
  return written(local_rank, param) == model_.shells().at(local_rank).params.at(param).nbytes;
}

std::vector<CoverageGap> CoverageTracker::gaps() const {
  std::vector<CoverageGap> out;
  const auto& shells = model_.shells();
  for (std::size_t r = 0; r < shells.size(); ++r) {
    for (std::size_t i = 0; i < shells[r].params.size(); ++i) {
      const ParamSpec& spec = shells[r].params[i];
      if (written_[r][i] != spec.nbytes) {
        out.push_back({r, shells[r].tp_rank, i, spec.name, written_[r][i], spec.nbytes});
      }
    }
  }
  return out;
}

namespace {

// Who writes an interval: a copy piece of route `index`, zero fill `index`, or the
// outputs of hook `index`.
struct Writer {
  enum class Kind { kCopy, kFill, kHook } kind = Kind::kCopy;
  std::size_t index = 0;
};

struct Interval {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  Writer writer;
};

class IntervalCheck {
 public:
  IntervalCheck(const Model& model, const std::function<std::string(std::size_t)>& route_name)
      : model_(model), route_name_(route_name) {
    for (const RankShell& shell : model.shells()) {
      intervals_.emplace_back(shell.params.size());
    }
  }

  void add(const Piece& p, Writer w) {
    std::vector<Interval>& list = param_list(p.local_rank, p.param, w);
    const std::uint64_t row = p.width_elems * dtype_size(p.dst_dtype);
    if (p.rows == 0 || row == 0) {
      return;
    }
    if (p.rows == 1 || p.dst_pitch == row) {
      list.push_back({p.dst_offset, p.dst_offset + p.rows * row, w});
      return;
    }
    for (std::uint64_t r = 0; r < p.rows; ++r) {  // a pitched destination, row by row
      list.push_back({p.dst_offset + r * p.dst_pitch, p.dst_offset + r * p.dst_pitch + row, w});
    }
  }

  void add_hook(const PostLoadHook& h, std::size_t index) {
    const Writer w{Writer::Kind::kHook, index};
    for (std::size_t out : h.outputs) {
      std::vector<Interval>& list = param_list(h.local_rank, out, w);
      list.push_back({0, model_.shells()[h.local_rank].params[out].nbytes, w});
    }
  }

  std::vector<CoverageGap> gaps() {
    std::vector<CoverageGap> out;
    const auto& shells = model_.shells();
    for (std::size_t r = 0; r < shells.size(); ++r) {
      for (std::size_t i = 0; i < shells[r].params.size(); ++i) {
        const ParamSpec& spec = shells[r].params[i];
        std::vector<Interval>& list = intervals_[r][i];
        std::sort(list.begin(), list.end(), [](const Interval& a, const Interval& b) {
          return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
        });
        std::uint64_t written = 0;
        for (std::size_t k = 0; k < list.size(); ++k) {
          const Interval& v = list[k];
          if (v.end > spec.nbytes) {
            fail(spec, "bytes [" + std::to_string(v.begin) + ", " + std::to_string(v.end) +
                           ") written by " + describe(v.writer) + " lie outside its " +
                           std::to_string(spec.nbytes) + " bytes");
          }
          if (k > 0 && v.begin < list[k - 1].end) {
            const Interval& u = list[k - 1];
            fail(spec, "bytes [" + std::to_string(v.begin) + ", " +
                           std::to_string(std::min(u.end, v.end)) + ") are written twice: by " +
                           describe(u.writer) + " (bytes [" + std::to_string(u.begin) + ", " +
                           std::to_string(u.end) + ")) and by " + describe(v.writer) + " (bytes [" +
                           std::to_string(v.begin) + ", " + std::to_string(v.end) + "))");
          }
          written += v.end - v.begin;
        }
        if (written != spec.nbytes) {
          out.push_back({r, shells[r].tp_rank, i, spec.name, written, spec.nbytes});
        }
        std::vector<Interval>().swap(list);
      }
    }
    return out;
  }

 private:
  std::vector<Interval>& param_list(std::size_t rank, std::size_t param, Writer w) {
    if (rank >= intervals_.size() || param >= intervals_[rank].size()) {
      throw Error(Stage::kPlacement, "", "",
                  "internal: coverage: " + describe(w) + " names local rank " +
                      std::to_string(rank) + " param " + std::to_string(param) +
                      ", which the model does not have");
    }
    return intervals_[rank][param];
  }

  std::string describe(Writer w) const {
    switch (w.kind) {
      case Writer::Kind::kCopy:
        return route_name_ ? "a copy from tensor " + route_name_(w.index)
                           : "a copy of route #" + std::to_string(w.index);
      case Writer::Kind::kFill:
        return "zero fill #" + std::to_string(w.index);
      case Writer::Kind::kHook:
        return "post-load hook '" + model_.hooks().at(w.index).name + "'";  // errors only
    }
    return "?";
  }

  [[noreturn]] void fail(const ParamSpec& spec, const std::string& what) const {
    throw Error(Stage::kPlacement, "", spec.name,
                "internal: the plan's writes into parameter " + spec.name + " are wrong: " + what);
  }

  const Model& model_;
  const std::function<std::string(std::size_t)>& route_name_;
  std::vector<std::vector<std::vector<Interval>>> intervals_;  // [local rank][param]
};

}  // namespace

std::vector<CoverageGap> check_coverage(
    const Model& model, std::span<const Route> routes,
    const std::function<std::string(std::size_t route)>& route_name) {
  IntervalCheck check(model, route_name);
  for (std::size_t i = 0; i < routes.size(); ++i) {
    for (const Piece& p : routes[i].pieces) {
      check.add(p, {Writer::Kind::kCopy, i});
    }
  }
  const std::vector<Piece> fills = model.fill_pieces();
  for (std::size_t i = 0; i < fills.size(); ++i) {
    check.add(fills[i], {Writer::Kind::kFill, i});
  }
  const std::vector<PostLoadHook> hooks = model.hooks();  // a copy per call: take it once
  for (std::size_t i = 0; i < hooks.size(); ++i) {
    check.add_hook(hooks[i], i);
  }
  return check.gaps();
}

std::vector<std::string> gap_names(const std::vector<CoverageGap>& gaps) {
  std::vector<std::string> names;
  for (const CoverageGap& g : gaps) {
    names.push_back(g.name);
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

}  // namespace ferry::models
