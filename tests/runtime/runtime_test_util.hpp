// Helpers for the end-to-end load tests: synthetic checkpoints, an independent
// naive reference of what each tensor-parallel rank must hold (Megatron index
// arithmetic written out here, never models/ placement code), element-by-element
// comparison, checkpoint surgery (rewrite a shard, update the index) and a staging
// allocator that counts what it handed out.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_writer.hpp"
#include "io/staging_pool.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/load_config.hpp"
#include "synth/synth.hpp"
#include "testing/dtype_codec.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::testing {

// ---- checkpoints -------------------------------------------------------------

struct Checkpoint {
  std::string dir;
  std::string family;
  std::uint64_t seed = 1;
  bool tied = false;
  nlohmann::json config;
  std::map<std::string, std::vector<std::uint64_t>> shapes;  // every checkpoint tensor

  // Element i of tensor `name` as synthesized.
  float value(const std::string& name, std::uint64_t i) const {
    return synth::synth_value(seed, name, i);
  }
  std::vector<float> values(const std::string& name) const {
    std::uint64_t n = 1;
    for (std::uint64_t d : shapes.at(name)) {
      n *= d;
    }
    std::vector<float> out(n);
    for (std::uint64_t i = 0; i < n; ++i) {
      out[i] = value(name, i);
    }
    return out;
  }
  std::uint64_t file_bytes() const {
    std::uint64_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.path().extension() == ".safetensors") {
        n += e.file_size();
      }
    }
    return n;
  }
  // Bytes of every tensor of every shard, from their headers.
  std::uint64_t tensor_bytes() const {
    std::uint64_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.path().extension() == ".safetensors") {
        for (const io::TensorInfo& t :
             io::read_safetensors_header(e.path().string(), e.path().string()).tensors) {
          n += t.nbytes;
        }
      }
    }
    return n;
  }
};

// A tiny DeepSeek-V3 with FP8 128 x 128 blocks, widened so that every fused slot
// starts on a 128-row block (q_lora_rank, kv_lora_rank and the experts' width 128),
// written under `dir`; returns the checkpoint folder.
inline std::string synth_deepseek_v3_block128(TempDir& dir) {
  nlohmann::json config = synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false);
  config["q_lora_rank"] = 128;
  config["kv_lora_rank"] = 128;
  config["moe_intermediate_size"] = 128;
  const std::string path = dir.file("config.json");
  std::ofstream(path) << config.dump();
  synth::SynthOptions o;
  o.from_config = path;
  o.quant = synth::SynthQuant::kFp8Block;
  o.quant_block = 128;
  o.out = dir.file("ck");
  o.fsync = false;
  synth::synthesize(o);
  return o.out;
}

inline Checkpoint synth_checkpoint(const std::string& dir, const std::string& family,
                                   bool tied = false, std::uint64_t seed = 1,
                                   std::uint64_t shard_bytes = 0) {
  synth::SynthOptions o;
  o.family = family;
  o.preset = "tiny";
  o.out = dir;
  o.seed = seed;
  o.tie_embeddings = tied;
  o.fsync = false;
  o.shard_bytes = shard_bytes;
  synth::synthesize(o);
  Checkpoint c;
  c.dir = dir;
  c.family = family;
  c.seed = seed;
  c.tied = tied;
  std::ifstream in(dir + "/config.json");
  c.config = nlohmann::json::parse(in);
  for (const synth::SynthTensor& t : synth::synth_tensor_list(family, "tiny", DType::kBF16, tied)) {
    c.shapes[t.name] = t.shape;
  }
  return c;
}

// ---- the reference -------------------------------------------------------------

struct RefTensor {
  std::vector<std::uint64_t> shape;
  std::vector<float> values;  // row-major; padding is 0
};

