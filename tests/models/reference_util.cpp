#include "models/reference_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <stdexcept>

#include "gpu/device.hpp"
#include "gpu/host_device.hpp"
#include "models/host_hook_context.hpp"
#include "synth/synth.hpp"

namespace ferry::testing {
namespace {

std::uint64_t get_u64(const nlohmann::json& c, const char* key) {
  return c.at(key).get<std::uint64_t>();
}

bool get_bool(const nlohmann::json& c, const char* key) {
  return c.contains(key) && !c.at(key).is_null() && c.at(key).get<bool>();
}

const HostTensor& at(const TensorMap& m, const std::string& name) {
  auto it = m.find(name);
  if (it == m.end()) {
    throw std::runtime_error("reference: checkpoint has no " + name);
  }
  return it->second;
}

// Element (row, col) of a 2-D tensor, or element `row` of a 1-D one (col 0).
float elem(const HostTensor& t, std::uint64_t row, std::uint64_t col) {
  std::uint64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
  return t.values.at(row * cols + col);
}

}  // namespace

RefConfig ref_config(const nlohmann::json& config) {
  RefConfig c;
  c.hidden = get_u64(config, "hidden_size");
  c.heads = get_u64(config, "num_attention_heads");
  c.kv_heads =
      config.contains("num_key_value_heads") ? get_u64(config, "num_key_value_heads") : c.heads;
  c.head_dim = config.contains("head_dim") && !config["head_dim"].is_null()
                   ? get_u64(config, "head_dim")
                   : c.hidden / c.heads;
  c.inter = get_u64(config, "intermediate_size");
  c.layers = get_u64(config, "num_hidden_layers");
  c.vocab = get_u64(config, "vocab_size");
  c.tied = get_bool(config, "tie_word_embeddings");
  std::string arch = config.at("architectures").at(0).get<std::string>();
  if (arch == "Qwen2ForCausalLM") {
    c.qkv_bias = true;
  } else if (arch == "Qwen3ForCausalLM") {
    c.qk_norm = true;
    c.qkv_bias = get_bool(config, "attention_bias");
    c.o_bias = c.qkv_bias;
  } else if (arch.rfind("Gemma", 0) == 0) {
    // Gemma has no lm_head of its own: the embedding is the output projection.
    c.tied = true;
    if (arch == "GemmaForCausalLM") {
      c.norm_plus_one = true;
    } else {
      c.qkv_bias = get_bool(config, "attention_bias");
      c.o_bias = c.qkv_bias;
      c.extra_norms = {"pre_feedforward_layernorm", "post_feedforward_layernorm"};
    }
    if (arch == "Gemma3ForCausalLM") {
      c.qk_norm = true;
      c.replicated_embedding = true;
    }
  } else {
    // SGLang's LlamaDecoderLayer: attention_bias or bias; its MLP has no bias.
    c.qkv_bias = get_bool(config, "attention_bias") || get_bool(config, "bias");
    c.o_bias = c.qkv_bias;
  }
  return c;
}

SynthCase tiny_case(const std::string& family, DType dtype, bool tied, bool llama_biases) {
  const std::string synth_family = family == "mistral" ? "llama" : family;
  SynthCase out;
  out.dtype = dtype;
  out.config = synth::synth_config(synth_family, "tiny", dtype, tied);
  for (const synth::SynthTensor& t : synth::synth_tensor_list(synth_family, "tiny", dtype, tied)) {
    out.names.push_back(t.name);
    out.shapes[t.name] = t.shape;
  }
  if (family == "mistral") {
    out.config["architectures"] = {"MistralForCausalLM"};
    out.config["model_type"] = "mistral";
    out.config.erase("head_dim");
    out.config.erase("attention_bias");
    out.config.erase("mlp_bias");
  }
  if (llama_biases) {
    out.config["attention_bias"] = true;
    out.config["mlp_bias"] = true;
    const RefConfig c = ref_config(out.config);
    for (std::uint64_t l = 0; l < c.layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      const std::map<std::string, std::uint64_t> biases{
          {"self_attn.q_proj.bias", c.heads * c.head_dim},
          {"self_attn.k_proj.bias", c.kv_heads * c.head_dim},
          {"self_attn.v_proj.bias", c.kv_heads * c.head_dim},
          {"self_attn.o_proj.bias", c.hidden},
          {"mlp.gate_proj.bias", c.inter},
          {"mlp.up_proj.bias", c.inter},
          {"mlp.down_proj.bias", c.hidden},
      };
      for (const auto& [suffix, n] : biases) {
        out.names.push_back(p + suffix);
        out.shapes[p + suffix] = {n};
      }
    }
  }
  return out;
}

io::TensorInfo tensor_info(const std::string& name, DType dtype,
                           const std::vector<std::uint64_t>& shape) {
  io::TensorInfo t;
  t.name = name;
  t.dtype = dtype;
  t.shape = shape;
  t.file = "model-00001-of-00001.safetensors";
  t.nbytes = dtype_size(dtype);
  for (std::uint64_t d : shape) {
    t.nbytes *= d;
  }
  return t;
}

TensorMap make_checkpoint(const std::map<std::string, std::vector<std::uint64_t>>& shapes,
                          std::uint64_t seed) {
  TensorMap out;
  for (const auto& [name, shape] : shapes) {
    HostTensor t;
    t.shape = shape;
    std::uint64_t n = 1;
    for (std::uint64_t d : shape) {
      n *= d;
    }
    t.values.resize(n);
    for (std::uint64_t i = 0; i < n; ++i) {
      t.values[i] = synth::synth_value(seed, name, i);
    }
    out.emplace(name, std::move(t));
  }
  return out;
}

TensorMap reference_params(const RefConfig& c, const TensorMap& ck, int rank_int, int tp_int) {
  const auto rank = static_cast<std::uint64_t>(rank_int);
  const auto tp = static_cast<std::uint64_t>(tp_int);
  TensorMap out;
  const std::uint64_t H = c.hidden;
  const std::uint64_t hd = c.head_dim;

  // Vocabulary: padded to a multiple of 64, rank r of a group of g holds padded rows
  // [r*per, (r+1)*per); rows past the real vocabulary are zero.
  auto vocab_param = [&](const std::string& name, std::uint64_t group) {
    const std::uint64_t g = group != 0 ? group : tp;
    const std::uint64_t padded = c.replicated_embedding ? c.vocab : (c.vocab + 63) / 64 * 64;
    const std::uint64_t per = c.replicated_embedding ? c.vocab : padded / g;
    const std::uint64_t first = c.replicated_embedding ? 0 : (rank % g) * per;
    const HostTensor& full = at(ck, name);
    HostTensor t;
    t.shape = {per, H};
    for (std::uint64_t i = 0; i < per; ++i) {
      const std::uint64_t row = first + i;
      for (std::uint64_t j = 0; j < H; ++j) {
        t.values.push_back(row < c.vocab ? elem(full, row, j) : 0.0f);
      }
    }
    out[name] = std::move(t);
  };
  vocab_param("model.embed_tokens.weight", c.embed_group);
  if (!c.tied) {
    vocab_param("lm_head.weight", c.head_group);
  }
  auto copy_full = [&](const std::string& name) { out[name] = at(ck, name); };
  copy_full("model.norm.weight");

  // Uneven tensor parallelism, with model.unaligned_tp=pad (c.pad): SGLang's CPU
  // rule (adjust_config_with_unaligned_cpu_tp, python/sglang/srt/configs/
  // update_config.py (SGLang 0.5.23)): when q or kv heads are not a multiple of tp,
  // kv heads are padded to one and q heads to padded kv * (heads / kv); an
  // intermediate size not a multiple of tp * 32 is padded to one. Heads, rows and
  // columns past the real ones are zeros. Without pad, nothing is padded (the
  // layouts the GPU accepts).
  // The attention's group (ta ranks, this one ra of them).
  const std::uint64_t ta = c.attn_group != 0 ? c.attn_group : tp;
  const std::uint64_t ra = rank % ta;
  std::uint64_t heads = c.heads;
  std::uint64_t kv_heads = c.kv_heads;
  std::uint64_t inter = c.inter;
  if (c.pad) {
    if (heads % ta != 0 || kv_heads % ta != 0) {
      kv_heads = (c.kv_heads + ta - 1) / ta * ta;
      heads = kv_heads * (c.heads / c.kv_heads);
    }
    if (inter % (tp * 32) != 0) {
      inter = (c.inter + tp * 32 - 1) / (tp * 32) * (tp * 32);
    }
  }

  // Heads of this rank: q heads [ra*hq, (ra+1)*hq); kv heads split when there are
  // at least ta of them, else rank ra holds kv head ra / (ta / kv).
  const std::uint64_t hq = heads / ta;
  std::vector<std::uint64_t> kv_list;
  if (kv_heads >= ta) {
    for (std::uint64_t h = ra * (kv_heads / ta); h < (ra + 1) * (kv_heads / ta); ++h) {
      kv_list.push_back(h);
    }
  } else {
    kv_list.push_back(ra / (ta / kv_heads));
  }
  const std::uint64_t il = inter / tp;

  // Row `row` range [begin, begin + rows) of a 2-D or 1-D tensor, as its own tensor.
  auto rows_of = [](const HostTensor& t, std::uint64_t begin, std::uint64_t rows) {
    const std::uint64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
    HostTensor part;
    part.shape = t.shape;
    part.shape[0] = rows;
    part.values.assign(t.values.begin() + static_cast<std::ptrdiff_t>(begin * cols),
                       t.values.begin() + static_cast<std::ptrdiff_t>((begin + rows) * cols));
    return part;
  };
  // A checkpoint tensor, or its rows of the fused tensor a Phi-3 checkpoint stores.
  auto source = [&](const std::string& p, const std::string& name) -> HostTensor {
    if (ck.count(p + name) != 0) {
      return at(ck, p + name);
    }
    const std::uint64_t q = c.heads * hd;
    const std::uint64_t kv = c.kv_heads * hd;
    const std::string suffix = name.substr(name.rfind('.'));
    if (name.starts_with("self_attn.q_proj")) {
      return rows_of(at(ck, p + "self_attn.qkv_proj" + suffix), 0, q);
    }
    if (name.starts_with("self_attn.k_proj")) {
      return rows_of(at(ck, p + "self_attn.qkv_proj" + suffix), q, kv);
    }
    if (name.starts_with("self_attn.v_proj")) {
      return rows_of(at(ck, p + "self_attn.qkv_proj" + suffix), q + kv, kv);
    }
    if (name.starts_with("mlp.gate_proj")) {
      return rows_of(at(ck, p + "mlp.gate_up_proj.weight"), 0, c.inter);
    }
    if (name.starts_with("mlp.up_proj")) {
      return rows_of(at(ck, p + "mlp.gate_up_proj.weight"), c.inter, c.inter);
    }
    return at(ck, p + name);  // throws, naming it
  };

  for (std::uint64_t l = 0; l < c.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
      copy_full(p + n);
    }
    for (const std::string& n : c.extra_norms) {
      copy_full(p + n + ".weight");
    }
    if (c.qk_norm) {
      copy_full(p + "self_attn.q_norm.weight");
      copy_full(p + "self_attn.k_norm.weight");
    }
    // qkv_proj: this rank's q heads, then its k heads, then its v heads; each head is
    // head_dim consecutive rows of the checkpoint tensor.
    for (bool bias : {false, true}) {
      if (bias && !c.qkv_bias) {
        continue;
      }
      const std::string suffix = bias ? ".bias" : ".weight";
      const std::uint64_t cols = bias ? 1 : H;
      HostTensor t;
      // A head past the checkpoint's (padding) is zeros.
      auto append_head = [&](const std::string& src, std::uint64_t head) {
        const HostTensor full = source(p, "self_attn." + src + suffix);
        const std::uint64_t real = src == "q_proj" ? c.heads : c.kv_heads;
        for (std::uint64_t d = 0; d < hd; ++d) {
          for (std::uint64_t j = 0; j < cols; ++j) {
            t.values.push_back(head < real ? elem(full, head * hd + d, j) : 0.0f);
          }
        }
      };
      for (std::uint64_t h = 0; h < hq; ++h) {
        append_head("q_proj", ra * hq + h);
      }
      for (std::uint64_t h : kv_list) {
        append_head("k_proj", h);
      }
      for (std::uint64_t h : kv_list) {
        append_head("v_proj", h);
      }
      std::uint64_t rows = (hq + 2 * kv_list.size()) * hd;
      t.shape = bias ? std::vector<std::uint64_t>{rows} : std::vector<std::uint64_t>{rows, H};
      out[p + "self_attn.qkv_proj" + suffix] = std::move(t);
    }
    // Row-parallel over a group of g ranks, this one r of them: columns [r*k, (r+1)*k)
    // of every row of the padded input (`in_padded`); columns at or past the real
    // input `in_real` are zeros.
    auto column_slice = [&](const std::string& name, std::uint64_t in_padded,
                            std::uint64_t in_real, std::uint64_t g, std::uint64_t r) {
      const HostTensor& full = at(ck, name);
      const std::uint64_t k = in_padded / g;
      HostTensor t;
      t.shape = {H, k};
      for (std::uint64_t i = 0; i < H; ++i) {
        for (std::uint64_t j = 0; j < k; ++j) {
          const std::uint64_t col = r * k + j;
          t.values.push_back(col < in_real ? elem(full, i, col) : 0.0f);
        }
      }
      out[name] = std::move(t);
    };
    column_slice(p + "self_attn.o_proj.weight", heads * hd, c.heads * hd, ta, ra);
    if (c.o_bias) {
      copy_full(p + "self_attn.o_proj.bias");
    }
    // gate_up_proj: this rank's gate rows, then its up rows (no biases).
    HostTensor t;
    for (const char* src : {"gate_proj", "up_proj"}) {
      const HostTensor full = source(p, std::string("mlp.") + src + ".weight");
      for (std::uint64_t i = 0; i < il; ++i) {
        for (std::uint64_t j = 0; j < H; ++j) {
          const std::uint64_t row = rank * il + i;
          t.values.push_back(row < c.inter ? elem(full, row, j) : 0.0f);
        }
      }
    }
    t.shape = {2 * il, H};
    out[p + "mlp.gate_up_proj.weight"] = std::move(t);
    column_slice(p + "mlp.down_proj.weight", inter, c.inter, tp, rank);
  }
  return out;
}

