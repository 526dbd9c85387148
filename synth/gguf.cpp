// A synthetic checkpoint as llama.cpp's convert_hf_to_gguf.py would convert it
// (synth/synth.hpp, "GGUF"): the tensor plan (names, the converter's reshapes, each
// tensor's type), the metadata it writes from config.json, and the rows streamed
// through io::GgufWriter. The converter's rules are quoted from current llama.cpp:
// conversion/base.py (ModelBase.prepare_tensors, TextModel.set_gguf_parameters),
// conversion/llama.py (LlamaModel), conversion/qwen.py (Qwen2MoeModel) and
// conversion/deepseek.py (DeepseekV2Model).
#include "synth/gguf.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>

#include "common/error.hpp"
#include "common/float_bits.hpp"
#include "common/format.hpp"
#include "synth/family.hpp"

namespace ferry::synth {

namespace {

using io::GgmlType;
using io::GgufArch;
using io::GgufValue;
using nlohmann::json;

// config.json's fields, as the converter reads them (hparams.get and find_hparam):
// absent and null are the same; a present value of the wrong kind is an error.
class Config {
 public:
  Config(const json& c, std::string where) : c_(c), where_(std::move(where)) {}

  const std::string& where() const { return where_; }

  [[noreturn]] void fail(const std::string& rule) const {
    throw Error(Stage::kSynth, where_, "", "--format gguf: " + rule);
  }

  const json* find(std::string_view key) const {
    const auto it = c_.find(key);
    return it == c_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(std::string_view key) const { return find(key) != nullptr; }

  std::optional<std::uint64_t> uint(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    if (!v->is_number_integer() || (!v->is_number_unsigned() && v->get<std::int64_t>() < 0)) {
      fail("config field '" + std::string(key) + "' must be a non-negative integer, not " +
           v->dump());
    }
    return v->get<std::uint64_t>();
  }
  std::uint64_t need_uint(std::string_view key) const {
    const std::optional<std::uint64_t> n = uint(key);
    if (!n) {
      fail("config field '" + std::string(key) + "' is missing");
    }
    return *n;
  }
  std::optional<double> number(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    if (!v->is_number()) {
      fail("config field '" + std::string(key) + "' must be a number, not " + v->dump());
    }
    return v->get<double>();
  }
  std::optional<bool> boolean(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    if (!v->is_boolean()) {
      fail("config field '" + std::string(key) + "' must be true or false, not " + v->dump());
    }
    return v->get<bool>();
  }
  std::optional<std::string> text(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    if (!v->is_string()) {
      fail("config field '" + std::string(key) + "' must be a string, not " + v->dump());
    }
    return v->get<std::string>();
  }
  // The first of `keys` present (find_hparam).
  std::optional<std::uint64_t> first_uint(std::initializer_list<std::string_view> keys) const {
    for (std::string_view key : keys) {
      if (has(key)) {
        return uint(key);
      }
    }
    return std::nullopt;
  }

 private:
  const json& c_;
  std::string where_;
};

// GGUF metadata in the order the converter adds it; a key added twice keeps its place
// and takes the new value, as GGUFWriter.add_key_value does.
class Meta {
 public:
  Meta(io::GgufMetadata& m, std::string arch, const Config& c)
      : m_(m), prefix_(std::move(arch) + "."), c_(c) {}

  void put(std::string key, GgufValue v) {
    for (auto& [k, value] : m_) {
      if (k == key) {
        value = std::move(v);
        return;
      }
    }
    m_.emplace_back(std::move(key), std::move(v));
  }
  void u32(std::string_view key, std::uint64_t v) {
    if (v > std::numeric_limits<std::uint32_t>::max()) {
      c_.fail("metadata key '" + prefix_ + std::string(key) + "': " + std::to_string(v) +
              " does not fit the u32 the converter writes");
    }
    put(prefix_ + std::string(key), GgufValue::of_u32(static_cast<std::uint32_t>(v)));
  }
  void f32(std::string_view key, double v) {
    put(prefix_ + std::string(key), GgufValue::of_f32(static_cast<float>(v)));
  }
  void flag(std::string_view key, bool v) {
    put(prefix_ + std::string(key), GgufValue::of_bool(v));
  }
  void text(std::string_view key, std::string v) {
    put(prefix_ + std::string(key), GgufValue::of_string(std::move(v)));
  }

