// DeepSeek-V2/V3 and GLM-4 MoE placement and the MLA post-load hook, compared
// element by element with the naive reference of deepseek_reference.hpp: every
// tensor of a synthetic checkpoint is routed (placed, or dropped with exactly the
// reason the reference expects), its pieces run through the naive executor, fills
// run, then the model's post-load hooks run on a host device, and every byte of
// every local param must hold the reference's value: w_kc and w_vc read through the
// strides the shell reports. Bad inputs are refused with errors naming the field.
#include "models/deepseek.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "gpu/device.hpp"
#include "gpu/host_device.hpp"
#include "models/coverage.hpp"
#include "models/deepseek_reference.hpp"
#include "models/host_hook_context.hpp"
#include "models/mla_hook.hpp"
#include "models/model.hpp"
#include "models/placement.hpp"
#include "models/quant.hpp"
#include "models/quant_reference.hpp"
#include "models/reference_util.hpp"
#include "models/table_model.hpp"
#include "synth/synth.hpp"
#include "testing/test_data.hpp"

namespace ferry::testing {
namespace {

using ::testing::HasSubstr;

constexpr std::uint64_t kSeed = 11;

bool synth_has(const std::string& family) {
  const auto& f = synth::synth_families();
  return std::find(f.begin(), f.end(), family) != f.end();
}

// A checkpoint description: config.json and every tensor with its own dtype (the
// router bias is F32 in a BF16 checkpoint). Values are synth_value(kSeed, ...).
struct Ckpt {
  nlohmann::json config;
  std::vector<synth::SynthTensor> tensors;
};

// `variant` edits the tiny synthetic checkpoint of `family`:
//   "no_q_lora": q_lora_rank null, so q_proj instead of q_a_proj / q_b_proj;
//   "greedy":    topk_method greedy, so the router has no correction bias;
//   "bias_norm": GLM with attention_bias and use_qk_norm (their tensors added);
//   "router_fp32": router_fp32 set, so the router's weight is F32.
Ckpt make_ckpt(const std::string& family, const std::string& variant = "") {
  Ckpt c;
  c.config = synth::synth_config(family, "tiny", DType::kBF16, false);
  c.tensors = synth::synth_tensor_list(family, "tiny", DType::kBF16, false);
  auto ends_with = [](const std::string& s, const std::string& x) {
    return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  // A tensor like `t` (same dtype and file) with another name and shape.
  auto like = [](const synth::SynthTensor& t, std::string name, std::vector<std::uint64_t> shape) {
    synth::SynthTensor out = t;
    out.name = std::move(name);
    out.shape = std::move(shape);
    return out;
  };
  if (variant == "no_q_lora") {
    const ds::Dims d = ds::dims_of(c.config);
    c.config["q_lora_rank"] = nullptr;
    std::vector<synth::SynthTensor> out;
    for (const synth::SynthTensor& t : c.tensors) {
      if (ends_with(t.name, "q_a_proj.weight") || ends_with(t.name, "q_a_layernorm.weight")) {
        continue;
      }
      if (ends_with(t.name, "q_b_proj.weight")) {
        std::string name = t.name.substr(0, t.name.size() - 15) + "q_proj.weight";
        out.push_back(like(t, name, {d.heads * (d.dn + d.dr), d.H}));
        continue;
      }
      out.push_back(t);
    }
    c.tensors = out;
  } else if (variant == "router_fp32") {
    c.config["router_fp32"] = true;
  } else if (variant == "rope_interleave") {
    // The indexer's fused wk_weights_proj (SGLang 0.5.23's use_dsa_indexer_fusion).
    c.config["indexer_rope_interleave"] = true;
  } else if (variant == "greedy") {
    c.config["topk_method"] = "greedy";
    std::erase_if(c.tensors, [&](const synth::SynthTensor& t) {
      return ends_with(t.name, "e_score_correction_bias");
    });
  } else if (variant == "bias_norm") {
    c.config["attention_bias"] = true;
    c.config["use_qk_norm"] = true;
    const ds::Dims d = ds::dims_of(c.config);
    std::vector<synth::SynthTensor> out;
    std::set<std::string> have;
    for (const synth::SynthTensor& t : c.tensors) {
      have.insert(t.name);
    }
    for (const synth::SynthTensor& t : c.tensors) {
      out.push_back(t);
      for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
        const std::string w = std::string(proj) + ".weight";
        if (ends_with(t.name, w)) {
          const std::string b = t.name.substr(0, t.name.size() - 6) + "bias";
          if (have.count(b) == 0) {
            out.push_back(like(t, b, {t.shape[0]}));
          }
        }
      }
      if (ends_with(t.name, "o_proj.weight")) {
        const std::string p = t.name.substr(0, t.name.size() - 13);
        for (const char* n : {"q_norm.weight", "k_norm.weight"}) {
          if (have.count(p + n) == 0) {
            out.push_back(like(t, p + n, {d.head_dim}));
          }
        }
      }
    }
    c.tensors = out;
  }
  return c;
}

float value(const std::string& name, std::uint64_t i) {
  return synth::synth_value(kSeed, name, i);
}

std::vector<float> all_values(const synth::SynthTensor& t) {
  std::vector<float> v(t.elements());
  for (std::uint64_t i = 0; i < v.size(); ++i) {
    v[i] = value(t.name, i);
  }
  return v;
}

struct Case {
  std::string family;
  std::string variant;
  int tp = 1;
  int ep = 1;
  int pp = 1;
  int pp_rank = 0;
  std::vector<int> local;  // empty: all ranks
  bool draft = false;
  std::optional<bool> fuse;  // model.fuse_shared_experts; nullopt = auto (SGLang's rule)
  bool switch_w13 = false;
  std::optional<DType> param_dtype;
  bool pad = false;  // model.unaligned_tp=pad
  // SGLang's DeepSeek deployment layouts (models::ParallelLayout).
  int attn_dp = 1;
  bool dp_lm_head = false;
  bool moe_dense_tp1 = false;
  bool deepep = false;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string n = c.family + (c.variant.empty() ? "" : "_" + c.variant) + "_tp" +
                  std::to_string(c.tp) + "_ep" + std::to_string(c.ep);
  if (c.pp > 1) {
    n += "_pp" + std::to_string(c.pp) + "s" + std::to_string(c.pp_rank);
  }
  if (!c.local.empty()) {
    n += "_local";
    for (int r : c.local) {
      n += std::to_string(r);
    }
  }
  n += c.draft ? "_draft" : "";
  n += c.fuse ? (*c.fuse ? "_fuse" : "_nofuse") : "";
  n += c.pad ? "_tppad" : "";
  n += c.switch_w13 ? "_w31" : "";
  if (c.param_dtype) {
    n += "_to_" + std::string(dtype_name(*c.param_dtype));
  }
  n += c.attn_dp > 1 ? "_attndp" + std::to_string(c.attn_dp) : "";
  n += c.dp_lm_head ? "_dplmhead" : "";
  n += c.moe_dense_tp1 ? "_densetp1" : "";
  n += c.deepep ? "_deepep" : "";
  return n;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name({c, 0});
}

class DeepseekReference : public ::testing::TestWithParam<Case> {};

TEST_P(DeepseekReference, EveryElementMatchesTheReference) {
  const Case& c = GetParam();
  const Ckpt ck = make_ckpt(c.family, c.variant);
  models::ParallelLayout layout = testing::case_layout(c);
  layout.moe_dense_tp = c.moe_dense_tp1 ? 1 : 0;
  layout.moe_a2a =
      c.deepep ? models::ParallelLayout::MoeA2a::kDeepep : models::ParallelLayout::MoeA2a::kNone;
  models::ModelOptions options;
  options.dtype = c.param_dtype;
  options.draft = c.draft;
  options.fuse_shared_experts = c.fuse;
  options.switch_w13 = c.switch_w13;
  options.unaligned_tp = c.pad ? models::Unaligned::kPad : models::Unaligned::kRefuse;
  std::unique_ptr<models::Model> model = models::make_model(ck.config, layout, options);
  ASSERT_EQ(model->family(), c.family);
  const DType param_dtype = c.param_dtype.value_or(DType::kBF16);
  std::vector<int> local = c.local;
  if (local.empty()) {
    for (int r = 0; r < c.tp; ++r) {
      local.push_back(r);
    }
  }
  ASSERT_EQ(model->layout().local_ranks, local);
  ds::Layout rl{c.tp, c.ep, c.pp, c.pp_rank, c.draft, false, c.switch_w13, c.pad};
  rl.attn_dp = c.attn_dp;
  rl.dp_lm_head = c.dp_lm_head;
  rl.moe_dense_tp1 = c.moe_dense_tp1;
  rl.deepep = c.deepep;
  rl.fuse_shared = c.fuse.value_or(ds::sglang_fuses(ds::dims_of(ck.config), rl));

  ParamBuffers buffers = make_buffers(*model);
  std::vector<models::Route> routes;
  std::size_t placed = 0;
  for (const synth::SynthTensor& t : ck.tensors) {
    models::Route route = model->route(tensor_info(t.name, t.dtype, t.shape));
    const std::string want = ds::expected_reason(ck.config, rl, local, t.name);
    if (!want.empty()) {
      EXPECT_EQ(route.kind, models::RouteKind::kDropped) << t.name;
      EXPECT_EQ(route.reason, want) << t.name;
      EXPECT_TRUE(route.pieces.empty()) << t.name;
      continue;
    }
    ASSERT_EQ(route.kind, models::RouteKind::kPlaced) << t.name << " " << route.reason;
    ASSERT_FALSE(route.pieces.empty()) << t.name;
    ++placed;
    std::vector<std::byte> bytes = encode(all_values(t), t.dtype);
    ASSERT_LE(route.src_begin, route.src_end) << t.name;
    ASSERT_LE(route.src_end, bytes.size()) << t.name;
    std::span<const std::byte> window(bytes.data() + route.src_begin,
                                      route.src_end - route.src_begin);
    for (const models::Piece& p : route.pieces) {
      ASSERT_EQ(p.kind, models::Piece::Kind::kCopy) << t.name;
      ASSERT_EQ(p.src_dtype, t.dtype) << t.name;
      ASSERT_NO_THROW(apply_piece(p, window, route.src_begin, buffers)) << t.name;
    }
    routes.push_back(std::move(route));
  }
  EXPECT_GT(placed, 0u);
  for (const models::Piece& p : model->fill_pieces()) {
    ASSERT_EQ(p.kind, models::Piece::Kind::kZero);
    ASSERT_NO_THROW(apply_piece(p, {}, 0, buffers));
  }
  EXPECT_TRUE(models::check_coverage(*model, routes).empty());
  run_hooks(*model, buffers);
  if (HasFatalFailure()) {
    return;
  }

  for (std::size_t i = 0; i < local.size(); ++i) {
    const models::RankShell& shell = model->shells()[i];
    ASSERT_EQ(shell.tp_rank, local[i]);
    const ds::Params want = ds::reference(ck.config, rl, local[i], value);
    std::vector<std::string> names;
    for (const models::ParamSpec& p : shell.params) {
      if (!p.transient) {  // loaded for a hook, then freed
        names.push_back(p.name);
      }
    }
    std::vector<std::string> want_names;
    for (const auto& [name, p] : want) {
      want_names.push_back(name);
    }
    ASSERT_EQ(names, want_names) << "rank " << local[i];
    for (std::size_t k = 0; k < shell.params.size(); ++k) {
      const models::ParamSpec& spec = shell.params[k];
      if (spec.transient) {
        continue;
      }
      const ds::Param& ref = want.at(spec.name);
      const DType dt = ref.f32 ? DType::kF32 : ref.bf16 ? DType::kBF16 : param_dtype;
      ASSERT_EQ(spec.shape, ref.shape) << spec.name;
      ASSERT_EQ(spec.strides, ref.strides) << spec.name;
      ASSERT_EQ(spec.dtype, dt) << spec.name;
      ASSERT_EQ(spec.nbytes, ref.values.size() * dtype_size(dt)) << spec.name;
      const auto& writes = buffers.writes[i][k];
      auto bad = std::find_if(writes.begin(), writes.end(), [](auto n) { return n != 1; });
      ASSERT_TRUE(bad == writes.end())
          << spec.name << " rank " << local[i] << ": byte " << (bad - writes.begin()) << " written "
          << int(*bad) << " times";
      // Walk the logical index; the storage offset comes from the reported strides.
      std::vector<std::uint64_t> idx(spec.shape.size(), 0);
      const std::byte* base = buffers.bytes[i][k].data();
      for (std::size_t e = 0; e < ref.values.size(); ++e) {
        const std::uint64_t off = storage_offset(idx, spec.strides);
        const float got = decode_one(base + off * dtype_size(dt), dt);
        if (got != ref.values[e]) {
          FAIL() << spec.name << " rank " << local[i] << " element " << e << ": got " << got
                 << ", reference " << ref.values[e];
        }
        next_index(idx, spec.shape);
      }
    }
  }
}

Case make_case(const std::string& family, int tp, int ep, const std::string& variant = "") {
  Case c;
  c.family = family;
  c.variant = variant;
  c.tp = tp;
  c.ep = ep;
  return c;
}
Case stage(Case c, int pp, int pp_rank) {
  c.pp = pp;
  c.pp_rank = pp_rank;
  return c;
}
Case on(Case c, std::vector<int> local) {
  c.local = std::move(local);
  return c;
}
Case draft(Case c) {
  c.draft = true;
  return c;
}
Case fuse(Case c, bool on) {
  c.fuse = on;
  return c;
}
Case padded(Case c) {
  c.pad = true;
  return c;
}
// SGLang's DeepSeek deployment layouts.
Case attn_dp(Case c, int dp, bool lm_head = false) {
  c.attn_dp = dp;
  c.dp_lm_head = lm_head;
  return c;
}
Case dense_tp1(Case c) {
  c.moe_dense_tp1 = true;
  return c;
}
Case deepep(Case c) {
  c.deepep = true;
  return c;
}
Case up_first(Case c) {
  c.switch_w13 = true;
  return c;
}
Case as(Case c, DType dtype) {
  c.param_dtype = dtype;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  // tp x ep, all ranks local.
  for (int tp : {1, 2, 4}) {
    for (int ep : {1, 2, 4}) {
      if (ep <= tp) {
        out.push_back(make_case("deepseek_v3", tp, ep));
      }
    }
  }
  out.push_back(make_case("deepseek_v3", 8, 8));
  // Pipeline stages (tiny has 2 layers: stage 0 holds dense layer 0, stage 1 MoE layer 1).
  out.push_back(stage(make_case("deepseek_v3", 2, 2), 2, 0));
  out.push_back(stage(make_case("deepseek_v3", 2, 2), 2, 1));
  // Subsets of ranks, in any device order.
  out.push_back(on(make_case("deepseek_v3", 4, 2), {3, 1}));
  out.push_back(on(make_case("deepseek_v3", 4, 4), {2}));
  // Draft (MTP) model, shared-expert folding, up-first w13, other param dtypes.
  out.push_back(draft(make_case("deepseek_v3", 1, 1)));
  out.push_back(draft(make_case("deepseek_v3", 4, 2)));
  // (tiny DeepSeek-V3 has 8 routed experts: SGLang never fuses it; GLM-4 MoE at
  // ep 1 is where fusion is tested, below.)
  out.push_back(fuse(make_case("deepseek_v3", 2, 1), false));
  out.push_back(up_first(make_case("deepseek_v3", 2, 1)));
  out.push_back(as(make_case("deepseek_v3", 2, 2), DType::kF32));
  out.push_back(as(draft(make_case("deepseek_v3", 4, 1)), DType::kF16));
  // q_lora_rank null (q_proj) and greedy routing (no correction bias).
  out.push_back(make_case("deepseek_v3", 1, 1, "no_q_lora"));
  out.push_back(make_case("deepseek_v3", 4, 2, "no_q_lora"));
  out.push_back(draft(make_case("deepseek_v3", 2, 2, "no_q_lora")));
  out.push_back(make_case("deepseek_v3", 2, 2, "greedy"));
  // router_fp32 (SGLang 0.5.23, MoEGate.__init__): the router's weight in F32.
  out.push_back(make_case("deepseek_v3", 2, 2, "router_fp32"));
  // Uneven tp: 8 MLA heads padded to 16 at tp 16 (one head a rank; ranks 8..15 hold
  // zero heads, and the hook splits their zero kv_b_proj into zero w_kc / w_vc).
  // Under model.unaligned_tp=pad, with every intermediate size rounded up to a
  // multiple of 16 * 32, so some ranks' expert shares are all zeros.
  out.push_back(padded(on(make_case("deepseek_v3", 16, 8), {7, 8, 15})));
  out.push_back(padded(on(draft(make_case("deepseek_v3", 16, 4, "no_q_lora")), {0, 9})));
  // DeepSeek-V3.2: the indexer in every layer (the MTP layer's in the draft).
  out.push_back(make_case("deepseek_v32", 1, 1));
  out.push_back(make_case("deepseek_v32", 4, 2));
  out.push_back(make_case("deepseek_v32", 2, 2, "rope_interleave"));
  out.push_back(draft(make_case("deepseek_v32", 2, 2, "rope_interleave")));
  out.push_back(stage(make_case("deepseek_v32", 2, 2), 2, 1));
  out.push_back(draft(make_case("deepseek_v32", 2, 2)));
  // SGLang's DeepSeek deployment layouts: attention data parallelism (attention tp
  // 2 and 1 of tp 4), lm_head over the attention group, the dense layers whole on
  // every rank, DeepEP's unsplit shared experts (ep = tp), and all of them at once
  // (the layout of SGLang's large DeepSeek deployments), on subsets, the draft, and
  // q_lora_rank null.
  out.push_back(attn_dp(make_case("deepseek_v3", 4, 1), 2));
  out.push_back(attn_dp(make_case("deepseek_v3", 4, 2), 4, true));
  out.push_back(attn_dp(make_case("deepseek_v3", 4, 2), 2, true));
  out.push_back(dense_tp1(make_case("deepseek_v3", 4, 1)));
  out.push_back(dense_tp1(attn_dp(make_case("deepseek_v3", 2, 2), 2)));
  out.push_back(deepep(make_case("deepseek_v3", 4, 4)));
  out.push_back(deepep(dense_tp1(attn_dp(make_case("deepseek_v3", 4, 4), 4, true))));
  out.push_back(on(deepep(dense_tp1(attn_dp(make_case("deepseek_v3", 4, 4), 2, true))), {3, 0}));
  out.push_back(draft(deepep(attn_dp(make_case("deepseek_v3", 4, 4), 2))));
  out.push_back(attn_dp(make_case("deepseek_v3", 4, 2, "no_q_lora"), 2, true));
  out.push_back(attn_dp(make_case("deepseek_v32", 4, 2), 4));
  out.push_back(stage(deepep(attn_dp(make_case("deepseek_v3", 2, 2), 2, true)), 2, 1));
  // Families whose synthetic checkpoints synth/ provides.
  if (synth_has("deepseek_v2")) {
    out.push_back(make_case("deepseek_v2", 1, 1));
    out.push_back(make_case("deepseek_v2", 2, 2));
    out.push_back(make_case("deepseek_v2", 4, 2));
    out.push_back(stage(make_case("deepseek_v2", 2, 2), 2, 1));
    out.push_back(on(make_case("deepseek_v2", 4, 4), {0, 3}));
  }
  if (synth_has("glm4_moe")) {
    for (int tp : {1, 2, 4}) {
      for (int ep : {1, 2, 4}) {
        if (ep <= tp) {
          out.push_back(make_case("glm4_moe", tp, ep));
        }
      }
    }
    out.push_back(stage(make_case("glm4_moe", 2, 2), 2, 0));
    out.push_back(stage(make_case("glm4_moe", 2, 2), 2, 1));
    out.push_back(on(make_case("glm4_moe", 4, 2), {2, 1}));
    out.push_back(draft(make_case("glm4_moe", 2, 2)));
    // GLM-4 MoE at ep 1: SGLang fuses the shared expert (the cases above at ep 1
    // do so under auto); true agrees, false keeps it a tensor-parallel MLP.
    out.push_back(fuse(make_case("glm4_moe", 2, 1), true));
    out.push_back(fuse(make_case("glm4_moe", 2, 1), false));
    out.push_back(draft(make_case("glm4_moe", 2, 1)));
    out.push_back(make_case("glm4_moe", 4, 2, "bias_norm"));
    // Attention data parallelism (SGLang 0.5.23, glm4_moe.py): qkv_proj / o_proj and
    // the embedding over the attention tp group, lm_head with dp_lm_head, the dense
    // layers whole under moe_dense_tp 1.
    out.push_back(attn_dp(make_case("glm4_moe", 4, 2), 2, true));
    out.push_back(attn_dp(make_case("glm4_moe", 4, 1, "bias_norm"), 4));
    out.push_back(dense_tp1(attn_dp(make_case("glm4_moe", 4, 2), 2)));
    // Uneven tp: 8 q / 2 kv heads padded to 64 / 16 at tp 16 (ranks 2..15 hold zero
    // heads; ranks 0 and 1 the real ones).
    out.push_back(padded(on(make_case("glm4_moe", 16, 8), {0, 1, 9})));
    out.push_back(padded(draft(on(make_case("glm4_moe", 16, 4), {1, 15}))));
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Families, DeepseekReference, ::testing::ValuesIn(cases()), case_name);

// ---- FP8 block-quantized checkpoints ---------------------------------------------
//
// The tiny checkpoints in the FP8 block layout (quant_reference.hpp), checked against
// the three readings of ds::reference; w_kc / w_vc hold the MLA split of the
// dequantized kv_b_proj (SGLang's post_load_weights, for 128 x 128 blocks).

struct Fp8Case {
  std::string family;
  std::string variant;
  int tp = 1;
  int ep = 1;
  bool draft = false;
  std::vector<int> local;
  synth::SynthQuant kind = synth::SynthQuant::kFp8Block;
  // SGLang's DeepSeek deployment layout: attention tp 2 of tp 4 with dp_lm_head, the
  // dense layers whole, DeepEP's whole shared experts (ep = tp).
  bool deployment = false;
};

std::string fp8_case_name(const ::testing::TestParamInfo<Fp8Case>& info) {
  const Fp8Case& c = info.param;
  std::string n = c.family + (c.variant.empty() ? "" : "_" + c.variant) + "_tp" +
                  std::to_string(c.tp) + "_ep" + std::to_string(c.ep) + (c.draft ? "_draft" : "");
  if (c.kind != synth::SynthQuant::kFp8Block) {
    std::string kind(synth::to_string(c.kind));
    std::replace(kind.begin(), kind.end(), '-', '_');
    n += "_" + kind;
  }
  for (int r : c.local) {
    n += "_r" + std::to_string(r);
  }
  return n + (c.deployment ? "_deployment" : "");
}

void PrintTo(const Fp8Case& c, std::ostream* os) {
  *os << fp8_case_name({c, 0});
}

class DeepseekFp8Reference : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(DeepseekFp8Reference, WeightsScalesAndDequantizedSplitMatchTheReference) {
  const Fp8Case& c = GetParam();
  Ckpt ck = make_ckpt(c.family, c.variant);
  quant::Values values(kSeed, quant::quantize(ck.tensors, ck.config, c.kind));
  models::ParallelLayout layout;
  layout.tp = c.tp;
  layout.ep = c.ep;
  layout.local_ranks = c.local;
  if (c.deployment) {
    layout.attn_dp = 2;
    layout.dp_lm_head = true;
    layout.moe_dense_tp = 1;
    layout.moe_a2a = models::ParallelLayout::MoeA2a::kDeepep;
  }
  models::ModelOptions options;
  options.draft = c.draft;
  std::unique_ptr<models::Model> model = models::make_model(ck.config, layout, options);
  const std::vector<int> local = model->layout().local_ranks;
  ds::Layout rl{c.tp, c.ep, 1, 0, c.draft, false, false, false};
  if (c.deployment) {
    rl.attn_dp = 2;
    rl.dp_lm_head = true;
    rl.moe_dense_tp1 = true;
    rl.deepep = true;
  }
  rl.fuse_shared = ds::sglang_fuses(ds::dims_of(ck.config), rl);

  ParamBuffers buffers = make_buffers(*model);
  const std::vector<models::Route> routes = quant::load(*model, ck.tensors, values, buffers);
  EXPECT_TRUE(models::check_coverage(*model, routes).empty());
  run_hooks(*model, buffers);
  if (HasFatalFailure()) {
    return;
  }
  std::size_t scales = 0;
  for (std::size_t i = 0; i < local.size(); ++i) {
    auto read = [&](const std::string&, const quant::ValueFn& fn) {
      return ds::reference(ck.config, rl, local[i], fn);
    };
    std::set<std::string> split;
    for (const auto& [name, p] : read("", [](const std::string&, std::uint64_t) { return 0.0f; })) {
      if (quant::ends_with(name, "w_kc") || quant::ends_with(name, "w_vc") ||
          quant::ends_with(name, "wk_weights_proj.weight")) {
        split.insert(name);
      }
    }
    EXPECT_EQ(split.empty(), c.family == "glm4_moe");  // MLA families only
    scales += quant::check_rank(*model, i, buffers, values, read, split);
  }
  EXPECT_GT(scales, 0u);
}

std::vector<Fp8Case> fp8_cases() {
  std::vector<Fp8Case> out;
  for (int tp : {1, 2, 4}) {
    for (int ep : {1, 2, 4}) {
      if (ep <= tp) {
        out.push_back({"deepseek_v3", "", tp, ep, false, {}});
      }
    }
  }
  out.push_back({"deepseek_v3", "", 2, 2, true, {}});       // the MTP draft layer
  out.push_back({"deepseek_v3", "", 4, 2, false, {3, 1}});  // some ranks, any order
  out.push_back({"deepseek_v3", "no_q_lora", 2, 1, false, {}});
  if (synth_has("glm4_moe")) {
    out.push_back({"glm4_moe", "", 2, 1, false, {}});  // shared expert fused at ep 1
    out.push_back({"glm4_moe", "", 4, 2, false, {}});
  }
  // The other formats: each split once (the dequantized MLA split of every one).
  using synth::SynthQuant;
  for (SynthQuant kind : {SynthQuant::kFp8Channel, SynthQuant::kFp8Tensor, SynthQuant::kModelOptFp8,
                          SynthQuant::kNvfp4}) {
    out.push_back({"deepseek_v3", "", 2, 2, false, {}, kind});
  }
  out.push_back({"deepseek_v3", "", 2, 1, false, {}, SynthQuant::kFp8Tensor});  // fused experts
  out.push_back({"deepseek_v3", "", 2, 2, true, {}, SynthQuant::kNvfp4});       // the draft
  // The deployment layout: block scales follow the attention group's heads, the
  // whole dense layers and shared experts (and NVFP4's group scales the same).
  out.push_back({"deepseek_v3", "", 4, 4, false, {}, SynthQuant::kFp8Block, true});
  out.push_back({"deepseek_v3", "", 4, 4, false, {2, 1}, SynthQuant::kNvfp4, true});
  // V3.2's indexer: wq_b and wk quantized, wk dequantized into wk_weights_proj.
  out.push_back({"deepseek_v32", "", 2, 1, false, {}});
  out.push_back({"deepseek_v32", "", 2, 2, true, {}});
  out.push_back({"deepseek_v32", "", 2, 2, false, {}, SynthQuant::kNvfp4});
  out.push_back({"deepseek_v32", "rope_interleave", 2, 1, false, {}});
  out.push_back({"deepseek_v32", "rope_interleave", 2, 2, false, {}, SynthQuant::kNvfp4});
  if (synth_has("glm4_moe")) {
    out.push_back({"glm4_moe", "", 2, 1, false, {}, SynthQuant::kModelOptFp8});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Fp8Block, DeepseekFp8Reference, ::testing::ValuesIn(fp8_cases()),
                         fp8_case_name);

void expect_error(const std::function<void()>& f, Stage stage, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing \"" << what << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), stage) << e.what();
    EXPECT_THAT(e.what(), HasSubstr(what));
  }
}

// ---- shells, strides and hooks ---------------------------------------------------

TEST(Deepseek, MlaShellHasStridedSplitOutputsAndOneHookPerLayerAndRank) {
  const Ckpt ck = make_ckpt("deepseek_v3");
  models::ParallelLayout layout;
  layout.tp = 2;
  layout.local_ranks = {1};
  auto m = models::make_model(ck.config, layout);
  const auto& shell = m->shells()[0];
  // tiny: 8 heads -> 4 local, qk_nope 16, v_head 16, kv_lora_rank 32.
  const auto& kc = shell.params[shell.by_name.at("model.layers.0.self_attn.w_kc")];
  EXPECT_EQ(kc.shape, (models::Shape{4, 16, 32}));
  EXPECT_EQ(kc.strides, (std::vector<std::uint64_t>{32 * 16, 1, 16}));
  EXPECT_EQ(kc.nbytes, 4u * 16 * 32 * 2);
  const auto& vc = shell.params[shell.by_name.at("model.layers.1.self_attn.w_vc")];
  EXPECT_EQ(vc.shape, (models::Shape{4, 32, 16}));
  EXPECT_EQ(vc.strides, (std::vector<std::uint64_t>{16 * 32, 1, 32}));
  const auto& kvb = shell.params[shell.by_name.at("model.layers.1.self_attn.kv_b_proj.weight")];
  EXPECT_EQ(kvb.shape, (models::Shape{4 * 32, 32}));
  EXPECT_EQ(kvb.strides, (std::vector<std::uint64_t>{32, 1}));
  const auto hooks = m->hooks();
  ASSERT_EQ(hooks.size(), 2u);  // two layers, one local rank
  for (const auto& h : hooks) {
    EXPECT_EQ(h.local_rank, 0u);
    ASSERT_EQ(h.inputs.size(), 1u);
    EXPECT_THAT(shell.params[h.inputs[0]].name, HasSubstr("self_attn.kv_b_proj.weight"));
    ASSERT_EQ(h.outputs.size(), 2u);
    EXPECT_THAT(shell.params[h.outputs[0]].name, HasSubstr("self_attn.w_kc"));
    EXPECT_THAT(shell.params[h.outputs[1]].name, HasSubstr("self_attn.w_vc"));
  }
  // The routes cover everything but the split outputs, which the hooks cover.
  std::vector<models::Route> routes;
  for (const auto& t : ck.tensors) {
    routes.push_back(m->route(tensor_info(t.name, t.dtype, t.shape)));
  }
  EXPECT_TRUE(models::check_coverage(*m, routes).empty());
}

TEST(Deepseek, DraftModelNamesFollowSglangNextN) {
  const Ckpt ck = make_ckpt("deepseek_v3");
  models::ModelOptions options;
  options.draft = true;
  auto m = models::make_model(ck.config, models::ParallelLayout{}, options);
  const auto& shell = m->shells()[0];
  for (const char* name :
       {"model.enorm.weight", "model.hnorm.weight", "model.eh_proj.weight",
        "model.shared_head.norm.weight", "model.decoder.self_attn.w_kc",
        "model.decoder.mlp.experts.w13_weight", "model.decoder.mlp.gate.e_score_correction_bias",
        "model.decoder.input_layernorm.weight"}) {
    EXPECT_EQ(shell.by_name.count(name), 1u) << name;
  }
  for (const auto& p : shell.params) {
    EXPECT_THAT(p.name, ::testing::Not(HasSubstr("model.layers.")));
    EXPECT_THAT(p.name, ::testing::Not(HasSubstr("embed_tokens")));
    EXPECT_THAT(p.name, ::testing::Not(HasSubstr("lm_head")));
  }
  EXPECT_EQ(shell.params[shell.by_name.at("model.eh_proj.weight")].shape,
            (models::Shape{128, 256}));
  EXPECT_EQ(m->hooks().size(), 1u);
  auto reason = [&](const std::string& name, std::vector<std::uint64_t> shape) {
    return m->route(tensor_info(name, DType::kBF16, shape)).reason;
  };
  EXPECT_EQ(reason("model.layers.2.shared_head.head.weight", {1000, 128}), "draft_shared");
  EXPECT_EQ(reason("model.layers.2.embed_tokens.weight", {1000, 128}), "draft_shared");
  EXPECT_EQ(reason("model.layers.0.input_layernorm.weight", {128}), "draft_target");
  EXPECT_EQ(reason("model.embed_tokens.weight", {1000, 128}), "draft_target");
  EXPECT_EQ(reason("lm_head.weight", {1000, 128}), "draft_target");
  EXPECT_EQ(reason("model.norm.weight", {128}), "draft_target");

  // The target model drops the MTP layer and keeps no draft names.
  auto target = models::make_model(ck.config, models::ParallelLayout{});
  EXPECT_EQ(target->route(tensor_info("model.layers.2.enorm.weight", DType::kBF16, {128})).reason,
            "mtp_layer");
  EXPECT_EQ(target->shells()[0].by_name.count("model.enorm.weight"), 0u);
  EXPECT_EQ(target->hooks().size(), 2u);
}

TEST(Deepseek, TheIndexerFollowsItsConfigAndRouterBiasStaysF32) {
  Ckpt ck = make_ckpt("deepseek_v3");
  models::ModelOptions options;
  options.dtype = DType::kF16;
  // Without index_topk an indexer tensor is no parameter's: unmapped, never dropped.
  auto m = models::make_model(ck.config, models::ParallelLayout{}, options);
  auto r = m->route(tensor_info("model.layers.1.self_attn.indexer.wk.weight", DType::kBF16, {4}));
  EXPECT_EQ(r.kind, models::RouteKind::kUnmapped);
  EXPECT_EQ(r.reason, "unknown_name");
  // With it (a V3 config too, as SGLang's is_deepseek_dsa): every layer has one by
  // default (dsa_layer_has_indexer); index_topk_freq f keeps the layers where
  // max(l - offset + 1, 0) % f == 0 (offset index_skip_topk_offset, else 2);
  // indexer_types / index_topk_pattern decide per layer; the MTP layer always has one.
  nlohmann::json v32 = ck.config;
  v32["index_topk"] = 2048;
  v32["index_n_heads"] = 4;
  v32["index_head_dim"] = 32;
  v32["num_hidden_layers"] = 5;
  auto indexed = [&](const nlohmann::json& c) {
    std::vector<bool> out;
    auto model = models::make_model(c, {});
    for (int l = 0; l < 5; ++l) {
      out.push_back(model->shells()[0].by_name.count("model.layers." + std::to_string(l) +
                                                     ".self_attn.indexer.wk.weight") != 0);
    }
    if (!out[2]) {
      EXPECT_EQ(model
                    ->route(tensor_info("model.layers.2.self_attn.indexer.wk.weight", DType::kBF16,
                                        {32, 128}))
                    .reason,
                "no_indexer");
    }
    return out;
  };
  EXPECT_EQ(indexed(v32), std::vector<bool>(5, true));
  nlohmann::json freq = v32;
  freq["index_topk_freq"] = 2;
  EXPECT_EQ(indexed(freq), (std::vector<bool>{true, true, false, true, false}));
  freq["index_skip_topk_offset"] = 2;  // max(l - 1, 0) % 2 == 0 as well: l = 0, 1, 3
  EXPECT_EQ(indexed(freq), (std::vector<bool>{true, true, false, true, false}));
  freq["index_skip_topk_offset"] = 3;  // max(l - 2, 0) % 2 == 0: l = 0, 1, 2, 4
  EXPECT_EQ(indexed(freq), (std::vector<bool>{true, true, true, false, true}));
  nlohmann::json types = v32;
  types["indexer_types"] = {"full", "shared", "f", "s", nullptr};
  EXPECT_EQ(indexed(types), (std::vector<bool>{true, false, true, false, true}));
  types["indexer_types"] = nullptr;
  types["index_topk_pattern"] = "FSFFS";
  EXPECT_EQ(indexed(types), (std::vector<bool>{true, false, true, true, false}));
  models::ModelOptions draft;
  draft.draft = true;
  auto d = models::make_model(freq, {}, draft);  // layer 5, the MTP layer: always
  EXPECT_EQ(d->shells()[0].by_name.count("model.decoder.self_attn.indexer.wk.weight"), 1u);
  // SGLang 0.5.23's Indexer.__init__ (dsa_indexer.py): wk and a BF16 weights_proj,
  // or with indexer_rope_interleave (not is_neox_style: use_dsa_indexer_fusion on
  // CUDA) one BF16 wk_weights_proj instead of them; ferry loads the two as
  // transients that the fusion hook reads.
  {
    models::ModelOptions f32;
    f32.dtype = DType::kF32;
    auto plain = models::make_model(v32, {}, f32);
    const models::RankShell& s = plain->shells()[0];
    const std::string pi = "model.layers.0.self_attn.indexer.";
    EXPECT_EQ(s.by_name.count(pi + "wk_weights_proj.weight"), 0u);
    EXPECT_EQ(s.params[s.by_name.at(pi + "wk.weight")].dtype, DType::kF32);
    EXPECT_EQ(s.params[s.by_name.at(pi + "weights_proj.weight")].dtype, DType::kBF16);
    EXPECT_FALSE(s.params[s.by_name.at(pi + "weights_proj.weight")].transient);
    nlohmann::json interleaved = v32;
    interleaved["indexer_rope_interleave"] = true;
    auto fused = models::make_model(interleaved, {}, f32);
    const models::RankShell& f = fused->shells()[0];
    EXPECT_EQ(f.params[f.by_name.at(pi + "wk_weights_proj.weight")].dtype, DType::kBF16);
    EXPECT_TRUE(f.params[f.by_name.at(pi + "wk.weight")].transient);
    EXPECT_TRUE(f.params[f.by_name.at(pi + "weights_proj.weight")].transient);
  }
  // Bad configs, named.
  nlohmann::json bad = v32;
  bad.erase("index_n_heads");
  expect_error([&] { models::make_model(bad, {}); }, Stage::kConfig, "index_n_heads");
  bad = v32;
  bad["q_lora_rank"] = nullptr;
  expect_error([&] { models::make_model(bad, {}); }, Stage::kConfig, "needs q_lora_rank");
  bad = v32;
  bad["indexer_types"] = {"full", "sparse"};
  expect_error([&] { models::make_model(bad, {}); }, Stage::kConfig,
               "unsupported DSA indexer type \"sparse\" for layer 1");
  const auto& shell = m->shells()[0];
  EXPECT_EQ(shell.params[shell.by_name.at("model.layers.1.mlp.gate.e_score_correction_bias")].dtype,
            DType::kF32);
  EXPECT_EQ(shell.params[shell.by_name.at("model.layers.1.mlp.gate.weight")].dtype, DType::kF16);
  // A BF16 bias in the checkpoint is cast into the F32 param.
  auto b =
      m->route(tensor_info("model.layers.1.mlp.gate.e_score_correction_bias", DType::kBF16, {8}));
  ASSERT_EQ(b.pieces.size(), 1u);
  EXPECT_EQ(b.pieces[0].src_dtype, DType::kBF16);
  EXPECT_EQ(b.pieces[0].dst_dtype, DType::kF32);
  EXPECT_EQ(b.pieces[0].width_elems, 8u);
}

TEST(Deepseek, SupportedArchitecturesIncludeTheFamilies) {
  const auto& names = models::supported_architectures();
  for (const char* a : {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), a), names.end()) << a;
  }
}

