#include "runtime/sharded_state.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/float_bits.hpp"
#include "common/log.hpp"
#include "common/output_file.hpp"
#include "common/small_file.hpp"
#include "io/safetensors_writer.hpp"
#include "io/sharded_state.hpp"
#include "models/hf_config.hpp"
#include "runtime/presharded.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;

// The checkpoint's small files an engine reads beside the weights.
constexpr std::uint64_t kMaxMetadataFile = std::uint64_t{256} << 20;

std::string list_ranks(const std::map<int, std::vector<std::string>>& files) {
  std::string out;
  for (const auto& [rank, names] : files) {
    out += (out.empty() ? "" : ",") + std::to_string(rank);
  }
  return out.empty() ? "none" : out;
}

bool contiguous(const LoadedParam& p) {
  if (p.strides.empty()) {
    return true;
  }
  std::uint64_t expect = 1;
  for (std::size_t d = p.shape.size(); d-- > 0;) {
    if (p.shape[d] != 1 && p.strides.at(d) != expect) {
      return false;
    }
    expect *= p.shape[d];
  }
  return true;
}

// The files an engine reads beside the weights: configs, tokenizer, chat template.
bool metadata_file(const std::string& name) {
  if (name.empty() || name.front() == '.' || name.ends_with(".index.json")) {
    return false;
  }
  for (const char* ext : {".json", ".txt", ".model", ".tiktoken", ".jinja"}) {
    if (name.ends_with(ext)) {
      return true;
    }
  }
  return false;
}

void copy_metadata(const std::string& from, const fs::path& to, const nlohmann::json& hf_config,
                   std::vector<fs::path>& written) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(from, ec)) {
    const std::string name = entry.path().filename().string();
    if (!metadata_file(name) || !entry.is_regular_file(ec) || fs::exists(to / name, ec)) {
      continue;
    }
    const std::string text =
        read_small_file(entry.path().string(), Stage::kOutput, kMaxMetadataFile, "a metadata file");
    OutputFile out((to / name).string(), Stage::kOutput, "sharded_state save");
    out.write(text);
    out.commit();
    written.push_back(to / name);
  }
  if (!fs::exists(to / "config.json", ec)) {  // e.g. from a dummy-free presharded part
    OutputFile out((to / "config.json").string(), Stage::kOutput, "sharded_state save");
    out.write(hf_config.dump(1) + "\n");
    out.commit();
    written.push_back(to / "config.json");
  }
}

}  // namespace

std::string sharded_state_folder(const LoadConfig& c, const std::string& root) {
  if (c.parallel.pp <= 1) {
    return root;
  }
  return (fs::path(root) / ("pp-" + std::to_string(c.parallel.pp_rank))).string();
}

