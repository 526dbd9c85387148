// An independent, deliberately naive account of what each tensor-parallel rank of
// a Mixtral / Qwen3-MoE / Qwen2-MoE model must hold, for the placement tests
// (tests/models/experts_test.cpp) and the end-to-end loads
// (tests/runtime/moe_load_test.cpp). Header-only so both test executables use it.
//
// Nothing here uses models/ code. The reference reads config.json itself and writes
// every element of every param out of the checkpoint's values with the definitions
// spelled out below:
//   - attention and dense MLPs: Megatron splits (q heads [R*h/T, ...), kv heads split
//     or, with fewer kv heads than ranks, head R / (T / kv); gate_up = this rank's
//     gate rows then its up rows; row-parallel = this rank's columns);
//   - vocabulary: padded to a multiple of 64, rank R holds padded rows
//     [R*per, (R+1)*per), zero past the real vocabulary;
//   - attention data parallelism (attn_dp > 1; Qwen2-MoE and Qwen3-MoE in SGLang
//     0.5.23: Qwen2MoeAttention / Qwen3MoeAttention with parallel_group="attn_tp",
//     Qwen2MoeModel's VocabParallelEmbedding(use_attn_tp_group=
//     is_dp_attention_enabled()), the ParallelLMHead with use_attn_tp_group=
//     enable_dp_lm_head): attention and embedding (lm_head with dp_lm_head) are
//     split as above over Ta = T / attn_dp ranks, rank R being R % Ta of them; the
//     dense MLPs, shared expert and experts keep T;
//   - experts: moe_tp = T / ep; rank R is ep rank R / moe_tp and moe-tp rank
//     R % moe_tp; with P physical slots (E without EPLB), ep rank e holds slots
//     [e*P/ep, (e+1)*P/ep), slot s holding the logical expert whose EPLB list names
//     physical id e*P/ep + s (without EPLB: expert e*P/ep + s). (SGLang never fuses
//     these families' shared experts.) w13[s] is [gate | up] (up first with
//     switch_w13), each half I_pad rows: rows j < I/moe_tp are expert rows
//     (R % moe_tp) * I/moe_tp + j, the rest zero; w2[s] is [H, I_pad] with columns
//     (R % moe_tp) * I/moe_tp + k, the rest zero;
//   - uneven tensor parallelism, only with model.unaligned_tp=pad (SGLang's CPU
//     rule, adjust_config_with_unaligned_cpu_tp in python/sglang/srt/configs/
//     update_config.py (SGLang 0.5.23)): when q % T or kv % T is not 0, kv heads
//     are padded to a multiple of T and q heads to padded kv * (q / kv); every
//     intermediate size (dense, shared and the experts') not a multiple of T * 32
//     is padded to one; shares are cut from the padded sizes (the experts' by
//     moe_tp) and every head, row or column past the real size is zero. Without
//     pad nothing is padded.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "models/sglang_rules.hpp"
#include "synth/synth.hpp"

namespace ferry::testing::moe_ref {

struct Options {
  int tp = 1;
  int ep = 1;
  int pp = 1;
  int pp_rank = 0;
  bool switch_w13 = false;
  std::uint64_t pad = 0;       // pad_moe_intermediate_to (0 = off)
  bool unaligned_pad = false;  // model.unaligned_tp=pad
  // EPLB: the physical slot count and, per layer, each logical expert's physical
  // ids. An empty map is the identity (P = E).
  std::uint64_t physical = 0;
  std::map<std::uint64_t, std::vector<std::vector<std::uint64_t>>> eplb;
  // Experts stored as the fused 3-D tensors <moe>experts.gate_up_proj [E, 2I, H]
  // and <moe>experts.down_proj [E, H, I] (values of those names), not per expert.
  bool fused_checkpoint = false;
  // Attention data parallelism (parallel.attn_dp, parallel.dp_lm_head).
  int attn_dp = 1;
  bool dp_lm_head = false;
};

struct Tensor {
  std::vector<std::uint64_t> shape;
  std::vector<float> values;  // row-major; padding is 0
};

// Checkpoint values synth_value(seed, name, i), each tensor computed once.
class Values {
 public:
  using Fn = std::function<float(const std::string& name, std::uint64_t index)>;
  explicit Values(std::uint64_t seed) : seed_(seed) {}
  // Element i of tensor `name` is fn(name, i) instead (the FP8 readings of
  // quant_reference.hpp).
  explicit Values(Fn fn) : fn_(std::move(fn)) {}
  // Elements 0 .. numel-1 of tensor `name` (a name's values do not depend on its
  // shape, so a test may reshape a tensor; each size is cached on its own).
  const std::vector<float>& get(const std::string& name, std::uint64_t numel) {
    auto key = std::make_pair(name, numel);
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      std::vector<float> v(numel);
      for (std::uint64_t i = 0; i < numel; ++i) {
        v[i] = fn_ ? fn_(name, i) : synth::synth_value(seed_, name, i);
      }
      it = cache_.emplace(std::move(key), std::move(v)).first;
    }
    return it->second;
  }
  std::uint64_t seed() const { return seed_; }

