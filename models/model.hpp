// What the load pipeline asks of a model family: the parameter shells every local
// tensor-parallel rank allocates, and for each checkpoint tensor where its bytes go
// (the route: a list of 2-D copy pieces, or a drop with a reason). Everything here
// is plain data computed from config.json and the parallel layout; nothing touches
// a file or a device, so placement is tested element by element on the host.
//
// Vocabulary (shared with ARCHITECTURE.md sections 2 and 4):
//   param  a slot in a rank's shell, allocated once on that rank's device;
//   piece  one 2-D copy from the checkpoint tensor's bytes into a param (or a zero
//          fill of a param region, for padding);
//   route  every piece one checkpoint tensor feeds, over all local ranks, plus the
//          smallest byte range of the tensor the reader must fetch for them.
//
// Invariant the coordinator relies on: the pieces that write one param (over all
// routes of a checkpoint, fill_pieces() and hook outputs) never overlap, so "this
// param is complete" is a byte count (see models/coverage.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/dtype.hpp"
#include "io/safetensors.hpp"

namespace ferry::gpu {
class Stream;
}  // namespace ferry::gpu

namespace ferry::models {

using Shape = std::vector<std::uint64_t>;

// "[4096, 128]" for messages.
std::string format_shape(const Shape& shape);

// How the model is split over devices, and which part this process serves.
struct ParallelLayout {
  int tp = 1;       // tensor-parallel world size
  int ep = 1;       // expert-parallel size (MoE families; dense families require 1)
  int pp = 1;       // pipeline stages
  int pp_rank = 0;  // this process's stage
  // Decoder layers per stage (pp entries summing to num_hidden_layers); empty =
  // SGLang's get_pp_indices (L / pp each, one more on each of the last L % pp
  // stages). See pp_layers().
  // TP ranks this process serves, in device order: local rank i drives the i-th
  // device and holds tp rank local_ranks[i]. Empty means every rank 0..tp-1 (one
  // process driving all devices); Model::layout() reports the filled-in list.
  std::vector<int> local_ranks;
  std::vector<int> pp_partition;
  // The deployment layouts of SGLang 0.5.23 (families whose descriptor declares
  //   them, FamilyDescriptor::attention_dp; make_model refuses them for the others):
  // - attn_dp: attention data parallelism (enable_dp_attention with dp_size): the
  //   attention's projections (MLA's q_b / q_proj, kv_b and o_proj; qkv_proj and
  //   o_proj) split over the attention tp group, attn_tp() = tp / attn_dp ranks,
  //   rank r being attention rank r % attn_tp(), where the family's SGLang model
  //   builds them so; the embedding over the attention group or all tp ranks, as
  //   the family's descriptor says. 1 = off.
  // - dp_lm_head (enable_dp_lm_head, needs attn_dp > 1): lm_head over the attention
  //   tp group instead of all tp ranks, for the families whose lm_head takes it.
  // - moe_dense_tp (moe_dense_tp_size): 0 = none (the dense MLP layers over all tp
  //   ranks), 1 = the dense MLP layers whole on every rank.
  // - moe_a2a kDeepep (moe_a2a_backend deepep, needs ep == tp): shared experts whole
  //   on every rank and never fused into the routed experts.
  int attn_dp = 1;
  bool dp_lm_head = false;
  int moe_dense_tp = 0;
  enum class MoeA2a { kNone, kDeepep };
  MoeA2a moe_a2a = MoeA2a::kNone;

  int attn_tp() const { return tp / attn_dp; }
};

struct ParamSpec {
  std::string name;  // SGLang's parameter name, e.g. model.layers.0.self_attn.qkv_proj.weight
  DType dtype = DType::kBF16;
  Shape shape;                         // this rank's local shape
  std::vector<std::uint64_t> strides;  // in elements; contiguous row-major except
                                       // where a family says (MLA w_kc / w_vc)
  std::uint64_t nbytes = 0;
  // Needed only while loading: the checkpoint's pieces fill it, post-load hooks read
  // it, and the loaded model does not keep it (quantization.online's full-precision
  // weights). The runtime frees it once every hook reading it has run (load.layered:
  // allocated on its first write, freed right after; else at the end of the load).
  bool transient = false;
  // Set where a post-load hook re-lays the param out in place into `shape` (the same
  // bytes; flashinfer_trtllm's block layout of BF16 experts): the shape its
  // checkpoint pieces and fills address. Empty: `shape` itself.
  Shape loaded_shape;

