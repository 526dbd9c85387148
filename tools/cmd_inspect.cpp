// `ferry inspect PATH [--load-format F] [--json] [--strict]`: which files of a
// checkpoint are weights and why, and every tensor's dtype, shape and byte range.
// The JSON form is a stable interface, documented in docs/inspect-json.md.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/format.hpp"
#include "io/discover.hpp"
#include "io/safetensors.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"
#include "tools/inspect.hpp"

namespace ferry::tools {
namespace {

constexpr const char kDescription[] =
    "Lists and validates a checkpoint's weight files and tensors: which files are weights\n"
    "and why, and every tensor's dtype, shape and byte range.";

}  // namespace

Inspection inspect_path(const std::string& path, const InspectOptions& options) {
  namespace fs = std::filesystem;
  Inspection out;
  std::error_code ec;
  if (fs::is_regular_file(path, ec) && fs::path(path).extension() == ".safetensors") {
    // One file on its own: no folder index, no discovery rules.
    fs::path p(path);
    out.source.folder = p.has_parent_path() ? p.parent_path().string() : ".";
    out.source.pattern = p.filename().string();
    out.source.files.push_back({path, p.filename().string(), "inspected on its own (no index)"});
    out.source.decisions.push_back("single file: the folder's index is not consulted");
  } else {
    out.source = io::resolve_source(path, options.discovery);
  }
  out.index = io::build_checkpoint_index(out.source, options.index);
  return out;
}

nlohmann::json inspection_json(const Inspection& in) {
  nlohmann::json files = nlohmann::json::array();
  for (const auto& f : in.index.files) {
    files.push_back(
        {{"path", f.name}, {"bytes", f.size}, {"tensors", f.tensor_count}, {"reason", f.reason}});
  }
  nlohmann::json skipped = nlohmann::json::array();
  for (const auto& s : in.source.skipped) {
    skipped.push_back({{"path", s.name}, {"reason", s.reason}});
  }
  nlohmann::json warnings = nlohmann::json::array();
  for (const auto& w : in.source.warnings) {
    warnings.push_back(w);
  }
  for (const auto& w : in.index.warnings) {
    warnings.push_back(w);
  }
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : in.index.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", std::string(dtype_name(t.dtype))},
                       {"shape", t.shape},
                       {"file", t.file},
                       {"offset", t.offset},
                       {"nbytes", t.nbytes}});
    if (t.blocks != GgmlBlocks::kNone) {
      // A quantized GGUF tensor: F32 elements once dequantized, stored in these blocks.
      tensors.back()["ggml_blocks"] = std::string(ggml_blocks_name(t.blocks));
    }
  }
  return {{"files", files},
          {"skipped", skipped},
          {"warnings", warnings},
          {"tensors", tensors},
          {"total_bytes", in.index.total_bytes}};
}

void print_inspection(const Inspection& in, std::FILE* out) {
  const auto& src = in.source;
  std::fprintf(out, "checkpoint: %s\n", src.folder.c_str());
  for (const auto& d : src.decisions) {
    std::fprintf(out, "  %s\n", d.c_str());
  }
  std::fprintf(out, "files (%zu):\n", in.index.files.size());
  for (const auto& f : in.index.files) {
    std::fprintf(out, "  %-40s %10s %6zu tensors  (%s)\n", f.name.c_str(),
                 human_bytes(f.size).c_str(), f.tensor_count, f.reason.c_str());
  }
  if (!src.skipped.empty()) {
    std::fprintf(out, "skipped (%zu):\n", src.skipped.size());
    for (const auto& s : src.skipped) {
      std::fprintf(out, "  %-40s (%s)\n", s.name.c_str(), s.reason.c_str());
    }
  }
  std::size_t nwarn = src.warnings.size() + in.index.warnings.size();
  if (nwarn > 0) {
    std::fprintf(out, "warnings (%zu):\n", nwarn);
    for (const auto& w : src.warnings)
      std::fprintf(out, "  %s\n", w.c_str());
    for (const auto& w : in.index.warnings)
      std::fprintf(out, "  %s\n", w.c_str());
  }
  std::fprintf(out, "tensors (%zu):\n", in.index.tensors.size());
  for (const auto& t : in.index.tensors) {
    std::fprintf(out, "  %-56s %-7s %-18s %s @%llu +%llu\n", t.name.c_str(),
                 std::string(t.blocks != GgmlBlocks::kNone ? ggml_blocks_name(t.blocks)
                                                           : dtype_name(t.dtype))
                     .c_str(),
                 format_dims(t.shape).c_str(), t.file.c_str(),
                 static_cast<unsigned long long>(t.offset),
                 static_cast<unsigned long long>(t.nbytes));
  }
  std::fprintf(out, "total: %zu tensors, %s of tensor data (%llu bytes) in %zu files\n",
               in.index.tensors.size(), human_bytes(in.index.total_bytes).c_str(),
               static_cast<unsigned long long>(in.index.total_bytes), in.index.files.size());
}

int cmd_inspect(const Args& args) {
  CLI::App app(kDescription, "ferry inspect");
  std::string path;
  bool as_json = false;
  std::string load_format = "auto";
  InspectOptions options;
  app.add_option("PATH", path,
                 "a checkpoint folder, or one .safetensors file (inspected on its own)")
      ->required();
  app.add_option("--load-format", load_format, "which weight files to look for")
      ->type_name("auto|safetensors|mistral|pt")
      ->check(known_value(
          [](const std::string& text) { return io::parse_load_format(text).has_value(); },
          "load format", "auto, safetensors, mistral, pt"));
  add_switch(app, "--json", as_json,
             "print one JSON document (docs/inspect-json.md); logs go to stderr");
  add_switch(app, "--strict", options.index.strict,
             "tensors the index does not list are an error, not a warning");
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  options.discovery.format = *io::parse_load_format(load_format);  // checked by the validator
  Inspection in;
  try {
    in = inspect_path(path, options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry inspect: %s: error: %s\n", path.c_str(), e.what());
    return 1;
  }
  if (as_json) {
    std::cout << inspection_json(in).dump(2) << "\n";
  } else {
    print_inspection(in, stdout);
  }
  return 0;
}

}  // namespace ferry::tools
