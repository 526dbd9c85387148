// Quantized variants of the tiny synthetic checkpoints (synth::SynthQuant: FP8 with
// block, channel or tensor scales, ModelOpt FP8, NVFP4), and the checks that compare
// what a rank loaded with readings of one naive reference.
//
// The checkpoint: every quantized linear weight (the spec, not ferry's predicate:
// *_proj.weight and *_proj_with_mqa.weight but eh_proj and the V3.2 indexer's
// weights_proj, the experts, and the indexer's wq_b and wk) stored in
// the layout of synth/synth.hpp. A family's reference (which knows nothing of
// quantization) is evaluated with value functions over each checkpoint tensor's
// logical [N, K] elements:
//   - weight(): the stored element: the FP8 value, or the byte that packs an NVFP4
//     pair; each quantized param must hold them exactly (packed: byte j of a row
//     is logical elements 2j and 2j + 1);
//   - own_scale(): the element's own weight scale in its source tensor (its block's,
//     its row's, its tensor's, its 16-group's); the loaded scale param must give
//     each element of the param that same scale, which is what makes every local
//     element dequantize as its source element did;
//   - tensor_id(), input_scale(), scale_2(): for the per-shard scalars (one per
//     fused shard, in row order): the shards of a param are the runs of source
//     tensors down its rows, and element (.., shard) of the scalar param must be
//     that shard's source scalar;
//   - dequantized(): the element's value (f32(W) * scales, NVFP4: e2m1 * scale *
//     scale_2) rounded to BF16, what an output computed from the dequantized weight
//     (DeepSeek's w_kc / w_vc) holds.
// Header-only, like the references it is used with.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "models/model.hpp"
#include "models/quant.hpp"
#include "models/reference_util.hpp"
#include "synth/synth.hpp"
#include "testing/dtype_codec.hpp"

namespace ferry::testing::quant {

using synth::SynthQuant;
constexpr std::uint64_t kBlock = 8;
constexpr std::uint64_t kGroup = synth::kSynthNvfp4Group;

inline bool ends_with(const std::string& s, const std::string& x) {
  return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
}

inline bool quantized_param(const std::string& name) {
  return ((ends_with(name, "_proj.weight") || ends_with(name, "_proj_with_mqa.weight") ||
           ends_with(name, "experts.w13_weight") || ends_with(name, "experts.w2_weight")) &&
          !ends_with(name, "eh_proj.weight") && !ends_with(name, "weights_proj.weight")) ||
         ends_with(name, "indexer.wq_b.weight") || ends_with(name, "indexer.wk.weight");
}

// "<module>.weight" + "input_scale" -> "<module>.input_scale".
inline std::string companion(const std::string& weight, const std::string& suffix) {
  return weight.substr(0, weight.size() - 6) + suffix;
}

inline bool per_tensor(SynthQuant k) {
  return k == SynthQuant::kFp8Tensor || k == SynthQuant::kModelOptFp8;
}
inline bool input_scales(SynthQuant k) {
  return per_tensor(k) || k == SynthQuant::kNvfp4;
}
inline std::string scale_suffix(SynthQuant k) {
  return k == SynthQuant::kFp8Block ? "weight_scale_inv" : "weight_scale";
}

struct Layout {
  SynthQuant kind = SynthQuant::kFp8Block;
  std::uint64_t block = kBlock;                              // kFp8Block's
  std::map<std::string, std::vector<std::uint64_t>> shapes;  // quantized tensors, logical
  std::map<std::string, float> ids;                          // every tensor: 1, 2, ...
};

// config.json with a ModelOpt hf_quant_config.json merged in, as the runtime does.
inline void set_quant_config(nlohmann::json& config, SynthQuant kind,
                             std::uint64_t block = kBlock) {
  if (nlohmann::json q = synth::synth_quant_config(kind, block); !q.is_null()) {
    config["quantization_config"] = q;
  }
  if (nlohmann::json h = synth::synth_hf_quant_config(kind); !h.is_null()) {
    config = models::with_hf_quant_config(config, h);
  }
}

// Turns a BF16 tensor list and config into `kind`'s layout (tools' synth transform;
// the values are this header's).
inline Layout quantize(std::vector<synth::SynthTensor>& tensors, nlohmann::json& config,
                       SynthQuant kind = SynthQuant::kFp8Block, std::uint64_t block = kBlock) {
  Layout l;
  l.kind = kind;
  l.block = block;
  std::map<std::string, std::vector<std::uint64_t>> logical;
  for (const synth::SynthTensor& t : tensors) {
    logical[t.name] = t.shape;
  }
  synth::synth_quantize(tensors, kind, block);
  set_quant_config(config, kind, block);
  for (const synth::SynthTensor& t : tensors) {
    l.ids[t.name] = static_cast<float>(l.ids.size() + 1);
    // A weight whose dtype synth changed (its scales are new names).
    auto it = logical.find(t.name);
    if (it != logical.end() && (t.dtype == DType::kF8E4M3 || t.dtype == DType::kU8)) {
      l.shapes[t.name] = it->second;
    }
  }
  return l;
}

class Values {
 public:
  Values(std::uint64_t seed, Layout layout) : seed_(seed), l_(std::move(layout)) {}