  const Shape& placed_shape() const { return loaded_shape.empty() ? shape : loaded_shape; }
};

// The params of one local rank. Every local rank of a dense family has the same
// names and shapes; later families (experts, uneven splits) may differ per rank.
struct RankShell {
  int tp_rank = 0;
  std::vector<ParamSpec> params;                         // sorted by name
  std::unordered_map<std::string, std::size_t> by_name;  // name -> index in params
};

// One copy: a 2-D block of `rows` rows of `width_elems` elements each.
// Source offsets are bytes in the checkpoint tensor's dtype, relative to the start
// of the tensor's data; destination offsets are bytes in the param's dtype,
// relative to the start of the param's storage. Row i goes from
// src_offset + i*src_pitch to dst_offset + i*dst_pitch. When src_dtype != dst_dtype
// the copy casts element by element (only between BF16, F16 and F32). A block that
// is contiguous on both sides has rows == 1 and pitches equal to the row's bytes.
// A kZero piece has no source (src_* are 0, src_dtype == dst_dtype): it zero-fills
// the destination block (vocabulary padding, later padded tails).
struct Piece {
  enum class Kind { kCopy, kZero };
  Kind kind = Kind::kCopy;
  std::size_t local_rank = 0;  // index into layout().local_ranks and shells()
  std::size_t param = 0;       // index into that rank's shell params
  std::uint64_t dst_offset = 0;
  std::uint64_t dst_pitch = 0;
  std::uint64_t src_offset = 0;
  std::uint64_t src_pitch = 0;
  std::uint64_t rows = 0;
  std::uint64_t width_elems = 0;
  DType src_dtype = DType::kBF16;
  DType dst_dtype = DType::kBF16;
  // Not kNone: the source rows are GGML blocks of this format holding src_dtype (F32)
  // elements (io::TensorInfo::blocks): offsets, pitch and width are whole blocks, and
  // the copy dequantizes (gpu::Stream::dequantize_ggml_2d).
  GgmlBlocks src_blocks = GgmlBlocks::kNone;

  std::uint64_t dst_bytes() const;      // rows * width_elems * size of dst_dtype
  std::uint64_t src_row_bytes() const;  // a source row: its elements or its blocks
  // One past the last source byte the piece reads (0 for a zero piece).
  std::uint64_t src_end() const;

