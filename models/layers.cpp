#include "models/layers.hpp"

#include <array>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "models/placement.hpp"

namespace ferry::models {

using Blocks = std::vector<Block>;

std::string layer_prefix(std::uint64_t layer) {
  return "model.layers." + std::to_string(layer) + ".";
}

std::string uneven_note(const std::string& what, const std::string& unit, std::uint64_t padded,
                        std::uint64_t real, int parts, const std::string& padded_text,
                        const std::string& ranks) {
  const auto n = static_cast<std::uint64_t>(parts);
  const std::uint64_t per = padded / n;
  const std::uint64_t first_empty = per == 0 ? 0 : (real + per - 1) / per;
  std::string out = "uneven tensor parallelism: " + std::to_string(parts) + " " + ranks +
                    " do not split " + what + "; padded to " + padded_text + " with zero " + unit +
                    " (SGLang's unaligned-TP padding)";
  if (first_empty + 1 == n) {
    out += "; of the " + ranks + ", " + std::to_string(first_empty) + " holds only zero " + unit;
  } else if (first_empty < n) {
    out += "; of the " + ranks + ", " + std::to_string(first_empty) + ".." + std::to_string(n - 1) +
           " hold only zero " + unit;
  }
  return out;
}

GqaAttention gqa_attention(const GqaDecoderDims& d, bool qkv_bias, bool o_bias,
                           Unaligned unaligned) {
  return {.hidden = d.hidden,
          .heads = d.heads,
          .kv_heads = d.kv_heads,
          .head_dim = d.head_dim,
          .qkv_bias = qkv_bias,
          .o_bias = o_bias,
          .unaligned = unaligned};
}

void add_gqa_attention(TableModel& m, const std::string& param_prefix,
                       const std::string& tensor_prefix, const GqaAttention& a, int tp) {
  const QkvShape qkv{a.heads, a.kv_heads, a.head_dim};
  const Unaligned u = a.unaligned;
  const QkvShape padded = padded_qkv(qkv, tp, u);
  if (padded != qkv) {
    m.add_note(uneven_note("num_attention_heads / num_key_value_heads " +
                               std::to_string(qkv.q_heads) + " / " + std::to_string(qkv.kv_heads),
                           "heads", padded.q_heads, qkv.q_heads, tp,
                           std::to_string(padded.q_heads) + " / " + std::to_string(padded.kv_heads),
                           a.ranks));
  }
  const std::uint64_t q_rows = qkv_slot_rows(qkv, QkvSlot::kQ);
  const std::uint64_t kv_rows = qkv_slot_rows(qkv, QkvSlot::kK);
  const std::string w = param_prefix + "qkv_proj.weight";
  const std::string b = param_prefix + "qkv_proj.bias";
  m.add_param(w, Shape{qkv_local_rows(qkv, tp, u), a.hidden});
  if (a.qkv_bias) {
    m.add_param(b, Shape{qkv_local_rows(qkv, tp, u)});
  }
  static constexpr std::array<QkvSlot, 3> kSlots{QkvSlot::kQ, QkvSlot::kK, QkvSlot::kV};
  if (a.sources.size() != kSlots.size()) {
    throw Error(Stage::kPlacement, "", w, "internal: qkv_proj needs three sources");
  }
  for (std::size_t i = 0; i < kSlots.size(); ++i) {
    const QkvSlot slot = kSlots[i];
    const std::string src = tensor_prefix + a.sources[i];
    const std::uint64_t rows = slot == QkvSlot::kQ ? q_rows : kv_rows;
    auto rule = [qkv, slot, tp, u](int rank) {
      return Blocks{qkv_slot(qkv, slot, rank % tp, tp, u).copy};
    };
    m.add_target(src + ".weight", w, Shape{rows, a.hidden}, rule);
    if (a.qkv_bias) {
      m.add_target(src + ".bias", b, Shape{rows}, rule);
    }
  }
  // A checkpoint with qkv_proj already fused: q rows, then k rows, then v rows.
  auto fused_rule = [qkv, q_rows, kv_rows, tp, u](int rank) {
    Blocks out;
    const std::array<std::uint64_t, 3> base{0, q_rows, q_rows + kv_rows};
    for (std::size_t i = 0; i < kSlots.size(); ++i) {
      Block blk = qkv_slot(qkv, kSlots[i], rank % tp, tp, u).copy;
      blk.src_start += base[i];
      out.push_back(blk);
    }
    return out;
  };
  const std::uint64_t fused_rows = q_rows + 2 * kv_rows;
  m.add_target(tensor_prefix + "qkv_proj.weight", w, Shape{fused_rows, a.hidden}, fused_rule);
  if (a.qkv_bias) {
    m.add_target(tensor_prefix + "qkv_proj.bias", b, Shape{fused_rows}, fused_rule);
  }
  // Uneven tp: the padded heads of every slot are zeros (no tensor writes them).
  if (padded != qkv) {
    auto zeros = [qkv, tp, u](int rank) {
      Blocks out;
      for (QkvSlot slot : {QkvSlot::kQ, QkvSlot::kK, QkvSlot::kV}) {
        out.push_back(qkv_slot(qkv, slot, rank % tp, tp, u).zero);
      }
      return out;
    };
    m.add_fill(w, zeros);
    if (a.qkv_bias) {
      m.add_fill(b, zeros);
    }
  }
  // o_proj's input dim follows the q heads, padded columns included.
  const std::uint64_t q_padded = qkv_slot_rows(padded, QkvSlot::kQ);
  const std::string o_w = param_prefix + "o_proj.weight";
  m.add_param(o_w, Shape{a.hidden, q_padded / static_cast<std::uint64_t>(tp)});
  add_row_parallel(m, tensor_prefix + "o_proj.weight", o_w, a.hidden, q_rows, q_padded, tp,
                   "o_proj input (num_attention_heads * head_dim)");
  if (a.o_bias) {
    add_replicated(m, param_prefix + "o_proj.bias", tensor_prefix + "o_proj.bias", Shape{a.hidden});
  }
}

void add_row_parallel(TableModel& m, const std::string& tensor, const std::string& param,
                      std::uint64_t rows, std::uint64_t input, std::uint64_t padded_input, int tp,
                      const std::string& what) {
  m.add_target(tensor, param, Shape{rows, input}, [=](int rank) {
    return Blocks{padded_shard(1, input, padded_input, rank % tp, tp, what).copy};
  });
  if (padded_input != input) {
    m.add_fill(param, [=](int rank) {
      return Blocks{padded_shard(1, input, padded_input, rank % tp, tp, what).zero};
    });
  }
}

void add_gated_mlp(TableModel& m, const std::string& param_prefix, const std::string& tensor_prefix,
                   std::uint64_t hidden, std::uint64_t intermediate, int tp, Unaligned policy,
                   const char* what, const std::vector<std::string>& sources) {
  // Uneven tp, under kPad, pads the intermediate size (padded_intermediate): each
  // rank's gate and up shares end in zero rows, its down_proj share in zero columns.
  const std::uint64_t padded = padded_intermediate(intermediate, tp, policy, what);
  const std::uint64_t local = even_shard(padded, 0, tp, what).length;
  if (padded != intermediate) {
    m.add_note(uneven_note(std::string(what) + " " + std::to_string(intermediate), "rows", padded,
                           intermediate, tp, std::to_string(padded), "tp ranks"));
  }
  const std::string gu_w = param_prefix + "gate_up_proj.weight";
  m.add_param(gu_w, Shape{2 * local, hidden});
  const std::string label = what;
  // Slot 0 (gate) or 1 (up) of the rank: its share, placed after the earlier slot.
  auto share = [intermediate, padded, local, tp, label](std::size_t slot, int rank) {
    PaddedShard s = padded_shard(0, intermediate, padded, rank % tp, tp, label);
    s.copy.dst_start += slot * local;
    s.zero.dst_start += slot * local;
    return s;
  };
  if (sources.size() != 2) {
    throw Error(Stage::kPlacement, "", gu_w, "internal: gate_up_proj needs two sources");
  }
  for (std::size_t slot = 0; slot < sources.size(); ++slot) {
    const std::string src = tensor_prefix + sources[slot];
    auto rule = [share, slot](int rank) { return Blocks{share(slot, rank).copy}; };
    m.add_target(src + ".weight", gu_w, Shape{intermediate, hidden}, rule);
  }
  // A checkpoint with gate_up_proj already fused: the gate rows, then the up rows.
  m.add_target(tensor_prefix + "gate_up_proj.weight", gu_w, Shape{2 * intermediate, hidden},
               [share, intermediate](int rank) {
                 Block up = share(1, rank).copy;
                 up.src_start += intermediate;
                 return Blocks{share(0, rank).copy, up};
               });
  if (padded != intermediate) {
    m.add_fill(gu_w, [share](int rank) {
      return Blocks{share(0, rank).zero, share(1, rank).zero};
    });
  }
  const std::string down_w = param_prefix + "down_proj.weight";
  m.add_param(down_w, Shape{hidden, local});
  add_row_parallel(m, tensor_prefix + "down_proj.weight", down_w, hidden, intermediate, padded, tp,
                   label);
}

void add_rope_cache_drops(TableModel& m) {
  m.add_drop_pattern("rotary_emb.inv_freq", "inv_freq");
  m.add_drop_pattern("rotary_emb.cos_cached", "rope_cache");
  m.add_drop_pattern("rotary_emb.sin_cached", "rope_cache");
}

void add_replicated(TableModel& m, const std::string& param, const std::string& tensor,
                    const Shape& shape, std::optional<DType> dtype) {
  m.add_param(param, shape, dtype);
  const std::uint64_t rows = shape.empty() ? 1 : shape[0];
  m.add_target(tensor, param, shape, [rows](int) { return Blocks{replicated(rows)}; });
}

}  // namespace ferry::models