models::ShardedStateNaming sharded_state_naming(const LoadConfig& c,
                                                const nlohmann::json& hf_config) {
  models::ShardedStateNaming naming;
  const nlohmann::json tie = hf_config.value("tie_word_embeddings", nlohmann::json(false));
  const nlohmann::json archs = hf_config.value("architectures", nlohmann::json());
  const std::string arch = archs.is_array() && !archs.empty() && archs[0].is_string()
                               ? archs[0].get<std::string>()
                               : std::string();
  // SGLang 0.5.23: LlamaForCausalLM (and Mistral, Phi-3 on it), Qwen2ForCausalLM,
  // Qwen3ForCausalLM, Gemma3ForCausalLM and DeepseekV2ForCausalLM set
  // `self.lm_head = self.model.embed_tokens` when tied (the Qwen and DeepSeek ones
  // with one pipeline stage); GemmaForCausalLM and Gemma2ForCausalLM have no lm_head.
  if (tie.is_boolean() && tie.get<bool>() && c.parallel.pp == 1 && !c.model.draft &&
      arch != "GemmaForCausalLM" && arch != "Gemma2ForCausalLM") {
    naming.tied_embedding = "model.embed_tokens.weight";
  }
  // Gemma2Model.__init__ (gemma2.py): register_buffer("normalizer",
  // torch.tensor(hidden_size**0.5)), persistent, in the default (the model's) dtype.
  if (arch == "Gemma2ForCausalLM") {
    const nlohmann::json hidden = hf_config.value("hidden_size", nlohmann::json());
    if (!hidden.is_number_unsigned() || hidden.get<std::uint64_t>() == 0) {
      throw Error(Stage::kConfig, "config.json", "model.normalizer",
                  "sharded_state: Gemma 2's normalizer needs a positive hidden_size");
    }
    models::ShardedStateNaming::Extra x;
    x.name = "model.normalizer";
    x.dtype = models::resolve_dtype(hf_config, c.model.dtype);
    const float value =
        static_cast<float>(std::sqrt(static_cast<double>(hidden.get<std::uint64_t>())));
    if (x.dtype == DType::kF32) {
      x.bytes.resize(4);
      std::memcpy(x.bytes.data(), &value, 4);
    } else {
      const std::uint16_t bits =
          x.dtype == DType::kBF16 ? float_to_bf16_bits(value) : float_to_f16_bits(value);
      x.bytes.resize(2);
      std::memcpy(x.bytes.data(), &bits, 2);
    }
    naming.extras.push_back(std::move(x));
  }
  return naming;
}

ResolvedCheckpoint resolve_sharded_state(const LoadConfig& c) {
  const std::string folder = sharded_state_folder(c, c.model.path);
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) {
    throw Error(Stage::kDiscovery, folder, "",
                "model.load_format=sharded_state: no such folder" +
                    std::string(c.parallel.pp > 1 ? " (with pp > 1 each pipeline stage's "
                                                    "files are in the folder's pp-<stage>/)"
                                                  : ""));
  }
  const std::map<int, std::vector<std::string>> files = io::list_sharded_state(folder);
  if (files.empty()) {
    throw Error(Stage::kDiscovery, folder, "",
                "model.load_format=sharded_state: no model-rank-<r>-part-<p>.safetensors here "
                "(SGLang's ShardedStateLoader names them so; `ferry save --format "
                "sharded_state` writes them)");
  }
  if (files.rbegin()->first >= c.parallel.tp) {
    throw Error(Stage::kDiscovery, folder, "",
                "model.load_format=sharded_state: the folder holds files of tp ranks " +
                    list_ranks(files) + ", the load asks tp " + std::to_string(c.parallel.tp) +
                    ": it was saved with a larger tp");
  }
  ResolvedCheckpoint out;
  out.source.folder = folder;
  out.source.load_format = io::LoadFormat::kShardedState;
  out.source.format = io::FileFormat::kSafetensors;
  out.source.pattern = "model-rank-*-part-*.safetensors";
  for (int rank : local_tp_ranks(c)) {
    auto it = files.find(rank);
    if (it == files.end()) {
      throw Error(Stage::kDiscovery, folder, "",
                  "model.load_format=sharded_state: no files of tp rank " + std::to_string(rank) +
                      " (model-rank-" + std::to_string(rank) +
                      "-part-*.safetensors); the folder holds tp ranks " + list_ranks(files));
    }
    for (const std::string& name : it->second) {
      out.source.files.push_back({(fs::path(folder) / name).string(), name,
                                  "tp rank " + std::to_string(rank) + "'s state"});
    }
  }
  out.source.decisions.push_back("sharded_state folder " + folder);
  out.index = io::build_checkpoint_index(out.source, index_options(c, true));
  // A stage's folder holds the config.json its save copied; SGLang's own folders
  // hold one beside the files.
  out.hf_config =
      read_hf_config(fs::exists(fs::path(folder) / "config.json", ec) ? folder : c.model.path,
                     c.io.max_metadata_bytes);
  out.warnings = out.index.warnings;
  out.stored_state =
      std::make_shared<const models::StoredState>(models::sharded_state_entries(out.index));
  out.stored_format = kShardedState;
  return out;
}

