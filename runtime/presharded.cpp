#include "runtime/presharded.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "common/output_file.hpp"
#include "common/small_file.hpp"
#include "common/xxh3.hpp"
#include "models/postprocess.hpp"
#include "runtime/sglang_presharded.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;

// Bumped whenever a change to ferry makes the same signature give other bytes.
constexpr const char* kLayoutVersion = "1";
constexpr std::size_t kBlockBytes = std::size_t{16} << 20;  // host memory of one read-back

std::string join(const std::vector<int>& v, const char* sep) {
  std::string out;
  for (int x : v) {
    out += (out.empty() ? "" : sep) + std::to_string(x);
  }
  return out;
}

bool present(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

// The part folders of a layout folder (hidden ones are saves still being written).
std::vector<fs::path> parts_of(const fs::path& layout, std::vector<fs::path>* unfinished) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(layout, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory(ec)) {
      continue;
    }
    if (name.rfind("part-", 0) == 0) {
      out.push_back(entry.path());
    } else if (name.rfind(".part-", 0) == 0 && unfinished != nullptr) {
      unfinished->push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

io::PreshardedManifest read_manifest(const fs::path& part, std::uint64_t max_bytes) {
  const fs::path file = part / io::kPreshardedManifest;
  return io::parse_presharded_manifest(
      read_json_file(file, "the presharded folder's manifest", max_bytes, Stage::kIndex),
      file.string());
}

// What one part folder is to the load (judged against `asked_config`, else its own
// config.json).
struct Candidate {
  std::optional<io::PreshardedManifest> manifest;  // set when it fits
  std::string why_not;                             // else: why not
};

Candidate judge(const fs::path& part, const LoadConfig& c,
                const std::optional<nlohmann::json>& asked_config) {
  Candidate out;
  if (!present(part / io::kPreshardedReady)) {
    out.why_not = "unfinished: no READY (a save that did not end)";
    return out;
  }
  io::PreshardedManifest m = read_manifest(part, c.io.max_metadata_bytes);
  const nlohmann::json config =
      asked_config ? *asked_config : read_hf_config(part.string(), c.io.max_metadata_bytes);
  const std::string mismatch =
      io::presharded_mismatch(m.signature, presharded_signature(c, config));
  if (!mismatch.empty()) {
    out.why_not = "another layout (" + mismatch + ")";
    return out;
  }
  std::set<int> held;
  for (const io::PreshardedRank& r : m.ranks) {
    held.insert(r.tp_rank);
  }
  const std::vector<int> want = local_tp_ranks(c);
  const bool all = std::all_of(want.begin(), want.end(), [&](int r) { return held.contains(r); });
  if (m.pp_rank != c.parallel.pp_rank || !all) {
    out.why_not = "holds pipeline stage " + std::to_string(m.pp_rank) + ", tp ranks " +
                  join(std::vector<int>(held.begin(), held.end()), ",") + "; the load asks stage " +
                  std::to_string(c.parallel.pp_rank) + ", tp ranks " + join(want, ",");
    return out;
  }
  out.manifest = std::move(m);
  return out;
}

// The folder's part and its manifest, indexed for the local ranks.
ResolvedCheckpoint resolve_part(const LoadConfig& c, const fs::path& part,
                                io::PreshardedManifest manifest) {
  ResolvedCheckpoint out;
  out.source.folder = part.string();
  out.source.load_format = io::LoadFormat::kPresharded;
  out.source.format = io::FileFormat::kSafetensors;
  out.source.pattern = io::kPreshardedManifest;
  const std::vector<int> want = local_tp_ranks(c);
  std::set<std::string> files;
  for (const io::PreshardedRank& r : manifest.ranks) {
    if (std::find(want.begin(), want.end(), r.tp_rank) == want.end()) {
      continue;
    }
    for (const io::PreshardedParam& p : r.params) {
      if (p.nbytes != 0) {
        files.insert(p.file);
      }
    }
  }
  for (const std::string& name : files) {
    out.source.files.push_back(
        {(part / name).string(), name, "holds params of the local tp ranks (manifest.json)"});
  }
  out.source.decisions.push_back("presharded part " + part.string());
  out.index = io::build_checkpoint_index(out.source, index_options(c));
  out.hf_config = read_hf_config(part.string(), c.io.max_metadata_bytes);
  out.warnings = out.index.warnings;
  out.presharded_manifest_file = (part / io::kPreshardedManifest).string();
  out.presharded = std::make_shared<const io::PreshardedManifest>(std::move(manifest));
  return out;
}

[[noreturn]] void out_error(const std::string& file, const std::string& what) {
  throw Error(Stage::kOutput, file, "", "presharded save: " + what);
}

}  // namespace

std::map<std::string, std::string> presharded_signature(const LoadConfig& c,
                                                        const nlohmann::json& hf_config) {
  std::map<std::string, std::string> s;
  s["layout_version"] = kLayoutVersion;
  const nlohmann::json archs = hf_config.value("architectures", nlohmann::json());
  s["architecture"] = archs.is_array() && !archs.empty() && archs[0].is_string()
                          ? archs[0].get<std::string>()
                          : std::string("(none)");
  const std::string config_text = hf_config.dump();
  s["config"] = xxh3_128(std::as_bytes(std::span(config_text.data(), config_text.size()))).hex();
  s["tp"] = std::to_string(c.parallel.tp);
  s["ep"] = std::to_string(c.parallel.ep);
  s["pp"] = std::to_string(c.parallel.pp);
  s["pp_partition"] = c.parallel.pp_partition.empty() ? "even" : join(c.parallel.pp_partition, ",");
  s["attn_dp"] = std::to_string(c.parallel.attn_dp);
  s["dp_lm_head"] = c.parallel.dp_lm_head ? "true" : "false";
  s["moe_dense_tp"] = std::to_string(c.parallel.moe_dense_tp);
  s["moe_a2a"] = c.parallel.moe_a2a_deepep ? "deepep" : "none";
  s["dtype"] = c.model.dtype ? std::string(dtype_name(*c.model.dtype)) : "auto";
  s["draft"] = c.model.draft ? "true" : "false";
  s["switch_w13"] = c.model.switch_w13 ? "true" : "false";
  s["fuse_shared_experts"] =
      !c.model.fuse_shared_experts ? "auto" : (*c.model.fuse_shared_experts ? "true" : "false");
  s["pad_moe_intermediate_to"] = std::to_string(c.model.pad_moe_intermediate_to);
  s["unaligned_tp"] = c.model.unaligned_tp == models::Unaligned::kPad ? "pad" : "refuse";
  if (c.model.eplb_map.empty()) {
    s["eplb_map"] = "none";
  } else {
    const std::string map =
        read_small_file(c.model.eplb_map, Stage::kConfig, c.io.max_metadata_bytes, "the EPLB map");
    s["eplb_map"] = xxh3_128(std::as_bytes(std::span(map.data(), map.size()))).hex();
  }
  s["requant"] = std::string(requant_name(c.quantization.requant));
  const models::QuantScheme::Online online = resolve_online(c);
  s["online"] = online == models::QuantScheme::Online::kNone      ? "none"
                : online == models::QuantScheme::Online::kChannel ? "channel"
                                                                  : "tensor";
  s["postprocess_target"] = std::string(models::to_string(resolve_target(c)));
  return s;
}

std::string presharded_layout_name(const std::map<std::string, std::string>& s) {
  const std::string text = nlohmann::json(s).dump();
  const std::string hex = xxh3_128(std::as_bytes(std::span(text.data(), text.size()))).hex();
  auto at = [&](const char* key) {
    auto it = s.find(key);
    return it == s.end() ? std::string("x") : it->second;
  };
  return "tp" + at("tp") + "-ep" + at("ep") + "-pp" + at("pp") + "-dp" + at("attn_dp") + "-" +
         at("postprocess_target") + "-" + hex.substr(0, 12);
}

std::optional<ResolvedCheckpoint> resolve_presharded(const LoadConfig& c) {
  const fs::path path(c.model.path);
  std::optional<nlohmann::json> asked_config;  // a checkpoint folder's own config.json
  std::vector<fs::path> parts;
  std::vector<fs::path> unfinished;
  std::vector<std::string> looked;
  std::string name;
  if (present(path / io::kPreshardedManifest)) {
    parts.push_back(path);  // a part
  } else if (std::vector<fs::path> in = parts_of(path, &unfinished); !in.empty()) {
    parts = std::move(in);  // a layout folder
  } else {
    std::vector<fs::path> roots = {path / "presharded", path};
    if (!c.load.save_presharded.empty()) {
      roots.emplace_back(c.load.save_presharded);
    }
    std::vector<fs::path> layouts;
    if (present(path / "config.json")) {
      asked_config = read_hf_config(path.string(), c.io.max_metadata_bytes);
      name = presharded_layout_name(presharded_signature(c, *asked_config));
      for (const fs::path& root : roots) {
        looked.push_back((root / name).string());
        if (present(root / name)) {
          layouts.push_back(root / name);
          break;
        }
      }
    }
    if (layouts.empty()) {  // every layout folder there, to say why none fits
      for (const fs::path& root : roots) {
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(root, ec)) {
          if (entry.is_directory(ec) && entry.path().filename().string().rfind("tp", 0) == 0) {
            layouts.push_back(entry.path());
          }
        }
      }
    }
    for (const fs::path& layout : layouts) {
      std::vector<fs::path> found = parts_of(layout, &unfinished);
      parts.insert(parts.end(), found.begin(), found.end());
    }
  }
  std::vector<std::string> why;
  for (const fs::path& part : parts) {
    Candidate found = judge(part, c, asked_config);
    if (found.manifest) {
      return resolve_part(c, part, std::move(*found.manifest));
    }
    why.push_back(part.string() + ": " + found.why_not);
  }
  for (const fs::path& u : unfinished) {
    why.push_back(u.string() + ": unfinished: a save still running or killed before READY");
  }
  // SGLang's own layout: model.path is its TP-<tp>-sig-* folder, or holds them in
  // presharded/ (runtime/sglang_presharded.hpp).
  if (std::optional<ResolvedCheckpoint> sglang = resolve_sglang_presharded(c, why)) {
    return sglang;
  }
  if (!c.load.save_presharded.empty()) {
    log::info("no presharded folder for this layout" + (name.empty() ? "" : " (" + name + ")") +
              ": loading " + c.model.path + " and saving it under " + c.load.save_presharded);
    return std::nullopt;
  }
  std::string rule = "model.load_format=presharded: no presharded folder for this layout";
  if (!name.empty()) {
    rule += " (" + name + "; looked for ";
    for (std::size_t i = 0; i < looked.size(); ++i) {
      rule += (i == 0 ? "" : ", ") + looked[i];
    }
    rule += ")";
  }
  if (why.empty()) {
    rule +=
        "; nothing presharded is there (`ferry save --format presharded` writes it, "
        "load.save_presharded saves one after a load)";
  }
  for (const std::string& w : why) {
    rule += "; " + w;
  }
  throw Error(Stage::kIndex, c.model.path, "", rule);
}