  const Layout& layout() const { return l_; }

  float weight(const std::string& name, std::uint64_t i) {
    auto it = l_.shapes.find(name);
    if (it == l_.shapes.end()) {
      return synth::synth_value(seed_, name, i);
    }
    if (l_.kind == SynthQuant::kNvfp4) {
      return static_cast<float>(byte_of(name, packed_index(it->second, i)));
    }
    return e4m3(synth::synth_value(seed_, name, i));
  }
  float own_scale(const std::string& name, std::uint64_t i) {
    auto it = l_.shapes.find(name);
    if (it == l_.shapes.end()) {
      return 0.0f;
    }
    const std::uint64_t k = it->second[1];
    const std::uint64_t row = i / k;
    const std::uint64_t col = i % k;
    auto cached = scale_names_.find(name);
    if (cached == scale_names_.end()) {
      cached = scale_names_.emplace(name, companion(name, scale_suffix(l_.kind))).first;
    }
    const std::string& scale = cached->second;
    switch (l_.kind) {
      case SynthQuant::kFp8Block: {
        const std::uint64_t b = l_.block;
        return synth::synth_value(seed_, scale, row / b * ((k + b - 1) / b) + col / b);
      }
      case SynthQuant::kFp8Channel:
        return synth::synth_value(seed_, scale, row);
      case SynthQuant::kNvfp4:
        return e4m3(synth::synth_value(seed_, scale, row * (k / kGroup) + col / kGroup));
      default:
        return synth::synth_value(seed_, scale, 0);
    }
  }
  float scale_2(const std::string& name, std::uint64_t) {
    return l_.shapes.count(name) != 0
               ? synth::synth_value(seed_, companion(name, "weight_scale_2"), 0)
               : 0.0f;
  }
  float input_scale(const std::string& name, std::uint64_t) {
    return l_.shapes.count(name) != 0
               ? synth::synth_value(
                     seed_, synth::synth_value_name(l_.kind, companion(name, "input_scale")), 0)
               : 0.0f;
  }
  float tensor_id(const std::string& name, std::uint64_t) { return l_.ids.at(name); }
  // A scalar tensor's value (ModelOpt's k_scale / v_scale).
  float scalar(const std::string& tensor) const { return synth::synth_value(seed_, tensor, 0); }
  // f32(W) * its scale, unrounded (FP8 only): what SGLang's block_quant_to_tensor_quant
  // and channel_quant_to_tensor_quant requantize from.
  float dequantized_f32(const std::string& name, std::uint64_t i) {
    return l_.shapes.count(name) == 0 ? weight(name, i) : weight(name, i) * own_scale(name, i);
  }
  float dequantized(const std::string& name, std::uint64_t i) {
    if (l_.shapes.count(name) == 0) {
      return weight(name, i);  // not quantized: the value itself (exact in BF16)
    }
    float v = 0;
    if (l_.kind == SynthQuant::kNvfp4) {
      const auto byte = static_cast<std::uint8_t>(weight(name, i));
      const std::uint8_t code = i % 2 == 0 ? (byte & 0xF) : (byte >> 4);
      static constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
      const float e = (code & 8) != 0 ? -kE2m1[code & 7] : kE2m1[code & 7];
      v = e * own_scale(name, i) * scale_2(name, i);
    } else {
      v = weight(name, i) * own_scale(name, i);
    }
    const std::uint32_t bits = static_cast<std::uint32_t>(synth::float_to_bf16_bits(v)) << 16;
    float out = 0;
    std::memcpy(&out, &bits, 4);
    return out;
  }
  // A stored tensor's bytes, as ferry synth writes them.
  std::vector<std::byte> bytes(const synth::SynthTensor& t) const {
    std::vector<std::byte> out(t.nbytes());
    synth::synth_encode(t.dtype, seed_, t.value_name.empty() ? t.name : t.value_name, 0, out);
    return out;
  }

