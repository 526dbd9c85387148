// The library side of `ferry inspect` (also used by `ferry demo`).
#pragma once

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "io/discover.hpp"
#include "io/safetensors.hpp"

namespace ferry::tools {

struct InspectOptions {
  io::DiscoveryOptions discovery;
  io::IndexOptions index;
};

struct Inspection {
  io::ResolvedSource source;
  io::CheckpointIndex index;
};

// PATH is a folder (discovery + index rules) or one .safetensors file on its own.
// Throws ferry::Error naming the file, tensor and rule on invalid input.
Inspection inspect_path(const std::string& path, const InspectOptions& options = {});

// The stable JSON form (docs/inspect-json.md).
nlohmann::json inspection_json(const Inspection& inspection);

// The human form.
void print_inspection(const Inspection& inspection, std::FILE* out);

}  // namespace ferry::tools
