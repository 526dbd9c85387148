// Tests for io/discover: which files of a checkpoint folder are weights, the index and
// packaging rules, symbolic links, the errors, and the per-rank ordering.
#include "io/discover.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::io {
namespace {

namespace fs = std::filesystem;
using ferry::testing::TempDir;
using ferry::testing::write_file;

std::vector<std::string> names_of(const ResolvedSource& source) {
  std::vector<std::string> out;
  for (const WeightFile& f : source.files) {
    out.push_back(f.name);
  }
  return out;
}

const SkippedFile* find_skipped(const ResolvedSource& source, const std::string& name) {
  for (const SkippedFile& s : source.skipped) {
    if (s.name == name) {
      return &s;
    }
  }
  return nullptr;
}

bool has_line_containing(const std::vector<std::string>& lines, const std::string& text) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& l) { return l.find(text) != std::string::npos; });
}

void touch(const TempDir& dir, const std::string& name) {
  write_file(dir.file(name), "x");
}

// `prefix` followed by `i` zero-padded to `width` digits. Built by appending: g++ 12 at
// -O3 reports a false -Wrestrict for "literal" + std::to_string(...) (GCC bug 105329).
std::string numbered(std::string prefix, int i, std::size_t width) {
  const std::string digits = std::to_string(i);
  if (digits.size() < width) {
    prefix.append(width - digits.size(), '0');
  }
  prefix += digits;
  return prefix;
}

// An index mapping tensor "t<i>" to each shard in turn.
std::string index_json(const std::vector<std::string>& shards) {
  nlohmann::json map = nlohmann::json::object();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    map[numbered("t", static_cast<int>(i), 1)] = shards[i];
  }
  return nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump();
}

// Runs `fn`, expecting a ferry::Error of `stage`; returns it for more checks.
template <typename Fn>
Error expect_error(Stage stage, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), stage) << e.what();
    return e;
  }
  ADD_FAILURE() << "no ferry::Error thrown";
  return Error(Stage::kCancelled, "", "", "none");
}

// Captures log output for the life of the object.
class LogCapture {
 public:
  LogCapture() : previous_level_(log::level()) {
    log::set_level(log::Level::kDebug);  // FERRY_LOG may raise it in the environment
    previous_ = log::set_sink([this](log::Level level, std::string_view message) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(std::string(level == log::Level::kWarn ? "warn: " : "other: ") +
                          std::string(message));
    });
  }
  ~LogCapture() {
    log::set_sink(previous_);
    log::set_level(previous_level_);
  }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }

 private:
  log::Level previous_level_;
  log::Sink previous_;
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// ---- load formats ------------------------------------------------------------------------

TEST(DiscoverLoadFormat, ParsesAndPrints) {
  for (LoadFormat f : {LoadFormat::kAuto, LoadFormat::kSafetensors, LoadFormat::kMistral,
                       LoadFormat::kPt, LoadFormat::kDummy}) {
    EXPECT_EQ(parse_load_format(to_string(f)), f);
  }
  EXPECT_EQ(to_string(LoadFormat::kAuto), "auto");
  EXPECT_EQ(to_string(LoadFormat::kSafetensors), "safetensors");
  EXPECT_EQ(to_string(LoadFormat::kMistral), "mistral");
  EXPECT_EQ(to_string(LoadFormat::kPt), "pt");
  EXPECT_EQ(parse_load_format("Auto"), std::nullopt);
  EXPECT_EQ(to_string(LoadFormat::kDummy), "dummy");
  EXPECT_EQ(parse_load_format("Dummy"), std::nullopt);
  EXPECT_EQ(parse_load_format(""), std::nullopt);
}

// The dummy format is the runtime's: discovery has no files to find for it.
TEST(DiscoverLoadFormat, DummyIsRefusedByDiscovery) {
  TempDir dir;
  const Error e = expect_error(Stage::kDiscovery,
                               [&] { resolve_source(dir.str(), {.format = LoadFormat::kDummy}); });
  EXPECT_NE(e.rule().find("load format dummy reads no weight files"), std::string::npos)
      << e.what();
}

TEST(Discover, AutoPrefersSafetensors) {
  TempDir dir;
  touch(dir, "b.safetensors");
  touch(dir, "a.safetensors");
  touch(dir, "pytorch_model.bin");
  touch(dir, "config.json");
  touch(dir, ".hidden.safetensors");
  fs::create_directory(dir.path() / "sub");
  touch(dir, "sub/deep.safetensors");  // no recursion
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"a.safetensors", "b.safetensors"}));
  EXPECT_EQ(s.format, FileFormat::kSafetensors);
  EXPECT_EQ(s.load_format, LoadFormat::kAuto);
  EXPECT_EQ(s.pattern, "*.safetensors");
  EXPECT_EQ(s.folder, dir.str());
  EXPECT_FALSE(s.index_file.has_value());
  EXPECT_EQ(s.files[0].path, (dir.path() / "a.safetensors").string());
  EXPECT_EQ(s.files[0].reason, "matches *.safetensors (no index)");
  EXPECT_TRUE(has_line_containing(s.decisions, "load format auto: *.safetensors matched 2 files"));
  EXPECT_TRUE(
      has_line_containing(s.decisions, "order: sorted bytewise (load.sort_weight_files=0)"));
}

