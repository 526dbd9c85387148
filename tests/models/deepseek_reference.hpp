// An independent, deliberately naive account of what each rank of a DeepSeek-V2/V3
// or GLM-4 MoE model must hold, for the contract tests in tests/models and
// tests/runtime. Nothing here uses models/ code: config.json is read here, and
// every element of every param is computed by explicit index arithmetic:
// Megatron splits (column-parallel rows, row-parallel columns, merged gate/up
// slots, q/k/v heads, padded vocabulary), expert parallelism as documented in
// models/experts.hpp (ep rank r / (tp/ep) holds experts [ep_rank*E/ep, +E/ep), then
// the folded shared expert), and the DeepSeek-V2 paper's kv_b_proj layout (per
// head: qk_nope_head_dim key rows W^UK, then v_head_dim value rows W^UV).
//
// Header-only, so that both test executables (models, runtime) can use it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "models/sglang_rules.hpp"

namespace ferry::testing::ds {

// Element `index` (row-major) of checkpoint tensor `name`.
using ValueFn = std::function<float(const std::string& name, std::uint64_t index)>;

struct Dims {
  std::string arch;
  bool glm = false;
  bool router_fp32 = false;  // config.json's router_fp32 (DeepSeek's MoEGate)
  std::uint64_t H = 0, L = 0, V = 0, heads = 0;
  std::uint64_t q_lora = 0, kv_lora = 0, dn = 0, dr = 0, dv = 0;  // MLA
  std::uint64_t kv_heads = 0, head_dim = 0;                       // GLM
  bool qkv_bias = false, qk_norm = false;
  std::uint64_t I = 0, E = 0, moe_I = 0, n_shared = 0, first_k = 0, freq = 1, nextn = 0;
  bool gate_bias = false, tied = false;
  std::uint64_t index_heads = 0, index_dim = 0;  // DeepSeek-V3.2's indexer (every layer)
  bool index_fused = false;  // config.json's indexer_rope_interleave: wk_weights_proj
};

inline std::uint64_t get_or(const nlohmann::json& c, const char* key, std::uint64_t fallback) {
  return c.contains(key) && !c.at(key).is_null() ? c.at(key).get<std::uint64_t>() : fallback;
}
inline bool get_bool_or(const nlohmann::json& c, const char* key, bool fallback) {
  return c.contains(key) && !c.at(key).is_null() ? c.at(key).get<bool>() : fallback;
}

inline Dims dims_of(const nlohmann::json& c) {
  Dims d;
  d.arch = c.at("architectures").at(0).get<std::string>();
  d.glm = d.arch == "Glm4MoeForCausalLM";
  d.router_fp32 = get_bool_or(c, "router_fp32", false);
  d.H = c.at("hidden_size");
  d.L = c.at("num_hidden_layers");
  d.V = c.at("vocab_size");
  d.heads = c.at("num_attention_heads");
  d.I = c.at("intermediate_size");
  d.E = get_or(c, "n_routed_experts", 0);
  d.moe_I = get_or(c, "moe_intermediate_size", 0);
  d.n_shared = get_or(c, "n_shared_experts", 0);
  d.first_k = get_or(c, "first_k_dense_replace", 0);
  d.nextn = get_or(c, "num_nextn_predict_layers", 0);
  d.tied = get_bool_or(c, "tie_word_embeddings", false);
  if (d.glm) {
    d.kv_heads = get_or(c, "num_key_value_heads", d.heads);
    d.head_dim = get_or(c, "head_dim", d.H / d.heads);
    d.qkv_bias = get_bool_or(c, "attention_bias", false);
    d.qk_norm = get_bool_or(c, "use_qk_norm", false);
    d.gate_bias = true;
  } else {
    d.q_lora = get_or(c, "q_lora_rank", 0);
    d.kv_lora = c.at("kv_lora_rank");
    d.dn = c.at("qk_nope_head_dim");
    d.dr = c.at("qk_rope_head_dim");
    d.dv = c.at("v_head_dim");
    d.freq = get_or(c, "moe_layer_freq", 1);
    const bool v3 = d.arch == "DeepseekV3ForCausalLM" || d.arch == "DeepseekV32ForCausalLM";
    std::string method = v3 ? "noaux_tc" : "greedy";
    if (c.contains("topk_method") && c.at("topk_method").is_string()) {
      method = c.at("topk_method").get<std::string>();
    }
    d.gate_bias = method == "noaux_tc";
    if (v3 && c.contains("index_topk") && !c.at("index_topk").is_null()) {
      d.index_heads = c.at("index_n_heads");
      d.index_dim = c.at("index_head_dim");
      d.index_fused = c.value("indexer_rope_interleave", false);
    }
  }
  return d;
}

inline bool is_moe(const Dims& d, std::uint64_t layer) {
  return d.E > 0 && layer >= d.first_k && layer % d.freq == 0;
}

struct Layout {
  int tp = 1;
  int ep = 1;
  int pp = 1;
  int pp_rank = 0;
  bool draft = false;
  bool fuse_shared = false;  // the decision: sglang::fuses_shared_experts, or the option
  bool switch_w13 = false;
  bool pad = false;  // model.unaligned_tp=pad
  // SGLang's DeepSeek deployment layouts (SGLang 0.5.23,
  // python/sglang/srt/models/deepseek_v2.py; runtime_context.py, derive_attn_tp_size
  // and derive_attention_ranks: attn_tp_size = tp // attn_dp_size, attn_tp_rank =
  // tp_rank % attn_tp_size):
  // - attn_dp: DeepseekV2AttentionMLA builds q_b_proj / q_proj, kv_b_proj and o_proj
  //   with (attn_tp_rank, attn_tp_size); DeepseekV2Model's embedding is
  //   VocabParallelEmbedding(**get_embedding_tp_kwargs()) (layers/
  //   vocab_parallel_embedding.py): enable_tp with use_attn_tp_group=
  //   is_dp_attention_enabled(), split over the attention tp group. (Changed from
  //   commit 3e4a39ee7330, where it was enable_tp=not enable_dp_attention: whole.)
  // - dp_lm_head: ParallelLMHead(use_attn_tp_group=enable_dp_lm_head);
  // - moe_dense_tp1: DeepseekV2DecoderLayer builds a dense layer's DeepseekV2MLP with
  //   tp_rank 0, tp_size 1 when enable_moe_dense_fully_dp() (moe_dense_tp_size == 1);
  // - deepep: DeepseekV2MoE builds shared_experts with tp_rank 0, tp_size 1 under
  //   get_moe_a2a_backend().is_deepep(), and shared_experts_fusion_disable_reason
  //   disables fusion (expert parallel world > 1).
  int attn_dp = 1;
  bool dp_lm_head = false;
  bool moe_dense_tp1 = false;
  bool deepep = false;
};

// SGLang's shared_experts_fusion_disable_reason for these dims and layout.
inline bool sglang_fuses(const Dims& d, const Layout& l) {
  return !l.deepep && sglang::fuses_shared_experts(d.arch, d.E, d.n_shared, l.ep);
}

// An intermediate size under model.unaligned_tp=pad: a multiple of T * 32 (SGLang's
// update_intermediate_size on CPU); unchanged without pad.
inline std::uint64_t padded_inter(std::uint64_t inter, std::uint64_t T, bool pad) {
  return !pad || inter % (T * 32) == 0 ? inter : (inter + T * 32 - 1) / (T * 32) * (T * 32);
}

// Layers [begin, end) of the stage.
inline std::pair<std::uint64_t, std::uint64_t> stage_layers(const Dims& d, const Layout& l) {
  return sglang::get_pp_indices(d.L, static_cast<std::uint64_t>(l.pp_rank),
                                static_cast<std::uint64_t>(l.pp));
}

// The experts (checkpoint ids) of tp rank `rank`, in slot order.
inline std::vector<std::uint64_t> experts_of(const Dims& d, const Layout& l, int rank) {
  const int moe_tp = l.tp / l.ep;
  const auto ep_rank = static_cast<std::uint64_t>(rank / moe_tp);
  const std::uint64_t per = d.E / static_cast<std::uint64_t>(l.ep);
  std::vector<std::uint64_t> out;
  for (std::uint64_t e = 0; e < per; ++e) {
    out.push_back(ep_rank * per + e);
  }
  return out;
}

struct Param {
  std::vector<std::uint64_t> shape;
  std::vector<std::uint64_t> strides;  // storage strides in elements
  bool f32 = false;                    // F32 whatever the model dtype
  bool bf16 = false;                   // BF16 whatever the model dtype
  std::vector<float> values;           // logical row-major
};
using Params = std::map<std::string, Param>;

inline std::vector<std::uint64_t> row_major(const std::vector<std::uint64_t>& shape) {
  std::vector<std::uint64_t> s(shape.size(), 1);
  for (std::size_t i = shape.size(); i > 1; --i) {
    s[i - 2] = s[i - 1] * shape[i - 1];
  }
  return s;
}

// What tp rank `rank` must hold. Names are SGLang's.
inline Params reference(const nlohmann::json& config, const Layout& l, int rank,
                        const ValueFn& value) {
  const Dims d = dims_of(config);
  const auto T = static_cast<std::uint64_t>(l.tp);
  const auto R = static_cast<std::uint64_t>(rank);
  const std::uint64_t H = d.H;
  Params out;
  auto put = [&](const std::string& name, std::vector<std::uint64_t> shape,
                 std::vector<float> values, bool f32 = false) {
    std::uint64_t n = 1;
    for (std::uint64_t x : shape) {
      n *= x;
    }
    if (n != values.size()) {
      throw std::runtime_error("reference: " + name + " has " + std::to_string(values.size()) +
                               " values for " + std::to_string(n) + " elements");
    }
    Param p;
    p.strides = row_major(shape);
    p.shape = std::move(shape);
    p.values = std::move(values);
    p.f32 = f32;
    out[name] = std::move(p);
  };
  // Rows [r0, r0 + n) of checkpoint tensor `name` with `cols` columns, appended.
  auto rows = [&](std::vector<float>& dst, const std::string& name, std::uint64_t cols,
                  std::uint64_t r0, std::uint64_t n) {
    for (std::uint64_t i = r0 * cols; i < (r0 + n) * cols; ++i) {
      dst.push_back(value(name, i));
    }
  };
  auto full = [&](const std::string& param, const std::string& tensor, std::uint64_t r,
                  std::uint64_t c, bool f32 = false) {
    std::vector<float> v;
    rows(v, tensor, c, 0, r);
    put(param, c == 1 ? std::vector<std::uint64_t>{r} : std::vector<std::uint64_t>{r, c},
        std::move(v), f32);
  };
  // Tensor-parallel groups (size, this rank's place in it): the attention's, the
  // embedding's and lm_head's, the dense layers' and the shared experts'.
  const std::uint64_t Ta = T / static_cast<std::uint64_t>(l.attn_dp);
  const std::uint64_t Ra = R % Ta;
  auto vocab = [&](const std::string& param, const std::string& tensor) {
    const bool head = param == "lm_head.weight";
    const std::uint64_t Tg = head ? (l.dp_lm_head ? Ta : T) : (l.attn_dp > 1 ? Ta : T);
    const std::uint64_t Rg = R % Tg;
    const std::uint64_t padded = (d.V + 63) / 64 * 64;
    const std::uint64_t per = padded / Tg;
    std::vector<float> v;
    for (std::uint64_t i = 0; i < per; ++i) {
      const std::uint64_t g = Rg * per + i;
      if (g < d.V) {
        rows(v, tensor, H, g, 1);
      } else {
        v.insert(v.end(), H, 0.0f);
      }
    }
    put(param, {per, H}, std::move(v));
  };
  // Rows [r0, r0 + n) as `rows`, with zeros for rows at or past `real`.
  auto padded_rows = [&](std::vector<float>& dst, const std::string& name, std::uint64_t c,
                         std::uint64_t real, std::uint64_t r0, std::uint64_t n) {
    for (std::uint64_t r = r0; r < r0 + n; ++r) {
      if (r < real) {
        rows(dst, name, c, r, 1);
      } else {
        dst.insert(dst.end(), c, 0.0f);
      }
    }
  };
  // Columns [c0, c0 + n) of a [r, real] tensor, zeros at or past `real`.
  auto padded_cols = [&](const std::string& tensor, std::uint64_t r, std::uint64_t real,
                         std::uint64_t c0, std::uint64_t n) {
    std::vector<float> v;
    for (std::uint64_t i = 0; i < r; ++i) {
      for (std::uint64_t j = c0; j < c0 + n; ++j) {
        v.push_back(j < real ? value(tensor, i * real + j) : 0.0f);
      }
    }
    return v;
  };
  // gate_up [2*n, H] = this rank's gate rows then up rows; down [H, n] = its columns
  // (of the padded width under pad).
  // ... over a group of Tg ranks (T, or 1: whole on every rank).
  auto mlp = [&](const std::string& p, const std::string& t, std::uint64_t inter,
                 std::uint64_t Tg) {
    const std::uint64_t Rg = R % Tg;
    const std::uint64_t n = padded_inter(inter, Tg, l.pad) / Tg;
    std::vector<float> gu;
    padded_rows(gu, t + "gate_proj.weight", H, inter, Rg * n, n);
    padded_rows(gu, t + "up_proj.weight", H, inter, Rg * n, n);
    put(p + "gate_up_proj.weight", {2 * n, H}, std::move(gu));
    put(p + "down_proj.weight", {H, n}, padded_cols(t + "down_proj.weight", H, inter, Rg * n, n));
  };

  auto attention = [&](const std::string& p, const std::string& t) {
    if (d.glm) {
      // Over the attention tp group (Glm4MoeAttention: parallel_group="attn_tp" in
      // SGLang 0.5.23; Ta = T without attention DP), as rank Ra of it.
      // Heads of this rank: q heads [Ra*hq, +hq); kv heads split when there are at
      // least Ta of them, else head Ra / (Ta / kv) replicated. Heads Ta does not
      // split are padded (kv to a multiple of tp, q to padded kv * group size) and
      // the padded heads are zeros.
      const std::uint64_t hd = d.head_dim;
      std::uint64_t heads = d.heads;
      std::uint64_t kv = d.kv_heads;
      if (l.pad && (heads % Ta != 0 || kv % Ta != 0)) {
        kv = (d.kv_heads + Ta - 1) / Ta * Ta;
        heads = kv * (d.heads / d.kv_heads);
      }
      const std::uint64_t hq = heads / Ta;
      const std::uint64_t kvl = kv >= Ta ? kv / Ta : 1;
      const std::uint64_t kv0 = kv >= Ta ? Ra * kvl : Ra / (Ta / kv);
      const std::uint64_t qkv_rows = (hq + 2 * kvl) * hd;
      // Rows of heads [h0, h0 + n) of a [real heads * hd, c] tensor, zeros past it.
      auto head_rows = [&](std::vector<float>& dst, const std::string& name, std::uint64_t c,
                           std::uint64_t h0, std::uint64_t n, std::uint64_t real) {
        for (std::uint64_t h = h0; h < h0 + n; ++h) {
          if (h < real) {
            rows(dst, name, c, h * hd, hd);
          } else {
            dst.insert(dst.end(), hd * c, 0.0f);
          }
        }
      };
      std::vector<float> w;
      head_rows(w, t + "q_proj.weight", H, Ra * hq, hq, d.heads);
      head_rows(w, t + "k_proj.weight", H, kv0, kvl, d.kv_heads);
      head_rows(w, t + "v_proj.weight", H, kv0, kvl, d.kv_heads);
      put(p + "qkv_proj.weight", {qkv_rows, H}, std::move(w));
      if (d.qkv_bias) {
        std::vector<float> b;
        head_rows(b, t + "q_proj.bias", 1, Ra * hq, hq, d.heads);
        head_rows(b, t + "k_proj.bias", 1, kv0, kvl, d.kv_heads);
        head_rows(b, t + "v_proj.bias", 1, kv0, kvl, d.kv_heads);
        put(p + "qkv_proj.bias", {qkv_rows}, std::move(b));
      }
      // o_proj: the rank's hq heads of input columns, zeros past the real ones.
      std::vector<float> o;
      for (std::uint64_t i = 0; i < H; ++i) {
        for (std::uint64_t j = 0; j < hq * hd; ++j) {
          const std::uint64_t col = Ra * hq * hd + j;
          o.push_back(col < d.heads * hd ? value(t + "o_proj.weight", i * d.heads * hd + col)
                                         : 0.0f);
        }
      }
      put(p + "o_proj.weight", {H, hq * hd}, std::move(o));
      if (d.qk_norm) {
        full(p + "q_norm.weight", t + "q_norm.weight", hd, 1);
        full(p + "k_norm.weight", t + "k_norm.weight", hd, 1);
      }
      return;
    }
    // Local heads: heads / tp, or with heads tp does not divide, the heads padded up
    // to a multiple of tp over tp; a global head g >= heads is padding (zeros).
    const std::uint64_t hl = (d.heads + Ta - 1) / Ta;
    // The rows of this rank's heads of a [heads * per, c] tensor, zeros past it.
    auto head_rows = [&](std::vector<float>& dst, const std::string& name, std::uint64_t c,
                         std::uint64_t per) {
      for (std::uint64_t h = 0; h < hl; ++h) {
        const std::uint64_t g = Ra * hl + h;
        if (g < d.heads) {
          rows(dst, name, c, g * per, per);
        } else {
          dst.insert(dst.end(), per * c, 0.0f);
        }
      }
    };
    const std::uint64_t qk = d.dn + d.dr;
    const std::uint64_t kv_a = d.kv_lora + d.dr;
    if (d.q_lora > 0) {
      std::vector<float> fused;
      rows(fused, t + "q_a_proj.weight", H, 0, d.q_lora);
      rows(fused, t + "kv_a_proj_with_mqa.weight", H, 0, kv_a);
      put(p + "fused_qkv_a_proj_with_mqa.weight", {d.q_lora + kv_a, H}, std::move(fused));
      full(p + "q_a_layernorm.weight", t + "q_a_layernorm.weight", d.q_lora, 1);
      std::vector<float> qb;
      head_rows(qb, t + "q_b_proj.weight", d.q_lora, qk);
      put(p + "q_b_proj.weight", {hl * qk, d.q_lora}, std::move(qb));
    } else {
      std::vector<float> q;
      head_rows(q, t + "q_proj.weight", H, qk);
      put(p + "q_proj.weight", {hl * qk, H}, std::move(q));
      full(p + "kv_a_proj_with_mqa.weight", t + "kv_a_proj_with_mqa.weight", kv_a, H);
    }
    full(p + "kv_a_layernorm.weight", t + "kv_a_layernorm.weight", d.kv_lora, 1);
    const std::uint64_t per_head = d.dn + d.dv;
    std::vector<float> kvb;
    head_rows(kvb, t + "kv_b_proj.weight", d.kv_lora, per_head);
    put(p + "kv_b_proj.weight", {hl * per_head, d.kv_lora}, std::move(kvb));
    std::vector<float> o;
    for (std::uint64_t i = 0; i < H; ++i) {
      for (std::uint64_t j = 0; j < hl * d.dv; ++j) {
        const std::uint64_t col = Ra * hl * d.dv + j;  // padding past heads * dv
        o.push_back(col < d.heads * d.dv ? value(t + "o_proj.weight", i * d.heads * d.dv + col)
                                         : 0.0f);
      }
    }
    put(p + "o_proj.weight", {H, hl * d.dv}, std::move(o));
    // The paper's split, per global head g = R*hl + h of kv_b_proj [heads*(dn+dv), r]:
    //   w_kc[h][i][c] = kv_b[g*(dn+dv) + i][c]        (W^UK, i < dn)
    //   w_vc[h][c][k] = kv_b[g*(dn+dv) + dn + k][c]   (W^UV, k < dv)
    // SGLang stores w_kc as [h][c][i] (strides (r*dn, 1, dn)) and w_vc as [h][k][c]
    // (strides (dv*r, 1, r)).
    const std::string kvb_name = t + "kv_b_proj.weight";
    std::vector<float> kc;
    for (std::uint64_t h = 0; h < hl; ++h) {
      for (std::uint64_t i = 0; i < d.dn; ++i) {
        for (std::uint64_t c = 0; c < d.kv_lora; ++c) {
          const std::uint64_t g = Ra * hl + h;
          kc.push_back(g < d.heads ? value(kvb_name, (g * per_head + i) * d.kv_lora + c) : 0.0f);
        }
      }
    }
    put(p + "w_kc", {hl, d.dn, d.kv_lora}, std::move(kc));
    out[p + "w_kc"].strides = {d.kv_lora * d.dn, 1, d.dn};
    std::vector<float> vc;
    for (std::uint64_t h = 0; h < hl; ++h) {
      for (std::uint64_t c = 0; c < d.kv_lora; ++c) {
        for (std::uint64_t k = 0; k < d.dv; ++k) {
          const std::uint64_t g = Ra * hl + h;
          vc.push_back(g < d.heads ? value(kvb_name, (g * per_head + d.dn + k) * d.kv_lora + c)
                                   : 0.0f);
        }
      }
    }
    put(p + "w_vc", {hl, d.kv_lora, d.dv}, std::move(vc));
    out[p + "w_vc"].strides = {d.dv * d.kv_lora, 1, d.kv_lora};
    if (d.index_heads != 0) {
      // DeepSeek-V3.2's indexer, whole on every rank (SGLang 0.5.23's Indexer.__init__,
      // layers/attention/dsa/dsa_indexer.py: ReplicatedLinears): wk and a BF16
      // weights_proj, or, with indexer_rope_interleave (use_dsa_indexer_fusion on
      // CUDA), instead of them one BF16 wk_weights_proj: wk's rows, then weights_proj's.
      const std::string pi = p + "indexer.";
      const std::string ti = t + "indexer.";
      full(pi + "wq_b.weight", ti + "wq_b.weight", d.index_heads * d.index_dim, d.q_lora);
      full(pi + "k_norm.weight", ti + "k_norm.weight", d.index_dim, 1, true);
      full(pi + "k_norm.bias", ti + "k_norm.bias", d.index_dim, 1, true);
      if (d.index_fused) {
        std::vector<float> fused;
        rows(fused, ti + "wk.weight", H, 0, d.index_dim);
        rows(fused, ti + "weights_proj.weight", H, 0, d.index_heads);
        put(pi + "wk_weights_proj.weight", {d.index_dim + d.index_heads, H}, std::move(fused));
        out[pi + "wk_weights_proj.weight"].bf16 = true;
      } else {
        full(pi + "wk.weight", ti + "wk.weight", d.index_dim, H);
        full(pi + "weights_proj.weight", ti + "weights_proj.weight", d.index_heads, H);
        out[pi + "weights_proj.weight"].bf16 = true;
      }
    }
  };

  auto moe = [&](const std::string& p, const std::string& t) {
    // SGLang 0.5.23: Glm4MoeGate.__init__ creates the weight in float32; DeepSeek's
    // MoEGate.__init__ does with config.router_fp32.
    full(p + "gate.weight", t + "gate.weight", d.E, H, d.glm || d.router_fp32);
    if (d.gate_bias) {
      full(p + "gate.e_score_correction_bias", t + "gate.e_score_correction_bias", d.E, 1, true);
    }
    const std::uint64_t moe_tp = T / static_cast<std::uint64_t>(l.ep);
    const std::uint64_t il = padded_inter(d.moe_I, T, l.pad) / moe_tp;
    const std::uint64_t mr = R % moe_tp;  // moe-tp rank
    std::vector<std::string> sources;     // checkpoint prefix per local slot
    for (std::uint64_t e : experts_of(d, l, rank)) {
      sources.push_back(t + "experts." + std::to_string(e) + ".");
    }
    if (l.fuse_shared) {
      sources.push_back(t + "shared_experts.");
    }
    std::vector<float> w13;
    std::vector<float> w2;
    for (const std::string& s : sources) {
      const char* first = l.switch_w13 ? "up_proj" : "gate_proj";
      const char* second = l.switch_w13 ? "gate_proj" : "up_proj";
      padded_rows(w13, s + first + ".weight", H, d.moe_I, mr * il, il);
      padded_rows(w13, s + second + ".weight", H, d.moe_I, mr * il, il);
      std::vector<float> down = padded_cols(s + "down_proj.weight", H, d.moe_I, mr * il, il);
      w2.insert(w2.end(), down.begin(), down.end());
    }
    const std::uint64_t slots = sources.size();
    put(p + "experts.w13_weight", {slots, 2 * il, H}, std::move(w13));
    put(p + "experts.w2_weight", {slots, H, il}, std::move(w2));
    if (!l.fuse_shared && d.n_shared > 0) {
      mlp(p + "shared_experts.", t + "shared_experts.", d.n_shared * d.moe_I, l.deepep ? 1 : T);
    }
  };

  auto layer = [&](const std::string& p, const std::string& t, bool sparse) {
    attention(p + "self_attn.", t + "self_attn.");
    if (sparse) {
      moe(p + "mlp.", t + "mlp.");
    } else {
      mlp(p + "mlp.", t + "mlp.", d.I, l.moe_dense_tp1 ? 1 : T);
    }
    full(p + "input_layernorm.weight", t + "input_layernorm.weight", H, 1);
    full(p + "post_attention_layernorm.weight", t + "post_attention_layernorm.weight", H, 1);
  };

  if (l.draft) {
    const std::string t = "model.layers." + std::to_string(d.L) + ".";
    full("model.enorm.weight", t + "enorm.weight", H, 1);
    full("model.hnorm.weight", t + "hnorm.weight", H, 1);
    full("model.shared_head.norm.weight", t + "shared_head.norm.weight", H, 1);
    full("model.eh_proj.weight", t + "eh_proj.weight", H, 2 * H);
    layer("model.decoder.", t, true);
    return out;
  }
  const auto [begin, end] = stage_layers(d, l);
  for (std::uint64_t i = begin; i < end; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    layer(p, p, is_moe(d, i));
  }
  const bool first = l.pp_rank == 0;
  const bool last = l.pp_rank == l.pp - 1;
  if (first) {
    vocab("model.embed_tokens.weight", "model.embed_tokens.weight");
  }
  if (last) {
    full("model.norm.weight", "model.norm.weight", H, 1);
    if (!d.tied) {
      vocab("lm_head.weight", "lm_head.weight");
    } else if (!first) {
      vocab("lm_head.weight", "model.embed_tokens.weight");
    }
  } else if (d.glm && !d.tied) {
    // SGLang 0.5.23's Glm4MoeForCausalLM builds its ParallelLMHead on every stage;
    // DeepSeek's is a PPMissingLayer off the last.
    vocab("lm_head.weight", "lm_head.weight");
  }
  return out;
}

inline bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// The drop reason ferry must give checkpoint tensor `name` when the local ranks are
// `ranks`, or "" when it must be placed.
inline std::string expected_reason(const nlohmann::json& config, const Layout& l,
                                   const std::vector<int>& ranks, const std::string& name) {
  const Dims d = dims_of(config);
  const bool first = l.pp_rank == 0;
  const bool last = l.pp_rank == l.pp - 1;
  std::uint64_t layer = 0;
  std::string rest;
  if (starts_with(name, "model.layers.")) {
    const std::size_t dot = name.find('.', 13);
    layer = std::stoull(name.substr(13, dot - 13));
    rest = name.substr(dot + 1);
  } else if (l.draft) {
    return "draft_target";
  } else if (name == "model.embed_tokens.weight") {
    return first || (last && d.tied) ? "" : "first_stage_only";
  } else if (name == "model.norm.weight" || name == "lm_head.weight") {
    if (!last && !(d.glm && !d.tied && name == "lm_head.weight")) {
      return "last_stage_only";
    }
    return name == "lm_head.weight" && d.tied ? "tied_lm_head" : "";
  } else {
    return "unknown";
  }
  if (l.draft) {
    if (layer < d.L) {
      return "draft_target";
    }
    if (layer > d.L) {
      return "mtp_layer";
    }
    if (starts_with(rest, "embed_tokens") || starts_with(rest, "shared_head.head")) {
      return "draft_shared";
    }
  } else {
    if (layer >= d.L) {
      return "mtp_layer";
    }
    const auto [begin, end] = stage_layers(d, l);
    if (layer < begin || layer >= end) {
      return "pp_stage";
    }
  }
  if (starts_with(rest, "mlp.experts.")) {
    const std::uint64_t e = std::stoull(rest.substr(12, rest.find('.', 12) - 12));
    const auto T = static_cast<std::uint64_t>(l.tp);
    const std::uint64_t moe_tp = T / static_cast<std::uint64_t>(l.ep);
    const std::uint64_t il = padded_inter(d.moe_I, T, l.pad) / moe_tp;
    bool owned = false;
    for (int r : ranks) {
      for (std::uint64_t mine : experts_of(d, l, r)) {
        if (mine == e) {
          owned = true;
          // A rank whose moe-tp share lies past the real width holds only zeros.
          if (static_cast<std::uint64_t>(r) % moe_tp * il < d.moe_I) {
            return "";
          }
        }
      }
    }
    return owned ? "no_local_slice" : "remote_expert";
  }
  // A tensor-parallel MLP (a dense layer's, or the unfused shared experts') whose
  // every local share lies past the real width under pad holds only zeros.
  const bool shared = starts_with(rest, "mlp.shared_experts.");
  if (shared || starts_with(rest, "mlp.gate_proj") || starts_with(rest, "mlp.up_proj") ||
      starts_with(rest, "mlp.down_proj")) {
    const auto T = static_cast<std::uint64_t>((shared ? l.deepep : l.moe_dense_tp1) ? 1 : l.tp);
    const std::uint64_t inter = shared ? d.n_shared * d.moe_I : d.I;
    const std::uint64_t n = padded_inter(inter, T, l.pad) / T;
    for (int r : ranks) {
      if (static_cast<std::uint64_t>(r) % T * n < inter) {
        return "";
      }
    }
    return "no_local_slice";
  }
  return "";
}

}  // namespace ferry::testing::ds