 private:
  std::uint64_t seed_ = 0;
  Fn fn_;
  std::map<std::pair<std::string, std::uint64_t>, std::vector<float>> cache_;
};

// The config fields the reference needs, read here independently of models/.
struct Config {
  std::string arch;
  std::uint64_t H = 0, heads = 0, kv = 0, hd = 0, L = 0, V = 0;
  bool tied = false;
  bool qkv_bias = false, o_bias = false, qk_norm = false;
  std::uint64_t E = 0, I = 0;  // routed experts and their width
  std::uint64_t dense_I = 0;   // intermediate_size of dense layers
  std::uint64_t shared_I = 0;  // Qwen2-MoE shared expert
  std::vector<bool> sparse;
  std::string moe;  // "block_sparse_moe." or "mlp."
  std::string gate_name, up_name, down_name;
};

inline Config read_config(const nlohmann::json& c) {
  auto u = [&](const char* k) { return c.at(k).get<std::uint64_t>(); };
  auto has = [&](const char* k) { return c.contains(k) && !c.at(k).is_null(); };
  Config r;
  r.arch = c.at("architectures").at(0).get<std::string>();
  r.H = u("hidden_size");
  r.heads = u("num_attention_heads");
  r.kv = has("num_key_value_heads") ? u("num_key_value_heads") : r.heads;
  r.hd = has("head_dim") ? u("head_dim") : r.H / r.heads;
  r.L = u("num_hidden_layers");
  r.V = u("vocab_size");
  r.tied = has("tie_word_embeddings") && c.at("tie_word_embeddings").get<bool>();
  if (r.arch == "MixtralForCausalLM") {
    r.E = u("num_local_experts");
    r.I = u("intermediate_size");
    r.sparse.assign(r.L, true);
    r.moe = "block_sparse_moe.";
    r.gate_name = "w1";
    r.up_name = "w3";
    r.down_name = "w2";
    return r;
  }
  r.E = u("num_experts");
  r.I = u("moe_intermediate_size");
  r.moe = "mlp.";
  r.gate_name = "gate_proj";
  r.up_name = "up_proj";
  r.down_name = "down_proj";
  const std::uint64_t step = has("decoder_sparse_step") ? u("decoder_sparse_step") : 1;
  std::set<std::uint64_t> dense;
  if (has("mlp_only_layers")) {
    for (const auto& v : c.at("mlp_only_layers")) {
      dense.insert(v.get<std::uint64_t>());
    }
  }
  for (std::uint64_t l = 0; l < r.L; ++l) {
    r.sparse.push_back(dense.count(l) == 0 && (l + 1) % step == 0);
  }
  if (std::find(r.sparse.begin(), r.sparse.end(), false) != r.sparse.end()) {
    r.dense_I = u("intermediate_size");
  }
  if (r.arch == "Qwen3MoeForCausalLM") {
    r.qk_norm = true;
    r.qkv_bias = has("attention_bias") && c.at("attention_bias").get<bool>();
    r.o_bias = r.qkv_bias;
  } else if (r.arch == "Qwen2MoeForCausalLM") {
    r.qkv_bias = true;
    r.shared_I = has("shared_expert_intermediate_size") ? u("shared_expert_intermediate_size") : 0;
  } else {
    throw std::runtime_error("moe reference: unknown architecture " + r.arch);
  }
  return r;
}

// The physical slots of logical expert x in layer l (identity without EPLB).
inline std::vector<std::uint64_t> physical_ids(const Options& o, std::uint64_t layer,
                                               std::uint64_t x) {
  if (o.eplb.empty()) {
    return {x};
  }
  return o.eplb.at(layer).at(x);
}

