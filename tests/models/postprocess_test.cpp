// postprocess.target (models/postprocess.hpp): the params a model declares per
// target, as fixtures of what SGLang 0.5.23's process_weights_after_loading leaves
// (names, shapes, dtypes; each case cites the function), the hooks' order after the
// hooks that read weights as loaded, and the refusals, by name. The values the
// hooks write are checked through the pipeline (tests/runtime/postprocess_load_test).
#include "models/postprocess.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "models/hooks.hpp"
#include "models/model.hpp"
#include "models/quant.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using models::QuantScheme;
using ::testing::HasSubstr;
using Target = QuantScheme::Target;

const models::ParamSpec* find(const models::RankShell& shell, const std::string& name) {
  auto it = shell.by_name.find(name);
  return it == shell.by_name.end() ? nullptr : &shell.params[it->second];
}

// The param's dtype and shape, "F32 [4096, 1]", or "absent".
std::string spec(const models::RankShell& shell, const std::string& name) {
  const models::ParamSpec* p = find(shell, name);
  if (p == nullptr) {
    return "absent";
  }
  return std::string(dtype_name(p->dtype)) + " " + models::format_shape(p->shape) +
         (p->transient ? " transient" : "");
}

std::unique_ptr<models::Model> make(const nlohmann::json& config, Target target,
                                    models::ParallelLayout layout = {}) {
  models::ModelOptions o;
  o.target = target;
  return models::make_model(config, layout, o);
}

// Llama with per-tensor FP8 scales, static input scales, in the format given.
nlohmann::json llama_fp8_tensor(const std::string& format) {
  nlohmann::json c = synth::synth_config("llama", "tiny", DType::kBF16, false);
  if (format == "fp8") {
    c["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"}};
  } else if (format == "compressed-tensors") {
    c["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Tensor, 0);
  } else {
    c = models::with_hf_quant_config(c,
                                     synth::synth_hf_quant_config(synth::SynthQuant::kModelOptFp8));
  }
  return c;
}

std::string rows_1(const models::RankShell& shell, const std::string& weight) {
  return "F32 [" + std::to_string(find(shell, weight)->shape[0]) + ", 1]";
}

// Fp8LinearMethod.process_weights_after_loading (fp8.py), per-tensor checkpoint,
// cutlass_fp8_supported on sm90 and sm100: convert_to_channelwise; the static
// input_scale becomes input_scale.max().
TEST(Postprocess, Fp8PerTensorLinearExpandsScalesPerRow) {
  const nlohmann::json c = llama_fp8_tensor("fp8");
  const auto loader = make(c, Target::kLoader);
  const models::RankShell& l = loader->shells()[0];
  const std::string qkv = "model.layers.0.self_attn.qkv_proj.";
  const std::string o = "model.layers.0.self_attn.o_proj.";
  EXPECT_EQ(spec(l, qkv + "weight_scale"), "F32 [3]");
  EXPECT_EQ(spec(l, qkv + "input_scale"), "F32 [3]");
  EXPECT_EQ(spec(l, qkv + "weight_scale_loaded"), "absent");
  for (Target t : {Target::kSm90, Target::kSm100}) {
    SCOPED_TRACE(std::string(models::to_string(t)));
    const auto m = make(c, t);
    const models::RankShell& s = m->shells()[0];
    EXPECT_EQ(spec(s, qkv + "weight"), spec(l, qkv + "weight"));  // unchanged storage
    EXPECT_EQ(spec(s, qkv + "weight_scale"), rows_1(s, qkv + "weight"));
    EXPECT_EQ(spec(s, qkv + "weight_scale_loaded"), "F32 [3] transient");
    EXPECT_EQ(spec(s, qkv + "input_scale"), "F32 []");
    EXPECT_EQ(spec(s, qkv + "input_scale_loaded"), "F32 [3] transient");
    EXPECT_EQ(spec(s, o + "weight_scale"), rows_1(s, o + "weight"));
    EXPECT_EQ(spec(s, "model.layers.0.mlp.gate_up_proj.weight_scale"),
              rows_1(s, "model.layers.0.mlp.gate_up_proj.weight"));
    // Fp8Config gives every RadixAttention an Fp8KVCacheMethod: k_scale / v_scale,
    // which process_weights_after_loading sets to 1.0 when nothing loaded them.
    EXPECT_EQ(spec(l, "model.layers.0.self_attn.attn.k_scale"), "absent");
    EXPECT_EQ(spec(s, "model.layers.0.self_attn.attn.k_scale"), "F32 []");
    EXPECT_EQ(spec(s, "model.layers.0.self_attn.attn.v_scale"), "F32 []");
    // Not for a family whose SGLang attention takes no KV-cache method (Qwen3).
    nlohmann::json qwen3 = synth::synth_config("qwen3", "tiny", DType::kBF16, false);
    qwen3["quantization_config"] = c["quantization_config"];
    EXPECT_EQ(spec(make(qwen3, t)->shells()[0], "model.layers.0.self_attn.attn.k_scale"), "absent");
    // Every param the loader has, the twins and the KV scales.
    std::size_t twins = 0;
    std::size_t kv = 0;
    for (const models::ParamSpec& p : s.params) {
      if (p.transient) {
        ++twins;
      } else if (p.name.ends_with("attn.k_scale") || p.name.ends_with("attn.v_scale")) {
        ++kv;
      } else {
        EXPECT_NE(find(l, p.name), nullptr) << p.name;
      }
    }
    EXPECT_EQ(s.params.size(), l.params.size() + twins + kv);
    // One hook per weight scale, per input scale and per attention's KV scales;
    // validate_hooks accepts them.
    std::size_t pp = 0;
    for (const models::PostLoadHook& h : m->hooks()) {
      pp += h.name.rfind("postprocess_", 0) == 0 ? 1 : 0;
      EXPECT_TRUE(h.idempotent);
      EXPECT_FALSE(h.reallocates);
    }
    EXPECT_EQ(pp, twins + kv / 2);
  }
}

// CompressedTensorsW8A8Fp8.process_weights_after_loading (strategy tensor):
// requantize_with_max_scale leaves one scalar scale; input_scale.max().
// ModelOptFp8LinearMethod.process_weights_after_loading: the same, kept scalar where
// _can_use_flashinfer_bmm (K and N multiples of 16), else convert_to_channelwise.
TEST(Postprocess, CompressedTensorsAndModelOptRequantizeToOneScale) {
  for (const std::string format : {"compressed-tensors", "modelopt"}) {
    SCOPED_TRACE(format);
    nlohmann::json c = llama_fp8_tensor(format);
    const auto m = make(c, Target::kSm90);
    const models::RankShell& s = m->shells()[0];
    const std::string qkv = "model.layers.0.self_attn.qkv_proj.";
    EXPECT_EQ(spec(s, qkv + "weight_scale"), "F32 []");
    EXPECT_EQ(spec(s, qkv + "weight_scale_loaded"), "F32 [3] transient");
    EXPECT_EQ(spec(s, qkv + "input_scale"), "F32 []");
    bool rewrites = false;
    for (const models::PostLoadHook& h : m->hooks()) {
      if (h.name.find(qkv + "weight") != std::string::npos) {
        rewrites = h.rewrites == std::vector<std::size_t>{s.by_name.at(qkv + "weight")};
      }
    }
    EXPECT_TRUE(rewrites) << "the weight is requantized in place";
  }
  // ModelOpt with an intermediate size that is not a multiple of 16: gate_up_proj
  // (N = 2 x 36) and down_proj (K = 36) fall back to per-row scales.
  nlohmann::json c = llama_fp8_tensor("modelopt");
  c["intermediate_size"] = 36;
  const auto m = make(c, Target::kSm100);
  const models::RankShell& s = m->shells()[0];
  EXPECT_EQ(spec(s, "model.layers.0.mlp.gate_up_proj.weight_scale"), "F32 [72, 1]");
  EXPECT_EQ(spec(s, "model.layers.0.mlp.down_proj.weight_scale"),
            rows_1(s, "model.layers.0.mlp.down_proj.weight"));
  EXPECT_EQ(spec(s, "model.layers.0.self_attn.qkv_proj.weight_scale"), "F32 []");
}