// The MLA split of a quantized kv_b_proj takes the form SGLang 0.5.23's
// post_load_weights (deepseek_common/deepseek_weight_loader.py) leaves on CUDA: 128 x
// 128 blocks dequantized to BF16 whatever the model dtype; other blocks, per-channel
// and per-tensor FP8 kept in E4M3 with one F32 w_scale (block_quant_to_tensor_quant,
// channel_quant_to_tensor_quant); NVFP4 dequantized to the model dtype (ferry's).
TEST(Deepseek, QuantizedMlaSplitTakesSglangsFormPerFormat) {
  using synth::SynthQuant;
  struct Want {
    SynthQuant kind;
    std::uint64_t block;
    DType split;
    bool w_scale;
  };
  for (const Want& w : {Want{SynthQuant::kFp8Block, 128, DType::kBF16, false},
                        Want{SynthQuant::kFp8Block, 64, DType::kF8E4M3, true},
                        Want{SynthQuant::kFp8Channel, 0, DType::kF8E4M3, true},
                        Want{SynthQuant::kFp8Tensor, 0, DType::kF8E4M3, true},
                        Want{SynthQuant::kModelOptFp8, 0, DType::kF8E4M3, true},
                        Want{SynthQuant::kNvfp4, 0, DType::kF32, false}}) {
    nlohmann::json config = synth::synth_config("deepseek_v3", "tiny", DType::kF32, false);
    config["q_lora_rank"] = 128;
    config["kv_lora_rank"] = 128;
    config["moe_intermediate_size"] = 128;
    if (w.kind == SynthQuant::kModelOptFp8 || w.kind == SynthQuant::kNvfp4) {
      config = models::with_hf_quant_config(config, synth::synth_hf_quant_config(w.kind));
    } else {
      config["quantization_config"] = synth::synth_quant_config(w.kind, w.block);
    }
    models::ModelOptions f32;
    f32.dtype = DType::kF32;
    auto m = models::make_model(config, {}, f32);
    const models::RankShell& sh = m->shells()[0];
    ASSERT_EQ(sh.params[sh.by_name.at("model.layers.1.self_attn.kv_b_proj.weight")].dtype,
              w.kind == SynthQuant::kNvfp4 ? DType::kU8 : DType::kF8E4M3);
    const std::string a = "model.layers.1.self_attn.";
    SCOPED_TRACE(std::string(synth::to_string(w.kind)) + " block " + std::to_string(w.block));
    EXPECT_EQ(sh.params[sh.by_name.at(a + "w_kc")].dtype, w.split);
    EXPECT_EQ(sh.params[sh.by_name.at(a + "w_vc")].dtype, w.split);
    ASSERT_EQ(sh.by_name.count(a + "w_scale"), w.w_scale ? 1u : 0u);
    if (w.w_scale) {
      EXPECT_EQ(sh.params[sh.by_name.at(a + "w_scale")].shape, models::Shape{1});
      EXPECT_EQ(sh.params[sh.by_name.at(a + "w_scale")].dtype, DType::kF32);
    }
  }
  // Not quantized, or excluded from the quantization: the model dtype.
  nlohmann::json plain = synth::synth_config("deepseek_v3", "tiny", DType::kF32, false);
  models::ModelOptions f32;
  f32.dtype = DType::kF32;
  auto p = models::make_model(plain, {}, f32);
  EXPECT_EQ(p->shells()[0].params[p->shells()[0].by_name.at("model.layers.1.self_attn.w_kc")].dtype,
            DType::kF32);
}