TEST(Discover, AutoFallsBackToBinAndSkipsTrainingState) {
  TempDir dir;
  touch(dir, "pytorch_model-00002-of-00002.bin");
  touch(dir, "pytorch_model-00001-of-00002.bin");
  for (const char* leftover :
       {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}) {
    touch(dir, leftover);
  }
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"pytorch_model-00001-of-00002.bin",
                                                   "pytorch_model-00002-of-00002.bin"}));
  EXPECT_EQ(s.format, FileFormat::kPickle);
  EXPECT_EQ(s.pattern, "*.bin");
  EXPECT_TRUE(has_line_containing(s.decisions, "*.safetensors matched no weight file"));
  for (const char* leftover : {"training_args.bin", "optimizer.bin"}) {
    const SkippedFile* skipped = find_skipped(s, leftover);
    ASSERT_NE(skipped, nullptr) << leftover;
    EXPECT_EQ(skipped->reason, "training state, not weights");
  }
  // *.pt is not an auto pattern: those leftovers were never matched.
  EXPECT_EQ(find_skipped(s, "scheduler.pt"), nullptr);
}

TEST(Discover, BinIndexDecidesTheShardsAndPtHasNone) {
  TempDir dir;
  touch(dir, "pytorch_model-00001-of-00002.bin");
  touch(dir, "pytorch_model-00002-of-00002.bin");
  touch(dir, "stale.bin");
  write_file(dir.file("pytorch_model.bin.index.json"),
             R"({"weight_map": {"a": "pytorch_model-00001-of-00002.bin",
                                "b": "pytorch_model-00002-of-00002.bin"}})");
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"pytorch_model-00001-of-00002.bin",
                                                   "pytorch_model-00002-of-00002.bin"}));
  EXPECT_EQ(s.index_file, "pytorch_model.bin.index.json");
  ASSERT_NE(find_skipped(s, "stale.bin"), nullptr);
  EXPECT_EQ(find_skipped(s, "stale.bin")->reason, "not in pytorch_model.bin.index.json");
  // A shard the index names but the folder lacks is an error, as for safetensors.
  fs::remove(dir.path() / "pytorch_model-00002-of-00002.bin");
  try {
    resolve_source(dir.str());
    ADD_FAILURE() << "a missing shard was not refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pytorch_model-00002-of-00002.bin"), std::string::npos)
        << e.what();
  }
  // *.pt checkpoints have no index: every *.pt is a weight file.
  TempDir pt;
  touch(pt, "a.pt");
  touch(pt, "b.pt");
  write_file(pt.file("pytorch_model.bin.index.json"), R"({"weight_map": {"a": "a.pt"}})");
  const ResolvedSource p = resolve_source(pt.str(), {.format = LoadFormat::kPt});
  EXPECT_EQ(names_of(p), (std::vector<std::string>{"a.pt", "b.pt"}));
  EXPECT_FALSE(p.index_file.has_value());
}

TEST(Discover, GgufIsOneFileNamedOrAloneInItsFolder) {
  TempDir dir;
  touch(dir, "model-Q8_0.gguf");
  touch(dir, "README.md");
  // auto: no safetensors and no .bin, so *.gguf; one file, no index.
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"model-Q8_0.gguf"}));
  EXPECT_EQ(s.format, FileFormat::kGguf);
  EXPECT_EQ(s.pattern, "*.gguf");
  EXPECT_FALSE(s.index_file.has_value());
  // Two quantizations side by side: which one is not guessed.
  touch(dir, "model-F16.gguf");
  try {
    resolve_source(dir.str(), {.format = LoadFormat::kGguf});
    ADD_FAILURE() << "two GGUF files were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 GGUF files (model-F16.gguf, model-Q8_0.gguf)"),
              std::string::npos)
        << e.what();
  }
  // model.path naming the file (SGLang's --model-path x.gguf), with auto or gguf.
  for (LoadFormat f : {LoadFormat::kAuto, LoadFormat::kGguf}) {
    const ResolvedSource one = resolve_source(dir.file("model-F16.gguf"), {.format = f});
    EXPECT_EQ(names_of(one), (std::vector<std::string>{"model-F16.gguf"}));
    EXPECT_EQ(one.folder, dir.str());
    EXPECT_EQ(one.format, FileFormat::kGguf);
  }
  // A file with another name is a GGUF only when the format says so.
  touch(dir, "weights.bin");
  EXPECT_EQ(resolve_source(dir.file("weights.bin"), {.format = LoadFormat::kGguf}).format,
            FileFormat::kGguf);
  EXPECT_THROW(resolve_source(dir.file("weights.bin")), Error);
  // With safetensors present, auto loads those.
  touch(dir, "model.safetensors");
  EXPECT_EQ(resolve_source(dir.str()).format, FileFormat::kSafetensors);
}