// Fp8MoEMethod / CompressedTensorsW8A8Fp8MoEMethod / ModelOptFp8MoEMethod
// .process_weights_after_loading: w13_weight_scale.max(dim=1) with each expert's w1
// and w3 requantized to it; w13_input_scale / w2_input_scale .max(); w2 unchanged.
TEST(Postprocess, PerTensorExpertsTakeEachExpertsLargerScale) {
  nlohmann::json c = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  c["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Tensor, 0);
  const auto loader = make(c, Target::kLoader);
  const auto m = make(c, Target::kSm90);
  const models::RankShell& l = loader->shells()[0];
  const models::RankShell& s = m->shells()[0];
  const std::string e = "model.layers.0.mlp.experts.";
  const std::uint64_t experts = find(s, e + "w13_weight")->shape[0];
  const std::string per_expert = "F32 [" + std::to_string(experts) + "]";
  EXPECT_EQ(spec(l, e + "w13_weight_scale"), "F32 [" + std::to_string(experts) + ", 2]");
  EXPECT_EQ(spec(s, e + "w13_weight_scale"), per_expert);
  EXPECT_EQ(spec(s, e + "w13_weight_scale_loaded"),
            "F32 [" + std::to_string(experts) + ", 2] transient");
  EXPECT_EQ(spec(s, e + "w2_weight_scale"), spec(l, e + "w2_weight_scale"));
  EXPECT_EQ(spec(s, e + "w2_weight_scale_loaded"), "absent");
  EXPECT_EQ(spec(l, e + "w13_input_scale"), per_expert);
  EXPECT_EQ(spec(s, e + "w13_input_scale"), "F32 []");
  EXPECT_EQ(spec(s, e + "w2_input_scale"), "F32 []");
  EXPECT_EQ(spec(s, e + "w2_input_scale_loaded"), per_expert + " transient");
}

// Block FP8 (Fp8LinearMethod.process_weights_after_loading_block_quant,
// requant_block_scale_ue8m0_for_deepgemm, should_deepgemm_weight_requant_ue8m0):
// unchanged on sm90; on sm100 DeepGEMM's UE8M0 scales replace weight_scale_inv for
// BF16 models where N % 64 == 0 and K % 128 == 0; the experts only under DeepEP
// (Fp8MoEMethod.is_deepgemm_moe_runner_backend_enabled).
TEST(Postprocess, BlockFp8RepacksToUe8m0OnlyOnSm100WhereDeepGemmRuns) {
  nlohmann::json c = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  c["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 128);
  // Every slot whole 128 x 128 blocks: two heads of 128, one KV head.
  c["hidden_size"] = 256;
  c["num_attention_heads"] = 2;
  c["num_key_value_heads"] = 1;
  c["head_dim"] = 128;
  c["moe_intermediate_size"] = 128;
  c["intermediate_size"] = 128;
  const auto loader = make(c, Target::kLoader);
  const auto sm90 = make(c, Target::kSm90);
  const models::RankShell& l = loader->shells()[0];
  // sm90: every param as loaded, plus Fp8KVCacheMethod's k_scale / v_scale.
  for (const models::ParamSpec& p : l.params) {
    EXPECT_EQ(spec(sm90->shells()[0], p.name), spec(l, p.name));
  }
  for (const models::ParamSpec& p : sm90->shells()[0].params) {
    if (find(l, p.name) == nullptr) {
      EXPECT_TRUE(p.name.ends_with("attn.k_scale") || p.name.ends_with("attn.v_scale")) << p.name;
      EXPECT_EQ(spec(sm90->shells()[0], p.name), "F32 []");
    }
  }
  const auto sm100 = make(c, Target::kSm100);
  const models::RankShell& s = sm100->shells()[0];
  // Each FP8 weight: repacked (I32 weight_scale_inv, the F32 scales in a transient
  // twin) exactly where DeepGEMM runs it, by SGLang's shape rule written out here.
  std::size_t repacked = 0;
  std::size_t kept = 0;
  for (const models::ParamSpec& w : s.params) {
    if (w.dtype != DType::kF8E4M3) {
      continue;
    }
    const std::string base = w.name.substr(0, w.name.size() - std::string("weight").size());
    const std::uint64_t n = w.shape[w.shape.size() - 2];
    const std::uint64_t k = w.shape.back();
    const bool dense = w.shape.size() == 2;
    if (dense && n % 64 == 0 && k % 128 == 0) {
      ++repacked;
      models::Shape packed = w.shape;
      packed.back() = ((k + 127) / 128 + 3) / 4;
      EXPECT_EQ(spec(s, base + "weight_scale_inv"), "I32 " + models::format_shape(packed))
          << w.name;
      EXPECT_EQ(spec(s, base + "weight_scale_inv_f32"),
                "F32 " + models::format_shape({(n + 127) / 128, (k + 127) / 128}) + " transient");
    } else {
      ++kept;
      EXPECT_EQ(spec(s, base + "weight_scale_inv"), spec(l, base + "weight_scale_inv")) << w.name;
      EXPECT_EQ(spec(s, base + "weight_scale_inv_f32"), "absent") << w.name;
    }
  }
  EXPECT_GT(repacked, 0u);
  EXPECT_GT(kept, 0u);  // the experts
  const std::string o = "model.layers.0.self_attn.o_proj.";
  // The experts stay: SGLang's MoE runs DeepGEMM only under DeepEP (ferry places
  // DeepEP for DeepSeek only: DeepseekRepackWaitsForTheMlaSplit has them repacked).
  const std::string e = "model.layers.0.mlp.experts.";
  EXPECT_EQ(spec(s, e + "w13_weight_scale_inv"), spec(l, e + "w13_weight_scale_inv"));
  // An F16 model: DeepGEMM's linears need BF16 output, so nothing is repacked.
  c["torch_dtype"] = "float16";
  const auto f16 = make(c, Target::kSm100);
  EXPECT_EQ(spec(f16->shells()[0], o + "weight_scale_inv_f32"), "absent");
  EXPECT_THAT(spec(f16->shells()[0], o + "weight_scale_inv"), HasSubstr("F32 ["));
}

TEST(Postprocess, ShapesDeepGemmCannotRunKeepTheirScales) {
  QuantScheme q;
  q.method = QuantScheme::Method::kFp8Block;
  q.block_n = 128;
  q.block_k = 128;
  q.target = Target::kSm100;
  q.ue8m0_dense = true;
  EXPECT_TRUE(models::converts_ue8m0(q, {512, 256}));
  EXPECT_FALSE(models::converts_ue8m0(q, {96, 256}));      // N % 64
  EXPECT_FALSE(models::converts_ue8m0(q, {512, 192}));     // K % 128
  EXPECT_FALSE(models::converts_ue8m0(q, {4, 512, 256}));  // experts without DeepEP
  q.ue8m0_experts = true;
  EXPECT_TRUE(models::converts_ue8m0(q, {4, 512, 256}));
  q.target = Target::kSm90;
  EXPECT_FALSE(models::converts_ue8m0(q, {512, 256}));
  q.block_n = 64;
  q.target = Target::kSm100;
  EXPECT_FALSE(models::converts_ue8m0(q, {512, 256}));
}

// The MLA split reads kv_b_proj as loaded: SGLang's post_load_weights runs before
// process_weights_after_loading, so the repack of kv_b_proj waits for the split.
TEST(Postprocess, DeepseekRepackWaitsForTheMlaSplit) {
  nlohmann::json c = synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false);
  c["q_lora_rank"] = 128;
  c["kv_lora_rank"] = 128;
  c["moe_intermediate_size"] = 128;
  c["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 128);
  models::ParallelLayout deepep;
  deepep.moe_a2a = models::ParallelLayout::MoeA2a::kDeepep;
  const auto m = make(c, Target::kSm100, deepep);
  const models::RankShell& s = m->shells()[0];
  const std::string kv_b = "model.layers.1.self_attn.kv_b_proj.weight";
  std::size_t split_output = 0;
  for (const models::PostLoadHook& h : m->hooks()) {
    if (h.local_rank == 0 && h.name.find("mla") != std::string::npos &&
        std::count(h.inputs.begin(), h.inputs.end(), s.by_name.at(kv_b)) == 1) {
      split_output = h.outputs.front();
    }
  }
  ASSERT_NE(split_output, 0u);
  // Under DeepEP the experts are repacked too.
  EXPECT_THAT(spec(s, "model.layers.1.mlp.experts.w13_weight_scale_inv"), HasSubstr("I32 ["));
  EXPECT_THAT(spec(s, "model.layers.1.mlp.experts.w2_weight_scale_inv_f32"),
              HasSubstr("transient"));
  bool ordered = false;
  for (const models::PostLoadHook& h : m->hooks()) {
    if (h.local_rank == 0 && h.name.find("requant_ue8m0:" + kv_b) == 0) {
      ordered = std::count(h.inputs.begin(), h.inputs.end(), split_output) == 1;
    }
  }
  EXPECT_TRUE(ordered);
}

nlohmann::json nvfp4_config(const std::string& family) {
  return models::with_hf_quant_config(synth::synth_config(family, "tiny", DType::kBF16, false),
                                      synth::synth_hf_quant_config(synth::SynthQuant::kNvfp4));
}

// ModelOptFp4LinearMethod.process_weights_after_loading (modelopt_quant.py) with
// sm100's default FP4 GEMM backend, flashinfer_cutedsl in W4A4
// (fp4_utils.initialize_fp4_gemm_config): alpha and input_scale_inv scalars; the
// block scales swizzled (swizzle_blockscale's padding to 128 rows and 4 columns)
// over weight_scale where alias_or_bind_derived_param can broadcast them into it,
// else into a new weight_scale_interleaved; the weight, input_scale and
// weight_scale_2 as loaded. Llama tiny at tp 2: qkv_proj [96, 128] (scales [96, 8],
// swizzled [128, 8]), o_proj [128, 64] (scales [128, 4]), gate_up_proj [256, 128],
// down_proj [128, 128].
TEST(Postprocess, Nvfp4OnSm100SwizzlesTheBlockScalesAndAddsAlpha) {
  const nlohmann::json c = nvfp4_config("llama");
  models::ParallelLayout tp2;
  tp2.tp = 2;
  const auto loader = make(c, Target::kLoader, tp2);
  const auto m = make(c, Target::kSm100, tp2);
  const models::RankShell& l = loader->shells()[0];
  const models::RankShell& s = m->shells()[0];
  const std::string qkv = "model.layers.0.self_attn.qkv_proj.";
  const std::string o = "model.layers.0.self_attn.o_proj.";
  const std::string down = "model.layers.0.mlp.down_proj.";
  EXPECT_EQ(spec(l, qkv + "weight"), "U8 [96, 64]");
  EXPECT_EQ(spec(l, qkv + "weight_scale"), "F8_E4M3 [96, 8]");
  EXPECT_EQ(spec(l, qkv + "alpha"), "absent");
  EXPECT_EQ(spec(s, qkv + "weight"), "U8 [96, 64]");
  EXPECT_EQ(spec(s, qkv + "weight_scale"), "F8_E4M3 [96, 8]");  // as loaded
  EXPECT_EQ(spec(s, qkv + "weight_scale_interleaved"), "F8_E4M3 [128, 8]");
  EXPECT_EQ(spec(s, qkv + "weight_scale_loaded"), "absent");
  EXPECT_EQ(spec(s, qkv + "input_scale"), "F32 [3]");
  EXPECT_EQ(spec(s, qkv + "weight_scale_2"), "F32 [3]");
  EXPECT_EQ(spec(s, qkv + "alpha"), "F32 []");
  EXPECT_EQ(spec(s, qkv + "input_scale_inv"), "F32 []");
  EXPECT_EQ(spec(s, o + "weight_scale"), "F8_E4M3 [128, 4]");  // swizzled in place
  EXPECT_EQ(spec(s, o + "weight_scale_loaded"), "F8_E4M3 [128, 4] transient");
  EXPECT_EQ(spec(s, o + "weight_scale_interleaved"), "absent");
  EXPECT_EQ(spec(s, down + "weight_scale"), "F8_E4M3 [128, 8]");
  EXPECT_EQ(spec(s, down + "weight_scale_loaded"), "F8_E4M3 [128, 8] transient");
  // ModelOptFp4Config.from_config reads the missing kv_cache_quant_algo as "auto":
  // every attention gets a ModelOptFp8KVCacheMethod, k_scale / v_scale 1.0.
  EXPECT_EQ(spec(l, "model.layers.0.self_attn.attn.k_scale"), "absent");
  EXPECT_EQ(spec(s, "model.layers.0.self_attn.attn.k_scale"), "F32 []");
  EXPECT_EQ(spec(s, "model.layers.0.self_attn.attn.v_scale"), "F32 []");
  // Every loader param is kept; per linear: two scalars, and a twin or an
  // interleaved copy; per layer the KV scales. One swizzle hook and one alpha hook
  // per linear, one KV-scale hook per layer.
  std::size_t linears = 0;
  for (const models::ParamSpec& p : l.params) {
    EXPECT_NE(find(s, p.name), nullptr) << p.name;
    linears += p.dtype == DType::kU8 ? 1 : 0;
  }
  EXPECT_EQ(linears, 4u * 4);  // four layers of qkv, o, gate_up, down
  EXPECT_EQ(s.params.size(), l.params.size() + 3 * linears + 2 * 4);
  std::size_t swizzles = 0;
  std::size_t alphas = 0;
  std::size_t kv = 0;
  for (const models::PostLoadHook& h : m->hooks()) {
    if (h.local_rank != 0) {
      continue;
    }
    swizzles += h.name.find("weight_scale") != std::string::npos ? 1 : 0;
    alphas += h.name.find(".alpha") != std::string::npos ? 1 : 0;
    kv += h.name.find(".kv_scales") != std::string::npos ? 1 : 0;
    EXPECT_TRUE(h.idempotent) << h.name;
    EXPECT_FALSE(h.reallocates) << h.name;
  }
  EXPECT_EQ(swizzles, linears);
  EXPECT_EQ(alphas, linears);
  EXPECT_EQ(kv, 4u);
  // Nothing changes on the loader target.
  EXPECT_EQ(loader->hooks().size(), 0u);
}

// NVFP4 fused experts on sm100 where SGLang 0.5.23 leaves the global MoE runner at
// auto (Mixtral, Qwen2-MoE, DeepSeek-V2): ModelOptNvFp4FusedMoEMethod reads
// enable_flashinfer_trtllm_moe as false and its process_weights_after_loading takes
// the CUTLASS branch: swizzle_blockscale of each expert's block scales, over
// w13_weight_scale / w2_weight_scale where alias_or_bind_derived_param can (else
// into w13_blockscale_swizzled), and per expert g1_alphas, g1_alphas_up, g2_alphas
// and the input scales' reciprocals (_compute_gemm1_alphas). Mixtral tiny at tp 1:
// w13 [8, 256, 128] (scales [8, 256, 8]), w2 [8, 128, 128] (scales [8, 128, 8]).
TEST(Postprocess, Nvfp4ExpertsOnSm100SwizzleEachExpertsScales) {
  const nlohmann::json c = nvfp4_config("mixtral");
  const auto loader = make(c, Target::kLoader);
  const auto m = make(c, Target::kSm100);
  const models::RankShell& l = loader->shells()[0];
  const models::RankShell& s = m->shells()[0];
  const std::string e = "model.layers.0.block_sparse_moe.experts.";
  EXPECT_EQ(spec(s, e + "w13_weight"), "U8 [8, 256, 64]");
  EXPECT_EQ(spec(s, e + "w13_weight_scale"), "F8_E4M3 [8, 256, 8]");
  EXPECT_EQ(spec(s, e + "w13_weight_scale_loaded"), "F8_E4M3 [8, 256, 8] transient");
  EXPECT_EQ(spec(s, e + "w13_blockscale_swizzled"), "absent");  // an alias of the scale
  EXPECT_EQ(spec(s, e + "w2_weight_scale"), "F8_E4M3 [8, 128, 8]");
  EXPECT_EQ(spec(s, e + "w2_weight_scale_loaded"), "F8_E4M3 [8, 128, 8] transient");
  EXPECT_EQ(spec(s, e + "w13_weight_scale_2"), "F32 [8, 2]");
  EXPECT_EQ(spec(s, e + "w13_input_scale"), "F32 [8, 2]");
  EXPECT_EQ(spec(s, e + "w2_input_scale"), "F32 [8]");
  for (const std::string name : {"g1_alphas", "g1_alphas_up", "g2_alphas", "w13_input_scale_quant",
                                 "w2_input_scale_quant"}) {
    EXPECT_EQ(spec(s, e + name), "F32 [8]") << name;
    EXPECT_EQ(spec(l, e + name), "absent") << name;
  }
  EXPECT_EQ(spec(s, e + "g1_scale_c"), "absent");  // flashinfer_trtllm's only
  // Scales whose padded shape differs stay as loaded, the swizzled ones beside
  // them: hidden 192 makes w2's rows 192 (padded to 256); w13's K / 16 is 12.
  nlohmann::json narrow = c;
  narrow["hidden_size"] = 192;
  const auto narrow_model = make(narrow, Target::kSm100);
  const models::RankShell& n = narrow_model->shells()[0];
  EXPECT_EQ(spec(n, e + "w13_weight_scale"), "F8_E4M3 [8, 256, 12]");
  EXPECT_EQ(spec(n, e + "w13_blockscale_swizzled"), "absent");
  EXPECT_EQ(spec(n, e + "w2_weight_scale"), "F8_E4M3 [8, 192, 8]");
  EXPECT_EQ(spec(n, e + "w2_blockscale_swizzled"), "F8_E4M3 [8, 256, 8]");
  EXPECT_EQ(spec(n, e + "w2_weight_scale_loaded"), "absent");
  // A gated w13 whose rows would pad: SGLang asserts (tp 4 quarters I to 32).
  models::ParallelLayout tp4;
  tp4.tp = 4;
  EXPECT_NO_THROW(make(c, Target::kLoader, tp4));
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { make(c, Target::kSm100, tp4); }),
              HasSubstr("cannot pad a gated layer's w13 block scales to 128 rows"));
  // Expert parallelism: _compute_gemm1_alphas multiplies [E] by [E / ep].
  models::ParallelLayout ep2;
  ep2.tp = 2;
  ep2.ep = 2;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { make(c, Target::kSm100, ep2); }),
              HasSubstr("which fails for ep 2"));
  // Qwen3-MoE's runner is flashinfer_trtllm (model_overrides/qwen3_moe.py), so its
  // scales stay as loaded and are shuffled in place.
  const auto qwen = make(nvfp4_config("qwen3_moe"), Target::kSm100);
  EXPECT_EQ(spec(qwen->shells()[0], "model.layers.0.mlp.experts.w13_weight_scale_loaded"),
            "absent");
  EXPECT_EQ(spec(qwen->shells()[0], "model.layers.0.mlp.experts.g1_scale_c"), "F32 [8]");
  // Under expert parallelism the input scales hold every global expert on each rank
  // (_sglang_require_global_experts), the max's input; the alphas the local ones.
  for (Target t : {Target::kSm100, Target::kLoader}) {
    const auto sharded = make(nvfp4_config("qwen3_moe"), t, ep2);
    for (const models::RankShell& shell : sharded->shells()) {
      EXPECT_EQ(spec(shell, "model.layers.0.mlp.experts.w13_input_scale"), "F32 [8, 2]");
      EXPECT_EQ(spec(shell, "model.layers.0.mlp.experts.w2_input_scale"), "F32 [8]");
      EXPECT_EQ(spec(shell, "model.layers.0.mlp.experts.w13_weight_scale_2"), "F32 [4, 2]");
      EXPECT_EQ(spec(shell, "model.layers.0.mlp.experts.g1_scale_c"),
                t == Target::kSm100 ? "F32 [4]" : "absent");
    }
  }
}