 private:
  io::GgufMetadata& m_;
  std::string prefix_;
  const Config& c_;
};

// The rope parameters TextModel.__init__ gathers: rope_parameters, else rope_scaling
// (with "type" read as "rope_type"), and rope_theta from it or the config.
struct Rope {
  json params = json::object();
  std::optional<double> theta;
};

Rope rope_of(const Config& c) {
  Rope r;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (const json* p = c.find(key)) {
      if (!p->is_object()) {
        c.fail("config field '" + std::string(key) + "' must be an object, not " + p->dump());
      }
      r.params = *p;
      break;
    }
  }
  if (r.params.contains("full_attention") || r.params.contains("sliding_attention")) {
    c.fail("per-layer-type rope_parameters (full_attention, sliding_attention) are not written");
  }
  if (!r.params.contains("rope_type") && r.params.contains("type")) {
    r.params["rope_type"] = r.params["type"];
  }
  const Config p(r.params, c.where());
  r.theta = p.number("rope_theta");
  if (!r.theta) {
    r.theta = c.number("rope_theta");
  }
  return r;
}

// rope.scaling.* as TextModel.set_gguf_parameters writes them: linear and yarn with a
// factor; "default" (or none) writes nothing. Others are refused: llama3's factors
// are a rope_freqs.weight tensor the converter computes in float32, longrope's are
// per-model tensors, and dynamic NTK is written by a class synth has no family of.
void rope_scaling(const Rope& rope, const Config& c, Meta& meta) {
  const Config p(rope.params, c.where());
  const json* type_value = p.find("rope_type");
  if (type_value == nullptr) {
    return;
  }
  if (!type_value->is_string()) {
    c.fail("rope_scaling's rope_type must be a string, not " + type_value->dump());
  }
  const std::string type = type_value->get<std::string>();
  const std::optional<double> factor = p.number("factor");
  if ((type == "linear" || type == "yarn") && factor) {
    meta.text("rope.scaling.type", type);
    meta.f32("rope.scaling.factor", *factor);
    if (type == "linear") {
      return;
    }
    const std::optional<std::uint64_t> orig = p.uint("original_max_position_embeddings");
    if (!orig) {
      c.fail("rope_scaling yarn needs original_max_position_embeddings");
    }
    meta.u32("rope.scaling.original_context_length", *orig);
    if (const auto ext = p.number("extrapolation_factor")) {
      meta.f32("rope.scaling.yarn_ext_factor", *ext);
    }
    if (const auto attn =
            p.has("attention_factor") ? p.number("attention_factor") : p.number("attn_factor")) {
      meta.f32("rope.scaling.yarn_attn_factor", *attn);
    }
    if (const auto fast = p.number("beta_fast")) {
      meta.f32("rope.scaling.yarn_beta_fast", *fast);
    }
    if (const auto slow = p.number("beta_slow")) {
      meta.f32("rope.scaling.yarn_beta_slow", *slow);
    }
    return;
  }
  if (type == "default" || type == "none") {
    return;
  }
  c.fail("rope_scaling of type '" + type +
         "' is not written (the converter writes linear and yarn as metadata; llama3's "
         "rope_freqs.weight and the other types are not synthesized)");
}

// TextModel.set_gguf_parameters, then the architecture's own keys.
io::GgufMetadata plan_metadata(const json& config, GgufArch arch, std::string_view what,
                               GgmlType type, const std::string& where) {
  const Config c(config, where);
  io::GgufMetadata out;
  Meta m(out, std::string(io::gguf_arch_name(arch)), c);
  const bool deepseek = arch == GgufArch::kDeepseek2;
  m.put("general.architecture", GgufValue::of_string(std::string(io::gguf_arch_name(arch))));
  m.put("general.type", GgufValue::of_string("model"));
  m.put("general.name", GgufValue::of_string("ferry synth " + std::string(what)));

  const std::uint64_t layers = c.need_uint("num_hidden_layers");
  const std::uint64_t heads = c.need_uint("num_attention_heads");
  m.u32("block_count", layers);
  if (const auto n = c.first_uint({"max_position_embeddings", "n_ctx", "n_positions"})) {
    m.u32("context_length", *n);
  }
  m.u32("embedding_length", c.need_uint("hidden_size"));
  if (const auto n = c.first_uint({"prefix_dense_intermediate_size", "intermediate_size"})) {
    m.u32("feed_forward_length", *n);
  }
  m.u32("attention.head_count", heads);
  if (deepseek) {
    m.u32("attention.head_count_kv", 1);  // MLA converted to MQA
  } else if (const auto kv = c.uint("num_key_value_heads")) {
    m.u32("attention.head_count_kv", *kv);
  }
  const Rope rope = rope_of(c);
  rope_scaling(rope, c, m);
  if (rope.theta) {
    m.f32("rope.freq_base", *rope.theta);
  }
  if (const auto eps = c.number("rms_norm_eps")) {
    m.f32("attention.layer_norm_rms_epsilon", *eps);
  } else if (deepseek) {
    m.f32("attention.layer_norm_rms_epsilon", 1e-6);
  }
  if (const auto n = c.first_uint({"num_local_experts", "num_experts", "n_routed_experts"})) {
    m.u32("expert_count", *n);
  }
  if (const auto n = c.uint("num_experts_per_tok")) {
    m.u32("expert_used_count", *n);
  }
  if (const auto n = c.uint("n_group")) {
    m.u32("expert_group_count", *n);
  }
  if (const auto n = c.uint("topk_group")) {
    m.u32("expert_group_used_count", *n);
  }
  if (const auto f = c.text("scoring_func")) {
    if (*f != "sigmoid" && *f != "softmax") {
      c.fail("scoring_func '" + *f + "' is neither sigmoid nor softmax");
    }
    m.u32("expert_gating_func", *f == "sigmoid" ? 2 : 1);  // ExpertGatingFuncType
  }
  if (const auto d = c.uint("head_dim")) {
    m.u32("attention.key_length", *d);
    m.u32("attention.value_length", *d);
  }
  m.put("general.file_type", GgufValue::of_u32(synth_gguf_file_type(type)));

  switch (arch) {
    case GgufArch::kLlama:
      m.u32("vocab_size", c.need_uint("vocab_size"));
      m.u32("rope.dimension_count",
            c.uint("head_dim")
                .value_or(c.need_uint("hidden_size") / std::max<std::uint64_t>(heads, 1)));
      break;
    case GgufArch::kQwen2:
    case GgufArch::kQwen3:
      break;
    case GgufArch::kQwen3Moe:
      if (const auto n = c.uint("moe_intermediate_size")) {
        m.u32("expert_feed_forward_length", *n);
      }
      if (const auto n = c.uint("shared_expert_intermediate_size")) {
        m.u32("expert_shared_feed_forward_length", *n);
      }
      break;
    case GgufArch::kDeepseek2: {
      const std::uint64_t rank = c.uint("kv_lora_rank").value_or(512);
      const std::uint64_t rope_dim = c.need_uint("qk_rope_head_dim");
      m.u32("leading_dense_block_count",
            c.uint("first_k_dense_replace").value_or(c.has("n_routed_experts") ? 0 : layers));
      m.u32("vocab_size", c.need_uint("vocab_size"));
      if (const auto q = c.uint("q_lora_rank")) {
        m.u32("attention.q_lora_rank", *q);
      }
      m.u32("attention.kv_lora_rank", rank);
      m.u32("attention.key_length", rank + rope_dim);
      m.u32("attention.value_length", rank);
      m.u32("attention.key_length_mla", c.need_uint("qk_nope_head_dim") + rope_dim);
      m.u32("attention.value_length_mla", c.need_uint("v_head_dim"));
      m.u32("expert_feed_forward_length",
            c.first_uint({"moe_intermediate_size", "intermediate_size"}).value_or(0));
      if (const auto n = c.uint("n_routed_experts")) {
        m.u32("expert_count", *n);
      }
      m.u32("expert_shared_count", c.uint("n_shared_experts").value_or(0));
      if (const auto s = c.number("routed_scaling_factor")) {
        m.f32("expert_weights_scale", *s);
      }
      if (c.boolean("norm_topk_prob").value_or(false)) {
        m.flag("expert_weights_norm", true);
      }
      m.u32("rope.dimension_count", rope_dim);
      if (const auto all = Config(rope.params, where).number("mscale_all_dim")) {
        m.f32("rope.scaling.yarn_log_multiplier", 0.1 * *all);
      }
      break;
    }
  }
  m.put("general.quantization_version", GgufValue::of_u32(2));  // GGML_QUANT_VERSION
  return out;
}

std::vector<std::uint64_t> reversed(std::vector<std::uint64_t> shape) {
  std::reverse(shape.begin(), shape.end());
  return shape;
}

// "model.layers.<i>." -> i; nullopt for names outside the layers.
std::optional<std::uint64_t> layer_of(std::string_view name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix)) {
    return std::nullopt;
  }
  name.remove_prefix(kPrefix.size());
  std::uint64_t n = 0;
  std::size_t i = 0;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) {
    n = n * 10 + static_cast<std::uint64_t>(name[i] - '0');
  }
  return i > 0 && i < name.size() && name[i] == '.' ? std::optional(n) : std::nullopt;
}