TEST(Deepseek, RealDeepseekV3ConfigGivesSglangShapes) {
  FERRY_NEED_TEST_DATA();
  // The published DeepSeek-V3 config.json: FP8 with 128 x 128 block scales. Its FP8
  // layout first (SGLang's Fp8LinearMethod / Fp8MoEMethod create_weights: the weight
  // F8_E4M3, weight_scale_inv F32 [ceil(N / 128), ceil(K / 128)]), then the BF16
  // layout of the same model, without its quantization_config.
  std::ifstream in(::ferry::testing::test_data_path("models/deepseek-v3/config.json"));
  ASSERT_TRUE(in);
  nlohmann::json config = nlohmann::json::parse(in);
  models::ParallelLayout layout;
  layout.tp = 8;
  layout.ep = 8;
  layout.local_ranks = {5};
  {
    auto q = models::make_model(config, layout);
    const auto& sh = q->shells()[0];
    auto param = [&](const std::string& name) -> const models::ParamSpec& {
      return sh.params.at(sh.by_name.at(name));
    };
    const std::string a = "model.layers.7.self_attn.";
    const std::map<std::string, models::Shape> scales{
        {a + "fused_qkv_a_proj_with_mqa.weight", {17, 56}},  // 12 + 5 blocks of rows
        {a + "q_b_proj.weight", {24, 12}},
        {a + "kv_b_proj.weight", {32, 4}},
        {a + "o_proj.weight", {56, 16}},
        {"model.layers.2.mlp.gate_up_proj.weight", {36, 56}},  // 2 x 18432 / 8 rows
        {"model.layers.7.mlp.experts.w13_weight", {32, 32, 56}},
        {"model.layers.7.mlp.experts.w2_weight", {32, 56, 16}},
        {"model.layers.7.mlp.shared_experts.down_proj.weight", {56, 2}},
    };
    for (const auto& [w, shape] : scales) {
      EXPECT_EQ(param(w).dtype, DType::kF8E4M3) << w;
      EXPECT_EQ(param(w + "_scale_inv").dtype, DType::kF32) << w;
      EXPECT_EQ(param(w + "_scale_inv").shape, shape) << w;
    }
    for (const char* plain :
         {"model.embed_tokens.weight", "lm_head.weight", "model.layers.7.mlp.gate.weight",
          "model.layers.7.input_layernorm.weight"}) {
      EXPECT_EQ(param(plain).dtype, DType::kBF16) << plain;
      EXPECT_EQ(sh.by_name.count(std::string(plain) + "_scale_inv"), 0u) << plain;
    }
    EXPECT_EQ(param("model.layers.7.mlp.gate.e_score_correction_bias").dtype, DType::kF32);
    EXPECT_EQ(param(a + "w_kc").dtype, DType::kBF16);  // the dequantized split
  }
  config.erase("quantization_config");
  auto m = models::make_model(config, layout);
  const auto& shell = m->shells()[0];
  auto spec = [&](const std::string& name) -> const models::ParamSpec& {
    return shell.params.at(shell.by_name.at(name));
  };
  const std::string a = "model.layers.7.self_attn.";
  // q_lora 1536 + kv_lora 512 + rope 64 rows; 128 heads / 8 = 16 local heads.
  EXPECT_EQ(spec(a + "fused_qkv_a_proj_with_mqa.weight").shape, (models::Shape{2112, 7168}));
  EXPECT_EQ(spec(a + "q_b_proj.weight").shape, (models::Shape{16 * 192, 1536}));
  EXPECT_EQ(spec(a + "kv_b_proj.weight").shape, (models::Shape{16 * 256, 512}));
  EXPECT_EQ(spec(a + "o_proj.weight").shape, (models::Shape{7168, 16 * 128}));
  EXPECT_EQ(spec(a + "w_kc").shape, (models::Shape{16, 128, 512}));
  EXPECT_EQ(spec(a + "w_kc").strides, (std::vector<std::uint64_t>{512 * 128, 1, 128}));
  EXPECT_EQ(spec(a + "w_vc").shape, (models::Shape{16, 512, 128}));
  EXPECT_EQ(spec(a + "w_vc").strides, (std::vector<std::uint64_t>{128 * 512, 1, 512}));
  // first_k_dense_replace 3: layers 0-2 dense, 3-60 MoE (256 experts over ep 8).
  EXPECT_EQ(spec("model.layers.2.mlp.gate_up_proj.weight").shape,
            (models::Shape{2 * 18432 / 8, 7168}));
  EXPECT_EQ(shell.by_name.count("model.layers.3.mlp.gate_up_proj.weight"), 0u);
  EXPECT_EQ(spec("model.layers.3.mlp.experts.w13_weight").shape,
            (models::Shape{32, 2 * 2048, 7168}));
  EXPECT_EQ(spec("model.layers.60.mlp.experts.w2_weight").shape, (models::Shape{32, 7168, 2048}));
  EXPECT_EQ(spec("model.layers.3.mlp.gate.e_score_correction_bias").dtype, DType::kF32);
  EXPECT_EQ(spec("model.layers.3.mlp.shared_experts.gate_up_proj.weight").shape,
            (models::Shape{2 * 2048 / 8, 7168}));
  EXPECT_EQ(m->hooks().size(), 61u);
  EXPECT_EQ(
      m->route(tensor_info("model.layers.61.eh_proj.weight", DType::kBF16, {7168, 14336})).reason,
      "mtp_layer");
  // Experts 160-191 live on ep rank 5; expert 159 is read by no local rank.
  EXPECT_EQ(m->route(tensor_info("model.layers.9.mlp.experts.159.up_proj.weight", DType::kBF16,
                                 {2048, 7168}))
                .reason,
            "remote_expert");
  EXPECT_EQ(m->route(tensor_info("model.layers.9.mlp.experts.160.up_proj.weight", DType::kBF16,
                                 {2048, 7168}))
                .kind,
            models::RouteKind::kPlaced);
}

