// Which files of a checkpoint folder are weights (SGLang's _prepare_weights, done
// better: missing shards are an error that lists them, index paths may not leave
// the folder, and every decision carries a reason that `ferry inspect` shows).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/small_file.hpp"

namespace ferry::io {

struct WeightIndex;  // io/safetensors.hpp

enum class LoadFormat {
  kAuto,            // *.safetensors, else *.bin, else *.gguf (first pattern that matches
                    // wins); a model.path that is a *.gguf file is that file
  kSafetensors,     // *.safetensors
  kMistral,         // consolidated*.safetensors with consolidated.safetensors.index.json
  kPt,              // *.pt
  kGguf,            // *.gguf: llama.cpp's format, one file (io/gguf_checkpoint.hpp); model.path
                    // may name the file itself
  kDummy,           // no weight files: the runtime fills every param with deterministic
                    // random values from config.json alone; discovery refuses it
  kPresharded,      // a folder `ferry save` wrote (runtime/presharded.hpp): each rank's params
                    // as a load leaves them; discovery refuses it (the runtime finds the folder)
  kShardedState,    // SGLang's sharded_state: each tp rank's state dict in
                    // model-rank-<r>-part-<p>.safetensors (io/sharded_state.hpp); discovery
                    // refuses it (the runtime picks the local ranks' files)
  kIpcCache,        // the weight cache: views of a `ferry serve` daemon's parameters
                    // (runtime/cache_client.cpp); discovery refuses it (the daemon read the files)
  kRemoteInstance,  // pulled over UCX from a running ferry serving the same layout (a seed,
                    // runtime/remote_target.cpp); discovery refuses it (nothing is read)
};

// What the chosen files contain (kAuto resolves to one of these): kPickle is a
// torch.save zip archive, read without executing it (io/torch_checkpoint.hpp); kGguf
// is one llama.cpp GGUF file (io/gguf_checkpoint.hpp).
enum class FileFormat { kSafetensors, kPickle, kGguf };

std::string_view to_string(LoadFormat format);
// "auto", "safetensors", "mistral", "pt", "gguf", "dummy", "presharded", "sharded_state",
// "ipc_cache", "remote_instance"; nullopt otherwise.
std::optional<LoadFormat> parse_load_format(std::string_view text);

struct DiscoveryOptions {
  LoadFormat format = LoadFormat::kAuto;
  // load.sort_weight_files: 0 sort bytewise; -1 directory order; k > 0 sort, then
  // stagger within groups of tp_size * k files, rank r rotated by r * k.
  int sort_weight_files = 0;
  int tp_size = 1;
  int tp_rank = 0;  // a process serving several ranks passes its first local rank
  // io.max_metadata_bytes: the cap on the index and config.json read here.
  std::uint64_t max_metadata_bytes = kDefaultMaxMetadataBytes;
};

struct WeightFile {
  std::string path;    // folder joined with name (symbolic links are followed on open)
  std::string name;    // relative to the folder, as shown to the user
  std::string reason;  // why it was chosen
};

struct SkippedFile {
  std::string name;
  std::string reason;
};

struct ResolvedSource {
  std::string folder;
  LoadFormat load_format = LoadFormat::kAuto;  // as requested
  FileFormat format = FileFormat::kSafetensors;
  std::string pattern;                    // the glob that matched, e.g. "*.safetensors"
  std::optional<std::string> index_file;  // name of the index in the folder, when used
  // The index as discovery parsed it, so that build_checkpoint_index does not read
  // and parse it again (null when no index is used, or for a hand-made source).
  std::shared_ptr<const WeightIndex> weight_index;
  std::vector<WeightFile> files;     // in load order
  std::vector<SkippedFile> skipped;  // matched a pattern but not chosen (by name)
  std::vector<std::string> warnings;
  std::vector<std::string> decisions;  // the order rule applied, etc. (shown by inspect)
  std::string prefix;                  // prepended to every tensor name (empty today)
};

// Resolves the weight files of `folder` (top level only; symbolic links are followed,
// so a Hugging Face cache snapshot works). Rules, in order:
//  - patterns: the format's patterns are tried in order and the first that matches a
//    weight candidate wins; hidden files never match (as Python's glob). Training state
//    (training_args.bin, optimizer.*, scheduler.pt, scaler.pt) and entries that are not
//    files (directories, fifos) are listed in `skipped`, never chosen.
//  - index (consolidated.safetensors.index.json for kMistral, pytorch_model.bin.index.json
//    when *.bin matched, model.safetensors.index.json otherwise; *.pt has none; SGLang
//    0.5.23's _prepare_weights uses only the safetensors one, ferry trusts the *.bin index
//    too so that a folder with stray *.bin files loads the shards it names): exactly the
//    shards its weight_map names are
//    chosen, the other matches are skipped. A shard name is a relative path inside the
//    folder: absolute names and "..", "." or empty components are refused. A subfolder
//    name ("sub/x.safetensors") is allowed and chosen even though the top-level listing
//    never matched it, because the index names it (the check is lexical: a symbolic link
//    inside the folder may point anywhere, as the HF cache's links do). Every shard named
//    but not a file on disk (absent, dangling link, directory) is listed in one error.
//    An index that is a dangling link or not a file is an error, not "no index".
//  - no index: every match is chosen, except that exactly {consolidated.safetensors,
//    model.safetensors} keeps model.safetensors. A match that is a dangling link is an
//    error here (nothing says whether it held weights).
//  - GLM-4 MoE: with an index, an unindexed top-level mtp.safetensors is added (with a
//    warning) when config.json names Glm4MoeForCausalLM or Glm4MoeLiteForCausalLM and
//    num_nextn_predict_layers > 0. config.json is read only in that case; when it is
//    absent or does not parse, the rule does not apply and `decisions` says so.
//  - order: order_weight_files over the chosen names. For -1 the list order is kept:
//    indexed top-level shards in directory order, then subfolder shards sorted, then the
//    GLM mtp.safetensors.
// Throws ferry::Error(Stage::kConfig) for bad ordering options (before touching the
// disk), ferry::Error(Stage::kIndex) from read_weight_index for an index that does not
// parse, and ferry::Error(Stage::kDiscovery) naming the folder or index (and tensor) for
// everything else above and for: no such folder, not a folder, no weights found (the
// error lists the patterns tried), an index whose weight_map is empty.
ResolvedSource resolve_source(const std::string& folder, const DiscoveryOptions& options = {});

// The ordering rule alone (exposed for tests): -1 returns `names` as given (directory
// order); 0 sorts bytewise; k > 0 sorts, then when tp_size > 1 replaces each consecutive
// group of n <= tp_size * k names with group[(j + tp_rank * k) % n]. Throws
// ferry::Error(Stage::kConfig) for sort_weight_files < -1, tp_size < 1 or tp_rank
// outside [0, tp_size).
std::vector<std::string> order_weight_files(std::vector<std::string> names, int sort_weight_files,
                                            int tp_size, int tp_rank);

}  // namespace ferry::io
