// A tiny synthetic checkpoint for tests that need one of a family (ferry synth's
// tiny preset), for the suites that link ferry_synth.
#pragma once

#include <string>

#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::testing {

// Writes `family`'s tiny preset with `quant` into dir/<name> (the family's name when
// empty), without fsync; returns the folder.
inline std::string synth_tiny(const TempDir& dir, const std::string& family = "llama",
                              synth::SynthQuant quant = synth::SynthQuant::kNone,
                              const std::string& name = "") {
  synth::SynthOptions o;
  o.family = family;
  o.preset = "tiny";
  o.quant = quant;
  o.out = dir.file(name.empty() ? family : name);
  o.fsync = false;
  synth::synthesize(o);
  return o.out;
}

}  // namespace ferry::testing