ParamBuffers make_buffers(const models::Model& model) {
  ParamBuffers b;
  for (const models::RankShell& shell : model.shells()) {
    auto& bytes = b.bytes.emplace_back();
    auto& writes = b.writes.emplace_back();
    for (const models::ParamSpec& p : shell.params) {
      // 0xFF bytes decode as NaN in every float type: an unwritten element never
      // compares equal to the reference.
      bytes.emplace_back(p.nbytes, std::byte{0xFF});
      writes.emplace_back(p.nbytes, 0);
    }
  }
  return b;
}

void apply_piece(const models::Piece& piece, std::span<const std::byte> window,
                 std::uint64_t window_begin, ParamBuffers& buffers) {
  auto& dst = buffers.bytes.at(piece.local_rank).at(piece.param);
  auto& writes = buffers.writes.at(piece.local_rank).at(piece.param);
  const std::uint64_t ses = dtype_size(piece.src_dtype);
  const std::uint64_t des = dtype_size(piece.dst_dtype);
  for (std::uint64_t r = 0; r < piece.rows; ++r) {
    for (std::uint64_t e = 0; e < piece.width_elems; ++e) {
      const std::uint64_t d = piece.dst_offset + r * piece.dst_pitch + e * des;
      if (d + des > dst.size()) {
        throw std::runtime_error("piece writes past its param");
      }
      float v = 0.0f;
      if (piece.kind == models::Piece::Kind::kCopy) {
        const std::uint64_t s = piece.src_offset + r * piece.src_pitch + e * ses;
        if (s < window_begin || s + ses > window_begin + window.size()) {
          throw std::runtime_error("piece reads byte " + std::to_string(s) +
                                   " outside the read range");
        }
        v = decode_one(window.data() + (s - window_begin), piece.src_dtype);
      }
      encode_one(v, piece.dst_dtype, dst.data() + d);
      for (std::uint64_t k = 0; k < des; ++k) {
        ++writes[d + k];
      }
    }
  }
}

