// SGLang's own presharded folders in the runtime (model.load_format=presharded): a
// TP-<tp>-sig-<16 hex> folder SGLang 0.5.23's PreshardedModelLoader dumped
// (io/sglang_presharded.hpp), read by ferry as SGLang's _load_from_presharded reads
// it: each local rank's reads from checksum.json, every stored tensor whole into the
// params it names, MLA's extras (w_kc, w_vc, w_scale) made again by ferry's MLA hooks.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "runtime/load_config.hpp"
#include "runtime/load_work.hpp"
#include "runtime/plan_report.hpp"

namespace ferry::runtime {

inline constexpr const char* kSglangPresharded = "SGLang presharded";

// The folder for this layout: model.path itself when it holds checksum.json, else a
// TP-<tp>-sig-* folder in model.path/presharded (a checkpoint folder, as SGLang
// looks there). A candidate without READY, with a shard config of another layout
// (tp, pp, ep, dp_lm_head, dtype: the first that differs is named), another world
// size, or no reads for a local rank does not fit; `why` gets a line for each.
// nullopt when none fits. The fitting folder is indexed (only the files the local
// ranks read), config.json read from the folder, else model.path, else the
// checkpoint two levels up. Throws Error(Stage::kIndex) for a plan that does not
// parse (naming the file and the field).
std::optional<ResolvedCheckpoint> resolve_sglang_presharded(const LoadConfig& config,
                                                            std::vector<std::string>& why);

// load.verify_checksums on SGLang's folder: every param of every local rank read back
// and hashed as SGLang's _hash_tensor does, against the stored key it was read from.
// Throws Error(Stage::kVerify) naming the file, the param and the tp rank.
void verify_sglang_presharded(const LoadedModel::State& state, const ResolvedCheckpoint& resolved,
                              const LoadConfig& config);

}  // namespace ferry::runtime