bool wants_presharded_save(const LoadConfig& c, const ResolvedCheckpoint& resolved) {
  return !c.load.save_presharded.empty() && !resolved.presharded;
}

std::string save_presharded(const LoadedModel::State& state, const LoadConfig& c,
                            const nlohmann::json& hf_config, const std::string& root) {
  for (const auto& device : state.devices) {
    if (!device->holds_data()) {
      throw Error(Stage::kOutput, device->name(), "",
                  "presharded save: this device keeps no parameter data (a null device)");
    }
  }
  const std::map<std::string, std::string> signature = presharded_signature(c, hf_config);
  const fs::path layout = fs::path(root) / presharded_layout_name(signature);
  std::vector<int> tp_ranks;
  std::vector<io::PreshardedRankSpec> specs;
  std::string shells;  // what the structure hash covers
  for (const LoadedRank& rank : state.ranks) {
    tp_ranks.push_back(rank.tp_rank);
    io::PreshardedRankSpec& spec = specs.emplace_back();
    spec.tp_rank = rank.tp_rank;
    shells += "rank " + std::to_string(rank.tp_rank) + "\n";
    for (const LoadedParam& p : rank.params) {
      spec.params.push_back({p.name, p.dtype, p.shape, p.nbytes});
      shells += p.name + " " + std::string(dtype_name(p.dtype)) + " " +
                nlohmann::json(p.shape).dump() + " " + nlohmann::json(p.strides).dump() + " " +
                std::to_string(p.nbytes) + "\n";
    }
  }
  const fs::path part =
      layout / ("part-pp" + std::to_string(c.parallel.pp_rank) + "-tp" + join(tp_ranks, "_"));
  if (present(part / io::kPreshardedReady)) {
    return {};
  }
  std::error_code ec;
  fs::create_directories(layout, ec);
  if (ec) {
    out_error(layout.string(), "cannot create the folder: " + ec.message());
  }
  const fs::path tmp = layout / ("." + part.filename().string() + ".tmp-" +
                                 std::to_string(static_cast<long>(::getpid())));
  fs::remove_all(tmp, ec);
  std::vector<std::unique_ptr<gpu::Stream>> streams;
  for (const auto& device : state.devices) {
    streams.push_back(device->create_stream());
  }
  auto read = [&](std::size_t r, std::size_t k, std::uint64_t offset, std::span<std::byte> out) {
    streams[r]->copy_d2h(out.data(), state.ranks[r].params[k].data + offset, out.size());
    streams[r]->synchronize();
  };
  io::PreshardedWriteOptions options;
  options.max_file_bytes = c.save.max_file_bytes;
  options.block_bytes = kBlockBytes;
  try {
    io::write_presharded(tmp.string(), signature,
                         xxh3_128(std::as_bytes(std::span(shells.data(), shells.size()))),
                         c.parallel.pp_rank, specs, read, options);
    OutputFile config((tmp / "config.json").string(), Stage::kOutput, "presharded save");
    config.write(hf_config.dump(1) + "\n");
    config.sync();
    config.commit();
    sync_folder(tmp.string(), Stage::kOutput, "presharded save");
    if (::rename(tmp.c_str(), part.c_str()) != 0) {
      const int err = errno;
      if ((err == ENOTEMPTY || err == EEXIST) && present(part / io::kPreshardedReady)) {
        fs::remove_all(tmp, ec);  // another process saved the same part first
        return {};
      }
      out_error(part.string(),
                std::string("cannot rename the part into place: ") + std::strerror(err));
    }
    sync_folder(layout.string(), Stage::kOutput, "presharded save");
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return part.string();
}

void read_back(gpu::Stream& stream, const std::byte* data, std::uint64_t nbytes,
               std::vector<std::byte>& block,
               const std::function<void(std::span<const std::byte>)>& each) {
  for (std::uint64_t off = 0; off < nbytes; off += kBlockBytes) {
    block.resize(static_cast<std::size_t>(std::min<std::uint64_t>(kBlockBytes, nbytes - off)));
    stream.copy_d2h(block.data(), data + off, block.size());
    stream.synchronize();
    each(block);
  }
}

void verify_presharded(const LoadedModel::State& state, const io::PreshardedManifest& manifest,
                       const std::string& manifest_file) {
  const fs::path folder = fs::path(manifest_file).parent_path();
  std::vector<std::byte> buf;
  for (std::size_t r = 0; r < state.ranks.size(); ++r) {
    const LoadedRank& rank = state.ranks[r];
    auto stored =
        std::find_if(manifest.ranks.begin(), manifest.ranks.end(),
                     [&](const io::PreshardedRank& m) { return m.tp_rank == rank.tp_rank; });
    if (stored == manifest.ranks.end() || stored->params.size() != rank.params.size()) {
      throw Error(Stage::kVerify, manifest_file, "",
                  "presharded: tp rank " + std::to_string(rank.tp_rank) +
                      "'s params are not the manifest's");
    }
    if (!state.devices[r]->holds_data()) {
      throw Error(Stage::kVerify, state.devices[r]->name(), "",
                  "load.verify_checksums: this device keeps no data to check (a null device)");
    }
    auto stream = state.devices[r]->create_stream();
    for (std::size_t k = 0; k < rank.params.size(); ++k) {
      const LoadedParam& p = rank.params[k];
      const io::PreshardedParam& e = stored->params[k];
      Xxh3Hasher h;
      read_back(*stream, p.data, p.nbytes, buf, [&](std::span<const std::byte> b) { h.update(b); });
      if (e.name != p.name || h.digest() != e.xxh3) {
        throw Error(Stage::kVerify, (folder / e.file).string(), p.name,
                    "presharded: the loaded bytes' XXH3-128 is " + h.digest().hex() +
                        ", the manifest says " + e.xxh3.hex() + " (tp rank " +
                        std::to_string(rank.tp_rank) + "): the file changed after it was saved");
      }
    }
  }
}

}  // namespace ferry::runtime
