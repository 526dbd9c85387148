// Fused-expert placement shared by every mixture-of-experts family (Mixtral,
// Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4 MoE), following SGLang's FusedMoE
// weight loader:
//
//   <param_prefix>w13_weight  [local slots, 2 * I_pad, H]  gate rows, then up rows
//                                                          (up first with switch_w13)
//   <param_prefix>w2_weight   [local slots, H, I_pad]      down_proj's input-dim slice
//
// moe_tp = tp / ep; tp rank r has ep rank r / moe_tp and moe-tp rank r % moe_tp;
// I_local = I / moe_tp; I_pad = I_local rounded up to
// options.pad_moe_intermediate_to (0: I_pad = I_local). Each w13 half holds the
// moe-tp rank's I_local rows [r % moe_tp * I_local, +I_local) of gate (or up) and
// w2 the same columns of down; the tail rows of each half and tail columns of w2
// are zero-filled (fill pieces, one per half and one for w2, over every slot).
// Uneven moe-tp (I % moe_tp != 0): I is padded first (padded_intermediate in
// placement.hpp), I_local is a share of the padded I, and the share's rows past
// the real I are zero-filled like the tail. flashinfer_trtllm's experts
// (QuantScheme::trtllm_experts: NVFP4, FP8, BF16): I_local is I / moe_tp rounded
// up to 64 (NVFP4) or 128, and rank r's share starts at r * I_local, so the last
// ranks hold fewer real rows or none (SGLang's narrow_padded_param_and_loaded_weight).
// Physical expert slots (P = E without EPLB, else the map's num_physical_experts)
// are split evenly and contiguously over ep ranks: ep rank e holds slots
// [e * P/ep, (e+1) * P/ep) as local slots 0 .. P/ep - 1, then (fuse_shared_experts
// and a shared_checkpoint_prefix) one slot for the shared expert on every rank.
// Every local physical replica of a logical expert is written (one tensor, several
// pieces). Expert tensors no local rank keeps are dropped unread with
// "remote_expert". The layer's global rows (TableModel::set_global_experts, for
// ModelOpt NVFP4's input scales, which every rank holds for all experts): P + 1
// with a fused shared expert, logical expert e at rows e, e + E, ... below P
// (SGLang's stride, whatever the EPLB map), the shared expert at row P.
//
// Checkpoint forms: per expert, <checkpoint_prefix><e>.<gate|up|down name>.weight;
// or fused 3-D, <checkpoint_prefix>gate_up_proj [E, 2I, H] (each expert's gate rows
// then up rows) and <checkpoint_prefix>down_proj [E, H, I], of which each rank reads
// only its experts' byte range. Other fused layouts are refused by shape (see
// add_moe_experts). Both forms are declared; a checkpoint uses one.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/small_file.hpp"
#include "models/model.hpp"
#include "models/table_model.hpp"

namespace ferry::models {

struct MoeLayerSpec {
  std::uint64_t layer = 0;              // decoder layer index (the EPLB map's key)
  std::uint64_t num_experts = 0;        // routed experts E of the checkpoint
  std::uint64_t hidden = 0;             // H
  std::uint64_t intermediate = 0;       // I of one routed expert, unsplit
  std::string param_prefix;             // "model.layers.3.mlp.experts."
  std::string checkpoint_prefix;        // "model.layers.3.mlp.experts."
  std::string gate_name = "gate_proj";  // Mixtral: w1
  std::string up_name = "up_proj";      // Mixtral: w3
  std::string down_name = "down_proj";  // Mixtral: w2
  // With options.fuse_shared_experts: the shared expert's checkpoint prefix
  // ("model.layers.3.mlp.shared_experts."; gate/up/down_proj under it), whose
  // intermediate size must equal `intermediate`. Empty: the family has none.
  std::string shared_checkpoint_prefix;
  // The config field `intermediate` comes from, for messages (Mixtral:
  // intermediate_size).
  std::string intermediate_field = "moe_intermediate_size";
};

struct FamilyDescriptor;

// A layer's routed experts: `experts` of them, [intermediate, hidden] each, under
// `param_prefix` and `checkpoint_prefix` ("model.layers.3.mlp.experts."), with the
// family's names for their tensors (the descriptor's sources of experts.w13_weight:
// gate, up; of experts.w2_weight: down).
MoeLayerSpec routed_experts(const FamilyDescriptor& descriptor, std::uint64_t layer,
                            std::uint64_t experts, std::uint64_t hidden,
                            std::uint64_t intermediate, std::string param_prefix,
                            std::string checkpoint_prefix);

// Checks up front, naming the config fields: tp % ep == 0 (Stage::kConfig);
// physical experts (E, or the EPLB map's P) % ep == 0 (Stage::kPlacement, naming
// `experts_field`, the config key of E); with an EPLB map, every layer it lists has
// exactly E logical experts and every layer of `moe_layers` has an entry
// (Stage::kConfig; the parser already guarantees ids < P, each used once).
void check_expert_parallel(const ParallelLayout& layout, std::uint64_t num_experts,
                           const ModelOptions& options, const std::string& architecture,
                           const std::string& experts_field = "num_experts",
                           const std::vector<std::uint64_t>& moe_layers = {});

// Declares the layer's w13/w2 params on every local rank, the zero fill of padded
// tails, and targets every expert tensor in both checkpoint forms (see the top of
// this file). Throws Error(Stage::kPlacement) naming spec.intermediate_field when I
// is 0, and Error(Stage::kConfig) when the EPLB map has no entry of E experts for spec.layer.
// Shapes are checked when a tensor is routed: a per-expert tensor must be [I, H]
// (down: [H, I]), a fused one [E, 2I, H] / [E, H, I]; anything else ([E, H, 2I],
// a wrong I) fails with "Attempted to load weight ... into parameter ..." naming
// the expected shape. A transposed layout of the same shape (H == 2I) cannot be
// told apart and is read as [E, 2I, H].
void add_moe_experts(TableModel& m, const MoeLayerSpec& spec, const ParallelLayout& layout,
                     const ModelOptions& options);

// The model.eplb_map file: {"num_physical_experts": P, "layers": {"<layer>":
// [[physical ids of logical expert 0], ...]}}. Every physical id in [0, P) appears
// exactly once per layer. Throws Error(Stage::kConfig) naming `file` and the field.
ModelOptions::Eplb parse_eplb_map(const nlohmann::json& j, const std::string& file);
// Reads `path` through read_small_file (a regular file of at most `max_bytes`,
// io.max_metadata_bytes).
ModelOptions::Eplb load_eplb_map(const std::string& path,
                                 std::uint64_t max_bytes = kDefaultMaxMetadataBytes);

}  // namespace ferry::models