// Every param tp rank `rank` of `tp` must hold, by SGLang name, computed with
// plain index arithmetic from the checkpoint's values.
// `pad`: model.unaligned_tp=pad (SGLang's CPU padding); without it nothing is padded.
inline std::map<std::string, RefTensor> reference_rank(const Checkpoint& ck, int tp, int rank,
                                                       bool pad = false) {
  const nlohmann::json& c = ck.config;
  const std::uint64_t H = c.at("hidden_size");
  const std::uint64_t heads = c.at("num_attention_heads");
  const std::uint64_t kv = c.value("num_key_value_heads", heads);
  const std::uint64_t hd =
      c.contains("head_dim") ? c.at("head_dim").get<std::uint64_t>() : H / heads;
  const std::uint64_t I = c.at("intermediate_size");
  const std::uint64_t L = c.at("num_hidden_layers");
  const std::uint64_t V = c.at("vocab_size");
  const bool bias = ck.family == "qwen2";
  const std::uint64_t T = static_cast<std::uint64_t>(tp);
  const std::uint64_t R = static_cast<std::uint64_t>(rank);

  std::map<std::string, RefTensor> out;
  std::map<std::string, std::vector<float>> cache;
  auto src = [&](const std::string& name) -> const std::vector<float>& {
    auto it = cache.find(name);
    if (it == cache.end()) {
      it = cache.emplace(name, ck.values(name)).first;
    }
    return it->second;
  };
  // Rows [r0, r0 + n) of a [real_rows, cols] tensor, appended; rows at or past
  // real_rows (padding) are zeros.
  auto take_rows = [&](std::vector<float>& dst, const std::string& name, std::uint64_t cols,
                       std::uint64_t r0, std::uint64_t n, std::uint64_t real_rows) {
    const std::vector<float>& s = src(name);
    for (std::uint64_t i = r0; i < r0 + n; ++i) {
      for (std::uint64_t j = 0; j < cols; ++j) {
        dst.push_back(i < real_rows ? s[i * cols + j] : 0.0f);
      }
    }
  };
  // Vocabulary-parallel: padded to a multiple of 64, rows of this rank, zeros past V.
  auto vocab = [&](const std::string& name) {
    const std::uint64_t padded = (V + 63) / 64 * 64;
    const std::uint64_t per = padded / T;
    RefTensor t{{per, H}, {}};
    for (std::uint64_t i = 0; i < per; ++i) {
      std::uint64_t g = R * per + i;
      if (g < V) {
        take_rows(t.values, name, H, g, 1, V);
      } else {
        t.values.insert(t.values.end(), H, 0.0f);
      }
    }
    out[name] = std::move(t);
  };
  vocab("model.embed_tokens.weight");
  if (!ck.tied) {
    vocab("lm_head.weight");
  }
  out["model.norm.weight"] = {{H}, src("model.norm.weight")};

  // Uneven tp under pad (SGLang's adjust_config_with_unaligned_cpu_tp): when q or kv
  // heads are not multiples of tp, kv heads are padded to one and q heads to padded
  // kv * (heads / kv); an intermediate size not a multiple of tp * 32 is padded to
  // one; padded parts are zeros.
  std::uint64_t heads_p = heads;
  std::uint64_t kv_p = kv;
  if (pad && (heads % T != 0 || kv % T != 0)) {
    kv_p = (kv + T - 1) / T * T;
    heads_p = kv_p * (heads / kv);
  }
  const std::uint64_t I_p = !pad || I % (T * 32) == 0 ? I : (I + T * 32 - 1) / (T * 32) * (T * 32);
  const std::uint64_t qh = heads_p / T;
  const std::uint64_t kvl = kv_p >= T ? kv_p / T : 1;
  const std::uint64_t kv0 = kv_p >= T ? R * kvl : R / (T / kv_p);  // first kv head of this rank
  const std::uint64_t il = I_p / T;
  for (std::uint64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string a = p + "self_attn.";
    RefTensor qkv{{(qh + 2 * kvl) * hd, H}, {}};
    take_rows(qkv.values, a + "q_proj.weight", H, R * qh * hd, qh * hd, heads * hd);
    take_rows(qkv.values, a + "k_proj.weight", H, kv0 * hd, kvl * hd, kv * hd);
    take_rows(qkv.values, a + "v_proj.weight", H, kv0 * hd, kvl * hd, kv * hd);
    out[a + "qkv_proj.weight"] = std::move(qkv);
    if (bias) {
      RefTensor b{{(qh + 2 * kvl) * hd}, {}};
      take_rows(b.values, a + "q_proj.bias", 1, R * qh * hd, qh * hd, heads * hd);
      take_rows(b.values, a + "k_proj.bias", 1, kv0 * hd, kvl * hd, kv * hd);
      take_rows(b.values, a + "v_proj.bias", 1, kv0 * hd, kvl * hd, kv * hd);
      out[a + "qkv_proj.bias"] = std::move(b);
    }
    // o_proj: columns [R*qh*hd, +qh*hd) of [H, heads*hd] (zeros past it).
    RefTensor o{{H, qh * hd}, {}};
    const std::vector<float>& os = src(a + "o_proj.weight");
    for (std::uint64_t i = 0; i < H; ++i) {
      for (std::uint64_t j = 0; j < qh * hd; ++j) {
        const std::uint64_t col = R * qh * hd + j;
        o.values.push_back(col < heads * hd ? os[i * heads * hd + col] : 0.0f);
      }
    }
    out[a + "o_proj.weight"] = std::move(o);
    const std::string m = p + "mlp.";
    RefTensor gu{{2 * il, H}, {}};
    take_rows(gu.values, m + "gate_proj.weight", H, R * il, il, I);
    take_rows(gu.values, m + "up_proj.weight", H, R * il, il, I);
    out[m + "gate_up_proj.weight"] = std::move(gu);
    RefTensor down{{H, il}, {}};
    const std::vector<float>& ds = src(m + "down_proj.weight");
    for (std::uint64_t i = 0; i < H; ++i) {
      for (std::uint64_t j = 0; j < il; ++j) {
        const std::uint64_t col = R * il + j;
        down.values.push_back(col < I ? ds[i * I + col] : 0.0f);
      }
    }
    out[m + "down_proj.weight"] = std::move(down);
    for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
      out[p + n] = {{H}, src(p + n)};
    }
  }
  return out;
}