// Whether any of `ranks` (tp ranks) holds a replica of logical expert x of layer l.
// Whether tp rank `rank`'s moe-tp share of the experts' intermediate size holds any
// real row: under unaligned pad, I is rounded up to a multiple of T * 32 before
// moe_tp splits it, so the last moe-tp ranks may hold only zeros.
inline bool holds_real_rows(const Config& c, const Options& o, int rank) {
  const auto T = static_cast<std::uint64_t>(o.tp);
  const std::uint64_t moe_tp = T / static_cast<std::uint64_t>(o.ep);
  const std::uint64_t padded =
      !o.unaligned_pad || c.I % (T * 32) == 0 ? c.I : (c.I + T * 32 - 1) / (T * 32) * (T * 32);
  return static_cast<std::uint64_t>(rank) % moe_tp * (padded / moe_tp) < c.I;
}

inline bool expert_is_local(const Config& c, const Options& o, std::uint64_t layer, std::uint64_t x,
                            const std::vector<int>& ranks) {
  const std::uint64_t P = o.eplb.empty() ? c.E : o.physical;
  const std::uint64_t per = P / static_cast<std::uint64_t>(o.ep);
  const int moe_tp = o.tp / o.ep;
  for (int r : ranks) {
    const auto ep_rank = static_cast<std::uint64_t>(r / moe_tp);
    if (!holds_real_rows(c, o, r)) {
      continue;  // its moe-tp share of the (padded) intermediate size is all zeros
    }
    for (std::uint64_t p : physical_ids(o, layer, x)) {
      if (p >= ep_rank * per && p < (ep_rank + 1) * per) {
        return true;
      }
    }
  }
  return false;
}