std::string save_sharded_state(const LoadedModel::State& state, const LoadConfig& c,
                               const nlohmann::json& hf_config, const std::string& source_folder,
                               const std::string& root) {
  for (const auto& device : state.devices) {
    if (!device->holds_data()) {
      throw Error(Stage::kOutput, device->name(), "",
                  "sharded_state save: this device keeps no parameter data (a null device)");
    }
  }
  const fs::path folder = sharded_state_folder(c, root);
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) {
    throw Error(Stage::kOutput, folder.string(), "",
                "sharded_state save: cannot create the folder: " + ec.message());
  }
  const std::map<int, std::vector<std::string>> there = io::list_sharded_state(folder.string());
  for (const LoadedRank& rank : state.ranks) {
    if (there.contains(rank.tp_rank)) {
      throw Error(Stage::kOutput, folder.string(), "",
                  "sharded_state save: the folder holds tp rank " + std::to_string(rank.tp_rank) +
                      "'s files already (model-rank-" + std::to_string(rank.tp_rank) +
                      "-part-*.safetensors); a sharded_state folder has no layout signature "
                      "to tell whether they are this load's: remove them or save elsewhere");
    }
  }
  const models::ShardedStateNaming naming = sharded_state_naming(c, hf_config);
  std::vector<fs::path> written;
  std::vector<std::byte> block;
  try {
    for (std::size_t r = 0; r < state.ranks.size(); ++r) {
      const LoadedRank& rank = state.ranks[r];
      auto stream = state.devices[r]->create_stream();
      // Parts as SGLang's save_model cuts them: a tensor that would take the part
      // past save.max_file_bytes starts the next one (never an empty part).
      std::vector<std::vector<const LoadedParam*>> parts(1);
      std::uint64_t part_bytes = 0;
      for (const LoadedParam& p : rank.params) {
        if (models::sglang_state_dict_lacks(p.name)) {
          continue;
        }
        if (!contiguous(p)) {
          throw Error(Stage::kOutput, folder.string(), p.name,
                      "sharded_state save: the param is not contiguous, and a state dict "
                      "file stores it in order");
        }
        if (!parts.back().empty() && part_bytes + p.nbytes > c.save.max_file_bytes) {
          parts.emplace_back();
          part_bytes = 0;
        }
        parts.back().push_back(&p);
        part_bytes += p.nbytes;
      }
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const fs::path file = folder / io::sharded_state_file(rank.tp_rank, static_cast<int>(i));
        io::SafetensorsWriter w(file.string(), Stage::kOutput, "sharded_state save");
        w.set_metadata({{"format", "pt"}});
        for (const LoadedParam* p : parts[i]) {
          w.add(models::sharded_state_name(p->name, naming), p->dtype, p->shape);
        }
        if (i == 0) {
          for (const models::ShardedStateNaming::Extra& x : naming.extras) {
            w.add(x.name, x.dtype, x.shape);
          }
        }
        w.begin();
        for (const LoadedParam* p : parts[i]) {
          read_back(*stream, p->data, p->nbytes, block,
                    [&](std::span<const std::byte> b) { w.write(b); });
        }
        if (i == 0) {
          for (const models::ShardedStateNaming::Extra& x : naming.extras) {
            w.write(x.bytes);
          }
        }
        w.finish(io::SafetensorsWriter::Sync::kFsync);
        written.push_back(file);
      }
    }
    copy_metadata(source_folder, folder, hf_config, written);
    sync_folder(folder.string(), Stage::kOutput, "sharded_state save");
  } catch (...) {
    for (const fs::path& f : written) {
      fs::remove(f, ec);
    }
    throw;
  }
  return folder.string();
}

}  // namespace ferry::runtime