// A layer's routed experts as they arrive, stacked once all 3 E of them have (the
// converter's self._experts[bid]).
struct ExpertStack {
  std::map<std::string, std::vector<std::size_t>> by_stack;  // GGUF name -> HF by expert
  std::size_t seen = 0;
};

class Planner {
 public:
  Planner(const std::vector<SynthTensor>& tensors, const json& config, GgufArch arch, GgmlType type,
          const std::string& where)
      : tensors_(tensors), c_(config, where), arch_(arch), type_(type), where_(where) {
    layers_ = c_.need_uint("num_hidden_layers");
    heads_ = c_.need_uint("num_attention_heads");
    kv_heads_ = c_.uint("num_key_value_heads").value_or(heads_);
    experts_ = c_.first_uint({"num_local_experts", "num_experts", "n_routed_experts"}).value_or(0);
  }

  std::vector<GgufPlanned> run() {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const SynthTensor& t = tensors_[i];
      const std::optional<std::uint64_t> layer = layer_of(t.name);
      if (layer && *layer >= layers_) {
        if (arch_ != GgufArch::kDeepseek2) {
          fail(t.name, "layer " + std::to_string(*layer) + " is past num_hidden_layers " +
                           std::to_string(layers_));
        }
        continue;  // DeepseekV2Model.skip_mtp: the converter drops the MTP layers
      }
      const std::vector<io::HfGgufTarget> targets = io::match_hf_name(arch_, t.name);
      if (targets.empty()) {
        fail(t.name, "has no name in llama.cpp's '" + std::string(io::gguf_arch_name(arch_)) +
                         "' architecture");
      }
      for (const io::HfGgufTarget& target : targets) {
        add(i, target, layer.value_or(0));
      }
    }
    for (const auto& [layer, stack] : pending_) {
      if (stack.seen != 0) {
        fail("", "layer " + std::to_string(layer) + " has " + std::to_string(stack.seen) +
                     " expert weights, not 3 x " + std::to_string(experts_));
      }
    }
    for (GgufPlanned& p : out_) {
      p.type = synth_gguf_tensor_type(p.name, p.dims, type_);
    }
    return std::move(out_);
  }

 private:
  [[noreturn]] void fail(const std::string& tensor, const std::string& rule) const {
    throw Error(Stage::kSynth, where_, tensor, "--format gguf: " + rule);
  }

  void add(std::size_t i, const io::HfGgufTarget& target, std::uint64_t layer) {
    const SynthTensor& t = tensors_[i];
    GgufPlanned p;
    p.name = target.gguf_name;
    p.hf = {i};
    switch (target.how) {
      case io::GgufToHf::kSame:
        p.dims = reversed(t.shape);
        break;
      case io::GgufToHf::kUnpermuteRows: {
        const std::uint64_t heads = target.key ? kv_heads_ : heads_;
        const std::uint64_t rows = t.shape.empty() ? 0 : t.shape[0];
        if (rows == 0 || rows % (2 * heads) != 0) {
          fail(t.name, std::to_string(rows) + " rows are not whole pairs of rows of " +
                           std::to_string(heads) + " heads (LlamaModel.permute)");
        }
        p.dims = reversed(t.shape);
        p.source = GgufSource::kPermuted;
        p.row_map = io::llama_qk_permute_rows(rows, heads);
        break;
      }
      case io::GgufToHf::kExperts:
        stack_expert(i, target, layer);
        return;
      case io::GgufToHf::kMlaKB:
      case io::GgufToHf::kMlaVB:
        split_kv_b(i, target, p);
        break;
      case io::GgufToHf::kNone:
        return;
    }
    out_.push_back(std::move(p));
  }

  void stack_expert(std::size_t i, const io::HfGgufTarget& target, std::uint64_t layer) {
    if (experts_ == 0 || target.expert >= experts_) {
      fail(tensors_[i].name, "expert " + std::to_string(target.expert) + " of " +
                                 std::to_string(experts_) + " routed experts in the config");
    }
    ExpertStack& stack = pending_[layer];
    std::vector<std::size_t>& slots = stack.by_stack[target.gguf_name];
    slots.resize(experts_, tensors_.size());
    slots[target.expert] = i;
    if (++stack.seen < 3 * experts_) {
      return;
    }
    // All arrived: the converter stacks down, gate, up (Mixtral: w1, w2, w3 = gate,
    // down, up) with torch.stack(datas, dim=0).
    const std::string blk = "blk." + std::to_string(layer) + ".";
    const std::vector<std::string> order =
        arch_ == GgufArch::kLlama
            ? std::vector<std::string>{"ffn_gate_exps", "ffn_down_exps", "ffn_up_exps"}
            : std::vector<std::string>{"ffn_down_exps", "ffn_gate_exps", "ffn_up_exps"};
    for (const std::string& stem : order) {
      const auto it = stack.by_stack.find(blk + stem + ".weight");
      if (it == stack.by_stack.end()) {
        fail("", "layer " + std::to_string(layer) + " has no " + stem + " experts");
      }
      const std::vector<std::size_t>& hf = it->second;
      for (std::size_t e = 0; e < hf.size(); ++e) {
        if (hf[e] == tensors_.size() || tensors_[hf[e]].shape.size() != 2 ||
            tensors_[hf[e]].shape != tensors_[hf[0]].shape) {
          fail(it->first, "expert " + std::to_string(e) + " is missing or not shaped as expert 0");
        }
      }
      GgufPlanned p;
      p.name = it->first;
      p.source = GgufSource::kExperts;
      p.hf = hf;
      p.dims = {tensors_[hf[0]].shape[1], tensors_[hf[0]].shape[0], experts_};
      out_.push_back(std::move(p));
    }
    stack = ExpertStack{};
  }

  // kv_b_proj [n * (nope + v), rank], viewed as [n, nope + v, rank] and split along
  // dim 1; the k half transposed (k_b.transpose(1, 2)). n is the config's
  // num_key_value_heads, as the converter reads it before set_gguf_parameters sets it
  // to 1.
  void split_kv_b(std::size_t i, const io::HfGgufTarget& target, GgufPlanned& p) const {
    const SynthTensor& t = tensors_[i];
    p.heads = kv_heads_;
    p.nope = c_.need_uint("qk_nope_head_dim");
    p.v_dim = c_.need_uint("v_head_dim");
    if (t.shape.size() != 2 || t.shape[0] != p.heads * (p.nope + p.v_dim)) {
      fail(t.name, "shape " + format_dims(t.shape) + " is not [" + std::to_string(p.heads) +
                       " x (" + std::to_string(p.nope) + " + " + std::to_string(p.v_dim) +
                       "), rank]");
    }
    p.rank = t.shape[1];
    if (target.how == io::GgufToHf::kMlaKB) {
      p.source = GgufSource::kKb;
      p.dims = {p.nope, p.rank, p.heads};
    } else {
      p.source = GgufSource::kVb;
      p.dims = {p.rank, p.v_dim, p.heads};
    }
  }

  const std::vector<SynthTensor>& tensors_;
  Config c_;
  GgufArch arch_;
  GgmlType type_;
  std::string where_;
  std::uint64_t layers_ = 0, heads_ = 0, kv_heads_ = 0, experts_ = 0;
  std::map<std::uint64_t, ExpertStack> pending_;
  std::vector<GgufPlanned> out_;
};

