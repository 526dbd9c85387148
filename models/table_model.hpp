// A Model described by tables: the params each local rank holds, which checkpoint
// names feed which params through which placement rule, which names are dropped,
// which param regions are zero-filled, and the post-load hooks. Families fill one
// in their factory (models/dense.cpp) and hand it out as a const Model; tests build
// toy ones (a param only a hook fills, for instance).
//
// Building is single-threaded: declare params, targets, fills and drops, call
// finish(), then add hooks (they refer to param indices, known after finish()).
// After that the object is only read, so every Model method is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/model.hpp"
#include "models/placement.hpp"
#include "models/quant.hpp"

namespace ferry::models {

class TableModel final : public Model {
 public:
  // A param's local shape on tp rank `tp_rank`.
  using ShapeRule = std::function<Shape(int tp_rank)>;
  // A param's storage strides (elements) for its local shape; empty: row-major.
  using StrideRule = std::function<std::vector<std::uint64_t>(const Shape& shape)>;
  // The blocks rank `tp_rank` takes from a tensor (or zero-fills, for fills).
  using BlockRule = std::function<std::vector<Block>(int tp_rank)>;

  // `layout` must already be normalized (normalize_layout); `architecture` is used
  // in messages ("no parameter of LlamaForCausalLM takes this tensor").
  TableModel(std::string family, std::string architecture, ParallelLayout layout, DType dtype,
             bool strict);

  // ---- building ----------------------------------------------------------------
  // Declares a param on every local rank, of the model's dtype unless `dtype` says
  // otherwise (e.g. an F32 router bias in a BF16 model). `strides` lays out its
  // storage other than row-major (the MLA split's w_kc / w_vc, DeepGEMM's packed
  // scales); finish() refuses strides that are not a dense permutation of the shape.
  void add_param(const std::string& name, ShapeRule shape, std::optional<DType> dtype = {},
                 StrideRule strides = {});
  // The same shape on every rank.
  void add_param(const std::string& name, Shape shape, std::optional<DType> dtype = {},
                 StrideRule strides = {});
  // Makes a declared param transient (ParamSpec::transient): loaded for a hook to
  // read, then freed; the scales quantization gives it are transient too.
  void set_transient(const std::string& name);
  // A declared param is served in `served` (ParamSpec::shape, the same element count)
  // once a post-load hook has re-laid it out in place; its targets and fills address
  // its declared shape (ParamSpec::loaded_shape).
  void serve_as(const std::string& name, ShapeRule served);
  // Every declared param whose name ends with `suffix` gets a transient twin
  // <name><twin_suffix> of the same shape in `dtype`, which its targets and fills
  // write instead: a hook computes the param from the twin (Gemma 1's norm + 1).
  void load_through(const std::string& suffix, const std::string& twin_suffix, DType dtype);
  // Checkpoint tensor `tensor`, whose shape must be `src_shape`, feeds `param` with
  // the blocks `copy` returns for each local rank. A tensor may feed several params.
  // When no local rank gets a block from any of its targets the tensor is dropped
  // unread with `empty_reason` (an expert no local device owns: "remote_expert").
  void add_target(const std::string& tensor, const std::string& param, Shape src_shape,
                  BlockRule copy, std::string empty_reason = "no_local_slice");
  // Fused experts `param` (a w13 / w2 weight) has `rows` global experts, and
  // `rows_of(tensor)` gives the global rows a checkpoint tensor feeding it stands
  // for (empty: none). Where a quantization keeps a per-expert scalar for every
  // global expert on each rank (SGLang 0.5.23's `_sglang_require_global_experts`:
  // ModelOpt NVFP4's w13_input_scale / w2_input_scale), that scale param is
  // [rows(, shards)] on every rank and each rank reads every expert's scalar.
  using RowsRule = std::function<std::vector<std::uint64_t>(const std::string& tensor)>;
  void set_global_experts(const std::string& param, std::uint64_t rows, RowsRule rows_of);
  // Zero blocks of `param` that no tensor writes (padding).
  void add_fill(const std::string& param, BlockRule zero);
  // Tensors whose name contains `pattern` (or equals `name`) are dropped with
  // `reason`. Drops are checked before targets.
  void add_drop_pattern(std::string pattern, std::string reason);
  void add_drop_name(std::string name, std::string reason);
  // The checkpoint's quantization (models/quant.hpp), applied by finish(): each
  // quantized linear param becomes F8_E4M3 and gets its <param>_scale_inv (F32
  // block scales), fed from each target's <tensor>_scale_inv with the target's
  // blocks in block units. finish() then refuses a share that is not whole blocks
  // (check_block_aligned, naming the tensor) and a fill (padding) of a quantized
  // param. Call before finish().
  void set_quantization(QuantScheme scheme);
  // Builds the shells (params sorted by name) and the fill pieces. Throws
  // Error(Stage::kPlacement) for a duplicate param or a target / fill naming an
  // undeclared one: those are bugs in a family's tables.
  void finish();
  // After finish(): appends hooks after validate_hooks (models/hooks.hpp), checked
  // together with the ones already added. make_model is the one place production
  // hooks are registered (the family's rules, then the quantization's).
  void add_hooks(std::vector<PostLoadHook> hooks);
  void add_hook(PostLoadHook hook);
  // A note for the operator (Model::notes); the same text is kept once.
  void add_note(const std::string& note);