  bool operator==(const Piece&) const = default;
};

enum class RouteKind { kPlaced, kDropped, kUnmapped };
std::string_view to_string(RouteKind kind);

struct Route {
  RouteKind kind = RouteKind::kPlaced;
  // Stable code (docs/plan-json.md lists them all). Dropped: "inv_freq"
  // (rotary_emb.inv_freq), "rope_cache" (rotary_emb.cos_cached / sin_cached),
  // "no_bias_param" (a Llama/Mistral bias SGLang has no param for),
  // "tied_lm_head" (lm_head.weight with tie_word_embeddings), "no_local_slice" (the
  // local ranks' slices are all padding), "pp_stage" (a layer of another pipeline
  // stage), "first_stage_only" / "last_stage_only" (embed_tokens; norm and lm_head),
  // "remote_expert" (no local rank owns the expert), "mtp_layer" (an MTP layer when
  // loading the target model), "draft_target" (a target-model tensor when loading
  // the draft), "no_indexer" (DeepSeek-V3.2 indexer tensors of a layer without one),
  // "draft_shared" (embed_tokens / shared_head.head of the MTP layer,
  // shared with the target), "overwritten_scale" (an expert's w1 input_scale, which
  // SGLang overwrites with w3's); a presharded folder's "other_rank", "padding" and
  // "empty" (models/presharded_model.hpp). Unmapped:
  // "unknown_name". Empty when placed.
  std::string reason;
  std::vector<Piece> pieces;  // copy pieces only, grouped by local rank
  // Smallest contiguous byte range of the tensor (relative to its data start) that
  // covers every piece's source; src_begin == src_end when nothing is read.
  std::uint64_t src_begin = 0;
  std::uint64_t src_end = 0;
};

// What a post-load hook may touch while it runs. The pipeline implements it over
// the hook's device; tests implement it over host buffers.
class HookContext {
 public:
  virtual ~HookContext() = default;
  // Device pointer to the storage of param `param` (an index into the hook's rank
  // shell). Only the hook's declared inputs and outputs may be asked for.
  virtual std::byte* param_data(std::size_t param) = 0;
  // The stream of the hook's device. The hook only enqueues work; the pipeline
  // synchronizes the stream before it reports the outputs complete.
  virtual gpu::Stream& stream() = 0;
  // Gives output `param` new storage of the same size on the hook's device and
  // returns it; param_data(param) returns it from then on. For a hook that must
  // rebuild a buffer out of place; only a hook that declares `reallocates` may ask.
  // The old storage stays allocated until the loaded model is released (a captured
  // graph may point at it). Throws ferry::Error(Stage::kPostProcess) when refused.
  virtual std::byte* reallocate(std::size_t param);
  // Device scratch on the hook's device, at least `bytes` long, for temporaries
  // (contents undefined; later work of the same stream may reuse it, so the hook
  // only uses it for work it queues). Made before the hook runs, at least the
  // hook's declared `scratch_bytes`: a hook never allocates while it runs (a
  // commit() may run inside another thread's CUDA graph capture). Throws
  // ferry::Error(Stage::kPostProcess) when `bytes` is more than the context holds;
  // bytes == 0 gives null.
  virtual std::byte* scratch(std::size_t bytes);
};

// Work that runs on one local rank once every input param is complete and that
// fills every output param entirely (e.g. MLA kv_b_proj -> w_kc / w_vc). Outputs are
// written only by the hook: no piece may target them.
struct PostLoadHook {
  std::string name;                  // stable, for errors and traces
  std::size_t local_rank = 0;        // index into shells()
  std::vector<std::size_t> inputs;   // param indices that must be complete first
  std::vector<std::size_t> outputs;  // param indices the hook fills
  // Params the hook rewrites in place (same bytes, same dtype), after the checkpoint's
  // pieces filled them: the hook waits for them as for its inputs, and they count as
  // complete (for on_layer_ready and the end of the load) only once it has run. A hook
  // that reads a param another hook rewrites must see it first: the rewriting hook
  // lists one of that hook's outputs among its inputs (validate_hooks checks it).
  std::vector<std::size_t> rewrites;
  std::function<void(HookContext&)> run;
  // What a capture-safe startup (runtime prepare()/commit() in overlap mode) needs:
  // it runs every hook twice, on sentinel weights and then on the real ones, into
  // storage that must not move. `idempotent`: the outputs depend only on the inputs
  // as they are when the hook runs (not on an earlier run, nor on outputs it wrote
  // before). `reallocates`: the hook calls HookContext::reallocate. A hook that is
  // not idempotent or that reallocates refuses the overlap (runtime admission).
  bool idempotent = true;
  bool reallocates = false;
  // The most device scratch one run asks HookContext::scratch for (0: none). The copy
  // worker allocates the largest of its rank's hooks (with its copy scratch) before
  // the first chunk; the runtime's serial hook runs likewise, before the hooks.
  std::size_t scratch_bytes = 0;
};

// One per checkpoint + layout. Immutable once made: every method is const and safe
// to call from several threads at once.
class Model {
 public:
  virtual ~Model() = default;

