#include "models/family.hpp"

#include "common/error.hpp"

namespace ferry::models {

const std::vector<std::string>& FamilyDescriptor::sources(std::string_view param) const {
  for (const FusedMapping& m : fused) {
    if (m.param == param) {
      return m.sources;
    }
  }
  throw Error(Stage::kPlacement, "", std::string(param),
              "internal: " + architecture + " declares no fused mapping for " +
                  std::string(param));
}

std::vector<FusedMapping> standard_fused_mappings() {
  return {
      {"qkv_proj", {"q_proj", "k_proj", "v_proj"}},
      {"gate_up_proj", {"gate_proj", "up_proj"}},
      {"experts.w13_weight", {"gate_proj", "up_proj"}},
      {"experts.w2_weight", {"down_proj"}},
  };
}

const FamilyDescriptor* find_family(std::string_view architecture) {
  for (const FamilyDescriptor& d : family_descriptors()) {
    if (d.architecture == architecture) {
      return &d;
    }
  }
  return nullptr;
}

}  // namespace ferry::models
