#include "models/table_model.hpp"

#include <algorithm>
#include <set>
#include <utility>

#include "common/error.hpp"
#include "models/hooks.hpp"
#include "models/row_order.hpp"

namespace ferry::models {
namespace {

[[noreturn]] void internal(const std::string& what, const std::string& rule) {
  throw Error(Stage::kPlacement, "", what, "internal: " + rule);
}

// A 0-d scalar and a one-element 1-D tensor hold the same bytes: a 0-d checkpoint
// scalar loads into a [1] param and a [1] tensor into a 0-d param (as SGLang 0.5.23's
// PerTensorScaleParameter._load_into_shard_id takes a [1] scale as its one element;
// layers/parameter.py). Shapes are compared and pieces computed with [] as [1].
Shape as_1d(const Shape& shape) {
  return shape.empty() ? Shape{1} : shape;
}

bool is_float(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32;
}

// A quantized linear param's storage: F8_E4M3, or NVFP4's packed bytes.
bool quantized_dtype(DType dtype) {
  return dtype == DType::kF8E4M3 || dtype == DType::kU8;
}

// What the copy workers can do: a plain copy, or a cast between float types.
bool castable(DType from, DType to) {
  return from == to || (is_float(from) && is_float(to));
}

}  // namespace

ParallelLayout normalize_layout(const ParallelLayout& layout) {
  auto bad = [](const std::string& rule) {
    throw Error(Stage::kConfig, "", "", "parallel layout: " + rule);
  };
  if (layout.tp < 1) {
    bad("tp must be >= 1 (got " + std::to_string(layout.tp) + ")");
  }
  if (layout.ep < 1) {
    bad("ep must be >= 1 (got " + std::to_string(layout.ep) + ")");
  }
  if (layout.pp < 1) {
    bad("pp must be >= 1 (got " + std::to_string(layout.pp) + ")");
  }
  if (layout.pp_rank < 0 || layout.pp_rank >= layout.pp) {
    bad("pp_rank " + std::to_string(layout.pp_rank) + " is outside [0, " +
        std::to_string(layout.pp) + ")");
  }
  if (layout.attn_dp < 1 || layout.tp % layout.attn_dp != 0) {
    bad("attn_dp " + std::to_string(layout.attn_dp) + " must divide tp " +
        std::to_string(layout.tp) + " (attention tp = tp / attn_dp)");
  }
  if (layout.dp_lm_head && layout.attn_dp == 1) {
    bad("dp_lm_head splits lm_head over the attention tp group, so it needs attn_dp > 1 (SGLang: "
        "enable_dp_lm_head requires enable_dp_attention)");
  }
  if (layout.moe_dense_tp != 0 && layout.moe_dense_tp != 1) {
    bad("moe_dense_tp " + std::to_string(layout.moe_dense_tp) +
        " is not 1 or none (SGLang's moe_dense_tp_size only supports 1 and None)");
  }
  if (layout.moe_a2a == ParallelLayout::MoeA2a::kDeepep && layout.ep != layout.tp) {
    bad("moe_a2a deepep runs experts with ep = tp (SGLang sets ep_size to tp_size); ep is " +
        std::to_string(layout.ep) + ", tp " + std::to_string(layout.tp));
  }
  ParallelLayout out = layout;
  if (out.local_ranks.empty()) {
    for (int r = 0; r < out.tp; ++r) {
      out.local_ranks.push_back(r);
    }
  }
  std::set<int> seen;
  for (int r : out.local_ranks) {
    if (r < 0 || r >= out.tp) {
      bad("local rank " + std::to_string(r) + " is outside [0, tp=" + std::to_string(out.tp) + ")");
    }
    if (!seen.insert(r).second) {
      bad("local rank " + std::to_string(r) + " is listed twice");
    }
  }
  return out;
}

TableModel::TableModel(std::string family, std::string architecture, ParallelLayout layout,
                       DType dtype, bool strict)
    : family_(std::move(family)),
      architecture_(std::move(architecture)),
      layout_(std::move(layout)),
      dtype_(dtype),
      strict_(strict) {}

void TableModel::add_param(const std::string& name, ShapeRule shape, std::optional<DType> dtype,
                           StrideRule strides) {
  if (finished_) {
    internal(name, "add_param after finish");
  }
  param_decls_.push_back(
      {name, std::move(shape), dtype.value_or(dtype_), false, std::move(strides)});
}

void TableModel::add_param(const std::string& name, Shape shape, std::optional<DType> dtype,
                           StrideRule strides) {
  add_param(
      name, [shape](int) { return shape; }, dtype, std::move(strides));
}

void TableModel::add_target(const std::string& tensor, const std::string& param, Shape src_shape,
                            BlockRule copy, std::string empty_reason) {
  if (finished_) {
    internal(tensor, "add_target after finish");
  }
  targets_[tensor].push_back(
      {param, std::move(src_shape), std::move(copy), std::move(empty_reason)});
}

void TableModel::add_fill(const std::string& param, BlockRule zero) {
  if (finished_) {
    internal(param, "add_fill after finish");
  }
  fill_decls_.push_back({param, std::move(zero)});
}

void TableModel::set_global_experts(const std::string& param, std::uint64_t rows,
                                    RowsRule rows_of) {
  if (finished_) {
    internal(param, "set_global_experts after finish");
  }
  global_experts_[param] = {rows, std::move(rows_of)};
}

void TableModel::add_drop_pattern(std::string pattern, std::string reason) {
  drop_patterns_.emplace_back(std::move(pattern), std::move(reason));
}

void TableModel::set_transient(const std::string& name) {
  for (ParamDecl& d : param_decls_) {
    if (d.name == name) {
      d.transient = true;
      return;
    }
  }
  internal(name, "set_transient names a param that was not declared");
}

void TableModel::serve_as(const std::string& name, ShapeRule served) {
  for (ParamDecl& d : param_decls_) {
    if (d.name == name) {
      d.served = std::move(served);
      return;
    }
  }
  internal(name, "serve_as names a param that was not declared");
}

// Points every target and fill of a param in `to` at its replacement (a transient
// the checkpoint loads into instead: load_through, apply_quant's twins, apply_online).
void TableModel::retarget(const std::map<std::string, std::string>& to) {
  for (auto& [tensor, list] : targets_) {
    for (Target& t : list) {
      if (auto it = to.find(t.param); it != to.end()) {
        t.param = it->second;
      }
    }
  }
  for (Fill& f : fill_decls_) {
    if (auto it = to.find(f.param); it != to.end()) {
      f.param = it->second;
    }
  }
}

void TableModel::load_through(const std::string& suffix, const std::string& twin_suffix,
                              DType dtype) {
  if (finished_) {
    internal(suffix, "load_through after finish");
  }
  std::map<std::string, std::string> twin_of;
  std::vector<ParamDecl> twins;
  for (const ParamDecl& d : param_decls_) {
    if (!d.transient && d.name.ends_with(suffix)) {
      twin_of.emplace(d.name, d.name + twin_suffix);
      twins.push_back({d.name + twin_suffix, d.shape, dtype, true});
    }
  }
  for (ParamDecl& t : twins) {
    param_decls_.push_back(std::move(t));
  }
  retarget(twin_of);
}

void TableModel::add_drop_name(std::string name, std::string reason) {
  drop_names_[std::move(name)] = std::move(reason);
}

void TableModel::set_quantization(QuantScheme scheme) {
  if (finished_) {
    internal(family_, "set_quantization after finish");
  }
  quant_ = std::move(scheme);
}

void TableModel::finish() {
  if (finished_) {
    internal(family_, "finish called twice");
  }
  if (quant_.quantized()) {
    apply_quant();
  } else if (quant_.online != QuantScheme::Online::kNone) {
    apply_online();
  }
  shells_.clear();
  for (int tp_rank : layout_.local_ranks) {
    RankShell shell;
    shell.tp_rank = tp_rank;
    for (const ParamDecl& decl : param_decls_) {
      ParamSpec p;
      p.name = decl.name;
      p.dtype = decl.dtype;
      p.shape = decl.shape(tp_rank);
      if (decl.served) {
        p.loaded_shape = std::exchange(p.shape, decl.served(tp_rank));
        if (element_count(p.shape) != element_count(p.loaded_shape)) {
          internal(decl.name, "served as " + format_shape(p.shape) + ", loaded as " +
                                  format_shape(p.loaded_shape));
        }
      }
      p.strides = contiguous_strides(p.shape);
      if (decl.strides) {
        p.strides = decl.strides(p.shape);
        if (!dense_permutation(p.shape, p.strides)) {
          internal(decl.name, "strides " + format_shape(p.strides) + " do not lay out the " +
                                  format_shape(p.shape) + " parameter densely");
        }
      }
      p.transient = decl.transient;
      std::uint64_t elems = element_count(p.shape);
      if (__builtin_mul_overflow(elems, dtype_size(p.dtype), &p.nbytes)) {
        internal(decl.name, "param size overflows 64 bits");
      }
      shell.params.push_back(std::move(p));
    }
    std::sort(shell.params.begin(), shell.params.end(),
              [](const ParamSpec& a, const ParamSpec& b) { return a.name < b.name; });
    for (std::size_t i = 0; i < shell.params.size(); ++i) {
      if (!shell.by_name.emplace(shell.params[i].name, i).second) {
        internal(shell.params[i].name, "param declared twice");
      }
    }
    shells_.push_back(std::move(shell));
  }
  auto index_of = [&](const RankShell& shell, const std::string& param) {
    auto it = shell.by_name.find(param);
    if (it == shell.by_name.end()) {
      internal(param, "a rule names a param that was not declared");
    }
    return it->second;
  };
  for (const auto& [tensor, targets] : targets_) {
    for (const Target& t : targets) {
      for (const RankShell& shell : shells_) {
        index_of(shell, t.param);
      }
    }
  }
  fills_.clear();
  for (const Fill& f : fill_decls_) {
    for (std::size_t i = 0; i < shells_.size(); ++i) {
      std::size_t param = index_of(shells_[i], f.param);
      const ParamSpec& spec = shells_[i].params[param];
      for (const Block& b : f.zero(shells_[i].tp_rank)) {
        if (b.length == 0) {
          continue;
        }
        if (b.kind != Block::Kind::kZero) {
          internal(f.param, "a fill rule returned a copy block");
        }
        Piece p = block_to_piece(b, as_1d(spec.placed_shape()), spec.dtype,
                                 as_1d(spec.placed_shape()), spec.dtype, spec.name);
        p.local_rank = i;
        p.param = param;
        fills_.push_back(p);
      }
    }
  }
  finished_ = true;
}

std::vector<std::uint64_t> TableModel::shard_starts(const std::string& weight) const {
  auto it = shard_starts_.find(weight);
  return it == shard_starts_.end() ? std::vector<std::uint64_t>{} : it->second;
}

void TableModel::add_note(const std::string& note) {
  if (std::find(notes_.begin(), notes_.end(), note) == notes_.end()) {
    notes_.push_back(note);
  }
}

void TableModel::add_hooks(std::vector<PostLoadHook> hooks) {
  if (!finished_) {
    internal(hooks.empty() ? family_ : hooks.front().name, "add_hook before finish");
  }
  validate_hooks(*this, hooks, hooks_);
  for (PostLoadHook& h : hooks) {
    hooks_.push_back(std::move(h));
  }
}

void TableModel::add_hook(PostLoadHook hook) {
  std::vector<PostLoadHook> one;
  one.push_back(std::move(hook));
  add_hooks(std::move(one));
}

Route TableModel::route(const io::TensorInfo& tensor) const {
  if (!finished_) {
    internal(tensor.name, "route before finish");
  }
  Route route;
  if (auto it = drop_names_.find(tensor.name); it != drop_names_.end()) {
    route.kind = RouteKind::kDropped;
    route.reason = it->second;
    return route;
  }
  for (const auto& [pattern, reason] : drop_patterns_) {
    if (tensor.name.find(pattern) != std::string::npos) {
      route.kind = RouteKind::kDropped;
      route.reason = reason;
      return route;
    }
  }
  auto it = targets_.find(tensor.name);
  if (it == targets_.end()) {
    if (strict_) {
      throw Error(Stage::kMapping, tensor.file, tensor.name,
                  "no parameter of " + architecture_ + " takes this tensor (load.strict is on)");
    }
    route.kind = RouteKind::kUnmapped;
    route.reason = "unknown_name";
    return route;
  }
  bool any_block = false;  // some local rank's rule gave a block, if only an empty one
  for (const Target& t : it->second) {
    const RankShell& first = shells_.front();
    const ParamSpec& first_spec = first.params[first.by_name.at(t.param)];
    // The dtype first: a weight stored in another format is named as such, not as a
    // shape mismatch (an NVFP4 param's packed shape).
    if (!castable(tensor.dtype, first_spec.dtype)) {
      std::string why = "only BF16, F16 and F32 convert into each other";
      const bool stored_quantized = tensor.dtype == DType::kF8E4M3 || tensor.dtype == DType::kU8;
      if (stored_quantized && !quantized_dtype(first_spec.dtype)) {
        why = quant_.quantized()
                  ? "config.json's quantization_config does not quantize this parameter"
                  : "config.json has no quantization_config, so the model is not FP8; an "
                    "FP8 checkpoint needs its quantization_config";
      } else if (quantized_dtype(first_spec.dtype)) {
        why = "config.json's quantization_config (" + describe(quant_) +
              ") says this weight is stored as " + std::string(dtype_name(first_spec.dtype)) +
              (first_spec.dtype == DType::kU8 ? " (two E2M1 values a byte)" : "");
      }
      throw Error(Stage::kPlacement, tensor.file, tensor.name,
                  "cannot load a " + std::string(dtype_name(tensor.dtype)) +
                      " weight into parameter " + t.param + " (" +
                      std::string(dtype_name(first_spec.dtype)) + "): " + why);
    }
    if (as_1d(tensor.shape) != as_1d(t.src_shape)) {
      throw Error(Stage::kPlacement, tensor.file, tensor.name,
                  "Attempted to load weight " + tensor.name + " " + format_shape(tensor.shape) +
                      " into parameter " + t.param + " " + format_shape(first_spec.shape) +
                      " (tp rank " + std::to_string(first.tp_rank) + " of " +
                      std::to_string(layout_.tp) + "): the checkpoint tensor must be " +
                      format_shape(t.src_shape));
    }
    for (std::size_t i = 0; i < shells_.size(); ++i) {
      const RankShell& shell = shells_[i];
      std::size_t param = shell.by_name.at(t.param);
      const ParamSpec& spec = shell.params[param];
      for (const Block& b : t.copy(shell.tp_rank)) {
        any_block = true;
        if (b.length == 0) {
          continue;
        }
        if (b.kind != Block::Kind::kCopy) {
          internal(t.param, "a target rule returned a zero block (zero blocks are fills)");
        }
        Piece p = block_to_piece(b, as_1d(tensor.shape), tensor.dtype, as_1d(spec.placed_shape()),
                                 spec.dtype, spec.name);
        p.local_rank = i;
        p.param = param;
        route.pieces.push_back(p);
      }
    }
  }
  if (tensor.interleaved_heads != 0) {
    // GGUF's llama attn_q / attn_k: placed in the Hugging Face row order above, read
    // from where llama.cpp's rope order keeps each row.
    route.pieces = unpermute_rows(route.pieces, tensor);
  }
  if (tensor.blocks != GgmlBlocks::kNone) {
    // A quantized GGUF tensor: the pieces read its blocks and dequantize.
    route.pieces = to_block_pieces(std::move(route.pieces), tensor);
  }
  // Pieces were produced target by target; keep them grouped by local rank.
  std::stable_sort(route.pieces.begin(), route.pieces.end(),
                   [](const Piece& a, const Piece& b) { return a.local_rank < b.local_rank; });
  if (route.pieces.empty()) {
    // A local rank holds the tensor's part but all of it is padding (say, an
    // expert whose moe-tp share lies past the real intermediate size under
    // unaligned_tp=pad): no_local_slice; no local rank holds it at all: the
    // target's own reason.
    route.kind = RouteKind::kDropped;
    route.reason = any_block ? "no_local_slice" : it->second.front().empty_reason;
    return route;
  }
  route.kind = RouteKind::kPlaced;
  route.src_begin = route.pieces.front().src_offset;
  route.src_end = 0;
  for (const Piece& p : route.pieces) {
    route.src_begin = std::min(route.src_begin, p.src_offset);
    route.src_end = std::max(route.src_end, p.src_end());
  }
  if (route.src_end > tensor.nbytes) {
    // io/ validates nbytes against shape and dtype; this guards hand-made TensorInfos.
    throw Error(Stage::kPlacement, tensor.file, tensor.name,
                "the tensor holds " + std::to_string(tensor.nbytes) + " bytes but its shape " +
                    format_shape(tensor.shape) + " and dtype need at least " +
                    std::to_string(route.src_end));
  }
  return route;
}

}  // namespace ferry::models
