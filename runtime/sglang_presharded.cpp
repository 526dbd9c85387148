#include "runtime/sglang_presharded.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "common/error.hpp"
#include "io/sglang_presharded.hpp"
#include "models/hf_config.hpp"
#include "runtime/presharded.hpp"
#include "runtime/sharded_state.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;

constexpr const char* kReady = "READY";

int world_rank(const LoadConfig& c, int tp_rank) {
  return c.parallel.pp_rank * c.parallel.tp + tp_rank;
}

bool present(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

// The first shard config field that differs from the load, as "field: the folder has
// X, the load asks Y"; "" when none does. Fields ferry has no counterpart for are
// left to the structural checks (every name, dtype and shape).
std::string shard_config_mismatch(const nlohmann::json& stored, const LoadConfig& c,
                                  const nlohmann::json& hf_config) {
  if (!stored.is_object()) {
    return "shard_config: the folder has none";
  }
  const std::vector<std::pair<const char*, nlohmann::json>> asked = {
      {"tp", c.parallel.tp},
      {"pp", c.parallel.pp},
      {"ep", c.parallel.ep},
      {"enable_dp_lm_head", c.parallel.dp_lm_head},
      {"model_dtype", io::torch_dtype_name(models::resolve_dtype(hf_config, c.model.dtype))},
  };
  for (const auto& [field, want] : asked) {
    const nlohmann::json have = stored.value(field, nlohmann::json());
    if (have != want) {
      return std::string(field) + ": the folder has " + have.dump() + ", the load asks " +
             want.dump();
    }
  }
  return {};
}

nlohmann::json config_for(const fs::path& folder, const LoadConfig& c) {
  for (const fs::path& at : {folder, fs::path(c.model.path), folder.parent_path().parent_path()}) {
    if (present(at / "config.json")) {
      return read_hf_config(at.string(), c.io.max_metadata_bytes);
    }
  }
  throw Error(Stage::kConfig, folder.string(), "",
              "SGLang presharded: no config.json in the folder, model.path or the checkpoint "
              "two levels up");
}

}  // namespace

std::optional<ResolvedCheckpoint> resolve_sglang_presharded(const LoadConfig& c,
                                                            std::vector<std::string>& why) {
  const fs::path path(c.model.path);
  std::vector<fs::path> candidates;
  if (present(path / io::kSglangPlan)) {
    candidates.push_back(path);
  } else {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(path / "presharded", ec)) {
      if (e.is_directory(ec) && e.path().filename().string().rfind("TP-", 0) == 0) {
        candidates.push_back(e.path());
      }
    }
    std::sort(candidates.begin(), candidates.end());
  }
  for (const fs::path& folder : candidates) {
    const std::string name = folder.string();
    if (!present(folder / kReady)) {
      why.push_back(name + ": unfinished: no READY (SGLang writes it last)");
      continue;
    }
    const fs::path plan_file = folder / io::kSglangPlan;
    io::SglangPlan plan =
        io::parse_sglang_plan(read_json_file(plan_file, "SGLang's presharded plan",
                                             c.io.max_metadata_bytes, Stage::kIndex),
                              plan_file.string());
    const nlohmann::json hf_config = config_for(folder, c);
    if (const std::string m = shard_config_mismatch(plan.shard_config, c, hf_config); !m.empty()) {
      why.push_back(name + ": another layout (" + m + ")");
      continue;
    }
    if (plan.world_size != c.parallel.tp * c.parallel.pp) {
      why.push_back(name + ": world_size " + std::to_string(plan.world_size) +
                    ", the load asks tp " + std::to_string(c.parallel.tp) + " x pp " +
                    std::to_string(c.parallel.pp));
      continue;
    }
    auto stored = std::make_shared<models::StoredState>();
    std::set<std::string> files;
    std::string lacking;
    for (int r : local_tp_ranks(c)) {
      auto it = plan.reads.find(world_rank(c, r));
      if (it == plan.reads.end() || it->second.empty()) {
        lacking += (lacking.empty() ? "" : ",") + std::to_string(world_rank(c, r));
        continue;
      }
      for (const io::SglangRead& read : it->second) {
        (*stored)[r].push_back({read.file, read.stored_key, read.name, read.extra});
        files.insert(read.file);
      }
    }
    if (!lacking.empty()) {
      why.push_back(name + ": no reads for world rank(s) " + lacking);
      continue;
    }
    ResolvedCheckpoint out;
    out.source.folder = name;
    out.source.load_format = io::LoadFormat::kPresharded;
    out.source.format = io::FileFormat::kSafetensors;
    out.source.pattern = io::kSglangPlan;
    for (const std::string& f : files) {
      out.source.files.push_back({(folder / f).string(), f,
                                  "read by a local rank (" + std::string(io::kSglangPlan) + ")"});
    }
    out.source.decisions.push_back("SGLang presharded folder " + name);
    out.index = io::build_checkpoint_index(out.source, index_options(c, true));
    out.hf_config = hf_config;
    out.warnings = out.index.warnings;
    out.stored_state = std::move(stored);
    out.stored_format = kSglangPresharded;
    return out;
  }
  return std::nullopt;
}

void verify_sglang_presharded(const LoadedModel::State& state, const ResolvedCheckpoint& resolved,
                              const LoadConfig& c) {
  const models::ShardedStateNaming naming = sharded_state_naming(c, resolved.hf_config);
  std::vector<std::byte> buf;
  for (std::size_t r = 0; r < state.ranks.size(); ++r) {
    const LoadedRank& rank = state.ranks[r];
    if (!state.devices[r]->holds_data()) {
      throw Error(Stage::kVerify, state.devices[r]->name(), "",
                  "load.verify_checksums: this device keeps no data to check (a null device)");
    }
    auto entries = resolved.stored_state->find(rank.tp_rank);
    if (entries == resolved.stored_state->end()) {
      continue;
    }
    auto stream = state.devices[r]->create_stream();
    std::set<std::string> checked;
    for (const models::StoredTensor& e : entries->second) {
      std::string name = e.name;
      if (!naming.tied_embedding.empty() && name == "lm_head.weight" && !rank.find(name)) {
        name = naming.tied_embedding;
      }
      const LoadedParam* p = e.extra ? nullptr : rank.find(name);
      if (p == nullptr || !checked.insert(name + '\0' + e.tensor).second) {
        continue;  // an extra, or a buffer ferry computes: not read into a param
      }
      Xxh3Hasher h = io::sglang_key_hasher(p->dtype, p->shape);
      read_back(*stream, p->data, p->nbytes, buf,
                [&](std::span<const std::byte> b) { h.update(b); });
      if (Hash128::from_hex(e.tensor) != h.digest()) {
        throw Error(Stage::kVerify, (fs::path(resolved.source.folder) / e.file).string(), p->name,
                    "SGLang presharded: the loaded bytes' key is " + h.digest().hex() +
                        ", the plan says " + e.tensor + " (tp rank " +
                        std::to_string(rank.tp_rank) + "): the file changed after it was saved");
      }
    }
  }
}

}  // namespace ferry::runtime