TEST(Discover, PtFormatMatchesPtAndSkipsTrainingState) {
  TempDir dir;
  touch(dir, "model.pt");
  touch(dir, "optimizer.pt");
  touch(dir, "scheduler.pt");
  touch(dir, "scaler.pt");
  touch(dir, "model.safetensors");  // ignored: pt format looks for *.pt only
  const ResolvedSource s = resolve_source(dir.str(), {.format = LoadFormat::kPt});
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"model.pt"}));
  EXPECT_EQ(s.format, FileFormat::kPickle);
  EXPECT_EQ(s.pattern, "*.pt");
  EXPECT_EQ(s.skipped.size(), 3u);
  for (const SkippedFile& skipped : s.skipped) {
    EXPECT_EQ(skipped.reason, "training state, not weights") << skipped.name;
  }
}

TEST(Discover, SafetensorsFormatIgnoresBin) {
  TempDir dir;
  touch(dir, "pytorch_model.bin");
  Error e = expect_error(Stage::kDiscovery,
                         [&] { resolve_source(dir.str(), {.format = LoadFormat::kSafetensors}); });
  EXPECT_EQ(std::string(e.what()),
            "discovery: " + dir.str() + ": no weight files found (tried *.safetensors)");
  touch(dir, "model.safetensors");
  const ResolvedSource s = resolve_source(dir.str(), {.format = LoadFormat::kSafetensors});
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"model.safetensors"}));
  EXPECT_EQ(s.load_format, LoadFormat::kSafetensors);
}

TEST(Discover, OnlyTrainingStateIsNoWeights) {
  TempDir dir;
  touch(dir, "training_args.bin");
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  const std::string what = e.what();
  EXPECT_NE(what.find("no weight files found (tried *.safetensors, *.bin, *.gguf)"),
            std::string::npos);
  EXPECT_NE(what.find("training_args.bin (training state, not weights)"), std::string::npos);
}

TEST(Discover, MistralFormatUsesConsolidatedIndex) {
  TempDir dir;
  touch(dir, "consolidated-00001-of-00002.safetensors");
  touch(dir, "consolidated-00002-of-00002.safetensors");
  touch(dir, "consolidated.safetensors");  // not in the consolidated index
  touch(dir, "model-00001-of-00001.safetensors");
  // The HF index would filter everything away if it were (wrongly) used.
  write_file(dir.file("model.safetensors.index.json"),
             index_json({"model-00001-of-00001.safetensors"}));
  write_file(dir.file("consolidated.safetensors.index.json"),
             index_json({"consolidated-00001-of-00002.safetensors",
                         "consolidated-00002-of-00002.safetensors"}));
  const ResolvedSource s = resolve_source(dir.str(), {.format = LoadFormat::kMistral});
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"consolidated-00001-of-00002.safetensors",
                                                   "consolidated-00002-of-00002.safetensors"}));
  EXPECT_EQ(s.pattern, "consolidated*.safetensors");
  EXPECT_EQ(s.index_file, "consolidated.safetensors.index.json");
  EXPECT_EQ(s.files[0].reason, "named by consolidated.safetensors.index.json");
  const SkippedFile* skipped = find_skipped(s, "consolidated.safetensors");
  ASSERT_NE(skipped, nullptr);
  EXPECT_EQ(skipped->reason, "not in consolidated.safetensors.index.json");
  EXPECT_EQ(find_skipped(s, "model-00001-of-00001.safetensors"), nullptr);  // never matched
}

TEST(Discover, MistralFormatWithoutIndexTakesAllConsolidated) {
  TempDir dir;
  touch(dir, "consolidated.safetensors");
  touch(dir, "model.safetensors");
  const ResolvedSource s = resolve_source(dir.str(), {.format = LoadFormat::kMistral});
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"consolidated.safetensors"}));
  EXPECT_FALSE(s.index_file.has_value());
}

TEST(Discover, ConsolidatedAndModelWithoutIndexKeepsModel) {
  TempDir dir;
  touch(dir, "consolidated.safetensors");
  touch(dir, "model.safetensors");
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"model.safetensors"}));
  const SkippedFile* skipped = find_skipped(s, "consolidated.safetensors");
  ASSERT_NE(skipped, nullptr);
  EXPECT_NE(skipped->reason.find("duplicates model.safetensors"), std::string::npos);

  // With a third file the pair rule (exactly those two files) does not apply.
  touch(dir, "extra.safetensors");
  const ResolvedSource three = resolve_source(dir.str());
  EXPECT_EQ(names_of(three), (std::vector<std::string>{"consolidated.safetensors",
                                                       "extra.safetensors", "model.safetensors"}));
}

// ---- the index -----------------------------------------------------------------------------