  // "llama", "qwen2", "mistral".
  virtual std::string family() const = 0;
  // The layout the model was made for, local_ranks filled in.
  virtual const ParallelLayout& layout() const = 0;
  // One shell per local rank, in the order of layout().local_ranks.
  virtual const std::vector<RankShell>& shells() const = 0;
  // Where one checkpoint tensor goes. Throws ferry::Error: Stage::kPlacement when the
  // tensor's shape or dtype cannot go into its param ("Attempted to load weight ...
  // into parameter ..."), Stage::kMapping for an unknown name in strict mode.
  virtual Route route(const io::TensorInfo& tensor) const = 0;
  // Zero pieces that do not depend on any tensor (vocabulary padding rows): run once
  // per load, in any order relative to the copies (they never overlap them).
  virtual std::vector<Piece> fill_pieces() const = 0;
  // Post-load hooks; dense families have none.
  virtual std::vector<PostLoadHook> hooks() const;
  // What the operator should know about how the layout was applied (uneven tensor
  // parallelism padded some heads or widths with zeros); the runtime and `ferry
  // plan` report each as a warning. None by default; a wrapper model forwards its
  // base's.
  virtual std::vector<std::string> notes() const;
};

// Sizes tensor parallelism does not divide (models/placement.hpp): refused as
// SGLang's GPU path asserts, or zero-padded as its CPU path does.
enum class Unaligned { kRefuse, kPad };

// quantization_config (or a ModelOpt hf_quant_config.json), parsed; models/quant.hpp
// says what each method stores. kNone: the checkpoint is not quantized.
struct QuantScheme {
  enum class Method {
    kNone,
    kFp8Block,    // F8_E4M3 weights, F32 scales of [block_n x block_k] blocks
    kFp8Channel,  // F8_E4M3 weights, F32 weight_scale [N, 1]: one per output row
    kFp8Tensor,   // F8_E4M3 weights, F32 weight_scale: one per fused shard
    kNvfp4,       // E2M1 weights packed two a byte (U8 [N, K/2]), F8_E4M3 weight_scale
                  // [N, K/group_size] and F32 weight_scale_2 per shard
  };
  // Who wrote the checkpoint (the names of its scales follow it).
  enum class Format { kNone, kFp8, kCompressedTensors, kModelOpt };
  // How quantization_config's list of excluded modules matches a module.
  enum class IgnoreMatch {
    kModule,            // fp8: the module or a parent, with or without "model."
    kSubstringOrRegex,  // compressed-tensors: a case-insensitive substring, "re:" a regex
    kGlob,              // ModelOpt: "*" wildcards over the module or one dotted part of it
  };
  Method method = Method::kNone;
  Format format = Format::kNone;
  std::uint64_t block_n = 0;     // kFp8Block: rows (output dim) per scale (weight_block_size[0])
  std::uint64_t block_k = 0;     // kFp8Block: columns (input dim) per scale
  std::uint64_t group_size = 0;  // kNvfp4: input-dim elements per F8_E4M3 scale (16)
  // The weight scale's suffix after the module: "weight_scale_inv" (quant_method
  // fp8 with blocks) or "weight_scale" (the others).
  std::string scale_suffix;
  // Static activation scales: every quantized module has an F32 input_scale per
  // fused shard (ModelOpt; fp8 and compressed-tensors with a static scheme).
  bool input_scales = false;
  // An FP8 KV cache with scales (ModelOpt kv_cache_quant_algo FP8): each attention
  // module has F32 scalars attn.k_scale and attn.v_scale (MLA: attn_mqa.*).
  bool kv_cache_scales = false;
  // Whether the family's SGLang attention takes a KV-cache quant method at all (not
  // Qwen3, Qwen3-MoE, GLM-4-MoE: FamilyOption kNoKvCacheScales), so that
  // postprocess.target gives it BaseKVCacheMethod's k_scale / v_scale.
  bool kv_cache_params = true;
  // "ue8m0" (DeepSeek-V3.1): the F32 scales are powers of two. Loaded as stored,
  // which is what SGLang does unless DeepGEMM's Blackwell repack runs.
  std::string scale_fmt;
  // Module names ("lm_head", "model.layers.0.mlp.gate", "re:.*mlp.gate$",
  // "*.mlp.gate") whose weights are not quantized, matched by `ignore_match`:
  // modules_to_not_convert / ignored_layers (fp8), ignore (compressed-tensors),
  // exclude_modules (ModelOpt).
  std::vector<std::string> ignored;
  IgnoreMatch ignore_match = IgnoreMatch::kModule;
  // quantization.requant (models/requant.hpp): FP8 block scales converted after
  // loading. kUe8m0: weights requantized with power-of-two block scales, packed for
  // DeepGEMM into <w>weight_scale_inv itself (I32); kTensor: one scale per weight
  // matrix (<w>weight_scale). Set by make_model from ModelOptions::requant.
  enum class Requant { kNone, kUe8m0, kTensor };
  Requant requant = Requant::kNone;
  // quantization.online (models/online_quant.hpp): a full-precision checkpoint
  // quantized to FP8 while loading, with one scale per output row (kChannel) or per
  // weight matrix (kTensor; fused experts always one an expert). method stays kNone
  // (the checkpoint is not quantized). Set by make_model from ModelOptions::online.
  enum class Online { kNone, kChannel, kTensor };
  Online online = Online::kNone;
  // postprocess.target (models/postprocess.hpp): the layout SGLang 0.5.23's
  // process_weights_after_loading leaves on that GPU with default server options;
  // kLoader stops at its weight loaders' state. Set by make_model from
  // ModelOptions::target. Under kSm100, DeepGEMM's UE8M0 repack of FP8 block scales
  // takes dense linears when ue8m0_dense (the model dtype is BF16) and fused experts
  // when ue8m0_experts (DeepEP: SGLang's MoE runs DeepGEMM only there), of the shapes
  // converts_ue8m0 (models/postprocess.hpp) accepts.
  enum class Target { kLoader, kSm90, kSm100 };
  Target target = Target::kLoader;
  bool ue8m0_dense = false;
  bool ue8m0_experts = false;
  // kSm100 only: SGLang's global MoE runner is flashinfer_trtllm (its server
  // argument overrides pick it for the DeepSeek family, Qwen3-MoE and GLM-4 MoE
  // without an all-to-all backend: trtllm_runner, models/postprocess.hpp). Elsewhere
  // the runner stays auto, and the quant methods that read the global runner lay
  // their experts out for the other kernels.
  bool trtllm_experts = false;
  // config.json's quantization_config.quant_method ("fp8", "modelopt_fp4", ...);
  // empty for a ModelOpt hf_quant_config.json (SGLang's server arguments see no
  // quantization there when their overrides pick the MoE runner).
  std::string config_method;
  // The model dtype (SGLang's params_dtype): what Marlin's NVFP4 scales on kSm90 are
  // computed in. Set by make_model.
  DType params_dtype = DType::kBF16;