// The DeepSeek family on sm100 without an all-to-all backend: SGLang 0.5.23's
// _deepseek_moe_quant_resolution makes the MoE runner flashinfer_trtllm.
// NVFP4 (ModelOptNvFp4FusedMoEMethod, align_fp4_moe_weights_for_flashinfer_trtllm):
// the experts' weights and block scales keep their shapes and dtypes (shuffled in
// place, hooks that rewrite them); one input scale for all experts, so
// w13_input_scale_quant and w2_input_scale_quant are F32 []; g1_scale_c [E].
// Block FP8 (Fp8MoEMethod): nothing is added; FusedMoE loads w3 first (tested
// through the pipeline). Others are refused, as are intermediate sizes SGLang pads.
TEST(Postprocess, DeepseekExpertsOnSm100AreFlashinferTrtllms) {
  nlohmann::json ds = nvfp4_config("deepseek_v3");
  ds["moe_intermediate_size"] = 64;
  ds["qk_rope_head_dim"] = 32;  // fused_qkv_a_proj's 128 rows: pad_nvfp4_weight leaves them
  const auto loader = make(ds, Target::kLoader);
  const auto m = make(ds, Target::kSm100);
  const models::RankShell& l = loader->shells()[0];
  const models::RankShell& s = m->shells()[0];
  const std::string e = "model.layers.1.mlp.experts.";
  for (const std::string name : {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale",
                                 "w13_weight_scale_2", "w13_input_scale", "w2_input_scale"}) {
    EXPECT_EQ(spec(s, e + name), spec(l, e + name)) << name;
  }
  EXPECT_EQ(spec(s, e + "w13_weight"), "U8 [8, 128, 64]");
  EXPECT_EQ(spec(s, e + "w13_weight_scale_loaded"), "absent");
  EXPECT_EQ(spec(s, e + "w13_blockscale_swizzled"), "absent");
  for (const std::string name : {"g1_alphas", "g1_alphas_up", "g2_alphas", "g1_scale_c"}) {
    EXPECT_EQ(spec(s, e + name), "F32 [8]") << name;
  }
  EXPECT_EQ(spec(s, e + "w13_input_scale_quant"), "F32 []");
  EXPECT_EQ(spec(s, e + "w2_input_scale_quant"), "F32 []");
  std::size_t rewrites = 0;
  for (const models::PostLoadHook& h : m->hooks()) {
    if (h.name.find("flashinfer_trtllm") != std::string::npos) {
      ++rewrites;
      EXPECT_TRUE(h.outputs.empty()) << h.name;
      EXPECT_EQ(h.rewrites.size(), 1u) << h.name;
    }
  }
  EXPECT_EQ(rewrites, 4u);  // w13, w2 and their scales, in tiny's one MoE layer
  // Under DeepEP the runner is not flashinfer_trtllm.
  models::ParallelLayout deepep;
  deepep.moe_a2a = models::ParallelLayout::MoeA2a::kDeepep;
  EXPECT_EQ(spec(make(ds, Target::kSm100, deepep)->shells()[0], e + "w13_input_scale_quant"),
            "F32 [8]");
  // flashinfer_trtllm pads an intermediate size a rank that is not a multiple of 64
  // (create_weights) and shards the padded size: 32 becomes 64, the rest zeros
  // (tests/runtime: the bytes of padded shares).
  nlohmann::json narrow = ds;
  narrow["moe_intermediate_size"] = 32;
  const auto padded = make(narrow, Target::kSm100);
  EXPECT_EQ(spec(padded->shells()[0], e + "w13_weight"), "U8 [8, 128, 64]");
  EXPECT_EQ(spec(padded->shells()[0], e + "w2_weight_scale"), "F8_E4M3 [8, 128, 4]");
  EXPECT_THAT(padded->notes(), ::testing::Contains(HasSubstr("padded from 32 to 64 rows")));
  EXPECT_EQ(spec(make(narrow, Target::kSm90)->shells()[0], e + "w13_weight_loaded"),
            "U8 [8, 64, 64] transient");  // Marlin's runner: not padded
  // Block FP8: the same shapes as the loader's, nothing added; 128 the alignment.
  nlohmann::json fp8 = synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false);
  fp8["q_lora_rank"] = 128;
  fp8["kv_lora_rank"] = 128;
  fp8["moe_intermediate_size"] = 128;
  fp8["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 128);
  const auto fp8_loader = make(fp8, Target::kLoader);
  const auto fp8_sm100 = make(fp8, Target::kSm100);
  const models::RankShell& fl = fp8_loader->shells()[0];
  const models::RankShell& fs = fp8_sm100->shells()[0];
  for (const std::string name : {"w13_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"}) {
    EXPECT_EQ(spec(fs, e + name), spec(fl, e + name)) << name;
  }
  EXPECT_EQ(spec(fs, e + "w13_weight_scale_inv"), "F32 [8, 2, 1]");
  fp8["moe_intermediate_size"] = 64;  // padded to 128 (FusedMoE), blocks of 32
  fp8["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 32);
  EXPECT_EQ(spec(make(fp8, Target::kSm100)->shells()[0], e + "w13_weight_scale_inv"),
            "F32 [8, 8, 4]");
  // Unquantized experts: flashinfer_trtllm's BF16 block layout (Bf16ExpertsOnSm100...);
  // under DeepEP as loaded.
  nlohmann::json bf16 = synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false);
  EXPECT_EQ(spec(make(bf16, Target::kSm100)->shells()[0], e + "w2_weight"), "BF16 [8, 2, 128, 64]");
  EXPECT_EQ(spec(make(bf16, Target::kSm100, deepep)->shells()[0], e + "w2_weight"),
            "BF16 [8, 128, 32]");
}