TEST(Discover, IndexKeepsOnlyItsShards) {
  TempDir dir;
  touch(dir, "model-00001-of-00002.safetensors");
  touch(dir, "model-00002-of-00002.safetensors");
  touch(dir, "consolidated.safetensors");
  touch(dir, "model.safetensors");
  write_file(dir.file("model.safetensors.index.json"),
             index_json({"model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors",
                         "model-00002-of-00002.safetensors"}));
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                   "model-00002-of-00002.safetensors"}));
  EXPECT_EQ(s.index_file, "model.safetensors.index.json");
  for (const WeightFile& f : s.files) {
    EXPECT_EQ(f.reason, "named by model.safetensors.index.json");
  }
  ASSERT_EQ(s.skipped.size(), 2u);
  EXPECT_EQ(s.skipped[0].name, "consolidated.safetensors");
  EXPECT_EQ(s.skipped[1].name, "model.safetensors");
  for (const SkippedFile& skipped : s.skipped) {
    EXPECT_EQ(skipped.reason, "not in model.safetensors.index.json");
  }
  EXPECT_TRUE(has_line_containing(s.decisions, "3 tensors in 2 shard files"));
}

TEST(Discover, MissingShardsAreAllListed) {
  TempDir dir;
  const std::vector<std::string> shards = {
      "model-00001-of-00005.safetensors", "model-00002-of-00005.safetensors",
      "model-00003-of-00005.safetensors", "model-00004-of-00005.safetensors",
      "model-00005-of-00005.safetensors"};
  touch(dir, shards[0]);
  touch(dir, shards[2]);
  write_file(dir.file("model.safetensors.index.json"), index_json(shards));
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  const std::string what = e.what();
  EXPECT_EQ(e.file(), dir.file("model.safetensors.index.json"));
  EXPECT_NE(what.find("3 of 5 shard files named by the index are missing"), std::string::npos)
      << what;
  for (const std::size_t i : {1u, 3u, 4u}) {
    EXPECT_NE(what.find(shards[i]), std::string::npos) << shards[i] << " not in: " << what;
  }
  EXPECT_EQ(what.find(shards[0]), std::string::npos) << what;
  EXPECT_EQ(what.find(shards[2]), std::string::npos) << what;
}

TEST(Discover, IndexedShardThatIsADirectoryIsMissing) {
  TempDir dir;
  touch(dir, "a.safetensors");
  fs::create_directory(dir.path() / "b.safetensors");
  write_file(dir.file("model.safetensors.index.json"),
             index_json({"a.safetensors", "b.safetensors"}));
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  EXPECT_NE(std::string(e.what()).find("b.safetensors (a directory)"), std::string::npos)
      << e.what();
}

TEST(Discover, ShardNamesOutsideTheFolderAreRejected) {
  for (const std::string bad : {"/etc/passwd", "../outside.safetensors", "a/../b.safetensors",
                                "sub/..", "./a.safetensors", "sub//a.safetensors", ""}) {
    SCOPED_TRACE(bad);
    TempDir dir;
    touch(dir, "a.safetensors");
    nlohmann::json index = {
        {"weight_map", {{"model.embed.weight", "a.safetensors"}, {"model.zz.weight", bad}}}};
    write_file(dir.file("model.safetensors.index.json"), index.dump());
    Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
    EXPECT_EQ(e.file(), dir.file("model.safetensors.index.json"));
    EXPECT_EQ(e.tensor(), "model.zz.weight");
    EXPECT_NE(e.rule().find("'" + bad + "'"), std::string::npos) << e.what();
    EXPECT_NE(e.rule().find("relative paths inside the folder"), std::string::npos);
  }
}

TEST(Discover, SubfolderShardNamedByIndexIsIncluded) {
  TempDir dir;
  touch(dir, "model-00001-of-00002.safetensors");
  touch(dir, "sub/model-00002-of-00002.safetensors");
  write_file(
      dir.file("model.safetensors.index.json"),
      index_json({"model-00001-of-00002.safetensors", "sub/model-00002-of-00002.safetensors"}));
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                   "sub/model-00002-of-00002.safetensors"}));
  EXPECT_EQ(s.files[1].path, (dir.path() / "sub/model-00002-of-00002.safetensors").string());
  EXPECT_NE(s.files[1].reason.find("in a subfolder"), std::string::npos);

  fs::remove(dir.path() / "sub/model-00002-of-00002.safetensors");
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  EXPECT_NE(std::string(e.what()).find("sub/model-00002-of-00002.safetensors"), std::string::npos);
}

TEST(Discover, EmptyWeightMapIsAnError) {
  TempDir dir;
  touch(dir, "model.safetensors");
  write_file(dir.file("model.safetensors.index.json"), R"({"weight_map": {}})");
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  EXPECT_EQ(e.file(), dir.file("model.safetensors.index.json"));
  EXPECT_NE(e.rule().find("names no shard files"), std::string::npos);
}

TEST(Discover, UnparsableIndexIsAnIndexError) {
  TempDir dir;
  touch(dir, "model.safetensors");
  write_file(dir.file("model.safetensors.index.json"), "{ not json");
  Error e = expect_error(Stage::kIndex, [&] { resolve_source(dir.str()); });
  EXPECT_NE(std::string(e.what()).find("model.safetensors.index.json"), std::string::npos);
}

TEST(Discover, PickleWinnerDoesNotUseSafetensorsIndex) {
  TempDir dir;
  touch(dir, "pytorch_model.bin");
  write_file(dir.file("model.safetensors.index.json"), index_json({"model.safetensors"}));
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"pytorch_model.bin"}));
  EXPECT_FALSE(s.index_file.has_value());
  // *.bin's own index is pytorch_model.bin.index.json; the safetensors one is not read.
  EXPECT_TRUE(
      has_line_containing(s.decisions, "no index (pytorch_model.bin.index.json is absent)"));
}

