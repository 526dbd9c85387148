// Gemma 1, 2 and 3 (text), as SGLang builds them:
// - GemmaForCausalLM (python/sglang/srt/models/gemma.py in
//   SGLang 0.5.23): no biases; head_dim from config.json
//   (256 for gemma-7b, whose q width 4096 is not hidden 3072); no lm_head module
//   (the logits use embed_tokens, and load_weights skips lm_head.weight); plain
//   RMSNorms whose weights load_weights raises by 1.0 (`loaded_weight += 1.0` for
//   every "norm.weight"): ferry's post-load hook adds 1 to each norm.
// - Gemma2ForCausalLM (gemma2.py (SGLang 0.5.23)): the
//   same plus pre_feedforward_layernorm and post_feedforward_layernorm per layer;
//   GemmaRMSNorm computes x * (1 + w) in the forward, so the weights load as stored;
//   qkv_proj / o_proj biases with attention_bias.
// - Gemma3ForCausalLM (gemma3_causal.py (SGLang 0.5.23)):
//   Gemma 2's layer plus per-head q_norm / k_norm (Gemma3RMSNorm(head_dim)); its
//   embedding is a torch nn.Embedding (Gemma3TextScaledWordEmbedding): whole and
//   unpadded on every rank; lm_head is the embedding, a checkpoint's lm_head.weight
//   is skipped.
// ferry does not split Gemma into pipeline stages (SGLang's Gemma models have no
// pipeline-parallel path either), and refuses attention data parallelism: SGLang
// 0.5.23's gemma.py, gemma2.py and gemma3_causal.py build nothing for it (no
// attention tp group, no use_attn_tp_group).
#include <cstring>
#include <vector>

#include "gpu/device.hpp"
#include "gpu/kernels_host.hpp"
#include "models/dense.hpp"

namespace ferry::models::families {
namespace {

DenseConfig gemma_config(const nlohmann::json& config, int version) {
  DenseConfig c = dense_config(config);
  // The output projection is always the embedding.
  c.tie_embeddings = true;
  c.pipeline_stages = false;
  c.drop_unused_biases = true;
  if (version >= 2) {
    c.qkv_bias = config_bool(config, "attention_bias", false);
    c.o_bias = c.qkv_bias;
    c.layer_norms.push_back("pre_feedforward_layernorm");
    c.layer_norms.push_back("post_feedforward_layernorm");
  }
  if (version == 3) {
    c.qk_norm = true;
    c.replicated_embedding = true;
  }
  return c;
}

// Gemma 1's load-time norm shift: every "...norm.weight" param becomes w + 1,
// computed in F32 and rounded once to the param's dtype (SGLang adds 1.0 to the
// checkpoint tensor in its dtype before the copy: the same bytes when the param
// dtype is the checkpoint's).
std::vector<PostLoadHook> norm_plus_one_hooks(const Model& model, const FamilyInput&) {
  std::vector<PostLoadHook> hooks;
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    const RankShell& shell = model.shells()[r];
    for (std::size_t i = 0; i < shell.params.size(); ++i) {
      const ParamSpec& p = shell.params[i];
      if (!p.name.ends_with("norm.weight")) {
        continue;
      }
      PostLoadHook h;
      h.name = "gemma_norm_plus_one:" + p.name + " (tp rank " + std::to_string(shell.tp_rank) +
               ")";
      h.local_rank = r;
      h.rewrites = {i};
      const DType dtype = p.dtype;
      const std::uint64_t count = p.nbytes / dtype_size(dtype);
      h.run = [i, dtype, count](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        std::vector<std::byte> raw(count * dtype_size(dtype));
        std::vector<float> values(count);
        stream.copy_d2h(raw.data(), ctx.param_data(i), raw.size());
        stream.synchronize();
        gpu::host::cast(reinterpret_cast<std::byte*>(values.data()), DType::kF32, raw.data(),
                        dtype, count);
        for (float& v : values) {
          v += 1.0f;
        }
        gpu::host::cast(raw.data(), dtype, reinterpret_cast<const std::byte*>(values.data()),
                        DType::kF32, count);
        stream.copy_h2d(ctx.param_data(i), raw.data(), raw.size());
        stream.synchronize();  // the host buffer dies with this call
      };
      hooks.push_back(std::move(h));
    }
  }
  return hooks;
}

FamilyDescriptor gemma(std::string architecture, std::string family, int version) {
  FamilyDescriptor d = dense_descriptor(
      std::move(architecture), std::move(family),
      [version](const nlohmann::json& config) { return gemma_config(config, version); });
  if (version == 1) {
    d.hooks.push_back(norm_plus_one_hooks);
  }
  return d;
}

}  // namespace

std::vector<FamilyDescriptor> gemma() {
  return {gemma("GemmaForCausalLM", "gemma", 1), gemma("Gemma2ForCausalLM", "gemma2", 2),
          gemma("Gemma3ForCausalLM", "gemma3", 3)};
}

}  // namespace ferry::models::families
