#include "models/family.hpp"

#include "common/error.hpp"
#include "models/table_model.hpp"

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

StageEdges stage_edges(const FamilyInput& in, std::uint64_t hidden, std::uint64_t vocab,
                       bool tie_embeddings) {
  StageEdges edges;
  edges.hidden = hidden;
  edges.vocab = vocab;
  edges.tie_embeddings = tie_embeddings;
  edges.embed_group = embedding_group(in);
  edges.head_group = lm_head_group(in);
  edges.head_on_every_stage = in.descriptor.takes(kLmHeadOnEveryStage);
  return edges;
}

void set_family_quantization(TableModel& m, const FamilyInput& in, QuantScheme quant) {
  if (in.descriptor.takes(kNoKvCacheScales)) {
    quant.kv_cache_params = false;
  }
  if (quant.kv_cache_scales && in.descriptor.takes(kNoKvCacheScales)) {
    quant.kv_cache_scales = false;
    for (const char* name : {"self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale",
                             "self_attn.k_scale", "self_attn.v_scale"}) {
      m.add_drop_pattern(name, "no_kv_scale_param");
    }
  }
  m.set_quantization(quant);
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