// ---- GLM-4 MoE mtp.safetensors ---------------------------------------------------------------

void make_glm_folder(const TempDir& dir, const std::string& config) {
  touch(dir, "model-00001-of-00002.safetensors");
  touch(dir, "model-00002-of-00002.safetensors");
  touch(dir, "mtp.safetensors");
  write_file(dir.file("model.safetensors.index.json"),
             index_json({"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}));
  if (!config.empty()) {
    write_file(dir.file("config.json"), config);
  }
}

TEST(Discover, GlmMoeAddsUnindexedMtpWithWarning) {
  for (const char* arch : {"Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM"}) {
    SCOPED_TRACE(arch);
    TempDir dir;
    make_glm_folder(
        dir, nlohmann::json{{"architectures", {arch}}, {"num_nextn_predict_layers", 1}}.dump());
    LogCapture capture;
    const ResolvedSource s = resolve_source(dir.str());
    EXPECT_EQ(names_of(s),
              (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors", "mtp.safetensors"}));
    EXPECT_EQ(s.files[2].reason,
              std::string("mtp.safetensors added for ") + arch + " (num_nextn_predict_layers=1)");
    ASSERT_EQ(s.warnings.size(), 1u);
    EXPECT_NE(s.warnings[0].find("mtp.safetensors is not in model.safetensors.index.json"),
              std::string::npos)
        << s.warnings[0];
    EXPECT_EQ(find_skipped(s, "mtp.safetensors"), nullptr);
    EXPECT_TRUE(has_line_containing(capture.lines(), "warn: discovery: " + dir.str()));
    EXPECT_TRUE(has_line_containing(capture.lines(), "mtp.safetensors is not in"));
  }
}

TEST(Discover, GlmMtpFollowsTheOrderingRule) {
  TempDir dir;
  make_glm_folder(dir,
                  R"({"architectures": ["Glm4MoeForCausalLM"], "num_nextn_predict_layers": 1})");
  touch(dir, "a-first.safetensors");  // sorts before everything; index does not name it
  // -1: indexed shards first (directory order), mtp appended.
  const ResolvedSource kept = resolve_source(dir.str(), {.sort_weight_files = -1});
  ASSERT_EQ(kept.files.size(), 3u);
  EXPECT_EQ(kept.files.back().name, "mtp.safetensors");
  // k > 0 with tp_size 2: sorted, then rotated within groups of 2: [m1, m2] [mtp].
  const ResolvedSource staggered =
      resolve_source(dir.str(), {.sort_weight_files = 1, .tp_size = 2, .tp_rank = 1});
  EXPECT_EQ(names_of(staggered),
            (std::vector<std::string>{"model-00002-of-00002.safetensors",
                                      "model-00001-of-00002.safetensors", "mtp.safetensors"}));
}

TEST(Discover, MtpNotAddedForOtherModels) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"other architecture",
       R"({"architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 1})"},
      {"no nextn layers",
       R"({"architectures": ["Glm4MoeForCausalLM"], "num_nextn_predict_layers": 0})"},
      {"nextn absent", R"({"architectures": ["Glm4MoeForCausalLM"]})"},
      {"config unparsable", "{ this is not json"},
      {"config absent", ""},
  };
  for (const auto& [label, config] : cases) {
    SCOPED_TRACE(label);
    TempDir dir;
    make_glm_folder(dir, config);
    const ResolvedSource s = resolve_source(dir.str());
    EXPECT_EQ(names_of(s), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors"}));
    EXPECT_TRUE(s.warnings.empty());
    const SkippedFile* skipped = find_skipped(s, "mtp.safetensors");
    ASSERT_NE(skipped, nullptr);
    EXPECT_EQ(skipped->reason, "not in model.safetensors.index.json");
    EXPECT_TRUE(has_line_containing(s.decisions, "mtp.safetensors is not in")) << label;
  }
  TempDir absent;
  make_glm_folder(absent, "");
  EXPECT_TRUE(has_line_containing(resolve_source(absent.str()).decisions, "config.json is absent"));
  TempDir broken;
  make_glm_folder(broken, "[1, 2");
  EXPECT_TRUE(has_line_containing(resolve_source(broken.str()).decisions,
                                  "config.json cannot be read as a JSON object"));
}

// ---- symbolic links ----------------------------------------------------------------------

// A Hugging Face cache: models--org--name/snapshots/<hash>/ holds links into
// models--org--name/blobs/, which stay inside the same models--* folder.
TEST(Discover, SymlinkedShardsAreFollowed) {
  TempDir cache;
  const fs::path repo = cache.path() / "models--org--name";
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "snapshots" / "abc123");
  struct Sub {
    fs::path p;
    fs::path path() const { return p; }
    std::string file(const std::string& name) const { return (p / name).string(); }
    std::string str() const { return p.string(); }
  };
  const Sub blobs{repo / "blobs"};
  const Sub snapshot{repo / "snapshots" / "abc123"};
  write_file(blobs.file("blob-1"), "x");
  write_file(blobs.file("blob-2"), "x");
  write_file(blobs.file("blob-index"),
             index_json({"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}));
  fs::create_symlink(blobs.path() / "blob-1", snapshot.path() / "model-00001-of-00002.safetensors");
  fs::create_symlink(blobs.path() / "blob-2", snapshot.path() / "model-00002-of-00002.safetensors");
  fs::create_symlink(blobs.path() / "blob-index", snapshot.path() / "model.safetensors.index.json");
  // A link to a directory matches the pattern but is not a file.
  fs::create_directory(blobs.path() / "adir");
  fs::create_symlink(blobs.path() / "adir", snapshot.path() / "zdir.safetensors");
  const ResolvedSource s = resolve_source(snapshot.str());
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                   "model-00002-of-00002.safetensors"}));
  EXPECT_EQ(s.files[0].path, snapshot.file("model-00001-of-00002.safetensors"));  // not resolved
  const SkippedFile* dir_link = find_skipped(s, "zdir.safetensors");
  ASSERT_NE(dir_link, nullptr);
  EXPECT_NE(dir_link->reason.find("not a regular file"), std::string::npos) << dir_link->reason;
}

// A link that leaves the checkpoint folder (and is in no Hugging Face cache) is
// refused, naming the file and where it leads, before anything is read.
TEST(Discover, SymlinksLeavingTheFolderAreRefused) {
  TempDir outside;
  TempDir dir;
  write_file(outside.file("secret.safetensors"), "x");
  touch(dir, "model-00001-of-00002.safetensors");
  fs::create_symlink(outside.path() / "secret.safetensors",
                     dir.path() / "model-00002-of-00002.safetensors");
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  EXPECT_EQ(e.file(), dir.file("model-00002-of-00002.safetensors"));
  EXPECT_NE(
      e.rule().find("resolves to " + fs::canonical(outside.file("secret.safetensors")).string() +
                    ", outside the checkpoint folder"),
      std::string::npos)
      << e.what();
  // Inside a models--* folder, a link out of it is refused too.
  TempDir cache;
  const fs::path snap = cache.path() / "models--a--b" / "snapshots" / "h";
  fs::create_directories(snap);
  fs::create_symlink(outside.path() / "secret.safetensors", snap / "model.safetensors");
  e = expect_error(Stage::kDiscovery, [&] { resolve_source(snap.string()); });
  EXPECT_NE(e.rule().find("outside its Hugging Face cache folder"), std::string::npos) << e.what();
  // A link that stays inside the folder is fine.
  TempDir ok;
  write_file(ok.file("real.bin"), "x");
  fs::create_symlink(ok.path() / "real.bin", ok.path() / "model.safetensors");
  EXPECT_EQ(names_of(resolve_source(ok.str())), (std::vector<std::string>{"model.safetensors"}));
}

TEST(Discover, DanglingSymlinkNamedByIndexIsMissing) {
  TempDir blobs;
  TempDir snapshot;
  write_file(blobs.file("blob-1"), "x");
  fs::create_symlink(blobs.path() / "blob-1", snapshot.path() / "model-00001-of-00002.safetensors");
  fs::create_symlink(blobs.path() / "gone", snapshot.path() / "model-00002-of-00002.safetensors");
  write_file(snapshot.file("model.safetensors.index.json"),
             index_json({"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}));
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(snapshot.str()); });
  const std::string what = e.what();
  EXPECT_NE(what.find("1 of 2 shard files named by the index are missing"), std::string::npos)
      << what;
  EXPECT_NE(what.find("model-00002-of-00002.safetensors (dangling symbolic link"),
            std::string::npos)
      << what;
}

TEST(Discover, DanglingSymlinkWithoutIndexIsAnError) {
  TempDir dir;
  touch(dir, "a.safetensors");
  fs::create_symlink(dir.path() / "nowhere", dir.path() / "b.safetensors");
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  EXPECT_NE(std::string(e.what()).find("b.safetensors (dangling symbolic link"), std::string::npos)
      << e.what();
}

TEST(Discover, DanglingIndexIsAnError) {
  TempDir dir;
  touch(dir, "a.safetensors");
  fs::create_symlink(dir.path() / "nowhere", dir.path() / "model.safetensors.index.json");
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  EXPECT_EQ(e.file(), dir.file("model.safetensors.index.json"));
  EXPECT_NE(e.rule().find("dangling symbolic link"), std::string::npos) << e.what();
}

TEST(Discover, SymlinkedFolderIsFollowed) {
  TempDir real;
  TempDir links;
  touch(real, "model.safetensors");
  fs::create_directory_symlink(real.path(), links.path() / "model");
  const std::string folder = (links.path() / "model").string();
  const ResolvedSource s = resolve_source(folder);
  EXPECT_EQ(names_of(s), (std::vector<std::string>{"model.safetensors"}));
  EXPECT_EQ(s.files[0].path, (fs::path(folder) / "model.safetensors").string());
}

// ---- folder errors -------------------------------------------------------------------------

TEST(Discover, EmptyFolderNamesFolderAndPatterns) {
  TempDir dir;
  touch(dir, "config.json");
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  EXPECT_EQ(
      std::string(e.what()),
      "discovery: " + dir.str() + ": no weight files found (tried *.safetensors, *.bin, *.gguf)");
  Error pt = expect_error(Stage::kDiscovery,
                          [&] { resolve_source(dir.str(), {.format = LoadFormat::kPt}); });
  EXPECT_EQ(std::string(pt.what()),
            "discovery: " + dir.str() + ": no weight files found (tried *.pt)");
  Error mistral = expect_error(
      Stage::kDiscovery, [&] { resolve_source(dir.str(), {.format = LoadFormat::kMistral}); });
  EXPECT_EQ(std::string(mistral.what()), "discovery: " + dir.str() +
                                             ": no weight files found (tried "
                                             "consolidated*.safetensors)");
}

TEST(Discover, MissingFolderOrFileIsAnError) {
  TempDir dir;
  const std::string missing = dir.file("no-such-model");
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(missing); });
  EXPECT_EQ(e.file(), missing);
  EXPECT_NE(e.rule().find("no such folder"), std::string::npos);

  touch(dir, "model.safetensors");
  Error f = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.file("model.safetensors")); });
  EXPECT_EQ(f.file(), dir.file("model.safetensors"));
  EXPECT_NE(f.rule().find("not a folder"), std::string::npos);

  expect_error(Stage::kDiscovery, [&] { resolve_source(""); });
}