// ---- values ------------------------------------------------------------------------

// Elements [first, first + out.size()) of HF tensor `t` as float32: its synth values
// encoded in its dtype, then widened, as the converter reads them
// (data_torch.to(torch.float32)).
class HfReader {
 public:
  explicit HfReader(std::uint64_t seed) : seed_(seed) {}

  void read(const SynthTensor& t, std::uint64_t first, std::span<float> out) {
    const std::size_t esize = dtype_size(t.dtype);
    bytes_.resize(out.size() * esize);
    synth_encode(t.dtype, seed_, t.value_name.empty() ? t.name : t.value_name, first, bytes_);
    for (std::size_t k = 0; k < out.size(); ++k) {
      const std::byte* b = bytes_.data() + k * esize;
      if (t.dtype == DType::kF32) {
        std::memcpy(&out[k], b, 4);
      } else {
        std::uint16_t bits = 0;
        std::memcpy(&bits, b, 2);
        out[k] = t.dtype == DType::kBF16 ? io::bf16_to_float(bits) : io::f16_to_float(bits);
      }
    }
  }

 private:
  std::uint64_t seed_;
  std::vector<std::byte> bytes_;
};

// The float32 rows of one planned tensor, GGUF row by GGUF row.
class RowSource {
 public:
  RowSource(const GgufPlanned& p, const std::vector<SynthTensor>& tensors, HfReader& reader)
      : p_(p), tensors_(tensors), reader_(reader) {}

