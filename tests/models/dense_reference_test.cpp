// The placement of Llama / Qwen2 / Mistral checkpoints compared element by element
// with an independent reference (reference_util.*): every tensor of a synthetic
// checkpoint is routed, its pieces are executed by a naive executor that can only
// see the tensor's bytes inside the route's read range, the fill pieces run, and
// every byte of every local param must have been written exactly once with the
// value the reference computes from the full tensors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "models/coverage.hpp"
#include "models/model.hpp"
#include "models/reference_util.hpp"

namespace ferry::testing {
namespace {

struct Case {
  std::string family;  // llama, qwen2, mistral
  int tp = 1;
  std::vector<int> local;  // empty: every rank
  bool tied = false;
  DType ckpt_dtype = DType::kBF16;
  std::optional<DType> param_dtype;  // nullopt: auto (the config's torch_dtype)
  bool llama_biases = false;
  // Non-zero: the checkpoint's vocabulary and intermediate size instead of tiny's
  // 1000 and 256 (tp 3 needs a vocabulary whose padded size it splits).
  std::uint64_t vocab = 0;
  std::uint64_t inter = 0;
  // Non-zero: num_key_value_heads instead of tiny's 2 (of 8 q heads).
  std::uint64_t kv_heads = 0;
  // model.unaligned_tp=pad: sizes tp does not divide are zero-padded as SGLang's
  // CPU path does (without it such a layout is refused).
  bool pad = false;
  // Attention data parallelism (parallel.attn_dp, parallel.dp_lm_head).
  int attn_dp = 1;
  bool dp_lm_head = false;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string name = c.family + "_tp" + std::to_string(c.tp);
  if (!c.local.empty()) {
    name += "_local";
    for (int r : c.local) {
      name += std::to_string(r);
    }
  }
  name += c.tied ? "_tied" : "_untied";
  name += "_" + std::string(dtype_name(c.ckpt_dtype));
  if (c.param_dtype) {
    name += "_to_" + std::string(dtype_name(*c.param_dtype));
  }
  if (c.llama_biases) {
    name += "_biases";
  }
  if (c.vocab != 0) {
    name += "_vocab" + std::to_string(c.vocab);
  }
  if (c.inter != 0) {
    name += "_inter" + std::to_string(c.inter);
  }
  if (c.kv_heads != 0) {
    name += "_kv" + std::to_string(c.kv_heads);
  }
  if (c.pad) {
    name += "_pad";
  }
  if (c.attn_dp > 1) {
    name += "_attndp" + std::to_string(c.attn_dp);
  }
  if (c.dp_lm_head) {
    name += "_dplmhead";
  }
  return name;
}

// gtest prints a failing parameter with this (instead of its raw bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name({c, 0});
}

class DenseReference : public ::testing::TestWithParam<Case> {};

// The case's sizes: tiny's, or the case's vocabulary, intermediate and kv heads
// (config fields and the shapes of the tensors they size).
void resize(SynthCase& ck, const Case& c) {
  const std::uint64_t hd = 16;  // tiny: head_dim 16, as the config says
  if (ck.config.contains("head_dim")) {
    EXPECT_EQ(ck.config["head_dim"].get<std::uint64_t>(), hd);
  }
  for (auto& [name, shape] : ck.shapes) {
    const bool embed = name == "model.embed_tokens.weight" || name == "lm_head.weight";
    const bool mlp_out = name.find("gate_proj") != std::string::npos ||
                         name.find("up_proj") != std::string::npos;
    const bool kv = name.find("k_proj") != std::string::npos ||
                    name.find("v_proj") != std::string::npos;
    if (embed && c.vocab != 0) {
      shape[0] = c.vocab;
    } else if (mlp_out && c.inter != 0) {
      shape[0] = c.inter;
    } else if (name.find("down_proj.weight") != std::string::npos && c.inter != 0) {
      shape[1] = c.inter;
    } else if (kv && c.kv_heads != 0) {
      shape[0] = c.kv_heads * hd;
    }
  }
  if (c.vocab != 0) {
    ck.config["vocab_size"] = c.vocab;
  }
  if (c.inter != 0) {
    ck.config["intermediate_size"] = c.inter;
  }
  if (c.kv_heads != 0) {
    ck.config["num_key_value_heads"] = c.kv_heads;
  }
}

// Full tensors do not depend on the dtype (synth values are exact in all three) and
// a name's values do not depend on the family, so every case draws from the
// untied llama-with-biases tensors (mistral uses llama's names) or qwen2's, at the
// case's sizes.
const TensorMap& checkpoint_for(const Case& c) {
  static std::map<std::string, TensorMap> cache;
  const std::string family = c.family == "qwen2" ? "qwen2" : "llama";
  const std::string key = family + "/" + std::to_string(c.vocab) + "/" + std::to_string(c.inter) +
                          "/" + std::to_string(c.kv_heads);
  auto it = cache.find(key);
  if (it == cache.end()) {
    SynthCase all = tiny_case(family, DType::kF32, /*tied=*/false, family == "llama");
    Case sizes;
    sizes.vocab = c.vocab;
    sizes.inter = c.inter;
    sizes.kv_heads = c.kv_heads;
    resize(all, sizes);
    it = cache.emplace(key, make_checkpoint(all.shapes, /*seed=*/7)).first;
  }
  return it->second;
}

TEST_P(DenseReference, EveryElementMatchesTheReference) {
  const Case& c = GetParam();
  SynthCase ck = tiny_case(c.family, c.ckpt_dtype, c.tied, c.llama_biases);
  resize(ck, c);
  const TensorMap& full = checkpoint_for(c);

  models::ParallelLayout layout;
  layout.tp = c.tp;
  layout.local_ranks = c.local;
  layout.attn_dp = c.attn_dp;
  layout.dp_lm_head = c.dp_lm_head;
  models::ModelOptions options;
  options.dtype = c.param_dtype;
  options.unaligned_tp = c.pad ? models::Unaligned::kPad : models::Unaligned::kRefuse;
  std::unique_ptr<models::Model> model = models::make_model(ck.config, layout, options);
  ASSERT_EQ(model->family(), c.family);
  const DType param_dtype = c.param_dtype.value_or(c.ckpt_dtype);

  std::vector<int> local = c.local;
  if (local.empty()) {
    for (int r = 0; r < c.tp; ++r) {
      local.push_back(r);
    }
  }
  ASSERT_EQ(model->layout().local_ranks, local);
  ASSERT_EQ(model->shells().size(), local.size());

  ParamBuffers buffers = make_buffers(*model);
  std::vector<models::Route> routes;
  for (const std::string& name : ck.names) {
    const HostTensor& t = full.at(name);
    models::Route route = model->route(tensor_info(name, c.ckpt_dtype, t.shape));
    if (name.find(".mlp.") != std::string::npos && name.ends_with(".bias")) {
      // SGLang's Llama MLP has no biases, whatever mlp_bias says: dropped.
      EXPECT_EQ(route.kind, models::RouteKind::kDropped) << name;
      EXPECT_EQ(route.reason, "no_bias_param") << name;
      continue;
    }
    ASSERT_EQ(route.kind, models::RouteKind::kPlaced) << name << " " << route.reason;
    ASSERT_FALSE(route.pieces.empty()) << name;
    std::vector<std::byte> bytes = encode(t.values, c.ckpt_dtype);
    ASSERT_LE(route.src_begin, route.src_end) << name;
    ASSERT_LE(route.src_end, bytes.size()) << name;
    // The executor sees only the bytes the reader would fetch.
    std::span<const std::byte> window(bytes.data() + route.src_begin,
                                      route.src_end - route.src_begin);
    for (const models::Piece& p : route.pieces) {
      ASSERT_EQ(p.kind, models::Piece::Kind::kCopy) << name;
      ASSERT_EQ(p.src_dtype, c.ckpt_dtype) << name;
      ASSERT_EQ(p.dst_dtype, param_dtype) << name;
      ASSERT_LT(p.local_rank, local.size()) << name;
      ASSERT_NO_THROW(apply_piece(p, window, route.src_begin, buffers)) << name;
    }
    routes.push_back(std::move(route));
  }
  for (const models::Piece& p : model->fill_pieces()) {
    ASSERT_EQ(p.kind, models::Piece::Kind::kZero);
    ASSERT_NO_THROW(apply_piece(p, {}, 0, buffers));
  }
  EXPECT_TRUE(models::check_coverage(*model, routes).empty());

  RefConfig rc = ref_config(ck.config);
  rc.pad = c.pad;
  // SGLang 0.5.23 under attention data parallelism: Llama (and its subclass Mistral)
  // keeps attention and embedding over tp and splits lm_head over the attention tp
  // group with enable_dp_lm_head (LlamaForCausalLM.__init__: ParallelLMHead(
  // use_attn_tp_group=enable_dp_lm_head)); Qwen2 splits only its embedding there
  // (Qwen2Model.__init__: VocabParallelEmbedding(use_attn_tp_group=
  // is_dp_attention_enabled())).
  const auto attn_tp = static_cast<std::uint64_t>(c.tp / c.attn_dp);
  if (c.attn_dp > 1 && c.family == "qwen2") {
    rc.embed_group = attn_tp;
  }
  if (c.dp_lm_head) {
    rc.head_group = attn_tp;
  }
  for (std::size_t i = 0; i < local.size(); ++i) {
    const models::RankShell& shell = model->shells()[i];
    ASSERT_EQ(shell.tp_rank, local[i]);
    TensorMap expected = reference_params(rc, full, local[i], c.tp);
    std::vector<std::string> expected_names;
    for (const auto& [name, t] : expected) {
      expected_names.push_back(name);
    }
    std::vector<std::string> names;
    for (const models::ParamSpec& p : shell.params) {
      names.push_back(p.name);
    }
    ASSERT_EQ(names, expected_names) << "rank " << local[i];
    for (std::size_t k = 0; k < shell.params.size(); ++k) {
      const models::ParamSpec& spec = shell.params[k];
      const HostTensor& want = expected.at(spec.name);
      ASSERT_EQ(spec.shape, want.shape) << spec.name;
      ASSERT_EQ(spec.dtype, param_dtype);
      ASSERT_EQ(spec.nbytes, want.values.size() * dtype_size(param_dtype));
      ASSERT_EQ(shell.by_name.at(spec.name), k);
      // Plain loops: one gtest assertion per element would dominate the run time.
      const auto& bytes = buffers.bytes[i][k];
      const auto& writes = buffers.writes[i][k];
      auto bad_write = std::find_if(writes.begin(), writes.end(), [](auto n) { return n != 1; });
      ASSERT_TRUE(bad_write == writes.end())
          << spec.name << " rank " << local[i] << ": byte " << (bad_write - writes.begin())
          << " written " << int(*bad_write) << " times";
      const std::size_t es = dtype_size(param_dtype);
      for (std::size_t e = 0; e < want.values.size(); ++e) {
        float got = decode_one(bytes.data() + e * es, param_dtype);
        if (got != want.values[e]) {
          FAIL() << spec.name << " rank " << local[i] << " element " << e << ": got " << got
                 << ", reference " << want.values[e];
        }
      }
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int tp : {1, 2, 4, 8}) {
    for (bool tied : {false, true}) {
      out.push_back({"llama", tp, {}, tied, DType::kBF16, std::nullopt, false});
      out.push_back({"qwen2", tp, {}, tied, DType::kBF16, DType::kF32, false});
    }
    out.push_back({"mistral", tp, {}, false, DType::kF16, std::nullopt, false});
  }
  // Subsets of ranks, in any device order.
  out.push_back({"llama", 4, {1, 3}, false, DType::kBF16, std::nullopt, false});
  out.push_back({"llama", 8, {7, 0, 4}, true, DType::kF32, DType::kBF16, false});
  out.push_back({"qwen2", 2, {1}, false, DType::kBF16, std::nullopt, false});
  out.push_back({"qwen2", 8, {5}, true, DType::kBF16, DType::kF16, false});
  // Llama with attention_bias and mlp_bias: qkv and o biases; the MLP biases are
  // dropped (SGLang's LlamaMLP has none).
  out.push_back({"llama", 2, {}, false, DType::kBF16, std::nullopt, true});
  out.push_back({"llama", 8, {}, true, DType::kBF16, DType::kF32, true});
  // Uneven tensor parallelism under model.unaligned_tp=pad, SGLang's CPU sizes
  // (8 q / 2 kv heads: 12 / 3 at tp 3, 24 / 6 at tp 6, 64 / 16 at tp 16; 8 q / 8 kv:
  // 9 kv and q heads at tp 3; intermediate 200 or 256 at tp 3 -> 288, at tp 6 ->
  // 384; 200 at tp 16 -> 512, and 256 at tp 16 too, since it is not a multiple of
  // 16 * 32).
  auto pad = [](Case c) {
    c.pad = true;
    return c;
  };
  out.push_back(pad({"llama", 3, {}, false, DType::kBF16, std::nullopt, false, 960}));
  out.push_back(pad({"qwen2", 3, {}, true, DType::kBF16, std::nullopt, false, 960, 200}));
  out.push_back(pad({"llama", 3, {2, 0}, false, DType::kF32, DType::kBF16, true, 960, 200, 8}));
  out.push_back(pad({"llama", 6, {}, false, DType::kBF16, std::nullopt, true, 1152}));
  out.push_back(pad({"qwen2", 6, {5, 1}, false, DType::kF16, std::nullopt, false, 1152, 200}));
  out.push_back(pad({"mistral", 16, {}, false, DType::kBF16, std::nullopt, false, 0, 200}));
  out.push_back(pad({"llama", 16, {1, 12}, true, DType::kBF16, std::nullopt, true}));
  // Under pad, layouts the GPU accepts are padded too when SGLang's CPU rule says
  // so: 2 kv heads at tp 4 (replicated on GPU) become 4, with 16 q heads; tiny's
  // intermediate 256 at tp 4 is a multiple of 128 and stays.
  out.push_back(pad({"llama", 4, {}, false, DType::kBF16, std::nullopt, false}));
  out.push_back({"qwen2", 8, {}, false, DType::kBF16, std::nullopt, false, 0, 0, 8});
  // Attention data parallelism at tp 8 and 4 (attention tp 2, 1 and 4), with and
  // without dp_lm_head, on subsets of ranks.
  auto dp = [](Case c, int attn_dp, bool lm_head) {
    c.attn_dp = attn_dp;
    c.dp_lm_head = lm_head;
    return c;
  };
  out.push_back(dp({"llama", 8, {}, false, DType::kBF16, std::nullopt, false}, 4, true));
  out.push_back(dp({"llama", 8, {6, 1}, false, DType::kBF16, std::nullopt, false}, 8, true));
  out.push_back(dp({"llama", 4, {}, true, DType::kBF16, std::nullopt, false}, 2, true));
  out.push_back(dp({"mistral", 8, {}, false, DType::kF16, std::nullopt, false}, 4, false));
  out.push_back(dp({"qwen2", 8, {}, false, DType::kBF16, std::nullopt, false}, 4, false));
  out.push_back(dp({"qwen2", 4, {3, 2}, true, DType::kBF16, std::nullopt, false}, 2, false));
  return out;
}

INSTANTIATE_TEST_SUITE_P(Families, DenseReference, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace ferry::testing