// ---- ordering ------------------------------------------------------------------------------

TEST(DiscoverOrder, SortsBytewiseByDefault) {
  EXPECT_EQ(order_weight_files({"b", "B", "a", "a0", "_"}, 0, 1, 0),
            (std::vector<std::string>{"B", "_", "a", "a0", "b"}));
  // tp does not change plain sorting.
  EXPECT_EQ(order_weight_files({"c", "a", "b"}, 0, 4, 3),
            (std::vector<std::string>{"a", "b", "c"}));
}

TEST(DiscoverOrder, MinusOneKeepsGivenOrder) {
  EXPECT_EQ(order_weight_files({"c", "a", "b"}, -1, 2, 1),
            (std::vector<std::string>{"c", "a", "b"}));
}

TEST(DiscoverOrder, StaggersTwoRanksGroupFactorOne) {
  const std::vector<std::string> files = {"f4", "f2", "f0", "f3", "f1"};
  // Groups [f0,f1] [f2,f3] [f4]; rank 1 rotates each by 1.
  EXPECT_EQ(order_weight_files(files, 1, 2, 0),
            (std::vector<std::string>{"f0", "f1", "f2", "f3", "f4"}));
  EXPECT_EQ(order_weight_files(files, 1, 2, 1),
            (std::vector<std::string>{"f1", "f0", "f3", "f2", "f4"}));
}