  void row(std::uint64_t r, std::span<float> out) {
    const std::uint64_t cols = p_.dims[0];
    const SynthTensor& first = tensors_[p_.hf[0]];
    switch (p_.source) {
      case GgufSource::kRows:
        reader_.read(first, r * cols, out);
        return;
      case GgufSource::kPermuted:
        if (p_.dims.size() == 1) {  // a bias: its elements are the rows that move
          scratch_.resize(cols);
          reader_.read(first, 0, scratch_);
          for (std::uint64_t j = 0; j < cols; ++j) {
            out[j] = scratch_[p_.row_map[j]];
          }
        } else {
          reader_.read(first, p_.row_map[r] * cols, out);
        }
        return;
      case GgufSource::kExperts: {
        const std::uint64_t per = p_.dims[1];
        reader_.read(tensors_[p_.hf[r / per]], (r % per) * cols, out);
        return;
      }
      case GgufSource::kKb: {
        // Row (h, c) holds column c of head h's nope rows of kv_b_proj.
        const std::uint64_t h = r / p_.rank, c = r % p_.rank;
        if (head_ != h || scratch_.empty()) {
          scratch_.resize(p_.nope * p_.rank);
          reader_.read(first, h * (p_.nope + p_.v_dim) * p_.rank, scratch_);
          head_ = h;
        }
        for (std::uint64_t n = 0; n < p_.nope; ++n) {
          out[n] = scratch_[n * p_.rank + c];
        }
        return;
      }
      case GgufSource::kVb: {
        const std::uint64_t h = r / p_.v_dim, j = r % p_.v_dim;
        reader_.read(first, (h * (p_.nope + p_.v_dim) + p_.nope + j) * p_.rank, out);
        return;
      }
    }
  }