  bool quantized() const { return method != Method::kNone; }
  bool operator==(const QuantScheme&) const = default;
};

struct ModelOptions {
  // Param dtype; nullopt = "auto": config.json's torch_dtype (or dtype).
  std::optional<DType> dtype{};
  // A checkpoint name the model does not know is an error instead of "unmapped".
  bool strict = false;
  // Families with MTP (NextN) layers: load only the draft model (the MTP layer),
  // not the target model. Others refuse it.
  bool draft = false;
  // Fused experts: w13 holds up (w3) rows first, then gate (w1).
  bool switch_w13 = false;
  // EPLB: for each MoE layer, the physical expert slots of each logical expert.
  // Empty = physical is logical. Parsed from the model.eplb_map file by
  // parse_eplb_map (models/experts.hpp).
  struct Eplb {
    std::uint64_t num_physical_experts = 0;
    // layer -> [logical expert] -> physical ids
    std::map<std::uint64_t, std::vector<std::vector<std::uint64_t>>> layers;
  };
  std::optional<Eplb> eplb{};
  // The shared expert becomes routed expert n_routed_experts, placed after the
  // local physical routed experts on every rank. nullopt = auto: as SGLang's
  // determine_num_fused_shared_experts decides on an NVIDIA GPU of compute
  // capability >= 8.0 with default server options (DeepSeek-V3/R1-shaped models and
  // GLM-4 MoE at ep 1); true where auto would not fuse is refused, naming why.
  std::optional<bool> fuse_shared_experts{};
  // model.unaligned_tp.
  Unaligned unaligned_tp = Unaligned::kRefuse;
  // Round the per-rank MoE intermediate size up to a multiple of this (0 = off);
  // the tail is zero-filled.
  std::uint64_t pad_moe_intermediate_to = 0;
  // quantization.requant: converts FP8 block scales after loading (models/requant.hpp);
  // refused for other checkpoints.
  QuantScheme::Requant requant = QuantScheme::Requant::kNone;
  // quantization.online, resolved (auto is the runtime's): refused for a checkpoint
  // that is already quantized.
  QuantScheme::Online online = QuantScheme::Online::kNone;
  // postprocess.target, resolved (auto is the runtime's): refused with
  // quantization.requant, and for what SGLang does not serve on that target or ferry
  // does not produce (make_model names it).
  QuantScheme::Target target = QuantScheme::Target::kLoader;
  // The checkpoint's quantization. make_model sets it from config.json's
  // quantization_config (parse_quant_scheme, models/quant.hpp), replacing what the
  // caller put here; the make_*_model functions of the families take it as given.
  QuantScheme quant{};
};

// "auto" -> nullopt; "bfloat16"/"bf16", "float16"/"half"/"fp16"/"f16",
// "float32"/"float"/"fp32"/"f32" (and the safetensors spellings BF16, F16, F32).
// Throws ferry::Error(Stage::kConfig) for anything else, naming the text.
std::optional<DType> parse_model_dtype(std::string_view text);

// Architectures make_model knows, e.g. "LlamaForCausalLM".
const std::vector<std::string>& supported_architectures();

// Builds the model for config.json's architectures[0], in the layout its
// quantization_config gives (models/quant.hpp: FP8 with block, channel or tensor
// scales, NVFP4, or none). Throws
// ferry::Error: Stage::kMapping for an unknown architecture (naming it and the
// supported ones) or a quantization method ferry does not load, Stage::kConfig for a
// missing or
// malformed field, Stage::kPlacement when the layout cannot split the model (a
// padded vocabulary tp does not divide, experts ep does not divide, ...; heads and
// intermediate sizes tp does not divide are padded with zeros instead, as SGLang
// does).
std::unique_ptr<Model> make_model(const nlohmann::json& hf_config, const ParallelLayout& layout,
                                  const ModelOptions& options = {});

}  // namespace ferry::models