TEST(DiscoverOrder, StaggersFourRanksGroupFactorTwo) {
  std::vector<std::string> files;
  for (int i = 10; i >= 0; --i) {
    files.push_back(numbered("f", i, 2));
  }
  // Groups of 8: [f00..f07] and a last group [f08,f09,f10] of 3; rank r rotates by 2r.
  EXPECT_EQ(order_weight_files(files, 2, 4, 0),
            (std::vector<std::string>{"f00", "f01", "f02", "f03", "f04", "f05", "f06", "f07", "f08",
                                      "f09", "f10"}));
  EXPECT_EQ(order_weight_files(files, 2, 4, 1),  // shift 2; last group (j+2)%3
            (std::vector<std::string>{"f02", "f03", "f04", "f05", "f06", "f07", "f00", "f01", "f10",
                                      "f08", "f09"}));
  EXPECT_EQ(order_weight_files(files, 2, 4, 2),  // shift 4; last group (j+4)%3 = (j+1)%3
            (std::vector<std::string>{"f04", "f05", "f06", "f07", "f00", "f01", "f02", "f03", "f09",
                                      "f10", "f08"}));
  EXPECT_EQ(order_weight_files(files, 2, 4, 3),  // shift 6; last group (j+6)%3 = j
            (std::vector<std::string>{"f06", "f07", "f00", "f01", "f02", "f03", "f04", "f05", "f08",
                                      "f09", "f10"}));
}