// A rank's param names, in order, against those of `want` (a map by name).
template <class RefMap>
void expect_param_names(const runtime::LoadedRank& rank, const RefMap& want) {
  std::vector<std::string> names;
  for (const runtime::LoadedParam& p : rank.params) {
    names.push_back(p.name);
  }
  std::vector<std::string> want_names;
  for (const auto& [name, t] : want) {
    want_names.push_back(name);
  }
  EXPECT_EQ(names, want_names) << "tp rank " << rank.tp_rank;
}

// Checks local rank `r` of `model` against `want` (name -> a tensor with `shape` and
// row-major float `values`): the same params by name, and each one's shape, its
// dtype (`dtype`) and its bytes (`values` encoded as `dtype`). Returns the number of
// params compared.
template <class RefMap>
std::size_t expect_rank_matches(const runtime::LoadedModel& model, std::size_t r,
                                const RefMap& want, DType dtype) {
  const runtime::LoadedRank& rank = model.ranks()[r];
  expect_param_names(rank, want);
  std::size_t checked = 0;
  for (const auto& [name, t] : want) {
    const runtime::LoadedParam* p = rank.find(name);
    if (p == nullptr) {
      continue;
    }
    EXPECT_EQ(p->shape, t.shape) << name;
    EXPECT_EQ(p->dtype, dtype) << name;
    const std::vector<std::byte> got = model.read_param(r, name);
    const std::vector<std::byte> bytes = encode(t.values, dtype);
    if (got != bytes) {
      const std::size_t es = dtype_size(dtype);
      std::size_t i = 0;
      while ((i + 1) * es <= std::min(got.size(), bytes.size()) &&
             std::memcmp(got.data() + i * es, bytes.data() + i * es, es) == 0) {
        ++i;
      }
      ADD_FAILURE() << "tp rank " << rank.tp_rank << " param " << name
                    << ": first differing element " << i << " of " << bytes.size() / es << " ("
                    << got.size() << " bytes loaded, " << bytes.size() << " expected)";
    }
    ++checked;
  }
  return checked;
}

// Checks every param of every local rank against the dense reference at `tp`
// (reference_rank). Returns the number of params compared.
inline std::size_t expect_matches_reference(const runtime::LoadedModel& model, const Checkpoint& ck,
                                            int tp, DType dtype, bool pad = false) {
  std::size_t checked = 0;
  for (std::size_t r = 0; r < model.ranks().size(); ++r) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    checked += expect_rank_matches(
        model, r, reference_rank(ck, tp, model.ranks()[r].tp_rank, pad), dtype);
  }
  return checked;
}

// Every parameter's stored bytes, "local rank/name" -> bytes, to compare two loads.
inline std::map<std::string, std::vector<std::byte>> param_bytes(const runtime::LoadedModel& m) {
  std::map<std::string, std::vector<std::byte>> out;
  for (std::size_t r = 0; r < m.ranks().size(); ++r) {
    for (const runtime::LoadedParam& p : m.ranks()[r].params) {
      out[std::to_string(r) + "/" + p.name] = m.read_param(r, p.name);
    }
  }
  return out;
}

