// One descriptor per synthetic family: what synth needs to know of a family, in one
// place. A new family is one file in synth/families/ (its descriptors) plus one line
// per family in synth/families/registry.cpp, next to its models/families/ file.
//
// A descriptor holds
// - its names: the family name (--family, config.json's model_type) and its
//   architectures (config.json's architectures[0]; the first is the one written);
// - whether it has routed experts (and so takes fused experts);
// - its preset sizes, and its sizes read from a real config.json, refusing what its
//   tensor list cannot express;
// - a decoder layer's tensors (and its MTP layer's, where it has one);
// - the config.json fields it writes on top of the common ones.
//
// Synth is the loader's independent oracle: its tensor lists are written from the
// Hugging Face models, never derived from models/'s descriptors, or the loader would
// be tested against itself. Same shape of code, separate data. Only the typed field
// reads of models/hf_config.hpp are shared.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.hpp"
#include "synth/synth.hpp"

namespace ferry::synth {

enum class Preset { kTiny, kSmall, kMedium };

// Sizes of one model. Attention heads x head_dim equals hidden for the families whose
// configs imply head_dim = hidden / heads (Llama, Qwen2, Mixtral, Mistral, Qwen2-MoE);
// Qwen3-MoE medium and small and every GLM-4 MoE preset deliberately differ, as the
// real Qwen3 and GLM-4.5 models do.
struct Dims {
  std::uint64_t hidden = 0;
  std::uint64_t intermediate = 0;
  std::uint64_t layers = 0;
  std::uint64_t heads = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;
  std::uint64_t vocab = 0;
  std::uint64_t experts = 0;
  std::uint64_t experts_per_tok = 0;
  std::uint64_t moe_intermediate = 0;
  std::uint64_t shared_intermediate = 0;  // Qwen2-MoE's one shared expert
  // DeepSeek-V2/V3 (MLA and routing), GLM-4 MoE (routing only)
  std::uint64_t q_lora_rank = 0;  // 0: q_lora_rank null, a plain q_proj (DeepSeek-V2-Lite)
  std::uint64_t kv_lora_rank = 0;
  std::uint64_t qk_nope = 0;
  std::uint64_t qk_rope = 0;
  std::uint64_t v_head = 0;
  std::uint64_t shared_experts = 0;
  std::uint64_t first_k_dense = 0;
  std::uint64_t n_group = 0;
  std::uint64_t topk_group = 0;
  // DeepSeek-V3 and GLM-4 MoE: num_nextn_predict_layers, 0 or 1 (every preset has 1).
  std::uint64_t nextn_layers = 1;
  // DeepSeek-V3.2's indexer in every layer (the MTP layer's too): index_n_heads and
  // index_head_dim; 0 = none.
  std::uint64_t index_heads = 0;
  std::uint64_t index_head_dim = 0;
  bool qk_norm = false;  // GLM-4 MoE's use_qk_norm (GLM-4.5 has it, GLM-4.5-Air not)
};

// A tensor list in state-dict order, built from the pieces the families share.
class ListBuilder {
 public:
  ListBuilder(DType dtype, const Dims& d, bool fused_experts)
      : dtype_(dtype), d_(d), fused_experts_(fused_experts) {}

  void add(std::string name, std::vector<std::uint64_t> shape);
  void add_typed(std::string name, DType dtype, std::vector<std::uint64_t> shape);
  // Tensors added from now on go to the unindexed file `file` ("" = the indexed shards).
  void set_file(std::string file) { file_ = std::move(file); }