TEST(DiscoverOrder, PositiveFactorWithOneRankJustSorts) {
  EXPECT_EQ(order_weight_files({"c", "a", "b"}, 3, 1, 0),
            (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(order_weight_files({}, 2, 4, 1).empty());
}

TEST(DiscoverOrder, RejectsInvalidArguments) {
  Error sort = expect_error(Stage::kConfig, [] { order_weight_files({"a"}, -2, 1, 0); });
  EXPECT_NE(sort.rule().find("load.sort_weight_files"), std::string::npos);
  EXPECT_NE(sort.rule().find("-2"), std::string::npos);
  expect_error(Stage::kConfig, [] { order_weight_files({"a"}, 0, 0, 0); });
  expect_error(Stage::kConfig, [] { order_weight_files({"a"}, 0, -1, 0); });
  expect_error(Stage::kConfig, [] { order_weight_files({"a"}, 0, 2, 2); });
  expect_error(Stage::kConfig, [] { order_weight_files({"a"}, 0, 2, -1); });
  // resolve_source validates before it looks at the disk.
  expect_error(Stage::kConfig,
               [] { resolve_source("/nonexistent-ferry-folder", {.sort_weight_files = -5}); });
  expect_error(Stage::kConfig,
               [] { resolve_source("/nonexistent-ferry-folder", {.tp_size = 2, .tp_rank = 2}); });
}

TEST(Discover, OrderRulesApplyToFolders) {
  TempDir dir;
  for (const char* name :
       {"c.safetensors", "a.safetensors", "e.safetensors", "b.safetensors", "d.safetensors"}) {
    touch(dir, name);
  }
  std::vector<std::string> listing;
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    listing.push_back(entry.path().filename().string());
  }
  const ResolvedSource kept = resolve_source(dir.str(), {.sort_weight_files = -1});
  EXPECT_EQ(names_of(kept), listing);
  EXPECT_TRUE(has_line_containing(kept.decisions, "order: directory order"));

  const ResolvedSource staggered =
      resolve_source(dir.str(), {.sort_weight_files = 1, .tp_size = 2, .tp_rank = 1});
  EXPECT_EQ(names_of(staggered),
            (std::vector<std::string>{"b.safetensors", "a.safetensors", "d.safetensors",
                                      "c.safetensors", "e.safetensors"}));
  EXPECT_TRUE(has_line_containing(staggered.decisions,
                                  "order: staggered in groups of 2, rank 1 rotated by 1"));

  const ResolvedSource big =
      resolve_source(dir.str(), {.sort_weight_files = 2, .tp_size = 4, .tp_rank = 1});
  EXPECT_TRUE(
      has_line_containing(big.decisions, "order: staggered in groups of 8, rank 1 rotated by 2"));
}

TEST(Discover, IndexWithMinusOneKeepsDirectoryOrder) {
  TempDir dir;
  std::vector<std::string> shards;
  for (int i = 1; i <= 6; ++i) {
    shards.push_back(numbered("model-", i, 5) + "-of-00006.safetensors");
    touch(dir, shards.back());
  }
  touch(dir, "unlisted.safetensors");
  write_file(dir.file("model.safetensors.index.json"), index_json(shards));
  std::vector<std::string> listing;
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    const std::string name = entry.path().filename().string();
    if (std::find(shards.begin(), shards.end(), name) != shards.end()) {
      listing.push_back(name);
    }
  }
  const ResolvedSource s = resolve_source(dir.str(), {.sort_weight_files = -1});
  EXPECT_EQ(names_of(s), listing);
}

// ---- real checkpoints ----------------------------------------------------------------------

TEST(DiscoverRealData, MixtralIndexFindsAll19Shards) {
  FERRY_NEED_TEST_DATA();
  const std::string shared_index =
      ::ferry::testing::test_data_path("models/mixtral-8x7b-v0.1/model.safetensors.index.json");
  ASSERT_TRUE(fs::is_regular_file(shared_index)) << shared_index;
  TempDir dir;
  fs::copy_file(shared_index, dir.file("model.safetensors.index.json"));
  std::vector<std::string> expected;
  for (int i = 1; i <= 19; ++i) {
    expected.push_back(numbered("model-", i, 5) + "-of-00019.safetensors");
  }
  // Created in reverse so that sorting is observable on most file systems.
  for (auto it = expected.rbegin(); it != expected.rend(); ++it) {
    touch(dir, *it);
  }
  const ResolvedSource s = resolve_source(dir.str());
  EXPECT_EQ(names_of(s), expected);
  EXPECT_TRUE(s.skipped.empty());
  EXPECT_TRUE(has_line_containing(s.decisions, "in 19 shard files"));

  fs::remove(dir.path() / expected[6]);
  Error e = expect_error(Stage::kDiscovery, [&] { resolve_source(dir.str()); });
  EXPECT_NE(std::string(e.what()).find("1 of 19 shard files named by the index are missing: " +
                                       expected[6]),
            std::string::npos)
      << e.what();
}

TEST(DiscoverRealData, ShardedTestdataCheckpoint) {
  FERRY_NEED_TEST_DATA();
  const std::string folder =
      ::ferry::testing::test_data_path("safetensors/safetensors-jl-testdata/sharded");
  ASSERT_TRUE(fs::is_directory(folder)) << folder;
  const ResolvedSource s = resolve_source(folder);
  std::vector<std::string> expected;
  for (int i = 1; i <= 6; ++i) {
    expected.push_back(numbered("model-", i, 5) + "-of-00006.safetensors");
  }
  EXPECT_EQ(names_of(s), expected);
  EXPECT_EQ(s.index_file, "model.safetensors.index.json");
  EXPECT_EQ(s.format, FileFormat::kSafetensors);
  for (const WeightFile& f : s.files) {
    EXPECT_EQ(f.path, folder + "/" + f.name);
    EXPECT_TRUE(fs::is_regular_file(f.path)) << f.path;
  }
}

}  // namespace
}  // namespace ferry::io