// ---- bad inputs -------------------------------------------------------------------

TEST(DeepseekUneven, MlaHeadsTpDoesNotDivideArePadded) {
  // (Every element of such layouts is checked by the contract cases at tp 16.)
  Ckpt ck = make_ckpt("deepseek_v3");
  ck.config["num_attention_heads"] = 6;
  models::ParallelLayout l;
  l.tp = 4;
  // Refused by default (SGLang's DeepseekV2AttentionMLA asserts heads % tp == 0).
  expect_error([&] { models::make_model(ck.config, l); }, Stage::kPlacement,
               "num_attention_heads (6) is not divisible by tensor parallel size 4");
  // Under pad, 6 heads padded to 8: 2 a rank; ranks 0-2 real heads 0..5, rank 3 zeros.
  models::ModelOptions options;
  options.unaligned_tp = models::Unaligned::kPad;
  auto m = models::make_model(ck.config, l, options);
  const std::uint64_t qk = ck.config["qk_nope_head_dim"].get<std::uint64_t>() +
                           ck.config["qk_rope_head_dim"].get<std::uint64_t>();
  const std::uint64_t dv = ck.config["v_head_dim"].get<std::uint64_t>();
  const models::RankShell& last = m->shells()[3];
  auto shape = [&](const std::string& name) {
    return last.params[last.by_name.at("model.layers.0.self_attn." + name)].shape;
  };
  EXPECT_EQ(shape("q_b_proj.weight")[0], 2 * qk);
  EXPECT_EQ(shape("o_proj.weight")[1], 2 * dv);
  EXPECT_EQ(shape("w_kc")[0], 2u);
  EXPECT_EQ(shape("w_vc")[0], 2u);
  EXPECT_FALSE(m->fill_pieces().empty());
  // The wrappers (strided params, hooks) pass the family's notes on: the heads, and
  // the intermediate sizes pad rounds up to multiples of 4 * 32.
  ASSERT_FALSE(m->notes().empty());
  EXPECT_NE(m->notes()[0].find("num_attention_heads 6 (MLA); padded to 8 with zero heads"),
            std::string::npos)
      << m->notes()[0];
  EXPECT_NE(m->notes()[0].find("of the tp ranks, 3 holds only zero heads"), std::string::npos);
}