// UnquantizedFusedMoEMethod under flashinfer_trtllm (process_weights_after_loading,
// _apply_trtllm_bf16_block_layout): FusedMoE pads a rank's share of the intermediate
// size to 128 and loads w13 up rows first; each expert [N, K] is served as
// [K / 64, N, 64] (convert_to_block_layout of its bytes, blockK 128), laid out in place
// by one hook a weight (the bytes: tests/runtime/postprocess_load_test.cpp). SGLang
// can do neither an F16 or F32 model (it views the weights as BF16) nor a hidden size
// that is not a multiple of 64; ferry refuses both by name.
TEST(Postprocess, Bf16ExpertsOnSm100AreFlashinferTrtllmBlocks) {
  const std::string e = "model.layers.0.mlp.experts.";
  const nlohmann::json c = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  const auto loader = make(c, Target::kLoader);
  const auto sm100 = make(c, Target::kSm100);
  const models::RankShell& l = loader->shells()[0];
  const models::RankShell& s = sm100->shells()[0];
  EXPECT_EQ(spec(l, e + "w13_weight"), "BF16 [8, 128, 128]");
  EXPECT_EQ(spec(s, e + "w13_weight"), "BF16 [8, 2, 256, 64]");  // I 64 padded to 128
  EXPECT_EQ(spec(s, e + "w2_weight"), "BF16 [8, 2, 128, 64]");
  EXPECT_EQ(find(s, e + "w13_weight")->loaded_shape, (models::Shape{8, 256, 128}));
  EXPECT_EQ(find(s, e + "w2_weight")->loaded_shape, (models::Shape{8, 128, 128}));
  EXPECT_TRUE(find(l, e + "w13_weight")->loaded_shape.empty());
  // The pieces address the loaded shape: up's rows first in w13, gate's after the
  // padded 128; the padding zero-filled.
  io::TensorInfo up;
  up.name = "model.layers.0.mlp.experts.3.up_proj.weight";
  up.dtype = DType::kBF16;
  up.shape = {64, 128};
  up.nbytes = 64 * 128 * 2;
  const models::Route route = sm100->route(up);
  ASSERT_EQ(route.pieces.size(), 1u);
  EXPECT_EQ(route.pieces[0].dst_offset, 3u * 256 * 128 * 2);
  io::TensorInfo gate = up;
  gate.name = "model.layers.0.mlp.experts.3.gate_proj.weight";
  EXPECT_EQ(sm100->route(gate).pieces[0].dst_offset, 3u * 256 * 128 * 2 + 128 * 128 * 2);
  std::size_t hooks = 0;
  for (const models::PostLoadHook& h : sm100->hooks()) {
    hooks += h.name.find("(flashinfer_trtllm)") != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(hooks, 2u * 4);  // w13 and w2 of tiny's four MoE layers
  EXPECT_EQ(spec(make(c, Target::kSm90)->shells()[0], e + "w13_weight"), "BF16 [8, 128, 128]");
  // Refused: an F16 model, quantization.online's FP8, a hidden size not a multiple of 64.
  const nlohmann::json f16 = synth::synth_config("qwen3_moe", "tiny", DType::kF16, false);
  EXPECT_THAT(error_of(Stage::kConfig, [&] { make(f16, Target::kSm100); }),
              HasSubstr("views them as BF16"));
  models::ModelOptions online;
  online.target = Target::kSm100;
  online.online = models::QuantScheme::Online::kTensor;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(c, {}, online); }),
              HasSubstr("not for quantization.online's FP8 experts"));
  nlohmann::json hidden = c;
  hidden["hidden_size"] = 96;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { make(hidden, Target::kSm100); }),
              HasSubstr("the hidden size must be a multiple of 64"));
}

