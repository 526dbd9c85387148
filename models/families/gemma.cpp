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
#include <optional>
#include <string>
#include <vector>

#include "common/error.hpp"
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
  c.norms_through_f32 = version == 1;
  return c;
}

// Gemma 1's load-time norm shift, as SGLang 0.5.23's GemmaForCausalLM.load_weights
// does it (`loaded_weight += 1.0` on the checkpoint tensor, then the param's
// weight_loader copies it): the sum is rounded in the checkpoint's dtype, then cast
// to the param's. The norm loads into an F32 twin "<name>_loaded" (exact for BF16,
// F16 and F32 tensors; DenseConfig::norms_through_f32), and the hook computes
// param = cast(round_C(x + 1)) with C the dtype config.json declares for the
// checkpoint (F32 when none: the sum rounded once). A checkpoint whose tensors are
// stored in another dtype than it declares rounds as if they were not.
std::vector<PostLoadHook> norm_plus_one_hooks(const Model& model, const FamilyInput& in) {
  std::vector<PostLoadHook> hooks;
  const DType ckpt = declared_dtype(in.config).value_or(DType::kF32);
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    const RankShell& shell = model.shells()[r];
    for (std::size_t i = 0; i < shell.params.size(); ++i) {
      const ParamSpec& p = shell.params[i];
      if (!p.name.ends_with("norm.weight") || p.transient) {
        continue;
      }
      auto twin = shell.by_name.find(p.name + "_loaded");
      if (twin == shell.by_name.end() || shell.params[twin->second].dtype != DType::kF32 ||
          shell.params[twin->second].shape != p.shape) {
        throw Error(Stage::kPostProcess, "", p.name,
                    "Gemma norm + 1: no F32 " + format_shape(p.shape) + " parameter " + p.name +
                        "_loaded to compute it from");
      }
      PostLoadHook h;
      h.name = "gemma_norm_plus_one:" + p.name + " (tp rank " + std::to_string(shell.tp_rank) +
               ")";
      h.local_rank = r;
      const std::size_t src = twin->second;
      h.inputs = {src};
      h.outputs = {i};
      const DType dtype = p.dtype;
      const std::uint64_t count = p.nbytes / dtype_size(dtype);
      h.run = [i, src, dtype, ckpt, count](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        std::vector<float> values(count);
        stream.copy_d2h(reinterpret_cast<std::byte*>(values.data()), ctx.param_data(src),
                        count * sizeof(float));
        stream.synchronize();
        for (float& v : values) {
          v += 1.0f;
        }
        // Rounded in the checkpoint's dtype, then cast to the param's.
        std::vector<std::byte> rounded(count * dtype_size(ckpt));
        gpu::host::cast(rounded.data(), ckpt, reinterpret_cast<const std::byte*>(values.data()),
                        DType::kF32, count);
        gpu::host::cast(reinterpret_cast<std::byte*>(values.data()), DType::kF32, rounded.data(),
                        ckpt, count);
        std::vector<std::byte> out(count * dtype_size(dtype));
        gpu::host::cast(out.data(), dtype, reinterpret_cast<const std::byte*>(values.data()),
                        DType::kF32, count);
        stream.copy_h2d(ctx.param_data(i), out.data(), out.size());
        stream.synchronize();  // the host buffers die with this call
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
