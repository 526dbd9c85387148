// Presharded checkpoints in the runtime (model.load_format=presharded, load.save_presharded,
// `ferry save`): which folder a layout's params live in, reading it, writing it.
//
// A root folder (`ferry save --out ROOT`, load.save_presharded=ROOT, or a checkpoint's
// own `presharded/`) holds a folder per layout, named for the layout's signature
// ("tp2-ep1-pp1-dp1-loader-<12 hex digits>"), and in it a part per pipeline stage and
// set of tp ranks that one process saved ("part-pp0-tp0_1"): io/presharded.hpp's
// folder, plus the config.json the params were made from. A part is written under a
// hidden name and renamed into place once READY is synced, so a reader never sees a
// half-written one; a part already there is never replaced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gpu/device.hpp"
#include "runtime/load_config.hpp"
#include "runtime/load_work.hpp"
#include "runtime/plan_report.hpp"

namespace ferry::runtime {

// Everything that decides what a load leaves in its params, as text: ferry's layout
// version, the architecture, an XXH3-128 of config.json (hf_quant_config merged), the
// parallel layout (tp, ep, pp, partition, attention DP, dp_lm_head, moe_dense_tp,
// moe_a2a), the model options (dtype, draft, switch_w13, fused shared experts,
// MoE padding, unaligned tp, the EPLB map's bytes) and the quantization
// (requant, online, postprocess target, each resolved).
std::map<std::string, std::string> presharded_signature(const LoadConfig& config,
                                                        const nlohmann::json& hf_config);

// The layout folder's name for a signature.
std::string presharded_layout_name(const std::map<std::string, std::string>& signature);

// model.load_format=presharded: the part holding this process's pipeline stage and
// every local tp rank, its manifest checked against the layout asked for, indexed
// (only the files the local ranks read). model.path is a part, a layout folder, or a
// root or checkpoint folder holding one for the layout (in itself, its presharded/,
// or load.save_presharded). Returns nullopt when none exists and load.save_presharded
// is set (the raw checkpoint at model.path is then loaded and saved). Throws
// Error(Stage::kIndex) naming the folder and, for a folder of another layout, the
// first signature field that differs; a part without READY is named as unfinished.
std::optional<ResolvedCheckpoint> resolve_presharded(const LoadConfig& config);

// After a load: whether load.save_presharded asks for a save this load has not made
// unnecessary (the load read a presharded folder of the same root).
bool wants_presharded_save(const LoadConfig& config, const ResolvedCheckpoint& resolved);

// Saves the loaded params of every local rank of `state` (made by `config` over
// `hf_config`) under `root`, in the layout's folder, as one part. Returns the part's
// folder, or "" when that part exists already (nothing is written). Devices must keep
// data. Host memory: one block of save.max_file_bytes' writer (16 MiB). Throws
// Error(Stage::kOutput).
std::string save_presharded(const LoadedModel::State& state, const LoadConfig& config,
                            const nlohmann::json& hf_config, const std::string& root);

// Reads `nbytes` of device storage at `data` back through `stream`, in blocks of at
// most 16 MiB held in `block` (reused across calls: bounded host memory), handing
// each to `each` in order. For the restart formats' saves and checksum checks.
void read_back(gpu::Stream& stream, const std::byte* data, std::uint64_t nbytes,
               std::vector<std::byte>& block,
               const std::function<void(std::span<const std::byte>)>& each);

// load.verify_checksums: every param of every local rank read back and hashed
// against the manifest. Throws Error(Stage::kVerify) naming the part's file, the
// param and the tp rank, for the first that differs.
void verify_presharded(const LoadedModel::State& state, const io::PreshardedManifest& manifest,
                       const std::string& manifest_file);

}  // namespace ferry::runtime