// Which models SGLang 0.5.23 serves with flashinfer_trtllm on sm100 (no all-to-all
// backend): the DeepSeek family (overrides.py _deepseek_moe_quant_resolution),
// Qwen3-MoE and GLM-4 MoE (model_overrides/qwen3_moe.py, glm4_moe.py), by the
// quantization the overrides see: config.json's quant_method, none for a ModelOpt
// hf_quant_config.json. Under it SGLang disables shared-expert fusion.
TEST(Postprocess, Sm100MoeRunnerFollowsSGLangsOverrides) {
  auto trtllm = [](const nlohmann::json& c, models::ParallelLayout layout = {}) {
    models::ModelOptions o;
    o.target = Target::kSm100;
    const auto m = models::make_model(c, layout, o);
    return m->shells()[0].by_name.count("model.layers.1.mlp.experts.g1_scale_c") != 0;
  };
  // GLM-4 MoE NVFP4 (hf_quant_config.json): flashinfer_trtllm; Mixtral: auto.
  EXPECT_TRUE(trtllm(nvfp4_config("glm4_moe")));
  EXPECT_TRUE(trtllm(nvfp4_config("qwen3_moe")));
  EXPECT_FALSE(trtllm(nvfp4_config("qwen2_moe")));
  // config.json's own quant_method: "modelopt_fp4" takes it, "modelopt" does not.
  nlohmann::json flat = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  flat["quantization_config"] = {
      {"quant_method", "modelopt_fp4"}, {"quant_algo", "NVFP4"}, {"group_size", 16}};
  EXPECT_TRUE(trtllm(flat));
  flat["quantization_config"]["quant_method"] = "modelopt";
  EXPECT_FALSE(trtllm(flat));
  // Block FP8 Qwen3-MoE: w13 loaded up rows first; its block scales alike.
  nlohmann::json fp8 = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  fp8["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 32);
  EXPECT_EQ(spec(make(fp8, Target::kSm100)->shells()[0], "model.layers.0.mlp.experts.w13_weight"),
            "F8_E4M3 [8, 256, 128]");  // intermediate 64 padded to 128
  EXPECT_EQ(spec(make(fp8, Target::kSm90)->shells()[0], "model.layers.0.mlp.experts.w13_weight"),
            "F8_E4M3 [8, 128, 128]");
  // A hidden size flashinfer_trtllm's NVFP4 shuffles cannot take is refused.
  nlohmann::json hidden = nvfp4_config("qwen3_moe");
  hidden["hidden_size"] = 192;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { make(hidden, Target::kSm100); }),
              HasSubstr("need the hidden size to be a multiple of 128"));
  // Per-tensor FP8 experts (ModelOpt's hf_quant_config.json; quant_method fp8 with
  // static activations) under it: align_fp8_moe_weights_for_flashinfer_trtllm's
  // shapes, the intermediate padded to 128, one scale an expert, scalar input scales
  // and three F32 [E] output scales (values: Fp8TensorExpertsOnSm100AreFlashinferTrtllms).
  // Unquantized experts are served too (Bf16ExpertsOnSm100AreFlashinferTrtllmBlocks).
  const nlohmann::json modelopt_fp8 =
      models::with_hf_quant_config(synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false),
                                   synth::synth_hf_quant_config(synth::SynthQuant::kModelOptFp8));
  nlohmann::json static_fp8 = synth::synth_config("qwen3_moe", "tiny", DType::kBF16, false);
  static_fp8["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"}};
  for (const nlohmann::json& c : {modelopt_fp8, static_fp8}) {
    const models::RankShell s = make(c, Target::kSm100)->shells()[0];
    const std::string ex = "model.layers.0.mlp.experts.";
    EXPECT_EQ(spec(s, ex + "w13_weight"), "F8_E4M3 [8, 256, 128]");
    EXPECT_EQ(spec(s, ex + "w2_weight"), "F8_E4M3 [8, 128, 128]");
    EXPECT_EQ(spec(s, ex + "w13_weight_scale"), "F32 [8]");
    EXPECT_EQ(spec(s, ex + "w2_weight_scale"), "F32 [8]");
    EXPECT_EQ(spec(s, ex + "w13_input_scale"), "F32 []");
    EXPECT_EQ(spec(s, ex + "w2_input_scale"), "F32 []");
    for (const std::string name :
         {"output1_scales_scalar", "output1_scales_gate_scalar", "output2_scales_scalar"}) {
      EXPECT_EQ(spec(s, ex + name), "F32 [8]") << name;
    }
    EXPECT_EQ(find(make(c, Target::kSm90)->shells()[0], ex + "output2_scales_scalar"), nullptr);
  }
  // Refused under it: dynamic activations (SGLang asserts the input scales), and a
  // hidden size its row shuffle cannot take.
  nlohmann::json dynamic_fp8 = static_fp8;
  dynamic_fp8["quantization_config"]["activation_scheme"] = "dynamic";
  EXPECT_THAT(error_of(Stage::kConfig, [&] { make(dynamic_fp8, Target::kSm100); }),
              HasSubstr("per-tensor FP8 experts need static input scales"));
  nlohmann::json narrow = static_fp8;
  narrow["hidden_size"] = 144;
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { make(narrow, Target::kSm100); }),
              HasSubstr("the hidden size must be a multiple of 32"));
  for (const std::string family : {"qwen3_moe", "glm4_moe", "deepseek_v3", "mixtral"}) {
    const nlohmann::json bf16 = synth::synth_config(family, "tiny", DType::kBF16, false);
    const models::RankShell s = make(bf16, Target::kSm100)->shells()[0];
    const std::string w2 = (family == "mixtral"     ? "model.layers.0.block_sparse_moe"
                            : family == "qwen3_moe" ? "model.layers.0.mlp"
                                                    : "model.layers.1.mlp") +
                           std::string(".experts.w2_weight");
    ASSERT_NE(find(s, w2), nullptr) << w2;
    EXPECT_EQ(find(s, w2)->shape.size(), family == "mixtral" ? 3u : 4u) << family;
  }
  // DeepSeek-V3-shaped (256 routed experts, one shared): fused on sm90, not under
  // flashinfer_trtllm; model.fuse_shared_experts=true is refused there.
  nlohmann::json v3 = nvfp4_config("deepseek_v3");
  v3["n_routed_experts"] = 256;
  v3["moe_intermediate_size"] = 64;
  v3["qk_rope_head_dim"] = 32;
  models::ParallelLayout tp2;
  tp2.tp = 2;
  EXPECT_EQ(
      spec(make(v3, Target::kSm90)->shells()[0], "model.layers.1.mlp.experts.w13_input_scale"),
      "F32 [257, 2]");
  const auto unfused = make(v3, Target::kSm100);
  EXPECT_EQ(spec(unfused->shells()[0], "model.layers.1.mlp.experts.w13_weight"),
            "U8 [256, 128, 64]");
  models::ModelOptions fuse;
  fuse.target = Target::kSm100;
  fuse.fuse_shared_experts = true;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(v3, {}, fuse); }),
              HasSubstr("disables shared-expert fusion under the flashinfer_trtllm MoE runner"));
}

