// Which files of a checkpoint folder are weights (SGLang's _prepare_weights, done
// better: missing shards are an error that lists them, index paths may not leave
// the folder, and every decision carries a reason that `ferry inspect` shows).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::io {

enum class LoadFormat {
  kAuto,         // *.safetensors, else *.bin (first pattern that matches wins)
  kSafetensors,  // *.safetensors
  kMistral,      // consolidated*.safetensors with consolidated.safetensors.index.json
  kPt,           // *.pt
};

// What the chosen files contain (kAuto resolves to one of these).
enum class FileFormat { kSafetensors, kPickle };

std::string_view to_string(LoadFormat format);
// "auto", "safetensors", "mistral", "pt"; nullopt otherwise.
std::optional<LoadFormat> parse_load_format(std::string_view text);

struct DiscoveryOptions {
  LoadFormat format = LoadFormat::kAuto;
  // load.sort_weight_files: 0 sort bytewise; -1 directory order; k > 0 sort, then
  // stagger within groups of tp_size * k files, rank r rotated by r * k.
  int sort_weight_files = 0;
  int tp_size = 1;
  int tp_rank = 0;  // a process serving several ranks passes its first local rank
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
  std::string pattern;  // the glob that matched, e.g. "*.safetensors"
  std::optional<std::string> index_file;  // name of the index in the folder, when used
  std::vector<WeightFile> files;          // in load order
  std::vector<SkippedFile> skipped;       // files that matched a pattern but are not weights
  std::vector<std::string> warnings;
  std::vector<std::string> decisions;     // the order rule applied, etc. (shown by inspect)
  std::string prefix;                     // prepended to every tensor name (empty today)
};

// Resolves the weight files of `folder`. Throws ferry::Error(Stage::kDiscovery)
// naming the folder (and the files) on: no such folder, no weights found (the error
// lists the patterns tried), index shards missing on disk (all listed), index paths
// that are absolute or contain "..", an index that does not parse.
ResolvedSource resolve_source(const std::string& folder, const DiscoveryOptions& options = {});

// The ordering rule alone (exposed for tests): `names` sorted/staggered per options.
// `directory_order` is used as is when sort_weight_files == -1.
std::vector<std::string> order_weight_files(std::vector<std::string> names,
                                            int sort_weight_files, int tp_size, int tp_rank);

}  // namespace ferry::io