// Every param tp rank `rank` must hold, by SGLang name.
inline std::map<std::string, Tensor> reference_rank(const nlohmann::json& config, Values& values,
                                                    const Options& o, int rank) {
  const Config c = read_config(config);
  const std::uint64_t T = static_cast<std::uint64_t>(o.tp);
  const std::uint64_t R = static_cast<std::uint64_t>(rank);
  const std::uint64_t H = c.H;
  const std::uint64_t hd = c.hd;
  std::map<std::string, Tensor> out;

  auto full = [&](const std::string& name, std::uint64_t numel) -> const std::vector<float>& {
    return values.get(name, numel);
  };
  auto copy_full = [&](const std::string& name, std::vector<std::uint64_t> shape) {
    std::uint64_t n = 1;
    for (std::uint64_t d : shape) {
      n *= d;
    }
    out[name] = Tensor{shape, full(name, n)};
  };
  // Rows [r0, r0 + n) of a [rows, cols] tensor, appended to `dst`; rows past the
  // tensor (padding) are zeros.
  auto rows = [&](std::vector<float>& dst, const std::string& name, std::uint64_t all_rows,
                  std::uint64_t cols, std::uint64_t r0, std::uint64_t n) {
    const std::vector<float>& s = full(name, all_rows * cols);
    for (std::uint64_t i = r0; i < r0 + n; ++i) {
      for (std::uint64_t j = 0; j < cols; ++j) {
        dst.push_back(i < all_rows ? s[i * cols + j] : 0.0f);
      }
    }
  };
  // Columns [c0, c0 + n) of every row of a [rows, cols] tensor; columns past the
  // tensor (padding) are zeros.
  auto columns = [&](const std::string& name, std::uint64_t all_rows, std::uint64_t cols,
                     std::uint64_t c0, std::uint64_t n) {
    const std::vector<float>& s = full(name, all_rows * cols);
    Tensor t{{all_rows, n}, {}};
    for (std::uint64_t i = 0; i < all_rows; ++i) {
      for (std::uint64_t j = c0; j < c0 + n; ++j) {
        t.values.push_back(j < cols ? s[i * cols + j] : 0.0f);
      }
    }
    return t;
  };
  // An intermediate size under pad: a multiple of T * 32.
  auto padded_inter = [&](std::uint64_t inter) {
    return !o.unaligned_pad || inter % (T * 32) == 0 ? inter
                                                     : (inter + T * 32 - 1) / (T * 32) * (T * 32);
  };
  // A tensor-parallel gated MLP of width `inter` under checkpoint/param prefix `p`.
  auto dense_mlp = [&](const std::string& p, std::uint64_t inter) {
    const std::uint64_t il = padded_inter(inter) / T;
    Tensor gu{{2 * il, H}, {}};
    rows(gu.values, p + "gate_proj.weight", inter, H, R * il, il);
    rows(gu.values, p + "up_proj.weight", inter, H, R * il, il);
    out[p + "gate_up_proj.weight"] = std::move(gu);
    out[p + "down_proj.weight"] = columns(p + "down_proj.weight", H, inter, R * il, il);
  };

  // Pipeline stage: SGLang's get_pp_indices; embedding first, norm and head last.
  const std::uint64_t S = static_cast<std::uint64_t>(o.pp);
  const std::uint64_t s = static_cast<std::uint64_t>(o.pp_rank);
  const auto [l0, l1] = sglang::get_pp_indices(c.L, s, S);
  const bool first = s == 0;
  const bool last = s + 1 == S;
  // The attention's group (Ta ranks, this one Ra of them).
  const std::uint64_t Ta = T / static_cast<std::uint64_t>(o.attn_dp);
  const std::uint64_t Ra = R % Ta;
  auto vocab = [&](const std::string& param, const std::string& src) {
    const bool split = param == "lm_head.weight" ? o.dp_lm_head : o.attn_dp > 1;
    const std::uint64_t Tg = split ? Ta : T;
    const std::uint64_t padded = (c.V + 63) / 64 * 64;
    const std::uint64_t per = padded / Tg;
    const std::vector<float>& v = full(src, c.V * H);
    Tensor t{{per, H}, {}};
    for (std::uint64_t i = 0; i < per; ++i) {
      const std::uint64_t g = (R % Tg) * per + i;
      for (std::uint64_t j = 0; j < H; ++j) {
        t.values.push_back(g < c.V ? v[g * H + j] : 0.0f);
      }
    }
    out[param] = std::move(t);
  };
  if (first) {
    vocab("model.embed_tokens.weight", "model.embed_tokens.weight");
  }
  if (last) {
    copy_full("model.norm.weight", {H});
    if (!c.tied) {
      vocab("lm_head.weight", "lm_head.weight");
    } else if (!first) {
      vocab("lm_head.weight", "model.embed_tokens.weight");
    }
  } else if (!c.tied) {
    // SGLang 0.5.23's MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM
    // build their ParallelLMHead on every pipeline stage and load it there.
    vocab("lm_head.weight", "lm_head.weight");
  }

  // Heads (over the attention group), padded under pad when q or kv heads are not
  // multiples of Ta.
  std::uint64_t heads_p = c.heads;
  std::uint64_t kv_p = c.kv;
  if (o.unaligned_pad && (c.heads % Ta != 0 || c.kv % Ta != 0)) {
    kv_p = (c.kv + Ta - 1) / Ta * Ta;
    heads_p = kv_p * (c.heads / c.kv);
  }
  const std::uint64_t qh = heads_p / Ta;
  const std::uint64_t kvl = kv_p >= Ta ? kv_p / Ta : 1;
  const std::uint64_t kv0 = kv_p >= Ta ? Ra * kvl : Ra / (Ta / kv_p);

  // Experts.
  const std::uint64_t moe_tp = T / static_cast<std::uint64_t>(o.ep);
  const std::uint64_t ep_rank = R / moe_tp;
  const std::uint64_t mr = R % moe_tp;
  const std::uint64_t il = padded_inter(c.I) / moe_tp;
  const std::uint64_t ip = o.pad == 0 ? il : (il + o.pad - 1) / o.pad * o.pad;
  const std::uint64_t P = o.eplb.empty() ? c.E : o.physical;
  const std::uint64_t per = P / static_cast<std::uint64_t>(o.ep);
  const std::uint64_t slots = per;
  // One expert's three matrices: gate and up [I, H], down [H, I], row-major.
  struct ExpertView {
    const float* gate = nullptr;
    const float* up = nullptr;
    const float* down = nullptr;
  };
  // Logical expert x of the MoE block `moe`.
  auto expert_view = [&](const std::string& moe, std::uint64_t x) {
    ExpertView v;
    if (o.fused_checkpoint) {
      // gate_up_proj [E, 2I, H]: expert x's gate rows, then its up rows.
      const float* gu = full(moe + "experts.gate_up_proj", c.E * 2 * c.I * H).data();
      v.gate = gu + x * 2 * c.I * H;
      v.up = v.gate + c.I * H;
      v.down = full(moe + "experts.down_proj", c.E * H * c.I).data() + x * H * c.I;
    } else {
      const std::string e = moe + "experts." + std::to_string(x) + ".";
      v.gate = full(e + c.gate_name + ".weight", c.I * H).data();
      v.up = full(e + c.up_name + ".weight", c.I * H).data();
      v.down = full(e + c.down_name + ".weight", H * c.I).data();
    }
    return v;
  };

  for (std::uint64_t l = l0; l < l1; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string a = p + "self_attn.";
    Tensor qkv{{(qh + 2 * kvl) * hd, H}, {}};
    rows(qkv.values, a + "q_proj.weight", c.heads * hd, H, Ra * qh * hd, qh * hd);
    rows(qkv.values, a + "k_proj.weight", c.kv * hd, H, kv0 * hd, kvl * hd);
    rows(qkv.values, a + "v_proj.weight", c.kv * hd, H, kv0 * hd, kvl * hd);
    out[a + "qkv_proj.weight"] = std::move(qkv);
    if (c.qkv_bias) {
      Tensor b{{(qh + 2 * kvl) * hd}, {}};
      rows(b.values, a + "q_proj.bias", c.heads * hd, 1, Ra * qh * hd, qh * hd);
      rows(b.values, a + "k_proj.bias", c.kv * hd, 1, kv0 * hd, kvl * hd);
      rows(b.values, a + "v_proj.bias", c.kv * hd, 1, kv0 * hd, kvl * hd);
      out[a + "qkv_proj.bias"] = std::move(b);
    }
    out[a + "o_proj.weight"] =
        columns(a + "o_proj.weight", H, c.heads * hd, Ra * qh * hd, qh * hd);
    if (c.o_bias) {
      copy_full(a + "o_proj.bias", {H});
    }
    if (c.qk_norm) {
      copy_full(a + "q_norm.weight", {hd});
      copy_full(a + "k_norm.weight", {hd});
    }
    copy_full(p + "input_layernorm.weight", {H});
    copy_full(p + "post_attention_layernorm.weight", {H});
    if (!c.sparse[l]) {
      dense_mlp(p + "mlp.", c.dense_I);
      continue;
    }
    const std::string moe = p + c.moe;
    copy_full(moe + "gate.weight", {c.E, H});

    // Which logical expert each local slot holds.
    std::vector<std::uint64_t> slot_expert(slots, c.E);
    for (std::uint64_t x = 0; x < c.E; ++x) {
      for (std::uint64_t id : physical_ids(o, l, x)) {
        if (id >= ep_rank * per && id < (ep_rank + 1) * per) {
          slot_expert[id - ep_rank * per] = x;
        }
      }
    }
    Tensor w13{{slots, 2 * ip, H}, {}};
    Tensor w2{{slots, H, ip}, {}};
    for (std::uint64_t sl = 0; sl < slots; ++sl) {
      const ExpertView v = expert_view(moe, slot_expert[sl]);
      for (std::uint64_t j = 0; j < 2 * ip; ++j) {
        const bool first_half = j < ip;
        const float* m = first_half != o.switch_w13 ? v.gate : v.up;
        const std::uint64_t jj = j % ip;
        for (std::uint64_t h = 0; h < H; ++h) {
          const std::uint64_t row = mr * il + jj;  // of the expert's I rows
          w13.values.push_back(jj < il && row < c.I ? m[row * H + h] : 0.0f);
        }
      }
      for (std::uint64_t h = 0; h < H; ++h) {
        for (std::uint64_t k = 0; k < ip; ++k) {
          const std::uint64_t col = mr * il + k;
          w2.values.push_back(k < il && col < c.I ? v.down[h * c.I + col] : 0.0f);
        }
      }
    }
    out[moe + "experts.w13_weight"] = std::move(w13);
    out[moe + "experts.w2_weight"] = std::move(w2);
    if (c.shared_I > 0) {
      dense_mlp(moe + "shared_expert.", c.shared_I);
      copy_full(moe + "shared_expert_gate.weight", {1, H});
    }
  }
  return out;
}

}  // namespace ferry::testing::moe_ref