// Runs the model's hooks of every local rank on a host device (poisoned memory),
// over the params' bytes in `buffers`: hook outputs are marked written once (a piece
// that wrote one fails the test), rewritten params get the hook's bytes.
void run_hooks(const models::Model& model, ParamBuffers& buffers) {
  gpu::HostDeviceOptions options;
  options.poison_allocations = true;
  auto device = gpu::make_host_device(0, options);
  auto stream = device->create_stream();
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    const auto& shell = model.shells()[r];
    std::vector<gpu::DeviceAllocation> storage;
    std::vector<std::byte*> ptrs;
    for (std::size_t k = 0; k < shell.params.size(); ++k) {
      storage.push_back(device->allocate(shell.params[k].nbytes));
      ptrs.push_back(storage.back().data());
      stream->copy_h2d(ptrs.back(), buffers.bytes[r][k].data(), shell.params[k].nbytes);
    }
    stream->synchronize();
    std::set<std::size_t> outputs;
    std::set<std::size_t> rewritten;
    for (const models::PostLoadHook& h : model.hooks()) {
      if (h.local_rank != r) {
        continue;
      }
      HostHookContext ctx(*stream, ptrs, h, device.get());
      h.run(ctx);
      stream->synchronize();
      outputs.insert(h.outputs.begin(), h.outputs.end());
      rewritten.insert(h.rewrites.begin(), h.rewrites.end());
    }
    for (std::size_t k : rewritten) {
      stream->copy_d2h(buffers.bytes[r][k].data(), ptrs[k], shell.params[k].nbytes);
    }
    for (std::size_t k : outputs) {
      for (std::uint8_t w : buffers.writes[r][k]) {
        ASSERT_EQ(w, 0) << shell.params[k].name << " is a hook output but a piece wrote it";
      }
      stream->copy_d2h(buffers.bytes[r][k].data(), ptrs[k], shell.params[k].nbytes);
      std::fill(buffers.writes[r][k].begin(), buffers.writes[r][k].end(), 1);
    }
    stream->synchronize();
  }
}

}  // namespace ferry::testing