TEST(DeepseekErrors, DraftWithoutMtpLayersOrWithPipelineStages) {
  Ckpt ck = make_ckpt("deepseek_v3");
  models::ModelOptions options;
  options.draft = true;
  ck.config["num_nextn_predict_layers"] = 0;
  expect_error([&] { models::make_model(ck.config, {}, options); }, Stage::kConfig,
               "num_nextn_predict_layers");
  ck.config.erase("num_nextn_predict_layers");
  expect_error([&] { models::make_model(ck.config, {}, options); }, Stage::kConfig, "no MTP layer");
  // SGLang's NextN loader asserts num_nextn_predict_layers == 1.
  ck.config["num_nextn_predict_layers"] = 2;
  expect_error([&] { models::make_model(ck.config, {}, options); }, Stage::kConfig,
               "num_nextn_predict_layers is 2; the draft model has exactly one MTP layer");
  ck.config["num_nextn_predict_layers"] = 1;
  models::ParallelLayout l;
  l.pp = 2;
  expect_error([&] { models::make_model(ck.config, l, options); }, Stage::kConfig,
               "parallel.pp is 2");
}

// SGLang builds the NextN decoder layer with layer id 0 (deepseek_nextn.py in
// SGLang 0.5.23, DeepseekModelNextN: DeepseekV2DecoderLayer(config, 0, ...)), so
// its FusedMoE looks experts up in row 0 of the expert-location map, not in row
// num_hidden_layers.
TEST(DeepseekMtp, TheDraftLayerReadsEplbRowZero) {
  const Ckpt ck = make_ckpt("deepseek_v3");  // 2 layers, the MTP layer is layer 2
  const ds::Dims d = ds::dims_of(ck.config);
  models::ModelOptions options;
  options.draft = true;
  models::ModelOptions::Eplb eplb;
  eplb.num_physical_experts = d.E;
  std::vector<std::vector<std::uint64_t>> reversed, identity;
  for (std::uint64_t e = 0; e < d.E; ++e) {
    reversed.push_back({d.E - 1 - e});
    identity.push_back({e});
  }
  eplb.layers[0] = reversed;  // row 0: logical e on physical E-1-e
  eplb.layers[1] = identity;
  options.eplb = eplb;
  models::ParallelLayout layout;
  layout.tp = 2;
  layout.ep = 2;
  auto m = models::make_model(ck.config, layout, options);
  // Logical expert E-1 is physical 0: the first slot of ep rank 0 (tp rank 0).
  const std::string name =
      "model.layers.2.mlp.experts." + std::to_string(d.E - 1) + ".gate_proj.weight";
  const models::Route r = m->route(tensor_info(name, DType::kBF16, {d.moe_I, d.H}));
  ASSERT_EQ(r.kind, models::RouteKind::kPlaced);
  ASSERT_EQ(r.pieces.size(), 1u);
  EXPECT_EQ(r.pieces[0].local_rank, 0u);
  EXPECT_EQ(r.pieces[0].dst_offset, 0u);
  // A map without row 0 is refused, naming the row the draft needs.
  eplb.layers.erase(0);
  options.eplb = eplb;
  expect_error([&] { models::make_model(ck.config, layout, options); }, Stage::kConfig,
               "model.eplb_map");
}