// The two models' ranks hold the same params: names, dtypes, shapes, strides, bytes
// (a load and a read of what it saved, issue 34's formats).
inline void expect_same_model(const runtime::LoadedModel& a, const runtime::LoadedModel& b) {
  ASSERT_EQ(a.ranks().size(), b.ranks().size());
  for (std::size_t r = 0; r < a.ranks().size(); ++r) {
    const runtime::LoadedRank& x = a.ranks()[r];
    const runtime::LoadedRank& y = b.ranks()[r];
    EXPECT_EQ(x.tp_rank, y.tp_rank);
    ASSERT_EQ(x.params.size(), y.params.size()) << "rank " << r;
    for (std::size_t k = 0; k < x.params.size(); ++k) {
      EXPECT_EQ(x.params[k].name, y.params[k].name);
      EXPECT_EQ(x.params[k].dtype, y.params[k].dtype) << x.params[k].name;
      EXPECT_EQ(x.params[k].shape, y.params[k].shape) << x.params[k].name;
      EXPECT_EQ(x.params[k].strides, y.params[k].strides) << x.params[k].name;
    }
  }
  const auto want = param_bytes(a);
  const auto got = param_bytes(b);
  ASSERT_EQ(want.size(), got.size());
  for (const auto& [name, bytes] : want) {
    ASSERT_TRUE(got.contains(name)) << name;
    EXPECT_TRUE(got.at(name) == bytes) << name;
  }
}

// ---- callbacks ---------------------------------------------------------------

// The layers a load's on_layer_ready announced (for any rank).
class LayerLog {
 public:
  runtime::LoadCallbacks callbacks() {
    runtime::LoadCallbacks cb;
    cb.on_layer_ready = [this](std::uint64_t layer, int) {
      std::lock_guard lock(mu_);
      layers_.insert(layer);
    };
    return cb;
  }
  std::set<std::uint64_t> layers() const {
    std::lock_guard lock(mu_);
    return layers_;
  }

 private:
  mutable std::mutex mu_;
  std::set<std::uint64_t> layers_;
};

// ---- configuration -----------------------------------------------------------

// The bytes of every safetensors header `r` wrote (length prefix included): what a
// load reads beyond its plan.
inline std::uint64_t synth_header_bytes(const synth::SynthResult& r) {
  std::uint64_t n = 0;
  for (const std::string& path : r.files) {
    if (path.size() > 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0) {
      std::ifstream in(path, std::ios::binary);
      std::uint64_t len = 0;
      in.read(reinterpret_cast<char*>(&len), 8);
      n += 8 + len;
    }
  }
  return n;
}

// A LoadConfig from `--set`-style assignments over the in-code defaults.
inline runtime::LoadConfig make_config(
    const std::string& model_dir, const std::vector<std::string>& sets,
    runtime::ConfigBuilder::Rules rules = runtime::ConfigBuilder::Rules::kAll) {
  runtime::ConfigBuilder b;
  b.apply_set("model.path=" + model_dir);
#ifdef FERRY_TEST_DEFERRED_COPIES
  // The Release test run: every load through here runs its copies deferred, so the
  // contract and end-to-end tests also prove the pipeline waits for its copies.
  b.apply_set("host.deferred_copies=true");
#endif
  for (const std::string& s : sets) {
    b.apply_set(s);
  }
  return b.build(rules);
}

// ---- issue 34's layout matrix: restart formats and updates -------------------

using Sets = std::vector<std::string>;

inline Sets with(Sets sets, const Sets& more) {
  sets.insert(sets.end(), more.begin(), more.end());
  return sets;
}

// One Runtime, one load of `path` with `sets`.
inline runtime::LoadResult load_with(const std::string& path, const Sets& sets) {
  runtime::Runtime rt(runtime::to_config(make_config(path, sets)));
  return rt.load();
}

// The integer `key=` assignment of `sets`, else `fallback`.
inline int set_value(const Sets& sets, const std::string& key, int fallback) {
  for (const std::string& s : sets) {
    if (s.rfind(key + "=", 0) == 0) {
      return std::stoi(s.substr(key.size() + 1));
    }
  }
  return fallback;
}

struct LayoutCase {
  const char* family;
  Sets sets;
};

// The layouts the restart formats and updates round-trip: tp 1, 2 and 4, pp 2, ep 2,
// attention DP, for Llama, Qwen3-MoE, DeepSeek-V3 (BF16, and "deepseek_v3_fp8":
// block FP8) and Gemma 2.
inline std::vector<LayoutCase> restart_layouts() {
  return {{"llama", {"parallel.tp=1"}},
          {"llama", {"parallel.tp=2"}},
          {"llama", {"parallel.tp=4"}},
          {"llama", {"parallel.tp=2", "parallel.pp=2"}},
          {"qwen3_moe", {"parallel.tp=2", "parallel.ep=2"}},
          {"deepseek_v3", {"parallel.tp=2", "parallel.ep=2"}},
          {"deepseek_v3", {"parallel.tp=4", "parallel.attn_dp=2"}},
          {"deepseek_v3_fp8", {"parallel.tp=2"}},
          {"deepseek_v3_fp8", {"parallel.tp=4", "parallel.attn_dp=2"}},
          {"gemma2", {"parallel.tp=2"}}};
}