  // Llama-style attention; Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k norms.
  void attention(const std::string& p, bool bias, bool qk_norm);
  // DeepSeek multi-head latent attention. Without a query LoRA (q_lora_rank null, as
  // DeepSeek-V2-Lite) the query is one plain projection.
  void mla(const std::string& p);
  void gated_mlp(const std::string& p, std::uint64_t inter);
  // The routed experts of the MoE block at `p` (which ends in "mlp." or
  // "block_sparse_moe."): per expert, or with --fused-experts the two 3-D tensors
  // described at synth_fused_expert_element.
  void routed_experts(const std::string& p, std::uint64_t inter, bool mixtral_names);
  // DeepseekV3MoE (and GLM-4 MoE, derived from it) registers experts, then the gate,
  // then the shared experts. DeepSeek-V2's gate has no correction bias.
  void deepseek_moe(const std::string& p, bool score_bias);
  // The multi-token-prediction layer's own embedding-side tensors (enorm, hnorm,
  // eh_proj), before its decoder layer; and its head, after it.
  void mtp_inputs(const std::string& p);
  void mtp_head(const std::string& p);
  void layer_norms(const std::string& p);

  std::vector<SynthTensor> take() { return std::move(out_); }

 private:
  DType dtype_;
  const Dims& d_;
  bool fused_experts_;
  std::string file_;
  std::vector<SynthTensor> out_;
};

// "model.layers.<i>."
std::string layer_prefix(std::uint64_t i);

struct SynthFamily {
  std::string name;                        // "llama": --family, the preset's model_type
  std::vector<std::string> architectures;  // "LlamaForCausalLM"; the first is written
  bool routed_experts = false;             // takes --fused-experts
  // false: the output projection is always the embedding (Gemma): no lm_head.weight
  // is written, and the family's config says tied.
  bool lm_head = true;
  // Multi-head latent attention (DeepSeek): head_dim is not hidden / heads, so a
  // scaled config replaces head_dim and qk_head_dim instead of writing head_dim.
  bool mla = false;
  Dims (*preset_dims)(Preset preset) = nullptr;
  // The sizes of a real config.json beyond the common ones (hidden_size,
  // num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, which `d`
  // holds), through models/hf_config.hpp's reads; refuses what its tensor list
  // cannot express with refuse() and the require_* helpers below.
  void (*config_dims)(const nlohmann::json& config, Dims& d) = nullptr;
  // Decoder layer `i`'s tensors at prefix `p`, but its two layer norms.
  void (*layer)(ListBuilder& b, const Dims& d, std::uint64_t i, const std::string& p) = nullptr;
  // Its multi-token-prediction layer (layer num_hidden_layers), written when
  // Dims::nextn_layers is 1; none: the family has no MTP layer.
  void (*mtp)(ListBuilder& b, const Dims& d) = nullptr;
  // Its preset config.json fields on top of the common ones (synth_config).
  void (*config)(nlohmann::json& c, const Dims& d) = nullptr;
};

// Every family (synth/families/registry.cpp), in synth_families()'s order, and the one
// named `name` (Error(Stage::kSynth) naming the known ones when none).
const std::vector<SynthFamily>& synth_family_registry();
const SynthFamily& find_synth_family(std::string_view name);

// ---- refusing what a family cannot express (Error(Stage::kConfig), which
// synth_source turns into Error(Stage::kSynth) naming the file) ----------------------

[[noreturn]] void refuse(std::string_view key, const std::string& why);
// Fields the family's tensor list has no way to honour: refuse anything else.
void require_count(const nlohmann::json& config, std::string_view key, std::uint64_t fallback,
                   std::uint64_t want, const std::string& why);
void require_bool(const nlohmann::json& config, std::string_view key, bool fallback, bool want,
                  const std::string& why);
// Qwen-MoE: the list must be empty (absent or null counts as empty).
void require_empty_list(const nlohmann::json& config, std::string_view key, const std::string& why);
// Whether `key` is present and not null.
bool config_has(const nlohmann::json& config, std::string_view key);

// ---- shared by synth's files ---------------------------------------------------------

[[noreturn]] void fail(const std::string& file, std::string rule);
// BF16, F16 or F32; Error(Stage::kSynth) otherwise.
void check_dtype(DType dtype);

}  // namespace ferry::synth