// A stand-alone NextN checkpoint (num_hidden_layers 1) keeps its MTP layer at
// model.layers.0 (SGLang's loader: nextn_layer_id = 0 if num_hidden_layers == 1
// else num_hidden_layers, deepseek_v2.py (SGLang 0.5.23), load_weights).
TEST(DeepseekMtp, AStandAloneNextnCheckpointIsLayerZero) {
  Ckpt ck = make_ckpt("deepseek_v3");
  const ds::Dims d = ds::dims_of(ck.config);
  ck.config["num_hidden_layers"] = 1;
  ck.config["first_k_dense_replace"] = 0;
  models::ModelOptions options;
  options.draft = true;
  auto m = models::make_model(ck.config, {}, options);
  const auto& shell = m->shells()[0];
  EXPECT_TRUE(shell.by_name.contains("model.eh_proj.weight"));
  EXPECT_TRUE(shell.by_name.contains("model.decoder.mlp.experts.w13_weight"));
  const models::Route eh =
      m->route(tensor_info("model.layers.0.eh_proj.weight", DType::kBF16, {d.H, 2 * d.H}));
  ASSERT_EQ(eh.kind, models::RouteKind::kPlaced);
  EXPECT_EQ(shell.params[eh.pieces[0].param].name, "model.eh_proj.weight");
  const models::Route expert = m->route(
      tensor_info("model.layers.0.mlp.experts.3.up_proj.weight", DType::kBF16, {d.moe_I, d.H}));
  ASSERT_EQ(expert.kind, models::RouteKind::kPlaced);
  EXPECT_EQ(shell.params[expert.pieces[0].param].name, "model.decoder.mlp.experts.w13_weight");
  // embed_tokens and shared_head.head come from the target, as for a full checkpoint.
  EXPECT_EQ(
      m->route(tensor_info("model.layers.0.embed_tokens.weight", DType::kBF16, {d.V, d.H})).reason,
      "draft_shared");
}