  // After finish(): the first rows of the fused shards of quantized weight `weight`
  // (the q / k / v or gate / up slots its scales follow; {0} for one shard), the same
  // on every local rank; empty for a param that is not a quantized weight.
  std::vector<std::uint64_t> shard_starts(const std::string& weight) const;

  // ---- Model ---------------------------------------------------------------------
  std::string family() const override { return family_; }
  const ParallelLayout& layout() const override { return layout_; }
  const std::vector<RankShell>& shells() const override { return shells_; }
  Route route(const io::TensorInfo& tensor) const override;
  std::vector<Piece> fill_pieces() const override { return fills_; }
  std::vector<PostLoadHook> hooks() const override { return hooks_; }
  std::vector<std::string> notes() const override { return notes_; }

 private:
  struct Target {
    std::string param;
    Shape src_shape;
    BlockRule copy;
    std::string empty_reason;
  };
  struct Fill {
    std::string param;
    BlockRule zero;
  };

  std::string family_;
  std::string architecture_;
  ParallelLayout layout_;
  DType dtype_;
  bool strict_;
  bool finished_ = false;

  struct ParamDecl {
    std::string name;
    ShapeRule shape;
    DType dtype;
    bool transient = false;
    StrideRule strides = {};
    ShapeRule served = {};  // serve_as
  };

  // Quantized checkpoints (table_quant.cpp): the weights' scale params and the
  // targets that load them, by the method's QuantTraits row.
  struct QuantWork;
  struct WeightScales;
  void apply_quant();
  std::map<std::string, ShapeRule> quantized_weights() const;
  WeightScales weight_scales(ParamDecl& d, ShapeRule weight, const QuantWork& w);
  void add_weight_companions(const WeightScales& s, QuantWork& w) const;
  void add_requant_outputs(const WeightScales& s, QuantWork& w) const;
  static Target scale_target(const WeightScales& s, const Target& t, const QuantWork& w);
  static void pack_target(const std::string& tensor, Target& t, const QuantWork& w);
  bool add_scale_targets(const WeightScales& s, QuantWork& w);
  void add_kv_cache_scales(QuantWork& w) const;
  void apply_online();
  void retarget(const std::map<std::string, std::string>& to);

  QuantScheme quant_;
  std::vector<ParamDecl> param_decls_;
  std::map<std::string, std::vector<Target>> targets_;
  std::vector<Fill> fill_decls_;
  std::vector<std::pair<std::string, std::string>> drop_patterns_;
  std::map<std::string, std::string> drop_names_;

  std::vector<RankShell> shells_;
  std::vector<Piece> fills_;
  std::vector<PostLoadHook> hooks_;
  std::vector<std::string> notes_;
  std::map<std::string, std::vector<std::uint64_t>> shard_starts_;
  std::map<std::string, std::pair<std::uint64_t, RowsRule>> global_experts_;
};

// Checks and completes a layout: tp, ep, pp >= 1, 0 <= pp_rank < pp, local ranks
// distinct and inside [0, tp); empty local ranks become 0..tp-1. Throws
// Error(Stage::kConfig) naming the field.
ParallelLayout normalize_layout(const ParallelLayout& layout);

}  // namespace ferry::models