 private:
  const GgufPlanned& p_;
  const std::vector<SynthTensor>& tensors_;
  HfReader& reader_;
  std::vector<float> scratch_;
  std::uint64_t head_ = 0;
};

// One row of floats in `type`'s bytes, appended to `out`.
void encode_row(GgmlType type, std::span<const float> row, const std::string& name,
                std::vector<std::byte>& out) {
  const std::size_t at = out.size();
  switch (type) {
    case GgmlType::kF32:
      out.resize(at + row.size() * 4);
      std::memcpy(out.data() + at, row.data(), row.size() * 4);
      return;
    case GgmlType::kF16:
    case GgmlType::kBF16:
      out.resize(at + row.size() * 2);
      for (std::size_t k = 0; k < row.size(); ++k) {
        const std::uint16_t bits =
            type == GgmlType::kF16 ? float_to_f16_bits(row[k]) : float_to_bf16_bits(row[k]);
        std::memcpy(out.data() + at + 2 * k, &bits, 2);
      }
      return;
    case GgmlType::kQ8_0: {
      const std::uint64_t bytes = *io::ggml_row_bytes(type, row.size());
      out.resize(at + bytes);
      io::quantize_q8_0(row, std::span(out).subspan(at, bytes), name);
      return;
    }
    default:
      throw Error(Stage::kSynth, "", name,
                  "--format gguf writes F32, F16, BF16 or Q8_0, not " +
                      std::string(io::ggml_type_name(type)));
  }
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

std::optional<GgmlType> parse_synth_gguf_type(std::string_view text) {
  for (const auto& [lower, type] :
       {std::pair{"f32", GgmlType::kF32}, std::pair{"f16", GgmlType::kF16},
        std::pair{"bf16", GgmlType::kBF16}, std::pair{"q8_0", GgmlType::kQ8_0}}) {
    if (text == lower || text == io::ggml_type_name(type)) {
      return type;
    }
  }
  return std::nullopt;
}

std::optional<GgufArch> synth_gguf_arch(std::string_view family) {
  if (family == "llama" || family == "mistral" || family == "mixtral") {
    return GgufArch::kLlama;  // LlamaModel registers all three
  }
  if (family == "qwen2") {
    return GgufArch::kQwen2;
  }
  if (family == "qwen3") {
    return GgufArch::kQwen3;
  }
  if (family == "qwen3_moe") {
    return GgufArch::kQwen3Moe;
  }
  if (family == "deepseek_v2" || family == "deepseek_v3") {
    return GgufArch::kDeepseek2;
  }
  return std::nullopt;
}

std::uint32_t synth_gguf_file_type(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
      return 0;
    case GgmlType::kF16:
      return 1;
    case GgmlType::kQ8_0:
      return 7;
    case GgmlType::kBF16:
      return 32;
    default:
      throw Error(Stage::kSynth, "", "",
                  "--format gguf writes F32, F16, BF16 or Q8_0, not " +
                      std::string(io::ggml_type_name(type)));
  }
}