TEST(DeepseekErrors, WrongKvBProjShapeNamesTensorAndParam) {
  const Ckpt ck = make_ckpt("deepseek_v3");
  models::ParallelLayout l;
  l.tp = 2;
  auto m = models::make_model(ck.config, l);
  // 8 heads * (16 + 16) = 256 rows of kv_lora_rank 32; give it 8 * 24 rows instead.
  expect_error(
      [&] {
        m->route(tensor_info("model.layers.0.self_attn.kv_b_proj.weight", DType::kBF16, {192, 32}));
      },
      Stage::kPlacement, "model.layers.0.self_attn.kv_b_proj.weight [192, 32]");
  expect_error(
      [&] {
        m->route(
            tensor_info("model.layers.0.self_attn.kv_b_proj.weight", DType::kBF16, {256, 32, 1}));
      },
      Stage::kPlacement, "must be [256, 32]");
  // The hook refuses a kv_b_proj param that does not fit the MLA sizes it is given.
  models::MlaDims wrong{4, 16, 8, 32};
  expect_error([&] { models::make_mla_split_hook(*m, 0, "model.layers.0.self_attn.", wrong); },
               Stage::kPostProcess, "model.layers.0.self_attn.kv_b_proj.weight");
  expect_error(
      [&] {
        models::make_mla_split_hook(*m, 0, "model.layers.9.self_attn.",
                                    models::MlaDims{4, 16, 16, 32});
      },
      Stage::kPostProcess, "declares no such parameter");
}

