// Synthetic Hugging Face checkpoints for tests, demos and benchmarks: a family's
// real config.json field names and tensor names at toy sizes (presets) or at a real
// model's dimensions (read from its config.json, optionally with every width scaled
// down), sharded like save_pretrained does, with values that are a pure function of
// (seed, tensor name, element index) so any reader can recompute any element it
// loaded, or, for full-size checkpoints that cost no disk, sparse files of zeros.
//
// The synth/ layer: the loader's independent oracle. Its families (synth/family.hpp,
// one file each in synth/families/) are written from the Hugging Face models, never
// derived from models/'s descriptors; it shares only models/hf_config's field reads.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/dtype.hpp"
#include "common/float_bits.hpp"
#include "common/hash.hpp"
#include "io/gguf_names.hpp"
#include "io/gguf_types.hpp"

namespace ferry::synth {

// ---- values ----------------------------------------------------------------

// splitmix64 and fnv1a64: common/hash.hpp.

// (k - 127) / 128 with k = splitmix64((seed ^ fnv1a64(name)) + index) % 255: a
// multiple of 1/128 in [-127/128, 127/128], exact in BF16, F16 and F32, so the
// value does not depend on the dtype the checkpoint was written in.
float synth_value(std::uint64_t seed, std::string_view tensor_name, std::uint64_t index);

// Round-to-nearest-even conversions (common/float_bits.hpp).
using ferry::float_to_bf16_bits;
using ferry::float_to_f16_bits;

// Fills `out` with elements first_index, first_index + 1, ... of tensor `name`,
// encoded little-endian as `dtype` (BF16, F16 or F32). Throws ferry::Error
// (Stage::kSynth) for another dtype or a size that is not a whole number of elements.
void synth_encode(DType dtype, std::uint64_t seed, std::string_view name, std::uint64_t first_index,
                  std::span<std::byte> out);

// ---- what a checkpoint holds -------------------------------------------------

// In the order of synth/families/registry.cpp, which is stable (new families are
// appended): "llama", "qwen2", "mixtral", "qwen3_moe", "deepseek_v3", "mistral",
// "qwen2_moe", "deepseek_v2", "glm4_moe", "deepseek_v32", "qwen3", "gemma", "gemma2",
// "gemma3", "phi3". Each writes its Hugging Face architecture's names and config fields:
//   llama        LlamaForCausalLM
//   qwen2        Qwen2ForCausalLM (q/k/v biases)
//   mixtral      MixtralForCausalLM (block_sparse_moe.experts.<e>.w1/w2/w3)
//   qwen3_moe    Qwen3MoeForCausalLM (q/k norms, head_dim independent of hidden)
//   deepseek_v3  DeepseekV3ForCausalLM (MLA, F32 e_score_correction_bias, first layer
//                dense, MTP layer num_hidden_layers in the indexed shards)
//   mistral      MistralForCausalLM (Llama's tensors; config as Mistral-7B-v0.3 plus
//                head_dim, sliding_window null)
//   qwen2_moe    Qwen2MoeForCausalLM (q/k/v biases, mlp.shared_expert.* and the [1, H]
//                mlp.shared_expert_gate.weight; tiny's shared expert is exactly as wide
//                as a routed one, so it can be fused in as one more expert)
//   deepseek_v2  DeepseekV2ForCausalLM (MLA without a correction bias or MTP layer;
//                tiny and medium have q_lora_rank null, so self_attn.q_proj.weight,
//                and greedy top-k; small has q_a_proj/q_a_layernorm/q_b_proj and
//                group_limited_greedy; n_shared_experts is 2 as in the real models,
//                except tiny's 1, which can be fused)
//   glm4_moe     Glm4MoeForCausalLM (as GLM-4.5-Air: q/k/v biases, no o_proj bias,
//                head_dim x heads != hidden, F32 e_score_correction_bias, first layer
//                dense; the MTP layer num_hidden_layers is written to kSynthMtpFile,
//                which the index does not list, as in the real checkpoints)
const std::vector<std::string>& synth_families();
// Whether `family` has routed experts (and so accepts fused experts). Throws
// ferry::Error(Stage::kSynth) for an unknown family.
bool synth_family_has_experts(std::string_view family);
// The unindexed file glm4_moe's MTP layer is written to, next to the indexed shards.
inline constexpr const char* kSynthMtpFile = "mtp.safetensors";
// "tiny" (about 1-4 MiB), "small" (tens of MiB), "medium" (2-3 GiB in BF16, untied).
const std::vector<std::string>& synth_presets();
// "bf16" | "f16" | "f32" (also the safetensors spellings "BF16", "F16", "F32").
std::optional<DType> parse_synth_dtype(std::string_view text);

struct SynthTensor {
  // A constructor rather than aggregate initialization, so {name, dtype, shape} keeps
  // compiling (without -Wmissing-field-initializers) now that `file` exists.
  SynthTensor() = default;
  SynthTensor(std::string name_in, DType dtype_in, std::vector<std::uint64_t> shape_in,
              std::string file_in = {})
      : name(std::move(name_in)),
        dtype(dtype_in),
        shape(std::move(shape_in)),
        file(std::move(file_in)) {}

