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

int attention_group(const FamilyInput& in) {
  const bool split = in.layout.attn_dp > 1 && in.descriptor.attention_dp &&
                     in.descriptor.attention_dp->attention;
  return split ? in.layout.attn_tp() : in.layout.tp;
}

int embedding_group(const FamilyInput& in) {
  const bool split = in.layout.attn_dp > 1 && in.descriptor.attention_dp &&
                     in.descriptor.attention_dp->embedding;
  return split ? in.layout.attn_tp() : 0;
}

int lm_head_group(const FamilyInput& in) {
  // make_model refuses dp_lm_head for a family whose lm_head does not take it.
  return in.layout.dp_lm_head ? in.layout.attn_tp() : 0;
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
