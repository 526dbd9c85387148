// The registry of synthetic families: one line per family, in synth_families()'s
// order, which is stable (new families are appended, never inserted: fuzz seeds and
// tests index it). Each family is a function families::<name>() in the
// synth/families/ file of its models/families/ twin.
#include <set>

#include "common/format.hpp"
#include "synth/family.hpp"

#define FERRY_SYNTH_FAMILIES(X) \
  X(llama)                      \
  X(qwen2)                      \
  X(mixtral)                    \
  X(qwen3_moe)                  \
  X(deepseek_v3)                \
  X(mistral)                    \
  X(qwen2_moe)                  \
  X(deepseek_v2)                \
  X(glm4_moe)                   \
  X(deepseek_v32)               \
  X(qwen3)                      \
  X(gemma)                      \
  X(gemma2)                     \
  X(gemma3)                     \
  X(phi3)

namespace ferry::synth {
namespace families {
#define FERRY_DECLARE_SYNTH_FAMILY(fn) SynthFamily fn();
FERRY_SYNTH_FAMILIES(FERRY_DECLARE_SYNTH_FAMILY)
#undef FERRY_DECLARE_SYNTH_FAMILY
}  // namespace families

const std::vector<SynthFamily>& synth_family_registry() {
  static const std::vector<SynthFamily> all = [] {
    std::vector<SynthFamily> out;
    std::set<std::string> seen;
#define FERRY_ADD_SYNTH_FAMILY(fn)                                                             \
  out.push_back(families::fn());                                                               \
  if (out.back().name != #fn || out.back().architectures.empty() || !out.back().preset_dims || \
      !out.back().config_dims || !out.back().layer || !out.back().config ||                    \
      !seen.insert(out.back().architectures[0]).second) {                                      \
    fail("", "internal: synthetic family " #fn " is registered incompletely or twice");        \
  }
    FERRY_SYNTH_FAMILIES(FERRY_ADD_SYNTH_FAMILY)
#undef FERRY_ADD_SYNTH_FAMILY
    return out;
  }();
  return all;
}

const SynthFamily& find_synth_family(std::string_view name) {
  for (const SynthFamily& f : synth_family_registry()) {
    if (f.name == name) {
      return f;
    }
  }
  fail("", "unknown family '" + std::string(name) + "' (expected one of " +
               join_list(synth_families()) + ")");
}

}  // namespace ferry::synth