// ModelOptFp4LinearMethod.process_weights_after_loading's marlin branch (the default
// FP4 GEMM backend below sm100) and prepare_nvfp4_layer_for_marlin
// (marlin_utils_fp4.py): the weight I32 [K'/16, 2N'] (gptq_marlin_repack), the scales
// E4M3 [K'/16, N'], weight_global_scale [1] in the model dtype, input_global_scale,
// alpha and input_scale_inv F32 []; the checkpoint's weight and scales load into
// transient twins. (N', K'): the smaller of (N to 64, K to 128) and (N to 128, K to
// 64): qkv_proj [96, 128] at tp 2 pads to [128, 128]; o_proj [128, 64] stays.
TEST(Postprocess, Nvfp4OnSm90IsMarlinsLayout) {
  EXPECT_EQ(models::marlin_padded_shape({96, 128}), (models::Shape{128, 128}));
  EXPECT_EQ(models::marlin_padded_shape({128, 64}), (models::Shape{128, 64}));
  EXPECT_EQ(models::marlin_padded_shape({64, 64}), (models::Shape{64, 128}));  // tie: the first
  EXPECT_EQ(models::marlin_padded_shape({7168, 2048}), (models::Shape{7168, 2048}));
  const nlohmann::json c = nvfp4_config("llama");
  models::ParallelLayout tp2;
  tp2.tp = 2;
  const auto loader = make(c, Target::kLoader, tp2);
  const auto m = make(c, Target::kSm90, tp2);
  const models::RankShell& l = loader->shells()[0];
  const models::RankShell& s = m->shells()[0];
  const std::string qkv = "model.layers.0.self_attn.qkv_proj.";
  const std::string o = "model.layers.0.self_attn.o_proj.";
  EXPECT_EQ(spec(s, qkv + "weight"), "I32 [8, 256]");
  EXPECT_EQ(spec(s, qkv + "weight_loaded"), "U8 [96, 64] transient");
  EXPECT_EQ(spec(s, qkv + "weight_scale"), "F8_E4M3 [8, 128]");
  EXPECT_EQ(spec(s, qkv + "weight_scale_loaded"), "F8_E4M3 [96, 8] transient");
  EXPECT_EQ(spec(s, qkv + "weight_global_scale"), "BF16 [1]");
  EXPECT_EQ(spec(s, qkv + "input_global_scale"), "F32 []");
  EXPECT_EQ(spec(s, qkv + "alpha"), "F32 []");
  EXPECT_EQ(spec(s, qkv + "input_scale_inv"), "F32 []");
  EXPECT_EQ(spec(s, qkv + "input_scale"), "F32 [3]");
  EXPECT_EQ(spec(s, qkv + "weight_scale_2"), "F32 [3]");
  EXPECT_EQ(spec(s, qkv + "weight_scale_interleaved"), "absent");
  EXPECT_EQ(spec(s, o + "weight"), "I32 [4, 256]");
  EXPECT_EQ(spec(s, o + "weight_scale"), "F8_E4M3 [4, 128]");
  // Every loader param kept; six more per linear (two twins, four scalars) and the
  // KV scales (as on sm100); three hooks per linear (the weight, the scales, the
  // scalars), one per layer for the KV scales.
  std::size_t linears = 0;
  for (const models::ParamSpec& p : l.params) {
    EXPECT_NE(find(s, p.name), nullptr) << p.name;
    linears += p.dtype == DType::kU8 ? 1 : 0;
  }
  EXPECT_EQ(s.params.size(), l.params.size() + 6 * linears + 2 * 4);
  std::size_t hooks = 0;
  for (const models::PostLoadHook& h : m->hooks()) {
    hooks += h.local_rank == 0 ? 1 : 0;
    EXPECT_TRUE(h.idempotent) << h.name;
  }
  EXPECT_EQ(hooks, 3 * linears + 4);
  // Fused experts (ModelOptNvFp4FusedMoEMethod's Marlin branch, then
  // prepare_moe_nvfp4_layer_for_marlin): Qwen3-MoE tiny at tp 2, w13 [8, 64, 128],
  // w2 [8, 128, 32]; input scales as loaded.
  const auto moe = make(nvfp4_config("qwen3_moe"), Target::kSm90, tp2);
  const models::RankShell& e = moe->shells()[0];
  const std::string experts = "model.layers.0.mlp.experts.";
  EXPECT_EQ(spec(e, experts + "w13_weight"), "I32 [8, 8, 128]");
  EXPECT_EQ(spec(e, experts + "w13_weight_loaded"), "U8 [8, 64, 64] transient");
  EXPECT_EQ(spec(e, experts + "w13_weight_scale"), "F8_E4M3 [8, 8, 64]");
  EXPECT_EQ(spec(e, experts + "w13_weight_scale_loaded"), "F8_E4M3 [8, 64, 8] transient");
  EXPECT_EQ(spec(e, experts + "w13_weight_scale_2"), "BF16 [8]");
  EXPECT_EQ(spec(e, experts + "w13_weight_scale_2_loaded"), "F32 [8, 2] transient");
  EXPECT_EQ(spec(e, experts + "w13_input_scale"), "F32 [8, 2]");
  EXPECT_EQ(spec(e, experts + "w2_weight"), "I32 [8, 2, 256]");
  EXPECT_EQ(spec(e, experts + "w2_weight_scale"), "F8_E4M3 [8, 2, 128]");
  EXPECT_EQ(spec(e, experts + "w2_weight_scale_2"), "BF16 [8]");
  EXPECT_EQ(spec(e, experts + "w2_weight_scale_2_loaded"), "F32 [8] transient");
  EXPECT_EQ(spec(e, experts + "w2_input_scale"), "F32 [8]");
  EXPECT_EQ(spec(e, experts + "w13_alpha"), "absent");
  // A bias (Qwen2's qkv_proj at tp 2: [96], padded to 128) loads into its twin and
  // is served padded (marlin_permute_bias), by one more hook.
  const auto qwen2 = make(nvfp4_config("qwen2"), Target::kSm90, tp2);
  const models::RankShell& q2 = qwen2->shells()[0];
  EXPECT_EQ(spec(q2, qkv + "bias"), "BF16 [128]");
  EXPECT_EQ(spec(q2, qkv + "bias_loaded"), "BF16 [96] transient");
  EXPECT_EQ(spec(q2, o + "bias"), "absent");
  std::size_t bias_hooks = 0;
  for (const models::PostLoadHook& h : qwen2->hooks()) {
    bias_hooks += h.name.find("qkv_proj.bias") != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(bias_hooks, 4u * 2);  // four layers, two local ranks
  // F16 models get their global scale in F16.
  nlohmann::json f16 = c;
  f16["torch_dtype"] = "float16";
  EXPECT_EQ(spec(make(f16, Target::kSm90)->shells()[0], qkv + "weight_global_scale"), "F16 [1]");
}

TEST(Postprocess, RefusalsNameTheTargetAndWhy) {
  // NVFP4: on Hopper what SGLang's Marlin refuses, a bias and experts it cannot
  // tile; on Blackwell a weight SGLang pads (fused experts: the tests above).
  const nlohmann::json nvfp4 = nvfp4_config("llama");
  EXPECT_NO_THROW(make(nvfp4, Target::kSm90));
  EXPECT_NO_THROW(make(nvfp4, Target::kSm100));
  EXPECT_NO_THROW(make(nvfp4, Target::kLoader));
  EXPECT_NO_THROW(make(nvfp4_config("qwen3_moe"), Target::kSm100));
  models::ModelOptions f32;  // model.dtype=float32 (auto makes a float32 config BF16)
  f32.target = Target::kSm90;
  f32.dtype = DType::kF32;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(nvfp4, {}, f32); }),
              HasSubstr("requires an FP16 or BF16 model (prepare_nvfp4_layer_for_marlin); this "
                        "one is F32"));
  nlohmann::json hf_quant = synth::synth_hf_quant_config(synth::SynthQuant::kNvfp4);
  hf_quant["quantization"]["group_size"] = 32;
  const nlohmann::json group32 = models::with_hf_quant_config(
      synth::synth_config("llama", "tiny", DType::kBF16, false), hf_quant);
  EXPECT_NO_THROW(make(group32, Target::kLoader));
  EXPECT_THAT(error_of(Stage::kConfig, [&] { make(group32, Target::kSm90); }),
              HasSubstr("requires group_size 16 (prepare_nvfp4_layer_for_marlin); this "
                        "checkpoint's is 32"));
  EXPECT_NO_THROW(make(nvfp4_config("qwen2"), Target::kSm100));
  nlohmann::json narrow_experts = nvfp4_config("qwen3_moe");
  narrow_experts["moe_intermediate_size"] = 48;  // w13's N at tp 1: 96
  EXPECT_NO_THROW(make(narrow_experts, Target::kLoader));
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { make(narrow_experts, Target::kSm90); }),
              HasSubstr("gptq_marlin_repack needs N % 64 == 0 and K % 16 == 0"));
  // down_proj's K 48, not a multiple of 32: pad_nvfp4_weight pads it to 64 on sm100
  // (the checkpoint's [N, 24] bytes load into a transient twin); gate_up's 96 rows stay.
  nlohmann::json narrow = nvfp4;
  narrow["intermediate_size"] = 48;
  const models::RankShell padded = make(narrow, Target::kSm100)->shells()[0];
  const std::string mlp = "model.layers.0.mlp.";
  const std::uint64_t hidden = narrow["hidden_size"].get<std::uint64_t>();
  EXPECT_EQ(spec(padded, mlp + "down_proj.weight"), "U8 [" + std::to_string(hidden) + ", 32]");
  EXPECT_EQ(spec(padded, mlp + "down_proj.weight_loaded"),
            "U8 [" + std::to_string(hidden) + ", 24] transient");
  EXPECT_EQ(find(padded, mlp + "gate_up_proj.weight_loaded"), nullptr);
  EXPECT_EQ(spec(make(narrow, Target::kLoader)->shells()[0], mlp + "down_proj.weight"),
            "U8 [" + std::to_string(hidden) + ", 24]");
  // DeepSeek-V3's experts on sm100 without DeepEP: flashinfer_trtllm, which ferry
  // does not lay out for quantization.online's FP8 experts.
  nlohmann::json ds = synth::synth_config("deepseek_v3", "tiny", DType::kBF16, false);
  ds["q_lora_rank"] = 128;
  ds["kv_lora_rank"] = 128;
  ds["moe_intermediate_size"] = 128;
  models::ModelOptions online;
  online.target = Target::kSm100;
  online.online = QuantScheme::Online::kTensor;
  const std::string online_error =
      error_of(Stage::kConfig, [&] { models::make_model(ds, {}, online); });
  EXPECT_THAT(online_error, HasSubstr("flashinfer_trtllm MoE runner on sm100"));
  EXPECT_THAT(online_error, HasSubstr("not for quantization.online's FP8 experts"));
  ds["quantization_config"] = synth::synth_quant_config(synth::SynthQuant::kFp8Block, 128);
  EXPECT_NO_THROW(make(ds, Target::kSm90));
  // With quantization.requant.
  models::ModelOptions o;
  o.target = Target::kSm90;
  o.requant = QuantScheme::Requant::kUe8m0;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { models::make_model(ds, {}, o); }),
              HasSubstr("quantization.requant converts scales by hand"));
  // Spellings.
  EXPECT_EQ(models::parse_target("sm90"), Target::kSm90);
  EXPECT_EQ(models::parse_target("sm100"), Target::kSm100);
  EXPECT_EQ(models::parse_target("loader"), Target::kLoader);
  EXPECT_EQ(models::parse_target("auto"), std::nullopt);
  EXPECT_EQ(models::parse_target("SM90"), std::nullopt);
}

// Unquantized checkpoints and the loader target: nothing changes.
TEST(Postprocess, UnquantizedModelsAreTheSameOnEveryTarget) {
  const nlohmann::json c = synth::synth_config("qwen3", "tiny", DType::kBF16, false);
  const auto l = make(c, Target::kLoader);
  for (Target t : {Target::kSm90, Target::kSm100}) {
    const auto m = make(c, t);
    ASSERT_EQ(m->shells()[0].params.size(), l->shells()[0].params.size());
    for (const models::ParamSpec& p : l->shells()[0].params) {
      EXPECT_EQ(spec(m->shells()[0], p.name), spec(l->shells()[0], p.name));
    }
    EXPECT_EQ(m->hooks().size(), l->hooks().size());
  }
}

}  // namespace
}  // namespace ferry::testing