GgmlType synth_gguf_tensor_type(std::string_view gguf_name, const std::vector<std::uint64_t>& dims,
                                GgmlType requested) {
  // prepare_tensors: "Most of the codebase that takes in 1D tensors or norms only
  // handles F32 tensors" (whatever --outtype), then the tensors always kept in F32
  // (here: the router, FFN_GATE_INP) and every name not ending in ".weight".
  if (dims.size() <= 1 || ends_with(gguf_name, "_norm.weight") ||
      ends_with(gguf_name, ".ffn_gate_inp.weight") || !ends_with(gguf_name, ".weight")) {
    return GgmlType::kF32;
  }
  if (requested == GgmlType::kQ8_0 && (dims.empty() || dims[0] % 32 != 0)) {
    return GgmlType::kF16;  // gguf.QuantError -> "falling back to F16"
  }
  return requested;
}

GgufPlan plan_synth_gguf(const std::vector<SynthTensor>& tensors, const nlohmann::json& config,
                         std::string_view family, std::string_view what, GgmlType type,
                         const std::string& where) {
  const std::optional<GgufArch> arch = synth_gguf_arch(family);
  if (!arch) {
    throw Error(Stage::kSynth, where, "",
                "--format gguf: family '" + std::string(family) +
                    "' has no llama.cpp architecture ferry maps (llama, mistral, mixtral, "
                    "qwen2, qwen3, qwen3_moe, deepseek_v2, deepseek_v3)");
  }
  synth_gguf_file_type(type);  // refuse another type first
  GgufPlan plan;
  plan.arch = *arch;
  plan.metadata = plan_metadata(config, *arch, what, type, where);
  plan.tensors = Planner(tensors, config, *arch, type, where).run();
  return plan;
}

std::uint64_t write_synth_gguf(const std::string& path, const GgufPlan& plan,
                               const std::vector<SynthTensor>& tensors, std::uint64_t seed,
                               bool fsync,
                               const std::function<void(std::uint64_t, std::uint64_t)>& progress) {
  io::GgufWriter writer(path, Stage::kSynth);
  for (const auto& [key, value] : plan.metadata) {
    writer.add_metadata(key, value);
  }
  for (const GgufPlanned& p : plan.tensors) {
    writer.add_tensor(p.name, p.type, p.dims);
  }
  writer.begin();
  std::uint64_t total = 0;
  for (const io::GgufWriterTensor& t : writer.tensors()) {
    total += t.nbytes;
  }
  constexpr std::size_t kFlushBytes = std::size_t{4} << 20;
  HfReader reader(seed);
  std::vector<float> row;
  std::vector<std::byte> block;
  std::uint64_t done = 0;
  for (std::size_t k = 0; k < plan.tensors.size(); ++k) {
    const GgufPlanned& p = plan.tensors[k];
    RowSource source(p, tensors, reader);
    row.resize(p.dims[0]);
    const std::uint64_t rows = writer.tensors()[k].nbytes / *io::ggml_row_bytes(p.type, p.dims[0]);
    for (std::uint64_t r = 0; r < rows; ++r) {
      source.row(r, row);
      encode_row(p.type, row, p.name, block);
      if (block.size() >= kFlushBytes) {
        writer.write(block);
        block.clear();
      }
    }
    writer.write(block);
    block.clear();
    done += writer.tensors()[k].nbytes;
    if (progress) {
      progress(done, total);
    }
  }
  writer.finish(fsync ? io::GgufWriter::Sync::kFsync : io::GgufWriter::Sync::kNone);
  return total;
}

}  // namespace ferry::synth
