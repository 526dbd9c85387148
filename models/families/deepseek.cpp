// DeepSeek-V2, V3 and V3.2 (python/sglang/srt/models/deepseek_v2.py): multi-head
// latent attention (the MLA split hook), DeepSeekMoE with the router's correction
// bias under noaux_tc, the MTP layer, and V3.2's sparse-attention indexer (its
// fusion hook). The placement is models/deepseek.hpp's.
#include "models/deepseek.hpp"
#include "models/hf_config.hpp"

namespace ferry::models {
namespace {

constexpr const char* kDeepseekV3 = "DeepseekV3ForCausalLM";

}  // namespace

DeepseekConfig parse_deepseek_config(const nlohmann::json& hf_config,
                                     const std::string& architecture) {
  DeepseekConfig c = deepseek_common_config(hf_config, architecture);
  // V3 and V3.2 route with noaux_tc by default (V2: greedy), and only they may have
  // an indexer; SGLang folds the shared expert only for DeepseekV3ForCausalLM.
  const bool v3 = architecture != "DeepseekV2ForCausalLM";
  c.fusion = architecture == kDeepseekV3 ? SharedExpertFusion::kDeepseekV3Shape
                                                   : SharedExpertFusion::kNever;
  c.mla = true;
  c.q_lora_rank = config_optional_positive(hf_config, "q_lora_rank").value_or(0);
  c.kv_lora_rank = config_positive(hf_config, "kv_lora_rank");
  c.qk_nope = config_positive(hf_config, "qk_nope_head_dim");
  c.qk_rope = config_positive(hf_config, "qk_rope_head_dim");
  c.v_head = config_positive(hf_config, "v_head_dim");
  c.moe_layer_freq = config_optional_positive(hf_config, "moe_layer_freq").value_or(1);
  // The router has e_score_correction_bias only for noaux_tc routing (DeepSeek-V3's
  // default; V2's is greedy).
  const std::string topk_method =
      config_string(hf_config, "topk_method", v3 ? "noaux_tc" : "greedy");
  c.gate_bias = topk_method == "noaux_tc";
  // SGLang 0.5.23, deepseek_v2.py MoEGate.__init__: the weight is float32 with
  // getattr(config, "router_fp32", False), else the model dtype.
  c.gate_f32 = config_bool(hf_config, "router_fp32", false);
  // SGLang's is_deepseek_dsa: a DeepSeek-V3 / V3.2 config with index_topk.
  c.indexer = v3 && hf_config.contains("index_topk") && !hf_config["index_topk"].is_null();
  if (c.indexer) {
    c.index_heads = config_positive(hf_config, "index_n_heads");
    c.index_head_dim = config_positive(hf_config, "index_head_dim");
    // deepseek_v2.py: is_neox_style = not indexer_rope_interleave, and the Indexer
    // fuses wk and weights_proj only when not is_neox_style.
    c.indexer_rope_interleave = config_bool(hf_config, "indexer_rope_interleave", false);
    if (c.q_lora_rank == 0) {
      config_error(
          "index_topk (a sparse-attention indexer) needs q_lora_rank: the indexer's "
          "wq_b reads the query latent");
    }
    c.index_topk_freq = config_optional_positive(hf_config, "index_topk_freq").value_or(1);
    c.index_skip_topk_offset = config_optional_positive(hf_config, "index_skip_topk_offset");
    for (const char* key : {"indexer_types", "index_topk_pattern"}) {
      auto it = hf_config.find(key);
      if (it == hf_config.end() || it->is_null() || !c.indexer_types.empty()) {
        continue;
      }
      if (it->is_string()) {  // one character a layer ("ffs...")
        for (char ch : it->get<std::string>()) {
          c.indexer_types.emplace_back(1, ch);
        }
      } else if (it->is_array()) {
        for (const nlohmann::json& v : *it) {
          c.indexer_types.push_back(v.is_string() ? v.get<std::string>() : "");
        }
      } else {
        config_error("field '" + std::string(key) + "' must be a list or a string");
      }
    }
  }
  return c;
}

}  // namespace ferry::models

namespace ferry::models::families {
namespace {

FamilyDescriptor deepseek(std::string architecture, std::string family) {
  FamilyDescriptor d;
  d.architecture = std::move(architecture);
  d.family = std::move(family);
  d.required_fields = {"hidden_size",      "num_attention_heads", "num_hidden_layers",
                       "vocab_size",       "intermediate_size",   "kv_lora_rank",
                       "qk_nope_head_dim", "qk_rope_head_dim",    "v_head_dim"};
  d.fused = standard_fused_mappings();
  d.fused.push_back({"fused_qkv_a_proj_with_mqa", {"q_a_proj", "kv_a_proj_with_mqa"}});
  d.options = kTakesExperts | kTakesDraft | kTakesSharedExpertFusion | kTakesMoeDenseTp |
              kTakesDeepep;
  // Under attention data parallelism (SGLang 0.5.23, deepseek_v2.py):
  // DeepseekV2AttentionMLA splits q_b_proj / q_proj, kv_b_proj and o_proj over the
  // attention tp group; DeepseekV2Model's embedding is
  // VocabParallelEmbedding(**get_embedding_tp_kwargs()): over the attention tp group
  // (whole only with SGLANG_ENABLE_EMBED_REPLICATION, which ferry does not model);
  // the ParallelLMHead takes use_attn_tp_group=enable_dp_lm_head.
  d.attention_dp = AttentionDpLayout{.attention = true, .embedding = true, .dp_lm_head = true};
  d.build = [](const FamilyInput& in) {
    return make_deepseek_model(in, parse_deepseek_config(in.config, in.descriptor.architecture));
  };
  d.hooks.push_back(deepseek_mla_hooks);
  d.hooks.push_back(deepseek_indexer_hooks);
  return d;
}

}  // namespace

std::vector<FamilyDescriptor> deepseek() {
  return {deepseek("DeepseekV2ForCausalLM", "deepseek_v2"),
          deepseek(kDeepseekV3, "deepseek_v3"),
          deepseek("DeepseekV32ForCausalLM", "deepseek_v32")};
}

}  // namespace ferry::models::families