  std::string name;
  DType dtype = DType::kBF16;
  std::vector<std::uint64_t> shape;
  // Empty: the tensor goes to the indexed shards. Otherwise the unindexed file it is
  // written to (kSynthMtpFile for GLM-4 MoE's MTP layer).
  std::string file;
  // Empty: its values are synth_value(seed, name, i). Otherwise those of this name:
  // compressed-tensors' per-tensor FP8 gives an expert's up (w3) input_scale its gate
  // (w1) one's value (synth_value_name), as real checkpoints calibrate both on the
  // same input and SGLang refuses unequal ones.
  std::string value_name;

  std::uint64_t elements() const;
  std::uint64_t nbytes() const;
};

// Every tensor in Hugging Face state-dict order (embed, layers 0..L-1, the
// DeepSeek-V3 or GLM-4 MoE MTP layer, norm, lm_head). `dtype` is the weights' dtype;
// DeepSeek-V3's and GLM-4 MoE's e_score_correction_bias is F32 whatever it is, as in
// the real checkpoints. `tie_embeddings` leaves out lm_head.weight. `fused_experts`
// writes each MoE layer's routed experts (MTP layers' too; shared experts stay as
// they are) as the two 3-D tensors of synth_fused_expert_element. Throws
// ferry::Error(Stage::kSynth) for an unknown family or preset, a dtype other than
// BF16, F16, F32, or fused experts for a dense family.
std::vector<SynthTensor> synth_tensor_list(std::string_view family, std::string_view preset,
                                           DType dtype, bool tie_embeddings,
                                           bool fused_experts = false);

// ---- quantized checkpoints ----------------------------------------------------------

// What the quantized linear layers' weights (SGLang's: *_proj.weight but eh_proj and
// the indexer's weights_proj, Mixtral's experts' w1/w2/w3, the indexer's wq_b and wk;
// synth's own rule, not models/'s) are stored as, each followed by its companions in
// the same file:
//   kFp8Block     quant_method fp8, weight_block_size [b, b] (DeepSeek-V3, Qwen3 FP8):
//                 F8_E4M3, <w>_scale_inv F32 [ceil(N / b), ceil(K / b)]
//   kFp8Channel   compressed-tensors, strategy channel, dynamic per-token inputs:
//                 F8_E4M3, weight_scale F32 [N, 1]
//   kFp8Tensor    compressed-tensors, strategy tensor, static per-tensor inputs:
//                 F8_E4M3, weight_scale F32 [], input_scale F32 []
//   kModelOptFp8  ModelOpt FP8 (hf_quant_config.json, FP8 KV cache): F8_E4M3,
//                 weight_scale F32 [], input_scale F32 []; and each attention's
//                 self_attn.k_proj.k_scale / v_proj.v_scale (MLA too, as ModelOpt
//                 names them) F32 []
//   kNvfp4        ModelOpt NVFP4, group 16: U8 [N, K / 2] (two E2M1 values a byte),
//                 weight_scale F8_E4M3 [N, K / 16], weight_scale_2 F32 [],
//                 input_scale F32 []
// ("<w>" is the weight's name less "weight".) Values are synth values (a weight's
// FP8 values the E4M3 nearest synth_value, packed bytes any byte, a scale plain
// synth values, so a scale may be negative: they check placement, not a real
// quantization).
enum class SynthQuant { kNone, kFp8Block, kFp8Channel, kFp8Tensor, kModelOptFp8, kNvfp4 };
inline constexpr std::uint64_t kSynthNvfp4Group = 16;

// "none", "fp8-block", "fp8-channel", "fp8-tensor", "modelopt-fp8", "nvfp4";
// nullopt for anything else.
std::optional<SynthQuant> parse_synth_quant(std::string_view text);
std::string_view to_string(SynthQuant quant);

// The name whose synth values tensor `name` of a `quant` checkpoint holds (see
// SynthTensor::value_name): kFp8Tensor's "...experts.E.up_proj.input_scale" (or
// w3.input_scale) takes "...experts.E.gate_proj.input_scale" (w1); every other
// tensor its own name.
std::string synth_value_name(SynthQuant quant, std::string_view name);

// Turns `tensors` into `quant`'s layout, in place (`block` is kFp8Block's b).
// Throws ferry::Error(Stage::kSynth) for block 0 with kFp8Block, for a weight that
// is not 2-D (fused 3-D experts), and for an NVFP4 weight whose K is not a multiple
// of 16.
void synth_quantize(std::vector<SynthTensor>& tensors, SynthQuant quant, std::uint64_t block);

// config.json's quantization_config for `quant` (kFp8Block: quant_method fp8, fmt
// e4m3, activation_scheme dynamic, weight_block_size [block, block]; the
// compressed-tensors ones with one config group targeting Linear and ignore
// ["lm_head"]); null for kNone and the ModelOpt ones, whose settings go to
// hf_quant_config.json.
nlohmann::json synth_quant_config(SynthQuant quant, std::uint64_t block);
// hf_quant_config.json for the ModelOpt ones (producer modelopt; quant_algo FP8
// with kv_cache_quant_algo FP8, or NVFP4 with group_size 16; exclude_modules
// ["lm_head"]); null for the others.
nlohmann::json synth_hf_quant_config(SynthQuant quant);

// ---- fused experts -------------------------------------------------------------

// With fused experts, the MoE block at `moe_prefix` ("model.layers.<i>.mlp.", or
// "model.layers.<i>.block_sparse_moe." for mixtral) holds, instead of
// <moe_prefix>experts.<e>.{gate_proj,up_proj,down_proj}.weight (mixtral: w1, w3, w2):
//   <moe_prefix>experts.gate_up_proj  [E, 2I, H]  expert e's gate rows 0..I-1, then its
//                                                  up rows I..2I-1
//   <moe_prefix>experts.down_proj     [E, H, I]
// with E routed experts, H = hidden_size and I = moe_intermediate_size (mixtral:
// intermediate_size). Their values are those of the fused names themselves,
// synth_value(seed, "<moe_prefix>experts.gate_up_proj", flat index), so element
// (r, c) of expert e's per-expert matrix is at flat index
//   gate [I, H]:  (e * 2I + r) * H + c        of gate_up_proj
//   up   [I, H]:  (e * 2I + I + r) * H + c    of gate_up_proj
//   down [H, I]:  (e * H + r) * I + c         of down_proj
// which synth_fused_expert_element computes.
enum class ExpertProj { kGate, kUp, kDown };
struct SynthElement {
  std::string tensor;       // the fused tensor's name
  std::uint64_t index = 0;  // flat (row-major) element index in it
};
SynthElement synth_fused_expert_element(std::string_view moe_prefix, ExpertProj proj,
                                        std::uint64_t expert, std::uint64_t row, std::uint64_t col,
                                        std::uint64_t hidden, std::uint64_t inter);

// config.json: the family's Hugging Face field names with the preset's sizes.
nlohmann::json synth_config(std::string_view family, std::string_view preset, DType dtype,
                            bool tie_embeddings);

// Shard size used when SynthOptions::shard_bytes is 0: tiny 512 KiB (so every
// tiny checkpoint has several shards), small 16 MiB, medium 512 MiB.
std::uint64_t synth_default_shard_bytes(std::string_view preset);

// The shards' file format, and the index that lists them.
enum class SynthFormat {
  // model-<i>-of-<n>.safetensors, model.safetensors.index.json.
  kSafetensors,
  // pytorch_model-<i>-of-<n>.bin, each byte for byte what torch.save writes for an
  // OrderedDict of the shard's tensors (io/torch_writer.hpp), and
  // pytorch_model.bin.index.json, as save_pretrained(safe_serialization=False) names
  // them. No metadata (a .bin has none), no sparse files (every member needs the
  // CRC-32 of its bytes) and no unindexed files (glm4_moe's mtp.safetensors).
  kTorchBin,
  // One file, kSynthGgufFile, as llama.cpp's convert_hf_to_gguf.py would write it for
  // the safetensors checkpoint of the same options (see "GGUF" below). No config.json
  // and no index: the GGUF metadata carries the config, as in a real GGUF.
  kGguf,
};
// "safetensors" | "bin" | "gguf"; nullopt for anything else.
std::optional<SynthFormat> parse_synth_format(std::string_view text);
std::string_view to_string(SynthFormat format);
// model.safetensors.index.json or pytorch_model.bin.index.json (kGguf has no index:
// empty).
std::string_view synth_index_file(SynthFormat format);

// ---- GGUF (--format gguf) ------------------------------------------------------------

// What kGguf writes is the converter's output for the checkpoint synth would write as
// safetensors with the same options:
//  - the architectures io/gguf_names maps: llama, mistral and mixtral as "llama",
//    qwen2, qwen3, qwen3_moe as "qwen3moe", deepseek_v2 and deepseek_v3 as
//    "deepseek2". The other families, --sparse, --quant and --fused-experts are
//    refused (Error(Stage::kSynth) naming the reason);
//  - tensor names: io::match_hf_name; q_proj / k_proj rows (weights and biases) of
//    the llama architecture permuted as LlamaModel.permute does (n_head for q,
//    n_head_kv for k); each MoE layer's routed experts stacked into ffn_*_exps
//    (ggml dims [in, out, E], expert e the e-th slice); DeepSeek's kv_b_proj split
//    per head into attn_k_b (k half transposed: [nope, rank, n_head]) and attn_v_b
//    ([rank, v_head_dim, n_head]), as DeepseekV2Model.modify_tensors does since
//    April 2025; DeepSeek-V3's MTP layer left out, as the converter leaves it out;
//  - values: the synth values of the HF tensors, read as the checkpoint's dtype and
//    converted to float32, then to each tensor's type (synth_gguf_tensor_type); every
//    value is exact in F32, F16 and BF16 (multiples of 1/128 below 1), Q8_0 is
//    io::quantize_q8_0 of them (gguf-py's bytes);
//  - metadata: general.architecture, general.type "model", general.name ("ferry synth
//    " and how it was made), the {arch}.* keys TextModel.set_gguf_parameters and the
//    architecture's converter class write from config.json (block_count,
//    context_length, embedding_length, feed_forward_length, attention.head_count,
//    head_count_kv, layer_norm_rms_epsilon, rope.freq_base, key/value_length when
//    head_dim is given, expert_* , DeepSeek's MLA lengths and ranks, vocab_size and
//    rope.dimension_count where the class writes them, rope scaling of type linear
//    or yarn; other rope_scaling types are refused), general.file_type
//    (synth_gguf_file_type) and general.quantization_version 2. No tokenizer
//    section: synth has no tokenizer, and io/gguf_config needs none (it takes the
//    vocabulary size from token_embd.weight). The config is read from config.json
//    alone, not through transformers' AutoConfig, so fields a config class would
//    default (head_dim of a config without one) are not written.
inline constexpr const char* kSynthGgufFile = "model.gguf";

// "f32" | "f16" | "bf16" | "q8_0" (also "F32", "F16", "BF16", "Q8_0"); nullopt for
// anything else.
std::optional<io::GgmlType> parse_synth_gguf_type(std::string_view text);
// llama.cpp's architecture for `family`; nullopt for a family kGguf refuses.
std::optional<io::GgufArch> synth_gguf_arch(std::string_view family);
// general.file_type as the converter writes it (gguf-py's LlamaFileType): ALL_F32 0,
// MOSTLY_F16 1, MOSTLY_Q8_0 7, MOSTLY_BF16 32. Throws ferry::Error(Stage::kSynth) for
// another type.
std::uint32_t synth_gguf_file_type(io::GgmlType type);
// The type convert_hf_to_gguf.py's prepare_tensors gives GGUF tensor `gguf_name` of
// ggml dims `dims` with --outtype `requested`: F32 for 1-D tensors and *_norm.weight
// whatever the type (norms, biases, DeepSeek's exp_probs_b.bias), and for the router
// ffn_gate_inp.weight and any name not ending in ".weight"; `requested` otherwise,
// except that a Q8_0 tensor whose rows (dims[0]) are not whole blocks of 32 falls
// back to F16, as the converter does on gguf-py's QuantError.
io::GgmlType synth_gguf_tensor_type(std::string_view gguf_name,
                                    const std::vector<std::uint64_t>& dims, io::GgmlType requested);

struct SynthShard {
  // model-00001-of-00003.safetensors (pytorch_model-00001-of-00003.bin), or
  // mtp.safetensors
  std::string file;
  std::vector<std::size_t> tensors;  // positions in the tensor list, in file order
  std::uint64_t data_bytes = 0;
  bool indexed = true;  // listed in the index
};

// Greedy packing in list order of the tensors without a `file`: a tensor never spans
// shards, a shard is closed when the next tensor would take it past `shard_bytes`,
// and a tensor larger than `shard_bytes` gets a shard of its own. These are named
// model-<i>-of-<n>.safetensors (kTorchBin: pytorch_model-<i>-of-<n>.bin; the plan is
// the same). Then one unindexed shard per distinct `file`, whatever its size,
// holding that file's tensors in list order.
std::vector<SynthShard> synth_shard_plan(const std::vector<SynthTensor>& tensors,
                                         std::uint64_t shard_bytes,
                                         SynthFormat format = SynthFormat::kSafetensors);

// ---- a real model's dimensions ---------------------------------------------------

// A real Hugging Face config.json to synthesize a checkpoint of, checked: its family
// comes from architectures[0] (LlamaForCausalLM llama, Qwen2ForCausalLM qwen2,
// MistralForCausalLM mistral, MixtralForCausalLM mixtral, Qwen3MoeForCausalLM
// qwen3_moe, Qwen2MoeForCausalLM qwen2_moe, DeepseekV2ForCausalLM deepseek_v2,
// DeepseekV3ForCausalLM deepseek_v3, Glm4MoeForCausalLM glm4_moe) and its sizes from
// the family's own field names (hidden_size, intermediate_size, num_hidden_layers,
// num_attention_heads, num_key_value_heads, head_dim or hidden / heads, vocab_size,
// num_local_experts / num_experts / n_routed_experts, moe_intermediate_size,
// shared_expert_intermediate_size, q_lora_rank (null: a plain q_proj), kv_lora_rank,
// qk_nope_head_dim, qk_rope_head_dim, v_head_dim, n_shared_experts,
// first_k_dense_replace, num_nextn_predict_layers (absent or 0: no MTP layer),
// use_qk_norm (GLM-4 MoE), tie_word_embeddings, ...; absent optional fields mean what
// they mean to ferry's models). Values the family's tensor list cannot express are
// refused, never ignored: Qwen-MoE mlp_only_layers not empty or decoder_sparse_step
// != 1 (every layer is sparse here); DeepSeek moe_layer_freq != 1, no routed or no
// shared experts, a topk_method that changes whether the router has
// e_score_correction_bias (V3: noaux_tc only; V2: anything else); DeepSeek-V3 and
// GLM-4 MoE num_nextn_predict_layers above 1, DeepSeek-V2's above 0; attention_bias
// true for Llama, Qwen3-MoE and DeepSeek, false or absent for GLM-4 MoE; Llama
// mlp_bias true; a missing, zero or non-integer size.
struct SynthSource {
  std::string file;               // the path it was read from, named in every error
  nlohmann::json config;          // as read
  std::string family;             // one of synth_families()
  std::uint64_t hidden_size = 0;  // the config's hidden_size
};

// Reads and checks `path`. Throws ferry::Error(Stage::kSynth) naming the file (and the
// field) when it is missing, does not parse, names another architecture or holds a
// value the family cannot express.
SynthSource read_synth_source(const std::string& path);
// The same checks on a config already parsed; `file` is only named in errors.
SynthSource synth_source(nlohmann::json config, std::string file);

// With --scale-dims H: `width` scaled by H / hidden, rounded up to a multiple of 8 and
// at least 8 (0 stays 0: an absent width, such as q_lora_rank null).
std::uint64_t synth_scaled_width(std::uint64_t width, std::uint64_t hidden,
                                 std::uint64_t scale_hidden);

// The tensors of `source`'s model, exactly as the family's preset lists are built
// (same names, order and dtypes; tie_word_embeddings decides lm_head.weight). With
// `scale_hidden` > 0, hidden_size becomes scale_hidden and intermediate_size,
// moe_intermediate_size, shared_expert_intermediate_size, q_lora_rank, kv_lora_rank,
// qk_nope_head_dim, qk_rope_head_dim, v_head_dim and head_dim are scaled by
// synth_scaled_width; layers, experts, heads, key/value heads, shared experts and the
// vocabulary stay. scale_hidden must be a multiple of 8 below hidden_size.
std::vector<SynthTensor> synth_tensor_list(const SynthSource& source, DType dtype,
                                           std::uint64_t scale_hidden = 0,
                                           bool fused_experts = false);

// config.json for that checkpoint: the source config less quantization_config (the
// weights are plain `dtype`; synthesize() puts it back for an FP8 checkpoint), torch_dtype (and
// `dtype`, when the config has one) set to what is written, and with `scale_hidden` the scaled
// fields replaced (head_dim always written for the grouped-query families, since hidden / heads
// changed).
nlohmann::json synth_config(const SynthSource& source, DType dtype, std::uint64_t scale_hidden = 0);

// Shard size used with a source config when SynthOptions::shard_bytes is 0: 5 GiB,
// as save_pretrained's default.
inline constexpr std::uint64_t kSynthSourceShardBytes = std::uint64_t{5} << 30;

// ---- writing -----------------------------------------------------------------

// The model is given one of two ways: `family` and `preset`, or `from_config`.
struct SynthOptions {
  std::string family;              // one of synth_families()
  std::string preset;              // one of synth_presets()
  std::string from_config;         // a real config.json (read_synth_source) instead
  std::uint64_t scale_hidden = 0;  // with from_config: see synth_tensor_list (0 = real sizes)
  std::string out;                 // the checkpoint folder to create
  std::uint64_t seed = 1;          // input of synth_value
  DType dtype = DType::kBF16;      // BF16, F16 or F32
  std::uint64_t shard_bytes = 0;   // 0 = synth_default_shard_bytes(preset), or 5 GiB
  bool tie_embeddings = false;     // no lm_head.weight; config says tied (presets only)
  bool fused_experts = false;      // 3-D experts.gate_up_proj / experts.down_proj (MoE only)
  // The quantized layers' weights (synth_quantize). With from_config,
  // quant_from_config instead takes it from the config's quantization_config: fp8
  // with weight_block_size [b, b] gives kFp8Block with block b (and keeps that
  // quantization_config); anything else gives kNone (and strips it).
  SynthQuant quant = SynthQuant::kNone;
  std::uint64_t quant_block = 0;  // b for kFp8Block; 0: the config's, else 128
  bool quant_from_config = false;
  // Every shard's data region is a hole (ftruncate, nothing written): real headers,
  // zeros for data, no disk used, so full-size checkpoints take seconds. Its values
  // are not synth_value's.
  bool sparse = false;
  // The shards' format: kTorchBin for PyTorch .bin shards, refused with `sparse` and
  // for a checkpoint with unindexed files (glm4_moe); kGguf for one GGUF file (see
  // "GGUF" above; shard_bytes does not apply).
  SynthFormat format = SynthFormat::kSafetensors;
  // kGguf: the converter's --outtype: F32, F16 (its default), BF16 or Q8_0; norms,
  // biases and routers stay F32 (synth_gguf_tensor_type). Ignored by other formats.
  io::GgmlType gguf_type = io::GgmlType::kF16;
  bool force = false;  // replace an existing non-empty `out`
  bool fsync = true;   // durable before the rename makes it visible
  // Called after each shard with (data bytes written so far, total data bytes).
  std::function<void(std::uint64_t, std::uint64_t)> progress;
};

struct SynthResult {
  // Paths under `out`: shards, index, config.json (kGguf: model.gguf alone).
  std::vector<std::string> files;
  // All tensor data bytes written: the index's metadata.total_size plus those of the
  // unindexed files (glm4_moe's mtp.safetensors); kGguf: the GGUF tensors' bytes,
  // padding left out.
  std::uint64_t total_bytes = 0;
  std::size_t tensors = 0;  // kGguf: the GGUF tensors (stacked experts count once)
  std::size_t shards = 0;   // shard files written, unindexed ones included (kGguf: 1)
  std::string family;       // the family written (from_config: the one it names)
};

// Writes config.json, the index (synth_index_file(format), listing the indexed
// shards' tensors; total_size is their data bytes), hf_quant_config.json for the
// ModelOpt layouts, and the shards (kGguf: model.gguf alone) into a
// temporary sibling folder, then renames it to `out`, so a crash never leaves a
// checkpoint that looks complete. An existing empty `out` is replaced; a
// non-empty one only with `force`, and only when it holds nothing but regular
// files named *.safetensors, *.bin, *.gguf or *.json, so a mistyped --out cannot
// wipe an unrelated folder. With `sparse`, each shard is its 8-byte length and header, then
// ftruncate to the full size. Errors are ferry::Error(Stage::kSynth).
SynthResult synthesize(const SynthOptions& options);

}  // namespace ferry::synth