 private:
  static std::uint64_t packed_index(const std::vector<std::uint64_t>& logical, std::uint64_t i) {
    const std::uint64_t k = logical[1];
    return (i / k) * (k / 2) + (i % k) / 2;
  }
  std::uint8_t byte_of(const std::string& name, std::uint64_t index) const {
    std::byte b{};
    synth::synth_encode(DType::kU8, seed_, name, index, std::span<std::byte>(&b, 1));
    return static_cast<std::uint8_t>(b);
  }
  float e4m3(float v) {
    auto it = rounded_.find(v);  // synth values take 255 values: round each once
    return it != rounded_.end() ? it->second : rounded_.emplace(v, round_to_e4m3(v)).first->second;
  }

  std::uint64_t seed_;
  Layout l_;
  std::map<float, float> rounded_;
  std::map<std::string, std::string> scale_names_;  // weight -> its scale tensor
};

// Routes every tensor of `tensors` (placed or dropped, never unmapped), runs the
// pieces and fills into `buffers`, and returns the routes.
inline std::vector<models::Route> load(const models::Model& model,
                                       const std::vector<synth::SynthTensor>& tensors,
                                       const Values& values, ParamBuffers& buffers) {
  std::vector<models::Route> routes;
  for (const synth::SynthTensor& t : tensors) {
    models::Route route = model.route(tensor_info(t.name, t.dtype, t.shape));
    EXPECT_NE(route.kind, models::RouteKind::kUnmapped) << t.name;
    if (route.kind != models::RouteKind::kPlaced) {
      continue;
    }
    const std::vector<std::byte> bytes = values.bytes(t);
    std::span<const std::byte> window(bytes.data() + route.src_begin,
                                      route.src_end - route.src_begin);
    for (const models::Piece& p : route.pieces) {
      apply_piece(p, window, route.src_begin, buffers);
    }
    routes.push_back(std::move(route));
  }
  for (const models::Piece& p : model.fill_pieces()) {
    apply_piece(p, {}, 0, buffers);  // vocabulary padding
  }
  return routes;
}

using ValueFn = std::function<float(const std::string&, std::uint64_t)>;

namespace detail {

// A [.., N / bn, K / bk] scale param against the per-element reference `ref`
// (logical [.., N, K]); bk = 0 for a channel scale ([.., N, 1]).
template <typename Param>
bool check_blocked(const models::ParamSpec& spec, const std::byte* base, const Param& ref,
                   std::uint64_t bn, std::uint64_t bk, DType dtype, const std::string& where) {
  const std::size_t d = ref.shape.size();
  const std::uint64_t rows = ref.shape[d - 2];
  const std::uint64_t cols = ref.shape[d - 1];
  std::vector<std::uint64_t> sshape = ref.shape;
  sshape[d - 2] = (rows + bn - 1) / bn;
  sshape[d - 1] = bk == 0 ? 1 : (cols + bk - 1) / bk;
  EXPECT_EQ(spec.shape, sshape) << where;
  EXPECT_EQ(spec.dtype, dtype) << where;
  if (spec.shape != sshape || spec.dtype != dtype) {
    return false;
  }
  for (std::uint64_t e = 0; e < ref.values.size(); ++e) {
    const std::uint64_t lead = e / (rows * cols);
    const std::uint64_t col = bk == 0 ? 0 : e % cols / bk;
    const std::uint64_t at = (lead * sshape[d - 2] + (e / cols) % rows / bn) * sshape[d - 1] + col;
    const float got = decode_one(base + at * dtype_size(dtype), dtype);
    if (got != ref.values[e]) {
      ADD_FAILURE() << where << ": weight element " << e << " reads scale " << got
                    << ", its source's is " << ref.values[e];
      return false;
    }
  }
  return true;
}

// A [.., shards] per-shard scalar param: the shards of each matrix are its runs of
// source tensors down the rows (`ids`), in order. Stacked experts follow SGLang
// 0.5.23's FusedMoE create_weights (Fp8MoEMethod, ModelOptFp8MoEMethod,
// ModelOptNvFp4FusedMoEMethod): one shard is [E], not [E, 1]; `merged` (the FP8
// methods' w13_input_scale, [E]) keeps one value per expert, the last shard's:
// FusedMoE._load_single_value writes w1's and then w3's into the same element (the
// checkpoint's name order; these checkpoints put up / w3 rows after gate / w1).
// (NVFP4's expert input scales hold every global expert: check_global_inputs.)
template <typename Param>
bool check_per_shard(const models::ParamSpec& spec, const std::byte* base, const Param& ref,
                     const Param& ids, const std::string& where, bool merged = false) {
  const std::size_t d = ref.shape.size();
  const std::uint64_t matrix = ref.shape[d - 2] * ref.shape[d - 1];
  const std::uint64_t matrices = matrix == 0 ? 0 : ref.values.size() / matrix;
  std::vector<std::vector<float>> order(matrices);  // per matrix, ids by first row
  for (std::uint64_t e = 0; e < ref.values.size(); ++e) {
    std::vector<float>& o = order[e / matrix];
    if (std::find(o.begin(), o.end(), ids.values[e]) == o.end()) {
      o.push_back(ids.values[e]);
    }
  }
  std::vector<std::uint64_t> sshape(ref.shape.begin(), ref.shape.end() - 2);
  const std::uint64_t shards = matrices == 0 ? 1 : order[0].size();
  const bool stacked = !sshape.empty();
  merged = merged && stacked;
  if (!stacked || (shards > 1 && !merged)) {
    sshape.push_back(shards);
  }
  const std::uint64_t stored = stacked && sshape.size() == 1 ? 1 : sshape.back();
  EXPECT_EQ(spec.shape, sshape) << where;
  EXPECT_EQ(spec.dtype, DType::kF32) << where;
  if (spec.shape != sshape || spec.dtype != DType::kF32) {
    return false;
  }
  for (std::uint64_t e = 0; e < ref.values.size(); ++e) {
    const std::vector<float>& o = order[e / matrix];
    const std::uint64_t shard =
        static_cast<std::uint64_t>(std::find(o.begin(), o.end(), ids.values[e]) - o.begin());
    if (merged && shard + 1 != o.size()) {
      continue;  // overwritten by the last shard's value
    }
    const std::uint64_t slot = merged || stored == 1 ? 0 : shard;
    const float got = decode_one(base + ((e / matrix) * stored + slot) * 4, DType::kF32);
    if ((!merged && o.size() != stored) || got != ref.values[e]) {
      ADD_FAILURE() << where << ": weight element " << e << " (shard " << shard << " of "
                    << o.size() << ") reads " << got << ", its source's is " << ref.values[e];
      return false;
    }
  }
  return true;
}

// ModelOpt NVFP4's fused experts keep every global expert's input scales on each
// rank: SGLang 0.5.23's ModelOptNvFp4FusedMoEMethod.create_weights makes
// w13_input_scale [num_experts, 2] and w2_input_scale [num_experts], marked
// `_sglang_require_global_experts`, and FusedMoE.weight_loader writes checkpoint
// expert e's scalar to row e (no EPLB here) on every rank, the fused shared expert's
// after the routed ones. w13's row holds its last shard's (up_proj / w3) in both
// elements. The experts are found by name in the checkpoint; the shared expert is
// fused where the rank's reference w13 / w2 reads its tensor (`weight_ids`).
template <typename Param>
bool check_global_inputs(const models::ParamSpec& spec, const std::byte* base, Values& values,
                         const std::string& weight, const Param& weight_ids,
                         const std::string& where) {
  const bool w13 = ends_with(weight, "w13_weight");
  // The checkpoint's "<layer>.experts." (the draft's params are named otherwise): that
  // of a routed expert tensor the rank's reference reads.
  const std::map<std::string, float>& ids = values.layout().ids;
  std::string module;
  for (const auto& [name, id] : ids) {
    const std::size_t at = name.find(".experts.");
    if (at != std::string::npos && module.empty() &&
        std::find(weight_ids.values.begin(), weight_ids.values.end(), id) !=
            weight_ids.values.end()) {
      module = name.substr(0, at + std::string(".experts.").size());
    }
  }
  const std::string parent = module.substr(0, module.size() - std::string("experts.").size());
  std::map<std::uint64_t, std::string> by_expert;
  for (const auto& [name, shape] : values.layout().shapes) {
    if (name.compare(0, module.size(), module) != 0) {
      continue;
    }
    const std::string rest = name.substr(module.size());
    const std::size_t dot = rest.find('.');
    const std::string id = rest.substr(0, dot);
    const std::string proj = dot == std::string::npos ? "" : rest.substr(dot + 1);
    if (!id.empty() && id.find_first_not_of("0123456789") == std::string::npos &&
        (proj == (w13 ? "up_proj.weight" : "down_proj.weight") ||
         proj == (w13 ? "w3.weight" : "w2.weight"))) {
      by_expert[std::stoull(id)] = name;
    }
  }
  std::vector<float> want;
  for (const auto& [e, name] : by_expert) {
    EXPECT_EQ(e, want.size()) << where << ": checkpoint experts are not 0 .. E - 1";
    want.push_back(values.input_scale(name, 0));
  }
  const std::string shared =
      parent + "shared_experts." + (w13 ? "up_proj" : "down_proj") + ".weight";
  if (auto it = ids.find(shared);
      it != ids.end() && std::find(weight_ids.values.begin(), weight_ids.values.end(),
                                   it->second) != weight_ids.values.end()) {
    want.push_back(values.input_scale(shared, 0));
  }
  std::vector<std::uint64_t> shape{want.size()};
  if (w13) {
    shape.push_back(2);
  }
  EXPECT_EQ(spec.shape, shape) << where << " (every global expert on each rank)";
  EXPECT_EQ(spec.dtype, DType::kF32) << where;
  if (want.empty() || spec.shape != shape || spec.dtype != DType::kF32) {
    return false;
  }
  const std::uint64_t per = w13 ? 2 : 1;
  for (std::uint64_t row = 0; row < want.size(); ++row) {
    for (std::uint64_t k = 0; k < per; ++k) {
      const float got = decode_one(base + (row * per + k) * 4, DType::kF32);
      if (got != want[row]) {
        ADD_FAILURE() << where << ": global expert " << row << " element " << k << " reads " << got
                      << ", its checkpoint input scale is " << want[row];
        return false;
      }
    }
  }
  return true;
}

}  // namespace detail

// Compares local rank `i` of `model` (its bytes in `buffers`) with the readings of
// a family's reference: `read(reading, fn)` must return that rank's params (a map
// from param name to something with .shape and .values, logical row-major) with every
// checkpoint element read through `fn`; `reading` names the reading ("weight",
// "own_scale", "tensor_id", "input_scale", "scale_2", "dequantized"), the same
// function for every rank, so a caller may keep what it computes from it. `dequantized_outputs`:
// params that hold the dequantized reading (w_kc, w_vc); the rest hold weight(). Returns how many
// scale params were checked. Params are read through the strides the shell reports.
template <typename Read>
std::size_t check_rank(const models::Model& model, std::size_t i, const ParamBuffers& buffers,
                       Values& values, const Read& read,
                       const std::set<std::string>& dequantized_outputs = {}) {
  const SynthQuant kind = values.layout().kind;
  auto reading = [&](const char* name, float (Values::*fn)(const std::string&, std::uint64_t)) {
    return read(std::string(name), ValueFn([&values, fn](const std::string& n, std::uint64_t e) {
                  return (values.*fn)(n, e);
                }));
  };
  const auto w = reading("weight", &Values::weight);
  const auto s = reading("own_scale", &Values::own_scale);
  using Map = std::decay_t<decltype(w)>;
  Map ids, in, s2, dq;
  if (per_tensor(kind) || kind == SynthQuant::kNvfp4) {
    ids = reading("tensor_id", &Values::tensor_id);
  }
  if (input_scales(kind)) {
    in = reading("input_scale", &Values::input_scale);
  }
  if (kind == SynthQuant::kNvfp4) {
    s2 = reading("scale_2", &Values::scale_2);
  }
  if (!dequantized_outputs.empty()) {
    dq = reading("dequantized", &Values::dequantized);
  }
  // MLA's split of an FP8 kv_b_proj whose blocks are not 128 x 128 (these checkpoints'
  // are 8 x 8), or whose scales are per channel or per tensor: SGLang 0.5.23's
  // post_load_weights requantizes the rank's kv_b_proj with one scale,
  // s = amax / 448 over it (scaled_fp8_quant), and splits the E4M3 values; the scale
  // is <attn>w_scale. NVFP4 is dequantized to the model dtype (ferry's choice).
  std::map<std::string, float> w_scale;  // <attn>w_scale -> s
  Map dq32;
  const bool fp8_split = kind != SynthQuant::kNvfp4;
  auto mla_output = [&](const std::string& name) {
    return fp8_split && dequantized_outputs.count(name) != 0 &&
           (ends_with(name, "self_attn.w_kc") || ends_with(name, "self_attn.w_vc"));
  };
  if (fp8_split && !dequantized_outputs.empty()) {
    dq32 = reading("dequantized_f32", &Values::dequantized_f32);
    for (const std::string& name : dequantized_outputs) {
      if (mla_output(name)) {
        float& amax = w_scale[name.substr(0, name.size() - 4) + "w_scale"];
        for (float v : dq32.at(name).values) {
          amax = std::max(amax, std::fabs(v));
        }
      }
    }
    for (auto& [name, amax] : w_scale) {
      amax = amax / 448.0f;
    }
  }
  // Expected names: the reference's, and each quantized weight's companions.
  // kind: 0 weight scale, 1 weight_scale_2, 2 input_scale; kv scales by prefix.
  std::map<std::string, std::pair<std::string, int>> companions;  // param -> (weight, kind)
  std::map<std::string, std::string> kv;  // attn.k_scale / v_scale -> source tensor
  std::set<std::string> names;
  for (const auto& [name, p] : w) {
    names.insert(name);
    if (!quantized_param(name)) {
      continue;
    }
    companions[companion(name, scale_suffix(kind))] = {name, 0};
    if (kind == SynthQuant::kNvfp4) {
      companions[companion(name, "weight_scale_2")] = {name, 1};
    }
    if (input_scales(kind)) {
      companions[companion(name, "input_scale")] = {name, 2};
    }
    // SGLang 0.5.23's Qwen3Attention, Qwen3MoeAttention and Glm4MoeAttention build
    // their RadixAttention without the quant config: no k_scale / v_scale params.
    const std::string family = model.family();
    const bool kv_params = family != "qwen3" && family != "qwen3_moe" && family != "glm4_moe";
    if (kind == SynthQuant::kModelOptFp8 && kv_params) {
      for (const std::string attn : {"qkv_proj.weight", "kv_b_proj.weight"}) {
        if (ends_with(name, "self_attn." + attn)) {
          const std::string pa = name.substr(0, name.size() - attn.size());
          // SGLang 0.5.23: maybe_remap_kv_scale_name gives attention the names
          // self_attn.attn.k_scale / v_scale; the DeepSeek loader renames MLA's
          // k_proj.k_scale to attn_mqa.k_scale (deepseek_weight_loader.py, load_weights).
          const bool gqa = attn[0] == 'q';
          const std::string at = pa + (gqa ? "attn." : "attn_mqa.");
          kv[at + "k_scale"] = pa + "k_proj.k_scale";
          kv[at + "v_scale"] = pa + "v_proj.v_scale";
        }
      }
    }
  }
  for (const auto& [name, c] : companions) {
    names.insert(name);
  }
  for (const auto& [name, source] : kv) {
    names.insert(name);
  }
  for (const auto& [name, scale] : w_scale) {
    names.insert(name);
  }
  const models::RankShell& shell = model.shells()[i];
  std::set<std::string> got_names;
  for (const models::ParamSpec& p : shell.params) {
    if (!p.transient) {  // loaded for a hook, then freed
      got_names.insert(p.name);
    }
  }
  EXPECT_EQ(got_names, names) << "tp rank " << shell.tp_rank;
  if (got_names != names) {
    return 0;
  }
  std::size_t scales = 0;
  for (std::size_t k = 0; k < shell.params.size(); ++k) {
    const models::ParamSpec& spec = shell.params[k];
    if (spec.transient) {
      continue;
    }
    const std::string where = spec.name + " tp rank " + std::to_string(shell.tp_rank);
    for (std::uint8_t n : buffers.writes[i][k]) {
      if (n != 1) {
        ADD_FAILURE() << where << ": a byte is written " << int(n) << " times";
        return scales;
      }
    }
    const std::byte* base = buffers.bytes[i][k].data();
    if (auto c = companions.find(spec.name); c != companions.end()) {
      const std::string& weight = c->second.first;
      bool ok = false;
      if (c->second.second == 1) {
        ok = detail::check_per_shard(spec, base, s2.at(weight), ids.at(weight), where);
      } else if (c->second.second == 2 && kind == SynthQuant::kNvfp4 &&
                 (ends_with(weight, "experts.w13_weight") ||
                  ends_with(weight, "experts.w2_weight"))) {
        ok = detail::check_global_inputs(spec, base, values, weight, ids.at(weight), where);
      } else if (c->second.second == 2) {
        ok = detail::check_per_shard(spec, base, in.at(weight), ids.at(weight), where,
                                     kind != SynthQuant::kNvfp4);
      } else if (kind == SynthQuant::kFp8Block) {
        ok = detail::check_blocked(spec, base, s.at(weight), values.layout().block,
                                   values.layout().block, DType::kF32, where);
      } else if (kind == SynthQuant::kNvfp4) {
        ok = detail::check_blocked(spec, base, s.at(weight), 1, kGroup, DType::kF8E4M3, where);
      } else if (kind == SynthQuant::kFp8Channel) {
        ok = detail::check_blocked(spec, base, s.at(weight), 1, 0, DType::kF32, where);
      } else {
        ok = detail::check_per_shard(spec, base, s.at(weight), ids.at(weight), where);
      }
      if (!ok) {
        return scales;
      }
      ++scales;
      continue;
    }
    if (auto it = w_scale.find(spec.name); it != w_scale.end()) {
      EXPECT_EQ(spec.shape, std::vector<std::uint64_t>{1}) << where;
      EXPECT_EQ(spec.dtype, DType::kF32) << where;
      EXPECT_EQ(decode_one(base, DType::kF32), it->second) << where;
      ++scales;
      continue;
    }
    if (mla_output(spec.name)) {
      // The one-scale E4M3 requantization of the F32 values (clamped, nearest even).
      const auto& x = dq32.at(spec.name);
      const float ws = w_scale.at(spec.name.substr(0, spec.name.size() - 4) + "w_scale");
      EXPECT_EQ(spec.shape, x.shape) << where;
      EXPECT_EQ(spec.dtype, DType::kF8E4M3) << where;
      if (spec.shape != x.shape || spec.dtype != DType::kF8E4M3) {
        return scales;
      }
      std::vector<std::uint64_t> idx(spec.shape.size(), 0);
      for (std::uint64_t e = 0; e < x.values.size(); ++e, next_index(idx, spec.shape)) {
        const float want =
            ws == 0 ? 0.0f : round_to_e4m3(std::clamp(x.values[e] * (1.0f / ws), -448.0f, 448.0f));
        const float got = decode_one(base + storage_offset(idx, spec.strides), DType::kF8E4M3);
        if (got != want) {
          ADD_FAILURE() << where << " element " << e << ": got " << got << ", reference " << want
                        << " (" << x.values[e] << " / " << ws << ")";
          return scales;
        }
      }
      continue;
    }
    if (auto it = kv.find(spec.name); it != kv.end()) {
      EXPECT_EQ(spec.shape, std::vector<std::uint64_t>{}) << where;
      EXPECT_EQ(decode_one(base, DType::kF32), values.scalar(it->second)) << where;
      ++scales;
      continue;
    }
    const auto& ref = (dequantized_outputs.count(spec.name) != 0 ? dq : w).at(spec.name);
    const bool quantized = quantized_param(spec.name);
    const bool packed = quantized && kind == SynthQuant::kNvfp4;
    std::vector<std::uint64_t> shape = ref.shape;
    if (packed) {
      shape.back() /= 2;
    }
    EXPECT_EQ(spec.shape, shape) << where;
    if (quantized) {
      EXPECT_EQ(spec.dtype, packed ? DType::kU8 : DType::kF8E4M3) << where;
    } else {
      EXPECT_NE(spec.dtype, DType::kF8E4M3) << where;
      EXPECT_NE(spec.dtype, DType::kU8) << where;
    }
    if (spec.shape != shape) {
      return scales;
    }
    const DType dt = spec.dtype;
    std::vector<std::uint64_t> idx(spec.shape.size(), 0);
    const std::uint64_t cols = ref.shape.empty() ? 1 : ref.shape.back();
    const std::uint64_t count = models::element_count(spec.shape);
    for (std::uint64_t e = 0; e < count; ++e, next_index(idx, spec.shape)) {
      const std::uint64_t off = storage_offset(idx, spec.strides);
      const float got = dt == DType::kU8 ? static_cast<float>(static_cast<std::uint8_t>(base[off]))
                                         : decode_one(base + off * dtype_size(dt), dt);
      // Packed: param element (.., n, j) holds logical elements 2j and 2j + 1.
      const std::uint64_t at = packed ? (e / (cols / 2)) * cols + (e % (cols / 2)) * 2 : e;
      if (got != ref.values[at] || (packed && ref.values[at + 1] != ref.values[at])) {
        ADD_FAILURE() << where << " element " << e << ": got " << got << ", reference "
                      << ref.values[at];
        return scales;
      }
    }
  }
  return scales;
}

}  // namespace ferry::testing::quant