// "llama_tp_2_pp_2": the family and each assignment's value, as a test name.
inline std::string layout_case_name(const ::testing::TestParamInfo<LayoutCase>& info) {
  std::string name = info.param.family;
  for (const std::string& s : info.param.sets) {
    name += "_" + s.substr(s.find('.') + 1);
  }
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) {
      ch = '_';
    }
  }
  return name;
}

// A tiny checkpoint of a matrix family in `dir`: "deepseek_v3_fp8" is DeepSeek-V3
// with FP8 8 x 8 blocks (which split at tp 4).
inline std::string layout_checkpoint(const std::string& dir, const std::string& family,
                                     std::uint64_t seed = 1) {
  if (family != "deepseek_v3_fp8") {
    return synth_checkpoint(dir, family, false, seed).dir;
  }
  synth::SynthOptions o;
  o.family = "deepseek_v3";
  o.preset = "tiny";
  o.out = dir;
  o.seed = seed;
  o.quant = synth::SynthQuant::kFp8Block;
  o.quant_block = 8;
  o.fsync = false;
  synth::synthesize(o);
  return o.out;
}

// ---- checkpoint surgery ------------------------------------------------------

struct ShardEntry {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<std::uint64_t> shape;
  std::string bytes;
};

// Rewrites shard `file` of the checkpoint in `dir` after `edit` changed its
// entries, and updates model.safetensors.index.json (weight_map and total_size).
inline void rewrite_shard(const std::string& dir, const std::string& file,
                          const std::function<void(std::vector<ShardEntry>&)>& edit) {
  const std::string path = dir + "/" + file;
  io::SafetensorsHeader h = io::read_safetensors_header(path, file);
  std::string data = read_file(path);
  std::vector<ShardEntry> entries;
  std::uint64_t before = 0;
  for (const io::TensorInfo& t : h.tensors) {
    entries.push_back({t.name, t.dtype, t.shape, data.substr(t.offset, t.nbytes)});
    before += t.nbytes;
  }
  std::vector<std::string> old_names;
  for (const ShardEntry& e : entries) {
    old_names.push_back(e.name);
  }
  edit(entries);
  std::uint64_t after = 0;
  io::SafetensorsWriter w(path);
  for (const ShardEntry& e : entries) {
    w.add(e.name, e.dtype, e.shape);
    after += e.bytes.size();
  }
  w.begin();
  for (const ShardEntry& e : entries) {
    w.write(std::as_bytes(std::span(e.bytes.data(), e.bytes.size())));
  }
  w.finish();

  const std::string index_path = dir + "/model.safetensors.index.json";
  nlohmann::json index = nlohmann::json::parse(read_file(index_path));
  for (const std::string& n : old_names) {
    index["weight_map"].erase(n);
  }
  for (const ShardEntry& e : entries) {
    index["weight_map"][e.name] = file;
  }
  if (index.contains("metadata") && index["metadata"].contains("total_size")) {
    std::uint64_t total = index["metadata"]["total_size"];
    index["metadata"]["total_size"] = total - before + after;
  }
  write_file(index_path, index.dump(2));
}

// The shard that holds tensor `name` (from the index).
inline std::string shard_of(const std::string& dir, const std::string& name) {
  nlohmann::json index = nlohmann::json::parse(read_file(dir + "/model.safetensors.index.json"));
  return index.at("weight_map").at(name);
}

// ---- staging memory that counts -------------------------------------------------

// Staging memory that counts its live buffers (and all it gave), and can refuse the
// n-th allocation (fail_at).
class CountingAllocator final : public io::BufferAllocator {
 public:
  void* allocate(std::size_t bytes, std::size_t alignment) override {
    if (++calls_ == fail_at.load()) {
      return nullptr;
    }
    void* p = inner_->allocate(bytes, alignment);
    if (p != nullptr) {
      live_.fetch_add(1);
      total_.fetch_add(1);
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    live_.fetch_sub(1);
    inner_->deallocate(p, bytes);
  }
  std::string name() const override { return "counting"; }

  int live() const { return live_.load(); }
  int total() const { return total_.load(); }

  std::atomic<int> fail_at{0};  // 1-based; 0 = never

 private:
  std::shared_ptr<io::BufferAllocator> inner_ = io::aligned_host_allocator();
  std::atomic<int> calls_{0};
  std::atomic<int> live_{0};
  std::atomic<int> total_{0};
};

}  // namespace ferry::testing