// model.fuse_shared_experts=true is SGLang 0.5.23's --enforce-shared-experts-fusion
// (DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason returns None before
// checking the architecture, expert count or ep): any DeepSeek model with one shared
// expert fuses it, at any ep, into a slot after each rank's routed experts.
TEST(DeepseekErrors, EnforcedFusionFusesWhereSglangsFlagWould) {
  Ckpt ck = make_ckpt("deepseek_v3");
  models::ModelOptions options;
  options.fuse_shared_experts = true;
  // Tiny DeepSeek-V3 has 8 routed experts: not fused by default, fused when enforced.
  for (int ep : {1, 2}) {
    models::ParallelLayout l;
    l.tp = 2;
    l.ep = ep;
    auto m = models::make_model(ck.config, l, options);
    const auto& shell = m->shells()[0];
    SCOPED_TRACE("ep " + std::to_string(ep));
    EXPECT_EQ(shell.by_name.count("model.layers.1.mlp.shared_experts.gate_up_proj.weight"), 0u);
    EXPECT_EQ(shell.params[shell.by_name.at("model.layers.1.mlp.experts.w13_weight")].shape.at(0),
              8u / static_cast<std::uint64_t>(ep) + 1);
    const models::Route r = m->route(
        tensor_info("model.layers.1.mlp.shared_experts.gate_proj.weight", DType::kBF16, {32, 128}));
    EXPECT_EQ(r.kind, models::RouteKind::kPlaced);
  }
  {
    models::ModelOptions automatic;
    auto m = models::make_model(ck.config, {}, automatic);
    EXPECT_EQ(m->shells()[0].by_name.count("model.layers.1.mlp.shared_experts.gate_up_proj.weight"),
              1u);
  }
  ck.config["n_shared_experts"] = 2;
  expect_error([&] { models::make_model(ck.config, {}, options); }, Stage::kConfig,
               "SGLang fuses exactly one shared expert");
  // GLM-4 MoE ignores the flag: it fuses at ep 1 but not under expert parallelism.
  const Ckpt glm = make_ckpt("glm4_moe");
  models::ParallelLayout ep2;
  ep2.tp = 2;
  ep2.ep = 2;
  expect_error([&] { models::make_model(glm.config, ep2, options); }, Stage::kConfig,
               "does not fuse the shared expert under expert parallelism (ep 2)");
  EXPECT_NO_THROW(models::make_model(glm.config, {}, options));
  options.fuse_shared_experts = false;
  ck.config["n_shared_experts"] = 1;
  auto m = models::make_model(ck.config, {}, options);  // unfused
  const auto& shell = m->shells()[0];
  EXPECT_EQ(shell.by_name.count("model.layers.1.mlp.shared_experts.gate_up_proj.weight"), 1u);
}

}  // namespace
}  // namespace ferry::testing
